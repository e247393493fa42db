"""`plait plan --family spmd`: synthesize a HAP-style SPMD program for the cluster, print it, and
with `--run` train it (and the same program at even ratios) on the emulated cluster.

    plait plan --family spmd --model bert:layers=2,hidden=256 --global-batch 32 --out spmd.json
    plait run --model bert:layers=2,hidden=256 --plan spmd.json        # the same program, run
    plait plan --family spmd ... --run                                 # predicted vs measured, vs even

Predictions: on the cluster's GPUs, `plait.spmd`'s cost model (`Synthesis.cost`). For this
machine (`--run` on an emulated cluster) the same cost model on this machine's devices
(`machine_devices`, `machine_pieces`): each rank's compute speed is its own, measured by the
ranks of each run side by side before and after their steps on the CPU clock (so the
interpreter's overhead is in it, and other jobs' load is not): each rank's own program alone (its
shards at the plan's ratios, its conversions' local work; collectives on a `NullGroup`), and the
whole program; divided by the rank's emulated slowdown. Its links are alpha-beta fitted to
all-gathers the ranks time before training (`spmd_calibrate`). Added: the outputs' gather, the
loss, its all-reduce and each rank's optimizer step. Not in the prediction: the steps' host work
between spans and what the compute spans lose to cold caches after each collective and sleep (a
few ms per step per rank, stretched by a slow rank's slowdown; `step_pieces` measures them).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.errors import PlaitError

if TYPE_CHECKING:
    from plait.cluster.spec import Cluster, ClusterSource
    from plait.ir.plan import Plan


@dataclass
class SpmdChoice:
    """A synthesized program and what `plait plan --family spmd` says about it."""

    model: str
    cluster: Cluster
    graph: Any
    problem: Any
    synthesis: Any
    plan: Plan  # with `spmd`
    even_plan: Plan  # the same program at even ratios
    even_cost: float  # its predicted time on the cluster's GPUs
    dtype: str
    # The graph the ranks interpret: captured in fp32 (fp32 master parameters; their ops autocast to
    # `dtype` as the run computes), `graph` itself when dtype is fp32. The machine prediction prices
    # `graph`, the program in the plan's dtype, as `--run` trains it.
    run_graph: Any = None

    def machine_program(self) -> Any:
        """The program as `--run` trains it on this machine: in the plan's dtype, its collectives
        at that dtype's bytes (the synthesis's own)."""
        return self.synthesis.program


def synthesize_plan(model: str, cluster: ClusterSource | None, batch: int, *, dtype: str = "fp32",
                    optimizer: str = "adam", max_states: int = 20_000) -> SpmdChoice:
    """Capture `model` at `batch` (meta device), synthesize for `cluster`, and the plans."""
    from plait.cluster import load_cluster
    from plait.cost.program import Problem
    from plait.cost.spmd import Devices
    from plait.graph.aten_stage import free_outputs
    from plait.graph.zoo import load_model
    from plait.search.spmd_family import synthesize_program
    from plait.sim.api import PlanSimulator
    from plait.spmd.program_plan import capture_graph, plan_collectives, program_plan
    from plait.spmd.ratios import segmented_cost

    spec = load_model(model)
    cluster_obj = load_cluster(cluster)
    graph = capture_graph(spec, batch, dtype)  # the program's dtype: messages priced at its bytes
    problem = Problem.build(graph, Devices.from_cluster(cluster_obj, dtype), outputs_free=free_outputs(graph, loss=True))
    syn, _, _ = synthesize_program(problem, PlanSimulator(cluster_obj), batch=batch, dtype=dtype, optimizer=optimizer,
                                   max_states=max_states)
    ratios = syn.segment_ratios if syn.segment_ratios is not None else syn.ratios
    segs = syn.segments
    n = problem.devices.n
    even = np.full_like(np.atleast_2d(np.asarray(ratios, dtype=float)), 1.0 / n)
    from plait.cost.program import Segments

    segs = segs or Segments.single(problem, syn.program)
    even_cost = segmented_cost(problem, syn.program, segs, even)
    plan = program_plan(syn.program.strategies, ratios, batch, model=spec.spec, predicted_s=syn.cost, dtype=dtype,
                        collectives=plan_collectives(syn.program.comms, problem.devices, ratios),
                        homes=syn.program.homes)
    # the even program runs the same collectives the same way (its predicted time prices them so)
    even_plan = program_plan(syn.program.strategies, even, batch, model=spec.spec, predicted_s=even_cost,
                             dtype=dtype, collectives=plan.spmd.collectives, homes=syn.program.homes)
    run_graph = graph if dtype == "fp32" else capture_graph(spec, batch, "fp32")
    return SpmdChoice(spec.spec, cluster_obj, graph, problem, syn, plan, even_plan, even_cost, dtype, run_graph)


def summary(choice: SpmdChoice) -> dict[str, Any]:
    syn, problem = choice.synthesis, choice.problem
    strategies = syn.program.strategies.values()
    comms = Counter(f"{c.phase} {c.op}" for _, c in syn.program.comms)
    return {
        "model": choice.model, "cluster": choice.cluster.name, "devices": list(problem.devices.names),
        "dtype": choice.dtype, "global_batch": choice.plan.global_batch, "ops": len(choice.graph.ops),
        "sharded_ops": sum(1 for s in strategies if s.splits_work),
        "collectives": dict(sorted(comms.items())), "segments": int(syn.segments.count) if syn.segments else 1,
        "ratios": [round(float(x), 4) for x in syn.ratios],
        "predicted_iteration_s": syn.cost, "predicted_even_s": choice.even_cost,
        "predicted_speedup_over_even": choice.even_cost / syn.cost if syn.cost > 0 else None,
        "memory_bytes": [float(x) for x in syn.memory], "capacity_bytes": [float(x) for x in syn.capacity],
        "fits": syn.fits, "search_rounds": syn.rounds, "states_expanded": syn.expanded,
        "optimal_search": bool(syn.program.optimal), "synthesis_s": syn.seconds,
    }


def search_result(choice: SpmdChoice, seconds: float) -> Any:
    """The program as the search driver's one-family result (`plait.search.spmd_family`'s shape:
    one candidate timed by the synthesis's cost), for the search file `plait report` reads."""
    from plait.planners.types import Candidate, PlanResult

    syn = choice.synthesis
    peaks = [int(x) for x in syn.memory]
    free: dict[str, int] = {}
    for d, peak in zip(choice.cluster.devices, peaks):  # a program uses every device
        free[d.kind.name] = min(free.get(d.kind.name, d.kind.memory_bytes), d.kind.memory_bytes - peak)
    cand = Candidate(plan=choice.plan, analytic_s=float(syn.cost), family="spmd", peak_bytes=peaks,
                     headroom_by_kind=free, throughput=choice.plan.global_batch / float(syn.cost))
    return PlanResult(model=choice.model, cluster=choice.cluster.name, global_batch=choice.plan.global_batch,
                      world_size=choice.cluster.num_devices, top=[cand], enumerated=1, memory_checked=1,
                      ranked_analytic=1, search_time_s=seconds, ranker="analytic", family="spmd")


