"""What every planner family shares, below the families and the search driver (`plait.search`):
the result types a search returns (`Candidate`, `PlanResult`), its error (`SearchError`), the
`Simulator` the driver hands a family (built by the layer above the search), the defaults
of `plait plan`, and the model graph and dtype every family resolves the same way (`load_graph`,
`auto_dtype`). A new family imports these from here, not from another family's module."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from plait.errors import PlaitError
from plait.ir.plan import Plan
from plait.planners.placement import PlacementResult

if TYPE_CHECKING:
    from plait.cluster.spec import Cluster
    from plait.cost.program import Problem, ProgramStage
    from plait.graph.resolve import ModelSource
    from plait.ir.opgraph import OpGraph
    from plait.net.view import ClusterView

# Ranks a placed finalist: (graph, plan) -> {"iteration_time_s", "tflops_per_gpu", ...}.
Evaluate = Callable[["OpGraph", Plan], dict[str, Any]]


class SimTimes(Protocol):
    """What a family reads of a simulated iteration (`plait.sim.api.SimResult`)."""

    iteration_time_s: float
    throughput_samples_per_s: float
    tflops_per_gpu: float
    memory_peak_bytes: list[int] | None

    def to_dict(self) -> dict[str, Any]: ...


class Simulator(Protocol):
    """The one simulator as every planner family sees it, for one cluster. The layer above the
    search builds it (`plait.sim.api.PlanSimulator`: `plait.api.plan`, `plait plan`, the recovery
    loop) and the driver hands it to each family, so every family is timed by the same engine on
    the same resolved cluster, and no planner imports `plait.sim` (an import contract in
    pyproject.toml)."""

    @property
    def view(self) -> ClusterView:
        """The cluster's devices and links, resolved once for every family."""
        ...

    def evaluate(self, graph: OpGraph, plan: Plan) -> dict[str, Any]:
        """A placed 3D or graph plan's iteration (`SimResult.to_dict()`), without its memory
        estimate (the search has it)."""
        ...

    def spmd(self, problem: Problem, synthesis: Any, *, batch: int, name: str = "spmd",
             device_scale: Any = None, mesh: Any = None) -> SimTimes:
        """A synthesized SPMD program of `problem` run on the cluster (`simulate_spmd`)."""
        ...

    def compose(self, stages: list[ProgramStage], edges: list[tuple[int, int]],
                bytes_per_sample: dict[tuple[int, int], float], micro_batches: int, micro_batch: int, *,
                schedule: str, tied: Any, memory: list[int], name: str, flops: float) -> SimTimes:
        """A composed plan's iteration: SPMD stage programs in a pipeline (`simulate_compose`)."""
        ...

DEFAULT_MODEL = "gpt:layers=4,hidden=128,heads=4,seq=64,vocab=1024"


