"""`run(model, cluster, plan, steps)`: train under a plan with real torch.distributed workers.

    result = run("gpt:layers=4,hidden=64,heads=4,seq=32,vocab=256", "my_cluster.yaml",
                 "dp=2,tp=2,pp=1,micro_batch=2,global_batch=8,dtype=fp32", steps=5)
    result.losses, result.iteration_times, result.timeline.save_chrome_trace("trace.json")

One worker per plan rank (world size = plan.world_size), launched through torchrun
(`torch.distributed.run`); gloo on CPU, NCCL (with CUDA-event timing) when CUDA devices
are available. On a cluster file with `emulation`, each rank's GPU kind sets a compute
slowdown (`plait.runtime.emulate`) and, as root, nodes live in network namespaces shaped
to the file's links (`plait.runtime.netns`); otherwise all ranks share loopback. On real
hosts each node calls `run(..., launch=LaunchConfig(rendezvous=Rendezvous(...)))` and runs its own ranks, which meet
the other nodes' through torchrun's c10d rendezvous (`plait.runtime.multinode`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plait.ir.formats import check_version
from plait.ir.opgraph import TP_CUT_ROLES
from plait.ir.plan import Plan, PlanError, PlanSource, check_plan_for_model
from plait.ir.timeline import Timeline, TimelineEvent
from plait.runtime.amp import SCALE_ENV, DynamicLossScaler, autocast_for
from plait.runtime.comm import LinkFault
from plait.runtime.config import (
    CheckpointConfig,
    FaultsConfig,
    LaunchConfig,
    RecordsConfig,
    TrainingConfig,
)
from plait.runtime.launch import AgentSpec, Launcher, RunFailure
from plait.runtime.layout import engine_for
from plait.runtime.metrics import write_tensorboard
from plait.runtime.multinode import Rendezvous, cluster_nodes, local_workers
from plait.runtime.partition import (
    RuntimeSetupError,
    build_seeded,
    load_model_spec,
    model_spec_string,
)
from plait.runtime.worker_config import (
    AgentRanks,
    CheckpointSettings,
    DataSettings,
    FaultSettings,
    MultinodeSettings,
    RankPlace,
    RecordSettings,
    WorkerConfig,
    WorkerConfigError,
    read_worker_config,
    write_worker_config,
)

if TYPE_CHECKING:  # the cluster package loads where a cluster is given
    from plait.cluster.spec import Cluster, ClusterSource
    from plait.graph.zoo.registry import ModelSpec

__all__ = ["CheckpointConfig", "FaultsConfig", "LaunchConfig", "RankInfo", "RecordsConfig", "RunFailure",
           "RunResult", "TrainingConfig", "load_run", "run", "rank_layout"]


@dataclass
class RankInfo:
    rank: int
    pp: int
    dp: int
    tp: int
    device: int  # cluster device id
    host: str  # node name in the cluster file (or this machine)
    node: int
    kind: str | None
    slowdown: float
    pid: int
    layers: list[str]
    params: int  # parameters held by this rank (its stage, its tensor shard)
    samples_per_step: int
    peak_memory_bytes: int
    memory_kind: str  # "cuda_max_allocated" or "max_rss" (whole process, CPU)


@dataclass
class RunResult:
    model: str
    cluster: str
    plan: str
    backend: str
    device: str
    steps: list[int]  # step indices that ran (a resumed run starts after its checkpoint)
    losses: list[float]  # global-batch mean loss per step
    iteration_times: list[float]  # seconds per step: first rank start to last rank end
    timeline: Timeline  # every measured span of every rank, seconds from the first step's start
    ranks: list[RankInfo]
    network: dict[str, Any] = field(default_factory=dict)  # how the cluster was emulated
    notes: list[str] = field(default_factory=list)
    run_dir: str | None = None
    params: dict[str, torch.Tensor] | None = None  # full (unsharded) parameters, if asked for
    resumed_from: int | None = None
    step_bounds: list[tuple[float, float]] = field(default_factory=list)
    # fp16 dynamic loss scaling (plait.runtime.amp); empty / None for other dtypes.
    loss_scales: list[float] = field(default_factory=list)  # the scale each step's backward used
    skipped_steps: list[int] = field(default_factory=list)  # steps skipped for inf/nan gradients
    final_loss_scale: float | None = None  # the scale the next step would use
    skipped_by_rank: dict[int, list[int]] = field(default_factory=dict)  # the same on every rank
    # Per-rank communication records streamed during the run (`comm/rankN.jsonl`, read with
    # `plait.ir.comm.read_comm_records`); None when recording was off or the run folder was temporary.
    comm_dir: str | None = None
    # SPMD plans: rank 0's collective conversions run and its link calibration (plait.runtime.spmd_worker)
    spmd: dict[str, Any] | None = None
    # The engine that ran it (a key of `plait.runtime.ENGINES`: "torch" for torch's DDP / FSDP2)
    engine: str | None = None

    def mean_iteration_time(self, skip: int = 1) -> float:
        """Mean over steps, skipping the first `skip` (warm-up) when there are more."""
        times = self.iteration_times[skip:] if len(self.iteration_times) > skip else self.iteration_times
        return sum(times) / len(times) if times else float("nan")

    def step_timeline(self, index: int = -1) -> Timeline:
        """One iteration (by position in `steps`), re-based to start at 0: row-comparable with
        the simulator's single-iteration timeline."""
        step = self.steps[index]
        t0, t1 = self.step_bounds[index]
        events = [TimelineEvent(e.name, e.category, e.resource, e.start - t0, e.end - t0, e.device, e.stage,
                                e.micro_batch, dict(e.args), e.chunk)
                  for e in self.timeline.events if e.args.get("step") == step]
        return Timeline(events=events, source="measured",
                        meta={**self.timeline.meta, "step": step, "iteration_time": t1 - t0})

    def to_dict(self, events: bool = False) -> dict[str, Any]:
        out = {
            "model": self.model, "cluster": self.cluster, "plan": self.plan, "backend": self.backend,
            "device": self.device, "steps": self.steps, "losses": self.losses,
            "iteration_times": self.iteration_times, "mean_iteration_time": self.mean_iteration_time(),
            "busy_by_category": self.timeline.by_category(), "network": self.network, "notes": self.notes,
            "resumed_from": self.resumed_from, "run_dir": self.run_dir,
            "loss_scales": self.loss_scales, "skipped_steps": self.skipped_steps,
            "final_loss_scale": self.final_loss_scale, "comm_dir": self.comm_dir,
            "ranks": [r.__dict__ for r in self.ranks],
        }
        if events:
            out["timeline"] = self.timeline.to_dict()
        return out


