"""Measured timeline and liveness of one worker.

`Recorder` times compute and communication spans of one rank into `TimelineEvent`s
(the simulator's schema): `time.perf_counter` on CPU, CUDA events on GPU (resolved
at the end of each step, relative to an event recorded right after the step's clock
origin). Times are seconds from the rank's clock origin, taken just after a barrier
that all ranks leave together, so merging ranks needs no further alignment beyond
the barrier's exit skew (tens of microseconds on loopback gloo).

On an emulated cluster a compute span of a slower GPU kind is stretched on CPU by
sleeping (slowdown - 1) x its own compute time (communication nested inside it, e.g.
a tensor-parallel all-reduce, is not stretched). An injected slow rank (`--inject slow:...`)
multiplies that factor at the steps it applies to. With `compute_floor_s` (sleep-padded
compute, `plait run --compute-sleep S`), a forward span lasts at least S and a backward 2 S
before the factors apply: the rank's timing is then set by sleeping, not by how the CPUs are
shared, so a slowed rank is not lost in CPU contention when many ranks share few cores.

`Heartbeat` publishes the rank's progress to a small JSON file that the launcher
watches: a rank that stops making progress while *not* waiting on a collective is
the one that hangs; ranks blocked in collectives only wait for it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from plait.ir.timeline import TimelineEvent
from plait.runtime.emulate import extra_time

# Phases in which a rank pauses training on purpose (a checkpoint write, a restart's checkpoint
# load, an evaluation): entering and leaving one is marked in RUN_DIR/pause/rankN.jsonl, so the
# doctor does not read the pause as a stall (plait.doctor.detect.past_stalls, stall). A wait for
# the user's data loader is marked the same way (`Heartbeat.pause("data")`), without a phase
# change: the doctor does not count it as the step's local work (a rank waiting for its data
# is not a slow rank) nor as a stall.
PAUSE_PHASES = ("checkpoint", "resume", "eval")
DATA_PAUSE = "data"
PAUSES_KIND = "plait.pauses"
PAUSES_VERSION = 1


class Heartbeat:
    """Progress of one rank, written to `path` every `interval` s by a daemon thread. Entering and
    leaving a `PAUSE_PHASES` phase appends a marker line to `pauses` (default: the run folder's
    ``pause/rankN.jsonl`` beside ``hb/``): ``{"what": phase, "step": s, "begin": t}`` then
    ``{"what": phase, "step": s, "end": t}`` (Unix time), after a header line
    ``{"format_version": 1, "kind": "plait.pauses", "rank": r}``."""

    def __init__(self, path: Path, rank: int, interval: float = 0.2, pauses: Path | None = None) -> None:
        self.path = path
        self.pauses = pauses if pauses is not None else path.parent.parent / "pause" / f"rank{rank}.jsonl"
        self.state: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "phase": "start", "step": -1,
                                      "waiting": None, "progress": time.time(), "beats": 0}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interval = interval
        self._write()
        self._thread = threading.Thread(target=self._loop, name="plait-heartbeat", daemon=True)
        self._thread.start()

    def progress(self, phase: str | None = None, step: int | None = None) -> None:
        with self._lock:
            before = self.state["phase"]
            changed = (phase is not None and phase != before) or \
                      (step is not None and step != self.state["step"])
            if phase is not None:
                self.state["phase"] = phase
            if step is not None:
                self.state["step"] = step
            self.state["progress"] = now = time.time()
            at = self.state["step"]
        if phase is not None and phase != before:
            if before in PAUSE_PHASES:
                self._mark({"what": before, "step": at, "end": now})
            if phase in PAUSE_PHASES:
                self._mark({"what": phase, "step": at, "begin": now})
        if changed:  # the launcher names the step and phase of a rank that dies: publish them now
            try:
                self._write()
            except OSError:
                pass

    @contextmanager
    def pause(self, what: str = DATA_PAUSE) -> Iterator[None]:
        """Mark the block as a pause on purpose (begin and end markers, as a `PAUSE_PHASES` phase
        gets) without changing the heartbeat's phase: a wait for the data loader."""
        with self._lock:
            at = self.state["step"]
        self._mark({"what": what, "step": at, "begin": time.time()})
        try:
            yield
        finally:
            self._mark({"what": what, "step": at, "end": time.time()})

    def _mark(self, line: dict[str, Any]) -> None:
        """Append one pause marker (the file and its header on the first)."""
        try:
            new = not self.pauses.exists()
            self.pauses.parent.mkdir(parents=True, exist_ok=True)
            with open(self.pauses, "a") as fh:
                if new:
                    fh.write(json.dumps({"format_version": PAUSES_VERSION, "kind": PAUSES_KIND,
                                         "rank": self.state["rank"]}) + "\n")
                fh.write(json.dumps(line) + "\n")
        except OSError:
            pass  # a marker is evidence for the doctor; training never stops for it

    def waiting(self, what: str | None) -> None:
        """Mark the rank as blocked on a collective (`what`) or running again (None)."""
        with self._lock:
            self.state["waiting"] = what
            self.state["progress"] = time.time()

    def _write(self) -> None:
        with self._lock:
            self.state["beats"] += 1
            data = json.dumps(self.state)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(data)
        os.replace(tmp, self.path)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._write()
            except OSError:
                pass

    def close(self, phase: str = "done") -> None:
        self.progress(phase)
        self._stop.set()
        self._thread.join(timeout=2)
        try:
            self._write()
        except OSError:
            pass


