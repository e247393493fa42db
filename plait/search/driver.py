"""The search driver: runs every planner family and ranks their finalists with one simulator.

Each family is a function with the signature of `FamilySearch`: it enumerates its own plans,
prunes them by the one memory estimator, ranks them analytically and has its finalists timed
by the `Simulator` it is handed -- the same for every family, built by the layer above the
search (`plait.api.plan`, `plait plan`, the recovery loop: this package never imports
`plait.sim`) -- and returns a
`PlanResult` whose candidates carry their `family`. The driver merges the families' finalists
into one ranking by simulated iteration time (so a 3D plan, a graph pipeline and an SPMD
program compete on one scale) and keeps each family's own result for the table "best per
family". A family that proposes nothing for this model and cluster (a graph pipeline of a
chain, say) says why instead of failing the search.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from plait.cluster.spec import Cluster
from plait.errors import PlaitError
from plait.ir.plan import Plan
from plait.planners.threed import Progress, search_3d
from plait.planners.types import (
    DEFAULT_MODEL,
    MAX_PROGRAM_DEVICES,
    PlanResult,
    SearchError,
    Simulator,
)
from plait.search.compose_family import search_compose
from plait.search.spmd_family import search_spmd
from plait.workers import paused_gc

if TYPE_CHECKING:
    from plait.graph.resolve import ModelSource

# One planner family: `(model, cluster, *, global_batch, top, simulator, supports, compute,
# **options) -> PlanResult` (raises a PlaitError when it has nothing to propose); each takes its own
# keyword options (the names registered with it), so the type checker sees only the result.
FamilySearch = Callable[..., PlanResult]


# name -> (search function, the keyword options it takes besides the common ones). Families
# register themselves here (`register_family`); the order is the order of the table.
FAMILIES: dict[str, tuple[FamilySearch, frozenset[str]]] = {}

_3D_OPTIONS = frozenset({"finalists", "space", "placement", "seed", "progress", "placement_iterations",
                         "memory_kwargs", "layer_time", "on_progress", "fast", "jobs", "dtype"})
# Options of the driver itself, handed to every family that takes them.
_DRIVER_OPTIONS = frozenset({"progress", "on_progress", "jobs", "graph_chains"})
# When the driver asks the graph family for a chain model beside the 3D family (`plan(graph_chains=)`):
#   "always"       (default, issue 36) on every cluster: its stages may use a subset of the GPUs
#                  and each has its own dp and micro-batch, which the 3D family's grid over all GPUs
#                  cannot express -- on one kind too (tests/test_search_guard.py pins a 4-GPU case
#                  where one GPU alone beats every plan over all four);
#   "mixed-kinds"  only on clusters of two or more GPU kinds (the driver of commit 67308ef);
#   "never"        the policy before issue 36: declined ("no branches").
GRAPH_CHAINS = ("always", "mixed-kinds", "never")
# Beside the 3D family the graph family is asked for chains on clusters of up to this many GPUs: its
# stage search grows with the GPUs (GPT-3 175B on large-mixed:nodes=128: 267 s to find that nothing
# fits, the whole search 7 s without it), while the 3D family's grid covers a chain at that scale --
# the limit the SPMD and composed families keep (`max_devices`).
GRAPH_CHAINS_MAX_DEVICES = MAX_PROGRAM_DEVICES


def register_family(name: str, search: FamilySearch, options: Iterable[str] = ()) -> None:
    """Add (or replace) a planner family; `options` are the keyword arguments of `plan()` it takes."""
    FAMILIES[name] = (search, frozenset(options))


def _search_3d(model: ModelSource | None, cluster: Cluster, *, global_batch: int | None, top: int,
               simulator: Simulator | None, supports: Callable[[Plan], tuple[bool, str]] | None,
               compute: Any, **options: Any) -> PlanResult:
    """The 3D family (`plait.planners.threed.search_3d`), its finalists timed by `simulator.evaluate`."""
    return search_3d(model, cluster, global_batch=global_batch, top=top,
                     evaluate=simulator.evaluate if simulator is not None else None, supports=supports,
                     compute=compute, **options)


register_family("3d", _search_3d, _3D_OPTIONS)


def _search_graph(model: ModelSource, cluster: Cluster, *, global_batch: int | None, top: int,
                  simulator: Simulator | None, supports: Callable[[Plan], tuple[bool, str]] | None,
                  compute: Any, runnable: bool = False, chains: bool = True,
                  chains_max_devices: int | None = None, **options: Any) -> PlanResult:
    """The graph-pipeline family (`plait.planners.graph_search.search_graph`). The runtime runs its
    plans, data-parallel stages of any degree included; with `runnable=True` (`plait plan --run`)
    the runtime's `supports` filter drops any it would refuse."""
    from plait.planners.graph_search import search_graph
    from plait.planners.types import load_graph

    too_many = chains_max_devices is not None and cluster.num_devices > chains_max_devices
    if not chains or too_many:  # beside the 3D family, a chain's "graph pipeline" is a 3D plan again
        graph = load_graph(model, options.get("dtype") or "bf16")[1]
        outs: dict[str, int] = {}
        ins: dict[str, int] = {}
        for a, b in graph.layer_edges:
            outs[a] = outs.get(a, 0) + 1
            ins[b] = ins.get(b, 0) + 1
        if max([*outs.values(), *ins.values(), 1]) < 2:
            if not chains:
                raise SearchError(f"graph: {graph.model} has no branches (its layer DAG is a chain); the 3D "
                                  "family plans chains")
            raise SearchError(f"graph: {graph.model} is a chain on {cluster.num_devices} GPUs; beside the 3D "
                              f"family the graph family plans chains on clusters of up to {chains_max_devices} "
                              "GPUs (its stage search grows with the GPUs; the 3D grid covers this scale)")
    return search_graph(model, cluster, global_batch=global_batch, top=top,
                        evaluate=simulator.evaluate if simulator is not None else None,
                        supports=supports if runnable else None, compute=compute, **options)