# ---------------------------------------------------------------------------------- layout
def _load_cluster(cluster: ClusterSource | None) -> Cluster | None:
    if cluster is None:
        return None
    from plait.cluster.spec import Cluster

    if isinstance(cluster, Cluster):
        return cluster
    from plait.cluster import load_cluster

    return load_cluster(cluster)


def rank_layout(cluster: Cluster | None, plan: Plan, dtype: str | None = None) -> list[dict[str, Any]]:
    """Per plan rank: cluster device, node, host name, GPU kind and emulated compute slowdown."""
    world = plan.world_size
    if cluster is None:
        host = socket.gethostname()
        return [{"rank": r, "device": plan.device_of(r), "node": 0, "host": host, "kind": None, "slowdown": 1.0}
                for r in range(world)]
    devices: list[tuple[int, str]] = []  # node-major: (node index, kind name)
    for i, node in enumerate(cluster.nodes):
        devices += [(i, kind) for kind in node.gpus]
    source = getattr(cluster, "source", "cluster")
    if world > len(devices):
        raise RuntimeSetupError(f"{source}: the plan needs {world} devices but the cluster has {len(devices)}")
    emu = getattr(cluster, "emulation", None)
    slow: dict[int, float] = {}
    if emu is not None and emu.enabled:
        from plait.runtime.emulate import compute_slowdown

        slow = {plan.device_of(r): compute_slowdown(cluster, plan.device_of(r), dtype or plan.dtype)
                for r in range(world)}
    out = []
    for r in range(world):
        dev = plan.device_of(r)
        if dev >= len(devices):
            raise RuntimeSetupError(f"plan field 'device_order': device {dev} is not in {source} "
                                    f"({len(devices)} devices)")
        node, kind = devices[dev]
        out.append({"rank": r, "device": dev, "node": node, "host": cluster.nodes[node].name, "kind": kind,
                    "slowdown": slow.get(dev, 1.0)})
    return out


def _check_plan(plan: Plan, asks: dict[str, Any] | None = None) -> None:
    """Refuse what the runtime cannot run: exactly `plait.runtime.supports`' verdict and reason,
    or, given what the run asks (`asks`: its engine, dtype and checkpoints), `engine_for`'s -- the
    workers' own verdict (a ZeRO-3 pipeline that asks for engine=plait, say)."""
    verdict = engine_for(plan, asks)  # without `asks`: `supports(plan)`
    if not verdict.ok:
        raise RuntimeSetupError(verdict.reason)


def _check_resumable(root: Path) -> None:
    """--resume with nothing to resume from is an error, not a silent restart from step 0."""
    from plait.runtime.checkpoint import latest_checkpoint

    if not root.is_dir():
        raise RuntimeSetupError(f"--resume: checkpoint directory {root} does not exist")
    if latest_checkpoint(root) is None:
        raise RuntimeSetupError(f"--resume: no complete checkpoint in {root} (nothing to resume from); "
                                "run without --resume to start at step 0")


def _wait_naming_logs(launcher: Launcher, rdir: Path, owns_dir: bool) -> None:
    """Wait for the workers; a failed run keeps its temporary folder (the workers' logs) and says where."""
    try:
        launcher.wait()
    except RunFailure as exc:
        if owns_dir and str(rdir) not in str(exc):
            named = RunFailure(f"{exc} (logs kept in {rdir})", rank=exc.rank, host=exc.host, kind=exc.kind,
                               run_dir=str(rdir))
            named.detected_at = exc.detected_at
            raise named from None
        raise


def _agents(layout: list[dict[str, Any]], nets: Any, nprocs_per_node: int | None) -> tuple[list[AgentSpec], dict[str, Any]]:
    """Torchrun agents: one per node inside its namespace, else loopback (optionally split every
    `nprocs_per_node` ranks, which runs the multi-agent rendezvous without namespaces)."""
    world = len(layout)
    if nets is not None and getattr(nets, "isolated", False):
        by_node: dict[int, list[int]] = {}
        for info in layout:
            by_node.setdefault(info["node"], []).append(info["rank"])
        agents = []
        for node in sorted(by_node):
            net = nets.node(node)
            agents.append(AgentSpec(node=node, host=layout[by_node[node][0]]["host"], ranks=by_node[node],
                                    namespace=net.namespace, ip=net.ip, env=net.env()))
        # The master (agent 0) must be reachable: node-sorted agents put it on the lowest node.
        return agents, {"mode": "namespaces", "shaped": getattr(nets, "shaped", False),
                        "latency_emulated": getattr(nets, "latency_emulated", False),
                        "links": {f"{a}-{b}": list(v) for (a, b), v in getattr(nets, "links", {}).items()},
                        "reason": getattr(nets, "reason", "")}
    reason = getattr(nets, "reason", "") if nets is not None else ""
    k = nprocs_per_node or world  # LaunchConfig refuses a negative one
    agents = [AgentSpec(node=i, host=layout[r]["host"], ranks=list(range(r, min(r + k, world))))
              for i, r in enumerate(range(0, world, k))]
    return agents, {"mode": "loopback", "agents": len(agents), "reason": reason}


