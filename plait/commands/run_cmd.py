"""`plait run`: train a model under a plan with real torch.distributed workers (torchrun)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from plait.commands.training_args import add_training_args


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run",
        help="train under a plan with torchrun workers (gloo on CPU, NCCL on GPU) and measure it",
        description="Launch one worker per plan rank through torch.distributed.run, train on deterministic "
                    "synthetic data or your dataset (--data) and report per-step losses, measured iteration "
                    "times and a timeline.",
    )
    _add_job_args(p)
    _add_checkpoint_args(p)
    _add_launch_args(p)
    _add_training_setup_args(p)
    _add_emulation_and_records_args(p)
    _add_recovery_args(p)
    _add_fault_args(p)
    p.set_defaults(func=run)
    return p


def _add_job_args(p: argparse.ArgumentParser) -> None:
    """What to train, where and under which plan, and how to report it."""
    p.add_argument("--model", required=True, help="zoo spec (gpt:layers=4,hidden=64,...) or file.py:factory")
    p.add_argument("--cluster", default=None,
                   help="cluster YAML or preset; its 'emulation' section emulates it on this machine "
                        "(default: this machine, no emulation)")
    p.add_argument("--plan", required=True, help="plan JSON file or short form (dp=2,tp=2,pp=1,...)")
    p.add_argument("--steps", type=int, default=3, help="total training steps (default 3)")
    p.add_argument("--trace", metavar="FILE", help="write the measured timeline as Chrome/Perfetto trace JSON")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """Checkpoints: where, how often, how many kept, and resuming from them."""
    p.add_argument("--checkpoint-dir", metavar="D", help="directory for checkpoints")
    p.add_argument("--checkpoint-every", metavar="K", type=int, default=None,
                   help="checkpoint every K steps (with --checkpoint-dir alone: once, after the last step)")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="complete checkpoints kept (default 2)")
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    """How the workers are launched: the hang timeout, agents per node, and real hosts."""
    p.add_argument("--timeout", metavar="S", type=float, default=300.0,
                   help="stop the run when a rank makes no progress for S seconds (default 300)")
    p.add_argument("--nprocs-per-node", "--nproc-per-node", metavar="K", type=int, default=None,
                   help="without network namespaces: start one torchrun agent per K ranks on loopback; with "
                        "--nnodes: the workers of a node whose --node-name is not in the cluster file")
    hosts = p.add_argument_group("real hosts (one `plait run` per node; under Slurm's srun none of these is needed)")
    hosts.add_argument("--nnodes", type=int, default=None,
                       help="nodes that join the run (torchrun's c10d rendezvous); the same plan and cluster "
                            "files on every node")
    hosts.add_argument("--rdzv-endpoint", metavar="HOST:PORT", default=None,
                       help="the rendezvous store, on one of the nodes (torchrun's --rdzv-endpoint)")
    hosts.add_argument("--rdzv-id", metavar="ID", default=None,
                       help="run id shared by the nodes (default: derived from model and plan)")
    hosts.add_argument("--node-name", metavar="NAME", default=None,
                       help="this node's name in the cluster file (default: the hostname); a name not in the "
                            "file takes a node in rendezvous order")


def _add_training_setup_args(p: argparse.ArgumentParser) -> None:
    """Device, dtype, optimizer, training options, seeds and the dataset."""
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--engine", choices=("auto", "plait", "torch"), default="auto",
                   help="auto: the engine plait.runtime.engine_for names (torch's modules where they run the "
                        "plan); plait: plait's own executors; torch: as auto (every plan torch's modules "
                        "run, they run by default)")
    p.add_argument("--dtype", choices=("fp32", "tf32", "bf16", "fp16"), default=None,
                   help="override the plan's training dtype (fp32 is fastest on CPU)")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), default="adamw")
    add_training_args(p)
    p.add_argument("--seed", type=int, default=0, help="weight-init seed")
    p.add_argument("--data-seed", type=int, default=0, help="data seed: synthetic samples, or the per-epoch sample order of --data")
    p.add_argument("--data", metavar="FILE.py:FACTORY", default=None,
                   help="your dataset: FACTORY() returns a map-style Dataset of (inputs_tuple, target) samples "
                        "(or (dataset, collate_fn)); default: the model's synthetic samples")
    p.add_argument("--data-workers", type=int, default=1, help="DataLoader worker processes per rank (default 1)")


def _add_emulation_and_records_args(p: argparse.ArgumentParser) -> None:
    """The run directory, the cluster's emulation and the communication records."""
    p.add_argument("--run-dir", default=None, help="keep workers' logs, state files and losses.csv here")
    p.add_argument("--no-emulate", action="store_true", help="ignore the cluster's emulation section")
    p.add_argument("--predict", action="store_true",
                   help="emulated cluster: calibrate this machine first (about 30 s), pin one rank per CPU, and "
                        "print the simulator's prediction for this machine next to the measurement (runs fp32)")
    p.add_argument("--no-comm-records", action="store_true",
                   help="do not stream each rank's collective / point-to-point records to RUN_DIR/comm/rankN.jsonl")
    p.add_argument("--comm-faults", metavar="JSON", default=None,
                   help='slow a link on purpose: {"slow_link": [a, b], "delay_s": x, "factor": f} (or a list); '
                        "every call whose group holds ranks a and b is delayed / stretched")