_FLOOR_WEIGHT = {"forward": 1.0, "backward": 2.0}  # sleep-padded compute: backward ~ 2 x forward


class Recorder:
    """Spans of one rank. `device` is the cluster device id (the timeline resource `dev{device}`)."""

    def __init__(self, device: int, stage: int, rank: int, cuda: bool = False, slowdown: float = 1.0,
                 heartbeat: Heartbeat | None = None, inject_factor: Callable[[int | None], float] | None = None,
                 compute_floor_s: float = 0.0) -> None:
        self.device = device
        self.stage = stage
        self.rank = rank
        self.cuda = cuda
        self.slowdown = slowdown if not cuda else 1.0  # stretching by sleep only emulates CPU ranks
        self.heartbeat = heartbeat
        self.events: list[TimelineEvent] = []
        self.origin = time.perf_counter()
        self.step: int | None = None
        self._pending: list[tuple[TimelineEvent, Any, Any]] = []  # CUDA events awaiting resolution
        self._base_event: Any = None
        self._base_time = 0.0
        self._comm_inside: list[float] = []  # stack: comm seconds nested in open compute spans
        self.enabled = True
        self.inject_factor = inject_factor  # step -> injected compute slowdown (plait.runtime.inject)
        self.compute_floor_s = compute_floor_s

    # -------------------------------------------------------------- clock
    def now(self) -> float:
        return time.perf_counter() - self.origin

    def set_origin(self) -> None:
        """Clock origin: call right after a barrier all ranks leave together."""
        if self.cuda:
            torch.cuda.synchronize()
        self.origin = time.perf_counter()

    def begin_step(self, step: int) -> float:
        self.step = step
        if self.cuda:
            torch.cuda.synchronize()
            self._base_event = torch.cuda.Event(enable_timing=True)
            self._base_event.record()
            self._base_time = self.now()
        return self.now()

    def end_step(self) -> float:
        if self.cuda:
            # Kernels (and NCCL collectives) run asynchronously: a rank blocks here when a peer hangs.
            if self.heartbeat is not None:
                self.heartbeat.waiting("cuda synchronize (end of step)")
            torch.cuda.synchronize()
            if self.heartbeat is not None:
                self.heartbeat.waiting(None)
            for ev, start, end in self._pending:
                ev.start = self._base_time + self._base_event.elapsed_time(start) / 1e3
                ev.end = self._base_time + self._base_event.elapsed_time(end) / 1e3
            self._pending.clear()
        return self.now()

    # -------------------------------------------------------------- spans
    def _event(self, name: str, category: str, kind: str, micro_batch: int | None, args: dict[str, Any],
               chunk: int | None = None) -> TimelineEvent:
        args = dict(args)
        args.setdefault("rank", self.rank)
        if self.step is not None:
            args.setdefault("step", self.step)
        return TimelineEvent(name=name, category=category, resource=f"dev{self.device}/{kind}", start=0.0,
                             end=0.0, device=self.device, stage=self.stage, micro_batch=micro_batch, args=args,
                             chunk=chunk)

    @contextmanager
    def compute(self, name: str, category: str, micro_batch: int | None = None, chunk: int | None = None,
                **args: Any) -> Iterator[None]:
        if self.heartbeat is not None:
            self.heartbeat.progress()
        self._comm_inside.append(0.0)
        ev = self._event(name, category, "compute", micro_batch, args, chunk)
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._comm_inside.pop()
                self._pending.append((ev, start, end))
                self.events.append(ev)
            return
        t0 = self.now()
        c0 = time.thread_time()
        try:
            yield
        finally:
            comm = self._comm_inside.pop()
            t1 = self.now()
            cpu = ev.args["cpu_s"] = time.thread_time() - c0  # this thread's CPU in the span: wall less what others took
            factor = self.slowdown * (self.inject_factor(self.step) if self.inject_factor is not None else 1.0)
            floor = self.compute_floor_s * _FLOOR_WEIGHT.get(category, 0.0)
            if factor > 1.0 or floor > 0.0:
                # Emulated slower GPU kind (or injected slow rank): the same work takes `factor` times
                # longer; sleep-padded compute first lifts the work to its floor. The work is the span
                # less its blocking calls, and never more than this thread's CPU time in it: a wait
                # inside the span that is no call of ours -- DDP's backward waiting at its end for
                # the gradient all-reduces its hooks started -- is not compute and is not stretched
                # (it was: the emulated slow rank of a data-parallel plan slept 1.4 x its all-reduce).
                # With one intra-op thread (plait run's ranks on a CPU each) this thread does all of
                # the span's compute; with more, its CPU time is a part of it and the wall is kept.
                work = max(0.0, t1 - t0 - comm)
                if torch.get_num_threads() == 1:
                    work = min(work, cpu)
                base = max(work, floor)
                time.sleep(base - work + extra_time(base, factor))
                t1 = self.now()
                ev.args["compute_s"] = work  # measured before the stretch
            ev.start, ev.end = t0, t1
            if comm:
                ev.args["comm_inside"] = comm
            self.events.append(ev)
            if self.heartbeat is not None:
                self.heartbeat.progress()

    @contextmanager
    def comm(self, name: str, category: str, micro_batch: int | None = None, chunk: int | None = None,
             **args: Any) -> Iterator[None]:
        """A blocking communication: the rank waits on its peers inside it (opened by the facade,
        `plait.runtime.comm`, around each call)."""
        if self.heartbeat is not None:
            self.heartbeat.waiting(name)
        ev = self._event(name, category, "comm", micro_batch, args, chunk)
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._pending.append((ev, start, end))
                self.events.append(ev)
                if self.heartbeat is not None:
                    self.heartbeat.waiting(None)
            return
        t0 = self.now()
        try:
            yield
        finally:
            t1 = self.now()
            ev.start, ev.end = t0, t1
            if self._comm_inside:
                self._comm_inside[-1] += t1 - t0
            self.events.append(ev)
            if self.heartbeat is not None:
                self.heartbeat.waiting(None)

    def comm_span(self, name: str, category: str, t_start: float, t_end: float, **args: Any) -> None:
        """An asynchronous call's span (perf_counter times), written when it completed: on the comm
        resource beside the compute it overlapped, which it is not subtracted from."""
        ev = self._event(name, category, "comm", None, args)
        ev.start, ev.end = t_start - self.origin, t_end - self.origin
        self.events.append(ev)

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Blocking synchronisation that is not part of the measured iteration (barriers)."""
        if self.heartbeat is not None:
            self.heartbeat.waiting(what)
        try:
            yield
        finally:
            if self.heartbeat is not None:
                self.heartbeat.waiting(None)
