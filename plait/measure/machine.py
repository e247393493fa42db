"""Predict plans on *this* machine's emulated cluster, and measure them next to the prediction.

A plan for an emulated cluster is predicted for the GPUs the cluster file describes; its
`plait run` measures CPU processes. To compare the two, the prediction must be for the
machine that runs: this is what profiling simulators do (dPRO, Hu et al. 2022 §4; Echo;
Pipette's profiler) -- measured layer times and measured links, simulated plan:

1. **links**: `plait profile` measures the emulated cluster inside its network namespaces
   (per-pair bandwidth/latency, collective sweeps, each kind's emulated slowdown) into a
   measured cluster YAML;
2. **gloo's own cost**: persistent profiler processes, one per rank of the plan (not per device
   of the cluster: a plan on fewer ranks shares this machine's CPUs with no other), each in its rank's
   cpu cgroup (`plait.runtime.cpu_share`: pinned to a CPU, high `cpu.shares`), time gloo
   all-reduces and pipeline exchanges made as training makes them (after a compute segment)
   and fit ``t = a + S/B`` to both (`CommFit`): the exchange's ``a`` and the all-reduce's
   ``B`` become the intra-node link, what an all-reduce costs beyond its ring latencies
   becomes the simulator's per-call `host_comm_s`; the runtime's gradient flatten/copy-back
   around the data-parallel all-reduce is timed too (`step_host_s`); a plan of one rank calls
   no collective and gets no gloo cost;
3. **layers**: per plan, the same profilers time every layer's forward and backward at the
   plan's micro-batch size and tensor-parallel slicing (`plait.measure.layer_profile`), side
   by side as the ranks compute side by side;
4. **simulate**: `plait.sim.api.simulate` on the measured cluster with those layer times,
   each device's scaled by its kind's emulated slowdown and by its own measured speed (two
   CPUs of one VM are not equally fast at all times).

`LocalMachine.measure_and_predict` profiles the layers right before and right after the run
(this machine's speed drifts by tens of percent over minutes; the difference is reported
as `drift`) and predicts from their mean. Ranks and profilers run with glibc malloc keeping
freed memory (`MALLOC_ENV`), as a GPU's caching allocator does: fresh memory costs page
faults that are expensive in a VM and hit pipeline stages (which keep activations alive)
far more than a layer timed alone (measured 8.4 vs 6.4 ms per layer; equal with it).

Accuracy on this 2-vCPU machine: `bench/sim_vs_real.py`. The prediction is meaningful with
at most one rank of the plan per CPU; with more, ranks time-share CPUs (`LocalMachine.notes`
says so).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait.errors import PlaitError

if TYPE_CHECKING:
    from plait.cluster.spec import Cluster, ClusterSource
    from plait.cost.compute import ComputeModel
    from plait.ir.plan import Plan, PlanSource

log = logging.getLogger("plait.measure.machine")

MiB = 2**20
SHARES = 8192  # cpu.shares of each rank's cgroup (8x a plain process)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(4 << 30),
              "MALLOC_TOP_PAD_": str(512 << 20)}


class MachineError(PlaitError, RuntimeError):
    """A profiler of this machine failed or the emulated cluster cannot be predicted."""


# ---------------------------------------------------------------- profilers
class Profilers:
    """One `plait.measure.machine_profiler` process per rank, each joining its rank's cgroups
    (through `env`). A request goes to all of them at once, so the devices are profiled side by
    side, as the ranks compute side by side."""

    def __init__(self, world: int, env: dict[str, str], timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self.procs = [subprocess.Popen([sys.executable, "-m", "plait.measure.machine_profiler", str(r)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                       env={**os.environ, **env}) for r in range(world)]

    def request(self, req: dict[str, Any]) -> list[Any]:
        line = json.dumps(req) + "\n"
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(line)
            proc.stdin.flush()
        out = []
        for r, proc in enumerate(self.procs):
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
            if not ready:
                raise MachineError(f"profiler of rank {r}: no answer to a {req['kind']!r} request within "
                                   f"{self.timeout_s:.0f} s")
            reply = proc.stdout.readline()
            if not reply:
                raise MachineError(f"profiler of rank {r} exited with status {proc.wait()}")
            data = json.loads(reply)
            if "error" in data:
                raise MachineError(f"profiler of rank {r}, {req['kind']!r} request: {data['error']}")
            out.append(data["ok"])
        return out

    def layers(self, model: str, micro_batch: int, tp: int, repeats: int, statistic: str = "mean") -> list[Any]:
        from plait.measure.layer_profile import LayerProfile

        return [LayerProfile.from_dict(d) for d in self.request(
            {"kind": "layers", "model": model, "mb": micro_batch, "tp": tp, "repeats": repeats,
             "statistic": statistic})]

    def flatten(self, model: str, repeats: int = 10) -> float:
        """Seconds per byte of the runtime's gradient flatten + copy-back, mean over the devices."""
        res = self.request({"kind": "flatten", "model": model, "repeats": repeats})
        return statistics.fmean(r["seconds"] / r["bytes"] for r in res)

    def gloo(self, store: Path, sizes: list[int], iters: int = 80) -> dict[str, list[list[float]]]:
        """`machine_profiler.gloo_sweep` on every profiler; per size the mean over the ranks."""
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
            except subprocess.TimeoutExpired:  # a loaded machine: kill it, and reap it, so none is left
                proc.kill()
                proc.wait()