def _add_recovery_args(p: argparse.ArgumentParser) -> None:
    """--recover and its options: isolate faulty nodes, re-plan and train on (plait.recover)."""
    rec = p.add_argument_group("recovery (plait.recover; see README, 'Recovery')")
    rec.add_argument("--recover", nargs="?", const="act", default=None, choices=("act", "advise"),
                     help="heal the job: when a rank dies or hangs (or the doctor names a link or node fault in "
                          "2 live diagnoses in a row), stop it, remove that node from the cluster, re-plan for the "
                          "cluster left (same global batch), reshard the last checkpoint onto the new plan and "
                          "train on; a slow rank is reported, never dropped; each phase and every action with its "
                          "evidence is recorded under RUN_DIR (recovery.json, phase-N/). --recover=advise: "
                          "record what it would do, do nothing")
    rec.add_argument("--rejoin", metavar="NODE[@STEP]", action="append", default=[],
                     help="with --recover: declare an isolated node repaired from STEP on (default 0: as soon as "
                          "it is isolated); the job grows back onto it at its next checkpoint. While the job runs, "
                          "a line NODE written to RUN_DIR/rejoin does the same")
    rec.add_argument("--max-recoveries", type=int, default=3, metavar="N",
                     help="with --recover: isolations allowed before giving up (default 3)")
    rec.add_argument("--no-live-diagnosis", action="store_true",
                     help="with --recover: act only when the launcher stops the job (a dead or hung rank), not on "
                          "the doctor's diagnosis of the running job (slow ranks and links)")


def _add_fault_args(p: argparse.ArgumentParser) -> None:
    """Fault injection and the timings it needs (`plait doctor` experiments)."""
    p.add_argument("--inject", metavar="SPEC", default=None,
                   help="inject faults (several, ';'-separated): kill:rank=R,step=S | stop:rank=R,step=S[,for=2s] | "
                        "hang:rank=R,step=S | error:rank=R,step=S | skip:rank=R,step=S | mismatch:rank=R,step=S | "
                        "slow:rank=R,factor=F[,from=S][,every=K][,until=S] | "
                        "link:ranks=A-B,factor=F|delay=5ms[,from=S] | uplink:node=N,factor=F|delay=5ms[,from=S] | "
                        "hog:rank=R[,from=S][,procs=K]  (docs/doctor.md)")
    p.add_argument("--compute-sleep", metavar="S", type=float, default=0.0,
                   help="pad every forward span to at least S seconds (backward 2 S) by sleeping: timings set by "
                        "sleep, not by how many ranks share a core (fault-injection experiments)")
    p.add_argument("--probe-every", metavar="K", type=int, default=10,
                   help="time every rank pair's link every K steps for `plait doctor`'s slow-link finding "
                        "(0: never; default 10)")


def run(args: argparse.Namespace) -> int:
    from plait.runtime.api import run as run_training

    _check_args(args)
    configs = _configs(args, _rendezvous(args))
    if args.recover:
        return _run_recovering(args, configs)
    machine = None
    if args.predict:
        result, machine = _run_predicted(args, configs)
    else:
        result = run_training(args.model, args.cluster, args.plan, steps=args.steps, **configs)
    if args.json:
        out = result.to_dict()
        if machine is not None:
            out["machine"] = machine
        print(json.dumps(out, indent=1, default=str))
        return 0
    _print(result, args, machine)
    return 0


