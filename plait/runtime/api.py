"""`run(model, cluster, plan, steps)`: train under a plan with real torch.distributed workers.

    result = run("gpt:layers=4,hidden=64,heads=4,seq=32,vocab=256", "my_cluster.yaml",
                 "dp=2,tp=2,pp=1,micro_batch=2,global_batch=8,dtype=fp32", steps=5)
    result.losses, result.iteration_times, result.timeline.save_chrome_trace("trace.json")

One worker per plan rank (world size = plan.world_size), launched through torchrun
(`torch.distributed.run`); gloo on CPU, NCCL (with CUDA-event timing) when CUDA devices
are available. On a cluster file with `emulation`, each rank's GPU kind sets a compute
slowdown (`plait.runtime.emulate`) and, as root, nodes live in network namespaces shaped
to the file's links (`plait.runtime.netns`); otherwise all ranks share loopback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from plait.plan.ir import Plan
from plait.runtime.launch import AgentSpec, Launcher, RunFailure
from plait.runtime.layout import device_of, supports
from plait.runtime.partition import RuntimeSetupError, load_model_spec, model_spec_string
from plait.sim.timeline import Timeline, TimelineEvent

__all__ = ["RankInfo", "RunFailure", "RunResult", "run", "rank_layout"]


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
            "final_loss_scale": self.final_loss_scale,
            "ranks": [r.__dict__ for r in self.ranks],
        }
        if events:
            out["timeline"] = self.timeline.to_dict()
        return out


# ---------------------------------------------------------------------------------- layout
def _load_cluster(cluster: Any) -> Any:
    if cluster is None:
        return None
    from plait.cluster.spec import Cluster

    if isinstance(cluster, Cluster):
        return cluster
    from plait.cluster import load_cluster

    return load_cluster(cluster)


def rank_layout(cluster: Any, plan: Plan, dtype: str | None = None) -> list[dict[str, Any]]:
    """Per plan rank: cluster device, node, host name, GPU kind and emulated compute slowdown."""
    world = plan.world_size
    if cluster is None:
        host = socket.gethostname()
        return [{"rank": r, "device": device_of(plan, r), "node": 0, "host": host, "kind": None, "slowdown": 1.0}
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

        slow = {device_of(plan, r): compute_slowdown(cluster, device_of(plan, r), dtype or plan.dtype)
                for r in range(world)}
    out = []
    for r in range(world):
        dev = device_of(plan, r)
        if dev >= len(devices):
            raise RuntimeSetupError(f"plan field 'device_order': device {dev} is not in {source} "
                                    f"({len(devices)} devices)")
        node, kind = devices[dev]
        out.append({"rank": r, "device": dev, "node": node, "host": cluster.nodes[node].name, "kind": kind,
                    "slowdown": slow.get(dev, 1.0)})
    return out


def _check_plan(plan: Plan) -> None:
    """Refuse what the runtime cannot run: exactly `plait.runtime.supports`' verdict and reason."""
    ok, reason = supports(plan)
    if not ok:
        raise RuntimeSetupError(reason)


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
    k = nprocs_per_node or world
    if k < 1:
        raise RuntimeSetupError(f"--nprocs-per-node must be >= 1, got {k}")
    agents = [AgentSpec(node=i, host=layout[r]["host"], ranks=list(range(r, min(r + k, world))))
              for i, r in enumerate(range(0, world, k))]
    return agents, {"mode": "loopback", "agents": len(agents), "reason": reason}


