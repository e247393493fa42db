"""What a strategy costs on a heterogeneous cluster: compute at the devices' ratios, collectives.

Compute (HAP section 5.1, extended by a memory-bound term): an op's work on device ``i`` is
``w_i = 3 F / f_i + 3 B / m_i`` -- forward plus backward FLOPs (backward ~ 2x forward: the
gradients of both operands of every product) at the device's effective FLOP/s ``f_i`` (peak x
`plait.cost.compute`'s GEMM efficiency), plus the output bytes written in forward and read and
written in backward at its memory bandwidth ``m_i``. A sharded strategy takes
``max_i r_i w_i`` (the slowest device finishes last), a redundant one ``max_i w_i``. Both are
at least the perfect-balance time ``1 / sum_i (1 / w_i)`` -- the search's admissible heuristic.

Communication: every collective through `plait.cost.collectives` on the group of all devices
(the ring's slowest link, the cluster's measured tables where it has them). Uneven shards run as
HAP's *padded* collectives: all-gather, reduce-scatter and all-to-all move every shard padded to
the largest, i.e. ``n max_i r_i`` of the tensor; all-reduce moves the whole tensor. Time is
affine in the bytes, so in ``max_i r_i`` -- what the ratio LP needs. (Per-tensor choice between
padded and grouped collectives, and per-link costs, are HAP items 5; they will replace
`comm_time` through the one traffic module.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from plait.cluster.spec import Cluster
from plait.cluster.topology import bandwidth_matrix, latency_matrix
from plait.cost.collectives import GroupLinks, collective_time, group_links
from plait.cost.compute import DEFAULT_MODEL
from plait.ir.aten_graph import AtenGraph, AtenOp
from plait.spmd.placement import Comm, ShardingError

BACKWARD_FACTOR = 3.0  # forward + backward work, as multiples of the forward


@dataclass(frozen=True)
class Devices:
    """The devices of one SPMD program: effective FLOP/s, memory bandwidth, capacity, links."""

    names: tuple[str, ...]
    flops: np.ndarray  # effective FLOP/s
    mem_bw: np.ndarray  # bytes/s
    memory: np.ndarray  # bytes
    links: GroupLinks

    @property
    def n(self) -> int:
        return len(self.names)

    @classmethod
    def from_cluster(cls, cluster: Cluster, dtype: str = "fp32", devices: Sequence[int] | None = None) -> Devices:
        every = cluster.devices
        ids = list(range(len(every))) if devices is None else list(devices)
        for i in ids:
            if not 0 <= i < len(every):
                raise ShardingError(f"device {i} is not in cluster {cluster.name!r} ({len(every)} devices)")
        picked = [every[i] for i in ids]
        eff = DEFAULT_MODEL.gemm_efficiency
        links = group_links(ids, bandwidth_matrix(cluster), latency_matrix(cluster), [d.node for d in every],
                            [max(1, n.nics) for n in cluster.nodes])
        return cls(
            names=tuple(f"gpu {d.id} ({d.kind.name}, node {d.node})" for d in picked),
            flops=np.array([d.kind.flops(dtype) * eff for d in picked]),
            mem_bw=np.array([d.kind.memory_bandwidth * DEFAULT_MODEL.memory_efficiency for d in picked]),
            memory=np.array([float(d.kind.memory_bytes) for d in picked]),
            links=links,
        )


def op_work(op: AtenOp, graph: AtenGraph, devices: Devices) -> np.ndarray:
    """Seconds of forward + backward work of the whole op on each device (``w_i``)."""
    out_bytes = sum(graph.tensors[t].nbytes for t in op.outputs)
    return BACKWARD_FACTOR * (op.flops / devices.flops + out_bytes / devices.mem_bw)


def compute_time(work: np.ndarray, splits: bool, ratios: np.ndarray) -> float:
    """``max_i r_i w_i`` when the strategy splits the work (`Strategy.splits_work`), else ``max_i w_i``."""
    return float(np.max(ratios * work)) if splits else float(np.max(work))


def balanced_time(work: np.ndarray) -> float:
    """The least time any strategy can take: perfect balance, ``1 / sum_i 1 / w_i``."""
    if not np.any(work > 0):
        return 0.0
    return float(1.0 / np.sum(1.0 / work))


PADDED = ("all_gather", "reduce_scatter", "all_to_all")


def comm_affine(comm: Comm, devices: Devices) -> tuple[float, float]:
    """``(a, b)``: the collective takes ``a + b max_i r_i`` seconds (padded shards)."""
    if comm.op not in PADDED:
        return collective_time(comm.op, comm.nbytes, devices.links), 0.0
    n = devices.n
    # padded size n * m * nbytes at m = 1/n (even) and m = 1: the time is affine in the bytes
    t_even = collective_time(comm.op, comm.nbytes, devices.links)
    t_full = collective_time(comm.op, n * comm.nbytes, devices.links)
    slope = (t_full - t_even) / (1.0 - 1.0 / n) if n > 1 else 0.0
    return t_even - slope / n, slope


def comm_time(comm: Comm, devices: Devices, ratios: np.ndarray) -> float:
    a, b = comm_affine(comm, devices)
    return a + b * float(np.max(ratios))
