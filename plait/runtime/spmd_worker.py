"""One rank of an SPMD plan (`Plan.spmd`): the program of `plait.runtime.spmd_program` trained step by step.

Started by the worker entry (`plait.runtime.entry`: the same launcher, run folder, heartbeats,
records and result file, `plait.runtime.results`, as the pipeline worker) when the plan holds an
SPMD program. Each rank builds the model with the run's seed, captures its `AtenGraph` at the
plan's global batch (the op names the plan's strategies refer to), checks the program against it,
keeps its shards of the parameters, and per step runs the whole global batch through the program
(every rank reads the same samples; inputs are sliced for free), computes the loss on the gathered
outputs and steps its optimizer on its shards. Compute between two collectives is one
`Recorder.compute` span, so an emulated slower GPU kind is slowed where its compute happens.

With `clip_grad` the optimizer step clips the global gradient norm over every rank's shards, and
checkpoints (`checkpoint.every`, `resume_from`) hold the logical parameters and optimizer state
(`plait.runtime.spmd_state`): a resume may run the program at other ratios, or another plan.

Before training, ranks may time gloo's all-gather at a few sizes (`records.spmd_calibrate`): the
alpha-beta figures of this machine's links that `plait plan --family spmd --run` predicts with;
with them, every rank times the whole (unsharded) program side by side with the others, before
and after the measured steps (`whole_program_seconds`): each rank's own compute speed, taken by
the processes that train, at the time they train (one-rank timings taken by another process
before or after the run were 2-3x off the ranks' compute when other work shared the CPUs).
"""

from __future__ import annotations

import copy
import os
import resource
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait.graph.aten_capture import capture_on_meta
from plait.graph.aten_stage import batch_loss_output
from plait.graph.sharding import strategies as op_strategies
from plait.ir.aten_graph import AtenGraph
from plait.runtime.amp import autocast_for, reduce_dtype
from plait.runtime.comm import Comm, CommLog, NullGroup
from plait.runtime.data_parallel import make_optimizer
from plait.runtime.lr import LRSchedule
from plait.runtime.partition import build_seeded, load_model_spec, make_samples
from plait.runtime.rank_config import RankConfig
from plait.runtime.recorder import Recorder
from plait.runtime.results import comm_records_path, common_origin, write_result
from plait.runtime.sharded_state import aliases_of
from plait.runtime.spmd_program import (
    CompiledProgram,
    RankProgram,
    Spans,
    compile_program,
    whole_parameters,
)
from plait.runtime.spmd_state import (
    ProgramCheckpoints,
    SpmdStep,
    checkpoint_layout,
    make_clipper,
    persistent_buffers,
)

CALIBRATION_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)  # bytes per rank of the timed all-gathers


def whole_program_seconds(graph: Any, module: torch.nn.Module, loss_fn: Any, inputs: Any, target: torch.Tensor,
                          optimizer: dict[str, Any], repeats: int = 3, threads: int | None = None
                          ) -> dict[str, float]:
    """Median seconds, over `repeats` passes after one warm-up, of the whole program (every op
    unsharded, one rank, on `threads` threads: None keeps this process's, as a rank's) on `inputs`:
    "program" (forward + backward of the aten ops through the interpreter, its own overhead
    included), "loss" (forward + backward of the loss on the whole outputs) and "optimizer" (one
    step over every parameter); each also as this thread's CPU seconds ("program_cpu", ...):
    what the part costs with a CPU to itself, whatever else shares the machine. `module` is read
    (parameters cloned) and its buffers may be updated: pass a copy."""
    whole = {op.name: op_strategies(op, graph, 1)[0] for op in graph.ops}
    runner = RankProgram(compile_program(graph, whole, [1.0], 1), 0)
    leaves = runner.load(module)
    opt = make_optimizer(leaves, {**optimizer, "lr": 1e-6})
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    rows = []

    def clocks() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    try:
        for _ in range(repeats + 1):
            t0 = clocks()
            outs = runner.forward(inputs)
            t1 = clocks()
            held = [o.detach().requires_grad_() for o in outs]
            loss_fn(held[0] if len(held) == 1 else tuple(held), target).backward()
            t2 = clocks()
            torch.autograd.backward(outs, [h.grad for h in held])
            t3 = clocks()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t4 = clocks()
            rows.append([(t1[c] - t0[c]) + (t3[c] - t2[c]) for c in (0, 1)] + [t2[c] - t1[c] for c in (0, 1)]
                        + [t4[c] - t3[c] for c in (0, 1)])
    finally:
        torch.set_num_threads(before)
    names = ("program", "program_cpu", "loss", "loss_cpu", "optimizer", "optimizer_cpu")
    return {k: statistics.median(c) for k, c in zip(names, zip(*rows[1:]))}