# ---------------------------------------------------------------------------------- run
def run(model: str | ModelSpec, cluster: ClusterSource | None = None, plan: PlanSource = "dp=1",
        steps: int = 3, *,
        training: TrainingConfig = TrainingConfig(), checkpoint: CheckpointConfig = CheckpointConfig(),
        launch: LaunchConfig = LaunchConfig(), records: RecordsConfig = RecordsConfig(),
        faults: FaultsConfig = FaultsConfig(), watch: Callable[[], str | None] | None = None) -> RunResult:
    """Train `model` under `plan` on `cluster` for `steps` steps (the total, counting resumed ones).

    The settings come in five configs (`plait.runtime.config`, a docstring per field):
    `training` (dtype, optimizer, Megatron-LM's learning-rate schedule, clipping, seeds, the
    user's `data`), `checkpoint` (dir, every, resume, keep), `launch` (timeouts, device, torchrun's
    start method, worker env, cluster emulation, `rendezvous` for real hosts), `records` (run
    folder, Chrome trace, comm and step records, link probes, returned parameters) and `faults`
    (injected faults, slowed links, compute padding). A bad value fails when its config is built;
    what needs the plan or the model fails here, before any process starts.

    fp16 runs scale the loss dynamically (`plait.runtime.amp`; its settings can be given as
    `LaunchConfig(env={"PLAIT_LOSS_SCALE": "init=1024,growth_interval=100"})`); `sequence_parallel`
    plans run Megatron sequence parallelism inside the tensor groups (`plait.runtime.tensor_parallel`).
    With `launch.rendezvous` every node calls `run` with the same plan and cluster
    (`plait.runtime.multinode`); the node that holds plan rank 0 returns the losses and timeline,
    the others a result naming their ranks. The loss per step is written to `losses.csv` in the
    run directory. A plan with an SPMD program (`Plan.spmd`) runs it op by op on every rank
    (`plait.runtime.spmd_worker`).
    `watch()` is called about every half second while the workers run; a message it returns stops
    every rank and raises RunFailure (kind "stopped"): how the recovery driver (`plait.recover`)
    stops a live job it has diagnosed."""
    plan_obj, spec_string = _check_inputs(model, plan, steps, training, checkpoint, faults, launch)
    prep = _resolve(plan_obj, spec_string, cluster, training, checkpoint, launch, records)
    # An injected node uplink becomes the link faults of the rank pairs crossing that node.
    faults = dataclasses.replace(faults, inject=faults.injection().on_nodes([int(i["node"]) for i in prep.layout]))
    rdir, owns_dir = _prepare_run_dir(records.run_dir, launch.rendezvous)
    net_ctx, link_notes = _network(prep, launch, faults)
    t_start = time.time()
    with net_ctx as nets:
        agents, network, link_faults = _agents_and_links(prep, nets, launch, faults, link_notes)
        config_path = _write_config(prep, rdir, agents, steps, training, checkpoint, launch, records,
                                    faults, link_faults)
        _launch(config_path, rdir, agents, prep, launch, watch, owns_dir)
    return _collect(rdir, owns_dir, prep, network, records, t_start)


@dataclass
class _Prepared:
    """What `run` resolved before any process starts."""

    plan: Plan
    spec_string: str  # the model, as the workers load it
    cluster_arg: ClusterSource | None  # as given: names the cluster in the result
    cluster: Cluster | None  # the loaded Cluster (emulation dropped when not emulated), or None
    dtype: str  # the training dtype
    layout: list[dict[str, Any]]  # per plan rank (rank_layout)
    host_plan: dict[str, Any] | None  # real hosts: this node's share (_host_plan)
    here: int  # ranks this machine runs
    use_cuda: bool
    data: DataSettings | None  # the workers' data settings
    resume_from: str | None  # the checkpoint chosen to resume from
    notes: list[str]

    @property
    def backend(self) -> str:
        return "nccl" if self.use_cuda else "gloo"


def _check_inputs(model: str | ModelSpec, plan: PlanSource, steps: int, training: TrainingConfig,
                  checkpoint: CheckpointConfig, faults: FaultsConfig,
                  launch: LaunchConfig | None = None) -> tuple[Plan, str]:
    """Phase 1: what the configs cannot check alone (the plan, the model, the resume directory)."""
    plan_obj = Plan.load(plan)
    _check_plan(plan_obj, None if launch is None else
                {"engine": launch.engine, "dtype": training.dtype, "checkpoint": checkpoint.dir is not None})
    faults.check_world(plan_obj.world_size)
    if steps < 1:
        raise RuntimeSetupError(f"steps must be >= 1, got {steps}")
    if checkpoint.resume and checkpoint.dir is not None:
        _check_resumable(Path(checkpoint.dir))
    spec_string = model_spec_string(model)
    spec = load_model_spec(spec_string)  # a bad model spec fails here, not in every worker
    try:  # the same check as `plait simulate`
        check_plan_for_model(plan_obj, getattr(spec, "config", None) or {}, spec_string)
    except PlanError as exc:
        raise RuntimeSetupError(str(exc)) from None
    if ".py:" in spec_string:
        _check_user_model(spec, plan_obj, spec_string)
    return plan_obj, spec_string


