"""`simulate(model, cluster, plan)`: predict one training iteration.

Model: an `OpGraph`, a zoo spec string (``gpt:layers=24,hidden=1024``), a path to an
OpGraph JSON file, a `ModelSpec`, or an `nn.Module` with ``inputs=``. Cluster: a
`Cluster`, a preset string or YAML path (`plait.cluster.load_cluster`), or a
`ClusterView`. Plan: a `Plan`, its short string form, or a plan JSON path.

The result carries the fields of ``plait simulate --json``: iteration time,
throughput, TFLOP/s per GPU in both conventions -- ``model_tflops_per_gpu`` (the
forward + backward FLOPs of the model, recompute excluded: what MFU counts, Chowdhery et
al. 2022) and ``hardware_tflops_per_gpu`` (recompute included: what Megatron-LM's papers
report as achieved TFLOP/s, Narayanan et al. SC'21 eq. (3)); ``tflops_per_gpu`` is an
alias of the model figure --, exposed communication (communication on
the critical path, including tensor-parallel collectives that block the compute
stream), per-device memory peak and fit (`plait.cost.memory`), the critical path,
per-resource busy fraction and the `Timeline`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from plait.cluster.spec import Cluster, ClusterSource
from plait.cost.compute import recompute_flops
from plait.cost.program import ProgramStage
from plait.errors import PlaitError
from plait.graph.resolve import ModelSource, resolve_model
from plait.ir.opgraph import OpGraph
from plait.ir.plan import Plan, PlanSource, check_plan_for_model
from plait.ir.timeline import Timeline, TimelineEvent
from plait.net.paths import from_plan_field
from plait.net.view import ClusterView
from plait.sim.engine import Schedule
from plait.sim.engine import simulate as run_engine
from plait.sim.lowering import Lowered, SimOptions, lower
from plait.workers import paused_gc


class SimulateError(PlaitError, ValueError):
    """Bad input to `simulate` (model, cluster or plan that cannot be resolved)."""


@dataclass
class SimResult:
    iteration_time_s: float
    throughput_samples_per_s: float
    tflops_per_gpu: float  # alias of model_tflops_per_gpu (kept for existing callers)
    exposed_comm_s: float
    memory_peak_bytes: list[int] | None
    fits_memory: bool | None
    critical_path: list[dict[str, Any]]
    busy_fraction: dict[str, float]
    world_size: int
    num_tasks: int
    symmetry: str
    granularity: str
    sim_wall_s: float
    breakdown: dict[str, float] = field(default_factory=dict)
    memory: Any = None  # the full MemoryEstimate when available
    plan: str = ""
    model: str = ""
    cluster: str = ""
    hardware_tflops_per_gpu: float = 0.0  # recompute FLOPs included (Megatron's "achieved TFLOP/s")
    # which compute costs were measured and which modelled ("compute measured on a100-80gb,
    # modelled on v100-32gb"; `plait.cost.compute.compute_provenance`)
    costs: str = ""
    _timeline: Timeline | None = field(default=None, repr=False)
    _build: Any = field(default=None, repr=False)  # deferred timeline construction

    @property
    def model_tflops_per_gpu(self) -> float:
        """Model FLOPs (forward + backward, recompute excluded) per second per GPU, in TFLOP/s."""
        return self.tflops_per_gpu

    @property
    def timeline(self) -> Timeline:
        """The simulated `Timeline` (built on first use: 10^5 events take a second)."""
        if self._timeline is None and self._build is not None:
            self._timeline = self._build()
            self._build = None
        return self._timeline  # type: ignore[return-value]

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        d = {
            "model": self.model,
            "cluster": self.cluster,
            "plan": self.plan,
            "iteration_time_s": self.iteration_time_s,
            "throughput_samples_per_s": self.throughput_samples_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "exposed_comm_s": self.exposed_comm_s,
            "memory_peak_bytes": self.memory_peak_bytes,
            "fits_memory": self.fits_memory,
            "critical_path": self.critical_path,
            "busy_fraction": self.busy_fraction,
            "breakdown_s": self.breakdown,
            "world_size": self.world_size,
            "num_tasks": self.num_tasks,
            "symmetry": self.symmetry,
            "granularity": self.granularity,
            "sim_wall_s": self.sim_wall_s,
            "costs": self.costs,
        }
        if self.memory is not None and hasattr(self.memory, "violations"):
            d["memory_violations"] = list(self.memory.violations)
        if timeline:
            d["timeline"] = self.timeline.to_dict()
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save_chrome_trace(self, path: str | Path) -> None:
        self.timeline.save_chrome_trace(path)

    def save_gantt(self, path: str | Path, title: str | None = None) -> Path:
        from plait.sim.gantt import save_gantt

        return save_gantt(self.timeline, path, title or f"{self.model} | {self.plan}")


# ---------------------------------------------------------------- resolution
def resolve_plan(plan: PlanSource | dict[str, Any]) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        return Plan.load(str(plan))
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    raise SimulateError(f"plan: expected a Plan, a short string or a JSON path, got {type(plan).__name__}")


def resolve_cluster(cluster: ClusterSource | ClusterView) -> ClusterView:
    if isinstance(cluster, ClusterView):
        return cluster
    if isinstance(cluster, Cluster):
        return ClusterView.from_cluster(cluster)
    if isinstance(cluster, (str, os.PathLike)):
        try:
            from plait.cluster import load_cluster
        except ImportError:
            raise SimulateError(f"cluster {cluster!r}: plait.cluster.load_cluster is not available") from None
        return ClusterView.from_cluster(load_cluster(str(cluster)))
    raise SimulateError(f"cluster: expected a Cluster, preset string or YAML path, got {type(cluster).__name__}")


# ---------------------------------------------------------------- simulate
def simulate(model: ModelSource, cluster: ClusterSource | ClusterView, plan: PlanSource | dict[str, Any], *,
             inputs: Any = None, options: SimOptions | None = None,
             analytic: bool | None = None, memory: bool = True, memory_options: dict[str, Any] | None = None,
             precision: str = "amp", **option_overrides: Any) -> SimResult:
    """Predict one training iteration (see module docstring). Keyword overrides go to `SimOptions`
    (``granularity=``, ``symmetry=``, ``overlap_grad_reduce=``, ``compute=``, ...); `memory_options`
    to `plait.cost.memory.estimate_memory` (``optimizer=``, ``loss=``). The gradient bucket is the
    plan's `grad_bucket_mb`: the runtime's, the simulator's and the memory estimate's. `precision`:
    how a bf16 / fp16 plan trains (`plait.graph.resolve.resolve_model`): "amp" as plait's engines
    do (fp32 parameters under autocast), "megatron" as Megatron-LM and DeepSpeed do; a model given
    as an OpGraph is taken as it was captured."""
    plan_obj = resolve_plan(plan)
    view = resolve_cluster(cluster)
    if any(st.spmd is not None for st in plan_obj.stages):  # a composed plan: SPMD programs in the stages
        return simulate_composed_plan(model, view, plan_obj, memory_options=memory_options)
    if plan_obj.spmd is not None:  # an op-level SPMD program: one stage (plait.sim.lowering.pipeline)
        return simulate_spmd_plan(model, view, plan_obj, memory_options=memory_options)
    graph = resolve_model(model, plan_obj, inputs, analytic, precision)
    check_plan_for_model(plan_obj, graph.config, graph.model)  # as strict as `plait run`
    if plan_obj.tp > 1 and not any(layer.tp_style == "transformer" for layer in graph.layers):
        # the 3D planner's rule (`plait.planners.threed`): it offers no tp > 1 for such a model
        raise SimulateError(f"plan field 'tp': {plan_obj.tp} > 1, but model {graph.model} has no layer tensor "
                            "parallelism can cut (no plait_tp markers, no tensor-parallel plan in its config): "
                            "every rank would hold and run the whole model; use tp=1")
    opts = options or SimOptions()
    if option_overrides:
        unknown = [k for k in option_overrides if not hasattr(opts, k)]
        if unknown:
            raise SimulateError(f"simulate: unknown option(s) {unknown}")
        opts = SimOptions(**{**opts.__dict__, **option_overrides})
    if plan_obj.flow_paths is not None and plan_obj.flow_paths["paths"] and view.fabric is None:
        raise SimulateError(f"plan field 'flow_paths': the plan routes flows over a switched fabric, but "
                            f"cluster {view.name!r} describes none (fabric.switches); re-plan for this cluster")
    if view.cluster is not None and view.cluster.model_profiles:  # measured where the cluster's profile has it
        compute = opts.compute.with_profile(view.cluster, graph, plan_obj.dtype)
        if compute is not opts.compute:
            opts = dataclasses.replace(opts, compute=compute)
    if plan_obj.flow_paths is not None and view.fabric is not None:
        view = view.with_flow_paths(from_plan_field(view.fabric, plan_obj.flow_paths))
    t0 = time.perf_counter()
    with paused_gc():  # 10^5 tasks of small acyclic objects: the collector's passes cost a quarter
        lowered = lower(graph, plan_obj, view, opts)
        schedule = run_engine(lowered.graph)
        result = _result(graph, plan_obj, view, lowered, schedule, time.perf_counter() - t0)
    result.costs = _provenance(graph, plan_obj, view, opts)
    if memory and view.cluster is not None:
        mem = dict(memory_options or {})
        _attach_memory(result, graph, plan_obj, view.cluster, mem)
    return result


def _provenance(graph: OpGraph, plan: Plan, view: ClusterView, opts: SimOptions) -> str:
    """The line that says which compute costs of `plan` were measured and which modelled."""
    from plait.cost.compute import compute_provenance

    if opts.layer_times:
        return "compute measured on this machine (per-layer times)"
    kinds = [k.name for k in view.kinds]
    if plan.stages:
        entries = [(kinds[d], name, st.micro_batch or plan.micro_batch, 1)
                   for st in plan.stages for d in st.devices for name in st.layers]
    else:
        entries = [(k, layer.name, plan.micro_batch, plan.tp) for k in dict.fromkeys(kinds) for layer in graph.layers]
    return compute_provenance(opts.compute, list(dict.fromkeys(entries)))


def _attach_memory(result: SimResult, graph: OpGraph, plan: Plan, cluster: Cluster,
                   memory_options: dict[str, Any]) -> None:
    from plait.cost.memory import estimate_memory

    est = estimate_memory(graph, plan, cluster, **memory_options)
    result.memory = est
    result.memory_peak_bytes = [int(x) for x in est.peak_bytes]
    result.fits_memory = bool(est.fits)


_COMPUTE = ("forward", "backward", "recompute", "optimizer")
# SPMD programs price each aten op at its shard (`plait.cost.spmd`), from the model profile's layer
# times where it has them (`plait.cost.spmd.measured_work`; `Problem.costs` says which)
OP_COSTS = "compute modelled per aten op"


@dataclass
class _TaskArrays:
    """A simulated task graph's columns as arrays, built once for the figures of its result."""

    start: np.ndarray
    end: np.ndarray
    device: np.ndarray  # -1: no device
    category: np.ndarray  # codes into category_names
    category_names: list[str]
    resource: np.ndarray  # codes into resource_names
    resource_names: list[str]

    @classmethod
    def of(cls, tg: Any, sched: Any) -> _TaskArrays:
        cats, cat_names = _codes(tg.category)
        res, res_names = _codes(tg.resource)
        device = np.nan_to_num(np.asarray(tg.device, dtype=float), nan=-1.0).astype(np.int64)  # None: -1
        return cls(np.asarray(sched.start, dtype=float), np.asarray(sched.end, dtype=float), device, cats,
                   cat_names, res, res_names)


