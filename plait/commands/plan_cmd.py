"""`plait plan`: find the fastest 3D plan that fits, place it, and optionally run it.

    plait plan                                   # built-in small GPT on the emulated mixed cluster
    plait plan --model gpt:size=1.3b --cluster a100-80g:nodes=4 --global-batch 512 --top 5
    plait plan ... --out plan.json               # then: plait simulate/run --plan plan.json
    plait plan ... --export megatron             # equivalent Megatron-LM launch arguments
    plait plan ... --out plan.json --export slurm  # an sbatch script running the plan with plait run
    plait plan --run                             # train the chosen plan a few steps, predicted vs measured
    plait plan --family spmd --global-batch 64 --run  # a HAP-style SPMD program (plait.commands.spmd_plan)
    plait plan --cluster fabric.yaml --traffic-plan --out plan.json  # plan its flows' fabric paths (C4P)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from plait.cluster import load_cluster
from plait.cluster.spec import Cluster
from plait.commands.traffic_plan import TrafficOutcome, add_traffic_args
from plait.commands.training_args import (
    add_memory_args,
    add_training_args,
    memory_kwargs_of,
    precision_of,
    training_of,
)
from plait.ir.plan import Plan
from plait.planners.export import FORMATS
from plait.search import (
    DEFAULT_CLUSTER,
    DEFAULT_GLOBAL_BATCH,
    DEFAULT_MODEL,
    FAMILIES,
    ComposeOptions,
    GraphOptions,
    PlanResult,
    SearchOptions,
    SearchSpace,
    SpmdOptions,
    ThreeDOptions,
    resolve_families,
)

GiB = 2**30
# Plans whose predicted times differ by less than this, and only in options, share a table row.
FOLD_TOLERANCE = 0.01
FOLD_EXTRA = 4  # plans asked of the search per table row, so that folded rows leave enough distinct ones


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
    p.add_argument("--family", choices=("all", *FAMILIES), default="all",
                   help="planner family: all (default: every family, ranked together by the simulator), 3d "
                        "(data x tensor x pipeline), graph (GraphPipe: a DAG of pipeline stages for "
                        "multi-branch models), spmd (an op-level SPMD program with uneven per-device "
                        "ratios: HAP, plait.spmd), compose (SPMD programs inside pipeline stages) or any "
                        "other family registered with plait.search.register_family")
    p.add_argument("--space", metavar="SPEC", default=None,
                   help="restrict the 3D search, e.g. \"tp=1,2 pp=1,2,4 mb=1,2 recompute=none zero=0,1 "
                        "schedule=1f1b sp=off dp=8\" (plait.search.space; searches the 3D family only)")
    p.add_argument("--top", type=int, default=5, help="how many plans to print (default 5)")
    p.add_argument("--finalists", type=int, default=12,
                   help="analytically best candidates to place and simulate (default 12; 0 = all)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--wide", action="store_true",
                   help="every column of the plan table, whatever the terminal width (default: fit the terminal)")
    p.add_argument("--out", metavar="FILE", help="write the best plan as JSON (for plait simulate/run --plan)")
    p.add_argument("--export", choices=FORMATS, help="print the best plan as launch args/config of this framework")
    p.add_argument("--run", action="store_true", help="train the best plan a few steps and compare with the prediction")
    p.add_argument("--steps", type=int, default=8, help="steps for --run and the exported launch (default 8; the "
                                                        "first 2 are warm-up)")
    add_training_args(p)
    add_memory_args(p)
    p.add_argument("--no-machine-prediction", action="store_true",
                   help="with --run on an emulated cluster: skip calibrating this machine (about 30 s) and "
                        "the prediction for it")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes of the search (default: this machine's CPUs, up to 8, on clusters "
                        "of 256 GPUs or more, else 1; or the environment variable PLAIT_JOBS); the same "
                        "plans whatever the number")
    p.add_argument("--seed", type=int, default=0, help="seed of the placement annealing (default 0)")
    p.add_argument("--no-placement", action="store_true", help="keep Megatron's rank order")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--dtype", choices=("fp32", "tf32", "bf16", "fp16"), default=None,
                   help="training dtype of every family's plans: fp32, tf32 (fp32 tensors, TF32 tensor-core "
                        "matmuls; fp32 where a GPU has no TF32 unit), bf16 or fp16 (mixed precision). Default: "
                        "bf16, or fp16 where a GPU kind has no bf16 unit (V100, T4); fp32 for --family spmd "
                        "(CPU ranks compute fp32 fastest)")
    p.add_argument("--max-states", type=int, default=20_000,
                   help="--family spmd: states of the exact program search before its beam search (default 20000)")
    add_traffic_args(p)
    p.set_defaults(func=run)


def search(model: str, cluster: Cluster, common: SearchOptions, families: str,
           options: list[object]) -> PlanResult:
    """`plait.search.search_plans` with every family's finalists timed by the one simulator of
    `cluster` (`plait.sim.api.PlanSimulator`), as `plait.api.plan` runs it."""
    from plait.search import search_plans
    from plait.sim.api import PlanSimulator

    return search_plans(model, cluster, simulator=PlanSimulator(cluster), common=common, families=families,
                        options=options)


def run(args: argparse.Namespace) -> int:
    from plait.commands.traffic_plan import traffic_plan

    space = _parse_space(args)
    if args.family == "spmd":
        from plait.commands.spmd_plan import run as run_spmd

        return run_spmd(args)
    jobs, fabric_cluster = _check_args(args)
    if args.family == "graph":
        return _run_graph(args)
    families, common, options, space = _search_options(args, space, jobs)
    cluster = load_cluster(args.cluster)  # resolved here, once: the search and the export read it
    result = search(args.model, cluster, common, families, options)
    best = result.best
    traffic = traffic_plan(args.model, fabric_cluster, best.plan, settings=bool(args.out), precision=precision_of(args)) \
        if fabric_cluster is not None else None
    best_plan = traffic.plan if traffic is not None else best.plan  # with its flows' paths
    exported = _export(args, best_plan, cluster) if args.export else None
    if args.out:
        _write_out(args, result, best_plan, traffic)
    measured = _run(args, result) if args.run else None
    if args.json:
        _print_json(args, result, exported, measured, traffic)
    else:
        _print_text(args, result, space, traffic, exported, measured)
    return 0


def _parse_space(args: argparse.Namespace) -> SearchSpace | None:
    """--space as a SearchSpace, None without it; a bad spec (or a family it does not restrict)
    fails before any work."""
    from plait.errors import PlaitError

    if args.space is None:
        return None
    from plait.search.space import parse_space

    space = parse_space(args.space)
    if args.family not in ("all", "3d"):
        raise PlaitError(f"--space restricts the 3D family's degrees and options; --family {args.family} "
                         "does not take it")
    return space


def _check_args(args: argparse.Namespace) -> tuple[int | None, Cluster | None]:
    """The options checked before any work: returns the --jobs count (None: the default) and, with
    --traffic-plan, the fabric cluster its flows are planned on."""
    from plait.commands.traffic_plan import check_traffic_cluster
    from plait.errors import PlaitError, check_output_path
    from plait.workers import check_jobs, default_jobs

    if args.top < 1:
        raise PlaitError(f"--top: must be >= 1, got {args.top}")
    if args.steps < 1:
        raise PlaitError(f"--steps: must be >= 1, got {args.steps}")
    check_output_path(args.out, "--out")
    if args.export == "slurm" and not args.out:
        raise PlaitError("--export slurm: give --out PLAN.json too (the script runs `plait run --plan PLAN.json`)")
    jobs = None if args.jobs is None else check_jobs(args.jobs, "--jobs")
    if jobs is None:
        default_jobs()  # a bad PLAIT_JOBS fails before any work
    fabric_cluster = check_traffic_cluster(args.cluster) if args.traffic_plan else None
    return jobs, fabric_cluster


def _search_options(args: argparse.Namespace, space: SearchSpace | None,
                    jobs: int | None) -> tuple[str, SearchOptions, list[object], SearchSpace | None]:
    """The families searched for these arguments, what every family is asked, the options of each
    family searched that has flags here, and the 3D space searched (None: unrestricted)."""
    # `all`: graph pipelines and SPMD programs compete with the 3D plans; with --run (or a plan to
    # export or place on fabric paths) only what the runtime runs and the frameworks express.
    families = args.family
    if families == "all" and (args.export or args.traffic_plan or space is not None):
        families = "3d"
    if args.export and families == "3d":  # frameworks split the global batch evenly
        space = dataclasses.replace(space or SearchSpace(), uneven_dp=False)
    # The table folds near-duplicates (fold_plans), so it asks for more plans than rows it shows.
    common = SearchOptions(global_batch=args.global_batch, top=args.top if args.json else args.top * FOLD_EXTRA,
                           dtype=args.dtype, jobs=jobs, progress=not args.no_progress and not args.json,
                           precision=precision_of(args))
    runnable = args.family == "all" or args.run
    memory = memory_kwargs_of(args)
    flagged = [ThreeDOptions(finalists=None if args.finalists == 0 else args.finalists, space=space,
                             placement=not args.no_placement, seed=args.seed, memory_kwargs=memory),
               GraphOptions(runnable=runnable, memory_kwargs=memory), SpmdOptions(runnable=runnable),
               ComposeOptions(runnable=runnable)]
    searched = {FAMILIES[name].options for name in resolve_families(families)}
    return families, common, [o for o in flagged if type(o) in searched], space


def _export(args: argparse.Namespace, best_plan: Plan, cluster: Cluster) -> str:
    """--export: the best plan as the framework's launch args/config; a slurm script is also
    written beside the plan file it runs."""
    from plait.planners.export import export

    launch = {"model": args.model, "cluster_file": args.cluster, "plan_file": args.out} \
        if args.export == "slurm" else None
    exported = export(best_plan, args.export, _model_config(args.model), cluster, launch,
                      training_of(args))
    if args.export == "slurm":  # beside the plan file it runs: submit with `sbatch PLAN.sbatch`
        script = Path(args.out).with_suffix(".sbatch")
        script.write_text(exported)
    return exported


def _write_out(args: argparse.Namespace, result: PlanResult, best_plan: Plan, traffic: TrafficOutcome | None) -> None:
    """--out: the best plan, each family's best beside it and, planned, its flows' fabric settings."""
    best_plan.save(args.out)
    from plait.search.summary import search_path, write_summary

    write_summary(result, search_path(args.out))  # `plait report` shows each family's best
    if traffic is not None and traffic.report is not None and traffic.report.settings is not None:
        Path(args.out).with_suffix(".traffic.json").write_text(json.dumps(traffic.report.settings, indent=1))


def _print_json(args: argparse.Namespace, result: PlanResult, exported: str | None, measured: dict[str, Any] | None,
                traffic: TrafficOutcome | None) -> None:
    """--json: the search result with what the other options produced."""
    out = result.to_dict()
    if exported is not None:
        out["export"] = {"format": args.export, "text": exported}
    if measured is not None:
        out["run"] = measured
    if traffic is not None:
        out["traffic_plan"] = traffic.to_dict()
    if args.out:
        out["out"] = args.out
    print(json.dumps(out, indent=2))


def _print_text(args: argparse.Namespace, result: PlanResult, space: SearchSpace | None,
                traffic: TrafficOutcome | None, exported: str | None, measured: dict[str, Any] | None) -> None:
    """The plan table and, after it, what the other options produced and wrote."""
    from rich.console import Console

    from plait.commands.traffic_plan import print_traffic

    columns = shutil.get_terminal_size().columns
    console = Console(width=max(columns, 1000) if args.wide else columns)
    print_result(result, console, wide=args.wide, top=args.top)
    if space is not None:
        from plait.search.space import describe

        console.print(f"--space: the 3D family only, restricted to {describe(space)}", soft_wrap=True)
    if traffic is not None:
        print_traffic(traffic, console)
    if args.out:
        from plait.search.summary import search_path

        console.print(f"best plan written to [bold]{args.out}[/] "
                      f"(plait simulate --plan {args.out} / plait run --plan {args.out}); each family's "
                      f"best to {search_path(args.out)} (plait report)")
    if args.export == "slurm":
        console.print(f"sbatch script written to [bold]{Path(args.out).with_suffix('.sbatch')}[/] "
                      f"(submit: sbatch {Path(args.out).with_suffix('.sbatch')})")
    if exported is not None:
        console.print(f"\n[bold]{args.export}[/] equivalent:")
        sys.stdout.write(exported)
    if measured is not None:
        _print_run(measured, console)


def _run_graph(args: argparse.Namespace) -> int:
    """`plait plan --family graph`: GraphPipe's stage DAGs, ranked by the simulator."""
    from plait.errors import PlaitError

    if args.export:
        raise PlaitError("--export: graph plans (a DAG of stages) have no Megatron/DeepSpeed equivalent")
    common = SearchOptions(global_batch=args.global_batch, top=args.top, dtype=args.dtype,
                           precision=precision_of(args))
    own = GraphOptions(runnable=args.run, memory_kwargs=memory_kwargs_of(args))
    result = search(args.model, load_cluster(args.cluster), common, "graph", [own])
    if args.out:
        from plait.search.summary import search_path, write_summary

        result.best.plan.save(args.out)
        write_summary(result, search_path(args.out))  # as the default search writes it
    measured = _run(args, result) if args.run else None
    if args.json:
        out = result.to_dict()
        if measured is not None:
            out["run"] = measured
        if args.out:
            out["out"] = args.out
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(shutil.get_terminal_size().columns, 1000) if args.wide else None)
    ex = result.extra
    console.print(f"[bold]plait plan --family graph[/]: {result.model} on {result.cluster} "
                  f"({result.world_size} GPUs), global batch {result.global_batch}")
    for note in ex["notes"]:
        console.print(f"[yellow]note:[/] {note}")
    pruned = ", ".join(f"{n} {r}" for r, n in result.pruned_reasons.items()) or "none"
    console.print(f"stage graphs: {result.enumerated} from the partitioner ({ex['targets_tried']} bottleneck "
                  f"targets), pruned {pruned}, {result.simulated} simulated in {result.search_time_s:.1f} s "
                  f"(ranked by the {result.ranker})")
    table = Table(title="top graph plans")
    for col in ("#", "stages", "depth", "GPUs", "ZeRO", "iteration", "samples/s", "analytic"):
        table.add_column(col, justify="right")
    for i, c in enumerate(result.top, 1):
        depth = _stage_depth(c.plan)
        table.add_row(str(i), str(len(c.plan.stages) or c.plan.pp), str(depth), str(c.plan.world_size),
                      str(c.plan.zero), _ms(c.time_s),
                      f"{c.throughput:.1f}" if c.throughput is not None else "-", _ms(c.analytic_s))
    console.print(table)
    best = result.best.plan
    if not best.stages:  # one stage of pure data parallelism, in the 3D form (ZeRO-3 runs only there)
        console.print(f"best plan: one stage, pure data parallelism: {best}")
    st = Table(title="best plan's stages")
    for col in ("stage", "layers", "devices", "dp", "micro-batch", "feeds"):
        st.add_column(col)
    for s, spec in enumerate(best.stages):
        layers = spec.layers[0] + (f" .. {spec.layers[-1]} ({len(spec.layers)})" if len(spec.layers) > 1 else "")
        if spec.segments and len(spec.segments) > 1:  # runs per input: each run after its own inputs
            layers += " per input " + "+".join(map(str, spec.segments))
        feeds = ", ".join(best.stages[b].name for a, b in best.stage_edges if a == s) or "(loss)"
        st.add_row(spec.name, layers, ",".join(map(str, spec.devices)), str(spec.dp),
                   str(spec.micro_batch), feeds)
    if best.stages:
        console.print(st)
    bound = ex["lower_bound_s"]
    eff = ex.get("effective_depth")
    depth = ex["pipeline_depth"] if eff is None or abs(eff - ex["pipeline_depth"]) < 5e-3 else \
        f"{ex['pipeline_depth']} (effective {eff:.2f})"
    console.print(f"pipeline depth {depth}; lower bound {_ms(bound['bound'])} (the most of work "
                  f"{_ms(bound['work'])}, memory floor {_ms(bound['memory'])} and critical path "
                  f"{_ms(bound['critical_path'])}, plus the optimizer step {_ms(bound['optimizer'])}); "
                  f"optimality gap {ex['optimality_gap'] * 100:.0f} %")
    if args.out:
        from plait.search.summary import search_path

        console.print(f"best plan written to [bold]{args.out}[/] (plait simulate --plan {args.out}); the search "
                      f"to {search_path(args.out)} (plait report)")
    if measured is not None:
        _print_run(measured, console)
    return 0


