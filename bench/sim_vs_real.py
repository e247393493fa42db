"""Simulator vs reality on this machine: predicted and measured iteration times of real plans.

    python bench/sim_vs_real.py                 # 2 clusters x 4 plans, 3 rounds (~4-5 min)
    python bench/sim_vs_real.py --quick         # 2 plans per cluster, 1 round (~1 min)
    python bench/sim_vs_real.py --keep DIR      # keep cluster files, profiles, traces and the JSON in DIR

What it does, end to end:

1. writes two **emulated clusters** of two "GPUs" each -- as many ranks as this machine has
   CPUs: `homo`, one node with two A100s (ranks talk over the node's loopback, like
   NVLink), and `hetero`, an A100 node and a T4 node whose NICs are shaped with tc to
   ``100 Gb/s x emulation.bandwidth_scale`` = 50 MB/s (namespaces need root; without it the
   run falls back to loopback and says so). The T4's compute slowdown is the datasheet fp32
   ratio 19.5/8.1 = 2.41 (`plait.runtime.emulate`);
2. **profiles each cluster** with `plait profile` inside its namespaces (per-pair p2p
   bandwidth and latency, all-reduce sweep, slowdown per kind) into the measured cluster YAML
   the simulator is given, and fits what gloo adds to a 2-rank ring all-reduce beyond the
   link (``t = 2a + S/B + c + S g``: ``c`` becomes the simulator's `host_comm_s`, ``g`` lowers
   the loopback link's bandwidth where it matters);
3. for each plan (DP, TP, PP GPipe / 1F1B on `homo`; even and uneven DP shares and layer
   splits on `hetero`), `--rounds` times (odd rounds in reverse order):
   **profiles the model's layers** on both emulated devices at once right before and right
   after the run (`plait.cost.layer_profile`: each layer's forward and backward alone,
   mean of repetitions -- a step sums many spans, so the expected time is what it sees --
   one thread, fp32 -- what a rank runs; under tensor parallelism a
   layer is sliced exactly as the runtime slices it, its collectives made no-ops, so the
   figure is one tensor rank's compute). This is how profiling simulators (dPRO, Echo,
   Pipette) feed a simulation: measured layer times, simulated plan. **Measures** the plan
   with `plait.runtime.api.run` on the emulated cluster (median of the steps after two
   warm-up steps) and **predicts** it with `plait.sim.api.simulate` on the measured cluster
   from the mean of the two profiles, each device's layer times scaled by its kind's
   slowdown and by its own measured speed (the devices of this machine differ at times);
   the optimizer step, the runtime's gradient flatten/copy-back around the data-parallel
   all-reduce, and gloo's per-call cost come from the same profilers;
4. prints per plan the predicted and measured iteration time of the round with the median
   error, the errors of every round, the per-cluster and overall ranking (Spearman and whether
   the order is the same), the simulator's default GPU compute model on the same measured
   cluster as a baseline, and a **replay** error: the same simulation at the compute speed
   each device actually had during the run (its measured forward/backward seconds over the
   simulated ones) -- what remains is the simulator's schedule, communication and
   overheads, without the machine's drift between profile and run.

This machine (2 vCPUs of a shared VM; other sessions run beside the bench) changes speed by
tens of percent from one minute to the next, and its two vCPUs slow each other down when
both compute. Hence: two ranks (one per CPU), each rank and its profiler pinned to its own
CPU with a high `cpu.shares` weight (`plait.runtime.cpu_share`; root only, else skipped):
unpinned, a gloo receive waits up to a scheduler slice (~4 ms measured) behind the other
rank's compute; profiles taken on both CPUs at once (as the ranks compute at once),
bracketing each run; several rounds; glibc malloc told to keep freed memory, as a GPU's
caching allocator does (`MALLOC_ENV`: fresh memory costs page faults that are expensive
in this VM and hit pipeline stages, which keep activations alive, far more than a layer
timed alone). `--cpu-mode fixed` instead gives each rank a 0.5-CPU
CFS quota on one shared CPU (no side-by-side contention, but ~2 ms extra gloo latency per
message), `--cpu-mode shared` leaves ranks unpinned.

The target (issue 5) is <= 10 % per plan and the same ranking.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

MODEL = "gpt:layers=4,hidden=128,heads=4,seq=64,vocab=512"
SHARES = 8192  # cpu.shares of each rank's cgroup (8x a plain process)
# glibc malloc keeps freed memory in the process (no mmap per large block, no trimming), as
# PyTorch's CUDA caching allocator does on a GPU. With glibc's defaults every activation of a
# block above 128 KiB is fresh mmap'd memory, and a page fault costs a lot in this VM: a
# pipeline stage, which keeps several micro-batches' activations alive, ran its layers 30-50 %
# slower than the same layers timed alone (measured: 8.4 vs 6.4 ms; 4.2 vs 4.2 ms with these).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(4 << 30),
              "MALLOC_TOP_PAD_": str(512 << 20)}

CLUSTERS = {
    # Ranks of one node talk over the namespace's loopback (NVLink-like, not shaped).
    "homo": """
        name: emu-homo
        nodes:
          - {name: a, gpus: {kind: a100-80gb, count: 2}, nic: {type: ethernet, bandwidth: 100 Gb/s, count: 1}}
        emulation: {bandwidth_scale: 0.004}
    """,
    # 100 Gb/s NICs x 0.004 = 50 MB/s between the nodes.
    "hetero": """
        name: emu-hetero
        nodes:
          - {name: fast, gpus: {kind: a100-80gb, count: 1}, nic: {type: ethernet, bandwidth: 100 Gb/s, count: 1}}
          - {name: slow, gpus: {kind: t4, count: 1}, nic: {type: ethernet, bandwidth: 100 Gb/s, count: 1}}
        emulation: {bandwidth_scale: 0.004}
    """,
}

COMMON = "dtype=fp32,collective.dp=ring,collective.tp=ring"
# (cluster, label, plan). On `hetero` device 0 is the A100, device 1 the T4.
PLANS = [
    ("homo", "DP2", f"dp=2,micro_batch=4,global_batch=16,{COMMON}"),
    ("homo", "TP2", f"tp=2,micro_batch=4,global_batch=16,{COMMON}"),
    ("homo", "PP2 GPipe", f"pp=2,micro_batch=4,global_batch=16,schedule=gpipe,{COMMON}"),
    ("homo", "PP2 1F1B mb2", f"pp=2,micro_batch=2,global_batch=16,schedule=1f1b,{COMMON}"),
    ("hetero", "DP2 even", f"dp=2,micro_batch=4,global_batch=16,{COMMON}"),
    ("hetero", "DP2 shares 3:1", f"dp=2,micro_batch=4,global_batch=16,dp_shares=0.75:0.25,{COMMON}"),
    ("hetero", "PP2 even split", f"pp=2,micro_batch=4,global_batch=16,schedule=1f1b,{COMMON}"),
    ("hetero", "PP2 split 4:2", f"pp=2,micro_batch=4,global_batch=16,schedule=1f1b,layer_split=4:2,{COMMON}"),
]
QUICK = {"DP2", "PP2 GPipe", "DP2 shares 3:1", "PP2 split 4:2"}


# ---------------------------------------------------------------- statistics
def spearman(xs: list[float], ys: list[float]) -> float:
    from scipy.stats import spearmanr

    if len(xs) < 2:
        return float("nan")
    return float(spearmanr(xs, ys).statistic)


def same_order(pred: list[float], real: list[float]) -> bool:
    return sorted(range(len(pred)), key=lambda i: pred[i]) == sorted(range(len(real)), key=lambda i: real[i])


def iqr(xs: list[float]) -> float:
    if len(xs) < 4:
        return max(xs) - min(xs) if xs else 0.0
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


# ---------------------------------------------------------------- profiling
def profile_cluster(path: Path, out: Path, max_size: int) -> Any:
    from plait.commands.profile_cmd import profile

    result, _ = profile(str(path), max_size=max_size, p2p_bytes=2 * 2**20, matmul_sizes=[128, 256, 512],
                        dtypes=["fp32"], slowdown_dtype="fp32", min_time=0.05, out=out)
    return result


def tp_shard(tp: int) -> Any:
    """The runtime's Megatron slicing of tensor rank 0 with no-op collectives (see module docstring)."""
    from plait.runtime.tensor_parallel import (
        TPContext,
        apply_tensor_parallel,
        is_tensor_parallel_layer,
    )

    if tp == 1:
        return None
    ctx = TPContext(group=None, size=tp, rank=0, comm=lambda name, category, fn: None)

    def shard(name: str, module: Any) -> None:
        if is_tensor_parallel_layer(module):
            apply_tensor_parallel(module, ctx, None)

    return shard


