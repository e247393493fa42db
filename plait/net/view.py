"""A cluster resolved once for pricing its transfers (`ClusterView`): device kinds, pair bandwidths
and latencies, link resources -- what the simulator runs on and the planners estimate with
(the search hands the one view of its `Simulator` to every family).

A transfer from device ``i`` to ``j`` crosses *resources* whose bandwidth concurrent
transfers share (`plait.sim.engine`):

* the pair path ``i->j`` at the effective pair bandwidth ``B[i, j]`` (what
  `Cluster.bandwidth_matrix` reports: NVLink/NVSwitch port, PCIe, or the slower NIC);
  inside a node it is only a separate resource when narrower than the ports;
* inside a node, the sender's egress port and the receiver's ingress port (an NVSwitch
  port carries every flow of its GPU: two transfers out of one GPU to different peers
  share it);
* across nodes, the sender's and receiver's NIC (one NIC per GPU, rail-affine as NCCL
  uses them) and the nodes' aggregate NIC capacity (``nics * nic bandwidth``), which the
  GPUs of a node share.

On a cluster that describes a switched fabric (leaves, spines, cores; `plait.net.fabric`) a
transfer between nodes instead crosses the fabric's directed links: its channels (one
5-tuple each) take the sending NIC port the bond hashes them to, the cables ECMP hashes
them to at every switch (or the paths a traffic plan gives, `Plan.flow_paths`), and the
receiving port; `route` gives each link with the share of the transfer's bytes it carries.

Resources are created lazily, so a 4096-GPU cluster costs nothing until a flow uses it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from plait.cluster.spec import Cluster
from plait.cost.collectives import ring_hops
from plait.cost.devices import DeviceModel
from plait.net.fabric import Fabric, fabric_of
from plait.net.flows import device_flow


@dataclass
class ClusterView(DeviceModel):
    """The one device model (`plait.cost.devices.DeviceModel`: kinds, nodes, pair bandwidths and
    latencies, NICs, measured tables) with what the engine adds: link resources, and the switched
    fabric's paths (built from a `Cluster` or by hand, `uniform`)."""

    fabric: Fabric | None = None  # switched fabric: inter-node transfers follow its paths
    # planned paths per (src, dst, channel): (share of its bytes, link ids) each
    flow_paths: dict[tuple[int, int, int], list[tuple[float, tuple[int, ...]]]] | None = None
    _routes: dict = field(default_factory=dict, repr=False)
    _port: np.ndarray | None = field(default=None, repr=False)
    _nic: np.ndarray | None = field(default=None, repr=False)
    _paths: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_cluster(cls, cluster: Cluster) -> ClusterView:
        return cls(**DeviceModel.facts_of(cluster), fabric=fabric_of(cluster))

    def with_flow_paths(self, paths: dict[tuple[int, int, int], list[tuple[float, tuple[int, ...]]]] | None
                        ) -> ClusterView:
        """This view with planned flow paths ((share, link ids) per (src device, dst device, channel))."""
        if paths == self.flow_paths:
            return self
        return dataclasses.replace(self, flow_paths=paths, _routes={}, _paths={}, _groups={})

    # ---------------------------------------------------------------- capacities
    def _ports(self) -> tuple[np.ndarray, np.ndarray]:
        if self._port is None:
            bw = self.bandwidth.copy()
            np.fill_diagonal(bw, 0.0)
            same = self.node_of[:, None] == self.node_of[None, :]
            self._port = np.where(same, bw, 0.0).max(axis=1)
            self._nic = np.where(~same, bw, 0.0).max(axis=1)
        return self._port, self._nic  # type: ignore[return-value]

    def path(self, src: int, dst: int) -> list[tuple[tuple, float]]:
        """Resources (key, capacity in bytes/s) a transfer src -> dst crosses."""
        if src == dst:
            return []
        hit = self._paths.get((src, dst))
        if hit is not None:
            return hit
        out = self._path(src, dst)
        self._paths[(src, dst)] = out
        return out

    def route(self, src: int, dst: int) -> list[tuple[tuple, float, float]]:
        """Resources (key, capacity, share of the transfer's bytes) a transfer src -> dst crosses;
        without a fabric every share is 1 (`path`)."""
        hit = self._routes.get((src, dst))
        if hit is not None:
            return hit
        fab = self.fabric
        if fab is None or src == dst or int(self.node_of[src]) == int(self.node_of[dst]):
            out = [(k, cap, 1.0) for k, cap in self.path(src, dst)]
        else:
            share: dict[int, float] = {}
            # A planned pair carries its bytes on the flows the plan lists (NCCL opens fewer for
            # small messages, `plait.net.nccl`); an unplanned one on ECMP's routes of all of them.
            fp = self.flow_paths or {}
            planned_ch = [c for c in range(fab.channels) if (src, dst, c) in fp]
            chans = planned_ch or list(range(fab.channels))
            for c in chans:
                planned = fp.get((src, dst, c))
                if planned is None:
                    planned = [(1.0, fab.route_ecmp(device_flow(fab, src, dst, c)).links)]
                for part, links in planned:  # a split flow: each path carries its part
                    for link in links:
                        share[link] = share.get(link, 0.0) + part / len(chans)
            out = [(("link", link), fab.capacity[link], x) for link, x in share.items()]
        self._routes[(src, dst)] = out
        return out

    def _path(self, src: int, dst: int) -> list[tuple[tuple, float]]:
        port, nic = self._ports()
        pair = float(self.bandwidth[src, dst])
        out: list[tuple[tuple, float]] = []
        ns, nd = int(self.node_of[src]), int(self.node_of[dst])
        if ns == nd:
            out.append((("out", src), float(port[src]) or pair))
            out.append((("in", dst), float(port[dst]) or pair))
            # Behind a switch (NVSwitch) the pair path is as wide as the ports, which already
            # bound it; only a narrower pair path (PCIe, measured override) is its own resource.
            if pair < min(out[0][1], out[1][1]):
                out.insert(0, (("pair", src, dst), pair))
            return out
        out.append((("pair", src, dst), pair))
        out.append((("nic_out", src), float(nic[src])))
        out.append((("nic_in", dst), float(nic[dst])))
        if self.node_nic_bandwidth is not None:
            out.append((("node_out", ns), float(self.node_nic_bandwidth[ns])))
            out.append((("node_in", nd), float(self.node_nic_bandwidth[nd])))
        return out

    def ring_loads(self, ring: Sequence[int]) -> tuple[float, list[tuple[int, int, float]]]:
        """(slowest pair bandwidth B of the ring, [(src, dst, load)]) for a ring collective over
        `ring` run as one flow of ``t x B`` bytes, `t` its bandwidth phase: the hops NCCL drives
        (`plait.cost.collectives.ring_hops`: between nodes, one per rail) with the bytes each
        carries as a multiple of the flow's. A ring hop carries ``t x`` the ring's bandwidth
        (inter-node hops at all rails' bandwidth), a rail its share of that."""
        devs = list(ring)
        hops = list(zip(devs, devs[1:] + devs[:1]))
        slowest = min(float(self.bandwidth[a, b]) for a, b in hops)
        scale = self.group(devs).ring_bandwidth / slowest
        return slowest, [(a, b, share * scale)
                         for a, b, share in ring_hops(devs, self.node_of, self.node_nics)]


