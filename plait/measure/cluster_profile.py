"""`plait profile`: measure a live cluster (or N local workers) and write a cluster YAML.

The workers are ordinary `torch.distributed` processes launched by torchrun
(`torch.distributed.run`; gloo on CPU, NCCL on GPU). Every rank measures, at the
same time as the others (as in training, where all ranks compute at once):

* **point-to-point** bandwidth and latency for every pair of ranks, in parallel
  rounds. The rounds come from the round-robin tournament ("circle method": fix
  rank 0, rotate the others), so each round is a perfect matching and n-1 rounds
  (n even) cover all n(n-1)/2 pairs. Pairs of a round that would share a node's NIC
  (two cross-node pairs touching the same node) are deferred to a sub-round, so each
  figure is one link's, uncontended -- the number a cluster file's link describes.
  Latency is half the median round trip of a 4-byte ping-pong; bandwidth is
  `k*S / (t - latency)` for k back-to-back sends of S bytes closed by a 4-byte ack, the
  best of `p2p_repeats` such bursts: a link's capacity is what it carries when nothing
  else interferes, and interference on a shared host only ever lowers the figure.
* **collectives**: all-reduce and all-gather from 1 KiB to 256 MiB (powers of two;
  `--max-size` for quick runs) with nccl-tests' conventions (PERFORMANCE.md of
  NVIDIA/nccl-tests): `size` is the full buffer (for all-gather the gathered
  output), `algbw = size / t`, `busbw = algbw * 2(n-1)/n` for all-reduce and
  `algbw * (n-1)/n` for all-gather; `t` is the slowest rank's mean time per call.
* **matmul** throughput per rank and dtype (n x n @ n x n = 2n^3 FLOP; the best of a
  few n is the kind's achieved peak), copy memory bandwidth (2 x bytes per copy), the
  rate of a transformer layer's elementwise kernels (`_stream_rate`) and the fixed cost
  of one tiny op in forward and backward (eager dispatch, autograd; `_op_overheads`).

When an emulated compute slowdown applies (see `plait.runtime.emulate`), every
matmul span is stretched by sleeping, exactly as the runtime does, so the profile
measures the emulated device. The launcher takes, per node, an object with
`command(argv)`, `env()` and `ip` (a `plait.runtime.netns.NodeNet`), so the workers
of an emulated node run inside its network namespace and measure the shaped links.

On a real multi-host cluster, run the worker under your own torchrun on every host
(`torchrun --nnodes ... -m plait.measure.cluster_profile --worker --result R.json`, with
PLAIT_NODE set to the host's node index) and turn the result into YAML with
`plait profile --from-result R.json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait.cost.collectives import bus_factor
from plait.errors import PlaitError
from plait.net.ports import free_port

if TYPE_CHECKING:
    from plait.cluster.spec import ClusterSource

KiB, MiB = 1024, 1024 * 1024


class ProfileError(PlaitError, RuntimeError):
    """The profiling run failed or was given impossible options."""


# ---------------------------------------------------------------- schedules


def round_robin_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of the round-robin tournament on n players; each round is a perfect matching.

    Circle method: fix player 0 and rotate the others one seat per round; round r pairs
    seat i with seat n-1-i. With n odd a dummy player is added and its partner rests.
    Every unordered pair appears exactly once; pairs are (low, high)."""
    if n < 2:
        return []
    players = list(range(n)) + ([None] if n % 2 else [])
    m = len(players)
    rounds = []
    for _ in range(m - 1):
        pairs = []
        for i in range(m // 2):
            a, b = players[i], players[m - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


def split_by_nic(pairs: Sequence[tuple[int, int]], node_of: Sequence[int]) -> list[list[tuple[int, int]]]:
    """Split one round so that each node takes part in at most one cross-node pair per sub-round.

    Intra-node pairs never share a NIC and stay in the first sub-round. Greedy first-fit:
    a matching's cross-node pairs form a multigraph on nodes and this is its edge colouring."""
    subrounds: list[list[tuple[int, int]]] = [[]]
    busy: list[set[int]] = [set()]
    for a, b in pairs:
        na, nb = node_of[a], node_of[b]
        if na == nb:
            subrounds[0].append((a, b))
            continue
        for k, used in enumerate(busy):
            if na not in used and nb not in used:
                subrounds[k].append((a, b))
                used.update((na, nb))
                break
        else:
            subrounds.append([(a, b)])
            busy.append({na, nb})
    return [s for s in subrounds if s]


def default_sizes(max_size: int = 256 * MiB, min_size: int = KiB) -> list[int]:
    """Powers of two from `min_size` to `max_size` bytes (nccl-tests' -b/-e/-f 2 sweep)."""
    if max_size < min_size:
        raise ProfileError(f"--max-size {max_size} is below the smallest size {min_size}")
    out, s = [], min_size
    while s <= max_size:
        out.append(s)
        s *= 2
    return out


def parse_size(text: str) -> int:
    """'1K', '256M', '1G', '4096' -> bytes (binary multiples, like nccl-tests)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": KiB, "M": MiB, "G": 1024 * MiB}
    try:
        if t and t[-1] in mult:
            return int(float(t[:-1]) * mult[t[-1]])
        return int(t)
    except ValueError:
        raise ProfileError(f"size {text!r}: expected a byte count like 4096, 64K, 256M or 1G") from None


# ---------------------------------------------------------------- results


@dataclass
class ProfileConfig:
    sizes: list[int] = field(default_factory=lambda: default_sizes())
    p2p_bytes: int = 4 * MiB
    p2p_iters: int = 3
    p2p_repeats: int = 3  # bursts per pair and direction; the best one is the link's capacity
    latency_iters: int = 20
    matmul_sizes: list[int] | None = None  # None: 256/512/1024 on CPU, 2048/4096/8192 on GPU
    dtypes: list[str] | None = None  # None: fp32,bf16 on CPU; fp32,tf32,bf16,fp16 on GPU
    min_time: float = 0.05  # seconds each collective size / matmul measurement runs for, at least
    max_iters: int = 20
    slowdowns: list[float] | None = None  # per global rank; None: no emulated slowdown
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 300.0


@dataclass
class ProfileResult:
    world: int
    backend: str
    device_type: str  # "cpu" or the CUDA device name
    node_of: list[int]  # rank -> node index
    p2p: dict[str, dict[str, float]]  # "a-b" (a -> b) -> {"bandwidth": B/s, "latency": s}
    collectives: dict[str, list[dict[str, float]]]  # name -> rows {bytes, time_s, algbw, busbw}
    matmul: list[dict[str, Any]]  # per rank: {dtype: best FLOP/s, "by_size": {dtype: {n: FLOP/s}}}
    memory_bandwidth: list[float]  # per rank, bytes/s (copy)
    memory_bytes: list[int]  # per rank
    slowdowns: list[float]
    rounds: list[list[list[tuple[int, int]]]]  # round -> sub-round -> pairs
    seconds: float = 0.0
    # per rank (forward, backward) seconds per tiny op: eager dispatch (+ autograd) cost,
    # stretched by the slowdown like any compute -- the per-kernel overhead on a CPU rank
    op_overhead: list[list[float]] = field(default_factory=list)
    # per rank, bytes/s of activation-sized elementwise kernels (see `_stream_rate`)
    stream_bandwidth: list[float] = field(default_factory=list)

    def pair(self, a: int, b: int) -> dict[str, float]:
        return self.p2p[f"{a}-{b}"]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, source: str = "profile result") -> ProfileResult:
        try:
            data = json.loads(text)
            data["rounds"] = [[[tuple(p) for p in sub] for sub in rnd] for rnd in data["rounds"]]
            return cls(**data)
        except (json.JSONDecodeError, TypeError, KeyError) as exc:
            raise ProfileError(f"{source}: not a plait profile result ({exc})") from None


# ---------------------------------------------------------------- the worker


@dataclass
class _Rank:
    """What every measurement of one profiling rank needs: who it is, its device, how to sync."""

    cfg: ProfileConfig
    rank: int
    world: int
    device: Any
    cuda: bool
    slow: float  # emulated slowdown of this rank's compute (1.0 on a GPU rank: it is its kind)

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def barrier(self) -> None:
        import torch.distributed as dist

        self.sync()
        dist.barrier()


def _worker(cfg: ProfileConfig, result_path: str | None) -> ProfileResult | None:
    """One rank of `plait profile`: point-to-point per pair, collectives, matmul, memory
    bandwidth and per-op overheads, gathered on rank 0, which writes `result_path`."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and cfg.backend != "gloo"
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=cfg.timeout_s),
                            **({"device_id": device} if cuda else {}))
    t_start = time.perf_counter()
    nodes: list[Any] = [None] * world
    dist.all_gather_object(nodes, int(os.environ.get("PLAIT_NODE", "0")))
    node_of = [int(x) for x in nodes]
    # Like the runtime's recorder, stretch compute only on CPU ranks: a GPU rank already is
    # its kind.
    me = _Rank(cfg, rank, world, device, cuda, 1.0 if cuda else (cfg.slowdowns or [1.0] * world)[rank])

    rounds = [split_by_nic(r, node_of) for r in round_robin_rounds(world)]
    p2p = _measure_p2p(me, rounds)
    collectives = _measure_collectives(me)
    matmul = _measure_matmul(me)
    op_fwd, op_bwd = _op_overheads(torch, device, me.sync, me.slow, me.barrier)
    stream_bw = _stream_rate(torch, device, me.sync, me.slow, me.barrier, cfg.min_time, cuda)
    mem_bw, mem_bytes = _measure_memory(me)

    # ---- gather on every rank (cheap), rank 0 writes
    mine = {"p2p": p2p, "matmul": matmul, "mem_bw": mem_bw, "mem_bytes": mem_bytes, "op": (op_fwd, op_bwd),
            "stream": stream_bw}
    everything: list[Any] = [None] * world
    dist.all_gather_object(everything, mine)
    result = None
    if rank == 0:
        merged: dict[str, dict[str, float]] = {}
        for r in everything:
            merged.update(r["p2p"])
        result = ProfileResult(
            world=world, backend="nccl" if cuda else "gloo",
            device_type=torch.cuda.get_device_name(device) if cuda else "cpu",
            node_of=node_of, p2p=merged, collectives=collectives,
            matmul=[r["matmul"] for r in everything],
            memory_bandwidth=[r["mem_bw"] for r in everything],
            memory_bytes=[r["mem_bytes"] for r in everything],
            op_overhead=[list(r["op"]) for r in everything],
            stream_bandwidth=[r["stream"] for r in everything],
            slowdowns=[1.0] * world if cuda else list(cfg.slowdowns or [1.0] * world), rounds=rounds,
            seconds=time.perf_counter() - t_start)
        if result_path:
            tmp = result_path + ".tmp"
            Path(tmp).write_text(result.to_json())
            os.replace(tmp, result_path)
    me.barrier()
    dist.destroy_process_group()
    return result


