"""The one device model: a cluster's devices as every cost, planner and the simulator read them.

Per device its GPU kind and node; the effective device-to-device bandwidth and latency matrices
(`plait.cluster.topology`, cached per cluster); each node's NICs and their aggregate bandwidth; the
measured collective tables in force (`plait.cost.collectives.measured_tables`). Two views build on
it and nothing else: the SPMD cost model's device group at a dtype (`plait.cost.spmd.Devices.of`)
and the simulator's view with link resources and the switched fabric (`plait.net.view.
ClusterView`, a `DeviceModel` itself). A group's ring summary (`group`) is computed here once for
both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plait.cluster.spec import Cluster, GPUKind
from plait.cluster.topology import bandwidth_matrix, latency_matrix
from plait.cost.collectives import GroupLinks, group_links, measured_tables


@dataclass
class DeviceModel:
    """Per-device facts of one cluster (built from a `Cluster`, or by hand: `uniform`)."""

    kinds: list[GPUKind]
    node_of: np.ndarray
    bandwidth: np.ndarray
    latency: np.ndarray
    node_nic_bandwidth: list[float] | None = None  # aggregate NIC egress per node (bytes/s)
    node_nics: list[int] | None = None  # NICs per node (collective channels across nodes)
    measured: tuple = ()  # measured collective busbw tables in force (cost.collectives.measured_tables)
    name: str = "cluster"
    cluster: Cluster | None = None
    _groups: dict = field(default_factory=dict, repr=False)

    @staticmethod
    def facts_of(cluster: Cluster) -> dict[str, Any]:
        """The fields of `cluster`'s device model, as keyword arguments (for a subclass's own)."""
        devices = cluster.devices
        return {"kinds": [d.kind for d in devices],
                "node_of": np.array([d.node for d in devices], dtype=np.int64),
                "bandwidth": np.asarray(bandwidth_matrix(cluster), dtype=float),
                "latency": np.asarray(latency_matrix(cluster), dtype=float),
                "node_nic_bandwidth": [n.nic.bandwidth * max(1, n.nics) for n in cluster.nodes],
                "node_nics": [max(1, n.nics) for n in cluster.nodes],
                "measured": measured_tables(cluster), "name": cluster.name, "cluster": cluster}

    @classmethod
    def of_cluster(cls, cluster: Cluster) -> DeviceModel:
        return cls(**cls.facts_of(cluster))

    @classmethod
    def uniform(cls, num_devices: int, kind: GPUKind, gpus_per_node: int, intra_bandwidth: float,
                intra_latency: float, inter_bandwidth: float = 25e9, inter_latency: float = 5e-6,
                nics_per_node: int | None = None, name: str = "uniform") -> Any:
        """A homogeneous cluster without a `Cluster` object (tests, benchmarks)."""
        node_of = np.arange(num_devices) // gpus_per_node
        same = node_of[:, None] == node_of[None, :]
        bw = np.where(same, intra_bandwidth, inter_bandwidth).astype(float)
        lat = np.where(same, intra_latency, inter_latency).astype(float)
        np.fill_diagonal(bw, kind.memory_bandwidth)
        np.fill_diagonal(lat, 0.0)
        nodes = int(node_of.max()) + 1
        nics = gpus_per_node if nics_per_node is None else nics_per_node
        return cls(kinds=[kind] * num_devices, node_of=node_of, bandwidth=bw, latency=lat,
                   node_nic_bandwidth=[inter_bandwidth * nics] * nodes, node_nics=[nics] * nodes, name=name)

    @property
    def num_devices(self) -> int:
        return len(self.kinds)

    def group(self, devices: Sequence[int]) -> GroupLinks:
        """Slowest-link summary of the ring over `devices`, in that order (cached)."""
        key = tuple(devices)
        hit = self._groups.get(key)
        if hit is None:
            hit = self._groups[key] = group_links(key, self.bandwidth, self.latency, self.node_of,
                                                  self.node_nics, self.measured)
        return hit

    def pair(self, src: int, dst: int) -> tuple[float, float]:
        """(bandwidth, latency) of the pair."""
        return float(self.bandwidth[src, dst]), float(self.latency[src, dst])