def pair_loads(view: ClusterView, a: list[int], b: list[int], nbytes: float) -> tuple[float, dict[tuple, tuple[float, float]]]:
    """A message of `nbytes` from group `a` (every rank holds it whole) to group `b`: ``k = min(|a|,
    |b|)`` rank pairs carry ``1/k`` each over their routes (Megatron's scatter/gather over tensor
    ranks). (latency, {link resource: (capacity, bytes)})."""
    k = min(len(a), len(b))
    loads: dict[tuple, tuple[float, float]] = {}
    lat = 0.0
    for s, d in zip(a[:k], b[:k]):
        lat = max(lat, view.pair(s, d)[1])
        for key, cap, part in view.route(s, d):
            old = loads.get(key, (cap, 0.0))[1]
            loads[key] = (cap, old + nbytes / k * part)
    return lat, loads


def transfer_seconds(view: ClusterView, a: list[int], b: list[int], nbytes: float) -> float:
    """The time of `pair_loads`' message alone on the links (its busiest link, plus latency): the
    pipeline message the simulator lowers (`plait.sim.lowering.pipeline`) without the all-gather after it;
    what the composed family's estimate ranks by."""
    lat, loads = pair_loads(view, a, b, nbytes)
    return lat + max((x / cap for cap, x in loads.values() if cap > 0), default=0.0)