def _layer_profile_worker(argv: list[str]) -> int:
    """`--layer-profile-worker RANK`: one emulated device's profiler, kept alive for the whole
    bench (torch imported once), in rank RANK's cgroup. Reads one JSON request per line from
    stdin and answers with one JSON line: {"kind": "layers", "model", "mb", "tp", "repeats",
    "statistic"} -> a `LayerProfile`; {"kind": "flatten", ...} -> `_flatten_cost`;
    {"kind": "gloo", ...} -> `_gloo_sweep` (all profilers join one gloo group)."""
    from plait.cost.layer_profile import profile_layers
    from plait.runtime.cpu_share import join_from_env

    rank = int(argv[0])
    join_from_env(rank)
    for line in sys.stdin:
        req = json.loads(line)
        if req["kind"] == "flatten":
            out: Any = _flatten_cost(req["model"], req["repeats"])
        elif req["kind"] == "gloo":
            out = _gloo_sweep(rank, req)
        else:
            out = profile_layers(req["model"], req["mb"], "fp32", tp=req["tp"], shard=tp_shard(req["tp"]), threads=1,
                                 repeats=req["repeats"], warmup=3, statistic=req["statistic"]).to_dict()
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    return 0


def _flatten_cost(model: str, repeats: int) -> dict[str, float]:
    """Seconds per gradient byte of what the runtime's data-parallel step does around its
    all-reduce besides communicating: flatten the gradients into one buffer and copy them back
    (`plait.runtime.data_parallel`, one 25 MB bucket here)."""
    import torch

    from plait.graph.zoo import load_model
    from plait.runtime.data_parallel import _flat_grads, _scatter_back

    torch.set_num_threads(1)
    params = [p for p in load_model(model).build().parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    times = []
    for i in range(3 + repeats):
        t0 = time.perf_counter()
        _scatter_back(_flat_grads(params), params, "grad")
        if i >= 3:
            times.append(time.perf_counter() - t0)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return {"seconds": statistics.median(times), "bytes": float(nbytes)}


def _gloo_sweep(rank: int, req: dict[str, Any]) -> dict[str, list[list[float]]]:
    """gloo between the profilers, placed as the ranks are (own CPU each, loopback): per size,
    the mean time of a 2-rank all-reduce and of a pipeline exchange (send S and receive S with
    `batch_isend_irecv`, as the runtime's 1F1B steady state), each call made as training makes
    it -- right after a compute segment of ~1.5 ms (a tensor-parallel layer's segment here), both
    ranks starting the segment together. A call then also pays for the ranks not finishing
    their segments together (each rank's speed jitters on a shared machine) and for waking
    gloo's threads after compute; the mean, because a step sums many calls."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{req['store']}", rank=rank, world_size=req["world"])
    torch.set_num_threads(1)
    peer = (rank + 1) % req["world"]
    w = torch.randn(256, 256)

    def segment() -> None:
        for _ in range(req.get("segment_matmuls", 3)):
            w @ w

    out: dict[str, list[list[float]]] = {"all_reduce": [], "exchange": []}
    for size in req["sizes"]:
        x, y = torch.zeros(max(1, size // 4)), torch.zeros(max(1, size // 4))
        for op, fn in (("all_reduce", lambda x=x: dist.all_reduce(x)),
                       ("exchange", lambda x=x, y=y: [w.wait() for w in dist.batch_isend_irecv(
                           [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)])])):
            times = []
            for i in range(3 + req["iters"]):
                dist.barrier()
                segment()
                t0 = time.perf_counter()
                fn()
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            out[op].append([float(x.numel() * 4), statistics.fmean(times)])
    return out


class Profilers:
    """One profiler process per emulated device, each in its rank's cgroup (pinned and weighted
    as that rank will run). A request goes to all of them at once, so the devices are profiled
    side by side, as the ranks compute side by side."""

    def __init__(self, world: int, env: dict[str, str]) -> None:
        import subprocess

        self.procs = [subprocess.Popen([sys.executable, __file__, "--layer-profile-worker", str(r)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                       env={**os.environ, **env}) for r in range(world)]

    def request(self, req: dict[str, Any]) -> list[Any]:
        line = json.dumps(req) + "\n"
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(line)
            proc.stdin.flush()
        out = []
        for proc in self.procs:
            assert proc.stdout is not None
            reply = proc.stdout.readline()
            if not reply:
                raise RuntimeError(f"profiler {proc.args[-1]} exited with {proc.wait()}")
            out.append(json.loads(reply))
        return out

    def __call__(self, model: str, micro_batch: int, tp: int, repeats: int, statistic: str) -> list[Any]:
        from plait.cost.layer_profile import LayerProfile

        return [LayerProfile.from_dict(d) for d in self.request(
            {"kind": "layers", "model": model, "mb": micro_batch, "tp": tp, "repeats": repeats,
             "statistic": statistic})]

    def flatten(self, model: str, repeats: int = 10) -> float:
        """Seconds per byte of the runtime's gradient flatten + copy-back, mean over the devices."""
        res = self.request({"kind": "flatten", "model": model, "repeats": repeats})
        return statistics.fmean(r["seconds"] / r["bytes"] for r in res)

    def gloo(self, store: Path, sizes: list[int], iters: int = 25) -> dict[str, list[list[float]]]:
        """`_gloo_sweep` on every profiler; per size the mean over the ranks."""
        store.unlink(missing_ok=True)
        res = self.request({"kind": "gloo", "store": str(store), "world": len(self.procs), "sizes": sizes,
                            "iters": iters})
        return {op: [[row[0], statistics.fmean(r[op][i][1] for r in res)] for i, row in enumerate(res[0][op])]
                for op in res[0]}

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 -- our own child: end it
                proc.kill()


