"""The search driver: runs a planner family and ranks its finalists with the simulator."""

from __future__ import annotations

from typing import Any

from plait.cluster import load_cluster
from plait.cluster.spec import Cluster
from plait.ir.opgraph import OpGraph
from plait.ir.plan import Plan
from plait.plan.threed import DEFAULT_CLUSTER, Evaluate, PlanResult, SearchError, search_3d


def simulator_evaluate(cluster: Cluster, compute: Any = None) -> Evaluate:
    """`evaluate(graph, plan) -> dict` for the planners: `plait.sim.api.simulate` without the
    memory estimate (the search has it), on one ClusterView and one layer-cost cache shared
    by every finalist of the search."""
    from plait.sim.api import simulate
    from plait.sim.topology import ClusterView

    view = ClusterView.from_cluster(cluster)
    cost_cache: dict = {}
    extra = {"compute": compute} if compute is not None else {}

    def evaluate(graph: OpGraph, plan: Plan) -> dict[str, Any]:
        return simulate(graph, view, plan, memory=False, cost_cache=cost_cache, **extra).to_dict()

    return evaluate


def plan(model: Any = None, cluster: Any = None, *, global_batch: int | None = None, top: int = 5,
         simulate: bool = True, compute: Any = None, family: str = "3d", **kwargs: Any) -> PlanResult:
    """The fastest plans of `model` on `cluster` for `global_batch`, ranked by the simulator
    (`simulate=False`: by the analytic model alone). `family`: "3d" (Pipette's data x tensor x
    pipeline search; other keyword arguments go to `plait.plan.threed.search_3d`: finalists, space,
    placement, seed, progress, ...) or "graph" (GraphPipe's stage DAGs,
    `plait.plan.graph_search.search_graph`: max_dp, candidates, ...)."""
    from plait.runtime import supports

    cluster_obj = load_cluster(DEFAULT_CLUSTER if cluster is None else cluster)
    evaluate = simulator_evaluate(cluster_obj, compute) if simulate else None
    if family == "graph":
        from plait.plan.graph_search import search_graph

        # Only plans the runtime runs when asked for (`runnable=True`, as `plait plan --run` does):
        # stages with data parallelism inside are planned and simulated but not yet run.
        if kwargs.pop("runnable", False):
            kwargs.setdefault("max_dp", 1)
            kwargs.setdefault("supports", supports)
        return search_graph(model, cluster_obj, global_batch=global_batch, top=top, evaluate=evaluate,
                            compute=compute, **kwargs)
    if family != "3d":
        raise SearchError(f"plan: family must be '3d' or 'graph', got {family!r}")
    kwargs.setdefault("supports", supports)  # never offer a plan the runtime would refuse
    return search_3d(model, cluster_obj, global_batch=global_batch, top=top, evaluate=evaluate,
                     compute=compute, **kwargs)