# ----------------------------------------------------------------------------- this machine
@dataclass
class OneRank:
    """Seconds of the whole program's parts on one rank of this machine (one thread, every op
    whole): one figure for every rank, or an array with each rank's own."""

    program: Any  # forward + backward of the aten ops
    loss: Any  # the loss on the whole outputs, forward + backward
    optimizer: Any  # one optimizer step over every parameter
    own: Any = None  # each rank's own program alone (its shards, its conversions' local work), fwd + bwd


def program_seconds(choice: SpmdChoice, repeats: int = 3, optimizer: str = "adam") -> OneRank:
    """Median seconds of the program's parts on one rank of this machine, in this process
    (`plait.runtime.spmd_worker.whole_program_seconds`; `--run` takes the same timing inside
    the ranks, side by side, before and after their steps)."""
    from plait.graph.zoo import load_model
    from plait.runtime.amp import autocast_for
    from plait.runtime.partition import make_samples
    from plait.runtime.spmd_worker import whole_program_seconds

    spec = load_model(choice.model)
    inputs, target = make_samples(spec, 0, choice.plan.global_batch, 0)
    with autocast_for(choice.dtype):  # as the ranks compute
        t = whole_program_seconds(choice.run_graph, spec.build(seed=0), spec.loss, inputs, target,
                                  {"name": optimizer}, repeats, threads=1)
    return OneRank(t["program"], t["loss"], t["optimizer"])


