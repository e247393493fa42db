"""How a search uses the machine: independent work on several CPU cores (fork-started worker
processes), and no pauses of the cyclic garbage collector.

A planner's phases are many independent, deterministic pure-Python evaluations (the memory
estimate of each configuration family, the simulation of each finalist, the annealed placement of
each shape); threads do not run them in parallel (the GIL), processes do. Workers are forked, so
they start with everything the parent has built (the model graph, the cluster, the cost caches)
and only the items and the results cross a pipe. Every result is what the same call gives in the
parent (the caches are memos), so a parallel search returns the same plans, to the bit, as a
serial one (tests/test_workers.py).

Forking is POSIX-only and a forked child must not touch torch's thread pools or CUDA; the work
sent here is numpy and Python only. Where fork is not available (or `jobs` is 1) everything runs
in the parent, in order.

`paused_gc` turns CPython's cyclic collector off for a search: lowering and simulating a
1024-GPU plan allocates millions of small acyclic objects (freed by reference counting), and the
collector's full passes over them cost a quarter of the simulation's time (bench/plan_search_time.py: its baseline runs with
`PAUSE_GC` off).

`jobs` defaults to the CPUs this process may run on (``os.sched_getaffinity``), at most
`MAX_DEFAULT_JOBS`; the environment variable ``PLAIT_JOBS`` overrides it (1 turns workers off).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import multiprocessing
import multiprocessing.util
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from plait.errors import PlaitError

MAX_DEFAULT_JOBS = 8
PAUSE_GC = True  # `paused_gc` pauses the collector (False: a no-op, for a benchmark's baseline)

# The functions of the open pools, by key: a forked worker finds its pool's function here (set
# before the fork), so closures run without being pickled.
_FUNCTIONS: dict[int, Callable[[Any], Any]] = {}
_KEYS = itertools.count()


class WorkersError(PlaitError):
    """A bad `jobs` value (PLAIT_JOBS or --jobs)."""


def can_fork() -> bool:
    """Whether worker processes can be forked here: on Linux (fork is safe for numpy-only work),
    and not from a daemonic process (a multiprocessing pool's worker may not have children)."""
    return (sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()
            and not multiprocessing.current_process().daemon)


def default_jobs() -> int:
    """``PLAIT_JOBS`` when set, else this process's usable CPUs (at most MAX_DEFAULT_JOBS)."""
    env = os.environ.get("PLAIT_JOBS", "").strip()
    if env:
        return check_jobs(env, "environment variable PLAIT_JOBS")
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_JOBS, cpus))


def check_jobs(value: Any, where: str = "jobs") -> int:
    """`value` as a worker count >= 1, or a clear error naming `where`."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise WorkersError(f"{where}: {value!r} is not a whole number of worker processes") from None
    if n < 1:
        raise WorkersError(f"{where}: needs at least 1 worker process, got {n}")
    return n


def resolve_jobs(jobs: int | None) -> int:
    return default_jobs() if jobs is None else check_jobs(jobs)


def cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have ended (a search's workers are
    joined before it returns): what a search costs, wherever it ran."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _run(key: int, item: Any) -> Any:
    return _FUNCTIONS[key](item)


class Workers:
    """`fn(item)` on up to `jobs` forked processes (in the parent, in order, when `jobs` is 1 or
    fork is unavailable). Use as a context manager; `submit` gives a future, `map` the results in
    the items' order."""

    def __init__(self, fn: Callable[[Any], Any], jobs: int | None = None) -> None:
        self.fn = fn
        self.jobs = resolve_jobs(jobs)
        self.key = next(_KEYS)
        self._pool: ProcessPoolExecutor | None = None
        if self.jobs > 1 and can_fork():
            _FUNCTIONS[self.key] = fn
            self._pool = ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("fork"))

    @property
    def parallel(self) -> bool:
        return self._pool is not None

    def submit(self, item: Any) -> Future:
        if self._pool is not None:
            return self._pool.submit(_run, self.key, item)
        fut: Future = Future()
        try:
            fut.set_result(self.fn(item))
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller by .result()
            fut.set_exception(exc)
        return fut

    def map(self, items: Iterable[Any], on_each: Callable[[int, Any], None] | None = None) -> list[Any]:
        """Results in the order of `items`; `on_each(index, result)` as each arrives in that order."""
        futures = [self.submit(x) for x in items]
        out = []
        for i, f in enumerate(futures):
            out.append(f.result())
            if on_each is not None:
                on_each(i, out[-1])
        return out

    def close(self, wait: bool = True) -> None:
        """Cancel what has not started; `wait`: also wait for what has (else it ends on its own)."""
        if self._pool is not None:
            manager = getattr(self._pool, "_executor_manager_thread", None)
            self._pool.shutdown(wait=wait, cancel_futures=True)
            if not wait and manager is not None and multiprocessing.parent_process() is not None:
                # A forked child exits through multiprocessing's exit function: it closes the
                # pool's call queue (its finalizer, priority 10), then joins every child process,
                # never the executor's manager thread. The manager's stop messages to the idle
                # workers, sent once their running items end, came after that close and were lost:
                # the child waited for its workers forever (bench/plan_search_time.py --nodes 16
                # hung 8 minutes). Its exit now first waits for the manager (priority 20).
                multiprocessing.util.Finalize(None, manager.join, exitpriority=20)
            self._pool = None
        _FUNCTIONS.pop(self.key, None)

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def map_parallel(fn: Callable[[Any], Any], items: list[Any], jobs: int | None = None,
                 on_each: Callable[[int, Any], None] | None = None) -> list[Any]:
    """`[fn(x) for x in items]` on up to `jobs` forked workers (never more than there are items)."""
    n = min(resolve_jobs(jobs), len(items))
    with Workers(fn, max(1, n)) as pool:
        return pool.map(items, on_each)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector off inside the block (as it was, after): reference counting
    still frees everything acyclic at once; cycles left are collected afterwards."""
    was = gc.isenabled()
    if PAUSE_GC:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
