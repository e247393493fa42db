"""`plait plan`: find the fastest 3D plan that fits, place it, and optionally run it.

    plait plan                                   # built-in small GPT on the emulated mixed cluster
    plait plan --model gpt:size=1.3b --cluster a100-80g:nodes=4 --global-batch 512 --top 5
    plait plan ... --out plan.json               # then: plait simulate/run --plan plan.json
    plait plan ... --export megatron             # equivalent Megatron-LM launch arguments
    plait plan ... --out plan.json --export slurm  # an sbatch script running the plan with plait run
    plait plan --run                             # train the chosen plan a few steps, predicted vs measured
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from plait.plan.export import FORMATS
from plait.search import DEFAULT_CLUSTER, DEFAULT_GLOBAL_BATCH, DEFAULT_MODEL

GiB = 2**30


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="search data x tensor x pipeline plans that fit, rank them by the simulator",
        description="Pipette-style 3D configurator: enumerate dp x tp x pp, micro-batch, recompute, "
        "ZeRO and schedule; prune what does not fit in memory; rank by the simulator; place ranks "
        "on uneven links; split layers and batches unevenly over mixed GPU kinds.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"zoo spec or file.py:factory (default: {DEFAULT_MODEL})")
    p.add_argument("--cluster", default=DEFAULT_CLUSTER, help=f"cluster YAML or preset (default: {DEFAULT_CLUSTER})")
    p.add_argument("--global-batch", type=int, default=DEFAULT_GLOBAL_BATCH,
                   help=f"samples per iteration (default: {DEFAULT_GLOBAL_BATCH})")
    p.add_argument("--top", type=int, default=5, help="how many plans to print (default 5)")
    p.add_argument("--finalists", type=int, default=12,
                   help="analytically best candidates to place and simulate (default 12; 0 = all)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", metavar="FILE", help="write the best plan as JSON (for plait simulate/run --plan)")
    p.add_argument("--export", choices=FORMATS, help="print the best plan as launch args/config of this framework")
    p.add_argument("--run", action="store_true", help="train the best plan a few steps and compare with the prediction")
    p.add_argument("--steps", type=int, default=8, help="steps for --run (default 8; the first 2 are warm-up)")
    p.add_argument("--no-machine-prediction", action="store_true",
                   help="with --run on an emulated cluster: skip calibrating this machine (about 30 s) and "
                        "the prediction for it")
    p.add_argument("--seed", type=int, default=0, help="seed of the placement annealing (default 0)")
    p.add_argument("--no-placement", action="store_true", help="keep Megatron's rank order")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from plait.errors import PlaitError
    from plait.plan.export import export
    from plait.search import plan

    if args.top < 1:
        raise PlaitError(f"--top: must be >= 1, got {args.top}")
    if args.steps < 1:
        raise PlaitError(f"--steps: must be >= 1, got {args.steps}")
    result = plan(args.model, args.cluster, global_batch=args.global_batch, top=args.top,
                  finalists=None if args.finalists == 0 else args.finalists, seed=args.seed,
                  placement=not args.no_placement, progress=not args.no_progress and not args.json)
    best = result.best
    exported = None
    if args.export:
        from plait.cluster import load_cluster

        launch = {"model": args.model, "cluster_file": args.cluster, "plan_file": args.out} \
            if args.export == "slurm" else None
        if args.export == "slurm" and not args.out:
            raise PlaitError("--export slurm: give --out PLAN.json too (the script runs `plait run --plan PLAN.json`)")
        exported = export(best.plan, args.export, _model_config(args.model), load_cluster(args.cluster), launch)
        if args.export == "slurm":  # beside the plan file it runs: submit with `sbatch PLAN.sbatch`
            script = Path(args.out).with_suffix(".sbatch")
            script.write_text(exported)
    if args.out:
        best.plan.save(args.out)
    measured = None
    if args.run:
        measured = _run(args, result)

    if args.json:
        out = result.to_dict()
        if exported is not None:
            out["export"] = {"format": args.export, "text": exported}
        if measured is not None:
            out["run"] = measured
        if args.out:
            out["out"] = args.out
        print(json.dumps(out, indent=2))
        return 0

    from rich.console import Console

    console = Console(width=max(Console().width, 150))
    print_result(result, console)
    if args.out:
        console.print(f"best plan written to [bold]{args.out}[/] "
                      f"(plait simulate --plan {args.out} / plait run --plan {args.out})")
    if args.export == "slurm":
        console.print(f"sbatch script written to [bold]{Path(args.out).with_suffix('.sbatch')}[/] "
                      f"(submit: sbatch {Path(args.out).with_suffix('.sbatch')})")
    if exported is not None:
        console.print(f"\n[bold]{args.export}[/] equivalent:")
        sys.stdout.write(exported)
    if measured is not None:
        _print_run(measured, console)
    return 0


def _model_config(model: str) -> dict[str, Any]:
    from plait.graph.zoo import load_model

    return dict(load_model(model).config)


def _run(args: argparse.Namespace, result: Any) -> dict[str, Any]:
    """Train the best plan the runtime can run for a few steps; predicted next to measured.

    On an emulated cluster the prediction that can be checked is the one for this machine:
    `plait.measure.machine.LocalMachine` profiles the emulated links and the model's layers on
    the ranks' CPUs, simulates the plan from them and runs it (in fp32, as CPU ranks train)."""
    from plait.cluster import load_cluster
    from plait.errors import PlaitError
    from plait.runtime.api import run as runtime_run

    runnable = [c for c in result.top if c.plan.schedule != "interleaved" and not c.plan.stages]
    if not runnable:
        raise PlaitError("--run: the runtime runs 1f1b and gpipe pipelines; every plan in the top "
                         f"{len(result.top)} is interleaved (raise --top)")
    cand = runnable[0]
    out: dict[str, Any] = {"plan": str(cand.plan), "rank_in_top": result.top.index(cand) + 1,
                           "predicted_iteration_s": cand.iteration_time_s, "machine": None}
    emu = load_cluster(args.cluster).emulation
    if emu is not None and emu.enabled and not args.no_machine_prediction and not _has_cuda():
        from plait.measure.machine import LocalMachine

        say = (lambda text: None) if args.json else (lambda text: print(f"  {text}", file=sys.stderr))
        if not args.json:
            print("plait run on this machine: calibrating (emulated links, gloo, layer times)...", file=sys.stderr)
        # slower kinds are slowed by the plan's dtype ratio (the GPUs it was planned for), while
        # the CPU ranks compute fp32
        with LocalMachine(args.cluster, args.model, emulate_dtype=cand.plan.dtype, say=say) as machine:
            mr = machine.measure_and_predict(cand.plan, steps=args.steps)
        res = mr.run
        out["machine"] = {**mr.summary(), "notes": machine.notes, "dtype": "fp32",
                          "emulated_dtype": cand.plan.dtype}
        out["measured_iteration_s"] = mr.measured_s
    else:
        res = runtime_run(args.model, args.cluster, cand.plan, steps=args.steps)
        skip = 2 if len(res.iteration_times) > 3 else 1
        out["measured_iteration_s"] = res.mean_iteration_time(skip=skip)
    out.update({"iteration_times_s": list(res.iteration_times), "losses": list(res.losses),
                "backend": res.backend, "device": res.device, "notes": list(res.notes)})
    return out


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _print_run(run: dict[str, Any], console: Any) -> None:
    pred, meas = run["predicted_iteration_s"], run["measured_iteration_s"]
    console.print(f"\n[bold]plait run[/] of plan #{run['rank_in_top']} ({run['plan']}), "
                  f"{len(run['iteration_times_s'])} steps on {run['backend']}/{run['device']} "
                  f"(losses {', '.join(f'{x:.3f}' for x in run['losses'])}):")
    machine = run.get("machine")
    if machine:
        err = machine["error"]
        console.print(f"  predicted for this machine {_ms(machine['predicted_iteration_s'])}, measured "
                      f"{_ms(meas)} (median after {machine['warmup_steps']} warm-up steps): error "
                      f"[{'green' if abs(err) <= 0.10 else 'red'}]{err * 100:+.1f} %[/]")
        console.print(f"  [dim]this machine: the ranks are CPU processes (fp32, slower kinds slowed by their "
                      f"{machine['emulated_dtype']} FLOP/s ratio, links shaped by tc); predicted from measured links "
                      f"and layer times "
                      f"(profile drift {machine['profile_drift'] * 100:+.0f} % over the run). The table above "
                      f"predicts the GPUs the cluster describes: {_ms(pred)} per iteration there.[/]")
        for note in machine["notes"]:
            console.print(f"  note: {note}")
    else:
        console.print(f"  iteration time: predicted {_ms(pred)}, measured {_ms(meas)}")
        if run["device"] == "cpu":
            console.print("  [dim]the prediction is for the GPUs the cluster describes, the measurement ran CPU "
                          "processes: they differ by the CPU/GPU speed ratio (an emulated cluster gets a "
                          "prediction for this machine unless --no-machine-prediction)[/]")
    for note in run["notes"]:
        console.print(f"  note: {note}")


