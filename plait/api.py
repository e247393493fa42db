"""The Python API: each function mirrors a CLI subcommand and takes the same string forms.

Imports are lazy so `import plait` stays fast and light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plait.ir.plan import Plan

if TYPE_CHECKING:  # the types only: each function imports what it runs on use
    from collections.abc import Sequence

    from torch import nn

    from plait.cluster.spec import Cluster, ClusterSource
    from plait.graph.resolve import ModelSource
    from plait.graph.zoo.registry import ModelSpec
    from plait.ir.opgraph import OpGraph
    from plait.ir.plan import PlanSource
    from plait.net.view import ClusterView
    from plait.planners.types import PlanResult
    from plait.runtime.api import RunResult
    from plait.sim.api import SimResult

__all__ = ["inspect", "load_cluster", "load_model", "Plan", "plan", "simulate", "run"]


def load_cluster(spec: ClusterSource | None) -> Cluster:
    """A Cluster from a YAML path, a preset string (`a100-80g:nodes=8`) or a Cluster."""
    from plait.cluster import load_cluster as _load

    return _load(spec)


def load_model(spec: str | ModelSpec) -> ModelSpec:
    """(nn.Module factory result, sample-input builder) from a zoo spec or `file.py:factory`."""
    from plait.graph.zoo import load_model as _load

    return _load(spec)


def inspect(model: str | ModelSpec | nn.Module, batch: int = 1, **kwargs: Any) -> OpGraph:
    """Capture `model` (zoo spec, `file.py:factory`, or nn.Module) and return its OpGraph."""
    from plait.graph.inspect import inspect_model

    return inspect_model(model, batch=batch, **kwargs)


def simulate(model: ModelSource, cluster: ClusterSource | ClusterView, plan: PlanSource | dict[str, Any],
             **kwargs: Any) -> SimResult:
    """Predict one iteration: returns a SimResult (see plait.sim)."""
    from plait.sim.api import simulate as _simulate

    return _simulate(model, cluster, plan, **kwargs)


def plan(model: ModelSource | None = None, cluster: ClusterSource | None = None, *, simulate: bool = True,
         compute: Any = None, global_batch: int | None = None, top: int = 5,
         families: str | Sequence[str] | None = "3d", family: str | None = None, graph_chains: str = "always",
         **options: Any) -> PlanResult:
    """The fastest plans of `model` on `cluster` (`plait plan`; default: `DEFAULT_MODEL` on
    `DEFAULT_CLUSTER`): the search driver (`plait.search.search_plans`) over the planner `families`
    ("3d", "all", a list; `family=` one name), every family's finalists timed by the one simulator
    built here for the cluster (`simulate=False`: ranked by each family's analytic model alone).

    `options` by name, built here into the typed options the driver hands the families
    (`plait.search.options_from_keywords`): the fields of `SearchOptions` (dtype, precision, jobs,
    supports, progress, on_progress) and of the searched families' own (`ThreeDOptions`: finalists, space,
    placement, seed, ...; `GraphOptions`: runnable, max_dp, ...; `SpmdOptions`, `ComposeOptions`;
    `plait.planners.options`), each to every searched family that has it; a name none has is
    refused, naming it. A PlanResult."""
    from plait.cluster import load_cluster as _load
    from plait.planners.types import DEFAULT_CLUSTER
    from plait.search import options_from_keywords, search_plans
    from plait.sim.api import PlanSimulator

    names = family if family is not None else families
    common, own = options_from_keywords(names, {"global_batch": global_batch, "top": top, "compute": compute,
                                                **options})
    cluster_obj = _load(DEFAULT_CLUSTER if cluster is None else cluster)
    simulator = PlanSimulator(cluster_obj, compute) if simulate else None
    return search_plans(model, cluster_obj, simulator=simulator, common=common, families=names, options=own,
                        graph_chains=graph_chains)


def run(model: str | ModelSpec, cluster: ClusterSource | None, plan: PlanSource, steps: int = 3,
        **configs: Any) -> RunResult:
    """Train `model` under `plan` with real torch.distributed workers (see plait.runtime).
    `configs`: `training`, `checkpoint`, `launch`, `records`, `faults` (the dataclasses of
    `plait.runtime.config`) and `watch`, as `plait.runtime.api.run` takes them."""
    from plait.runtime.api import run as _run

    return _run(model, cluster, plan, steps=steps, **configs)