register_family("graph", _search_graph, ("runnable", "chains", "chains_max_devices", "max_dp", "candidates",
                                         "memory_kwargs", "dtype", "fast"))
register_family("spmd", search_spmd, ("dtype", "max_states", "max_devices", "runnable"))
# SPMD programs inside the stages of a pipeline (plait.search.compose_family), run by
# plait.runtime.compose_worker; a candidate the runtime refuses carries its reason (`Candidate.unsupported`)
register_family("compose", search_compose, ("dtype", "max_states", "max_devices", "max_stages", "candidates",
                                             "runnable", "jobs"))


def resolve_families(families: str | Sequence[str] | None) -> list[str]:
    """The families to search: None or "all" -> every registered one; else the names given
    (a comma-separated string or a list), each checked."""
    if families is None or families == "all":
        return list(FAMILIES)
    names = [f.strip() for f in families.split(",")] if isinstance(families, str) else list(families)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        raise SearchError(f"--family: unknown {unknown or names!r}; use one or more of {list(FAMILIES)} or 'all'")
    return names


def search_plans(model: ModelSource | None, cluster: Cluster, *, simulator: Simulator | None,
                 global_batch: int | None = None, top: int = 5, compute: Any = None,
                 families: str | Sequence[str] | None = "3d", family: str | None = None,
                 **kwargs: Any) -> PlanResult:
    """The fastest plans of `model` on `cluster` for `global_batch` over the planner `families`
    ("all", a name or a list; see FAMILIES), ranked by `simulator` (the layer above builds it for
    `cluster`: `plait.sim.api.PlanSimulator`; None: by each family's analytic model alone). Other keyword arguments go to the families that take them
    (e.g. finalists, space, placement, seed, progress for "3d"). `graph_chains` says when the
    graph family is asked for a chain model beside the 3D family (GRAPH_CHAINS: "always", the
    default; "mixed-kinds" and "never", the earlier policies, kept so a bench can run them beside
    today's in one process).

    One family: its own result. Several: one result whose `top` merges every family's
    finalists by iteration time and whose `families` holds each family's result (or why it
    proposed nothing); a search where no family proposes anything raises the first reason.
    `family=` is the same as `families=` with one name."""
    from plait.runtime import supports

    t0 = time.perf_counter()
    model = DEFAULT_MODEL if model is None else model  # resolved here once, for every family
    names = resolve_families(family if family is not None else families)
    if kwargs.get("graph_chains", "always") not in GRAPH_CHAINS:
        raise SearchError(f"plan: graph_chains={kwargs['graph_chains']!r}; use one of {list(GRAPH_CHAINS)}")
    kwargs.setdefault("supports", supports)  # never offer a plan the runtime would refuse
    common = {"global_batch": global_batch, "top": top, "simulator": simulator, "compute": compute,
              "supports": kwargs.pop("supports")}
    unknown = [k for k in kwargs if k not in _DRIVER_OPTIONS and not any(k in FAMILIES[n][1] for n in names)]
    if unknown:
        raise SearchError(f"plan: option(s) {unknown} are not taken by the families {names}")
    show, callback = bool(kwargs.pop("progress", False)), kwargs.pop("on_progress", None)
    chains = kwargs.pop("graph_chains", "always")
    with paused_gc():
        results = _search_families(names, model, cluster, common, kwargs, show, callback, chains)
    if len(names) == 1:
        return results[names[0]]  # type: ignore[return-value]
    found = [r for r in results.values() if isinstance(r, PlanResult)]
    if not found:
        raise SearchError("plan: no family proposed a plan: " + "; ".join(
            f"{n}: {r}" for n, r in results.items()))
    merged = sorted((c for r in found for c in r.top), key=lambda c: (c.time_s, c.family, str(c.plan)))
    first = found[0]
    return PlanResult(model=first.model, cluster=first.cluster, global_batch=first.global_batch,
                      world_size=first.world_size, top=merged[:top],
                      enumerated=sum(r.enumerated for r in found), pruned=sum(r.pruned for r in found),
                      pruned_reasons=_summed(r.pruned_reasons for r in found),
                      pruned_examples={k: v for r in found for k, v in r.pruned_examples.items()},
                      memory_checked=sum(r.memory_checked for r in found),
                      ranked_analytic=sum(r.ranked_analytic for r in found),
                      simulated=sum(r.simulated for r in found), search_time_s=time.perf_counter() - t0,
                      ranker=first.ranker, families=results, family="+".join(names))