def total(prof: Any) -> float:
    return prof.forward_s + prof.backward_s


def per_device_cluster(cluster: Any, plan: Any, per_rank: list[Any], slowdown: dict[str, float]
                       ) -> tuple[Any, dict[str, float], list[float]]:
    """The measured cluster with one GPU kind per device, and `layer_time_scale` for it.

    The devices of this machine are not equal even when they emulate the same kind (one CPU
    is at times slowed by work beyond our control), and the profile sees it: device d's
    speed relative to the mean profile is ``total_d / mean total``; its layer-time scale is
    that times its kind's emulated slowdown."""
    import dataclasses

    mean_total = statistics.fmean(total(p) for p in per_rank)
    speed = [1.0] * cluster.num_devices
    for r, prof in enumerate(per_rank):
        speed[plan.device_of(r)] = total(prof) / mean_total
    kinds = dict(cluster.kinds)
    scale: dict[str, float] = {}
    nodes, dev = [], 0
    for node in cluster.nodes:
        gpus = []
        for k in node.gpus:
            name = f"{k}@dev{dev}"
            kinds[name] = dataclasses.replace(cluster.kinds[k], name=name)
            scale[name] = slowdown.get(k, 1.0) * speed[dev]
            gpus.append(name)
            dev += 1
        nodes.append(dataclasses.replace(node, gpus=gpus))
    return dataclasses.replace(cluster, kinds=kinds, nodes=nodes), scale, speed