def schedule_figures(tg: Any, sched: Any, folded: dict[int, float]) -> tuple[
        dict[str, float], dict[str, float], float, list[dict[str, Any]]]:
    """What every `SimResult` reports from a schedule, the task columns read once: (busy fraction
    per compute stream, task seconds per category, exposed communication -- `folded`: the
    tensor-parallel seconds folded into compute tasks, by task id -- and the critical path)."""
    arrays = _TaskArrays.of(tg, sched)
    busy, by_cat = busy_and_breakdown(tg, sched, arrays)
    critical = [{"name": tg.name[t], "category": tg.category[t], "resource": tg.resource[t],
                 "start_s": sched.start[t], "end_s": sched.end[t]} for t in sched.critical_path()]
    return busy, by_cat, _exposed_comm(tg, sched, folded, arrays), critical


def busy_and_breakdown(tg: Any, sched: Any, arrays: _TaskArrays | None = None) -> tuple[dict[str, float],
                                                                                      dict[str, float]]:
    """(busy fraction of each compute stream over the makespan, seconds of task time per category)
    of a simulated task graph: the figures every `SimResult` reports."""
    T = sched.makespan
    x = arrays or _TaskArrays.of(tg, sched)
    per_cat = np.bincount(x.category, weights=x.end - x.start, minlength=len(x.category_names))
    by_cat = {name: float(v) for name, v in zip(x.category_names, per_cat)}
    compute = np.asarray([name.endswith("/compute") for name in x.resource_names], dtype=bool)
    busy: dict[str, float] = {}
    for k, a, b in _grouped(x.resource, compute[x.resource], x.start, x.end):
        busy[x.resource_names[k]] = float(np.sum(b - a)) / T if T > 0 else 0.0
    return dict(sorted(busy.items())), by_cat