def ranks_timing(calibration: dict[str, Any], clock: str = "cpu") -> OneRank | None:
    """Each rank's whole-program timing from the run's calibration (`program_s` before the steps,
    `program_s_after` after them; their mean per rank), as per-rank arrays; None without them.

    `clock` "cpu": the ranks' thread CPU seconds -- what each part costs with a CPU to the rank,
    as the prediction assumes, whatever else shares the machine (wall seconds under other jobs'
    load run 1.5-8x longer, and by how much changes from second to second); "wall": wall seconds."""
    taken = [calibration[k] for k in ("program_s", "program_s_after") if calibration.get(k)]
    if not taken:
        return None

    def read(t: dict[str, Any], part: str) -> float:
        return float(t.get(f"{part}_cpu", t[part]) if clock == "cpu" else t[part])

    parts = [np.mean([[read(r, k) for r in t] for t in taken], axis=0) for k in ("program", "loss", "optimizer")]
    own = None
    if all("own" in r for t in taken for r in t):
        own = np.mean([[read(r, "own") for r in t] for t in taken], axis=0)
    return OneRank(*parts, own=own)


def machine_devices(choice: SpmdChoice, one_rank_s: Any, slowdowns: list[float],
                    calibration: dict[str, Any], ratios: Any = None, own_s: Any = None) -> Any:
    """`plait.cost.spmd.Devices` of this machine's emulated ranks: the fastest kind's FLOP/s and
    memory bandwidth scaled so the program's modelled work takes `one_rank_s` (one figure, or one
    per rank: each rank's own speed), each rank slowed by its emulated factor; links alpha-beta
    fitted to the ranks' all-gathers (`fit_links`). With `own_s` (each rank's own program at
    `ratios`, timed alone: `OneRank.own`) each rank's speed is set so the model's work of its share
    takes that long instead: its shard shapes and its conversions' local work are then in it."""
    from plait.cost.collectives import GroupLinks
    from plait.cost.spmd import Devices, op_work

    dev = choice.problem.devices
    fastest = int(np.argmax(dev.flops))
    one = Devices(dev.names[:1], dev.flops[fastest:fastest + 1], dev.mem_bw[fastest:fastest + 1],
                  dev.memory[:1], dev.links)
    work = sum(float(op_work(op, choice.graph, one)[0]) for op in choice.graph.ops)
    if own_s is not None and ratios is not None:  # the whole program's time at each rank's own speed
        one_rank_s = np.asarray(own_s, dtype=float) * work / share_work(choice, one, ratios, dev.n)
    scale = work / np.asarray(one_rank_s, dtype=float)  # each CPU is `scale` x the fastest kind's modelled speed
    slow = np.asarray(slowdowns, dtype=float)
    n = dev.n
    # the least of each size's repeats when the run gives them: the links undisturbed by other jobs
    # (as the compute on the CPU clock), the median otherwise
    alpha, bw = fit_links(np.asarray(calibration.get("all_gather_min") or calibration["all_gather"], dtype=float), n)
    links = GroupLinks(n, bw, alpha, 1, n, bw, alpha, bw, alpha)
    return Devices(dev.names, dev.flops[fastest] * scale / slow, dev.mem_bw[fastest] * scale / slow, dev.memory,
                   links)


def fit_links(rows: np.ndarray, n: int) -> tuple[float, float]:
    """(alpha seconds, bandwidth bytes/s) of the ring all-gather ``t = (n-1) a + (n-1)/n S / B``
    (`plait.cost.collectives.ring_all_gather_time`) fitted to `rows` of [total bytes, seconds] in
    relative error (each row weighted by 1 / its time): every size counts alike, so the small
    messages that SPMD programs of this machine's size mostly move keep their latency (an
    unweighted fit, led by the 8 MB row, put alpha at 0 and priced 8 KB gathers 3x too fast)."""
    design = np.column_stack([np.full(len(rows), n - 1.0), (n - 1.0) / n * rows[:, 0]])
    weight = 1.0 / np.maximum(rows[:, 1], 1e-12)
    (alpha, inv_bw), *_ = np.linalg.lstsq(design * weight[:, None], rows[:, 1] * weight, rcond=None)
    return max(float(alpha), 0.0), 1.0 / max(float(inv_bw), 1e-15)


