"""The graph-pipeline family of `plait plan` (`--family graph`): GraphPipe's partitioner, ranked.

`search_graph` runs the partitioner (`plait.planners.graphpipe`), turns its best stage lists into
Plans (stages + stage edges), drops those the memory estimator says do not fit (and, when the
caller hands in `supports`, those the runtime refuses), and ranks the rest with the `evaluate`
function the search driver hands in (the simulator). It returns the same `PlanResult` as the 3D
family; `PlanResult.extra` holds the graph facts: pipeline depth, the lower bound (`lower_bound`)
and the partitioner's notes (a model without branches, layers that are not series-parallel).

**Options of the 3D family.** The partitioner chooses stages; the memory and optimizer options
the 3D family searches are plan-wide and the analytic score does not see them, so the simulator
ranks them: each of the best `option_top` simulated stage graphs is also tried at every ZeRO stage
the runtime runs for it (`option_variants`: 0-2 for a stage graph, where ZeRO-1/2 shard over each
stage's own replicas; 0-3 for a one-stage graph, i.e. pure data parallelism, which is the 3D plan
``dp=N`` and is emitted in that form because ZeRO-3 runs with one stage only). So the family's space
holds pure data parallelism with every option the 3D family gives it, and chains of stages (the
series-parallel search of a chain model is PipeDream's).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from plait.cost.memory import estimate_memory
from plait.ir.plan import Plan
from plait.planners.graph_cost import GraphPlanError, StageCost, lower_bound
from plait.planners.graphpipe import GraphPartition, partition
from plait.planners.types import (
    DEFAULT_CLUSTER,
    DEFAULT_GLOBAL_BATCH,
    DEFAULT_MODEL,
    Candidate,
    Evaluate,
    PlanResult,
    Simulator,
    auto_dtype,
    load_graph,
    memory_headroom,
)

if TYPE_CHECKING:
    from plait.cluster.spec import Cluster, ClusterSource
    from plait.graph.resolve import ModelSource
    from plait.ir.opgraph import OpGraph
    from plait.planners.options import GraphOptions, SearchOptions

# ZeRO stages the runtime runs (`plait.runtime.layout.supports`): 3 shards parameters per layer and
# runs with one stage only; 1 and 2 shard the optimizer state (and gradients) over a stage's replicas
STAGE_GRAPH_ZERO = (0, 1, 2)
DATA_PARALLEL_ZERO = (0, 1, 2, 3)


def option_variants(plan: Plan) -> list[Plan]:
    """`plan`'s partition at each other ZeRO stage (module docstring). A one-stage graph is pure
    data parallelism: its variants are the 3D plan ``dp = its replicas`` (on its devices), the form
    the runtime runs ZeRO-3 in (the plan's own ZeRO stage is left to the plan itself); stage graphs
    keep their form at ZeRO 0-2. Only plans with replicas have ZeRO variants."""
    if len(plan.stages) == 1:
        st = plan.stages[0]
        if st.dp <= 1 or st.tp != 1:
            return []
        order = None if list(st.devices) == list(range(st.dp)) else list(st.devices)
        base = Plan(dp=st.dp, tp=1, pp=1, micro_batch=st.micro_batch or plan.micro_batch,
                    global_batch=plan.global_batch, dtype=plan.dtype, schedule=plan.schedule,
                    recompute=plan.recompute, device_order=order)
        return [dataclasses.replace(base, zero=z) for z in DATA_PARALLEL_ZERO if z != plan.zero]
    if not any(st.dp > 1 for st in plan.stages):
        return []
    return [dataclasses.replace(plan, zero=z, stages=[dataclasses.replace(st) for st in plan.stages],
                                stage_edges=list(plan.stage_edges)) for z in STAGE_GRAPH_ZERO if z != plan.zero]


@dataclasses.dataclass
class _Admission:
    """The memory and runtime checks of a graph plan, with a tally of what they refuse."""

    graph: OpGraph
    cluster: Cluster
    memory_kwargs: dict[str, Any]
    supports: Callable[[Plan], tuple[bool, str]] | None
    reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    examples: dict[str, str] = dataclasses.field(default_factory=dict)

    def admit(self, plan: Plan, score: float) -> Candidate | None:
        """`plan` as a candidate, or None (counted in `reasons`) if memory or the runtime refuses it."""
        mem = estimate_memory(self.graph, plan, self.cluster, **self.memory_kwargs)
        if not mem.fits:
            self.reasons["memory"] = self.reasons.get("memory", 0) + 1
            self.examples.setdefault("memory", "; ".join(mem.violations[:2]))
            return None
        if self.supports is not None:
            ok, why = self.supports(plan)
            if not ok:
                self.reasons["runtime"] = self.reasons.get("runtime", 0) + 1
                self.examples.setdefault("runtime", why)
                return None
        return Candidate(plan, layout="graph", analytic_s=score, peak_bytes=list(mem.peak_bytes),
                         headroom_by_kind=memory_headroom(list(mem.peak_bytes), self.cluster.devices, plan))


def search_graph(model: ModelSource | None, cluster: ClusterSource | None, common: SearchOptions,
                 simulator: Simulator | None, options: GraphOptions) -> PlanResult:
    """Graph-pipeline plans of `model` on `cluster`, fastest first (module docstring).

    `common`: what every family is asked (`plait.planners.options.SearchOptions`); its `supports`
    filters the plans only with `options.runnable`. `options`: the family's own (`GraphOptions`:
    max_dp, candidates, option_top, ...). `simulator.evaluate` ranks the plans (None: the
    partitioner's analytic score); the best `options.option_top` are also tried at each ZeRO stage
    (`option_variants`), only when simulated, as the analytic score does not tell ZeRO stages apart."""
    from plait.cluster import load_cluster
    from plait.cost.compute import DEFAULT_MODEL as DEFAULT_COMPUTE

    t0 = time.perf_counter()
    evaluate = simulator.evaluate if simulator is not None else None
    supports = common.supports if options.runnable else None
    cluster_obj = load_cluster(DEFAULT_CLUSTER if cluster is None else cluster)
    gb = DEFAULT_GLOBAL_BATCH if common.global_batch is None else int(common.global_batch)
    dtype = common.dtype or auto_dtype(cluster_obj)
    _, graph = load_graph(DEFAULT_MODEL if model is None else model, dtype, common.precision)
    mem_kw = dict(options.memory_kwargs or {})
    compute = (common.compute or DEFAULT_COMPUTE).with_profile(cluster_obj, graph, dtype)  # measured where profiled
    cost = StageCost(graph, cluster_obj, gb, dtype=dtype, compute=compute, max_dp=options.max_dp,
                     overhead_bytes=mem_kw.get("overhead_bytes"), lazy=options.fast)
    part = partition(cost, candidates=options.candidates)
    checks = _Admission(graph, cluster_obj, mem_kw, supports)
    kept = _admitted_partitions(part, cost, checks, whole_too=evaluate is not None)
    if not kept:
        why = "; ".join(f"{k}: {checks.examples[k]}" for k in checks.examples) or "no stage list"
        raise GraphPlanError(f"plan --family graph: no graph plan of {graph.model} on {cluster_obj.name} "
                             f"survives ({why})")
    variants = 0
    if evaluate is not None:
        variants = _simulate_with_options(kept, graph, evaluate, checks, options.option_top)
    kept.sort(key=lambda c: c.time_s)
    extra = _graph_facts(cost, part, kept[0], variants)
    reasons = checks.reasons
    return PlanResult(graph.model, cluster_obj.name, gb, len(cluster_obj.devices), kept[:common.top],
                      enumerated=len(part.stages), pruned=sum(reasons.values()), pruned_reasons=reasons,
                      pruned_examples=checks.examples, memory_checked=len(part.stages),
                      ranked_analytic=len(part.stages), simulated=len(kept) if evaluate is not None else 0,
                      search_time_s=time.perf_counter() - t0,
                      ranker="simulator" if evaluate is not None else "analytic", family="graph", extra=extra)


def _admitted_partitions(part: GraphPartition, cost: StageCost, checks: _Admission, whole_too: bool) -> list[Candidate]:
    """The partitioner's stage lists as plans that pass `checks`, in its order; with `whole_too`,
    each segmented plan is followed by the same stages run whole."""
    kept: list[Candidate] = []
    for stages, score in zip(part.stages, part.scores):
        cand = checks.admit(cost.to_plan(stages), score)
        if cand is not None:
            kept.append(cand)
        if whole_too and cand is not None and any(s.segments for s in cand.plan.stages):
            # the same stages run whole: per input a segment's inputs are received only once the
            # segment before it has run (as the executor posts them), which can cost more than it saves
            # where those transfers are long; the score does not price transfers, the simulator does
            whole = checks.admit(cost.to_plan(stages, per_input=False), cost.score(stages, per_input=False))
            if whole is not None:
                kept.append(whole)
    return kept


def _simulate_with_options(kept: list[Candidate], graph: Any, evaluate: Evaluate, checks: _Admission,
                           option_top: int) -> int:
    """Simulate `kept`, then append the best `option_top`'s ZeRO variants (`option_variants`) that
    pass `checks`, simulated; returns how many variants were added."""
    for cand in kept:
        _simulate(cand, graph, evaluate)
    kept.sort(key=lambda c: c.time_s)
    seen = {str(c.plan) + repr(c.plan.stages) for c in kept}
    variants = 0
    for cand in list(kept[:option_top]):
        for var in option_variants(cand.plan):
            key = str(var) + repr(var.stages)
            if key in seen:
                continue
            seen.add(key)
            vc = checks.admit(var, cand.analytic_s)
            if vc is not None:
                _simulate(vc, graph, evaluate)
                kept.append(vc)
                variants += 1
    return variants


def _graph_facts(cost: StageCost, part: GraphPartition, best: Candidate, variants: int) -> dict[str, Any]:
    """`PlanResult.extra` of the graph family: the best plan's depth, the partitioner's notes and
    the lower bound with the best plan's gap to it."""
    choices = cost.choices_of(best.plan) if best.plan.stages else None
    depth = cost.pipeline_depth(choices) if choices else best.plan.pp
    per_input = any(s.segments for s in best.plan.stages)
    effective = cost.effective_depth(choices, per_input=per_input) if choices else float(best.plan.pp)
    bound = lower_bound(cost)
    return {
        "pipeline_depth": depth,
        # stage-equivalents on the longest path: a stage that runs per input counts on the other
        # branch's path by its join segment's share only (`StageCost.effective_depth`)
        "effective_depth": effective,
        "stages": len(best.plan.stages),
        "partition_search_s": part.search_time_s,
        "targets_tried": part.targets_tried,
        "option_variants": variants,
        "notes": part.notes,
        "lower_bound_s": bound,
        "optimality_gap": best.time_s / bound["bound"] - 1.0 if bound["bound"] > 0 else None,
    }


def _simulate(cand: Candidate, graph: Any, evaluate: Evaluate) -> None:
    sim = evaluate(graph, cand.plan)
    cand.sim = sim
    cand.iteration_time_s = float(sim["iteration_time_s"])
    cand.tflops_per_gpu = sim.get("tflops_per_gpu")
    cand.throughput = sim.get("throughput_samples_per_s")
