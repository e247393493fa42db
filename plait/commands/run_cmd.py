"""`plait run`: train a model under a plan with real torch.distributed workers (torchrun)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run",
        help="train under a plan with torchrun workers (gloo on CPU, NCCL on GPU) and measure it",
        description="Launch one worker per plan rank through torch.distributed.run, train on deterministic "
                    "synthetic data and report per-step losses, measured iteration times and a timeline.",
    )
    p.add_argument("--model", required=True, help="zoo spec (gpt:layers=4,hidden=64,...) or file.py:factory")
    p.add_argument("--cluster", default=None,
                   help="cluster YAML or preset; its 'emulation' section emulates it on this machine "
                        "(default: this machine, no emulation)")
    p.add_argument("--plan", required=True, help="plan JSON file or short form (dp=2,tp=2,pp=1,...)")
    p.add_argument("--steps", type=int, default=3, help="total training steps (default 3)")
    p.add_argument("--trace", metavar="FILE", help="write the measured timeline as Chrome/Perfetto trace JSON")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--checkpoint-dir", metavar="D", help="directory for checkpoints")
    p.add_argument("--checkpoint-every", metavar="K", type=int, default=0, help="checkpoint every K steps")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="complete checkpoints kept (default 2)")
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    p.add_argument("--timeout", metavar="S", type=float, default=300.0,
                   help="stop the run when a rank makes no progress for S seconds (default 300)")
    p.add_argument("--nprocs-per-node", metavar="K", type=int, default=None,
                   help="without network namespaces: start one torchrun agent per K ranks on loopback")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dtype", choices=("fp32", "tf32", "bf16", "fp16"), default=None,
                   help="override the plan's training dtype (fp32 is fastest on CPU)")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip-grad", metavar="N", type=float, default=None,
                   help="clip the global gradient norm (over every shard of the plan) to N (Megatron's --clip-grad)")
    p.add_argument("--seed", type=int, default=0, help="weight-init seed")
    p.add_argument("--data-seed", type=int, default=0, help="synthetic-data seed")
    p.add_argument("--run-dir", default=None, help="keep workers' logs and state files here")
    p.add_argument("--no-emulate", action="store_true", help="ignore the cluster's emulation section")
    p.add_argument("--predict", action="store_true",
                   help="emulated cluster: calibrate this machine first (about 30 s), pin one rank per CPU, and "
                        "print the simulator's prediction for this machine next to the measurement (runs fp32)")
    p.add_argument("--fault", default=None, help=argparse.SUPPRESS)  # tests: rank=1,step=2,kind=hang|die|error
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from plait.runtime.api import run as run_training

    common = dict(trace=args.trace, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                  resume=args.resume, keep_checkpoints=args.keep_checkpoints, timeout=args.timeout,
                  optimizer=args.optimizer, lr=args.lr, seed=args.seed, data_seed=args.data_seed,
                  run_dir=args.run_dir, fault=args.fault, clip_grad=args.clip_grad)
    machine = None
    if args.predict:
        result, machine = _run_predicted(args, common)
    else:
        result = run_training(args.model, args.cluster, args.plan, steps=args.steps,
                              nprocs_per_node=args.nprocs_per_node, device=args.device, dtype=args.dtype,
                              emulate=not args.no_emulate, **common)
    if args.json:
        out = result.to_dict()
        if machine is not None:
            out["machine"] = machine
        print(json.dumps(out, indent=1, default=str))
        return 0
    _print(result, args)
    if machine is not None:
        _print_machine(machine)
    return 0


def _run_predicted(args: argparse.Namespace, common: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """`--predict`: `plait.runtime.machine.LocalMachine` calibrates this machine, runs the plan with
    the ranks pinned as its profilers and predicts it from the layer profiles that bracket the run."""
    import sys

    from plait.errors import PlaitError
    from plait.runtime.machine import LocalMachine

    if args.cluster is None or args.no_emulate:
        raise PlaitError("--predict: give an emulated cluster (--cluster with an 'emulation:' section, "
                         "e.g. emulated-mixed) and no --no-emulate")
    if args.dtype not in (None, "fp32") or args.device == "cuda" or args.nprocs_per_node:
        raise PlaitError("--predict: predicts CPU ranks in fp32 (no --dtype other than fp32, no --device cuda, "
                         "no --nprocs-per-node)")
    say = (lambda text: None) if args.json else (lambda text: print(f"  {text}", file=sys.stderr))
    from plait.plan.ir import Plan

    # slower kinds are slowed by the plan's dtype ratio; the CPU ranks compute fp32
    with LocalMachine(args.cluster, args.model, emulate_dtype=Plan.load(args.plan).dtype, say=say) as m:
        mr = m.measure_and_predict(args.plan, steps=args.steps, **common)
        notes = list(m.notes)
    return mr.run, {**mr.summary(), "notes": notes}


def _print_machine(machine: dict[str, Any]) -> None:
    from rich.console import Console

    err = machine["error"]
    console = Console()
    console.print(f"predicted for this machine {machine['predicted_iteration_s'] * 1e3:.2f} ms, measured "
                  f"{machine['measured_iteration_s'] * 1e3:.2f} ms (median after {machine['warmup_steps']} "
                  f"warm-up steps): error [{'green' if abs(err) <= 0.10 else 'red'}]{err * 100:+.1f} %[/] "
                  f"(layer profile drift over the run {machine['profile_drift'] * 100:+.0f} %)")
    for note in machine["notes"]:
        console.print(f"note: {note}")


def _print(result: Any, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    width = Console().width
    console = Console(width=max(width, 110))  # the rank table needs ~110 columns; wrap rather than elide
    console.print(f"[bold]plait run[/bold]  model {result.model}  plan {result.plan}")
    console.print(f"backend {result.backend} on {result.device}, network {result.network.get('mode')}"
                  + (f", resumed after step {result.resumed_from}" if result.resumed_from else ""))
    steps = Table(title="steps")
    steps.add_column("step", justify="right")
    steps.add_column("loss", justify="right")
    steps.add_column("iteration (ms)", justify="right")
    for s, loss, t in zip(result.steps, result.losses, result.iteration_times):
        steps.add_row(str(s), f"{loss:.6f}", f"{t * 1e3:.2f}")
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
    console.print(f"mean iteration time {result.mean_iteration_time() * 1e3:.2f} ms "
                  f"(steps after the first)")
    for note in result.notes:
        console.print(f"note: {note}")
    if args.trace:
        console.print(f"trace written to {args.trace}")