# ---------------------------------------------------------------------------------- run
def run(model: Any, cluster: Any = None, plan: Any = "dp=1", steps: int = 3, *,
        trace: str | Path | None = None, checkpoint_dir: str | Path | None = None, checkpoint_every: int = 0,
        resume: bool = False, keep_checkpoints: int | None = 2, timeout: float = 300.0,
        startup_timeout: float | None = None, nprocs_per_node: int | None = None, device: str = "auto",
        dtype: str | None = None, optimizer: str | dict[str, Any] = "adamw", lr: float = 1e-3,
        weight_decay: float = 0.0, seed: int = 0, data_seed: int = 0, run_dir: str | Path | None = None,
        return_params: bool = False, step_barrier: bool = True, fault: str | None = None,
        env: dict[str, str] | None = None, emulate: bool = True, start_method: str | None = None,
        emulate_dtype: str | None = None, clip_grad: float | None = None) -> RunResult:
    """Train `model` under `plan` on `cluster` for `steps` steps (the total, counting resumed ones).

    `dtype` overrides `plan.dtype` (e.g. "fp32" on CPU, where bf16 autocast is slow);
    `emulate_dtype` is the dtype whose peak FLOP/s ratios set the emulated slowdown of slower
    kinds (default: the training dtype), e.g. the plan's fp16 while the CPU ranks compute fp32;
    `start_method` is torchrun's: "fork" (CPU default: workers inherit the agent's imports)
    or "spawn" (GPU default: CUDA must not be initialised before a fork);
    `fault` is the hidden fault-injection string of tests (see `plait.runtime.worker.Fault`);
    `clip_grad` clips the global gradient norm (over every shard of every form) to that value
    (`plait.runtime.clip`, Megatron's --clip-grad).
    fp16 runs scale the loss dynamically (`plait.runtime.amp`; its settings can be given as
    `env={"PLAIT_LOSS_SCALE": "init=1024,growth_interval=100"}`); `sequence_parallel` plans run
    Megatron sequence parallelism inside the tensor groups (`plait.runtime.tensor_parallel`)."""
    plan_obj = Plan.load(plan)
    _check_plan(plan_obj)
    if steps < 1:
        raise RuntimeSetupError(f"steps must be >= 1, got {steps}")
    if clip_grad is not None and not clip_grad > 0:
        raise RuntimeSetupError(f"clip_grad: must be > 0, got {clip_grad}")
    if checkpoint_every < 0:
        raise RuntimeSetupError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
    if (checkpoint_every or resume) and checkpoint_dir is None:
        raise RuntimeSetupError("checkpointing and --resume need a checkpoint directory (--checkpoint-dir)")
    spec_string = model_spec_string(model)
    spec = load_model_spec(spec_string)  # a bad model spec fails here, not in every worker
    seq = (getattr(spec, "config", None) or {}).get("seq")
    if plan_obj.sequence_parallel and plan_obj.tp > 1 and isinstance(seq, int) and seq % plan_obj.tp:
        raise RuntimeSetupError(f"plan field 'sequence_parallel': the sequence length {seq} of {spec_string} does "
                                f"not divide by tp={plan_obj.tp} (sequence parallelism cuts it into tp equal parts)")
    cluster_obj = _load_cluster(cluster)
    dtype = dtype or plan_obj.dtype
    if dtype not in ("fp32", "tf32", "bf16", "fp16"):
        raise RuntimeSetupError(f"dtype: must be fp32, tf32, bf16 or fp16, got {dtype!r}")
    if cluster_obj is not None and not emulate:
        cluster_obj = dataclasses.replace(cluster_obj, emulation=None)
    if emulate_dtype is not None and emulate_dtype not in ("fp32", "tf32", "bf16", "fp16"):
        raise RuntimeSetupError(f"emulate_dtype: must be fp32, tf32, bf16 or fp16, got {emulate_dtype!r}")
    layout = rank_layout(cluster_obj, plan_obj, emulate_dtype or dtype)
    world = len(layout)
    # auto: NCCL on GPUs when there is one per rank, else gloo on CPU.
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available()
                                    and torch.cuda.device_count() >= world)
    if device not in ("auto", "cpu", "cuda"):
        raise RuntimeSetupError(f"device: must be auto, cpu or cuda, got {device!r}")
    if use_cuda and torch.cuda.device_count() < len(layout):
        raise RuntimeSetupError(f"device cuda: the plan has {len(layout)} ranks but this machine has "
                                f"{torch.cuda.device_count()} GPUs (NCCL needs one GPU per rank); use --device cpu")
    backend = "nccl" if use_cuda else "gloo"
    notes: list[str] = []
    if plan_obj.sequence_parallel and plan_obj.tp == 1:
        notes.append("sequence_parallel has no effect with tp=1")
    if plan_obj.zero >= 3 and plan_obj.dp == 1:
        notes.append("zero=3 with dp=1: nothing to shard (ran plain data parallel)")
    if use_cuda and any(info["slowdown"] > 1.0 for info in layout):
        notes.append("compute slowdown emulation is applied on CPU ranks only; GPU ranks run at full speed")
    opt_cfg = {"name": optimizer, "lr": lr, "weight_decay": weight_decay} if isinstance(optimizer, str) \
        else {"lr": lr, "weight_decay": weight_decay, **optimizer}
    owns_dir = run_dir is None
    rdir = Path(tempfile.mkdtemp(prefix="plait-run-")) if run_dir is None else Path(run_dir)
    rdir.mkdir(parents=True, exist_ok=True)
    for sub in ("hb", "status", "exit"):
        shutil.rmtree(rdir / sub, ignore_errors=True)
        (rdir / sub).mkdir()
    for stale in ("result.json", "params.pt"):
        (rdir / stale).unlink(missing_ok=True)
    for f in rdir.glob("agent*.failures.json"):
        f.unlink()
    startup = startup_timeout if startup_timeout is not None else max(120.0, timeout)

    from contextlib import nullcontext

    net_ctx: Any = nullcontext(None)
    emu = getattr(cluster_obj, "emulation", None) if cluster_obj is not None else None
    if emu is not None and emu.enabled and emu.namespaces:
        from plait.runtime.netns import emulated_network

        net_ctx = emulated_network(cluster_obj, plan_obj)
    t_start = time.time()
    with net_ctx as nets:
        agents, network = _agents(layout, nets, nprocs_per_node)
        if network.get("reason"):
            notes.append(f"network: {network['reason']}")
        cfg = {
            "model": spec_string, "plan": plan_obj.to_dict(), "steps": steps, "seed": seed, "data_seed": data_seed,
            "optimizer": opt_cfg, "backend": backend, "device": "cuda" if use_cuda else "cpu", "dtype": dtype,
            "ranks": layout, "agents": [{"node": a.node, "ranks": a.ranks} for a in agents],
            "run_dir": str(rdir), "collective_timeout": max(timeout * 1.5, timeout + 30.0),
            "checkpoint": {"dir": str(Path(checkpoint_dir).resolve()), "every": checkpoint_every,
                           "resume": resume, "keep": keep_checkpoints} if checkpoint_dir is not None else None,
            "return_params": return_params, "step_barrier": step_barrier, "fault": fault, "clip_grad": clip_grad,
        }
        config_path = rdir / "config.json"
        config_path.write_text(json.dumps(cfg, indent=1))
        extra_env = dict(env or {})
        # All ranks share this machine's cores. torchrun sets OMP_NUM_THREADS=1 only for agents with
        # several workers; fixing it here makes the numerics independent of how ranks map to agents.
        if "OMP_NUM_THREADS" not in extra_env and "OMP_NUM_THREADS" not in os.environ:
            extra_env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
        method = start_method or ("spawn" if use_cuda else "fork")
        if method not in ("fork", "spawn", "forkserver"):
            raise RuntimeSetupError(f"start_method: must be fork, spawn or forkserver, got {method!r}")
        launcher = Launcher(config_path, rdir, agents, layout, timeout=timeout, startup_timeout=startup,
                            env=extra_env, start_method=method)
        launcher.start()
        launcher.wait()
    result = _read_result(rdir, cfg, plan_obj, cluster, backend, network, notes)
    result.network["wall_seconds"] = time.time() - t_start
    if trace is not None:
        result.timeline.save_chrome_trace(trace)
    if owns_dir:
        shutil.rmtree(rdir, ignore_errors=True)
        result.run_dir = None
    return result