def _check_user_model(spec: Any, plan: Plan, spec_string: str) -> None:
    """Before any worker starts, a user's model (shapes only, on fake tensors): its output suits
    its loss (a Hugging Face ModelOutput does; a tuple needs a loss of its own), and a pipeline
    plan cuts it as the workers will."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from plait.errors import PlaitError
    from plait.graph.capture import quiet_fake_mode

    module = spec.build("meta")
    if plan.tp > 1 and not any(getattr(m, "plait_tp", None) in TP_CUT_ROLES for m in module.modules()):
        raise RuntimeSetupError(
            f"plan field 'tp': {plan.tp} > 1, but model {spec_string} marks nothing tensor parallelism can "
            "shard (no plait_tp markers, no base_model_tp_plan in its config): every rank "
            "would hold the whole model; use tp=1")
    inputs, target = spec.sample_batch(2, device="meta")
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), quiet_fake_mode():  # the workers report what fails
            spec.loss(module(*inputs), target)
    except PlaitError as exc:
        raise RuntimeSetupError(f"model {spec_string}: {exc}") from None
    except Exception:  # an op fake tensors cannot run: the workers will say what, on real data
        pass
    if plan.pp > 1 and not plan.stages and plan.virtual_stages == 1:
        from plait.runtime.partition import split_into_stages

        split_into_stages(module, plan.layers_per_stage)


def _resolve(plan_obj: Plan, spec_string: str, cluster: ClusterSource | None, training: TrainingConfig,
             checkpoint: CheckpointConfig, launch: LaunchConfig, records: RecordsConfig) -> _Prepared:
    """Phase 2: the cluster, each rank's place and device, the data and the checkpoint to resume from."""
    cluster_obj = _load_cluster(cluster)
    dtype = training.dtype or plan_obj.dtype
    if cluster_obj is not None and not launch.emulate:
        cluster_obj = dataclasses.replace(cluster_obj, emulation=None)
    layout = rank_layout(cluster_obj, plan_obj, launch.emulate_dtype or dtype)
    notes: list[str] = []
    rdzv = launch.rendezvous
    host_plan = _host_plan(rdzv, cluster_obj, layout, notes, records.return_params) if rdzv is not None else None
    here = host_plan["nproc"] if host_plan is not None else len(layout)
    # auto: NCCL on GPUs when there is one per rank, else gloo on CPU.
    use_cuda = launch.device == "cuda" or (launch.device == "auto" and torch.cuda.is_available()
                                           and torch.cuda.device_count() >= here)
    if use_cuda and torch.cuda.device_count() < here:
        raise RuntimeSetupError(f"device cuda: the plan has {here} ranks on this machine but it has "
                                f"{torch.cuda.device_count()} GPUs (NCCL needs one GPU per rank); use --device cpu")
    if host_plan is not None and not use_cuda and not host_plan["emulated"]:
        notes.append("hosts: CPU workers: checked each host's worker count against the cluster file, not GPU "
                     "kind or memory")
    if plan_obj.sequence_parallel and plan_obj.tp == 1:
        notes.append("sequence_parallel has no effect with tp=1")
    if plan_obj.zero >= 3 and plan_obj.dp == 1:
        notes.append("zero=3 with dp=1: nothing to shard (ran plain data parallel)")
    if use_cuda and any(info["slowdown"] > 1.0 for info in layout):
        notes.append("compute slowdown emulation is applied on CPU ranks only; GPU ranks run at full speed")
    data: DataSettings | None = None
    if training.data is not None:
        from plait.runtime.data import load_data

        path, sep, name = str(training.data).rpartition(":")
        spec_text = f"{Path(path).expanduser().resolve()}:{name}" if sep and path else str(training.data)
        load_data(spec_text)  # a bad file or factory fails here, once, not in every worker
        data = DataSettings(spec=spec_text, workers=training.data_workers)
    resume_from: str | None = None
    if checkpoint.resume:
        assert checkpoint.dir is not None
        from plait.runtime import checkpoint as ckpt

        # Chosen here, before any worker starts: a damaged newest checkpoint is named in a warning and
        # the previous good one used; an old-format or incompatible one is a clear error, not a traceback.
        found, ck_notes = ckpt.choose_resume(Path(checkpoint.dir).resolve(), {
            "model": spec_string, "optimizer": training.optimizer_config(), "seed": training.seed,
            "data_seed": training.data_seed})
        resume_from = str(found) if found is not None else None
        notes += ck_notes
    return _Prepared(plan=plan_obj, spec_string=spec_string, cluster_arg=cluster, cluster=cluster_obj, dtype=dtype,
                     layout=layout, host_plan=host_plan, here=here, use_cuda=use_cuda, data=data,
                     resume_from=resume_from, notes=notes)


def _prepare_run_dir(run_dir: str | Path | None, rendezvous: Rendezvous | None) -> tuple[Path, bool]:
    """Phase 3: the run folder (a temporary one when none is given: owned, deleted after success),
    emptied of a previous run's records. Returns (folder, owned)."""
    rdir = Path(tempfile.mkdtemp(prefix="plait-run-")) if run_dir is None else Path(run_dir)
    if rendezvous is not None and run_dir is not None:
        rdir = rdir / rendezvous.node_name  # one folder per node: a run folder on a shared filesystem works too
    rdir.mkdir(parents=True, exist_ok=True)
    for sub in ("hb", "status", "exit", "comm", "steps"):
        shutil.rmtree(rdir / sub, ignore_errors=True)
        (rdir / sub).mkdir()
    for stale in ("result.json", "params.pt"):
        (rdir / stale).unlink(missing_ok=True)
    for f in rdir.glob("agent*.failures.json"):
        f.unlink()
    return rdir, run_dir is None


def _network(prep: _Prepared, launch: LaunchConfig, faults: FaultsConfig
             ) -> tuple[Any, dict[int, tuple[str, str]]]:
    """Phase 4a: the emulated network's context (namespaces shaped to the cluster file's links, and
    to the injected link faults tc can shape), or a null context (loopback, real hosts); and how
    each injected link fault will be applied (`_link_fault_plan`)."""
    from contextlib import nullcontext

    net_ctx: Any = nullcontext(None)
    emu = getattr(prep.cluster, "emulation", None) if prep.cluster is not None else None
    if emu is not None and emu.enabled and emu.namespaces and launch.rendezvous is None:
        from plait.runtime.netns import emulated_network

        net_ctx = emulated_network(prep.cluster, prep.plan)
    injection = faults.injection()
    link_notes = _link_fault_plan(injection, prep.layout, emu, launch.rendezvous)
    if any(how == "tc" for how, _ in link_notes.values()):
        from plait.runtime.netns import emulated_network

        net_ctx = emulated_network(prep.cluster, prep.plan, slow_links=_tc_links(injection, prep.layout))
    return net_ctx, link_notes


