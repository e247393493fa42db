"""The graph-pipeline family of `plait plan` (`--family graph`): GraphPipe's partitioner, ranked.

`search_graph` runs the partitioner (`plait.plan.graphpipe`), turns its best stage lists into
Plans (stages + stage edges), drops those the memory estimator says do not fit (and, when the
caller hands in `supports`, those the runtime refuses), and ranks the rest with the `evaluate`
function the search driver hands in (the simulator). It returns the same `PlanResult` as the 3D
family; `PlanResult.extra` holds the graph facts: pipeline depth, the lower bound (`lower_bound`)
and the partitioner's notes (a model without branches, layers that are not series-parallel).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from plait.cost.memory import estimate_memory
from plait.ir.plan import Plan
from plait.plan.graph_cost import GraphPlanError, StageCost, lower_bound
from plait.plan.graphpipe import partition
from plait.plan.threed import (
    DEFAULT_CLUSTER,
    DEFAULT_GLOBAL_BATCH,
    DEFAULT_MODEL,
    Candidate,
    Evaluate,
    PlanResult,
    auto_dtype,
    load_graph,
    memory_headroom,
)


def search_graph(model: Any = None, cluster: Any = None, *, global_batch: int | None = None, top: int = 5,
                 evaluate: Evaluate | None = None, supports: Callable[[Plan], tuple[bool, str]] | None = None,
                 max_dp: int | None = None, candidates: int = 6, compute: Any = None,
                 memory_kwargs: dict[str, Any] | None = None, dtype: str | None = None,
                 fast: bool = True) -> PlanResult:
    """Graph-pipeline plans of `model` on `cluster`, fastest first (module docstring).

    `max_dp`: most data-parallel replicas per stage (1: pure pipelines; None: any).
    `candidates`: stage lists of the partitioner that are turned into plans and ranked.
    `fast=False`: the partitioner's cost tables built whole, as before they were built lazily
    (the same plans; bench/plan_search_time.py measures the difference)."""
    from plait.cluster import load_cluster
    from plait.cost.compute import DEFAULT_MODEL as DEFAULT_COMPUTE

    t0 = time.perf_counter()
    if top < 1:
        raise GraphPlanError(f"plan: top must be >= 1, got {top}")
    cluster_obj = load_cluster(DEFAULT_CLUSTER if cluster is None else cluster)
    gb = DEFAULT_GLOBAL_BATCH if global_batch is None else int(global_batch)
    if gb < 1:
        raise GraphPlanError(f"plan: global batch must be >= 1, got {gb}")
    dtype = dtype or auto_dtype(cluster_obj)
    _, graph = load_graph(DEFAULT_MODEL if model is None else model, dtype)
    mem_kw = dict(memory_kwargs or {})
    cost = StageCost(graph, cluster_obj, gb, dtype=dtype, compute=compute or DEFAULT_COMPUTE, max_dp=max_dp,
                     overhead_bytes=mem_kw.get("overhead_bytes"), lazy=fast)
    part = partition(cost, candidates=candidates)
    reasons: dict[str, int] = {}
    examples: dict[str, str] = {}
    kept: list[Candidate] = []
    for stages, score in zip(part.stages, part.scores):
        plan = cost.to_plan(stages)
        mem = estimate_memory(graph, plan, cluster_obj, **mem_kw)
        if not mem.fits:
            reasons["memory"] = reasons.get("memory", 0) + 1
            examples.setdefault("memory", "; ".join(mem.violations[:2]))
            continue
        if supports is not None:
            ok, why = supports(plan)
            if not ok:
                reasons["runtime"] = reasons.get("runtime", 0) + 1
                examples.setdefault("runtime", why)
                continue
        cand = Candidate(plan, layout="graph", analytic_s=score, peak_bytes=list(mem.peak_bytes),
                         headroom_by_kind=memory_headroom(list(mem.peak_bytes), cluster_obj.devices, plan))
        kept.append(cand)
    if not kept:
        why = "; ".join(f"{k}: {examples[k]}" for k in examples) or "no stage list"
        raise GraphPlanError(f"plan --family graph: no graph plan of {graph.model} on {cluster_obj.name} "
                             f"survives ({why})")
    if evaluate is not None:
        for cand in kept:
            sim = evaluate(graph, cand.plan)
            cand.sim = sim
            cand.iteration_time_s = float(sim["iteration_time_s"])
            cand.tflops_per_gpu = sim.get("tflops_per_gpu")
            cand.throughput = sim.get("throughput_samples_per_s")
    kept.sort(key=lambda c: c.time_s)
    best = kept[0]
    depth = cost.pipeline_depth(cost.choices_of(best.plan))
    bound = lower_bound(cost)
    extra = {
        "pipeline_depth": depth,
        "stages": len(best.plan.stages),
        "partition_search_s": part.search_time_s,
        "targets_tried": part.targets_tried,
        "notes": part.notes,
        "lower_bound_s": bound,
        "optimality_gap": best.time_s / bound["bound"] - 1.0 if bound["bound"] > 0 else None,
    }
    return PlanResult(graph.model, cluster_obj.name, gb, len(cluster_obj.devices), kept[:top],
                      enumerated=len(part.stages), pruned=sum(reasons.values()), pruned_reasons=reasons,
                      pruned_examples=examples, memory_checked=len(part.stages), ranked_analytic=len(part.stages),
                      simulated=len(kept) if evaluate is not None else 0,
                      search_time_s=time.perf_counter() - t0,
                      ranker="simulator" if evaluate is not None else "analytic", family="graph", extra=extra)