def machine_prediction(choice: SpmdChoice, devices: Any, ratios: Any, one: OneRank | None = None,
                       slowdowns: list[float] | None = None) -> float:
    """The program's iteration on this machine's `devices`: the sum of `machine_pieces`."""
    return sum(machine_pieces(choice, devices, ratios, one, slowdowns).values())


def machine_pieces(choice: SpmdChoice, devices: Any, ratios: Any, one: OneRank | None = None,
                   slowdowns: list[float] | None = None) -> dict[str, float]:
    """The program's iteration on this machine's `devices`, piece by piece: `plait.spmd`'s cost
    of its ops ("compute") and of their collectives ("comm") at the ratios, plus what the runtime
    adds around them (with `one`, `slowdowns`) -- the outputs' gather to every rank ("gather"),
    the loss (the slowest rank finishes last), the all-reduce of the step's loss when each rank
    computed it on its own batch rows ("loss_comm": nothing gathered then) and each rank's
    optimizer step over its own parameter elements."""
    from plait.cost.program import Problem, Segments
    from plait.cost.spmd import comm_time
    from plait.graph.aten_stage import batch_loss_output, free_outputs
    from plait.ir.program import Comm, shard_dim
    from plait.runtime.spmd_program import compile_program
    from plait.spmd.ratios import segmented_cost

    problem = Problem.build(choice.graph, devices, outputs_free=free_outputs(choice.graph, loss=True))
    syn = choice.synthesis
    program = choice.machine_program()
    segs = syn.segments or Segments.single(problem, program)
    r = np.atleast_2d(np.asarray(ratios, dtype=float))
    compute = segmented_cost(problem, dataclasses.replace(program, comms=[]), segs, r)
    out = {"compute": compute, "comm": segmented_cost(problem, program, segs, r) - compute}
    if one is None:
        return out
    graph = choice.graph
    slow = np.asarray(slowdowns if slowdowns is not None else np.ones(devices.n), dtype=float)
    made = {t: p for op in graph.ops for t, p in zip(op.outputs, syn.program.strategies[op.name].outputs)}
    batch_loss = batch_loss_output(graph, syn.program.strategies) if len(graph.outputs) == 1 else None
    loss_share = np.ones(devices.n)  # each rank's part of the loss: all of it, or its batch rows
    out["gather"] = out["loss_comm"] = 0.0
    for t in graph.outputs:
        d = shard_dim(made.get(t, "R"))
        g = segs.of_dim.get((t, d), 0) if d is not None and r.shape[0] > 1 else 0
        if t == batch_loss:  # the worker's loss on its own rows, the step's loss all-reduced (one fp32)
            loss_share = r[g] / r[g].sum()
            out["loss_comm"] = comm_time(Comm("all_reduce", t, 4), devices, r[g]) if devices.n > 1 else 0.0
        elif d is not None:
            out["gather"] += comm_time(Comm("all_gather", t, graph.tensors[t].nbytes, dim=d), devices, r[g])
    out["loss"] = float(np.max(np.asarray(one.loss) * slow * loss_share))
    compiled = compile_program(graph, syn.program.strategies, r if r.shape[0] > 1 else r[0], devices.n,
                               homes=syn.program.homes)
    elements = np.zeros(devices.n)
    for t, q in compiled.stored.items():
        numel = graph.tensors[t].numel
        d = shard_dim(q)
        if d is None:
            elements += numel
        else:
            sizes = np.asarray(compiled.sizes[(t, d)], dtype=float)
            elements += numel * sizes / sizes.sum()
    whole = sum(graph.tensors[t].numel for t in compiled.stored)
    out["optimizer"] = float(np.max(np.asarray(one.optimizer) * slow * elements / max(whole, 1)))
    return out


def share_work(choice: SpmdChoice, unit: Any, ratios: Any, n: int) -> np.ndarray:
    """Modelled work of each of `n` ranks' shares on one device `unit` (`Devices` of one): its
    share of each split op, all of each redundant one."""
    from plait.cost.spmd import op_work

    r = np.atleast_2d(np.asarray(ratios, dtype=float))
    strategies = choice.synthesis.program.strategies
    segs = choice.synthesis.segments
    of_op = segs.of_op if segs is not None else {}
    total = np.zeros(n)
    for op in choice.graph.ops:
        w = float(op_work(op, choice.graph, unit)[0])
        total += w * r[of_op.get(op.name, 0)] if strategies[op.name].splits_work else w
    return total