def _stage_depth(plan: Plan) -> int:
    """Stages on the longest path of a plan's stage graph (a plan without stages: its pp chain)."""
    if not plan.stages:
        return plan.pp
    depth = [1] * len(plan.stages)
    for a, b in sorted(plan.stage_edges, key=lambda e: -e[0]):  # stages are in topological order
        depth[a] = max(depth[a], depth[b] + 1)
    return max(depth, default=0)


def _model_config(model: str) -> dict[str, Any]:
    from plait.graph.zoo import load_model

    return dict(load_model(model).config)


def _run(args: argparse.Namespace, result: Any) -> dict[str, Any]:
    """Train the best plan the runtime can run for a few steps; predicted next to measured.

    On an emulated cluster the prediction that can be checked is the one for this machine:
    `plait.measure.machine.LocalMachine` profiles the emulated links and the model's layers on
    the ranks' CPUs, simulates the plan from them and runs it (in fp32, as CPU ranks train)."""
    from plait.errors import PlaitError
    from plait.runtime import supports
    from plait.runtime.api import run as runtime_run

    # SPMD programs run with their own prediction: `plait plan --family spmd --run`
    runnable = [c for c in result.top if c.plan.schedule != "interleaved" and c.plan.spmd is None
                and supports(c.plan)[0]]
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
        # the CPU ranks compute fp32; calibrated for the plan's ranks, which may be fewer than the
        # cluster's devices (a graph plan's stages may leave GPUs idle)
        with LocalMachine(args.cluster, args.model, ranks=cand.plan.world_size, emulate_dtype=cand.plan.dtype,
                          say=say) as machine:
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
        if machine["warmup_steps"] == 0:  # too few steps to leave warm-up out: not a steady-state figure
            console.print(f"  predicted for this machine {_ms(machine['predicted_iteration_s'])}, measured "
                          f"{_ms(meas)} (median of all {len(run['iteration_times_s'])} steps, warm-up included: "
                          f"too few to leave it out; --steps 4 or more for a steady-state figure): "
                          f"[dim]{err * 100:+.1f} %, not judged[/]")
        else:
            console.print(f"  predicted for this machine {_ms(machine['predicted_iteration_s'])}, measured "
                          f"{_ms(meas)} (median after {machine['warmup_steps']} warm-up steps): error "
                          f"[{'green' if abs(err) <= 0.10 else 'red'}]{err * 100:+.1f} %[/]")
        console.print(f"  [dim]this machine: the ranks are CPU processes (fp32, slower kinds slowed by their "
                      f"{machine['emulated_dtype']} FLOP/s ratio, links shaped by tc); predicted from measured links "
                      f"and layer times "
                      f"(profile drift {machine['profile_drift'] * 100:+.0f} % over the run). The table above "
                      f"predicts the GPUs the cluster describes: {_ms(pred)} per iteration there.[/]")
    else:
        console.print(f"  iteration time: predicted {_ms(pred)}, measured {_ms(meas)}")
        if run["device"] == "cpu":
            console.print("  [dim]the prediction is for the GPUs the cluster describes, the measurement ran CPU "
                          "processes: they differ by the CPU/GPU speed ratio (an emulated cluster gets a "
                          "prediction for this machine unless --no-machine-prediction)[/]")
    from plait.commands.run_cmd import print_notes

    print_notes(console, machine["notes"] if machine else [], run["notes"], indent="  ")