def _one_kind(cluster: Cluster) -> bool:
    """Whether every GPU of `cluster` is of one kind."""
    return len({k for node in cluster.nodes for k in node.gpus}) <= 1


def _search_families(names: list[str], model: ModelSource | None, cluster_obj: Cluster, common: dict[str, Any],
                     kwargs: dict[str, Any], show: bool, callback: Any,
                     graph_chains: str = "always") -> dict[str, PlanResult | str]:
    """Each family's result, or why it proposed nothing (raised when it is the only family)."""
    ask_chains = graph_chains == "always" or (graph_chains == "mixed-kinds" and not _one_kind(cluster_obj))
    results: dict[str, PlanResult | str] = {}
    for name in names:
        search, options = FAMILIES[name]
        own = {k: v for k, v in kwargs.items() if k in options}
        if name == "graph" and len(names) > 1 and "3d" in names:
            if not ask_chains:  # an earlier policy (GRAPH_CHAINS), run beside today's by bench/unified.py
                own.setdefault("chains", False)
            own.setdefault("chains_max_devices", GRAPH_CHAINS_MAX_DEVICES)
        phased = "on_progress" in options  # the family reports its phases; the driver draws them
        bar = _FamilyProgress(name, show, callback, prefix=len(names) > 1)
        if phased:
            own["on_progress"] = bar.report
            if "progress" in options:
                own["progress"] = False
        bar.begin(phased)
        try:
            res = search(model, cluster_obj, **common, **own)
        except PlaitError as exc:
            if len(names) == 1:
                raise
            results[name] = f"{exc}"
            continue
        finally:
            bar.end()
        for c in res.top:
            c.family = name
            if common["supports"] is not None and not c.unsupported:  # marked, whichever family
                ok, why = common["supports"](c.plan)
                c.unsupported = "" if ok else why
        results[name] = res
    return results


class _FamilyProgress:
    """The progress of one family's search: a bar labelled with the family and its phase
    (checking memory, ranking analytically, placing + simulating) and the caller's callback,
    called as ``on_progress(f"{family} {phase}", done, total)``; a family that reports no
    phases shows one "search" phase from start to end. The family itself is reported as
    phase ``family`` (0 of 1 when it starts, 1 of 1 when it ends), so a caller can time it."""

    def __init__(self, family: str, show: bool, callback: Callable[[str, int, int], None] | None,
                 prefix: bool) -> None:
        self.family, self.show, self.callback = family, show, callback
        self.bar = Progress(show, None, prefix=f"{family}: " if prefix else "")
        self.phase: str | None = None
        self.reported = False

    def begin(self, phased: bool) -> None:
        if self.callback is not None:
            self.callback(self.family, 0, 1)
        if not phased:
            self.bar.start("search", 1)

    def report(self, phase: str, done: int, total: int) -> None:
        self.reported = True
        if phase != self.phase:
            self.bar.stop()
            self.phase = phase
            self.bar.start(phase, total)
        self.bar.advance(done - self.bar.done)
        if self.callback is not None:
            self.callback(f"{self.family} {phase}", done, total)

    def end(self) -> None:
        if not self.reported:
            self.bar.advance(1)
        self.bar.stop()
        if self.callback is not None:
            if not self.reported:
                self.callback(f"{self.family} search", 1, 1)
            self.callback(self.family, 1, 1)


def _summed(dicts: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out