# ---------------------------------------------------------------- fits and derived clusters
def total(prof: Any) -> float:
    return prof.forward_s + prof.backward_s


def mean_profile(profs: list[Any]) -> Any:
    """Per-layer mean of several layer profiles of the same configuration."""
    out = copy.deepcopy(profs[0])
    for name in out.times:
        out.times[name] = tuple(statistics.fmean(p.times[name][i] for p in profs) for i in range(2))
        out.spread[name] = tuple(statistics.fmean(p.spread[name][i] for p in profs) for i in range(2))
        out.optimizer[name] = statistics.fmean(p.optimizer[name] for p in profs)
    out.optimizer_total_s = statistics.fmean(p.optimizer_total_s for p in profs)
    return out


@dataclasses.dataclass
class CommFit:
    """gloo between ranks placed as the runtime places them (loopback, own CPU each), from
    `gloo_sweep`: a pipeline exchange costs ``t = a + S/B_p2p`` and an all-reduce over `world`
    ranks ``t = A + S/B_ar`` (least squares on relative residuals, soft-L1 loss)."""

    exchange_fixed: float  # a, s
    exchange_bandwidth: float  # B_p2p, bytes/s
    allreduce_fixed: float  # A, s
    allreduce_bandwidth: float  # B_ar, bytes/s
    rms_rel: float
    world: int = 2

    @property
    def link_latency(self) -> float:
        """The links' latency in the simulated cluster: the exchange's fixed cost, but no more than
        an all-reduce's fixed cost shared by its ring's 2(world-1) steps -- gloo's all-reduce can
        cost less than 2(world-1) exchanges (measured 0.69 ms against 2 x 1.6 ms on this machine,
        quiet), and a ring of whole exchange latencies priced each tensor-parallel all-reduce of
        sim_vs_real's TP2 at 3.3 ms where the run's took 0.7 ms. What an exchange costs beyond it
        is `p2p_extra`."""
        return min(self.exchange_fixed, self.allreduce_fixed / (2 * max(1, self.world - 1)))

    @property
    def p2p_extra(self) -> float:
        """What a pipeline exchange costs beyond `link_latency`: the simulator's `p2p_host_s`."""
        return self.exchange_fixed - self.link_latency

    @property
    def per_call(self) -> float:
        """What an all-reduce call costs beyond its ring's 2(world-1) link latencies: the
        simulator's `host_comm_s` (gloo's CPU-side work, whatever the link)."""
        return max(0.0, self.allreduce_fixed - 2 * max(1, self.world - 1) * self.link_latency)


def fit_line(rows: list[list[float]]) -> tuple[float, float, float]:
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


def fit_gloo(sweep: dict[str, list[list[float]]], world: int = 2) -> CommFit:
    a, bp, r1 = fit_line(sweep["exchange"])
    A, ba, r2 = fit_line(sweep["all_reduce"])
    return CommFit(a, bp, A, ba, max(r1, r2), world)


