"""`plait.workers`: fork-started workers give what the parent gives, in order; bad job counts
are refused by name; the collector pause restores the collector. The searches run with workers
are checked to the bit in tests/test_search_exact.py."""

import gc
import os

import pytest

from plait.errors import PlaitError
from plait.workers import Workers, can_fork, check_jobs, default_jobs, map_parallel, paused_gc

needs_fork = pytest.mark.skipif(not can_fork(), reason="fork-started workers need Linux")


@needs_fork
def test_map_runs_in_other_processes_and_keeps_the_order():
    table = {i: i * i for i in range(20)}  # a closure over the parent's state: inherited, not pickled
    out = map_parallel(lambda i: (table[i], os.getpid()), list(range(20)), jobs=2)
    assert [v for v, _ in out] == [i * i for i in range(20)]
    assert os.getpid() not in {pid for _, pid in out}


def test_one_job_runs_in_this_process():
    seen = []
    out = map_parallel(lambda x: os.getpid(), [1, 2, 3], jobs=1, on_each=lambda i, r: seen.append(i))
    assert out == [os.getpid()] * 3 and seen == [0, 1, 2]


@needs_fork
def test_a_worker_error_reaches_the_caller():
    def boom(x):
        if x == 3:
            raise ValueError(f"bad item {x}")
        return x

    with pytest.raises(ValueError, match="bad item 3"):
        map_parallel(boom, list(range(6)), jobs=2)


@needs_fork
def test_close_without_waiting_returns_at_once():
    """The placer drops the annealing nobody asked for without waiting for it."""
    import time

    with Workers(lambda x: time.sleep(0.3) or x, jobs=2) as pool:
        futures = [pool.submit(i) for i in range(16)]
        assert futures[0].result() == 0
        t0 = time.perf_counter()
        pool.close(wait=False)
        assert time.perf_counter() - t0 < 0.25


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_bad_job_counts_are_refused_by_name(value, monkeypatch):
    monkeypatch.setenv("PLAIT_JOBS", value)
    with pytest.raises(PlaitError, match="PLAIT_JOBS"):
        default_jobs()
    with pytest.raises(PlaitError, match="--jobs"):
        check_jobs(value, "--jobs")


def test_jobs_from_the_environment(monkeypatch):
    monkeypatch.setenv("PLAIT_JOBS", "3")
    assert default_jobs() == 3
    monkeypatch.delenv("PLAIT_JOBS")
    assert 1 <= default_jobs() <= 8


def test_paused_gc_restores_the_collector():
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner pause leaves the outer one paused
    assert gc.isenabled()
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError("x")
    assert gc.isenabled()


def test_cli_refuses_a_bad_jobs_before_any_work(capsys):
    from plait.cli import main

    rc = main(["plan", "--model", "gpt:size=1.3b", "--cluster", "large-mixed:nodes=2", "--jobs", "0",
               "--no-progress"])
    assert rc != 0
    assert "--jobs" in capsys.readouterr().err


def _can_fork_here() -> bool:
    return can_fork()


@needs_fork
def test_no_workers_from_a_daemonic_process():
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1) as pool:  # its workers are daemonic
        assert pool.apply(_can_fork_here) is False


def _search_in_a_child_that_closes_without_waiting() -> None:
    import time

    os.setpgrp()  # its own process group: the test can stop it and its workers together
    pool = Workers(lambda x: time.sleep(0.5) or x, jobs=2)
    for i in range(4):
        pool.submit(i)
    time.sleep(0.1)  # two items running, the rest queued
    pool.close(wait=False)


@needs_fork
def test_a_child_process_that_closed_workers_without_waiting_exits():
    # A forked child (bench/plan_search_time.py measures each search in one) exits through
    # multiprocessing's exit function: it closes the pool's call queue, then joins every child
    # process. The executor's stop messages to its idle workers, sent once their running items
    # ended, came after that close and were lost: the child waited for its workers forever
    # (a --nodes 16 measurement hung for 8 minutes).
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=_search_in_a_child_that_closes_without_waiting)
    child.start()
    child.join(timeout=30)
    alive = child.is_alive()
    if alive:
        import signal

        os.killpg(child.pid, signal.SIGKILL)
        child.join()
    assert not alive, "the child hung at exit"
    assert child.exitcode == 0