def rank_work(choice: SpmdChoice, devices: Any, ratios: Any, slowdowns: list[float]) -> list[float]:
    """Each rank's modelled compute of the program's ops before its emulated stretch (its share of
    each split op, all of each redundant one): to set beside `step_pieces`' "cpu" of the rank, which
    also holds its loss and optimizer spans (`machine_pieces`' "loss" and "optimizer", stretched)."""
    from plait.cost.spmd import op_work

    r = np.atleast_2d(np.asarray(ratios, dtype=float))
    program = choice.machine_program()
    segs = choice.synthesis.segments
    of_op = segs.of_op if segs is not None else {}
    total = np.zeros(devices.n)
    for op in choice.graph.ops:
        w = op_work(op, choice.graph, devices)
        total += w * r[of_op.get(op.name, 0)] if program.strategies[op.name].splits_work else w
    return (total / np.asarray(slowdowns, dtype=float)).tolist()


WARMUP_STEPS = 2  # steps left out of the measured median (first calls, allocator growth)


def step_pieces(res: Any, skip: int = WARMUP_STEPS) -> dict[str, Any]:
    """Where a measured step goes, per rank (median over the steps after `skip`): "work" (compute
    spans before the emulated stretch), "stretch" (the sleep that emulates the slower kind),
    "comm" (collectives, waiting on peers included), "other" (the step less all three: the
    worker's own host time between spans, and a rank's wait for the last rank to end the step)
    and "cpu" (the rank's thread CPU seconds in its compute spans: "work" less what other
    processes took from it -- work/cpu is how much the machine's other load slowed the rank)."""
    steps = res.steps[skip:] if len(res.steps) > skip else res.steps
    bounds = dict(zip(res.steps, res.step_bounds))
    rows: dict[int, dict[str, list[float]]] = {}
    for step in steps:
        t0, t1 = bounds[step]
        per: dict[int, dict[str, float]] = {}
        for e in res.timeline.events:
            if e.args.get("step") != step or e.args.get("rank") is None:
                continue
            p = per.setdefault(int(e.args["rank"]), {"work": 0.0, "stretch": 0.0, "comm": 0.0, "cpu": 0.0})
            if e.resource.endswith("/compute"):
                own = e.duration - float(e.args.get("comm_inside", 0.0))
                work = float(e.args.get("compute_s", own))
                p["work"] += work
                p["cpu"] += float(e.args.get("cpu_s", work))
                p["stretch"] += own - work
            else:
                p["comm"] += e.duration
        for r, p in per.items():
            p["other"] = (t1 - t0) - p["work"] - p["stretch"] - p["comm"]  # "cpu" is part of "work"
            for k, v in p.items():
                rows.setdefault(r, {}).setdefault(k, []).append(v)
    return {str(r): {k: statistics.median(v) for k, v in sorted(d.items())} for r, d in sorted(rows.items())}


def steal(pieces: dict[str, Any]) -> float:
    """The ranks' compute spans in wall seconds over their thread CPU seconds (`step_pieces`): how
    much other jobs slowed the ranks (1 with a CPU per rank and nothing else running; NaN unknown)."""
    cpu = sum(p.get("cpu", 0.0) for p in pieces.values())
    return sum(p.get("work", 0.0) for p in pieces.values()) / cpu if cpu > 0 else float("nan")


def measured_row(res: Any, skip: int = WARMUP_STEPS) -> dict[str, Any]:
    """A run's measured iteration (median step after `skip` warm-up steps), the spread of those
    steps (min, quartiles, max) and where the steps go (`step_pieces`)."""
    times = res.iteration_times
    kept = times[min(skip, max(0, len(times) - 1)):]
    q = np.percentile(kept, [0, 25, 75, 100]).tolist() if kept else []
    return {"measured_iteration_s": statistics.median(kept), "measured_spread_s": q, "measured_steps": len(kept),
            "iteration_times_s": list(times), "losses": list(res.losses),
            "collectives": (res.spmd or {}).get("moves"), "notes": list(res.notes),
            "network": res.network.get("mode"), "pieces": (pieces := step_pieces(res, skip)), "steal": steal(pieces)}