def sim_cluster_yaml(measured: Path, fit: CommFit | None, out: Path) -> Path:
    """The measured cluster with the pairs inside a node (loopback here) at gloo's measured cost:
    latency = `CommFit.link_latency` (the exchange's fixed cost, or less where gloo's all-reduce
    costs less than its ring of exchanges; a pipeline exchange pays the rest as `p2p_host_s`,
    `compute_model`), bandwidth = the all-reduce's rate (collectives are
    most intra-node traffic of these plans). Pairs across nodes keep the profile's bandwidth (the
    shaped NIC dominates there) and its latency, but never less than that link latency:
    that is gloo's own per-message work, which a message between nodes pays as well (the
    profile's tight ping-pong loop measures 80-100 us where a message sent as training sends it,
    after a compute segment, costs 0.6-1.2 ms; this machine's tc emulates no wire latency).
    Collectives of many calls per step -- ZeRO-3's per-layer gathers -- pay it in every ring
    step. The profile's busbw tables are dropped: they were measured in a tight loop, and this
    calibration (calls after a compute segment, as training makes them) replaces them -- one
    source for collective times, never both.

    `fit` None (a plan of one rank: no gloo call to fit) keeps the links as profiled; the plan
    sends nothing over them."""
    import yaml

    from plait.cluster.units import parse_duration

    data = yaml.safe_load(measured.read_text())
    data.pop("collectives", None)
    if fit is None:
        out.write_text(yaml.safe_dump(data, sort_keys=False))
        return out

    def floor(latency: Any) -> str:
        return f"{max(parse_duration(latency), fit.link_latency) * 1e6:.6g} us"

    nodes = data.get("nodes", [])
    node_of = [i for i, n in enumerate(nodes) for _ in range(int(n["gpus"]["count"]) if isinstance(n["gpus"], dict)
                                                            else len(n["gpus"]))]
    for ov in data.get("overrides", []):
        a, b = ov["devices"]
        if node_of[a] == node_of[b]:
            ov["bandwidth"] = f"{fit.allreduce_bandwidth:.6g} B/s"
            ov["latency"] = f"{fit.link_latency * 1e6:.6g} us"
        elif "latency" in ov:
            ov["latency"] = floor(ov["latency"])
    for node in nodes:
        node["intra"]["bandwidth"] = f"{fit.allreduce_bandwidth:.6g} B/s"
        node["intra"]["latency"] = f"{fit.link_latency * 1e6:.6g} us"
        if isinstance(node.get("nic"), dict) and "latency" in node["nic"]:
            node["nic"]["latency"] = floor(node["nic"]["latency"])
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def per_device_cluster(cluster: Cluster, plan: Plan, per_rank: list[Any], slowdown: dict[str, float]
                       ) -> tuple[Cluster, dict[str, float], list[float]]:
    """The measured cluster with one GPU kind per device, and the `layer_time_scale` for it.

    Devices of this machine are not equal even when they emulate the same kind (a CPU is at
    times slowed by work beyond our control) and the profile sees it: device d's speed
    relative to the mean profile is ``total_d / mean total``; its layer-time scale is that
    times its kind's emulated slowdown.

    `per_rank`: rank r's profile at r, one per rank of the plan. A plan on fewer devices than the
    cluster (a 2-stage graph plan on 4 GPUs) leaves the others at speed 1: it puts no work on them."""
    if len(per_rank) != plan.world_size:
        raise MachineError(f"{len(per_rank)} layer profiles for a plan of {plan.world_size} ranks ({plan})")
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