def mean_profile(profs: list[Any]) -> Any:
    """Per-layer mean of several layer profiles of the same configuration."""
    import copy

    out = copy.deepcopy(profs[0])
    for name in out.times:
        out.times[name] = tuple(statistics.fmean(p.times[name][i] for p in profs) for i in range(2))
        out.spread[name] = tuple(statistics.fmean(p.spread[name][i] for p in profs) for i in range(2))
        out.optimizer[name] = statistics.fmean(p.optimizer[name] for p in profs)
    out.optimizer_total_s = statistics.fmean(p.optimizer_total_s for p in profs)
    return out


@dataclasses.dataclass
class CommFit:
    """gloo between two ranks placed as the runtime places them (loopback, own CPU each), from
    `_gloo_sweep`: a pipeline exchange costs ``t = a + S/B_p2p`` and a 2-rank all-reduce
    ``t = A + S/B_ar`` (least squares on relative residuals with a soft-L1 loss)."""

    exchange_fixed: float  # a, s
    exchange_bandwidth: float  # B_p2p, bytes/s
    allreduce_fixed: float  # A, s
    allreduce_bandwidth: float  # B_ar, bytes/s
    rms_rel: float

    @property
    def per_call(self) -> float:
        """What an all-reduce call costs beyond the ring's two link latencies: the simulator's
        `host_comm_s` (gloo's CPU-side work, whatever the link)."""
        return max(0.0, self.allreduce_fixed - 2 * self.exchange_fixed)


def _fit_line(rows: list[list[float]]) -> tuple[float, float, float]:
    """(fixed s, bytes/s, relative rms) of ``t = fixed + S / rate`` over (S, t) rows."""
    import numpy as np
    from scipy.optimize import least_squares

    S = np.array([r[0] for r in rows], dtype=float)
    t = np.array([r[1] for r in rows], dtype=float)

    def model(x: np.ndarray) -> np.ndarray:
        return x[0] * 1e-6 + S * x[1] * 1e-9  # us and ns/B keep the problem well scaled

    sol = least_squares(lambda x: (model(x) - t) / t, x0=[100.0, 1.0], bounds=([0.0, 1e-6], [np.inf, np.inf]),
                        loss="soft_l1", f_scale=0.2)
    rms = float(np.sqrt(np.mean(((model(sol.x) - t) / t) ** 2)))
    return float(sol.x[0]) * 1e-6, 1e9 / float(sol.x[1]), rms


def fit_gloo(sweep: dict[str, list[list[float]]]) -> CommFit:
    a, bp, r1 = _fit_line(sweep["exchange"])
    A, ba, r2 = _fit_line(sweep["all_reduce"])
    return CommFit(a, bp, A, ba, max(r1, r2))


def sim_cluster(measured: Path, fit: CommFit, out: Path) -> Path:
    """The measured cluster with the pairs inside a node (loopback here) at gloo's measured cost:
    latency = the exchange's fixed cost, bandwidth = the all-reduce's rate (collectives are
    most of these plans' intra-node traffic). Pairs across nodes keep the profile's figures
    (the shaped NIC dominates there)."""
    import yaml

    data = yaml.safe_load(measured.read_text())
    nodes = data.get("nodes", [])
    node_of = [i for i, n in enumerate(nodes) for _ in range(int(n["gpus"]["count"]) if isinstance(n["gpus"], dict)
                                                            else len(n["gpus"]))]
    for ov in data.get("overrides", []):
        a, b = ov["devices"]
        if node_of[a] == node_of[b]:
            ov["bandwidth"] = f"{fit.allreduce_bandwidth:.6g} B/s"
            ov["latency"] = f"{fit.exchange_fixed * 1e6:.6g} us"
    for node in nodes:
        node["intra"]["bandwidth"] = f"{fit.allreduce_bandwidth:.6g} B/s"
        node["intra"]["latency"] = f"{fit.exchange_fixed * 1e6:.6g} us"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def compute_model(fit: CommFit, prof: Any, cluster: Any, plan: Any, flatten_s_per_byte: float) -> Any:
    """The simulator's host/optimizer constants for gloo on CPU ranks with measured layer times:
    `host_comm_s` = gloo's per-call cost (`fit_gloo`); the optimizer from the layer profile's
    AdamW step over all parameters (`optimizer_bytes_per_param` on the fastest kind's measured
    memory bandwidth);
    under data parallelism `step_host_s` = the runtime's gradient flatten + copy-back for one
    stage's gradients (pipeline stages hold about 1/pp of them)."""
    from plait.cost.compute import ComputeModel

    fastest = max(cluster.kinds.values(), key=lambda k: k.flops("fp32"))
    params = sum(prof.params.values())
    opt_bytes = prof.optimizer_total_s * fastest.memory_bandwidth / params if params else 0.0
    step = flatten_s_per_byte * 4 * params / (plan.tp * plan.pp) if plan.dp > 1 else 0.0
    return ComputeModel(host_comm_s=fit.per_call, p2p_host_s=0.0, step_host_s=step, loss_host_s=0.0,
                        batch_host_s=0.0, optimizer_bytes_per_param=opt_bytes, memory_efficiency=1.0,
                        host_fwd_s=0.0, host_bwd_s=0.0, kernel_gpu_s=0.0)