def _uneven(c: Any) -> str:
    p = c.plan
    parts = []
    if p.layer_split is not None:
        parts.append("layers " + ":".join(map(str, p.layer_split)))
    if p.dp_shares is not None:
        parts.append("batch " + ":".join(str(n) for n in p.samples_per_replica()))
    if p.device_order is not None:
        parts.append("placed")
    return ", ".join(parts) or "-"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.2f} s" if seconds >= 10 else f"{seconds * 1e3:.2f} ms"


def print_result(result: Any, console: Any) -> None:
    from rich.table import Table

    console.print(f"[bold]plait plan[/]: {result.model} on {result.cluster} "
                  f"({result.world_size} GPUs), global batch {result.global_batch}")
    pruned = ", ".join(f"{n} {r}" for r, n in sorted(result.pruned_reasons.items(), key=lambda x: -x[1])) or "none"
    console.print(f"candidates: {result.enumerated} enumerated, {result.pruned} pruned ({pruned}), "
                  f"{result.ranked_analytic} fit, {result.simulated} simulated "
                  f"in {result.search_time_s:.1f} s (ranked by the {result.ranker})")
    kinds = sorted({k for c in result.top for k in c.headroom_by_kind})
    table = Table(title=f"top {len(result.top)} plans (predicted by the {result.ranker})")
    for name in ("#", "dp", "tp", "pp", "mb"):
        table.add_column(name, justify="right")
    for name in ("recompute", "zero", "schedule", "sp", "layout", "uneven split"):
        table.add_column(name)
    table.add_column("iteration", justify="right")
    table.add_column("TFLOP/s/GPU", justify="right")
    table.add_column("samples/s", justify="right")
    for k in kinds:
        table.add_column(f"free {k}", justify="right")
    for i, c in enumerate(result.top, 1):
        p = c.plan
        schedule = p.schedule + (f" x{p.virtual_stages}" if p.virtual_stages > 1 else "")
        row = [str(i), str(p.dp), str(p.tp), str(p.pp), str(p.micro_batch), p.recompute, str(p.zero), schedule,
               "yes" if p.sequence_parallel else "-", c.layout, _uneven(c), _ms(c.time_s),
               f"{c.tflops_per_gpu:.2f}" if c.tflops_per_gpu is not None else "-",
               f"{c.throughput:.1f}" if c.throughput is not None else "-"]
        row += [f"{c.headroom_by_kind[k] / GiB:.1f} GiB" if k in c.headroom_by_kind else "-" for k in kinds]
        table.add_row(*row)
    console.print(table)
    best = result.best
    if best.placement is not None:
        pl = best.placement
        line = (f"placement (Pipette annealing): path-model communication {_ms(pl.cost)} vs "
                f"{_ms(pl.default_cost)} in the default rank order ({pl.gain:.2f}x)")
        if best.default_order_time_s and best.iteration_time_s:
            line += (f"; simulated iteration {_ms(best.iteration_time_s)} vs "
                     f"{_ms(best.default_order_time_s)} "
                     f"({best.default_order_time_s / best.iteration_time_s:.2f}x)")
        console.print(line)
    console.print(f"best: [bold]{best.plan}[/]")
