"""The worker entry: one process = one plan rank. Started by torchrun
(`python -m plait.runtime.entry CONFIG`), or forked from the in-process agent (`entrypoint`,
`plait.runtime.agent`).

It sets the process up (torchrun's OMP_NUM_THREADS, the plan rank of this process, the rank's CPU
cgroups, its heartbeat and status files, SIGTERM), reads the run's typed config
(`worker_config.read_worker_config`; each engine's `rank_config.RankConfig`) and hands the plan to
the engine that runs its form (`engine_of`):

* a composed plan (pipeline stages that run SPMD programs) -- `compose_worker.ComposeWorker`;
* an op-level SPMD program (`Plan.spmd`) -- `spmd_worker.SpmdWorker`;
* a plan that torch's modules run (`layout.torch_runs`) -- `torch_worker.TorchWorker` (DDP,
  FSDP2, DTensor, torch.distributed.pipelining);
* any other plan (3D grid, stage graph) -- the pipeline worker, `worker.Worker`.

What the engines share lives in modules of their own (`worker_config`: the run's typed config;
`rank_config`: what each reads first from it; `results`: what each writes the same way -- comm
records, the common clock, `result.json`): no engine imports another, and this module is the only
one that imports them.

How a rank ended goes to `RUN_DIR/status/rankN.json` (ok, error with traceback and whether a peer
failed, or terminated by torchrun), and, when forked from the agent, to `RUN_DIR/exit/rankN.json`
(exit code or signal), which the launcher reads.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.ir.plan import Plan
from plait.runtime.comm import Comm
from plait.runtime.layout import engine_for
from plait.runtime.partition import RuntimeSetupError
from plait.runtime.recorder import Heartbeat
from plait.runtime.worker import Worker
from plait.runtime.worker_config import WorkerConfig, read_worker_config


def _is_peer_error(exc: BaseException) -> bool:
    """True when the exception says a *peer* failed (closed connection, collective timeout)."""
    if isinstance(exc, getattr(dist, "DistError", ())) or type(exc).__name__.startswith("Dist"):
        return True
    text = str(exc).lower()
    return any(s in text for s in ("connection closed", "connection reset", "timed out", "timeout", "gloo",
                                   "broken pipe", "nccl", "peer"))


def _plan_rank(config: WorkerConfig) -> int:
    if config.multinode is not None:  # c10d rendezvous on real hosts: mapped after it (plait.runtime.multinode)
        from plait.runtime.multinode import rank_after_rendezvous

        return rank_after_rendezvous(config)
    agent = int(os.environ.get("GROUP_RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return config.agents[agent].ranks[local]


def _write_status(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def engine_of(plan: Plan, config: WorkerConfig | Mapping[str, Any] | None = None) -> str:
    """Which engine runs `plan` under the run's `config`: "compose" (a stage runs an SPMD
    program), "spmd" (the plan is one SPMD program), "torch" (data parallelism or ZeRO on torch's
    modules) or "pipeline" (a 3D grid or a stage graph) -- `layout.engine_for`'s verdict, the same
    one `api.run` checked before starting any process."""
    verdict = engine_for(plan, config)
    if verdict.engine is None:
        raise RuntimeSetupError(verdict.reason)
    return verdict.engine


def make_worker(config: WorkerConfig, rank: int, heartbeat: Heartbeat) -> Any:
    """The engine that runs this rank's plan, built on the run's config."""
    engine = engine_of(config.plan, config)
    if engine == "compose":  # pipeline stages running SPMD programs
        # imported here: the SPMD engines' imports (the program planner and its costs) would add
        # about half a second to the start of every pipeline rank
        from plait.runtime.compose_worker import ComposeWorker

        return ComposeWorker(config, rank, heartbeat)
    if engine == "spmd":  # an op-level SPMD program
        from plait.runtime.spmd_worker import SpmdWorker

        return SpmdWorker(config, rank, heartbeat)
    if engine == "torch":  # data parallelism and ZeRO on torch's DDP and FSDP2
        from plait.runtime.torch_worker import TorchWorker

        return TorchWorker(config, rank, heartbeat)
    return Worker(config, rank, heartbeat)


def fit_threads_to_cpus() -> int:
    """At most one intra-op thread per CPU this process may run on; returns the thread count. A
    cpuset of fewer CPUs than the OpenMP threads (a fixed CPU share per rank, as `plait run
    --predict` pins each rank to one core) leaves the threads spin-waiting on one another on the
    same core: one rank of `make demo` ran 3.1 s a step pinned, 0.13 s with this."""
    allowed = len(os.sched_getaffinity(0))
    if torch.get_num_threads() > allowed:
        torch.set_num_threads(allowed)
    return torch.get_num_threads()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config = read_worker_config(argv[0])
    # torchrun sets OMP_NUM_THREADS for its workers; a worker forked from the agent imported torch
    # before that, so apply it explicitly (oversubscribed OpenMP spin-waits are very slow).
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    rank = _plan_rank(config)
    # A fixed CPU share per rank when the launcher's caller made cgroups for it (plait.runtime.cpu_share).
    from plait.runtime.cpu_share import join_from_env

    join_from_env(rank)
    fit_threads_to_cpus()
    run_dir = Path(config.run_dir)
    status = run_dir / "status" / f"rank{rank}.json"
    hb = Heartbeat(run_dir / "hb" / f"rank{rank}.json", rank)

    def on_term(signum: int, frame: Any) -> None:
        # torchrun stops the surviving workers with SIGTERM after one fails: say so, so the
        # launcher does not mistake them for the cause.
        _write_status(status, {"state": "terminated", "signal": signum, "time": time.time(),
                               "step": hb.state["step"], "phase": hb.state["phase"]})
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    worker = make_worker(config, rank, hb)
    try:
        worker.run()
    except BaseException as exc:  # report, then exit non-zero so torchrun stops the job
        _write_status(status, {"state": "error", "time": time.time(), "step": hb.state["step"],
                               "phase": hb.state["phase"], "error": f"{type(exc).__name__}: {exc}"[:2000],
                               "peer_error": _is_peer_error(exc), "traceback": traceback.format_exc()[-8000:]})
        hb.close("error")
        sys.stderr.write(f"[plait rank {rank}] {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        os._exit(1)
    _write_status(status, {"state": "ok", "time": time.time()})
    hb.close("done")
    try:
        Comm.destroy()
    except Exception:
        pass
    return 0


def entrypoint(config_path: str) -> int:
    """Python entry point for torchrun's function launch (workers forked from the agent).

    torch's multiprocessing context reports only the first failed worker it polls (often a
    peer that lost its connection), so the worker runs in a forked child of this process,
    which records how it ended (exit code or signal) in `RUN_DIR/exit/rankN.json` and then
    ends the same way."""
    config = read_worker_config(config_path)
    rank = _plan_rank(config)
    exit_dir = Path(config.run_dir) / "exit"
    exit_dir.mkdir(exist_ok=True)
    pid = os.fork()
    if pid == 0:  # the worker; never returns into torch's multiprocessing wrapper
        code = 1
        try:
            code = main([config_path])
        finally:
            os._exit(code)

    def forward(signum: int, frame: Any) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        _write_status(exit_dir / f"rank{rank}.json", {"pid": pid, "exitcode": -sig, "time": time.time(),
                                                      "signal": signal.Signals(sig).name})
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    code = os.WEXITSTATUS(status)
    _write_status(exit_dir / f"rank{rank}.json", {"pid": pid, "exitcode": code, "time": time.time(), "signal": None})
    if code:
        os._exit(code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