def _configs(args: argparse.Namespace, rendezvous: Any) -> dict[str, Any]:
    """The runtime's configs (`plait.runtime.config`) from the flags: `run`'s keyword arguments."""
    from plait.runtime.config import (
        CheckpointConfig,
        FaultsConfig,
        LaunchConfig,
        RecordsConfig,
        TrainingConfig,
    )

    return {
        "training": TrainingConfig(
            dtype=args.dtype, optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay,
            min_lr=args.min_lr, lr_warmup_iters=args.lr_warmup_iters, lr_decay_style=args.lr_decay_style,
            lr_decay_iters=args.lr_decay_iters, clip_grad=args.clip_grad, seed=args.seed,
            data_seed=args.data_seed, data=args.data, data_workers=args.data_workers),
        # --recover: the recovery loop sets the checkpoints (_run_recovering)
        "checkpoint": None if args.recover else CheckpointConfig(
            dir=args.checkpoint_dir, every=args.checkpoint_every, resume=args.resume, keep=args.keep_checkpoints),
        "launch": LaunchConfig(timeout=args.timeout, device=args.device, engine=args.engine,
                               emulate=not args.no_emulate,
                               nprocs_per_node=None if rendezvous or args.recover else args.nprocs_per_node,
                               rendezvous=rendezvous),
        "records": RecordsConfig(run_dir=None if args.recover else args.run_dir, trace=args.trace,
                                 comm_records=not args.no_comm_records, probe_every=args.probe_every),
        "faults": FaultsConfig(inject=args.inject, comm_faults=args.comm_faults, compute_sleep=args.compute_sleep),
    }


def _parse_rejoin(items: list[str]) -> dict[str, int]:
    from plait.errors import PlaitError

    out: dict[str, int] = {}
    for item in items:
        node, sep, step = item.partition("@")
        try:
            at = int(step) if sep else 0
        except ValueError:
            raise PlaitError(f"--rejoin {item!r}: expected NODE or NODE@STEP (STEP an integer)") from None
        if not node or at < 0:
            raise PlaitError(f"--rejoin {item!r}: expected NODE or NODE@STEP with STEP >= 0")
        out[node] = at
    return out


def _run_recovering(args: argparse.Namespace, configs: dict[str, Any]) -> int:
    """`--recover`: `plait.recover.recover` drives the run as phases (module doc there)."""
    import tempfile

    from plait.recover import RecoveryConfig, recover
    from plait.runtime.config import CheckpointConfig

    run_dir = args.run_dir or tempfile.mkdtemp(prefix="plait-recover-")
    every = args.checkpoint_every
    checkpoint = CheckpointConfig(dir=args.checkpoint_dir or Path(run_dir) / "checkpoints", resume=args.resume,
                                  keep=args.keep_checkpoints)
    say = (lambda text: None) if args.json else (lambda text: print(f"plait run: {text}", file=sys.stderr))
    say(f"recovering run in {run_dir} (checkpoint every {every} steps; declare a repaired node back with "
        f"`echo NODE >> {run_dir}/rejoin`)")
    config = RecoveryConfig(checkpoint_every=every, max_recoveries=args.max_recoveries,
                            rejoin_at=_parse_rejoin(args.rejoin), live=not args.no_live_diagnosis,
                            advise=args.recover == "advise")
    result = recover(args.model, args.cluster, args.plan, args.steps, run_dir=run_dir, config=config,
                     say=say, **{**configs, "checkpoint": checkpoint})
    if args.json:
        print(json.dumps(result.to_dict(), indent=1, default=str))
        return 0
    _print_recovery(result)
    return 0