def _measure_p2p(me: _Rank, rounds: list[list[list[tuple[int, int]]]]) -> dict[str, dict[str, float]]:
    """Latency (half the median round trip) and one-way bandwidth of every pair, in parallel
    rounds of disjoint pairs (`round_robin_rounds`, split so no NIC carries two pairs)."""
    import torch
    import torch.distributed as dist

    cfg, rank = me.cfg, me.rank
    small = torch.zeros(1, dtype=torch.float32, device=me.device)
    big = torch.zeros(max(1, cfg.p2p_bytes // 4), dtype=torch.float32, device=me.device)
    p2p: dict[str, dict[str, float]] = {}

    def one_way(src: int, dst: int, lat: float) -> float:
        """Bandwidth src -> dst; both ranks call it, only src's figure is meaningful."""
        repeats = max(1, cfg.p2p_repeats)
        if rank == src:
            dist.send(big, dst)  # warm-up: connection set-up and buffer registration
            dist.recv(small, dst)
            best = 0.0
            for _ in range(repeats):
                me.sync()
                t0 = time.perf_counter()
                for _ in range(cfg.p2p_iters):
                    dist.send(big, dst)
                dist.recv(small, dst)
                me.sync()
                t = time.perf_counter() - t0
                best = max(best, cfg.p2p_iters * big.numel() * 4 / max(t - lat, 1e-9))
            return best
        dist.recv(big, src)
        dist.send(small, src)
        for _ in range(repeats):
            for _ in range(cfg.p2p_iters):
                dist.recv(big, src)
            dist.send(small, src)
        return 0.0

    for rnd in rounds:
        for sub in rnd:
            for a, b in sub:
                if rank not in (a, b):
                    continue
                peer = b if rank == a else a
                rtts = []
                for i in range(3 + cfg.latency_iters):
                    me.sync()
                    t0 = time.perf_counter()
                    if rank == a:
                        dist.send(small, peer)
                        dist.recv(small, peer)
                    else:
                        dist.recv(small, peer)
                        dist.send(small, peer)
                    me.sync()
                    if i >= 3:
                        rtts.append(time.perf_counter() - t0)
                lat = statistics.median(rtts) / 2
                bw_ab = one_way(a, b, lat)
                bw_ba = one_way(b, a, lat)
                if rank == a:
                    p2p[f"{a}-{b}"] = {"bandwidth": bw_ab, "latency": lat}
                else:
                    p2p[f"{b}-{a}"] = {"bandwidth": bw_ba, "latency": lat}
            me.barrier()
    return p2p


def _timed(me: _Rank, op: Any) -> float:
    """Mean seconds per call of `op`, slowest rank; iterations sized from a warm-up call."""
    import torch
    import torch.distributed as dist

    me.barrier()
    t0 = time.perf_counter()
    op()
    me.sync()
    t_warm = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=me.device)
    dist.all_reduce(t_warm, op=dist.ReduceOp.MAX)
    iters = int(min(me.cfg.max_iters, max(1, math.ceil(me.cfg.min_time / max(float(t_warm), 1e-6)))))
    me.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    me.sync()
    t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=me.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _measure_collectives(me: _Rank) -> dict[str, list[dict[str, float]]]:
    """nccl-tests' rows for all-reduce and all-gather at each size: time, algbw, busbw."""
    import torch
    import torch.distributed as dist

    world, device = me.world, me.device
    collectives: dict[str, list[dict[str, float]]] = {"all_reduce": [], "all_gather": []}
    for size in me.cfg.sizes:
        buf = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        t = _timed(me, lambda b=buf: dist.all_reduce(b))
        nbytes = buf.numel() * 4
        collectives["all_reduce"].append({"bytes": nbytes, "time_s": t, "algbw": nbytes / t,
                                          "busbw": nbytes / t * bus_factor("all_reduce", world)})
        per = max(1, size // 4 // world)
        part = torch.ones(per, dtype=torch.float32, device=device)
        out = torch.empty(per * world, dtype=torch.float32, device=device)
        t = _timed(me, lambda o=out, i=part: dist.all_gather_into_tensor(o, i))
        nbytes = out.numel() * 4
        collectives["all_gather"].append({"bytes": nbytes, "time_s": t, "algbw": nbytes / t,
                                          "busbw": nbytes / t * bus_factor("all_gather", world)})
    return collectives


def _measure_matmul(me: _Rank) -> dict[str, Any]:
    """Best matmul FLOP/s per dtype, and by size (all ranks at once, like training)."""
    import torch

    cfg, device, cuda = me.cfg, me.device, me.cuda
    dtypes = cfg.dtypes or (["fp32", "tf32", "bf16", "fp16"] if cuda else ["fp32", "bf16"])
    ns = cfg.matmul_sizes or ([2048, 4096, 8192] if cuda else [256, 512, 1024])
    torch_dtype = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    matmul: dict[str, Any] = {"by_size": {}}
    for dt in dtypes:
        if dt not in torch_dtype:
            raise ProfileError(f"--dtypes: unknown dtype {dt!r}; use fp32, tf32, bf16, fp16")
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = dt == "tf32"
        best, by_size = 0.0, {}
        for n in ns:
            gen = torch.Generator(device=device).manual_seed(me.rank)
            x = torch.randn(n, n, generator=gen, device=device).to(torch_dtype[dt])
            y = torch.randn(n, n, generator=gen, device=device).to(torch_dtype[dt])
            x @ y  # warm-up (kernel selection, page faults)
            me.barrier()
            reps, total = 0, 0.0
            while total < cfg.min_time or reps < 2:
                t0 = time.perf_counter()
                x @ y
                me.sync()
                if me.slow > 1.0:
                    # The emulated slower kind: stretch the span by sleeping, as the runtime
                    # does (plait.runtime.emulate.apply_slowdown; not imported: measure keeps
                    # this worker free of the runtime's imports).
                    time.sleep((me.slow - 1.0) * (time.perf_counter() - t0))
                total += time.perf_counter() - t0
                reps += 1
            flops = 2.0 * n**3 * reps / total
            by_size[str(n)] = flops
            best = max(best, flops)
        matmul[dt] = best
        matmul["by_size"][dt] = by_size
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    return matmul


def _measure_memory(me: _Rank) -> tuple[float, int]:
    """Copy bandwidth (bytes/s, read + write) and the memory this rank may use (bytes)."""
    import torch

    copy_bytes = (256 if me.cuda else 32) * MiB
    src = torch.ones(copy_bytes // 4, dtype=torch.float32, device=me.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    me.barrier()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < me.cfg.min_time or reps < 2:
        dst.copy_(src)
        me.sync()
        reps += 1
    mem_bw = 2.0 * copy_bytes * reps / (time.perf_counter() - t0)
    if me.cuda:
        return mem_bw, int(torch.cuda.get_device_properties(me.device).total_memory)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return mem_bw, int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, local_world))


def _op_overheads(torch: Any, device: Any, sync: Any, slow: float, barrier: Any, ops: int = 200) -> tuple[float, float]:
    """Seconds per tiny elementwise op in forward and in backward (all ranks at once).

    On a CPU rank every op pays PyTorch's eager dispatch (and in backward the autograd
    engine's per-node work) serially with its arithmetic; with 8-element tensors the
    arithmetic is nil, so this is that fixed cost per op."""
    x = torch.ones(8, device=device, requires_grad=True)
    fwd, bwd = [], []
    barrier()
    for _ in range(5):  # median of 5, measured under the same contention as training
        t0 = time.perf_counter()
        y = x
        for _i in range(ops):
            y = y * 1.0001
        sync()
        t1 = time.perf_counter()
        y.sum().backward()
        sync()
        t2 = time.perf_counter()
        if slow > 1.0:
            time.sleep((slow - 1.0) * (t2 - t0))
        fwd.append((t1 - t0) * slow / ops)
        bwd.append((t2 - t1) * slow / ops)
        x.grad = None
    return statistics.median(fwd), statistics.median(bwd)


def _stream_rate(torch: Any, device: Any, sync: Any, slow: float, barrier: Any, min_time: float,
                 cuda: bool) -> float:
    """Bytes/s of the elementwise kernels of a transformer layer, counted as a roofline does.

    LayerNorm, GELU, softmax (2 x 4 B per element: read + write), dropout (+ a 1-byte
    mask) and a residual add (3 x 4 B), on activation-sized fp32 tensors. On a GPU these
    kernels are bound by HBM and run near the copy rate; on a CPU core they are bound by
    arithmetic (erf, exp, the RNG) and run several times below it -- this is the rate a
    simulator's memory-bound kernels see on that device."""
    import torch.nn.functional as F

    n = 1 << (24 if cuda else 17)
    x = torch.randn(n // 512, 512, device=device)
    y = torch.randn_like(x)
    w = torch.ones(512, device=device)
    kernels = [
        (lambda: F.layer_norm(x, (512,), w, w), 8),
        (lambda: F.gelu(x), 8),
        (lambda: F.softmax(x, dim=-1), 8),
        (lambda: F.dropout(x, 0.1, training=True), 9),
        (lambda: x + y, 12),
    ]
    for fn, _ in kernels:  # warm-up
        fn()
    barrier()
    moved, total = 0.0, 0.0
    while total < min_time or moved == 0.0:
        for fn, per_elem in kernels:
            t0 = time.perf_counter()
            fn()
            sync()
            if slow > 1.0:
                time.sleep((slow - 1.0) * (time.perf_counter() - t0))
            total += time.perf_counter() - t0
            moved += per_elem * n
    return moved / total


# ---------------------------------------------------------------- the launcher


@dataclass(frozen=True)
class LocalNode:
    """A node whose workers run in this machine's own network namespace (loopback)."""

    node_index: int = 0
    ip: str = "127.0.0.1"
    namespace: None = None

    def command(self, argv: Sequence[str]) -> list[str]:
        return list(argv)

    def env(self) -> dict[str, str]:
        return {"GLOO_SOCKET_IFNAME": "lo"}  # keep gloo off the machine's outside interface


def _worker_args(cfg: ProfileConfig, result_path: str) -> list[str]:
    args = ["--worker", "--result", result_path,
            "--sizes", ",".join(map(str, cfg.sizes)),
            "--p2p-bytes", str(cfg.p2p_bytes), "--p2p-iters", str(cfg.p2p_iters),
            "--latency-iters", str(cfg.latency_iters), "--min-time", str(cfg.min_time),
            "--max-iters", str(cfg.max_iters), "--backend", cfg.backend, "--timeout", str(cfg.timeout_s)]
    if cfg.matmul_sizes:
        args += ["--matmul-sizes", ",".join(map(str, cfg.matmul_sizes))]
    if cfg.dtypes:
        args += ["--dtypes", ",".join(cfg.dtypes)]
    if cfg.slowdowns:
        args += ["--slowdowns", ",".join(f"{x:.9g}" for x in cfg.slowdowns)]
    return args


def launch(nprocs_per_node: Sequence[int], cfg: ProfileConfig, nets: Sequence[Any] | None = None, *,
           workdir: str | None = None) -> ProfileResult:
    """Run the profile with one torchrun agent per node; returns rank 0's result.

    `nets[i]` (a NodeNet or LocalNode) wraps node i's agent command (namespace) and sets
    its environment; node i's workers get ranks after those of nodes 0..i-1."""
    if not nprocs_per_node or min(nprocs_per_node) < 1:
        raise ProfileError(f"need at least one worker per node, got {list(nprocs_per_node)}")
    nets = list(nets) if nets is not None else [LocalNode(i) for i in range(len(nprocs_per_node))]
    if len(nets) != len(nprocs_per_node):
        raise ProfileError(f"{len(nets)} node networks for {len(nprocs_per_node)} nodes")
    world = sum(nprocs_per_node)
    if cfg.slowdowns is not None and len(cfg.slowdowns) != world:
        raise ProfileError(f"{len(cfg.slowdowns)} slowdown factors for {world} ranks")
    isolated = any(getattr(n, "namespace", None) for n in nets)
    master = nets[0].ip
    port = 29517 if isolated else free_port()  # node 0's namespace is fresh: any fixed port is free
    tmp = tempfile.TemporaryDirectory(prefix="plait-profile-") if workdir is None else None
    wd = Path(workdir or tmp.name)
    wd.mkdir(parents=True, exist_ok=True)
    result_path = str(wd / "profile_result.json")
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for i, (net, nproc) in enumerate(zip(nets, nprocs_per_node, strict=True)):
            argv = [sys.executable, "-m", "torch.distributed.run",
                    f"--nnodes={len(nets)}", f"--node_rank={i}", f"--nproc_per_node={nproc}",
                    f"--master_addr={master}", f"--master_port={port}", "--max_restarts=0",
                    "-m", "plait.measure.cluster_profile", *_worker_args(cfg, result_path)]
            env = dict(os.environ)
            env.update(net.env())
            env["PLAIT_NODE"] = str(getattr(net, "node_index", i))
            env.setdefault("OMP_NUM_THREADS", "1")
            log_path = wd / f"node{i}.log"
            logs.append(log_path)
            fh = open(log_path, "w")  # noqa: SIM115 -- closed after the process ends
            procs.append(subprocess.Popen(net.command(argv), env=env, stdout=fh, stderr=subprocess.STDOUT,
                                          start_new_session=True))
            fh.close()
        deadline = time.monotonic() + cfg.timeout_s + 60
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
        if any(c != 0 for c in codes):
            tail = "".join(_tail(path) for path in logs)
            why = "timed out" if any(c is None for c in codes) else f"exit codes {codes}"
            raise ProfileError(f"profiling workers failed ({why}); last log lines:\n{tail}")
        if not Path(result_path).exists():
            raise ProfileError(f"profiling workers ended without writing {result_path}")
        return ProfileResult.from_json(Path(result_path).read_text(), result_path)
    finally:
        for p in procs:  # only the process groups this call started
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(timeout=5)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        if tmp is not None:
            tmp.cleanup()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return f"--- {path.name}\n" + "\n".join(text[-lines:]) + "\n"


# ---------------------------------------------------------------- result -> cluster


def _slug(text: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in text.lower()).split()) or "device"


def _median(values: Sequence[float], default: float) -> float:
    return float(statistics.median(values)) if values else default


def _pair_means(result: ProfileResult) -> dict[tuple[int, int], tuple[float, float]]:
    """(a, b) with a < b -> (mean bandwidth of both directions, mean latency)."""
    out = {}
    for a in range(result.world):
        for b in range(a + 1, result.world):
            ab, ba = result.p2p.get(f"{a}-{b}"), result.p2p.get(f"{b}-{a}")
            got = [x for x in (ab, ba) if x]
            if got:
                out[(a, b)] = (sum(x["bandwidth"] for x in got) / len(got), sum(x["latency"] for x in got) / len(got))
    return out


def kind_memory_bandwidth(result: ProfileResult, rank: int) -> float:
    """The kind's `memory_bandwidth`: the copy rate on a GPU (HBM-bound kernels, the
    simulator applies its own efficiency); on a CPU the elementwise-kernel rate, which is
    what memory-bound kernels achieve there (they are bound by arithmetic, not DRAM)."""
    if result.device_type == "cpu" and result.stream_bandwidth:
        return result.stream_bandwidth[rank]
    return result.memory_bandwidth[rank]


def result_to_cluster(result: ProfileResult, base: Any = None, name: str | None = None) -> Any:
    """The measured cluster: one `measured-<kind>` GPU kind per original kind (mean of its
    ranks' achieved FLOP/s per dtype and memory-kernel rate (`kind_memory_bandwidth`), smallest memory), node links from the
    medians of the measured pairs, and every measured pair as a device override.

    With `base` (the cluster profiled, ranks = its devices) the node layout, NIC counts and
    switches are kept and the emulation section is rewritten for the measured figures:
    `bandwidth_scale` 1 (the links were measured already scaled) and the slowdown per
    measured kind set to the factor the profile ran with, so `plait run` on the measured
    file emulates the same machine."""
    import dataclasses

    from plait.cluster.spec import Cluster, EmulationSpec, GPUKind, Link, NodeSpec, PairOverride

    n = result.world
    if base is not None and base.num_devices != n:
        raise ProfileError(f"cluster '{base.name}' has {base.num_devices} devices but the profile ran {n} ranks")
    if base is not None:
        orig = [d.kind.name for d in base.devices]
        node_of = [d.node for d in base.devices]
    else:
        orig = [_slug(result.device_type)] * n
        node_of = list(result.node_of)
    kind_of = [f"measured-{k}" for k in orig]
    kinds: dict[str, GPUKind] = {}
    for k in dict.fromkeys(kind_of):
        ranks = [r for r in range(n) if kind_of[r] == k]
        dtypes = [d for d in ("fp32", "tf32", "bf16", "fp16") if all(d in result.matmul[r] for r in ranks)]
        if "fp32" not in dtypes:
            raise ProfileError("the profile has no fp32 matmul figure; a GPU kind needs one")
        kinds[k] = GPUKind(name=k, peak_flops={d: statistics.fmean(result.matmul[r][d] for r in ranks) for d in dtypes},
                           memory_bytes=min(result.memory_bytes[r] for r in ranks),
                           memory_bandwidth=statistics.fmean(kind_memory_bandwidth(result, r) for r in ranks))
    pairs = _pair_means(result)
    intra_all = [v for (a, b), v in pairs.items() if node_of[a] == node_of[b]]
    n_nodes = max(node_of) + 1
    link_kind = "loopback" if result.device_type == "cpu" else "generic"
    default_intra = Link(_median([v[0] for v in intra_all], statistics.fmean(result.memory_bandwidth) / 2),
                         _median([v[1] for v in intra_all], 0.0), link_kind)
    nodes = []
    for i in range(n_nodes):
        members = [r for r in range(n) if node_of[r] == i]
        intra = [v for (a, b), v in pairs.items() if node_of[a] == i and node_of[b] == i]
        cross = [v for (a, b), v in pairs.items() if (node_of[a] == i) != (node_of[b] == i)]
        intra_link = Link(_median([v[0] for v in intra], default_intra.bandwidth),
                          _median([v[1] for v in intra], default_intra.latency), link_kind) if intra else default_intra
        nic_kind = "ethernet" if base is not None and n_nodes > 1 else link_kind
        nic = Link(_median([v[0] for v in cross], intra_link.bandwidth), _median([v[1] for v in cross],
                   intra_link.latency), nic_kind)
        src = base.nodes[i] if base is not None else None
        nodes.append(NodeSpec(name=src.name if src else f"node{i}", gpus=[kind_of[r] for r in members],
                              intra=intra_link, nic=nic, nics=src.nics if src else 1,
                              leaf=src.leaf if src else None))
    overrides = [PairOverride(a=a, b=b, bandwidth=bw, latency=lat) for (a, b), (bw, lat) in sorted(pairs.items())]
    switches, emulation = [], None
    if base is not None:
        emu = base.emulation
        scale = emu.bandwidth_scale if emu is not None and emu.enabled else 1.0
        switches = [dataclasses.replace(s, uplink=dataclasses.replace(s.uplink, bandwidth=s.uplink.bandwidth * scale))
                    if s.uplink else s for s in base.switches]
        if emu is not None and emu.enabled:
            factor = {kind_of[r]: float(result.slowdowns[r]) for r in range(n)}
            emulation = EmulationSpec(enabled=True, namespaces=emu.namespaces, bandwidth_scale=1.0, slowdown=factor)
    return Cluster(name=name or (f"{base.name}-measured" if base is not None else f"local-{n}"), kinds=kinds,
                   nodes=nodes, switches=switches, overrides=overrides, emulation=emulation,
                   collectives=measured_collectives(result, n_nodes),
                   model_profiles=list(base.model_profiles) if base is not None else [], source="plait profile")


def measured_collectives(result: ProfileResult, nodes: int) -> list[Any]:
    """The profile's collective sweeps as busbw tables (nccl-tests' vocabulary), one per op."""
    from plait.cluster.spec import COLLECTIVE_OPS, MeasuredCollective

    out = []
    for op, rows in result.collectives.items():
        points = sorted({float(r["bytes"]): float(r["busbw"]) for r in rows
                         if r.get("bytes", 0) > 0 and r.get("busbw", 0) > 0}.items())
        if op in COLLECTIVE_OPS and points and result.world > 1:
            out.append(MeasuredCollective(
                op=op, nodes=nodes, ranks=result.world, sizes=tuple(p[0] for p in points),
                busbw=tuple(p[1] for p in points),
                source=f"plait profile: {result.world} ranks, {result.backend} on {result.device_type}"))
    return out


def result_to_yaml(result: ProfileResult, base: Any = None, name: str | None = None) -> dict[str, Any]:
    """The measured cluster as YAML data (`load_cluster` reads it), with a summary in `description`."""
    from plait.cluster.loader import cluster_to_dict

    data = cluster_to_dict(result_to_cluster(result, base, name))
    best = {c: max((row["busbw"] for row in rows), default=0.0) for c, rows in result.collectives.items()}
    summary = (f"measured by plait profile: {result.world} ranks, {result.backend} on {result.device_type}; "
               f"peak busbw all_reduce {best.get('all_reduce', 0) / 1e6:.1f} MB/s, "
               f"all_gather {best.get('all_gather', 0) / 1e6:.1f} MB/s")
    return {"name": data.pop("name"), "description": summary, **data}


# ---------------------------------------------------------------- entry point for the workers


def _csv(kind: Any) -> Any:
    return lambda text: [kind(x) for x in text.split(",") if x]


def worker_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m plait.measure.cluster_profile")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--result", default=None)
    p.add_argument("--sizes", type=_csv(parse_size), default=None)
    p.add_argument("--p2p-bytes", type=parse_size, default=4 * MiB)
    p.add_argument("--p2p-iters", type=int, default=3)
    p.add_argument("--latency-iters", type=int, default=20)
    p.add_argument("--min-time", type=float, default=0.05)
    p.add_argument("--max-iters", type=int, default=20)
    p.add_argument("--matmul-sizes", type=_csv(int), default=None)
    p.add_argument("--dtypes", type=_csv(str), default=None)
    p.add_argument("--slowdowns", type=_csv(float), default=None)
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args(argv)
    cfg = ProfileConfig(sizes=a.sizes or default_sizes(), p2p_bytes=a.p2p_bytes, p2p_iters=a.p2p_iters,
                        latency_iters=a.latency_iters, matmul_sizes=a.matmul_sizes, dtypes=a.dtypes,
                        min_time=a.min_time, max_iters=a.max_iters, slowdowns=a.slowdowns,
                        backend=a.backend, timeout_s=a.timeout)
    _worker(cfg, a.result)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())


