"""The search driver: runs every planner family and ranks their finalists with one simulator.

Each family is a function with the signature of `FamilySearch`, registered with the dataclass of
its own options (`register_family`): it enumerates its own plans, prunes them by the one memory
estimator, ranks them analytically and has its finalists timed by the `Simulator` it is handed
-- the same for every family, built by the layer above the search (`plait.api.plan`, `plait plan`,
the recovery loop: this package never imports `plait.sim`) -- and returns a `PlanResult` whose
candidates carry their `family`. Every family is handed the one `SearchOptions` (global batch,
top, dtype, ...) and its own options object (`plait.planners.options`: `ThreeDOptions`,
`GraphOptions`, ...), so a value is followed by its type from the caller into the planner. The
driver merges the families' finalists into one ranking by simulated iteration time (so a 3D plan,
a graph pipeline and an SPMD program compete on one scale) and keeps each family's own result for
the table "best per family". A family that proposes nothing for this model and cluster (a graph
pipeline of a chain, say) says why instead of failing the search.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from plait.cluster.spec import Cluster
from plait.errors import PlaitError
from plait.planners.options import (
    ComposeOptions,
    GraphOptions,
    SearchOptions,
    SpmdOptions,
    ThreeDOptions,
)
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

OptionsT = TypeVar("OptionsT")  # a family's options dataclass
OptionsT_contra = TypeVar("OptionsT_contra", contravariant=True)


class FamilySearch(Protocol[OptionsT_contra]):
    """One planner family: `search(model, cluster, common, simulator, options) -> PlanResult`, with
    `model` resolved (a spec string parsed into its ModelSpec, once for every family; never None),
    `cluster` loaded, `common` the `SearchOptions` every family is
    handed (its `supports` and `on_progress` filled in by the driver), `simulator` the one
    simulator (None: rank analytically) and `options` an instance of the dataclass the family was
    registered with. It raises a PlaitError when it has nothing to propose."""

    def __call__(self, model: ModelSource, cluster: Cluster, common: SearchOptions, simulator: Simulator | None,
                 options: OptionsT_contra, /) -> PlanResult: ...


@dataclass(frozen=True)
class Family:
    """A registered planner family: its search and the dataclass of its own options (every field
    with a default: the driver builds it when the caller gives none)."""

    search: FamilySearch[Any]
    options: type


# name -> the family. Families register themselves here (`register_family`); the order is the order
# of the table.
FAMILIES: dict[str, Family] = {}

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


def register_family(name: str, search: FamilySearch[OptionsT], options: type[OptionsT]) -> None:
    """Add (or replace) a planner family: `search` is handed an `options` instance (the caller's, or
    `options()` when it gives none; `plait.planners.options.NoOptions` for a family that takes
    nothing beyond `SearchOptions`)."""
    what = f"register_family {name!r}: its options {getattr(options, '__name__', options)!r}"
    if not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        raise SearchError(f"{what} must be a dataclass (plait.plan hands it keywords by field name)")
    try:
        options()
    except TypeError as exc:
        raise SearchError(f"{what} must build with no arguments (a default for every field): {exc}") from None
    FAMILIES[name] = Family(search, options)


def _search_graph(model: ModelSource, cluster: Cluster, common: SearchOptions, simulator: Simulator | None,
                  options: GraphOptions) -> PlanResult:
    """The graph-pipeline family (`plait.planners.graph_search.search_graph`), which first declines a
    chain model where `options.chains` or `options.chains_max_devices` say so. The runtime runs its
    plans, data-parallel stages of any degree included; with `options.runnable` (`plait plan --run`)
    the runtime's `supports` filter drops any it would refuse."""
    from plait.planners.graph_search import search_graph
    from plait.planners.types import load_graph

    limit = options.chains_max_devices
    too_many = limit is not None and cluster.num_devices > limit
    if not options.chains or too_many:  # beside the 3D family, a chain's "graph pipeline" is a 3D plan again
        graph = load_graph(model, common.dtype or "bf16", common.precision)[1]
        outs: dict[str, int] = {}
        ins: dict[str, int] = {}
        for a, b in graph.layer_edges:
            outs[a] = outs.get(a, 0) + 1
            ins[b] = ins.get(b, 0) + 1
        if max([*outs.values(), *ins.values(), 1]) < 2:
            if not options.chains:
                raise SearchError(f"graph: {graph.model} has no branches (its layer DAG is a chain); the 3D "
                                  "family plans chains")
            raise SearchError(f"graph: {graph.model} is a chain on {cluster.num_devices} GPUs; beside the 3D "
                              f"family the graph family plans chains on clusters of up to {limit} "
                              "GPUs (its stage search grows with the GPUs; the 3D grid covers this scale)")
    return search_graph(model, cluster, common, simulator, options)