def _uneven(c: Any) -> str:
    p = c.plan
    parts = []
    if p.layer_split is not None:
        parts.append("layers " + ":".join(map(str, p.layer_split)))
    if p.dp_shares is not None:
        parts.append("batch " + ":".join(str(n) for n in p.samples_per_replica()))
    if p.tp_ratios is not None:
        parts.append("tensor " + ":".join(f"{x:.2g}" for x in p.tp_ratios))
    if p.device_order is not None:
        parts.append("placed")
    return ", ".join(parts) or "-"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.2f} s" if seconds >= 10 else f"{seconds * 1e3:.2f} ms"


def fold_plans(cands: list[Any], tolerance: float = FOLD_TOLERANCE) -> list[list[Any]]:
    """Ranked candidates grouped into rows: a plan joins an earlier row when it has the same shape
    (dp, tp, pp, micro-batch, splits, placement, dtype, sequence parallelism) and differs only in
    options -- ZeRO level, recompute, schedule -- and its predicted time is within `tolerance`
    (relative) of that row's best. Such plans tie within the simulator's error; the row lists them
    as variants, each with its memory margin, instead of filling the table with near-duplicates."""
    groups: list[list[Any]] = []
    for c in cands:
        for g in groups:
            if _shape(g[0]) == _shape(c) and abs(c.time_s - g[0].time_s) <= tolerance * g[0].time_s:
                g.append(c)
                break
        else:
            groups.append([c])
    return groups