def _agents_and_links(prep: _Prepared, nets: Any, launch: LaunchConfig, faults: FaultsConfig,
                      link_notes: dict[int, tuple[str, str]]) -> tuple[list[AgentSpec], dict[str, Any], tuple[Any, ...]]:
    """Phase 4b: the torchrun agents, how the network was built, and the link faults the
    communication facade applies (those tc did not shape)."""
    injection = faults.injection()
    shaped_by_tc = bool(getattr(nets, "isolated", False)) and bool(getattr(nets, "slow_links", None))
    facade_links = [_facade_link(f) for f, (how, _) in zip(injection.links(), link_notes.values())
                    if how != "tc" or not shaped_by_tc]
    for f, (how, why) in zip(injection.links(), link_notes.values()):
        done = "tc on the emulated link" if how == "tc" and shaped_by_tc else \
            f"the communication facade ({why if how != 'tc' else 'namespaces could not be built'})"
        prep.notes.append(f"inject: {f.describe()}: shaped by {done}")
    if prep.host_plan is not None:
        agents, network = prep.host_plan["agents"], prep.host_plan["network"]
    else:
        agents, network = _agents(prep.layout, nets, launch.nprocs_per_node)
    if network.get("reason"):
        prep.notes.append(f"network: {network['reason']}")
    return agents, network, faults.link_faults() + tuple(facade_links)


def _write_config(prep: _Prepared, rdir: Path, agents: list[AgentSpec], steps: int, training: TrainingConfig,
                  checkpoint: CheckpointConfig, launch: LaunchConfig, records: RecordsConfig,
                  faults: FaultsConfig, link_faults: tuple[LinkFault, ...]) -> Path:
    """Phase 4c: the workers' `config.json` (and `cluster.yaml` beside it, for `plait report`)."""
    timeout = launch.timeout
    config = WorkerConfig(
        model=prep.spec_string, plan=prep.plan, steps=steps, seed=training.seed, data_seed=training.data_seed,
        optimizer=training.optimizer_config(), dtype=prep.dtype, lr_schedule=training.lr_schedule(),
        clip_grad=training.clip_grad, data=prep.data, backend=prep.backend,
        device="cuda" if prep.use_cuda else "cpu", engine=launch.engine,
        collective_timeout=max(timeout * 1.5, timeout + 30.0), step_barrier=launch.step_barrier,
        run_dir=str(rdir), ranks=tuple(RankPlace(**info) for info in prep.layout),
        agents=tuple(AgentRanks(a.node, tuple(a.ranks)) for a in agents),
        multinode=_multinode_settings(prep.host_plan, launch),
        checkpoint=_checkpoint_settings(checkpoint, prep.resume_from), records=_record_settings(records),
        faults=FaultSettings(inject=faults.injection(), comm_faults=link_faults, compute_sleep=faults.compute_sleep),
    )
    config_path = rdir / "config.json"
    write_worker_config(config_path, config)
    if prep.cluster is not None:  # beside the records: `plait report RUN_DIR` predicts the run from it
        from plait.cluster.loader import save_cluster
        from plait.errors import PlaitError

        try:
            save_cluster(prep.cluster, rdir / "cluster.yaml")
        except (PlaitError, OSError, ValueError) as exc:  # the run goes on; the report will ask for it
            prep.notes.append(f"run folder: cluster.yaml not written ({exc}); plait report will need --cluster")
    return config_path


def _multinode_settings(host_plan: dict[str, Any] | None, launch: LaunchConfig) -> MultinodeSettings | None:
    if host_plan is None:
        return None
    return MultinodeSettings(node_name=host_plan["node_name"], nodes=tuple(host_plan["nodes"]),
                             emulated=host_plan["emulated"], timeout=launch.startup())


def _checkpoint_settings(checkpoint: CheckpointConfig, resume_from: str | None) -> CheckpointSettings | None:
    if checkpoint.dir is None:
        return None
    return CheckpointSettings(dir=str(Path(checkpoint.dir).resolve()), every=checkpoint.every,
                              resume=checkpoint.resume, resume_from=resume_from, keep=checkpoint.keep)


def _record_settings(records: RecordsConfig) -> RecordSettings:
    # link probes time through the communication records: none without them
    return RecordSettings(comm_records=records.comm_records, step_records=records.step_records,
                          probe_every=records.probe_every if records.comm_records else 0,
                          probe_bytes=records.probe_bytes, return_params=records.return_params,
                          spmd_calibrate=bool(records.spmd_calibrate))


def _launch(config_path: Path, rdir: Path, agents: list[AgentSpec], prep: _Prepared, launch: LaunchConfig,
            watch: Callable[[], str | None] | None, owns_dir: bool) -> None:
    """Phase 5: start the torchrun agents and wait for the workers (watching them)."""
    extra_env = dict(launch.env or {})
    # All ranks share this machine's cores. torchrun sets OMP_NUM_THREADS=1 only for agents with
    # several workers; fixing it here makes the numerics independent of how ranks map to agents.
    if "OMP_NUM_THREADS" not in extra_env and "OMP_NUM_THREADS" not in os.environ:
        extra_env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // prep.here))
    method = rank_start_method(launch, prep.use_cuda, torch.cuda.is_available(), extra_env)
    launcher = Launcher(config_path, rdir, agents, prep.layout, timeout=launch.timeout,
                        startup_timeout=launch.startup(), env=extra_env, start_method=method,
                        rdzv=launch.rendezvous, watch=watch)
    launcher.start()
    _wait_naming_logs(launcher, rdir, owns_dir)