_log = logging.getLogger("plait.profile")


def profile(cluster: ClusterSource | None = None, nprocs: int | None = None, *, sizes: list[int] | None = None,
            max_size: int = 256 * MiB, p2p_bytes: int = 4 * MiB, matmul_sizes: list[int] | None = None,
            dtypes: list[str] | None = None, slowdown_dtype: str | None = None, min_time: float = 0.05,
            backend: str = "auto", timeout_s: float = 300.0, out: str | Path | None = None,
            name: str | None = None, prefix: str = "plait") -> tuple[ProfileResult, dict[str, Any]]:
    """Profile and return (raw result, cluster YAML data); writes the YAML to `out` when given.

    `cluster`: a Cluster, YAML path or preset string; one worker per device, laid out by
    node. Without it, `nprocs` local workers on one node."""
    cfg = ProfileConfig(sizes=sizes or default_sizes(max_size), p2p_bytes=p2p_bytes, matmul_sizes=matmul_sizes,
                        dtypes=dtypes, min_time=min_time, backend=backend, timeout_s=timeout_s)
    if cluster is None:
        if not nprocs or nprocs < 1:
            raise ProfileError("plait profile: give --nprocs N (N >= 1) or --cluster CLUSTER")
        result = launch([nprocs], cfg)
        data = result_to_yaml(result, None, name=name or f"local-{nprocs}")
    else:
        from plait.cluster import load_cluster
        from plait.runtime.emulate import slowdowns
        from plait.runtime.netns import emulated_network

        cl = load_cluster(cluster)
        per_node = [len(n.gpus) for n in cl.nodes]
        emu = cl.emulation
        if emu is not None and emu.enabled:
            cfg.slowdowns = slowdowns(cl, slowdown_dtype)
            with emulated_network(cl, cl.num_devices, prefix=prefix) as net:
                nets = [n if n.namespace else LocalNode(n.node_index) for n in net]
                # net.reason (no netem, loopback fallback) was logged once by plait.runtime.netns.warn_once
                result = launch(per_node, cfg, nets)
        else:
            _log.warning("plait profile: cluster '%s' has no emulation section; measuring %d local workers "
                        "laid out as its nodes (loopback links)", cl.name, cl.num_devices)
            result = launch(per_node, cfg)
        data = result_to_yaml(result, cl, name=name or f"{cl.name}-measured")
    if out is not None:
        import yaml

        Path(out).write_text(yaml.safe_dump(data, sort_keys=False))
    return result, data
