"""The options of a plan search, typed: what every planner family is asked (`SearchOptions`) and
each family's own (`ThreeDOptions`, `GraphOptions`, `SpmdOptions`, `ComposeOptions`): frozen
dataclasses, one docstring per field, each checking its own fields when it is built.

    search_plans(model, cluster, simulator=sim,
                 common=SearchOptions(global_batch=512, top=5, dtype="bf16"),
                 families="all", options=[ThreeDOptions(finalists=4), GraphOptions(runnable=True)])

The search driver (`plait.search.search_plans`) hands each family the one `SearchOptions` and the
object of the type the family registered (`register_family`), so a reader follows each value from
the caller into the planner; a family registered beside these four defines its own dataclass.
A bad value raises a `SearchError` naming the field when the options are built, before any work.
This module sits below the families and the driver (it imports neither), so both import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plait.ir.plan import Plan
from plait.planners.types import MAX_PROGRAM_DEVICES, PLAN_DTYPES, SearchError

if TYPE_CHECKING:
    from plait.cost.compute import ComputeModel
    from plait.planners.hetero import LayerTimeFn
    from plait.planners.threed import SearchSpace

__all__ = ["ComposeOptions", "GraphOptions", "NoOptions", "SearchOptions", "SpmdOptions", "ThreeDOptions"]

# The runtime's check of a plan: (plan) -> (ok, why not).
Supports = Callable[[Plan], tuple[bool, str]]
# A search's progress: (phase, done, total).
OnProgress = Callable[[str, int, int], None]


def _at_least(name: str, value: int | None, low: int, none_ok: bool = True) -> None:
    """A SearchError naming option `name` unless `value` is a whole number >= `low` (or None, where allowed)."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        allowed = f"a whole number >= {low}" + (" or None" if none_ok else "")
        raise SearchError(f"plan: option {name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class SearchOptions:
    """What every family is asked, whichever it is."""

    global_batch: int | None = None
    """Samples per iteration; None: `plait.planners.types.DEFAULT_GLOBAL_BATCH`."""
    top: int = 5
    """How many plans the search returns (each family returns at most this many; the driver merges
    them and keeps the fastest `top`)."""
    dtype: str | None = None
    """The plans' training dtype (fp32, tf32, bf16, fp16); None: each family's default (bf16, or
    fp16 where a GPU kind has no bf16 unit: `auto_dtype`)."""
    precision: str = "amp"
    """How a bf16 / fp16 plan keeps its states and activations (`plait.cost.memory.PRECISIONS`):
    "amp", as plait's engines train it (fp32 parameters, ops under autocast: the model is captured
    so and its memory checked so); "megatron", the model in that dtype with fp32 main parameters
    (Megatron-LM, DeepSpeed: for a plan exported to them). The SPMD and composed families check
    memory as "megatron" whatever this says (their own accounting; not yet autocast's)."""
    jobs: int | None = None
    """Worker processes of the families that fan out (the 3D family's memory check and simulations,
    the composed family's syntheses; `plait.workers`); the same plans whatever the number. None:
    each family's default (this machine's CPUs on large clusters, or `PLAIT_JOBS`)."""
    compute: ComputeModel | None = None
    """The compute model every analytic ranking prices layers with (`plait.cost.compute`); None:
    the A100-fitted default, refined per cluster by its measured profiles."""
    supports: Supports | None = None
    """`(plan) -> (ok, why)`: a plan it refuses is never offered (counted among the pruned, with its
    reason). None: the search driver fills in the runtime's (`plait.runtime.supports`); a family
    called directly with None filters nothing."""
    progress: bool = False
    """Draw a progress bar on stderr (the driver draws one per family and phase)."""
    on_progress: OnProgress | None = None
    """Called as `on_progress(phase, done, total)`; the driver calls it with "family phase" and
    hands each family its own bar's callback here."""

    def __post_init__(self) -> None:
        _at_least("global_batch", self.global_batch, 1)
        _at_least("top", self.top, 1, none_ok=False)
        if self.dtype is not None and self.dtype not in PLAN_DTYPES:
            raise SearchError(f"plan: option dtype must be one of {list(PLAN_DTYPES)}, got {self.dtype!r}")
        from plait.cost.memory import PRECISIONS

        if self.precision not in PRECISIONS:
            raise SearchError(f"plan: option precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        if self.jobs is not None:
            from plait.workers import check_jobs

            check_jobs(self.jobs, "jobs")


@dataclass(frozen=True)
class ThreeDOptions:
    """The 3D family's (`plait.planners.threed.search_3d`): data x tensor x pipeline plans."""

    finalists: int | None = 12
    """How many of the analytically best candidates are placed and timed by the simulator; None:
    every candidate (exhaustive)."""
    space: SearchSpace | None = None
    """What to enumerate (`plait.planners.threed.SearchSpace`, `plait plan --space`); None: every
    valid degree, micro-batch and option. `SearchOptions.dtype` overrides its `dtype`."""
    placement: bool = True
    """Place each candidate's ranks on the GPUs by simulated annealing over the links (False:
    Megatron's rank order)."""
    seed: int = 0
    """Seed of the placement annealing."""
    placement_iterations: int | None = None
    """Annealing steps of one placement (`plait.planners.placement.anneal`); None: its default,
    which grows with the cluster."""
    memory_kwargs: dict[str, Any] | None = None
    """Keyword arguments of the memory estimate (`plait.cost.memory.estimate_memory`: optimizer,
    loss, overhead_bytes, ...); None: its defaults."""
    layer_time: LayerTimeFn | None = None
    """`(layer, gpu kind, plan) -> seconds`: the analytic model's layer times and the uneven
    layer split's; None: priced by `SearchOptions.compute`."""
    fast: bool = True
    """Reuse stage graphs and messages across candidates; False: rebuild them for each (the same
    numbers, slower: the baseline of bench/plan_search_time.py)."""

    def __post_init__(self) -> None:
        _at_least("finalists", self.finalists, 1)
        _at_least("placement_iterations", self.placement_iterations, 1)


@dataclass(frozen=True)
class GraphOptions:
    """The graph-pipeline family's (`plait.planners.graph_search.search_graph`): a DAG of stages."""

    runnable: bool = False
    """Offer only what the runtime runs: `SearchOptions.supports` filters the plans (False: the
    family ignores it; the driver still marks a plan the runtime refuses)."""
    chains: bool = True
    """Plan models whose layer DAG is a chain too; False: decline them ("no branches"), leaving
    chains to the 3D family (the driver's policy before issue 36, `graph_chains="never"`)."""
    chains_max_devices: int | None = None
    """Decline a chain model on clusters of more GPUs than this (the driver sets it beside the 3D
    family, whose grid covers chains at that scale); None: no limit."""
    max_dp: int | None = None
    """Most data-parallel replicas per stage; 1: pure pipelines; None: any."""
    candidates: int = 6
    """Stage lists of the partitioner turned into plans and ranked."""
    memory_kwargs: dict[str, Any] | None = None
    """Keyword arguments of the memory estimate, as `ThreeDOptions.memory_kwargs`."""
    fast: bool = True
    """Build the partitioner's cost tables lazily; False: whole (the same plans, slower)."""
    option_top: int = 2
    """The best simulated stage graphs also tried at each ZeRO stage (0: none)."""

    def __post_init__(self) -> None:
        _at_least("chains_max_devices", self.chains_max_devices, 1)
        _at_least("max_dp", self.max_dp, 1)
        _at_least("candidates", self.candidates, 1, none_ok=False)
        _at_least("option_top", self.option_top, 0, none_ok=False)


@dataclass(frozen=True)
class SpmdOptions:
    """The SPMD family's (`plait.search.spmd_family.search_spmd`): one program over every GPU."""

    max_states: int = 20_000
    """States of the exact program search before it turns to a beam search."""
    max_devices: int = MAX_PROGRAM_DEVICES
    """The most GPUs one flat program is searched for; larger clusters are declined."""
    runnable: bool = False
    """Offer only a program the runtime runs as captured (decline a dtype that changes the graph)."""

    def __post_init__(self) -> None:
        _at_least("max_states", self.max_states, 1, none_ok=False)
        _at_least("max_devices", self.max_devices, 1, none_ok=False)


@dataclass(frozen=True)
class ComposeOptions:
    """The composed family's (`plait.search.compose_family.search_compose`): SPMD programs inside
    pipeline stages."""

    max_states: int = 20_000
    """States of each stage program's exact search before it turns to a beam search."""
    max_devices: int = MAX_PROGRAM_DEVICES
    """The most GPUs the family synthesizes stage programs for; larger clusters are declined."""
    max_stages: int = 4
    """The most pipeline stages (node groups) a composed plan has."""
    candidates: int = 6
    """(grouping, micro-batch) options with the least pipeline estimate that are synthesized and
    simulated."""
    runnable: bool = False
    """Offer only stage programs the runtime runs as captured (decline a dtype that changes a
    stage's graph)."""

    def __post_init__(self) -> None:
        _at_least("max_states", self.max_states, 1, none_ok=False)
        _at_least("max_devices", self.max_devices, 1, none_ok=False)
        _at_least("max_stages", self.max_stages, 2, none_ok=False)
        _at_least("candidates", self.candidates, 1, none_ok=False)


@dataclass(frozen=True)
class NoOptions:
    """The options of a family that takes none beyond `SearchOptions`."""