def compute_model(fit: CommFit | None, prof: Any, cluster: Cluster, plan: Plan, flatten_s_per_byte: float
                  ) -> ComputeModel:
    """The simulator's host/optimizer constants for gloo on CPU ranks with measured layer times:
    `host_comm_s` = gloo's per-call cost; gloo's reduce-scatter is an all-reduce of the whole
    input (`ProcessGroupGloo::reduce_scatter_tensor`: clone, all-reduce, copy this rank's slice;
    measured 5.6-7.3 ms for the 793 KB of a layer where its all-gather takes 2.2-4.6 ms); the optimizer from the profile's AdamW step over all
    parameters (as bytes per parameter at the fastest kind's measured memory bandwidth); under
    data parallelism `step_host_s` = the runtime's gradient flatten + copy-back for one stage's
    gradients (a pipeline stage holds about 1/pp of them, a tensor rank 1/tp); the embedding and
    LM head replicated on every tensor rank, as the runtime runs them (`vocab_parallel=False`).
    `fit` None: one rank, no gloo call."""
    from plait.cost.compute import ComputeModel

    fastest = max(cluster.kinds.values(), key=lambda k: k.flops("fp32"))
    params = sum(prof.params.values())
    opt_bytes = prof.optimizer_total_s * fastest.memory_bandwidth / params if params else 0.0
    step = flatten_s_per_byte * 4 * params / (plan.tp * plan.pp) if plan.dp > 1 else 0.0
    return ComputeModel(host_comm_s=fit.per_call if fit is not None else 0.0,
                        p2p_host_s=fit.p2p_extra if fit is not None else 0.0, step_host_s=step, loss_host_s=0.0,
                        batch_host_s=0.0, optimizer_bytes_per_param=opt_bytes, memory_efficiency=1.0,
                        host_fwd_s=0.0, host_bwd_s=0.0, kernel_gpu_s=0.0, reduce_scatter_algorithm="allreduce",
                        vocab_parallel=False)


# ---------------------------------------------------------------- results
@dataclasses.dataclass
class MachinePrediction:
    """The simulated iteration of `plan` on this machine."""

    plan: Plan
    iteration_s: float
    result: Any  # plait.sim.api.SimResult
    profile: Any  # mean LayerProfile over the ranks
    device_speed: list[float]  # each device's measured speed relative to the mean (1 = average)
    layer_time_scale: dict[str, float]
    compute: Any  # the ComputeModel used
    cluster: Cluster  # the measured cluster simulated, one GPU kind per device (`per_device_cluster`)
    graph: Any  # the OpGraph simulated


@dataclasses.dataclass
class MachineRun:
    """`measure_and_predict`: one run of `plan` with the prediction from the profiles that
    bracket it."""

    prediction: MachinePrediction
    run: Any  # plait.runtime.api.RunResult
    measured_s: float  # median over the steps after the warm-up ones
    warmup_steps: int
    drift: float  # (after - before) / mean of the layer profiles' totals

    @property
    def predicted_s(self) -> float:
        return self.prediction.iteration_s

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s

    def summary(self) -> dict[str, Any]:
        """The figures the CLI prints and puts in its JSON."""
        return {"predicted_iteration_s": self.predicted_s, "measured_iteration_s": self.measured_s,
                "error": self.error, "warmup_steps": self.warmup_steps, "profile_drift": self.drift,
                "device_speed": self.prediction.device_speed}