_OPTIONS = ("zero", "recompute", "schedule", "virtual_stages")


def _shape(c: Any) -> tuple[Any, ...]:
    p = c.plan
    split = p.layer_split if p.virtual_stages == 1 else None  # interleaving re-cuts the layers
    return (p.dp, p.tp, p.pp, p.micro_batch, p.sequence_parallel, p.dtype, split, p.dp_shares, p.tp_ratios,
            p.device_order, str(p.stages), c.layout, getattr(c, "family", "3d"), str(p.spmd))


def _variants(group: list[Any]) -> str:
    """'zero=0 79.0G, zero=1 79.1G, ...': the options that differ inside a folded row, with each
    variant's memory margin (the least free memory over its GPUs)."""
    if len(group) == 1:
        return ""
    varying = [o for o in _OPTIONS if len({getattr(c.plan, o) for c in group}) > 1]
    by_margin: dict[str, list[str]] = {}  # variants with the same margin share one entry
    for c in group:
        label = " ".join(f"{o}={getattr(c.plan, o)}" for o in varying)
        by_margin.setdefault(f"{_margin(c) / GiB:.1f}G", []).append(label)
    if len(varying) == 1:
        prefix = _SHORT[varying[0]]
        return ", ".join(prefix + "|".join(lab.split("=", 1)[1] for lab in labels) + f" {m}"
                         for m, labels in by_margin.items())
    return ", ".join(" | ".join(labels) + f" {m}" for m, labels in by_margin.items())