# ---------------------------------------------------------------- predict / measure
def _per_device(timeline: Any) -> dict[str, float]:
    """Mean per-device seconds in forward, backward (+ recompute, optimizer) and communication
    (measured communication includes the wait for the slowest peer)."""
    devices = {e.device for e in timeline.events if e.device is not None} or {None}
    out = {"fwd": 0.0, "bwd": 0.0, "comm": 0.0}
    for e in timeline.events:
        if e.category == "forward":
            out["fwd"] += e.duration
        elif e.category in ("backward", "recompute", "optimizer"):
            out["bwd"] += e.duration
        elif e.category.startswith("comm"):
            out["comm"] += e.duration
    return {k: v / len(devices) for k, v in out.items()}


def predict(graph: Any, cluster: Any, plan: str, **opts: Any) -> tuple[float, dict[str, float], dict[int, float]]:
    """(iteration s, per-device split, per-device compute s) of the simulation; layer granularity so
    that tensor-parallel collectives are tasks of their own, as the measured spans separate them."""
    from plait.sim.api import simulate

    res = simulate(graph, cluster, plan, memory=False, granularity="layer", **opts)
    return float(res.iteration_time_s), _per_device(res.timeline), _compute_work(res.timeline)


def measure(model: str, cluster: str, plan: str, steps: int, env: dict[str, str]) -> dict[str, Any]:
    from plait.runtime.api import run

    res = run(model, cluster, plan, steps=steps, dtype="fp32", env=env)
    # The steps after the first two (warm-up: allocator, gloo connections); median and IQR.
    skip = 2 if len(res.iteration_times) > 3 else 0
    times = res.iteration_times[skip:]
    med = statistics.median(times)
    k = min(range(skip, len(res.iteration_times)), key=lambda i: abs(res.iteration_times[i] - med))
    return {"median": med, "iqr": iqr(times), "min": min(times), "max": max(times), "steps": list(res.iteration_times),
            "split": _per_device(res.step_timeline(k)), "work": _compute_work(res.timeline, res.steps[skip:]),
            "result": res}


def _compute_work(timeline: Any, steps: list[int] | None = None) -> dict[int, float]:
    """Per device: seconds per step in forward and backward compute (communication nested in a
    span -- tensor-parallel all-reduces -- taken out; an emulated slower kind's stretch kept)."""
    out: dict[int, float] = {}
    for e in timeline.events:
        if e.category not in ("forward", "backward", "recompute") or e.device is None:
            continue
        if steps is not None and e.args.get("step") not in steps:
            continue
        out[e.device] = out.get(e.device, 0.0) + e.duration - float(e.args.get("comm_inside", 0.0))
    n = len(steps) if steps else 1
    return {d: v / n for d, v in out.items()}