def _in_precision(dtype: str | None, fn: Any) -> Any:
    """`fn()` with the ops autocast to `dtype` (the steps' precision, so the calibration times what
    the steps compute)."""
    with autocast_for(dtype):
        return fn()


PROGRAM_REPEATS = 5  # timed passes of the whole program per calibration (after one warm-up)


def own_program_seconds(program: Any, rank: int, module: torch.nn.Module, inputs: Any, keep: frozenset[str],
                        repeats: int = PROGRAM_REPEATS) -> dict[str, float]:
    """Median seconds of this rank's own program (its shards, its conversions' local work) alone:
    its collectives on a `NullGroup` (this rank's result shape, no peers, no transfer); forward +
    backward, wall ("own") and this thread's CPU ("own_cpu"). `module`: pass a copy."""
    runner = RankProgram(program, rank, NullGroup(program.world, rank), Spans(None))
    runner.load(module)
    rows = []
    for _ in range(repeats + 1):
        t0, c0 = time.perf_counter(), time.thread_time()
        outs = runner.forward(inputs, keep)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        rows.append((time.perf_counter() - t0, time.thread_time() - c0))
    wall, cpu = zip(*rows[1:])
    return {"own": statistics.median(wall), "own_cpu": statistics.median(cpu)}


def program_timings(model: torch.nn.Module, spec: Any, graph: Any, batch: int, samples: Any,
                    optimizer: dict[str, Any]) -> dict[str, Any]:
    """`whole_program_seconds` at the global `batch` (`graph`, the program's capture) on a copy of
    `model`; `samples(count)` gives (inputs, target)."""
    return {"batch": batch, **whole_program_seconds(graph, copy.deepcopy(model), spec.loss, *samples(batch),
                                                    optimizer, repeats=PROGRAM_REPEATS)}


@dataclass
class _RankState:
    """What one rank's steps run with, built before them (`SpmdWorker._build`)."""

    spec: Any  # the model spec (its `loss`)
    batch: int  # the plan's global batch: every rank runs all of it
    graph: AtenGraph
    runner: RankProgram
    spans: Spans
    fetch: Callable[[int], Any]  # step -> (inputs, target) of the whole global batch
    batch_loss: str | None  # an output left in batch shards (each rank's loss on its rows), else None
    keep: frozenset[str]
    leaves: list[torch.nn.Parameter]
    aliases: dict[str, str]
    buffers: dict[str, torch.Tensor]
    timed: Callable[[], dict[str, float]] | None  # the calibration's timings of the whole program, or None