def _codes(labels: list) -> tuple[np.ndarray, list]:
    """(an integer code per label, the distinct labels in order of first appearance)."""
    names = list(dict.fromkeys(labels))
    index = {x: i for i, x in enumerate(names)}
    return np.fromiter(map(index.__getitem__, labels), dtype=np.int64, count=len(labels)), names


def _grouped(group: np.ndarray, keep: np.ndarray, start: np.ndarray,
             end: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Per group (ascending) of the kept tasks: the union of their [start, end) intervals as
    (group, starts, ends) of disjoint, sorted intervals. Empty intervals are dropped; intervals
    that touch or overlap merge (a sweep: sorted by start, a new interval begins where the start
    passes every earlier end)."""
    sel = np.flatnonzero(keep & (end > start))
    if len(sel) == 0:
        return
    order = sel[np.lexsort((end[sel], start[sel], group[sel]))]
    g, a, b = group[order], start[order], end[order]
    cuts = np.flatnonzero(g[1:] != g[:-1]) + 1
    for lo, hi in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(g)]])):
        ga, gb = a[lo:hi], np.maximum.accumulate(b[lo:hi])
        first = np.ones(len(ga), dtype=bool)
        first[1:] = ga[1:] > gb[:-1]
        heads = np.flatnonzero(first)
        yield int(g[lo]), ga[heads], gb[np.append(heads[1:] - 1, len(ga) - 1)]


def _exposed_comm(tg: Any, sched: Schedule, folded: dict[int, float], arrays: _TaskArrays | None = None) -> float:
    """Communication not overlapped by computation, on the device where it is largest.

    Per device: the time some communication of the device is in flight while its compute
    stream runs nothing (|union(comm) - union(compute)|), plus the tensor-parallel
    collectives folded into compute tasks, which block the stream (Megatron runs them on it)."""
    x = arrays or _TaskArrays.of(tg, sched)
    dev, names = x.device, x.category_names
    on_device = dev >= 0
    is_comp = np.asarray([c in _COMPUTE for c in names], dtype=bool)[x.category] & on_device
    is_comm = np.asarray([c.startswith("comm") for c in names], dtype=bool)[x.category] & on_device
    totals = np.zeros(int(dev.max()) + 1 if len(dev) else 0)
    if folded:  # folded tensor-parallel time of compute tasks, per device
        ids = np.fromiter(folded, dtype=np.int64, count=len(folded))
        seconds = np.fromiter(folded.values(), dtype=float, count=len(folded))
        keep = is_comp[ids]
        totals += np.bincount(dev[ids[keep]], weights=seconds[keep], minlength=len(totals))
    busy = {d: (a, b, np.concatenate([[0.0], np.cumsum(b - a)]))
            for d, a, b in _grouped(dev, is_comp, x.start, x.end)}
    for d, ma, mb in _grouped(dev, is_comm, x.start, x.end):
        exposed = mb - ma
        if d in busy:  # minus each comm interval's overlap with the compute union
            exposed = exposed - (_covered(busy[d], mb) - _covered(busy[d], ma))
        totals[d] += float(np.sum(np.maximum(exposed, 0.0)))
    return float(totals.max()) if len(totals) else 0.0


def _covered(union: tuple[np.ndarray, np.ndarray, np.ndarray], x: np.ndarray) -> np.ndarray:
    """How much of [0, x) the disjoint sorted intervals (starts, ends, cumulative lengths) cover."""
    starts, ends, cum = union
    k = np.searchsorted(starts, x, side="right")  # intervals starting before x
    inside = np.where(k > 0, np.minimum(x, ends[np.maximum(k - 1, 0)]) - starts[np.maximum(k - 1, 0)], 0.0)
    return cum[np.maximum(k - 1, 0)] * (k > 0) + np.maximum(inside, 0.0)


def iteration_flops(graph: OpGraph, plan: Plan) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one iteration of `plan` over all GPUs.

    Model FLOPs: forward + backward of every sample (recompute excluded; the MFU numerator).
    Hardware FLOPs add the forward work activation recompute re-runs
    (`plait.cost.compute.recompute_flops`), as Narayanan et al. (SC'21, eq. (3)) count it: with
    full recompute a transformer layer's share is 4/3 of its model FLOPs."""
    model = (graph.fwd_flops + graph.bwd_flops) * plan.global_batch
    extra = sum(recompute_flops(layer, graph, plan.recompute) for layer in graph.layers) * plan.global_batch
    return model, model + extra


def _result(graph: OpGraph, plan: Plan, view: ClusterView, lowered: Lowered, sched: Schedule,
            wall: float) -> SimResult:
    tg = lowered.graph
    T = sched.makespan

    def build_timeline() -> Timeline:
        events = [TimelineEvent(name=tg.name[i], category=tg.category[i], resource=tg.resource[i],
                                start=sched.start[i], end=sched.end[i], device=tg.device[i],
                                stage=tg.stage[i], micro_batch=tg.micro_batch[i],
                                args=dict(tg.args[i] or {}), chunk=tg.chunk[i])
                  for i in range(len(tg))]
        return Timeline(events=events, source="simulated",
                        meta={"plan": str(plan), "model": graph.model, "cluster": view.name,
                              "symmetry": lowered.symmetry_note, "granularity": lowered.granularity})

    busy, by_cat, exposed, critical = schedule_figures(tg, sched, lowered.tp_comm_s)
    model_flops, hardware_flops = iteration_flops(graph, plan)
    world = lowered.world_size
    return SimResult(
        iteration_time_s=T,
        throughput_samples_per_s=plan.global_batch / T if T > 0 else 0.0,
        tflops_per_gpu=model_flops / T / world / 1e12 if T > 0 and world else 0.0,
        hardware_tflops_per_gpu=hardware_flops / T / world / 1e12 if T > 0 and world else 0.0,
        exposed_comm_s=exposed,
        memory_peak_bytes=None,
        fits_memory=None,
        critical_path=critical,
        busy_fraction=busy,
        world_size=world,
        num_tasks=len(tg),
        symmetry=lowered.symmetry_note,
        granularity=lowered.granularity,
        sim_wall_s=wall,
        breakdown=by_cat,
        plan=str(plan),
        model=graph.model if not graph.config else f"{graph.model}:" + ",".join(
            f"{k}={graph.config[k]}" for k in ("layers", "hidden", "heads", "seq") if k in graph.config),
        cluster=view.name,
        _build=build_timeline,
    )


# ---------------------------------------------------------------- composed plans
def simulate_compose(stages: list[ProgramStage], edges: list[tuple[int, int]],
                     bytes_per_sample: dict[tuple[int, int], float], micro_batches: int, micro_batch: int,
                     cluster: ClusterSource | ClusterView, *, schedule: str = "1f1b", bucket_bytes: float | None = 25e6,
                     fixed_costs: bool = True, tied: Sequence[tuple[int, int, float]] = (),
                     memory: list[int] | None = None, name: str = "compose", flops: float = 0.0) -> Any:
    """Predict one iteration of a composed plan with the one engine; a `plait.sim.api.SimResult`.

    `memory`: peak bytes per cluster device (the family's estimate: each stage's program with the
    micro-batches its schedule keeps in flight); `flops`: model FLOPs of the iteration (for TFLOP/s)."""
    from plait.cost.compute import DEFAULT_MODEL
    from plait.sim.lowering import lower_compose

    view = resolve_cluster(cluster)
    t0 = time.perf_counter()
    low = lower_compose(stages, edges, bytes_per_sample, micro_batches, micro_batch, view, schedule=schedule,
                        bucket_bytes=bucket_bytes, model=DEFAULT_MODEL if fixed_costs else None, tied=tied)
    tg = low.graph
    sched = run_engine(tg)
    T = sched.makespan
    busy, by_cat, exposed, critical = schedule_figures(tg, sched, {})
    world = sum(len(p.ids) for p in stages)
    batch = micro_batches * micro_batch
    fits = None
    if memory is not None and view.cluster is not None:
        fits = all(memory[d.id] <= d.kind.memory_bytes for d in view.cluster.devices)
    classes = sum(len(r) for r in low.reps)
    return SimResult(
        iteration_time_s=T, throughput_samples_per_s=batch / T if T > 0 else 0.0,
        tflops_per_gpu=flops / T / world / 1e12 if T > 0 else 0.0,
        hardware_tflops_per_gpu=flops / T / world / 1e12 if T > 0 else 0.0,
        exposed_comm_s=exposed,
        memory_peak_bytes=list(memory) if memory is not None else None, fits_memory=fits,
        critical_path=critical, busy_fraction=busy, world_size=world, num_tasks=len(tg),
        symmetry=(f"one rank simulated per class of equal kind and ratios in each stage: {classes} of {world}"
                  if classes < world else "every rank simulated"),
        granularity="op", sim_wall_s=time.perf_counter() - t0, breakdown=by_cat, plan=name,
        model=stages[0].problem.graph.model if stages else "", cluster=view.name)


# ---------------------------------------------------------------- SPMD programs (HAP)
def simulate_spmd(problem: Any, synthesis: Any, cluster: ClusterSource | ClusterView, *,
                  bucket_bytes: float | None = 25e6, batch: int | None = None, name: str = "spmd",
                  device_scale: Any = None, fixed_costs: bool = True, mesh: Any = None) -> SimResult:
    """Predict one iteration of a synthesized SPMD program (`plait.cost.program.Synthesis`:
    program, ratios, per-segment ratios, memory) of `problem` (`plait.cost.program.Problem`) on
    `cluster`, lowered as a one-stage plan (`plait.sim.lowering.spmd.lower_spmd`) and run by the same engine as `simulate`.

    The program's devices are priced on the cluster's real links whatever model searched it
    (HAP's flat one included). `bucket_bytes`: parameter-gradient all-reduces packed into DDP
    buckets (None: one collective per gradient). `batch` (samples per iteration) gives the
    throughput. Memory per device is the synthesis's (`plait.cost.memory.memory_model`).
    `device_scale`: see `plait.cost.program.ProgramStage` (data parallelism with uneven batches).
    `fixed_costs`: charge the compute model's per-kernel GPU and host times and per-iteration host
    work, as `simulate` does for 3D plans (False: the work alone, for hand-computed checks).
    A hierarchical program (`plait.spmd.mesh.Hierarchical`) is simulated with
    ``simulate_spmd(h.world_problem, h, cluster, device_scale=h.device_scale, mesh=h.mesh)``."""
    from plait.cost.compute import DEFAULT_MODEL
    from plait.cost.spmd import Devices
    from plait.sim.lowering import lower_spmd

    view = resolve_cluster(cluster)
    devices = problem.devices
    if view.cluster is not None:
        devices = Devices.of(view, devices.dtype, devices.ids or None)
    segs = synthesis.segments
    ratios = synthesis.segment_ratios if segs is not None and synthesis.segment_ratios is not None \
        else synthesis.ratios
    t0 = time.perf_counter()
    lowered = lower_spmd(problem, synthesis.program, np.asarray(ratios, dtype=float), view, devices=devices,
                         of_op=segs.of_op if segs is not None else None,
                         of_dim=segs.of_dim if segs is not None else None, bucket_bytes=bucket_bytes,
                         host_comm_s=DEFAULT_MODEL.host_comm_s, device_scale=device_scale, mesh=mesh,
                         model=DEFAULT_MODEL if fixed_costs else None)
    tg = lowered.graph
    sched = run_engine(tg)
    wall = time.perf_counter() - t0
    T = sched.makespan
    graph = problem.graph

    def build_timeline() -> Timeline:
        events = [TimelineEvent(name=tg.name[i], category=tg.category[i], resource=tg.resource[i],
                                start=sched.start[i], end=sched.end[i], device=tg.device[i],
                                args=dict(tg.args[i] or {})) for i in range(len(tg))]
        return Timeline(events=events, source="simulated", meta={"plan": name, "model": graph.model,
                                                                 "cluster": view.name, "granularity": "op"})

    busy, by_cat, exposed, critical = schedule_figures(tg, sched, {})
    n = devices.n
    flops = 3.0 * sum(op.flops for op in graph.ops)  # forward + backward (~2x forward)
    memory = np.asarray(synthesis.memory, dtype=float) if synthesis.memory is not None else None
    fits = bool(np.all(memory <= devices.memory * (1 + 1e-9))) if memory is not None and memory.size == n else None
    classes = len(lowered.reps[0])
    return SimResult(
        iteration_time_s=T,
        throughput_samples_per_s=(batch / T) if batch and T > 0 else 0.0,
        tflops_per_gpu=flops / T / n / 1e12 if T > 0 and n else 0.0,
        hardware_tflops_per_gpu=flops / T / n / 1e12 if T > 0 and n else 0.0,
        exposed_comm_s=exposed,
        memory_peak_bytes=[int(x) for x in memory] if memory is not None and memory.size == n else None,
        fits_memory=fits,
        critical_path=critical,
        busy_fraction=busy,
        world_size=n,
        num_tasks=len(tg),
        symmetry=(f"one rank simulated per class of equal kind and ratios: {classes} of {n}"
                  if classes < n else "every rank simulated"),
        granularity="op",
        costs=OP_COSTS,
        sim_wall_s=wall,
        breakdown=by_cat,
        plan=name,
        model=graph.model,
        cluster=view.name,
        _build=build_timeline,
    )


@dataclass
class SpmdMemory:
    """Bytes an SPMD program keeps per device (`plait.cost.memory.memory_model`) against capacity."""

    peak_bytes: list[float]
    capacity_bytes: list[float]
    names: list[str]

    @property
    def fits(self) -> bool:
        return all(m <= c * (1 + 1e-9) for m, c in zip(self.peak_bytes, self.capacity_bytes))

    @property
    def violations(self) -> list[str]:
        return [f"{name}: needs {m / 2**30:.2f} GiB, has {c / 2**30:.2f} GiB"
                for name, m, c in zip(self.names, self.peak_bytes, self.capacity_bytes) if m > c * (1 + 1e-9)]


def spmd_plan_synthesis(model: ModelSource, view: ClusterView, plan: Plan, optimizer: str = "adam",
                        overhead: float | None = None) -> tuple[Any, Any]:
    """(Problem, Synthesis) of a plan with an SPMD program (`Plan.spmd`): the model captured at the
    plan's global batch (op names as `plait plan --family spmd` and `plait run` capture them), the
    program replayed op by op at its ratios on the plan's devices, each uneven collective padded or
    grouped as the plan's `collectives` says (padded where it says nothing: what the runtime runs);
    memory from the program's memory model plus `overhead` per GPU (default the framework constant)."""
    from plait.cost.memory import memory_model
    from plait.cost.program import Problem, Segments, Synthesis, segments
    from plait.cost.spmd import Devices, cluster_model_profile
    from plait.graph.aten_stage import free_outputs
    from plait.sim.replay import ReplayError, capture, model_spec, replay

    if view.cluster is None:
        raise SimulateError(f"cluster {view.name!r}: an SPMD plan is simulated on a cluster file or preset")
    assert plan.spmd is not None
    try:
        spec = model_spec(model, "an SPMD plan")
        world, every = plan.world_size, len(view.cluster.devices)
        if plan.device_order is None and world > every:
            raise SimulateError(f"plan field 'spmd': {world} ranks, cluster {view.name!r} has {every} devices")
        ids = plan.device_order if plan.device_order is not None else list(range(world))
        dtype = "fp32" if plan.dtype == "tf32" else plan.dtype
        graph = capture(spec, plan.global_batch, dtype)  # in the plan's dtype, as the search captured it
        problem = Problem.build(graph, Devices.of(view, dtype, ids),
                                outputs_free=free_outputs(graph, loss=True),
                                profile=cluster_model_profile(view.cluster, spec, plan.dtype), grad_dtype=plan.grad_dtype)
        problem.homes = dict(plan.spmd.homes)
        program = replay(problem, plan.spmd, "spmd")
    except ReplayError as exc:
        raise SimulateError(str(exc)) from None
    r = plan.spmd.ratio_array()
    segs = segments(problem, program) if r.ndim == 2 else Segments.single(problem, program)
    if r.ndim == 2 and r.shape[0] != segs.count:
        raise SimulateError(f"plan field 'spmd.ratios': {r.shape[0]} ratio vectors, the program has "
                            f"{segs.count} segment(s)")
    held = memory_model(problem, program, dtype, optimizer, segs=segs, overhead=overhead).on(r)  # a scalar when nothing is sharded
    memory = np.broadcast_to(np.asarray(held, dtype=float), (problem.devices.n,)).copy()
    syn = Synthesis(program, r.mean(axis=0) if r.ndim == 2 else r, program.cost, memory,
                    segment_ratios=r if r.ndim == 2 else None, segments=segs, capacity=problem.devices.memory)
    return problem, syn


def _program_memory_options(options: dict[str, Any] | None) -> tuple[str, float | None]:
    """(optimizer, overhead bytes) of `simulate`'s `memory_options` for a plan that runs programs:
    the options `estimate_memory` takes that a program's memory model also has (``loss`` and the
    gradient bucket have no meaning there: a program's loss and gradients are its own ops)."""
    opts = dict(options or {})
    overhead = opts.get("overhead_bytes")
    if overhead is not None and overhead < 0:
        raise SimulateError("memory option 'overhead_bytes' must be >= 0")
    return str(opts.get("optimizer", "adam")), overhead


def simulate_composed_plan(model: ModelSource, cluster: ClusterSource | ClusterView,
                           plan: PlanSource | dict[str, Any], *, memory_options: dict[str, Any] | None = None
                           ) -> SimResult:
    """`simulate` of a composed plan (stages that run SPMD programs, `StageSpec.spmd`): each
    stage's program replayed on its aten sub-graph (`plait.sim.replay.composed_stages`), lowered by
    `plait.sim.lowering.pipeline` on the plan's schedule; memory per device from each stage's program
    with the micro-batches in flight (`memory_options`: its ``optimizer`` and ``overhead_bytes``)."""
    from plait.sim.replay import ReplayError, composed_stages

    plan_obj = resolve_plan(plan)
    view = resolve_cluster(cluster)
    if view.cluster is None:
        raise SimulateError(f"cluster {view.name!r}: a composed plan is simulated on a cluster file or preset")
    optimizer, overhead = _program_memory_options(memory_options)
    try:
        rep = composed_stages(model, view.cluster, plan_obj, optimizer, overhead)
    except ReplayError as exc:
        raise SimulateError(str(exc)) from None
    res = simulate_compose(rep.stages, list(plan_obj.stage_edges), rep.bytes_per_sample, plan_obj.num_micro_batches,
                           plan_obj.micro_batch, view, schedule=plan_obj.schedule, tied=rep.tied, memory=rep.memory,
                           name=str(plan_obj), flops=rep.flops)
    res.costs = "; ".join(dict.fromkeys(st.problem.costs for st in rep.stages))
    if isinstance(model, str):
        res.model = model
    return res


def simulate_spmd_plan(model: ModelSource, cluster: ClusterSource | ClusterView,
                       plan: PlanSource | dict[str, Any], *, memory_options: dict[str, Any] | None = None
                       ) -> SimResult:
    """`simulate` of a plan with an SPMD program (`plait simulate --plan FILE`): `spmd_plan_synthesis`
    lowered by `simulate_spmd`, gradients all-reduced one tensor at a time as the runtime's per-rank
    programs do (no DDP buckets); memory per device from the program's memory model
    (`memory_options`: its ``optimizer`` and ``overhead_bytes``)."""
    plan_obj = resolve_plan(plan)
    view = resolve_cluster(cluster)
    optimizer, overhead = _program_memory_options(memory_options)
    problem, syn = spmd_plan_synthesis(model, view, plan_obj, optimizer, overhead)
    res = simulate_spmd(problem, syn, view, bucket_bytes=None, batch=plan_obj.global_batch, name=str(plan_obj))
    res.costs = problem.costs
    if isinstance(model, str):
        res.model = model
    res.memory = SpmdMemory([float(x) for x in syn.memory], [float(x) for x in problem.devices.memory],
                            list(problem.devices.names))
    return res


# ---------------------------------------------------------------- the simulator the search is handed
class PlanSimulator:
    """The one simulator as the planner families use it (`plait.planners.types.Simulator`) for one
    cluster: its ClusterView resolved once and one layer-cost cache, shared by every finalist of
    every family. Built above the search (`plait.api.plan`, `plait plan`, the recovery loop) and
    handed down; `compute`: the compute model of `simulate` for 3D and graph plans (None: the
    default)."""

    def __init__(self, cluster: Cluster, compute: Any = None) -> None:
        self.view = ClusterView.from_cluster(cluster)
        self._cost_cache: dict = {}
        self._extra = {"compute": compute} if compute is not None else {}

    def evaluate(self, graph: OpGraph, plan: Plan) -> dict[str, Any]:
        return simulate(graph, self.view, plan, memory=False, cost_cache=self._cost_cache, **self._extra).to_dict()

    def spmd(self, problem: Any, synthesis: Any, *, batch: int, name: str = "spmd", device_scale: Any = None,
             mesh: Any = None) -> SimResult:
        return simulate_spmd(problem, synthesis, self.view, batch=batch, name=name, device_scale=device_scale,
                             mesh=mesh)

    def compose(self, stages: list[ProgramStage], edges: list[tuple[int, int]],
                bytes_per_sample: dict[tuple[int, int], float], micro_batches: int, micro_batch: int, *,
                schedule: str, tied: Any, memory: list[int], name: str, flops: float) -> SimResult:
        return simulate_compose(stages, edges, bytes_per_sample, micro_batches, micro_batch, self.view,
                                schedule=schedule, tied=tied, memory=memory, name=name, flops=flops)