def run_both(args: argparse.Namespace, choice: SpmdChoice, pin: bool = False) -> dict[str, Any]:
    """Train the program and its even-ratio twin; predicted (this machine) next to measured.

    This machine's speed drifts while other work runs (other jobs share its CPUs): each run's
    ranks time the whole program side by side before and after their steps, and time gloo's
    all-gathers (`spmd_calibrate`); each run is predicted from its own ranks' timings."""
    from plait.measure.machine import SHARES
    from plait.runtime.api import rank_layout
    from plait.runtime.api import run as runtime_run
    from plait.runtime.config import LaunchConfig, RecordsConfig, TrainingConfig
    from plait.runtime.cpu_share import RankCgroups, pinned

    say = (lambda text: None) if args.json else (lambda text: print(f"  {text}", file=sys.stderr))
    cluster = choice.cluster
    slow = [r["slowdown"] for r in rank_layout(cluster, choice.plan, choice.dtype)]
    # The plan's dtype, as the prediction prices it: fp32 masters, ops autocast to bf16 / fp16.
    training = TrainingConfig(dtype=choice.dtype, optimizer="adam", lr=args.lr)
    records = RecordsConfig(spmd_calibrate=True)
    out: dict[str, Any] = {"slowdowns": slow, "dtype": choice.dtype, "emulated_dtype": choice.dtype}
    # `pin`: each rank on its own CPU with a high cpu.shares (as plait.measure.machine does); the
    # ranks' whole-program timings run under the same shares. Off by default.
    world = choice.plan.world_size
    with RankCgroups(world, shares=SHARES, cpuset=pinned(world)) if pin else contextlib.nullcontext() as groups:
        out["pinned"] = bool(groups is not None and groups.active)
        for name, plan in (("uneven", choice.plan), ("even", choice.even_plan)):
            say(f"plait run: the {name} program ({args.steps} steps) ...")
            env = groups.env() if groups is not None and groups.active else None
            res = runtime_run(choice.model, cluster, plan, steps=args.steps, training=training, records=records,
                              launch=LaunchConfig(emulate_dtype=choice.dtype, env=env))
            out[name] = measured_row(res)
            calibration = (res.spmd or {}).get("calibration")
            timing = ranks_timing(calibration) if calibration else None
            if timing is None:
                continue
            devices = machine_devices(choice, timing.program, slow, calibration, plan.spmd.ratios, timing.own)
            pieces = machine_pieces(choice, devices, plan.spmd.ratios, timing, slow)
            pred = sum(pieces.values())
            meas = out[name]["measured_iteration_s"]
            out[name].update({"predicted_machine_s": pred, "predicted_pieces": pieces,
                              "predicted_rank_work_s": rank_work(choice, devices, plan.spmd.ratios, slow), "error": (meas - pred) / pred if pred > 0 else None,
                              "one_rank_s": {k: np.asarray(v).tolist() for k, v in dataclasses.asdict(timing).items()},
                              "links": {"alpha_s": devices.links.ring_latency,
                                        "bandwidth_Bps": devices.links.ring_bandwidth}})
    out["measured_speedup_over_even"] = out["even"]["measured_iteration_s"] / out["uneven"]["measured_iteration_s"]
    if "predicted_machine_s" in out["uneven"] and "predicted_machine_s" in out["even"]:
        out["predicted_speedup_over_even"] = out["even"]["predicted_machine_s"] / out["uneven"]["predicted_machine_s"]
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    out["ranks"], out["cpus"] = choice.plan.world_size, cpus
    out["load_average"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if choice.plan.world_size > cpus:
        out["note"] = (f"{choice.plan.world_size} ranks on {cpus} CPUs: ranks time-share CPUs, so the machine "
                       "prediction (one CPU per rank) does not hold")
    elif out["load_average"] is not None and out["load_average"] > cpus:
        out["note"] = (f"load average {out['load_average']:.1f} on {cpus} CPUs: other work shares the ranks' CPUs, "
                       "so measured times drift from the prediction")
    return out


# ----------------------------------------------------------------------------- the command
def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise PlaitError(f"--steps: must be >= 1, got {args.steps}")
    if args.export:
        raise PlaitError("--export: an SPMD program has no Megatron/DeepSpeed equivalent; use --out and plait run")
    from plait.errors import check_output_path

    check_output_path(args.out, "--out")
    t0 = time.perf_counter()
    choice = synthesize_plan(args.model, args.cluster, args.global_batch, dtype=args.dtype or "fp32",
                             optimizer=args.optimizer, max_states=args.max_states)
    if args.out:
        from plait.search.summary import search_path, write_summary

        choice.plan.save(args.out)
        write_summary(search_result(choice, time.perf_counter() - t0), search_path(args.out))
    info = summary(choice)
    measured = run_both(args, choice) if args.run else None
    if args.json:
        out = {"family": "spmd", **info, "plan": choice.plan.to_dict()}
        if measured is not None:
            out["run"] = measured
        if args.out:
            out["out"] = args.out
        print(json.dumps(out, indent=2))
        return 0
    _print(info, choice, measured, args)
    return 0


def _ms(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    return f"{s:.2f} s" if s >= 10 else f"{s * 1e3:.2f} ms"


def _print(info: dict[str, Any], choice: SpmdChoice, measured: dict[str, Any] | None,
           args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]plait plan --family spmd[/]: {info['model']} on {info['cluster']} "
                  f"({len(info['devices'])} GPUs), global batch {info['global_batch']}, {info['dtype']}")
    console.print(f"program: {info['sharded_ops']} of {info['ops']} aten ops sharded, {info['segments']} ratio "
                  f"segment(s); collectives: " + (", ".join(f"{k} x{v}" for k, v in info["collectives"].items())
                                                  or "none"))
    table = Table(title="per device (ratio: work-weighted mean over segments)")
    for col in ("device", "ratio", "memory", "capacity"):
        table.add_column(col, justify="left" if col == "device" else "right")
    for name, r, m, c in zip(info["devices"], info["ratios"], info["memory_bytes"], info["capacity_bytes"]):
        table.add_row(name, f"{r:.3f}", f"{m / 2**30:.2f} GiB", f"{c / 2**30:.1f} GiB")
    console.print(table)
    speed = info["predicted_speedup_over_even"]
    console.print(f"predicted iteration on the cluster's GPUs: {_ms(info['predicted_iteration_s'])} "
                  f"(even ratios: {_ms(info['predicted_even_s'])}, {speed:.2f}x); fits: {info['fits']}; "
                  f"synthesis {info['synthesis_s']:.1f} s, {info['states_expanded']} states"
                  f"{'' if info['optimal_search'] else ' (beam search past the state budget)'}")
    if args.out:
        from plait.search.summary import search_path

        console.print(f"plan written to [bold]{args.out}[/] (plait run --model '{info['model']}' --plan {args.out}); "
                      f"the search to {search_path(args.out)} (plait report)")
    if measured is None:
        return
    console.print(f"\n[bold]plait run[/] on this machine ({measured['ranks']} ranks, {measured['cpus']} CPUs; "
                  f"CPU ranks in {measured['dtype']}, slowed by their kind's {measured['emulated_dtype']} FLOP/s ratio "
                  f"{', '.join(f'{s:.2f}' for s in measured['slowdowns'])}):")
    rows = Table()
    for col in ("program", "predicted (this machine)", "measured", "error", "steal", "losses"):
        rows.add_column(col, justify="right" if col != "program" else "left")
    for name in ("uneven", "even"):
        m = measured[name]
        err = m.get("error")
        rows.add_row(name, _ms(m.get("predicted_machine_s")), _ms(m["measured_iteration_s"]),
                     f"{err * 100:+.1f} %" if err is not None else "-", f"{m.get('steal', float('nan')):.2f}",
                     ", ".join(f"{x:.3f}" for x in m["losses"]))
    console.print(rows)
    line = f"measured speedup over even sharding: {measured['measured_speedup_over_even']:.2f}x"
    if "predicted_speedup_over_even" in measured:
        line += f" (predicted {measured['predicted_speedup_over_even']:.2f}x)"
    console.print(line)
    console.print("[dim]steal: the ranks' compute in wall over CPU seconds (1.00: a CPU per rank, as predicted)[/]")
    if measured.get("note"):
        console.print(f"[dim]{measured['note']}[/]")