_SHORT = {"zero": "zero ", "recompute": "rc ", "schedule": "", "virtual_stages": "x"}


def _margin(c: Any) -> float:
    return min(c.headroom_by_kind.values()) if c.headroom_by_kind else float("nan")


# Plan-table columns: (header, right-aligned, priority). Narrow terminals drop the lowest priority
# first; --wide shows them all.
_COLUMNS = [("#", True, 100), ("family", False, 98), ("dp", True, 99), ("tp", True, 99), ("pp", True, 99), ("mb", True, 98),
            ("iteration", True, 97), ("costs", False, 96), ("options", False, 90), ("uneven split", False, 85), ("variants", False, 80),
            ("min free", True, 75), ("samples/s", True, 60), ("layout", False, 50), ("TFLOP/s/GPU", True, 40)]


def _costs_cell(c: Any) -> str:
    """What the row's simulation measured (a model profile) vs modelled; "-" where nothing was
    measured (then the line under the table says so for every row)."""
    text = (c.sim or {}).get("costs", "")
    if "measured" not in text or "per-layer times" in text:
        return "-"
    return text.split(" (profile ")[0].removeprefix("compute ")


def _cells(c: Any, group: list[Any], index: int, kinds: list[str]) -> dict[str, str]:
    p = c.plan
    schedule = p.schedule + (f" x{p.virtual_stages}" if p.virtual_stages > 1 else "")
    opts = schedule + (f" zero{p.zero}" if p.zero else "") + (f" rc={p.recompute}" if p.recompute != "none" else "") + (
        " sp" if p.sequence_parallel else "")
    family = getattr(c, "family", "3d")
    if family == "graph" and p.stages:  # (a one-stage graph is pure data parallelism, in the 3D form)
        opts = f"{len(p.stages)} stages, " + ", ".join(sorted({f"dp{s.dp}" for s in p.stages}))
    elif family == "spmd" and p.spmd is not None:
        r = p.spmd.ratios
        vec = r[0] if r and isinstance(r[0], list) else r
        opts = "SPMD program, ratios " + ":".join(f"{x:.2f}" for x in vec[:8]) + (" ..." if len(vec) > 8 else "")
    cells = {"#": str(index), "family": family, "dp": str(p.dp), "tp": str(p.tp), "pp": str(p.pp), "mb": str(p.micro_batch),
             "iteration": _ms(c.time_s), "options": opts, "uneven split": _uneven(c),
             "variants": _variants(group), "min free": f"{_margin(c) / GiB:.1f} GiB",
             "samples/s": f"{c.throughput:.1f}" if c.throughput is not None else "-", "layout": c.layout,
             "TFLOP/s/GPU": f"{c.tflops_per_gpu:.2f}" if c.tflops_per_gpu is not None else "-",
             "costs": _costs_cell(c)}
    for k in kinds:
        cells[f"free {k}"] = f"{c.headroom_by_kind[k] / GiB:.1f} GiB" if k in c.headroom_by_kind else "-"
    return cells