# ---------------------------------------------------------------- main
CPU_MODES = {
    # rank r on CPU r, with a high weight against other work on the machine: a rank's threads (gloo's
    # receive loop too) stay on its own CPU; unpinned, a receive can wait a whole scheduler slice
    # (~4 ms measured) behind the other rank's compute
    "pinned": {"cpus": None, "cpuset": "pinned", "statistic": "mean"},
    # ranks run anywhere, with a high weight against other work on the machine
    "shared": {"cpus": None, "cpuset": None, "statistic": "mean"},
    # every rank gets 1/world of CPU 0 (CFS quota): ranks take turns on one CPU and never run
    # side by side, so a rank's speed does not depend on whether its peer computes
    "fixed": {"cpus": 0.5, "cpuset": "0", "statistic": "mean"},
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--layer-profile-worker":
        return _layer_profile_worker(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 plans per cluster, 6 steps")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default 8; quick 6)")
    ap.add_argument("--repeats", type=int, default=12, help="layer-profile repetitions")
    ap.add_argument("--rounds", type=int, default=None, help="tries of every plan (default 3; quick 1)")
    ap.add_argument("--keep", help="directory for cluster files, profiles, traces and the JSON (default: a temp dir)")
    ap.add_argument("--max-size", default="16M", help="largest collective size profiled (default 16M)")
    ap.add_argument("--cpu-mode", choices=sorted(CPU_MODES), default="pinned",
                    help="how ranks (and profilers) share this machine's CPUs (see the docstring)")
    ap.add_argument("--no-cgroups", action="store_true", help="do not put ranks and profilers in cpu cgroups")
    ap.add_argument("--default-malloc", action="store_true",
                    help="leave glibc malloc at its defaults for ranks and profilers (see MALLOC_ENV)")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="first wait up to SECONDS for this machine's 1-minute load average to fall below 0.5")
    ap.add_argument("--model", default=MODEL)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from plait.cluster import load_cluster
    from plait.cluster.profile import parse_size
    from plait.plan.ir import Plan
    from plait.runtime.cpu_share import ProcessCgroup, RankCgroups, pinned
    from plait.sim.api import resolve_model

    console = Console(width=180)
    steps = args.steps or (6 if args.quick else 8)
    args.rounds = args.rounds or (1 if args.quick else 3)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="plait-sim-vs-real-"))
    work.mkdir(parents=True, exist_ok=True)
    plans = [p for p in PLANS if not args.quick or p[1] in QUICK]
    t_start = time.time()
    mode = CPU_MODES[args.cpu_mode]
    world = 2

    def rank_groups() -> Any:
        if args.no_cgroups:
            return _null()
        cpuset = pinned(world) if mode["cpuset"] == "pinned" else mode["cpuset"]
        return RankCgroups(world, cpus=mode["cpus"], shares=SHARES, cpuset=cpuset)

    deadline = time.time() + args.wait_quiet
    while os.getloadavg()[0] >= 0.5 and time.time() < deadline:
        time.sleep(5)
    console.print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; model {args.model}; "
                  f"CPU mode {args.cpu_mode}")

    # 1-2. clusters and their profiles (the profile's ranks are children of this process: they share
    # one cgroup holding what the ranks will hold together).
    emulated, raw, measured, slowdowns, clusters = {}, {}, {}, {}, {}
    cluster_group = _null() if args.no_cgroups else ProcessCgroup(
        cpus=None if mode["cpus"] is None else mode["cpus"] * world, shares=SHARES * world,
        cpuset=None if mode["cpuset"] == "pinned" else mode["cpuset"])
    with cluster_group as pc:
        console.print(f"cluster profiles: {pc.describe() if pc.active else 'no cgroup (' + pc.reason + ')'}")
        for name, text in CLUSTERS.items():
            if not any(p[0] == name for p in plans):
                continue
            emulated[name] = work / f"{name}.yaml"
            emulated[name].write_text(textwrap.dedent(text))
            raw[name] = work / f"{name}-measured.yaml"
            t0 = time.time()
            res = profile_cluster(emulated[name], raw[name], parse_size(args.max_size))
            (work / f"{name}-profile.json").write_text(res.to_json())
            pairs = list(res.p2p.values())
            console.print(f"profiled [bold]{name}[/] in {time.time() - t0:.0f} s: p2p "
                          f"{statistics.fmean(v['bandwidth'] for v in pairs) / 1e6:.0f} MB/s, latency "
                          f"{statistics.fmean(v['latency'] for v in pairs) * 1e6:.0f} us; slowdowns {res.slowdowns}")

    # 3-5. per plan: profile its layers (on both emulated devices at once, each in its rank's cgroup)
    # right before and right after the run, measure, predict from the mean of the two profiles.
    # This machine is shared: its speed drifts by tens of percent over minutes, so the profile
    # must bracket the run it predicts (the before/after difference is printed as "drift"), and
    # every plan is tried `--rounds` times (odd rounds in reverse order).
    graphs: dict[int, Any] = {}
    trials: list[dict[str, Any]] = []
    flatten_cost = [0.0]
    fit: list[Any] = [None]

    def trial(cname: str, label: str, spec: str, rnd: int, profilers: Any, env: dict[str, str]) -> dict[str, Any]:
        p = Plan.load(spec)
        tag = f"{cname}-{label.replace(' ', '_')}-r{rnd}"
        row: dict[str, Any] = {"cluster": cname, "plan": label, "spec": spec, "round": rnd}

        def layers(when: str, tp: int, repeats: int) -> list[Any]:
            profs = profilers(args.model, p.micro_batch, tp, repeats, mode["statistic"])
            for r, prof in enumerate(profs):
                (work / f"layers-{tag}-{when}-rank{r}.json").write_text(json.dumps(prof.to_dict()))
            return profs

        before = layers("before", p.tp, args.repeats)
        # The optimizer figure needs whole parameters: under tensor parallelism profile tp=1 too.
        base_prof = mean_profile(before if p.tp == 1 else layers("tp1", 1, 3))
        try:
            m = measure(args.model, str(emulated[cname]), spec, steps, env)
            m.pop("result").timeline.save_chrome_trace(work / f"{tag}.trace.json")
            row.update({"measured_s": m["median"], "iqr_s": m["iqr"], "steps_s": [round(t, 5) for t in m["steps"]],
                        "real": m["split"], "real_work": m["work"]})
        except Exception as exc:  # noqa: BLE001 -- a bench reports what failed and goes on
            row.update({"measured_s": float("nan"), "iqr_s": 0.0, "steps_s": [], "real": {}, "real_work": {}})
            console.print(f"[red]run failed[/] for {cname} {label}: {type(exc).__name__}: {exc}")
        after = layers("after", p.tp, args.repeats)
        per_rank = [mean_profile([b, a]) for b, a in zip(before, after)]
        prof = mean_profile(per_rank)
        totals = [statistics.fmean(total(x) for x in before), statistics.fmean(total(x) for x in after)]
        row["profile_drift"] = (totals[1] - totals[0]) / statistics.fmean(totals)
        sim_cl, scale, speed = per_device_cluster(clusters[cname], p, per_rank, slowdowns[cname])
        row["device_speed"] = speed
        if p.micro_batch not in graphs:
            graphs[p.micro_batch] = resolve_model(args.model, p)
        graph = graphs[p.micro_batch]
        cm = compute_model(fit[0], base_prof, clusters[cname], p, flatten_cost[0])
        nan = float("nan")
        try:
            row["predicted_s"], row["sim"], sim_work = predict(graph, sim_cl, spec, layer_times=prof.times,
                                                               layer_time_scale=scale, compute=cm)
            # Replay: the same simulation at the compute speed each device had during the run (its
            # measured forward/backward seconds over the simulated ones) -- what is left is the
            # simulator's schedule, communication and overheads, without the machine's drift.
            replay = dict(scale)
            for d, kind in enumerate(k for node in sim_cl.nodes for k in node.gpus):
                # A tensor-parallel group is simulated on its first device: its peers do the same work.
                sw = sim_work.get(d) or (statistics.fmean(sim_work.values()) if sim_work else 0.0)
                if sw > 0 and row["real_work"].get(d):
                    replay[kind] = scale[kind] * row["real_work"][d] / sw
            row["replay_s"], _, _ = predict(graph, sim_cl, spec, layer_times=prof.times, layer_time_scale=replay,
                                            compute=cm)
            row["baseline_s"], _, _ = predict(graph, str(measured[cname]), spec)
        except Exception as exc:  # noqa: BLE001
            row.update({"predicted_s": nan, "replay_s": nan, "baseline_s": nan, "sim": {}})
            console.print(f"[red]simulate failed[/] for {cname} {label}: {type(exc).__name__}: {exc}")
        real = row["measured_s"]
        for key in ("predicted", "replay", "baseline"):
            row[f"{key}_error"] = (row[f"{key}_s"] - real) / real if real == real and real > 0 else nan
        console.print(f"  r{rnd} {cname:6s} {label:15s} predicted {row['predicted_s'] * 1e3:6.1f} ms, measured "
                      f"{real * 1e3:6.1f} ms (IQR {row['iqr_s'] * 1e3:4.1f}): {row['predicted_error'] * 100:+5.1f} %; "
                      f"replay {row['replay_error'] * 100:+5.1f} %; profile {prof.forward_s * 1e3:.1f}+"
                      f"{prof.backward_s * 1e3:.1f} ms/mb, drift {row['profile_drift'] * 100:+.0f} %, devices "
                      f"{'/'.join(f'{x:.2f}' for x in speed)}")
        return row

    with rank_groups() as groups:
        console.print(f"layer profiles and ranks: {groups.describe() if groups.active else 'no cgroups'}; "
                      f"malloc keeps freed memory: {not args.default_malloc}")
        env = {**groups.env(), **({} if args.default_malloc else MALLOC_ENV)}
        profilers = Profilers(world, env)
        try:
            flatten_cost[0] = profilers.flatten(args.model)
            sweep = profilers.gloo(work / "gloo.store", [4**k * 1024 for k in range(8)])
            fit[0] = fit_gloo(sweep)
            f = fit[0]
            console.print(f"runtime gradient flatten + copy-back: {flatten_cost[0] * 1e9:.2f} ns per byte; gloo, "
                          f"placed as the ranks: exchange {f.exchange_fixed * 1e6:.0f} us + S / "
                          f"{f.exchange_bandwidth / 1e6:.0f} MB/s, all-reduce {f.allreduce_fixed * 1e6:.0f} us + S / "
                          f"{f.allreduce_bandwidth / 1e6:.0f} MB/s (fit rms {f.rms_rel * 100:.0f} %) -> "
                          f"{f.per_call * 1e6:.0f} us per collective call")
            for name in raw:
                measured[name] = sim_cluster(raw[name], f, work / f"{name}-sim.yaml")
                clusters[name] = load_cluster(str(measured[name]))
                emu = clusters[name].emulation
                slowdowns[name] = dict(emu.slowdown) if emu is not None and emu.slowdown else {}

            for rnd in range(args.rounds):
                for cname, label, spec in (plans if rnd % 2 == 0 else plans[::-1]):
                    trials.append(trial(cname, label, spec, rnd, profilers, env))
        finally:
            profilers.close()

    # Per plan: the round with the median error (each round pairs a run with the profiles that
    # bracket it; the median is robust to a round that a burst of other work on the machine spoiled).
    rows = []
    for cname, label, spec in plans:
        mine = [t for t in trials if t["plan"] == label and t["cluster"] == cname]
        ok = sorted((t for t in mine if t["measured_s"] == t["measured_s"] and t["predicted_s"] == t["predicted_s"]),
                    key=lambda t: t["predicted_error"])
        nan = float("nan")
        mid = ok[(len(ok) - 1) // 2] if ok else {}
        row = {"cluster": cname, "plan": label, "spec": spec, "rounds": len(ok), "round": mid.get("round")}
        for key in ("predicted_s", "measured_s", "replay_s", "baseline_s", "predicted_error", "replay_error",
                    "baseline_error", "iqr_s"):
            row[key] = mid.get(key, nan)
        row["trial_errors"] = [t["predicted_error"] for t in sorted(ok, key=lambda t: t["round"])]
        row["trial_replay_errors"] = [t["replay_error"] for t in sorted(ok, key=lambda t: t["round"])]
        row["measured_spread"] = ((max(t["measured_s"] for t in ok) - min(t["measured_s"] for t in ok))
                                  / statistics.median(t["measured_s"] for t in ok)) if ok else nan
        row["sim"], row["real"] = mid.get("sim", {}), mid.get("real", {})
        rows.append(row)

    table = Table(title=f"sim vs real: {args.model}, fp32, {world} CPU ranks ({args.cpu_mode}), {steps} steps per run "
                        f"(median of steps 3..{steps}); per plan the round with the median error of {args.rounds}")
    for col in ("cluster", "plan", "predicted ms", "measured ms (IQR)", "error", "errors per round",
                "measured spread", "replay error", "sim fwd/bwd+opt/comm ms", "real fwd/bwd+opt/comm ms",
                "baseline (GPU model)"):
        table.add_column(col, justify="left" if col in ("cluster", "plan") else "right")
    for r in rows:
        ok = abs(r["predicted_error"]) <= 0.10
        table.add_row(r["cluster"], r["plan"], f"{r['predicted_s'] * 1e3:.1f}",
                      f"{r['measured_s'] * 1e3:.1f} ({r['iqr_s'] * 1e3:.1f})",
                      f"[{'green' if ok else 'red'}]{r['predicted_error'] * 100:+.1f} %[/]",
                      " ".join(f"{e * 100:+.0f}" for e in r["trial_errors"]),
                      f"{r['measured_spread'] * 100:.0f} %", f"{r['replay_error'] * 100:+.1f} %",
                      "/".join(f"{r['sim'].get(k, float('nan')) * 1e3:.1f}" for k in ("fwd", "bwd", "comm")),
                      "/".join(f"{r['real'].get(k, float('nan')) * 1e3:.1f}" for k in ("fwd", "bwd", "comm")),
                      f"{r['baseline_s'] * 1e3:.0f} ms ({r['baseline_error'] * 100:+.0f} %)")
    console.print(table)
    summary: dict[str, Any] = {}
    for scope in [*CLUSTERS, "all"]:
        sub = [r for r in rows if (scope == "all" or r["cluster"] == scope) and r["predicted_error"] == r["predicted_error"]]
        if len(sub) < 2:
            continue
        pred, real = [r["predicted_s"] for r in sub], [r["measured_s"] for r in sub]
        summary[scope] = {"mape": statistics.fmean(abs(r["predicted_error"]) for r in sub),
                          "max_abs_error": max(abs(r["predicted_error"]) for r in sub),
                          "replay_mape": statistics.fmean(abs(r["replay_error"]) for r in sub),
                          "spearman": spearman(pred, real), "same_ranking": same_order(pred, real),
                          "measured_order": [sub[i]["plan"] for i in sorted(range(len(sub)), key=lambda i: real[i])],
                          "predicted_order": [sub[i]["plan"] for i in sorted(range(len(sub)), key=lambda i: pred[i])]}
        s = summary[scope]
        console.print(f"{scope}: MAPE {s['mape'] * 100:.1f} %, worst {s['max_abs_error'] * 100:.1f} %, replay MAPE "
                      f"{s['replay_mape'] * 100:.1f} %, Spearman {s['spearman']:.2f}, same ranking: {s['same_ranking']}"
                      + ("" if s["same_ranking"] else f" (measured {s['measured_order']}, predicted {s['predicted_order']})"))
    all_ok = bool(rows) and all(abs(r["predicted_error"]) <= 0.10 for r in rows) and \
        all(s["same_ranking"] for s in summary.values())
    console.print(f"target (<= 10 % per plan, same ranking): {'met' if all_ok else 'NOT met'}; "
                  f"total {time.time() - t_start:.0f} s; load average now {os.getloadavg()[0]:.2f}; files in {work}")
    (work / "sim_vs_real.json").write_text(json.dumps(
        {"model": args.model, "steps": steps, "rounds": args.rounds, "cpu_mode": args.cpu_mode, "rows": rows,
         "trials": trials, "summary": summary, "gloo": dataclasses.asdict(fit[0]) if fit[0] else None},
        indent=1, default=str))
    return 0


class _null:
    """A do-nothing context manager standing in for the cgroups (`--no-cgroups`)."""

    active = False
    reason = "disabled (--no-cgroups)"

    def env(self) -> dict[str, str]:
        return {}

    def describe(self) -> str:
        return self.reason

    def __enter__(self) -> _null:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