def _default_cluster() -> str:
    """The mixed cluster this machine can emulate with one CPU per rank, which `plait plan --run`
    needs to predict this machine (`plait.measure.machine`): 2 nodes x 2 GPUs from 4 CPUs on,
    else 2 nodes x 1 GPU (with 4 ranks on 2 CPUs the ranks time-share CPUs and the machine
    prediction was 18-23 % low, measured)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return "emulated-mixed" if cpus >= 4 else "emulated-mixed:gpus_per_node=1"


DEFAULT_CLUSTER = _default_cluster()
DEFAULT_GLOBAL_BATCH = 16
# The most GPUs the per-op families search (one flat SPMD program: HAP's testbed; composed stage
# programs) and the graph family is asked for chain models beside the 3D family: their searches grow
# with the GPUs, while the 3D family's grid covers larger clusters.
MAX_PROGRAM_DEVICES = 64
GiB = 2**30


class SearchError(PlaitError, ValueError):
    """A search request that cannot be answered (bad argument, or nothing fits)."""



@dataclass
class Candidate:
    plan: Plan
    layout: str = "default"
    analytic_s: float = math.inf  # cheap model, seconds per iteration
    iteration_time_s: float | None = None  # simulator
    tflops_per_gpu: float | None = None
    throughput: float | None = None  # samples/s
    peak_bytes: list[int] = field(default_factory=list)  # per device id
    headroom_by_kind: dict[str, int] = field(default_factory=dict)  # min bytes free per GPU kind
    placement: PlacementResult | None = None
    default_order_time_s: float | None = None  # simulated with the layout's start order
    # the annealed order's simulated time when the start order simulated faster and was kept
    placed_time_s: float | None = None
    sim: dict[str, Any] | None = None
    family: str = "3d"  # the planner family that proposed it ("3d", "graph", "spmd", ...)
    unsupported: str = ""  # why `plait.runtime.supports` refuses the plan ("" when it runs or was not asked)

    @property
    def time_s(self) -> float:
        return self.iteration_time_s if self.iteration_time_s is not None else self.analytic_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan.to_dict(),
            "plan_str": str(self.plan),
            "family": self.family,
            "runnable": not self.unsupported,
            "unsupported": self.unsupported,
            "layout": self.layout,
            "iteration_time_s": self.iteration_time_s,
            "analytic_time_s": self.analytic_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "throughput_samples_per_s": self.throughput,
            "memory_peak_bytes": self.peak_bytes,
            "memory_headroom_bytes_by_kind": self.headroom_by_kind,
            "placement": self.placement.to_dict() if self.placement else None,
            "default_order_time_s": self.default_order_time_s,
            "placed_time_s": self.placed_time_s,
            "costs": (self.sim or {}).get("costs", ""),  # measured vs modelled (issue 28)
        }


@dataclass
class PlanResult:
    model: str
    cluster: str
    global_batch: int
    world_size: int
    top: list[Candidate]
    enumerated: int = 0
    pruned: int = 0
    pruned_reasons: dict[str, int] = field(default_factory=dict)
    pruned_examples: dict[str, str] = field(default_factory=dict)
    memory_checked: int = 0
    ranked_analytic: int = 0
    simulated: int = 0
    search_time_s: float = 0.0
    ranker: str = "simulator"
    # the search of each family when several ran (plait.search.driver): name -> its own result,
    # or the reason it proposed nothing (e.g. "no branches" for graph pipelines of a chain)
    families: dict[str, PlanResult | str] = field(default_factory=dict)
    family: str = "3d"  # the planner family that made the plans ("3d", "graph")
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific facts (e.g. graph: depth, bound)

    @property
    def best(self) -> Candidate:
        return self.top[0]

    @property
    def plan(self) -> Plan:
        return self.top[0].plan

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "cluster": self.cluster, "global_batch": self.global_batch,
            "world_size": self.world_size, "ranker": self.ranker,
            "candidates": {"enumerated": self.enumerated, "pruned_memory": self.pruned,
                           "memory_checked": self.memory_checked, "ranked_analytic": self.ranked_analytic,
                           "simulated": self.simulated},
            "pruned_reasons": self.pruned_reasons, "pruned_examples": self.pruned_examples,
            "search_time_s": self.search_time_s,
            "top": [c.to_dict() for c in self.top],
            **({"families": {name: (r if isinstance(r, str) else r.family_summary())
                             for name, r in self.families.items()}} if self.families else {}),
            **({"family": self.family, **self.extra} if self.family != "3d" else {}),
        }

    def family_summary(self) -> dict[str, Any]:
        """This result as one family's row: its best time, search time and candidate counts."""
        return {"best_time_s": self.best.time_s if self.top else None,
                "best_plan": str(self.best.plan) if self.top else None,
                "search_time_s": self.search_time_s, "enumerated": self.enumerated,
                "pruned_memory": self.pruned, "simulated": self.simulated}


_GRAPHS: dict[tuple[str, str, str], tuple[Any, OpGraph]] = {}


def load_graph(model: ModelSource, dtype: str = "bf16", precision: str = "megatron") -> tuple[Any, OpGraph]:
    """(ModelSpec or None, OpGraph) of a zoo spec string, a ModelSpec, or an OpGraph.

    The graph is the one the simulator uses (`plait.graph.resolve.resolve_model`: a capture
    on the meta device; the closed-form GPT graph for deep zoo GPTs; under autocast for a 16-bit
    `dtype` at `precision` "amp"), cached per spec, dtype and precision."""
    from plait.ir.opgraph import OpGraph

    if isinstance(model, OpGraph):
        return None, model
    from plait.graph.resolve import resolve_model
    from plait.graph.zoo import load_model

    spec = load_model(model) if isinstance(model, str) else model
    key = (getattr(spec, "spec", "") or getattr(spec, "name", ""), dtype, precision)
    if key[0] and key in _GRAPHS:
        return _GRAPHS[key]
    graph = resolve_model(getattr(spec, "spec", None) or spec, Plan(dtype=dtype), precision=precision)
    if key[0]:
        _GRAPHS[key] = (spec, graph)
    return spec, graph


PLAN_DTYPES = ("fp32", "tf32", "bf16", "fp16")  # what a plan's `dtype` may be (`Plan`)


def auto_dtype(cluster: Cluster) -> str:
    """bf16 where every GPU kind has bf16 units, else fp16 (V100/T4 train mixed precision in fp16)."""
    kinds = {d.kind.name: d.kind for d in cluster.devices}.values()
    return "bf16" if all(k.peak_flops.get("bf16") for k in kinds) else "fp16"


def memory_headroom(peaks: list[int], devices: list, plan: Plan) -> dict[str, int]:
    """Least free memory (bytes) per GPU kind over the devices `plan` uses: its memory margin."""
    out: dict[str, int] = {}
    used = sorted({d for s in plan.stages for d in s.devices}) if plan.stages else \
        [plan.device_of(r) for r in range(plan.world_size)]
    for i in used:
        dev = devices[i]
        room = dev.kind.memory_bytes - peaks[dev.id]
        out[dev.kind.name] = min(out.get(dev.kind.name, room), room)
    return out