def plan_table(result: Any, width: int | None, top: int | None = None) -> tuple[Any, list[str]]:
    """The top plans as a rich Table that fits `width` columns (None: every column), with
    near-duplicates folded (`fold_plans`); returns (table, names of the columns left out)."""
    from rich.table import Table

    groups = fold_plans(result.top)[:top]
    kinds = sorted({k for c in result.top for k in c.headroom_by_kind})
    rows = [_cells(g[0], g, i, kinds) for i, g in enumerate(groups, 1)]
    columns = [c for c in _COLUMNS if (any(r[c[0]] not in ("", "-") for r in rows) or c[2] >= 97)
               and (c[0] != "family" or any(r["family"] != "3d" for r in rows))]
    if len(kinds) > 1:  # per-kind margins: in wide tables
        columns += [(f"free {k}", True, 30) for k in kinds]
    hidden: list[str] = []
    if width is not None:
        def natural(col: tuple[str, bool, int]) -> int:  # cell text + rich's padding and rule
            return max(len(col[0]), *(min(len(r[col[0]]), 40) for r in rows)) + 3

        while sum(natural(c) for c in columns) + 1 > width and len(columns) > 6:
            drop = min(columns, key=lambda c: c[2])
            columns.remove(drop)
            hidden.append(drop[0])
    folded = sum(len(g) for g in groups) - len(groups)
    title = f"top {len(groups)} plans (predicted by the {result.ranker})"
    if folded:
        title += f"; {folded} near-duplicates folded (< {FOLD_TOLERANCE:.0%} apart, options only)"
    table = Table(title=title, caption="variants: options within 1 % of the row's time, each with its least free "
                  "GPU memory" if any(len(g) > 1 for g in groups) and any(c[0] == "variants" for c in columns) else None)
    for name, right, _ in columns:
        table.add_column(name, justify="right" if right else "left", overflow="fold")
    for r in rows:
        table.add_row(*(r[name] for name, _, _ in columns))
    return table, hidden