register_family("3d", search_3d, ThreeDOptions)
register_family("graph", _search_graph, GraphOptions)
register_family("spmd", search_spmd, SpmdOptions)
# SPMD programs inside the stages of a pipeline (plait.search.compose_family), run by
# plait.runtime.compose_worker; a candidate the runtime refuses carries its reason (`Candidate.unsupported`)
register_family("compose", search_compose, ComposeOptions)


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


def options_from_keywords(families: str | Sequence[str] | None,
                          keywords: Mapping[str, Any]) -> tuple[SearchOptions, list[object]]:
    """Keyword arguments by name (`plait.plan`'s) as typed options, built in this one place: a field
    of `SearchOptions` goes there, any other to the options of every searched family whose dataclass
    has a field of that name (`memory_kwargs` to the 3D and the graph family, say). A name that
    neither has is refused, naming it and the families."""
    names = resolve_families(families)
    common = _field_names(SearchOptions)
    own: dict[type, dict[str, Any]] = {FAMILIES[n].options: {} for n in names}
    unknown = []
    for key, value in keywords.items():
        takers = [kind for kind in own if key in _field_names(kind)]
        if key not in common and not takers:
            unknown.append(key)
        for kind in takers:
            own[kind][key] = value
    if unknown:
        known = common.union(*(_field_names(kind) for kind in own))
        raise SearchError(f"plan: option(s) {unknown} are not taken by the families {names}; they take "
                          f"{', '.join(sorted(known))}")
    return (SearchOptions(**{k: v for k, v in keywords.items() if k in common}),
            [kind(**values) for kind, values in own.items() if values])


def _field_names(kind: type) -> set[str]:
    """The fields of an options dataclass."""
    return {f.name for f in dataclasses.fields(kind)}


def search_plans(model: ModelSource | None, cluster: Cluster, *, simulator: Simulator | None,
                 common: SearchOptions | None = None, families: str | Sequence[str] | None = "3d",
                 options: Iterable[object] = (), graph_chains: str = "always") -> PlanResult:
    """The fastest plans of `model` on `cluster` over the planner `families` ("all", a name or a list;
    see FAMILIES), ranked by `simulator` (the layer above builds it for `cluster`:
    `plait.sim.api.PlanSimulator`; None: by each family's analytic model alone). `common` is what
    every family is asked (`SearchOptions`: global batch, top, dtype, ...; its `supports` defaults
    to the runtime's, so no family offers a plan `plait run` refuses); `options` the families' own,
    one object per family type (`ThreeDOptions(finalists=4)`, `GraphOptions(runnable=True)`, ...),
    each handed to the family registered with its type (a family without one gets its defaults).
    `graph_chains` says when the graph family is asked for a chain model beside the 3D family
    (GRAPH_CHAINS: "always", the default; "mixed-kinds" and "never", the earlier policies, kept so a
    bench can run them beside today's in one process).

    One family: its own result. Several: one result whose `top` merges every family's
    finalists by iteration time and whose `families` holds each family's result (or why it
    proposed nothing); a search where no family proposes anything raises the first reason."""
    from plait.graph.zoo import load_model
    from plait.runtime import supports

    t0 = time.perf_counter()
    # The model is resolved here once, for every family: a spec string (zoo or file.py:factory) into
    # its ModelSpec; each family's OpGraph of it comes from `load_graph`'s one cache (per dtype).
    model = load_model(DEFAULT_MODEL if model is None else model) if model is None or isinstance(model, str) \
        else model
    names = resolve_families(families)
    if graph_chains not in GRAPH_CHAINS:
        raise SearchError(f"plan: graph_chains={graph_chains!r}; use one of {list(GRAPH_CHAINS)}")
    common = common or SearchOptions()
    if common.supports is None:  # never offer a plan the runtime would refuse
        common = dataclasses.replace(common, supports=supports)
    own = _family_options(names, options)
    if "graph" in names and "3d" in names and len(names) > 1:
        own["graph"] = _graph_beside_3d(own["graph"], cluster, graph_chains)
    with paused_gc():
        results = _search_families(names, model, cluster, simulator, common, own)
    if len(names) == 1:
        return results[names[0]]  # type: ignore[return-value]
    found = [r for r in results.values() if isinstance(r, PlanResult)]
    if not found:
        raise SearchError("plan: no family proposed a plan: " + "; ".join(
            f"{n}: {r}" for n, r in results.items()))
    merged = sorted((c for r in found for c in r.top), key=lambda c: (c.time_s, c.family, str(c.plan)))
    first = found[0]
    return PlanResult(model=first.model, cluster=first.cluster, global_batch=first.global_batch,
                      world_size=first.world_size, top=merged[:common.top],
                      enumerated=sum(r.enumerated for r in found), pruned=sum(r.pruned for r in found),
                      pruned_reasons=_summed(r.pruned_reasons for r in found),
                      pruned_examples={k: v for r in found for k, v in r.pruned_examples.items()},
                      memory_checked=sum(r.memory_checked for r in found),
                      ranked_analytic=sum(r.ranked_analytic for r in found),
                      simulated=sum(r.simulated for r in found), search_time_s=time.perf_counter() - t0,
                      ranker=first.ranker, families=results, family="+".join(names))


