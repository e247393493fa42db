"""Everything one report shows, gathered from a plan file or a run folder.

A plan file (`plait plan --out`) holds only the plan: the model and the cluster come from the
command line. A run folder (`plait run --run-dir`) holds the model and the plan (config.json), the
cluster (cluster.yaml), the measured run (result.json, read by `plait.runtime.api.load_run`) and,
once the doctor has looked at it, diagnosis.json. Every number is asked of its one source: the
simulator for the predicted timeline and critical path, the memory estimator for memory,
`plait.cost.traffic` for the bytes between devices, `plait.net` for the load on each cable.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait.errors import PlaitError

if TYPE_CHECKING:  # the report loads each on use: `plait report --help` stays fast
    from plait.cluster.spec import Cluster, ClusterSource
    from plait.ir.opgraph import OpGraph
    from plait.ir.plan import Plan


class ReportError(PlaitError, ValueError):
    """A plan file or run folder the report cannot read (the message names the file and why)."""


@dataclass
class LinkLoad:
    """Bytes one fabric cable carries per iteration under the plan's paths (or ECMP's)."""

    name: str
    bytes: float
    capacity: float  # bytes/s

    @property
    def seconds(self) -> float:
        return self.bytes / self.capacity if self.capacity > 0 else 0.0


@dataclass
class Traffic:
    """Per-iteration traffic: device x device bytes (every class) and, on a switched fabric, the
    load of every cable that carries any."""

    devices: list[int]  # cluster device ids of the matrix rows/columns
    matrix: list[list[float]]  # bytes sent from row to column per iteration
    by_class: dict[str, float]  # wire bytes per traffic class (dp, tp, pp, zero, tied)
    links: list[LinkLoad] = field(default_factory=list)
    routing: str = ""  # "planned paths" | "ECMP" | "" (no fabric)


@dataclass
class MachinePrediction:
    """RUN_DIR/prediction.json: the simulator fed with this machine's measured links and layer
    times (`plait run --predict`), comparable with the measured run where the GPU one is not."""

    iteration_s: float
    timeline: Any  # plait.ir.timeline.Timeline
    critical_path: list[dict[str, Any]]
    summary: dict[str, Any]


@dataclass
class ReportData:
    source: str  # the plan file or run folder
    kind: str  # "plan" | "run"
    model: str  # model spec
    model_config: dict[str, Any]
    cluster: Cluster
    plan: Plan
    sim: Any  # plait.sim.api.SimResult (predicted)
    params: int | None = None  # parameter count of the model
    run: Any = None  # plait.runtime.api.RunResult (measured), for a run folder
    measured_step: Any = None  # the measured Timeline of one representative step
    measured_step_index: int | None = None
    measured_s: float | None = None  # mean iteration time after the warm-up step
    measured_how: str = ""  # how measured_s was taken from the steps
    traffic: Traffic | None = None
    roles: dict[int, dict[str, Any]] = field(default_factory=dict)  # device -> rank, stage, replica, tp, layers
    diagnosis: Any = None  # plait.ir.diagnosis.Diagnosis
    machine: MachinePrediction | None = None  # `plait run --predict`'s prediction for this machine
    search: dict[str, Any] | None = None  # the unified search that chose the plan (plait.search.summary)
    notes: list[str] = field(default_factory=list)

    @property
    def predicted_s(self) -> float:
        """The prediction the measurement compares with: this machine's when the run has one."""
        return self.machine.iteration_s if self.machine is not None else float(self.sim.iteration_time_s)

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured."""
        if not self.measured_s:
            return None
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def memory_margin(self) -> tuple[int, int] | None:
        """(least free bytes over the plan's GPUs, its device id)."""
        mem = self.sim.memory
        if mem is None:
            return None
        if not hasattr(mem, "devices"):  # an SPMD program's memory (`SpmdMemory`): listed by program rank
            if not mem.peak_bytes:
                return None
            r = min(range(len(mem.peak_bytes)), key=lambda i: mem.capacity_bytes[i] - mem.peak_bytes[i])
            return int(mem.capacity_bytes[r] - mem.peak_bytes[r]), self.plan.device_of(r)
        if not mem.devices:
            return None
        d = min(mem.devices, key=lambda i: mem.capacity_bytes[i] - mem.peak_bytes[i])
        return mem.capacity_bytes[d] - mem.peak_bytes[d], d


def load(source: str | Path, model: str | None = None, cluster: ClusterSource | None = None,
         search: str | Path | None = None) -> ReportData:
    """The report's data for a plan file or a run folder (module docstring). `model` and `cluster`
    are needed for a plan file and override what a run folder says. `search`: the unified
    search's file (`plait.search.summary`; default: ``PLAN.search.json`` beside a plan file,
    ``search.json`` in a run folder, when there)."""
    path = Path(source)
    data = _load(path, model, cluster)
    data.search = _search(path, search, data.notes)
    return data


def _search(path: Path, given: str | Path | None, notes: list[str]) -> dict[str, Any] | None:
    from plait.search.summary import read_summary, search_path

    if given is not None:
        return read_summary(given)  # asked for by name: a bad file is an error
    found = path / "search.json" if path.is_dir() else search_path(path)
    if not found.is_file():
        return None
    try:
        return read_summary(found)
    except PlaitError as exc:
        notes.append(f"{exc}; the search's per-family table is left out")
        return None


def _load(path: Path, model: str | None, cluster: ClusterSource | None) -> ReportData:
    if path.is_dir():
        return _from_run(path, model, cluster)
    if not path.is_file():
        raise ReportError(f"{path}: no such plan file or run folder")
    if model is None or cluster is None:
        raise ReportError(f"{path}: a plan file holds the plan only; give --model and --cluster "
                          "(those `plait plan` was given)")
    from plait.ir.plan import Plan

    plan = Plan.load(str(path))
    return _assemble(str(path), "plan", model, _cluster(cluster), plan)


def _cluster(spec: ClusterSource) -> Cluster:
    from plait.cluster import load_cluster

    return load_cluster(spec)


def _from_run(rdir: Path, model: str | None, cluster: ClusterSource | None) -> ReportData:
    from plait.ir.plan import Plan
    from plait.runtime.api import load_run

    config = rdir / "config.json"
    if not config.is_file():
        raise ReportError(f"{rdir}: not a plait run folder (no config.json; `plait run --run-dir` writes one)")
    try:
        cfg = json.loads(config.read_text())
        plan = Plan.from_dict(cfg["plan"], str(config))
        model = model or cfg["model"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ReportError(f"{config}: not a plait run configuration ({exc})") from None
    if cluster is None:
        if not (rdir / "cluster.yaml").is_file():
            raise ReportError(f"{rdir}: the run folder has no cluster.yaml (an older run); give --cluster")
        cluster = str(rdir / "cluster.yaml")
    notes: list[str] = []
    run = None
    if (rdir / "result.json").is_file():
        run = load_run(rdir)
    else:
        notes.append(f"{rdir / 'result.json'} is missing (the run did not finish): no measured timeline")
    data = _assemble(str(rdir), "run", model, _cluster(cluster), plan, notes)
    notes = data.notes
    if run is not None and run.iteration_times:
        data.run = run
        times = run.iteration_times
        after = list(range(1, len(times))) if len(times) > 1 else [0]  # the first step warms up
        data.measured_s = sum(times[i] for i in after) / len(after)
        data.measured_how = f"mean of the {len(after)} steps after the first"
        median = statistics.median_low([times[i] for i in after])
        data.measured_step_index = next(i for i in after if times[i] == median)
        data.measured_step = run.step_timeline(data.measured_step_index)
        if run.device == "cpu":
            notes.append("measured on CPU processes (gloo): the prediction is for the GPUs the cluster "
                         "describes, so the two differ by the CPU/GPU speed ratio -- compare their shapes")
    data.diagnosis = _diagnosis(rdir, notes)
    data.machine = _machine(rdir, notes)
    if data.machine is not None and data.machine.summary.get("measured_iteration_s"):
        # the figure `plait run --predict` compared its prediction with (median after its warm-up)
        data.measured_s = float(data.machine.summary["measured_iteration_s"])
        data.measured_how = f"median after {data.machine.summary.get('warmup_steps', '?')} warm-up steps"
    if data.machine is not None and data.run is not None and data.run.device == "cpu":
        notes.remove(next(n for n in notes if n.startswith("measured on CPU processes")))
        notes.append("measured on CPU processes: the error compares the run with the simulator's prediction "
                     "for this machine (plait run --predict); the GPU prediction is shown for the cluster's GPUs")
    return data


def _machine(rdir: Path, notes: list[str]) -> MachinePrediction | None:
    from plait.ir.formats import check_version
    from plait.ir.timeline import Timeline

    path = rdir / "prediction.json"
    if not path.is_file():
        return None
    try:
        d = check_version("prediction", json.loads(path.read_text()), str(path), ReportError)
        return MachinePrediction(iteration_s=float(d["summary"]["predicted_iteration_s"]),
                                 timeline=Timeline.from_dict(d["timeline"], str(path)),
                                 critical_path=list(d["critical_path"]), summary=dict(d["summary"]))
    except (ValueError, KeyError, TypeError, PlaitError) as exc:
        notes.append(f"{path}: unreadable ({exc}); the prediction for this machine is left out")
        return None


def _diagnosis(rdir: Path, notes: list[str]) -> Any:
    from plait.ir.diagnosis import Diagnosis, DiagnosisError

    path = rdir / "diagnosis.json"
    if not path.is_file():
        notes.append("no diagnosis.json in the run folder: the doctor has not looked at this run")
        return None
    try:
        return Diagnosis.from_dict(json.loads(path.read_text()), str(path))
    except (ValueError, KeyError, TypeError, DiagnosisError) as exc:
        notes.append(f"{path}: unreadable ({exc}); the doctor's findings are left out")
        return None


def _assemble(source: str, kind: str, model: str, cluster: Cluster, plan: Plan,
              notes: list[str] | None = None) -> ReportData:
    from plait.graph.resolve import resolve_model
    from plait.sim.api import simulate

    notes = list(notes or [])
    if plan.spmd is not None:  # an op-level program: simulated on the model's aten ops, not its layers
        return _assemble_spmd(source, kind, model, cluster, plan, notes)
    graph = resolve_model(model, plan, precision="amp")  # as plait's engines trained it
    sim = simulate(graph, cluster, plan)
    params = None
    try:
        from plait.graph.zoo import load_model

        spec = load_model(model)
        config, params = dict(spec.config), int(spec.param_count_formula())
    except (PlaitError, ValueError, TypeError, AttributeError, ImportError, OSError):
        # a model file without a parameter formula: the report goes on without the count
        config = dict(graph.config or {})
    data = ReportData(source=source, kind=kind, model=model, model_config=config, cluster=cluster, plan=plan,
                      sim=sim, params=params, notes=notes)
    data.traffic = traffic(graph, plan, cluster, data.notes)
    data.roles = roles(graph, plan)
    return data


def _assemble_spmd(source: str, kind: str, model: str, cluster: Cluster, plan: Plan, notes: list[str]) -> ReportData:
    """The report of a plan with an SPMD program (`plait plan --family spmd`): simulated by the SPMD
    lowering (`plait.sim.api.simulate_spmd_plan`) on the model's aten ops; every rank holds the
    whole model at its share of each op."""
    from plait.graph.zoo import load_model
    from plait.sim.api import simulate

    sim = simulate(model, cluster, plan)
    spec = load_model(model)
    try:
        params = int(spec.param_count_formula())
    except (ValueError, TypeError, AttributeError):
        params = None
    data = ReportData(source=source, kind=kind, model=model, model_config=dict(spec.config), cluster=cluster,
                      plan=plan, sim=sim, params=params, notes=notes)
    data.traffic = spmd_traffic(model, cluster, plan, notes)
    data.roles = {plan.device_of(r): {"rank": r, "stage": 0, "replica": 0, "tp": r,
                                      "layers": "the whole model, each op sharded by the program"}
                  for r in range(plan.world_size)}
    return data


def spmd_traffic(model: str, cluster: Cluster, plan: Plan, notes: list[str]) -> Traffic:
    """Device x device bytes of one iteration of an SPMD plan: its program's collectives
    (`plait.sim.api.spmd_plan_synthesis`, as `plait simulate` replays it) over the ring of its
    devices, laid out on the NICs as NCCL's rings run (`plait.cost.traffic.program_messages`)."""
    from plait.cost.traffic import program_messages
    from plait.sim.api import resolve_cluster, spmd_plan_synthesis

    _, syn = spmd_plan_synthesis(model, resolve_cluster(cluster), plan)
    devices = [plan.device_of(r) for r in range(plan.world_size)]
    messages = program_messages(syn.program.comms, devices)
    by_class: dict[str, float] = {}
    for m in messages:
        by_class[m.cls] = by_class.get(m.cls, 0.0) + m.wire_bytes
    flows = [f for m in messages for f in m.flows(*_ring_layout(cluster))]
    notes.append("an SPMD program: its traffic is its collectives over one ring of its devices at even shares "
                 "(padded uneven collectives move somewhat more); cable loads are drawn for 3D and graph plans only")
    return Traffic(devices=sorted(devices), matrix=_device_matrix(flows, sorted(devices)), by_class=by_class)


def _ring_layout(cluster: Cluster) -> tuple[list[int], list[int]]:
    """(node of each device, NICs of each node): how `Message.flows` lays a ring on the rails."""
    return [d.node for d in cluster.devices], [max(1, n.nics) for n in cluster.nodes]


def _device_matrix(flows: Any, devices: list[int]) -> list[list[float]]:
    """Bytes each of `devices` sends each other one, summed over `flows` (self-sends left out)."""
    index = {d: i for i, d in enumerate(devices)}
    matrix = [[0.0] * len(devices) for _ in devices]
    for f in flows:
        if f.src != f.dst and f.src in index and f.dst in index:
            matrix[index[f.src]][index[f.dst]] += f.nbytes
    return matrix


def roles(graph: OpGraph, plan: Plan) -> dict[int, dict[str, Any]]:
    """What each device of the plan does, from the one stage graph: its plan rank, pipeline stage,
    data-parallel replica, tensor rank and the layers it holds."""
    from plait.ir.stage_graph import stage_graph

    rank_of = {plan.device_of(r): r for r in range(plan.world_size)}
    out: dict[int, dict[str, Any]] = {}
    sg = stage_graph(plan, graph)
    for st in sg.stages:
        layers = [n for c in st.chunks for n in sg.chunks[c].layers]
        span = f"{layers[0]} … {layers[-1]}" if len(layers) > 1 else (layers[0] if layers else "-")
        for rep in st.replicas:
            for t, d in enumerate(rep.devices):
                out[d] = {"rank": rank_of.get(d, -1), "stage": st.index, "replica": rep.index, "tp": t,
                          "layers": f"{len(layers)} layers: {span}"}
    return out


def traffic(graph: OpGraph, plan: Plan, cluster: Cluster, notes: list[str]) -> Traffic:
    """Device x device bytes of one iteration (`plait.cost.traffic`) and, on a switched fabric, each
    cable's load along the plan's planned paths or ECMP's (`plait.net`)."""
    from plait.cost.traffic import iteration_traffic

    it = iteration_traffic(graph, plan)
    devices = sorted({plan.device_of(r) for r in range(plan.world_size)})
    matrix = _device_matrix(it.flows(*_ring_layout(cluster)), devices)
    out = Traffic(devices=devices, matrix=matrix, by_class={k: float(v) for k, v in it.totals().items() if v})
    from plait.net import planner
    from plait.net.fabric import fabric_of
    from plait.net.flows import traffic_flows

    fabric = fabric_of(cluster)
    if fabric is None:
        return out
    flows = traffic_flows(plan, cluster, fabric, graph)
    if not flows:
        return out
    routes = planner.ecmp_routes(fabric, flows)
    out.routing = "ECMP"
    if plan.flow_paths is not None:
        from plait.net.paths import from_plan_field

        try:
            planned = from_plan_field(fabric, plan.flow_paths)
        except PlaitError as exc:
            notes.append(f"the plan's flow paths do not apply ({exc}); cables loaded by ECMP")
        else:
            routes = [dataclasses.replace(r, links=planned.get((f.src_device, f.dst_device, f.channel), r.links))
                      for f, r in zip(flows, routes)]
            out.routing = "planned paths"
    load = planner.assign(fabric, flows, routes).load
    out.links = [LinkLoad(fabric.names[i], float(load[i]), float(fabric.capacity[i]))
                 for i in range(len(fabric.names)) if load[i] > 0]
    return out
