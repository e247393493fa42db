"""A toy planner family: pure data parallelism -- the worked example of docs/DESIGN.md, "Add a family".

It proposes dp = 1, 2, 4, ... up to the cluster's size (each dividing the global batch), with
tp = pp = 1 and one micro-batch per replica; prunes what the one memory estimator
(`plait.cost.memory`) says does not fit; ranks the rest by a FLOP bound; has its `top` finalists
timed by the `Simulator` the driver hands it (the same for every family); and
returns a `PlanResult` whose candidates say family "toy".

Adding it to plait is this module and one call -- nothing in plait/ names it:

    from plait.search import register_family
    register_family("toy", search_toy, ToyOptions)

after which `plait.plan(..., families="toy")` (or "all", or "3d,toy") and
`plait plan --family toy` search it (tests/test_toy_family.py). The driver hands `search_toy` what
every family is asked (`SearchOptions`: global batch, top, dtype, the runtime's `supports`, ...),
the one simulator, and its own `ToyOptions` (`plait.plan(..., families="toy", max_dp=2)` builds it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plait.cluster.spec import Cluster
from plait.cost.memory import estimate_memory
from plait.ir.plan import Plan
from plait.planners.options import SearchOptions
from plait.planners.types import (
    DEFAULT_GLOBAL_BATCH,
    DEFAULT_MODEL,
    Candidate,
    PlanResult,
    SearchError,
    Simulator,
    auto_dtype,
    load_graph,
    memory_headroom,
)


@dataclass(frozen=True)
class ToyOptions:
    """The toy family's own options, beside what every family is asked (`SearchOptions`)."""

    max_dp: int | None = None
    """The largest data-parallel degree proposed; None: the cluster's size."""


def search_toy(model: Any, cluster: Cluster, common: SearchOptions, simulator: Simulator | None,
               options: ToyOptions) -> PlanResult:
    """The fastest pure data-parallel plans of `model` on `cluster` (module docstring); the
    `FamilySearch` signature of `plait.search.driver`. Raises SearchError when none fits."""
    t0 = time.perf_counter()
    gb = DEFAULT_GLOBAL_BATCH if common.global_batch is None else int(common.global_batch)
    dtype = common.dtype or auto_dtype(cluster)
    spec, graph = load_graph(DEFAULT_MODEL if model is None else model, dtype)
    supports, top = common.supports, common.top
    max_dp = cluster.num_devices if options.max_dp is None else min(options.max_dp, cluster.num_devices)

    kept: list[Candidate] = []
    enumerated = 0
    reasons: dict[str, int] = {}
    examples: dict[str, str] = {}
    dp = 1
    while dp <= max_dp:
        if gb % dp == 0:
            enumerated += 1
            plan = Plan(dp=dp, micro_batch=gb // dp, global_batch=gb, dtype=dtype)
            why = _refused(graph, plan, cluster, supports)
            if isinstance(why, str):
                reasons[why] = reasons.get(why, 0) + 1
                examples.setdefault(why, str(plan))
            else:
                kept.append(Candidate(plan=plan, layout="default", analytic_s=_flop_bound(graph, plan, cluster),
                                      peak_bytes=why, family="toy",
                                      headroom_by_kind=memory_headroom(why, cluster.devices, plan)))
        dp *= 2
    if not kept:
        raise SearchError(f"toy: no data-parallel degree of {graph.model} fits on {cluster.name} "
                          f"({', '.join(reasons) or 'none divides the global batch'})")

    kept.sort(key=lambda c: (c.analytic_s, str(c.plan)))
    finalists = kept[:top]
    for c in finalists if simulator is not None else ():  # the driver's simulator: one scale for all
        sim = simulator.evaluate(graph, c.plan)
        c.iteration_time_s = sim["iteration_time_s"]
        c.tflops_per_gpu = sim.get("tflops_per_gpu")
        c.throughput = sim.get("throughput_samples_per_s")
    finalists.sort(key=lambda c: (c.time_s, str(c.plan)))
    return PlanResult(model=getattr(spec, "spec", None) or graph.model, cluster=cluster.name, global_batch=gb,
                      world_size=cluster.num_devices, top=finalists, enumerated=enumerated,
                      pruned=sum(reasons.values()), pruned_reasons=reasons, pruned_examples=examples,
                      memory_checked=enumerated, ranked_analytic=len(kept),
                      simulated=len(finalists) if simulator is not None else 0,
                      search_time_s=time.perf_counter() - t0,
                      ranker="simulator" if simulator is not None else "analytic", family="toy")


def _refused(graph: Any, plan: Plan, cluster: Cluster,
             supports: Callable[[Plan], tuple[bool, str]] | None) -> str | list[int]:
    """Why `plan` is not offered (the one memory estimator, then the runtime's `supports`), or
    its peak bytes per device id when it is."""
    est = estimate_memory(graph, plan, cluster)
    if not est.fits:
        worst = cluster.devices[est.over_devices[0]].kind
        return f"out of memory on {worst.name} ({worst.memory_bytes / 2**30:.0f} GiB)"
    if supports is not None:
        ok, why = supports(plan)
        if not ok:
            return f"the runtime refuses it: {why}"
    return [int(x) for x in est.peak_bytes]


def _flop_bound(graph: Any, plan: Plan, cluster: Cluster) -> float:
    """Seconds of one iteration at the slowest used GPU's peak FLOP/s (a lower bound: the
    analytic ranking of the finalists)."""
    slowest = min(cluster.devices[plan.device_of(r)].kind.flops(plan.dtype) for r in range(plan.world_size))
    return (graph.fwd_flops + graph.bwd_flops) * plan.micro_batch / slowest