def rank_start_method(launch: LaunchConfig, use_cuda: bool, cuda_present: bool, env: dict[str, str]) -> str:
    """How the agents start their ranks: CUDA ranks spawn (CUDA cannot be used after fork), CPU
    ranks fork. On a machine with GPUs, CPU ranks get the GPUs hidden (`CUDA_VISIBLE_DEVICES=""`
    in `env`, unless the caller set it): a CPU rank there failed at step 0 with "CUDA error:
    initialization error" (an emulated cluster on an H100 host), and hidden GPUs cannot be touched."""
    if use_cuda:
        return launch.start_method or "spawn"
    if cuda_present and "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return launch.start_method or "fork"


def _collect(rdir: Path, owns_dir: bool, prep: _Prepared, network: dict[str, Any], records: RecordsConfig,
             t_start: float) -> RunResult:
    """Phase 6: the result from the workers' records; `losses.csv`, the trace; a temporary folder removed."""
    config = _read_config(rdir / "config.json", rdir)  # as the workers read it
    args = (rdir, config, prep.plan, prep.cluster_arg, prep.backend, network, prep.notes)
    if prep.host_plan is not None and not (rdir / "result.json").exists():
        result = _node_result(*args)
    else:
        result = _read_result(*args)
    result.network["wall_seconds"] = time.time() - t_start
    write_loss_csv(rdir / "losses.csv", result.steps, result.losses)
    if not owns_dir:  # a kept run folder: the same steps as TensorBoard scalars (`plait.runtime.metrics`)
        config = getattr(load_model_spec(prep.spec_string), "config", None) or {}
        seq = config.get("seq") if isinstance(config, dict) else None
        note = write_tensorboard(rdir, result, prep.plan.global_batch, seq if isinstance(seq, int) else None)
        if note:
            result.notes.append(note)
    balance = stage_balance_note(result)
    if balance:
        result.notes.append(balance)
    if records.trace is not None:
        result.timeline.save_chrome_trace(records.trace)
    result.comm_dir = str(rdir / "comm") if records.comm_records else None
    if owns_dir:
        shutil.rmtree(rdir, ignore_errors=True)
        result.run_dir = result.comm_dir = None
    return result


def _link_fault_plan(injection: Any, layout: list[dict[str, Any]], emu: Any, rendezvous: Any
                     ) -> dict[int, tuple[str, str]]:
    """Per injected link fault: ("tc", "") where the emulated cluster's links can shape it (root,
    network namespaces, the two ranks on different nodes, from step 0, a delay only with
    sch_netem), else ("facade", why not)."""
    from plait.runtime.netns import namespaces_possible

    out: dict[int, tuple[str, str]] = {}
    for i, f in enumerate(injection.links()):
        if emu is None or not (emu.enabled and emu.namespaces) or rendezvous is not None:
            out[i] = ("facade", "no emulated cluster with network namespaces")
        elif layout[f.rank]["node"] == layout[f.peer]["node"]:
            out[i] = ("facade", f"ranks {f.rank} and {f.peer} share node {layout[f.rank]['host']}")
        elif f.step > 0:
            out[i] = ("facade", "tc shapes a link for the whole run; the fault starts at a later step")
        elif f.delay_s > 0:
            out[i] = ("facade", "a delay needs sch_netem")
        else:
            ok, why = namespaces_possible()
            out[i] = ("tc", "") if ok else ("facade", why)
    return out


def _tc_links(injection: Any, layout: list[dict[str, Any]]) -> dict[tuple[int, int], float]:
    """(node a, node b) -> bandwidth divisor, for the link faults tc shapes."""
    out: dict[tuple[int, int], float] = {}
    for f in injection.links():
        a, b = layout[f.rank]["node"], layout[f.peer]["node"]
        if a != b and f.step == 0 and f.delay_s == 0:
            out[(a, b)] = out[(b, a)] = max(out.get((a, b), 1.0), f.factor)
    return out


def _facade_link(f: Any) -> LinkFault:
    return LinkFault(f.rank, f.peer, f.delay_s, f.factor, f.step)


def _host_plan(rdzv: Rendezvous, cluster: Cluster | None, layout: list[dict[str, Any]], notes: list[str],
               return_params: bool = False) -> dict[str, Any]:
    """Real hosts: this node's agent (its workers, its plan ranks when its name is in the cluster
    file) and what the workers will check after the rendezvous (`plait.runtime.multinode`)."""
    nodes = cluster_nodes(cluster, layout)
    if return_params:
        raise RuntimeSetupError("return_params: not in a multi-node run (each node has its own run directory)")
    nproc, named = local_workers(nodes, rdzv)
    for node in nodes:  # the GPU of each rank on its host: the cluster file's local index
        for r, local in zip(node.ranks, node.local):
            layout[r]["local_device"] = local
    emu = getattr(cluster, "emulation", None)
    emulated = emu is not None and emu.enabled
    if emulated:
        notes.append("hosts: the cluster file is emulated: GPU count, kind and memory of the hosts are not checked "
                     "(only each host's worker count)")
    ranks = list(named.ranks) if named is not None else list(range(nproc))  # unnamed: known after the rendezvous
    agent = AgentSpec(node=0, host=rdzv.node_name, ranks=ranks)
    network = {"mode": "hosts", "nnodes": rdzv.nnodes, "endpoint": rdzv.endpoint, "run_id": rdzv.run_id,
               "node_name": rdzv.node_name, "launch": rdzv.source,
               "matched_by": "node name" if named is not None else "rendezvous order"}
    return {"nproc": nproc, "nodes": nodes, "emulated": emulated, "node_name": rdzv.node_name,
            "agents": [agent], "network": network}