def _print_recovery(result: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    phases = Table(title=f"phases of the run ({result.run_dir})")
    for col in ("phase", "nodes", "plan", "from step", "predicted (ms)", "measured (ms)", "end"):
        phases.add_column(col, justify="right" if col in ("phase", "from step") or "ms" in col else "left")
    for p in result.phases:
        measured = f"{p.measured_step_s * 1e3:.2f}" if p.measured_step_s is not None else "-"
        phases.add_row(str(p.index), ", ".join(p.nodes), p.plan, str(p.start_step), f"{p.predicted_step_s * 1e3:.2f}",
                       measured, p.ended.split(":")[0])
    console.print(phases)
    for p in result.phases:
        if p.ended != "finished":
            console.print(f"phase {p.index} ended: {p.ended}")
    for t in result.transitions:
        console.print(f"after phase {t.after_phase}: {t.reason} {', '.join(t.nodes)}; resumed from checkpoint "
                      f"{t.resumed_from} ({t.lost_steps} steps re-run); detection to training again "
                      f"{t.detect_to_train_s:.1f} s (stopping {t.detect_to_stopped_s:.1f} s, planning "
                      f"{t.plan_s:.1f} s)")
    losses = result.losses
    if losses:
        console.print("loss per step: " + " ".join(f"{s}:{v:.4f}" for s, v in losses.items()))
    console.print("predicted: the simulator on each phase's cluster (the cluster file's GPUs); measured: this "
                  "machine's ranks (median step after the first)")


def _check_args(args: argparse.Namespace) -> None:
    """Every argument check that does not need the model: before anything is started."""
    from plait.errors import PlaitError, check_output_path
    from plait.ir.plan import Plan

    if args.steps < 1:
        raise PlaitError(f"--steps: must be >= 1, got {args.steps}")
    if not args.timeout > 0:
        raise PlaitError(f"--timeout: must be > 0 seconds (how long a rank may make no progress before the run "
                         f"is stopped), got {args.timeout:g}")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise PlaitError(f"--checkpoint-every: must be >= 1 step, got {args.checkpoint_every}")
    if args.checkpoint_every is not None and args.checkpoint_dir is None and not args.recover:
        raise PlaitError("--checkpoint-every: needs --checkpoint-dir (where the checkpoints go)")
    if args.recover:
        for flag, given in (("--predict", args.predict), ("--nnodes", args.nnodes is not None),
                            ("--trace", args.trace is not None)):
            if given:
                raise PlaitError(f"--recover: not with {flag} (a recovering run is several runs, one per phase)")
        if args.cluster is None:
            raise PlaitError("--recover: needs --cluster (the nodes it may isolate and re-plan over)")
        if args.max_recoveries < 0:
            raise PlaitError(f"--max-recoveries: must be >= 0, got {args.max_recoveries}")
        _parse_rejoin(args.rejoin)
        if args.checkpoint_every is None:  # at most a tenth of the run is re-run after a fault
            args.checkpoint_every = max(1, args.steps // 10)
    elif args.rejoin or args.no_live_diagnosis:
        raise PlaitError(f"{'--rejoin' if args.rejoin else '--no-live-diagnosis'}: only with --recover")
    if args.checkpoint_dir is not None and args.checkpoint_every is None:
        # The stated default: one checkpoint, after the last step (enough to --resume a longer run).
        args.checkpoint_every = args.steps
        print(f"plait run: --checkpoint-dir without --checkpoint-every: one checkpoint after the last step "
              f"(--checkpoint-every {args.steps}) in {args.checkpoint_dir}", file=sys.stderr)
    args.checkpoint_every = args.checkpoint_every or 0
    check_output_path(args.trace, "--trace")
    world = Plan.load(args.plan).world_size
    from plait.runtime.inject import Injection

    Injection.parse(args.inject).check_world(world)  # a bad spec names its clause before anything starts
    cpus = os.cpu_count() or 1
    if world > cpus:
        print(f"plait run: warning: the plan has {world} ranks and this machine {cpus} CPUs: ranks time-share the "
              f"CPUs, so the run is slow and its timings are not those of {world} devices", file=sys.stderr)


def _rendezvous(args: argparse.Namespace) -> Any:
    """Multi-node options from the flags, else from a Slurm step (srun, one task per node), else None."""
    import dataclasses
    import hashlib
    import os
    import socket

    from plait.errors import PlaitError
    from plait.runtime.multinode import Rendezvous, from_slurm

    flags = {"--rdzv-endpoint": args.rdzv_endpoint, "--rdzv-id": args.rdzv_id, "--node-name": args.node_name}
    if args.nnodes is None:
        slurm = from_slurm(os.environ)
        if slurm is not None and slurm.nnodes > 1:
            if args.predict:
                raise PlaitError("--predict: runs on one machine; not inside a multi-node Slurm step")
            over = {k: v for k, v in (("endpoint", args.rdzv_endpoint), ("run_id", args.rdzv_id),
                                      ("node_name", args.node_name)) if v}
            return dataclasses.replace(slurm, **over, nproc=args.nprocs_per_node)
        given = [k for k, v in flags.items() if v]
        if given:
            raise PlaitError(f"{given[0]}: needs --nnodes N (a multi-node run)")
        return None
    if args.rdzv_endpoint is None:
        raise PlaitError("--nnodes: needs --rdzv-endpoint HOST:PORT (the same on every node)")
    if args.predict:
        raise PlaitError("--predict: runs on one machine; not with --nnodes")
    run_id = args.rdzv_id or "plait-" + hashlib.sha1(f"{args.model}|{args.plan}".encode()).hexdigest()[:10]
    return Rendezvous(nnodes=args.nnodes, endpoint=args.rdzv_endpoint, run_id=run_id,
                      node_name=args.node_name or socket.gethostname(), nproc=args.nprocs_per_node)


def _run_predicted(args: argparse.Namespace, configs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """`--predict`: `plait.measure.machine.LocalMachine` calibrates this machine, runs the plan with
    the ranks pinned as its profilers and predicts it from the layer profiles that bracket the run."""
    from plait.errors import PlaitError
    from plait.measure.machine import LocalMachine

    if args.cluster is None or args.no_emulate:
        raise PlaitError("--predict: give an emulated cluster (--cluster with an 'emulation:' section, "
                         "e.g. emulated-mixed) and no --no-emulate")
    from plait.ir.plan import Plan

    if Plan.load(args.plan).spmd is not None:
        raise PlaitError("--predict: an SPMD plan is predicted for this machine by `plait plan --family spmd --run`")
    if args.dtype not in (None, "fp32") or args.device == "cuda" or args.nprocs_per_node:
        raise PlaitError("--predict: predicts CPU ranks in fp32 (no --dtype other than fp32, no --device cuda, "
                         "no --nprocs-per-node)")
    say = (lambda text: None) if args.json else (lambda text: print(f"  {text}", file=sys.stderr))
    plan = Plan.load(args.plan)
    # slower kinds are slowed by the plan's dtype ratio; the CPU ranks compute fp32. Calibrated for
    # the plan's ranks: a plan on fewer ranks than the cluster's devices shares the CPUs with no other.
    with LocalMachine(args.cluster, args.model, ranks=plan.world_size, emulate_dtype=plan.dtype, say=say) as m:
        mr = m.measure_and_predict(args.plan, steps=args.steps, **configs)
        notes = list(m.notes)
    if args.run_dir and mr.run.run_dir:  # beside the measured run: `plait report RUN_DIR` shows both
        write_prediction(Path(mr.run.run_dir), mr, notes)
    return mr.run, {**mr.summary(), "notes": notes}


def write_prediction(run_dir: Path, mr: Any, notes: list[str]) -> Path:
    """RUN_DIR/prediction.json: the simulator's prediction of this run for this machine (its
    iteration time, critical path and timeline), with how it compares with the measurement."""
    from plait.ir.formats import stamp

    sim = mr.prediction.result
    data = stamp("prediction", {"for": "this machine (measured links and layer times)",
                                "summary": mr.summary(), "critical_path": sim.critical_path,
                                "timeline": sim.timeline.to_dict(), "notes": notes})
    path = run_dir / "prediction.json"
    path.write_text(json.dumps(data, default=str))
    return path


def _print_machine(machine: dict[str, Any], console: Any) -> None:
    """The one measured figure of a --predict run (the median of the steps after the warm-up, which
    is what the prediction is compared with) next to the prediction."""
    err = machine["error"]
    console.print(f"measured iteration time (median after {machine['warmup_steps']} warm-up steps) "
                  f"{machine['measured_iteration_s'] * 1e3:.2f} ms; predicted for this machine "
                  f"{machine['predicted_iteration_s'] * 1e3:.2f} ms: error "
                  f"[{'green' if abs(err) <= 0.10 else 'red'}]{err * 100:+.1f} %[/] "
                  f"(layer profile drift over the run {machine['profile_drift'] * 100:+.0f} %)")


def print_notes(console: Any, *groups: list[str], indent: str = "") -> None:
    """Each note once, in order; network notes that plait.runtime.netns already logged are not repeated."""
    from plait.runtime.netns import already_reported

    seen: set[str] = set()
    for note in (n for g in groups for n in g):
        if note in seen or already_reported(note):
            continue
        seen.add(note)
        console.print(f"{indent}note: {note}")


def trained_dtype(args: argparse.Namespace) -> tuple[str, str]:
    """(dtype the ranks computed in, the plan's dtype): --predict runs fp32, --dtype overrides the plan."""
    from plait.ir.plan import Plan

    planned = Plan.load(args.plan).dtype
    return ("fp32" if args.predict else args.dtype or planned), planned


def _stalls(run_dir: Any) -> dict[int, str]:
    """step -> the doctor's past stalls there (class, rank, seconds), read off the run folder's
    records; {} without a run folder or records (the table then has no stall column)."""
    if not run_dir or not (Path(run_dir) / "comm").is_dir():
        return {}
    from plait.doctor import diagnose

    try:
        found = diagnose(run_dir).findings
    except Exception:  # noqa: BLE001 -- the table must print whatever the records hold
        return {}
    return {f.step: f"{f.kind} of rank {list(f.ranks)}: {f.evidence.get('stalled_s')} s"
            for f in found if f.evidence.get("resumed") and f.step is not None}


def _print(result: Any, args: argparse.Namespace, machine: dict[str, Any] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    width = Console().width
    console = Console(width=max(width, 110))  # the rank table needs ~110 columns; wrap rather than elide
    console.print(f"[bold]plait run[/bold]  model {result.model}  plan {result.plan}")
    dtype, planned = trained_dtype(args)
    why = "--predict runs CPU ranks in fp32" if args.predict else "overridden by --dtype"
    console.print(f"dtype {dtype}" + (f" (the plan's {planned}, {why})" if dtype != planned else "")
                  + f", backend {result.backend} on {result.device}, network {result.network.get('mode')}"
                  + (f", resumed after step {result.resumed_from}" if result.resumed_from else ""))
    if not result.steps:  # a node of a multi-node run without plan rank 0: that node reports the run
        for note in result.notes:
            console.print(f"note: {note}")
        return
    steps = Table(title="steps")
    steps.add_column("step", justify="right")
    steps.add_column("loss", justify="right")
    steps.add_column("iteration (ms)", justify="right")
    stalls = _stalls(args.run_dir)
    if stalls:  # a wait outside the step's timed span (a rank stopped, then resumed) shows here
        steps.add_column("stall (doctor)", justify="left")
    for s, loss, t in zip(result.steps, result.losses, result.iteration_times):
        steps.add_row(str(s), f"{loss:.6f}", f"{t * 1e3:.2f}", *([stalls.get(s, "")] if stalls else []))
    console.print(steps)
    ranks = Table(title="ranks (samples per step; busy fraction of the measured steps)")
    for col in ("rank", "pp/dp/tp", "dev", "host", "kind", "slowdown", "layers", "params", "samples",
                "compute", "comm"):
        ranks.add_column(col, justify="right" if col not in ("host", "kind", "layers") else "left")
    span = sum(result.iteration_times) or 1.0
    for r in result.ranks:
        busy_c = result.timeline.busy_time(f"dev{r.device}/compute") / span
        busy_m = result.timeline.busy_time(f"dev{r.device}/comm") / span
        layers = f"{r.layers[0]}..{r.layers[-1]}" if len(r.layers) > 2 else ",".join(r.layers)
        ranks.add_row(str(r.rank), f"{r.pp}/{r.dp}/{r.tp}", str(r.device), r.host, r.kind or "-",
                      f"{r.slowdown:.2f}", layers, f"{r.params:,}", str(r.samples_per_step),
                      f"{busy_c:.0%}", f"{busy_m:.0%}")
    console.print(ranks)
    if machine is not None:
        _print_machine(machine, console)
    else:
        console.print(f"measured iteration time (mean of the steps after the first) "
                      f"{result.mean_iteration_time() * 1e3:.2f} ms")
    print_notes(console, result.notes, machine["notes"] if machine is not None else [])
    if args.trace:
        console.print(f"trace written to {args.trace}")