def _family_options(names: list[str], options: Iterable[object]) -> dict[str, Any]:
    """Each searched family's options: the given object of the type it registered, else its
    defaults. An object of a type no searched family takes, or two of one type, is refused."""
    given: dict[type, object] = {}
    for obj in options:
        kind = type(obj)
        if kind in given:
            raise SearchError(f"plan: two {kind.__name__} objects given; give each family's options once")
        if not any(FAMILIES[n].options is kind for n in names):
            takers = [n for n, f in FAMILIES.items() if f.options is kind] or "no registered family"
            raise SearchError(f"plan: {kind.__name__} are the options of {takers}, not of the families "
                              f"searched {names}")
        given[kind] = obj
    own = {n: given.get(FAMILIES[n].options) for n in names}
    return {n: FAMILIES[n].options() if obj is None else obj for n, obj in own.items()}


def _graph_beside_3d(options: GraphOptions, cluster: Cluster, graph_chains: str) -> GraphOptions:
    """The graph family's options beside the 3D family: chains asked for as `graph_chains` says (an
    earlier policy is run beside today's by bench/unified.py), up to GRAPH_CHAINS_MAX_DEVICES GPUs
    unless the caller set a limit."""
    ask = graph_chains == "always" or (graph_chains == "mixed-kinds" and not _one_kind(cluster))
    limit = GRAPH_CHAINS_MAX_DEVICES if options.chains_max_devices is None else options.chains_max_devices
    return dataclasses.replace(options, chains=options.chains and ask, chains_max_devices=limit)


def _one_kind(cluster: Cluster) -> bool:
    """Whether every GPU of `cluster` is of one kind."""
    return len({k for node in cluster.nodes for k in node.gpus}) <= 1


def _search_families(names: list[str], model: ModelSource, cluster: Cluster, simulator: Simulator | None,
                     common: SearchOptions, own: dict[str, Any]) -> dict[str, PlanResult | str]:
    """Each family's result, or why it proposed nothing (raised when it is the only family)."""
    results: dict[str, PlanResult | str] = {}
    for name in names:
        # the family reports its phases to the driver's bar, which draws them and calls the caller's callback
        bar = _FamilyProgress(name, common.progress, common.on_progress, prefix=len(names) > 1)
        asked = dataclasses.replace(common, progress=False, on_progress=bar.report)
        bar.begin()
        try:
            res = FAMILIES[name].search(model, cluster, asked, simulator, own[name])
        except PlaitError as exc:
            if len(names) == 1:
                raise
            results[name] = f"{exc}"
            continue
        finally:
            bar.end()
        for c in res.top:
            c.family = name
            if common.supports is not None and not c.unsupported:  # marked, whichever family
                ok, why = common.supports(c.plan)
                c.unsupported = "" if ok else why
        results[name] = res
    return results


class _FamilyProgress:
    """The progress of one family's search: a bar labelled with the family and its phase
    (checking memory, ranking analytically, placing + simulating) and the caller's callback,
    called as ``on_progress(f"{family} {phase}", done, total)``; a family that reports no
    phases shows one "search" phase from start to end (the bar shows it until a first phase). The family itself is reported as
    phase ``family`` (0 of 1 when it starts, 1 of 1 when it ends), so a caller can time it."""

    def __init__(self, family: str, show: bool, callback: Callable[[str, int, int], None] | None,
                 prefix: bool) -> None:
        self.family, self.show, self.callback = family, show, callback
        self.bar = Progress(show, None, prefix=f"{family}: " if prefix else "")
        self.phase: str | None = None
        self.reported = False

    def begin(self) -> None:
        if self.callback is not None:
            self.callback(self.family, 0, 1)
        self.bar.start("search", 1)  # until the family reports a phase of its own

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