# ---------------------------------------------------------------- the machine
class LocalMachine:
    """This machine running an emulated cluster: calibrated on entry, then predicts and measures
    plans (a context manager; profilers, cgroups and namespaces are gone on exit).

        with LocalMachine("emulated-mixed:gpus_per_node=1", "gpt:layers=4,hidden=128", ranks=2) as m:
            r = m.measure_and_predict("pp=2,micro_batch=4,global_batch=16", steps=6)
            print(r.predicted_s, r.measured_s, r.error)

    Calibration has two parts. The cluster's links and each kind's emulated slowdown are profiled
    once, over all its devices. The rest is for the ranks a plan runs, which share this machine's
    CPUs as its run does: one profiler process per rank in that rank's CPU share, gloo's fit over
    those ranks and the gradient flatten. `ranks` is how many ranks that is at entry (default: one
    per cluster device; give the plan's `world_size`); a plan of another rank count calibrates
    that part again for its own ranks before it is profiled, so a plan on fewer ranks than the
    cluster has devices (a one-rank plan on 4 GPUs) is never profiled beside ranks it does not run.

    `pin` puts rank r on CPU r mod CPUs with `cpu.shares` `shares` (root and cgroup v1 only;
    otherwise the ranks run unpinned and `notes` says why); `keep_freed_memory` sets
    `MALLOC_ENV` for ranks and profilers; `emulate_dtype` is the dtype whose datasheet FLOP/s
    ratios slow the slower kinds down (the ranks compute fp32 either way: emulating an fp16
    plan on A100 + V100 takes the fp16 ratio, 2.5, not the fp32 one, 1.24); `repeats` are the
    layer profile's repetitions;
    `max_size` the largest collective the cluster profile times; `say` receives progress lines.
    """

    def __init__(self, cluster: ClusterSource, model: str, *, ranks: int | None = None,
                 workdir: str | Path | None = None, repeats: int = 12,
                 max_size: int = 16 * MiB, pin: bool = True, shares: int = SHARES, cgroups: bool = True,
                 keep_freed_memory: bool = True, emulate_dtype: str = "fp32",
                 say: Callable[[str], None] | None = None) -> None:
        from plait.cluster import load_cluster

        self.cluster_arg = str(cluster) if isinstance(cluster, Path) else cluster
        self.cluster = load_cluster(self.cluster_arg)
        if self.cluster.emulation is None or not self.cluster.emulation.enabled:
            raise MachineError(f"cluster {self.cluster.name}: predicting this machine needs an emulated cluster "
                               "(an 'emulation:' section); a real cluster is predicted by `plait simulate`")
        self.model = model
        self.world = self.cluster.num_devices if ranks is None else ranks  # the ranks calibrated
        self._check_ranks(self.world)
        self.repeats, self.max_size, self.pin, self.shares = repeats, max_size, pin, shares
        self.cgroups, self.keep_freed_memory = cgroups, keep_freed_memory
        if emulate_dtype not in ("fp32", "tf32", "bf16", "fp16"):
            raise MachineError(f"emulate_dtype: must be fp32, tf32, bf16 or fp16, got {emulate_dtype!r}")
        self.emulate_dtype = emulate_dtype
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="plait-machine-"))
        self._own_workdir = not workdir  # a temporary folder: removed on a clean exit
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.say = say or (lambda text: log.info("%s", text))
        self.notes: list[str] = []
        self._graphs: dict[int, Any] = {}
        self._stack: ExitStack | None = None
        self._ranks_stack: ExitStack | None = None  # what the ranks' calibration started

    def _check_ranks(self, ranks: int) -> None:
        if not 1 <= ranks <= self.cluster.num_devices:
            raise MachineError(f"ranks: a plan on {self.cluster.name} runs 1 to {self.cluster.num_devices} ranks, "
                               f"got {ranks}")

    # ---- calibration
    def __enter__(self) -> LocalMachine:
        self._stack = ExitStack()
        try:
            self._profile_cluster()
            self._stack.callback(self._close_ranks)
            self._calibrate_ranks(self.world)
        except BaseException:
            self._stack.close()
            raise
        return self

    def _profile_cluster(self) -> None:
        """`plait profile` of the emulated cluster, all its devices: links and kinds' slowdowns."""
        from plait.measure.cluster_profile import profile
        from plait.runtime.cpu_share import ProcessCgroup

        t0 = time.perf_counter()
        self._measured = self.workdir / "measured.yaml"
        # The cluster profile's ranks are children of this process: they share one cgroup
        # holding what the devices' ranks would hold together.
        devices = self.cluster.num_devices
        group = ProcessCgroup(shares=self.shares * devices) if self.cgroups else None
        with group if group is not None else ExitStack():
            res, _ = profile(self.cluster_arg, max_size=self.max_size, p2p_bytes=2 * MiB,
                             matmul_sizes=[128, 256, 512], dtypes=["fp32"], slowdown_dtype=self.emulate_dtype,
                             min_time=0.05, out=self._measured)
        self.profile_result = res
        (self.workdir / "profile.json").write_text(res.to_json())
        pairs = list(res.p2p.values())
        if pairs:
            self.say(f"profiled {self.cluster.name} in {time.perf_counter() - t0:.0f} s: p2p "
                     f"{statistics.fmean(v['bandwidth'] for v in pairs) / 1e6:.0f} MB/s, latency "
                     f"{statistics.fmean(v['latency'] for v in pairs) * 1e6:.0f} us; slowdowns "
                     f"{', '.join(f'{s:.2f}' for s in res.slowdowns)}")

    def _calibrate_ranks(self, world: int) -> None:
        """What depends on how many ranks share this machine's CPUs, for `world` ranks: their CPU
        shares (rank r pinned to CPU r mod CPUs), one profiler per rank, the gradient flatten and
        gloo's fit over them (none for one rank: it calls no collective), and the simulated cluster
        with that fit. Replaces an earlier calibration for another count."""
        from plait.cluster import load_cluster
        from plait.runtime.cpu_share import RankCgroups, pinned

        self._close_ranks()
        self.world = world
        self.notes = []
        cpus = os.cpu_count() or 1
        if world > cpus:
            self.notes.append(f"{world} ranks on {cpus} CPUs: ranks time-share CPUs, which the prediction "
                              "models only as slower layers (profiled side by side); expect a larger error")
        stack = self._ranks_stack = ExitStack()
        self.groups = None
        if self.cgroups:
            self.groups = stack.enter_context(RankCgroups(world, shares=self.shares,
                                                          cpuset=pinned(world) if self.pin else None))
            if not self.groups.active:
                self.notes.append(f"ranks not pinned: {self.groups.reason}")
        self.env = {**(self.groups.env() if self.groups is not None else {}),
                    **(MALLOC_ENV if self.keep_freed_memory else {})}
        self.profilers = Profilers(world, self.env)
        stack.callback(self.profilers.close)
        self.flatten_s_per_byte = self.profilers.flatten(self.model)
        self.comm = fit_gloo(self.profilers.gloo(self.workdir / "gloo.store", [4**k * 1024 for k in range(8)]),
                             world) if world > 1 else None
        self._say_calibration()
        # sim.yaml: the simulated cluster of the ranks calibrated now (bench/sim_vs_real.py reads it)
        self.sim_cluster = load_cluster(str(sim_cluster_yaml(self._measured, self.comm, self.workdir / "sim.yaml")))
        emu = self.sim_cluster.emulation
        self.slowdown = dict(emu.slowdown) if emu is not None and emu.slowdown else {}

    def _say_calibration(self) -> None:
        f, flatten = self.comm, f"gradient flatten + copy-back {self.flatten_s_per_byte * 1e9:.2f} ns/B"
        if f is None:
            self.say(f"one rank: no gloo call to calibrate; {flatten}")
            return
        self.say(f"gloo as the {self.world} ranks run it: exchange {f.exchange_fixed * 1e6:.0f} us + S / "
                 f"{f.exchange_bandwidth / 1e6:.0f} MB/s, all-reduce {f.allreduce_fixed * 1e6:.0f} us + S / "
                 f"{f.allreduce_bandwidth / 1e6:.0f} MB/s -> {f.per_call * 1e6:.0f} us per collective call; "
                 f"{flatten}")

    def _close_ranks(self) -> None:
        if self._ranks_stack is not None:
            self._ranks_stack.close()
            self._ranks_stack = None

    def __exit__(self, *exc: Any) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        if self._own_workdir and exc[0] is None:  # kept after a failure: its calibration files are evidence
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _require(self) -> None:
        if self._stack is None:
            raise MachineError("LocalMachine: use it in a `with` block (it calibrates on entry)")

    # ---- predict and measure
    @staticmethod
    def _fp32(plan: PlanSource) -> Plan:
        from plait.ir.plan import Plan

        p = Plan.load(plan)
        return p if p.dtype == "fp32" else dataclasses.replace(p, dtype="fp32")

    def _for_ranks_of(self, plan: Plan) -> None:
        """Calibrate for `plan`'s ranks when the machine is calibrated for another count: its layers
        are then profiled side by side by as many profilers as it runs ranks, not by the cluster's."""
        if plan.world_size != self.world:
            self._check_ranks(plan.world_size)
            self.say(f"calibrating for the plan's {plan.world_size} ranks (was {self.world})")
            self._calibrate_ranks(plan.world_size)

    def layer_profiles(self, plan: PlanSource, repeats: int | None = None) -> list[Any]:
        """Per rank of `plan` (rank r's at r), the layer profile at its micro-batch and tensor-parallel
        slicing: profiler r runs in rank r's CPU share, beside the plan's other ranks' profilers only."""
        self._require()
        p = self._fp32(plan)
        self._for_ranks_of(p)
        return self.profilers.layers(self.model, p.micro_batch, p.tp, repeats or self.repeats)

    def predict(self, plan: PlanSource, profiles: list[Any] | None = None) -> MachinePrediction:
        """Simulate `plan` (in fp32, as CPU ranks run it) from per-rank layer profiles (taken now
        when not given)."""
        from plait.graph.resolve import resolve_model
        from plait.sim.api import simulate

        self._require()
        p = self._fp32(plan)
        per_rank = profiles or self.layer_profiles(p)
        self._for_ranks_of(p)  # profiles given: gloo's fit and the flatten must still be of its ranks
        prof = mean_profile(per_rank)
        # The optimizer figure needs whole parameters: under tensor parallelism profile tp=1 too.
        base = prof if p.tp == 1 else mean_profile(self.profilers.layers(self.model, p.micro_batch, 1, 3))
        cl, scale, speed = per_device_cluster(self.sim_cluster, p, per_rank, self.slowdown)
        if p.micro_batch not in self._graphs:
            self._graphs[p.micro_batch] = resolve_model(self.model, p)
        cm = compute_model(self.comm, base, self.sim_cluster, p, self.flatten_s_per_byte)
        # Layer granularity: tensor-parallel collectives are tasks of their own, as in the run.
        res = simulate(self._graphs[p.micro_batch], cl, p, memory=False, granularity="layer",
                       layer_times=prof.times, layer_time_scale=scale, compute=cm)
        return MachinePrediction(p, float(res.iteration_time_s), res, prof, speed, scale, cm, cl,
                                 self._graphs[p.micro_batch])

    def run(self, plan: PlanSource, steps: int = 8, *, training: Any = None, launch: Any = None, **configs: Any) -> Any:
        """`plait.runtime.api.run` of `plan` in fp32 with the ranks placed as the profilers: `training`
        with dtype fp32, `launch` with this machine's emulated dtype and worker env added; the other
        configs (`checkpoint`, `records`, `faults`) as given. Its ranks run in the CPU shares their
        profilers ran in (calibrated for its rank count)."""
        from plait.runtime.api import run
        from plait.runtime.config import LaunchConfig, TrainingConfig

        self._require()
        self._for_ranks_of(self._fp32(plan))
        training = dataclasses.replace(training or TrainingConfig(), dtype="fp32")
        launch = launch or LaunchConfig()
        launch = dataclasses.replace(launch, emulate_dtype=self.emulate_dtype, env={**self.env, **(launch.env or {})})
        return run(self.model, self.cluster_arg, self._fp32(plan), steps=steps, training=training, launch=launch,
                   **configs)

    def measure_and_predict(self, plan: PlanSource, steps: int = 8, warmup: int = 2, **configs: Any) -> MachineRun:
        """Profile the layers, run `plan` (`configs`: `run`'s, as `LocalMachine.run` takes them),
        profile again; predict from the mean of the two profiles. The measurement is the median
        step after `warmup` steps (allocator, gloo connections)."""
        before = self.layer_profiles(plan)
        res = self.run(plan, steps=steps, **configs)
        after = self.layer_profiles(plan)
        per_rank = [mean_profile([b, a]) for b, a in zip(before, after)]
        totals = [statistics.fmean(total(x) for x in before), statistics.fmean(total(x) for x in after)]
        skip = warmup if len(res.iteration_times) > warmup + 1 else 0
        return MachineRun(prediction=self.predict(plan, per_rank), run=res,
                          measured_s=statistics.median(res.iteration_times[skip:]), warmup_steps=skip,
                          drift=(totals[1] - totals[0]) / statistics.fmean(totals))