class SpmdWorker(ProgramCheckpoints, RankConfig):
    """One rank of a whole-model SPMD program (module docstring)."""

    def run(self) -> None:
        config = self.config
        group = self._init_comm()
        state = self._build(group)
        stepper = self._make_stepper(state, group)
        start = self._maybe_resume()
        ck = config.checkpoint
        calibration = self._calibrate(group, state.timed) if state.timed is not None else None

        steps = config.steps
        self.comm.barrier("startup barrier")
        self.rec.set_origin()
        origin = common_origin(self.rec, self.comm)
        losses: list[torch.Tensor] = []
        bounds: list[tuple[int, float, float]] = []
        for step in range(start, steps):
            loss, t0, t1 = self._train_step(state, stepper, group, step, steps, config.lr_schedule)
            bounds.append((step, t0, t1))
            losses.append(loss.detach().clone())
            if ck is not None and ck.every and (step + 1) % ck.every == 0:
                self._save_checkpoint(step + 1, Path(ck.dir))

        if state.timed is not None and calibration is not None:  # the same timings after the steps
            calibration["program_s_after"] = self._time_whole(state.timed)
        self._finish(state, group, losses, bounds, start, steps, origin, calibration)

    def _init_comm(self) -> Any:
        """The rank's recorder and communication facade; returns the world group."""
        config = self.config
        self.rec = Recorder(self.info.device, 0, self.rank, cuda=False, slowdown=self.info.slowdown, heartbeat=self.hb)
        self.hb.progress("init")
        log = CommLog(comm_records_path(self.run_dir, self.rank), self.rank, self.world) \
            if config.records.comm_records else None
        self.comm = Comm(self.rank, self.world, rec=self.rec, log=log, faults=config.faults.link_faults())
        return self.comm.init_process_group(config.backend, timeout_s=config.collective_timeout)

    def _build(self, group: Any) -> _RankState:
        """The seeded model captured and compiled into the plan's program; this rank's shards of it loaded."""
        config, plan = self.config, self.plan
        self.hb.progress("build")
        spec = load_model_spec(config.model)
        seed = config.seed
        model = build_seeded(spec, seed)
        batch = plan.global_batch
        data_seed = config.data_seed
        fetch = self._data(spec, batch, data_seed)
        graph = capture_on_meta(spec, batch)  # as the planner captured it (the meta device)
        program = self._compile(graph)
        spans = Spans(self.rec)
        runner = RankProgram(program, self.rank, group, spans, seed=seed)
        runner.grad_dtype = reduce_dtype(plan, config.dtype)  # parameter gradients reduced in the plan's dtype
        # an output left in batch shards is not gathered: each rank's loss on its rows (as the
        # composed worker's last stage; the search and the simulator price no gather for it)
        batch_loss = batch_loss_output(graph, program.strategies) if len(graph.outputs) == 1 else None
        keep = frozenset([batch_loss]) if batch_loss else frozenset()
        leaves = runner.load(model)
        aliases, buffers = aliases_of(model), persistent_buffers(model)
        timing = copy.deepcopy(model) if config.records.spmd_calibrate else None  # the whole program's, side by side
        del model
        timed = (lambda: _in_precision(config.dtype, lambda: {
            **program_timings(timing, spec, graph, batch, lambda k: make_samples(spec, 0, k, data_seed),
                              config.optimizer),
            **own_program_seconds(program, self.rank, copy.deepcopy(timing), fetch(0)[0], keep)})
                 ) if timing is not None else None
        return _RankState(spec, batch, graph, runner, spans, fetch, batch_loss, keep, leaves, aliases, buffers, timed)

    def _compile(self, graph: AtenGraph) -> CompiledProgram:
        """The plan's program checked against `graph`, its ratios rounded to shard sizes."""
        names = [f"gpu {r.device} ({r.kind or 'cpu'}, rank {r.rank})" for r in self.config.ranks]
        spmd = self.plan.spmd
        assert spmd is not None  # entry: only a plan with a program reaches this worker
        return compile_program(graph, spmd.strategies, spmd.ratio_array(), self.world, devices=names,
                               collective=spmd.collectives, homes=spmd.homes)

    def _make_stepper(self, state: _RankState, group: Any) -> SpmdStep:
        """The optimizer step over this rank's shards (clipped and loss-scaled when the run asks), and
        the checkpoint layout that saves and resumes them."""
        config = self.config
        opt = make_optimizer(state.leaves, config.optimizer)
        stepper = SpmdStep(state.leaves, opt)
        if config.clip_grad:
            stepper.clip = make_clipper(state.runner, self.world, config.clip_grad, group)
        stepper.scaler = self.loss_scaling(group)
        self.layout = checkpoint_layout(state.runner, stepper, state.aliases, state.buffers, self.rank)
        return stepper

    def _train_step(self, state: _RankState, stepper: SpmdStep, group: Any, step: int, steps: int,
                    schedule: LRSchedule | None) -> tuple[torch.Tensor, float, float]:
        """One step over the whole global batch (forward, loss, backward, optimizer): its loss and bounds."""
        config, runner, spans = self.config, state.runner, state.spans
        self.hb.progress("train", step)
        inputs, target = state.fetch(step)
        self.rec.step = step
        if config.step_barrier:
            self.comm.barrier("step barrier")
        t0 = self.rec.begin_step(step)
        runner.step = step
        spans.begin("forward")
        with autocast_for(config.dtype):  # fp32 master leaves, ops in the plan's precision
            outs = runner.forward(inputs, state.keep)
            if state.batch_loss:  # this rank's rows, weighted by their share of the batch; never gathered
                first, rows = runner.rows(state.batch_loss, 0)
                loss = state.spec.loss(outs[0], target.narrow(0, first, rows)) * (rows / state.batch)
            else:
                loss = state.spec.loss(outs[0] if len(outs) == 1 else tuple(outs), target)
        spans.begin("backward")
        if stepper.scaler is not None:
            self.scales.append(stepper.scaler.scale)
            (loss * stepper.scaler.scale).backward()
        else:
            loss.backward()
        spans.end()
        if state.batch_loss and self.world > 1:  # the step's loss: the shards' losses summed
            loss = loss.detach().clone()
            group.all_reduce(loss, "allreduce loss", "comm_spmd")
        with self.rec.compute("optimizer", "optimizer"):
            if schedule is not None:
                for g in stepper.optimizer.param_groups:
                    g["lr"] = schedule.at(step, steps)
            stepper.step()  # unscaled and clipped first when the run asks (`plait.runtime.spmd_state`)
        if stepper.scaler is not None:
            stepper.scaler.update(step)
        t1 = self.rec.end_step()
        return loss, t0, t1

    def _finish(self, state: _RankState, group: Any, losses: list[torch.Tensor],
                bounds: list[tuple[int, float, float]], start: int, steps: int, origin: Any,
                calibration: dict[str, Any] | None) -> None:
        """Every rank's record gathered on rank 0, which writes the run's result."""
        self.hb.progress("gather")
        runner, leaves = state.runner, state.leaves
        params = None
        if self.config.records.return_params:
            params = whole_parameters(runner, lambda x, sizes, d: group.all_gather_uneven(
                x, sizes, d, "gather parameters", "comm_spmd"))
        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        mine = {
            "rank": self.rank, "pp": 0, "dp": 0, "tp": 0, "device": self.info.device, "host": self.info.host,
            "node": self.info.node, "kind": self.info.kind, "slowdown": self.rec.slowdown,
            "pid": os.getpid(), "hostname": socket.gethostname(), "layers": state.graph.layers,
            "params": sum(p.numel() for p in leaves), "param_bytes": sum(p.numel() * p.element_size() for p in leaves),
            "peak_memory_bytes": peak, "memory_kind": "max_rss", "samples_per_step": state.batch,
            "events": [asdict(e) for e in self.rec.events], "step_bounds": bounds,
            "losses": torch.stack(losses).tolist() if losses else [],
            "params_state": params if self.rank == 0 else None, "shard_infos": {}, "clock": origin, "amp": self.amp_record(start),
            "spmd": {"moves": runner.moves, "calibration": calibration},
        }
        gathered = self.comm.gather_object(mine, dst=0, name="gather results")
        if self.rank == 0:
            assert gathered is not None
            write_result(self.run_dir, self.plan, gathered, start, steps, self.config.records.return_params)
        self.comm.barrier("final barrier")
        self.comm.close()

    def _data(self, spec: Any, batch: int, data_seed: int) -> Any:
        """step -> (inputs, target) of the whole global batch: the model's samples, or the user's data."""
        data = self.config.data
        # `sample_base`: a resume continues with the sample after the checkpoint's last
        if data is None:
            return lambda step: make_samples(spec, self.sample_base + step * batch, batch, data_seed)
        from plait.runtime import data as user_data

        dataset, collate = user_data.load_data(data.spec)
        order = user_data.SampleOrder(len(dataset), data_seed)

        def fetch(step: int) -> Any:
            with self.hb.pause():  # a wait for the user's data is not the step's work (plait.runtime.recorder)
                return user_data.samples(dataset, collate, order, self.sample_base + step * batch, batch)
        return fetch

    def _time_whole(self, timed: Any) -> list[dict[str, float]]:
        """`timed()` (`whole_program_seconds`) on every rank at once, after a barrier; every rank's
        figures, by rank. Not recorded: no step's events or records."""
        self.hb.progress("calibrate")
        recording, self.comm.recording = self.comm.recording, False
        kept = len(self.rec.events)
        try:
            self.comm.barrier("calibration barrier")
            mine = timed()
            return self.comm.all_gather_object(mine, "calibration timings")
        finally:
            self.comm.recording = recording
            del self.rec.events[kept:]

    def _calibrate(self, group: Any, timed: Any, repeats: int = 5) -> dict[str, Any]:
        """Median (and least) seconds of a padded all-gather of each of `CALIBRATION_SIZES` bytes per
        rank on the world group (the ranks' links as gloo drives them), outside the measured steps; and
        every rank's `whole_program_seconds` (`timed`), taken side by side."""
        rows, least = [], []
        recording, self.comm.recording = self.comm.recording, False
        for nbytes in CALIBRATION_SIZES:
            x = torch.zeros(nbytes // 4)
            sizes = [x.shape[0]] * self.world
            times = []
            for _ in range(repeats):
                self.comm.barrier("calibration barrier")
                t0 = time.perf_counter()
                group.all_gather_uneven(x, sizes, 0, "calibrate all_gather", "calibration")
                times.append(time.perf_counter() - t0)
            rows.append([nbytes * self.world, float(np.median(times))])
            least.append([nbytes * self.world, float(np.min(times))])
        program = self._time_whole(timed)
        self.comm.recording = recording
        self.rec.events.clear()  # not part of any step
        return {"all_gather": rows, "all_gather_min": least, "program_s": program}