def _node_result(rdir: Path, config: WorkerConfig, plan: Plan, cluster: ClusterSource | None, backend: str,
                 network: dict[str, Any], notes: list[str]) -> RunResult:
    """Real hosts, a node without plan rank 0: its ranks trained; rank 0's node reports the run."""
    node = json.loads((rdir / "node.json").read_text()) if (rdir / "node.json").exists() else {}
    network = {**network, "ranks": node.get("ranks"), "cluster_node": node.get("cluster_node")}
    rank0_node = config.ranks[0].host
    owner = next((h for h in node.get("hosts", []) if h["cluster_node"] == rank0_node), None)
    where = f"host {owner['hostname']} (node name '{owner['name']}')" if owner else f"cluster node '{rank0_node}'"
    notes = [*notes, f"this node ran plan ranks {node.get('ranks')}; {where} holds plan rank 0 and reports the "
                     f"losses and the timeline"]
    cluster_name = str(cluster) if isinstance(cluster, str | Path) else getattr(cluster, "name", "local")
    return RunResult(model=config.model, cluster=cluster_name, plan=str(plan), backend=backend, device=config.device,
                     steps=[], losses=[], iteration_times=[], timeline=Timeline(events=[], source="measured"),
                     ranks=[], network=network, notes=notes, run_dir=str(rdir))


@dataclass
class StepRecords:
    """What a run folder's streamed step records (`RecordsConfig(step_records=True)`) say, for the steps every
    rank finished: a run that died keeps its losses and step times up to its death."""

    losses: dict[int, float]  # step -> global-batch loss (the data-parallel replicas' shares summed)
    iteration_times: dict[int, float]  # step -> last rank's end - first rank's start (as RunResult's)
    started_wall: dict[int, float]  # step -> wall time (time.time()) the first rank started it


def read_step_records(run_dir: str | Path, world: int) -> StepRecords:
    """Read `RUN_DIR/steps/rank*.jsonl` of a run of `world` ranks. A line cut short by a rank's
    death is skipped."""
    by_step: dict[int, dict[int, dict[str, Any]]] = {}
    for f in sorted((Path(run_dir) / "steps").glob("rank*.jsonl")):
        rank = int(f.stem[4:])
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
                by_step.setdefault(int(rec["step"]), {})[rank] = rec
            except (ValueError, KeyError, TypeError):
                continue
    out = StepRecords({}, {}, {})
    for step, recs in sorted(by_step.items()):
        if len(recs) < world:
            continue
        shares = {int(r["dp"]): float(r["loss_share"]) for r in recs.values() if "loss_share" in r}
        # Summed in fp32 as the replicas' all-reduce does (exact for 2 replicas; for more, the
        # order of a ring's additions may differ in the last bit).
        total = torch.zeros((), dtype=torch.float32)
        for d in sorted(shares):
            total += shares[d]
        out.losses[step] = float(total)
        out.iteration_times[step] = max(r["t1"] for r in recs.values()) - min(r["t0"] for r in recs.values())
        out.started_wall[step] = min(r["wall"] - (r["t1"] - r["t0"]) for r in recs.values())
    return out


def write_loss_csv(path: Path, steps: list[int], losses: list[float]) -> None:
    """The global-batch loss of each step, as `step,loss` lines (beside the run's records)."""
    lines = ["step,loss"] + [f"{s},{loss!r}" for s, loss in zip(steps, losses, strict=True)]
    path.write_text("\n".join(lines) + "\n")


# Stages whose compute differs by more than this are not a split any planner of plait's picks (they
# balance stage times); most likely the plan's `layers` or the default split of a model with layers
# of very unequal cost (an embedding table as heavy as several blocks) put them there.
LOPSIDED_STAGES = 2.0


def stage_balance_note(result: RunResult) -> str | None:
    """A note when a pipeline's stages computed very unequal times (issue 38: a lopsided split ran
    without a word): per stage, the median over steps (the first left out) of its first rank's
    forward and backward seconds (CPU seconds on CPU ranks); None when the slowest is within
    `LOPSIDED_STAGES` of the fastest."""
    stages = sorted({r.pp for r in result.ranks})
    if len(stages) < 2 or len(result.steps) < 2:
        return None
    first = {s: min(r.device for r in result.ranks if r.pp == s) for s in stages}
    per: dict[int, dict[int, float]] = {s: {} for s in stages}
    for e in result.timeline.events:
        step = e.args.get("step")
        if e.category in ("forward", "backward") and step is not None and step != result.steps[0] \
                and e.stage in per and e.device == first[e.stage]:
            # a CPU rank's span: its thread's CPU seconds, which other processes on the machine
            # do not stretch (a GPU rank's: its kernels' time)
            per[e.stage][step] = per[e.stage].get(step, 0.0) + float(e.args.get("cpu_s", e.duration))
    times = {s: statistics.median(v.values()) for s, v in per.items() if v}
    if len(times) < 2 or min(times.values()) <= 0:
        return None
    slow, fast = max(times, key=times.__getitem__), min(times, key=times.__getitem__)
    ratio = times[slow] / times[fast]
    if ratio <= LOPSIDED_STAGES:
        return None
    params = {s: sum(r.params for r in result.ranks if r.pp == s and r.device == first[s]) for s in (slow, fast)}
    return (f"pipeline: stage {slow} computed {times[slow] * 1e3:.1f} ms per step, stage {fast} "
            f"{times[fast] * 1e3:.1f} ms ({ratio:.1f}x; {params[slow]:,} vs {params[fast]:,} parameters) -- "
            "a split no planner of plait's picks; `plait plan` balances the stages' times (or set the plan's layers)")