def print_result(result: Any, console: Any, wide: bool = False, top: int | None = None) -> None:
    console.print(f"[bold]plait plan[/]: {result.model} on {result.cluster} "
                  f"({result.world_size} GPUs), global batch {result.global_batch}")
    pruned = ", ".join(f"{n} {r}" for r, n in sorted(result.pruned_reasons.items(), key=lambda x: -x[1])) or "none"
    console.print(f"candidates: {result.enumerated} enumerated, {result.pruned} pruned ({pruned}), "
                  f"{result.ranked_analytic} fit, {result.simulated} simulated "
                  f"in {result.search_time_s:.1f} s (ranked by the {result.ranker})")
    families = getattr(result, "families", {}) or {}
    if families:
        best_of = {n: (f"{_ms(r.best.time_s)} in {r.search_time_s:.1f} s" if not isinstance(r, str) else f"none ({r})")
                   for n, r in families.items()}
        console.print("families: " + "; ".join(f"{n} {v}" for n, v in best_of.items()), soft_wrap=True)
    table, hidden = plan_table(result, None if wide else console.width, top)
    console.print(table)
    if hidden:
        console.print(f"[dim]{', '.join(hidden)} left out to fit {console.width} columns (--wide shows them)[/]")
    lines = sorted({(c.sim or {}).get("costs", "") for c in result.top} - {""})
    if lines:  # measured vs modelled (issue 28): per row in the costs column where a profile measured some
        console.print("costs: " + "; ".join(lines), soft_wrap=True)
    best = result.best
    if best.placement is not None:
        pl = best.placement
        line = (f"placement (Pipette annealing): path-model communication {_ms(pl.cost)} vs "
                f"{_ms(pl.default_cost)} in the default rank order ({pl.gain:.2f}x)")
        if best.placed_time_s:
            line += (f"; simulated, the annealed order takes {_ms(best.placed_time_s)} and the start order "
                     f"{_ms(best.iteration_time_s)}: the start order is kept")
        elif best.default_order_time_s and best.iteration_time_s:
            line += (f"; simulated iteration {_ms(best.iteration_time_s)} vs "
                     f"{_ms(best.default_order_time_s)} "
                     f"({best.default_order_time_s / best.iteration_time_s:.2f}x)")
        console.print(line)
    console.print(f"best: [bold]{best.plan}[/]", soft_wrap=True)