def _read_result(rdir: Path, cfg: dict[str, Any], plan: Plan, cluster: Any, backend: str,
                 network: dict[str, Any], notes: list[str]) -> RunResult:
    path = rdir / "result.json"
    if not path.exists():
        raise RunFailure(f"the workers finished without writing {path}; see the logs in {rdir}",
                         run_dir=str(rdir))
    data = json.loads(path.read_text())
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
                        meta={"model": cfg["model"], "plan": str(plan), "cluster": cluster_name, "backend": backend,
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
    return RunResult(model=cfg["model"], cluster=cluster_name, plan=str(plan), backend=backend,
                     device=cfg["device"], steps=steps, losses=data["losses"],
                     iteration_times=data["iteration_times"], timeline=timeline, ranks=infos, network=network,
                     notes=notes, run_dir=str(rdir), params=params,
                     resumed_from=steps[0] if steps and steps[0] > 0 else None, step_bounds=bounds,
                     loss_scales=amp.get("loss_scales", []), skipped_steps=amp.get("skipped_steps", []),
                     final_loss_scale=amp.get("final_loss_scale"),
                     skipped_by_rank={int(k): v for k, v in (amp.get("skipped_by_rank") or {}).items()})


def reference_run(model: Any, plan: Any, steps: int, *, optimizer: str | dict[str, Any] = "adamw",
                  lr: float = 1e-3, weight_decay: float = 0.0, seed: int = 0, data_seed: int = 0,
                  clip_grad: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process reference: the whole global batch in one forward/backward per step,
    the same initial weights, samples and optimizer. Returns (losses, parameters by name)."""
    from plait.runtime.data_parallel import make_optimizer
    from plait.runtime.partition import make_samples

    plan_obj = Plan.load(plan)
    spec = load_model_spec(model)
    torch.manual_seed(seed)
    try:
        module = spec.build(device="cpu", dtype=torch.float32, seed=seed)
    except TypeError:
        module = spec.build(device="cpu", dtype=torch.float32)
    module.train()
    torch.manual_seed(seed + 1)
    opt_cfg = {"name": optimizer, "lr": lr, "weight_decay": weight_decay} if isinstance(optimizer, str) \
        else {"lr": lr, "weight_decay": weight_decay, **optimizer}
    opt = make_optimizer([p for p in module.parameters() if p.requires_grad], opt_cfg)
    losses = []
    for step in range(steps):
        inputs, target = make_samples(spec, step * plan_obj.global_batch, plan_obj.global_batch, data_seed)
        loss = spec.loss(module(*inputs), target)
        loss.backward()
        if clip_grad is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}
    return losses, params