def _read_result(rdir: Path, config: WorkerConfig, plan: Plan, cluster: ClusterSource | None, backend: str,
                 network: dict[str, Any], notes: list[str]) -> RunResult:
    path = rdir / "result.json"
    if not path.exists():
        raise RunFailure(f"the workers finished without writing {path}; see the logs in {rdir}",
                         run_dir=str(rdir))
    data = check_version("run", json.loads(path.read_text()), str(path), RunFailure)
    ranks = data["ranks"]
    events: list[TimelineEvent] = []
    for r in ranks:
        events += [TimelineEvent(**e) for e in r["events"]]
    bounds = []
    for i in range(len(data["steps"])):
        bounds.append((min(r["step_bounds"][i][1] for r in ranks), max(r["step_bounds"][i][2] for r in ranks)))
    t0 = bounds[0][0] if bounds else 0.0
    for e in events:
        e.start -= t0
        e.end -= t0
    events.sort(key=lambda e: (e.start, e.resource))
    bounds = [(a - t0, b - t0) for a, b in bounds]
    cluster_name = str(cluster) if isinstance(cluster, str | Path) else getattr(cluster, "name", "local")
    timeline = Timeline(events=events, source="measured",
                        meta={"model": config.model, "plan": str(plan), "cluster": cluster_name, "backend": backend,
                              "steps": data["steps"], "iteration_times": data["iteration_times"],
                              "clock": ranks[0]["clock"]["alignment"]})
    infos = [RankInfo(rank=r["rank"], pp=r["pp"], dp=r["dp"], tp=r["tp"], device=r["device"], host=r["host"],
                      node=r["node"], kind=r["kind"], slowdown=r["slowdown"], pid=r["pid"], layers=r["layers"],
                      params=r["params"], samples_per_step=r["samples_per_step"],
                      peak_memory_bytes=r["peak_memory_bytes"], memory_kind=r["memory_kind"]) for r in ranks]
    params = None
    if data.get("params_file"):
        params = torch.load(rdir / data["params_file"], weights_only=True)
    steps = data["steps"]
    amp = data.get("amp") or {}
    return RunResult(model=config.model, cluster=cluster_name, plan=str(plan), backend=backend,
                     device=config.device, steps=steps, losses=data["losses"],
                     iteration_times=data["iteration_times"], timeline=timeline, ranks=infos, network=network,
                     notes=notes, run_dir=str(rdir), params=params,
                     resumed_from=steps[0] if steps and steps[0] > 0 else None, step_bounds=bounds,
                     loss_scales=amp.get("loss_scales", []), skipped_steps=amp.get("skipped_steps", []),
                     final_loss_scale=amp.get("final_loss_scale"),
                     skipped_by_rank={int(k): v for k, v in (amp.get("skipped_by_rank") or {}).items()},
                     spmd=ranks[0].get("spmd"), engine=engine_for(plan, config).engine)


def load_run(run_dir: str | Path) -> RunResult:
    """The `RunResult` of a finished run folder (its config.json and result.json), as `run` returned
    it: losses, iteration times, the measured timeline and each rank's facts. RunFailure naming the
    file when the folder holds no finished run."""
    rdir = Path(run_dir)
    path = rdir / "config.json"
    if not path.is_file():
        raise RunFailure(f"{path}: no such file (not a plait run folder)", run_dir=str(rdir))
    config = _read_config(path, rdir)
    cluster = rdir / "cluster.yaml"
    return _read_result(rdir, config, config.plan, str(cluster) if cluster.is_file() else "local", config.backend,
                        {}, [])


def _read_config(path: Path, rdir: Path) -> WorkerConfig:
    """The run folder's worker config (`read_worker_config`); RunFailure naming the file and the key."""
    try:
        return read_worker_config(path)
    except WorkerConfigError as exc:
        raise RunFailure(str(exc), run_dir=str(rdir)) from None


def reference_run(model: str | ModelSpec, plan: PlanSource, steps: int, *, training: TrainingConfig = TrainingConfig()
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process reference: the whole global batch in one forward/backward per step,
    the same initial weights, samples (synthetic, or the stream of `training.data`), optimizer,
    learning-rate schedule and clipping as `run(..., training=training)`, in fp32 -- or, when
    `training.dtype` names one, in that precision as every engine runs it (fp32 parameters, ops
    autocast to bf16 / fp16; fp16 with the dynamic loss scaler of `PLAIT_LOSS_SCALE`, skipping the
    steps it skips). Returns (losses, parameters by name)."""
    from plait.runtime.data_parallel import make_optimizer
    from plait.runtime.partition import make_samples

    plan_obj = Plan.load(plan)
    spec = load_model_spec(model)
    seed, data, data_seed = training.seed, training.data, training.data_seed
    module = build_seeded(spec, seed)
    torch.manual_seed(seed + 1)
    opt = make_optimizer([p for p in module.parameters() if p.requires_grad], training.optimizer_config())
    schedule = training.lr_schedule()
    if data is not None:
        from plait.runtime import data as user_data

        dataset, collate = user_data.load_data(data)
        order = user_data.SampleOrder(len(dataset), data_seed)
    scaler = DynamicLossScaler.from_string(os.environ.get(SCALE_ENV)) if training.dtype == "fp16" else None
    losses = []
    for step in range(steps):
        if data is not None:
            inputs, target = user_data.samples(dataset, collate, order, step * plan_obj.global_batch,
                                               plan_obj.global_batch)
        else:
            inputs, target = make_samples(spec, step * plan_obj.global_batch, plan_obj.global_batch, data_seed)
        with autocast_for(training.dtype):
            loss = spec.loss(module(*inputs), target)
        (loss * scaler.scale if scaler is not None else loss).backward()
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if scaler is not None and scaler.unscale_and_check(grads):
            scaler.update(step)  # skipped, as every rank of a run skips it
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            continue
        if scaler is not None:
            scaler.update(step)
        if training.clip_grad is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), training.clip_grad)
        if schedule is not None:
            for group in opt.param_groups:
                group["lr"] = schedule.at(step, steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}
    return losses, params
