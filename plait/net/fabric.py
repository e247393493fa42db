"""The directed link graph of a cluster's switched fabric, and how flows are routed over it.

Built from the cluster description (`Cluster.switches`, `NodeSpec.leaf`/`leaves`,
`Cluster.fabric`): every cable is two directed links (full duplex), each with its own
capacity (bytes/s) and latency:

* a NIC port to its leaf and back (``<node>.nic<r>.p<p>>leaf`` / ``leaf><node>.nic<r>.p<p>``),
  capacity ``nic.bandwidth / ports`` (a bonded NIC's ports share its bandwidth);
* leaf to each spine (of its pod) and spine to each core, ``links`` parallel cables each
  (``leaf>spine#k`` and ``spine>leaf#k``), the lower switch's ``uplink`` figures.

Routing between two leaves climbs to the lowest tier that joins them (a spine of the pod;
across pods, a core) and descends. At every switch the equal-cost next hops are the alive
cables towards switches that can still reach the destination (a routing protocol withdraws
the others), and ECMP picks one by hashing the flow's 5-tuple (`plait.net.ecmp`); a bonded
NIC picks its sending port the same way and the destination leaf its port towards a bonded
receiver. A planner instead picks any of these next hops (`plait.net.planner`).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from plait.cluster.spec import Cluster, ClusterError, NcclSpec, SwitchSpec
from plait.net import ecmp, nccl


class FabricError(ClusterError):
    """No path is left between two NICs (the message names the failed links that cut it)."""


@dataclass(frozen=True)
class FlowKey:
    """One flow (a queue pair): NIC `src_nic` of node `src` to NIC `dst_nic` of node `dst`;
    `tag` tells apart flows between the same NICs (channel, collective) and sets its
    UDP source port, as a new queue pair gets a new one."""

    src: int
    src_nic: int
    dst: int
    dst_nic: int
    tag: int = 0

    def five_tuple(self) -> ecmp.FiveTuple:
        ident = zlib.crc32(struct.pack(">5q", self.src, self.src_nic, self.dst, self.dst_nic, self.tag))
        return ecmp.FiveTuple(ecmp.node_ip(self.src, self.src_nic), ecmp.node_ip(self.dst, self.dst_nic),
                              ecmp.source_port(ident))


@dataclass(frozen=True)
class Route:
    """A flow's path: its sending port, the switch-to-switch links, its receiving port."""

    links: tuple[int, ...]  # link ids in order, ports included


class Fabric:
    """Directed links of `cluster`'s switched fabric (see module doc)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        spec = cluster.fabric
        self.ports = spec.ports if spec else 1
        self.nccl = spec.nccl if spec else NcclSpec()
        self.comm_channels = spec.channels if spec else 1  # NCCL channels per connection (large messages)
        # Flows (queue pairs) per connection for large messages: the simulator routes every
        # transfer over this many; `flows_for` gives a message size's own count.
        self.channels = nccl.flows_per_connection(nccl.LARGE, self.comm_channels, self.nccl)
        self.rails = any(s.rail is not None for s in cluster.switches)
        self.seed = spec.ecmp_seed if spec else 0
        self.mode = spec.ecmp_hash if spec else "per_tier"
        self.names: list[str] = []
        self.capacity: list[float] = []
        self.latency: list[float] = []
        self.index: dict[str, int] = {}
        self.switch: dict[str, SwitchSpec] = {s.name: s for s in cluster.switches}
        self.cables: dict[tuple[str, str], list[int]] = {}  # (from, to) -> parallel link ids
        self.port_up: list[list[list[int]]] = []  # [node][nic] -> link ids, one per port
        self.port_down: list[list[list[int]]] = []
        self.nic_leaf: list[list[str]] = []
        self._reach_memo: dict[tuple[str, str, str], bool] = {}
        self._devices = cluster.devices  # a property that builds the list on every call
        self._build()
        self.alive = [True] * len(self.names)
        for f in (spec.failed if spec else []):
            self.fail(f.a, f.b, f.index)

    # ------------------------------------------------------------ construction
    def _add(self, name: str, capacity: float, latency: float) -> int:
        self.index[name] = len(self.names)
        self.names.append(name)
        self.capacity.append(float(capacity))
        self.latency.append(float(latency))
        return self.index[name]

    def _build(self) -> None:
        for node in self.cluster.nodes:
            leaves = node.leaves or [node.leaf] * node.nics
            ups, downs = [], []
            for r, leaf in enumerate(leaves):
                cap = node.nic.bandwidth / self.ports
                port = [f"{node.name}.nic{r}.p{p}" for p in range(self.ports)]
                ups.append([self._add(f"{x}>{leaf}", cap, node.nic.latency / 2) for x in port])
                downs.append([self._add(f"{leaf}>{x}", cap, node.nic.latency / 2) for x in port])
            self.port_up.append(ups)
            self.port_down.append(downs)
            self.nic_leaf.append(list(leaves))
        for lo in self.cluster.switches:
            for hi in self.upper(lo):
                assert lo.uplink is not None  # checked by the loader / check_cluster
                for a, b in ((lo.name, hi.name), (hi.name, lo.name)):
                    self.cables[(a, b)] = [self._add(f"{a}>{b}#{k}", lo.uplink.bandwidth, lo.uplink.latency)
                                           for k in range(lo.links)]

    def upper(self, s: SwitchSpec) -> list[SwitchSpec]:
        """Switches of the next tier cabled to `s` (leaf: spines of its pod; spine: every core)."""
        if s.tier == "leaf":
            return [t for t in self.cluster.switches if t.tier == "spine" and (s.pod is None or t.pod == s.pod)]
        if s.tier == "spine":
            return [t for t in self.cluster.switches if t.tier == "core"]
        return []

    # ------------------------------------------------------------ failures
    def fail(self, a: str, b: str, index: int | None = None) -> list[int]:
        """Take a cable down (both directions); returns the link ids it killed."""
        killed: list[int] = []
        nodes = {n.name: i for i, n in enumerate(self.cluster.nodes)}
        if a in nodes or b in nodes:
            node, leaf = (a, b) if a in nodes else (b, a)
            n = nodes[node]
            for r, lf in enumerate(self.nic_leaf[n]):
                if lf == leaf:
                    ports = range(self.ports) if index is None else [index]
                    killed += [self.port_up[n][r][p] for p in ports] + [self.port_down[n][r][p] for p in ports]
        else:
            for key in ((a, b), (b, a)):
                ids = self.cables.get(key, [])
                killed += ids if index is None else ids[index:index + 1]
        if not killed:
            raise FabricError(f"{self.cluster.source}: fabric.failed_links: no cable joins {a!r} and {b!r}")
        for i in killed:
            self.alive[i] = False
        self._reach_memo.clear()
        return killed

    def restore(self) -> None:
        self.alive = [True] * len(self.names)
        self._reach_memo.clear()

    # ------------------------------------------------------------ routing
    def next_hops(self, at: str, dst: str, phase: str) -> Iterator[tuple[int, str, str]]:
        """(link, next switch, next phase) of every equal-cost hop from `at` towards leaf `dst`,
        alive or not; phase "up" climbs, "down" descends."""
        s = self.switch[at]
        d = self.switch[dst]
        if phase == "down":
            if s.tier == "spine":
                for link in self.cables.get((at, dst), []):
                    yield link, dst, "end"
            elif s.tier == "core":
                for t in self.cluster.switches:
                    if t.tier == "spine" and t.pod == d.pod:
                        for link in self.cables.get((at, t.name), []):
                            yield link, t.name, "down"
            return
        for t in self.upper(s):
            if t.tier == "spine":
                nxt = "down" if (d.pod is None or t.pod == d.pod) else "up"
            else:
                nxt = "down"
            for link in self.cables[(at, t.name)]:
                yield link, t.name, nxt

    def _reach(self, at: str, dst: str, phase: str) -> bool:
        """Whether some alive path leads from `at` (in `phase`) to leaf `dst` (memoised)."""
        if phase == "end":
            return True
        key = (at, dst, phase)
        hit = self._reach_memo.get(key)
        if hit is None:
            hit = self._reach_memo[key] = any(self.alive[link] and self._reach(nxt, dst, ph)
                                              for link, nxt, ph in self.next_hops(at, dst, phase))
        return hit

    def choices(self, at: str, dst: str, phase: str) -> list[tuple[int, str, str]]:
        """The alive next hops from which ECMP (or a planner) picks, in a fixed order."""
        return [(link, nxt, ph) for link, nxt, ph in self.next_hops(at, dst, phase)
                if self.alive[link] and self._reach(nxt, dst, ph)]

    def _no_path(self, what: str, dead: list[int]) -> FabricError:
        named = ", ".join(self.names[i] for i in dead) or "none"
        return FabricError(f"{self.cluster.source}: fabric: no path left {what}; failed links: {named}")

    def _dead_between(self, at: str, dst: str, phase: str) -> list[int]:
        """Failed links on the equal-cost routes from `at` to `dst` (the ones that cut them)."""
        dead: list[int] = []
        seen = {(at, phase)}
        stack = [(at, phase)]
        while stack:
            node, ph = stack.pop()
            for link, nxt, nph in self.next_hops(node, dst, ph):
                if not self.alive[link]:
                    dead.append(link)
                elif nph != "end" and (nxt, nph) not in seen:
                    seen.add((nxt, nph))
                    stack.append((nxt, nph))
        return sorted(set(dead))

    def route_ecmp(self, flow: FlowKey, five: ecmp.FiveTuple | None = None) -> Route:
        """The path ECMP and the bonds give `flow` (deterministic in the fabric's seed and mode);
        `five`: its 5-tuple when not the one its tag gives (a chosen UDP source port)."""
        five = five or flow.five_tuple()
        src_ports = self._alive_ports(self.port_up, flow.src, flow.src_nic, "sending")
        dst_ports = self._alive_ports(self.port_down, flow.dst, flow.dst_nic, "receiving")
        links = [src_ports[ecmp.choose(five, len(src_ports), self.seed, "bond", self.mode)]]
        links += self.walk(self.nic_leaf[flow.src][flow.src_nic], self.nic_leaf[flow.dst][flow.dst_nic],
                           lambda opts, tier: ecmp.choose(five, len(opts), self.seed, tier, self.mode))
        links.append(dst_ports[ecmp.choose(five, len(dst_ports), self.seed ^ 0x5BD1E995, "bond", self.mode)])
        return Route(tuple(links))

    def _alive_ports(self, table: list[list[list[int]]], node: int, nic: int, what: str) -> list[int]:
        ports = [p for p in table[node][nic] if self.alive[p]]
        if not ports:
            raise self._no_path(f"at the {what} NIC {self.cluster.nodes[node].name}.nic{nic}", table[node][nic])
        return ports

    def walk(self, src_leaf: str, dst_leaf: str, pick) -> list[int]:
        """Switch links from `src_leaf` to `dst_leaf`, `pick(options, tier)` choosing each hop."""
        links: list[int] = []
        at, phase = src_leaf, "up"
        if src_leaf == dst_leaf:
            return links
        while phase != "end":
            opts = self.choices(at, dst_leaf, phase)
            if not opts:
                raise self._no_path(f"from {at} towards {dst_leaf}", self._dead_between(at, dst_leaf, phase))
            link, at, phase = opts[pick(opts, self.switch[at].tier)]
            links.append(link)
        return links

    def all_switch_paths(self, src_leaf: str, dst_leaf: str) -> list[tuple[int, ...]]:
        """Every equal-cost alive switch path between two leaves (small fabrics: tests, LP checks)."""
        if src_leaf == dst_leaf:
            return [()]
        out: list[tuple[int, ...]] = []

        def rec(at: str, phase: str, acc: tuple[int, ...]) -> None:
            if phase == "end":
                out.append(acc)
                return
            for link, nxt, ph in self.choices(at, dst_leaf, phase):
                rec(nxt, ph, acc + (link,))

        rec(src_leaf, "up", ())
        return out

    def flows_for(self, nbytes: float) -> int:
        """Flows (queue pairs) NCCL opens on one connection for a message of `nbytes` per rank."""
        return nccl.flows_per_connection(nbytes, self.comm_channels, self.nccl)

    def nic_of(self, local: int, gpus: int, nics: int) -> int:
        """The NIC a GPU uses (GPU-NIC affinity: GPUs split evenly over the NICs, as NCCL does)."""
        return local * nics // max(1, gpus)

    def endpoint(self, device: int) -> tuple[int, int]:
        """(node, NIC) of a device."""
        dev = self._devices[device]
        node = self.cluster.nodes[dev.node]
        return dev.node, self.nic_of(dev.local, len(node.gpus), node.nics)


def fabric_of(cluster: Cluster) -> Fabric | None:
    """The fabric when `cluster` describes switches (leaves), else None (cached per content)."""
    if not any(s.tier == "leaf" for s in cluster.switches):
        return None
    key = (id(cluster), _content(cluster))
    hit = cluster.__dict__.get("_plait_net_fabric")
    if hit is None or hit[0] != key:
        hit = (key, Fabric(cluster))
        cluster.__dict__["_plait_net_fabric"] = hit
    return hit[1]


def _content(cluster: Cluster) -> tuple:
    return (tuple((n.name, n.nics, n.nic, n.leaf, tuple(n.leaves or ())) for n in cluster.nodes),
            tuple((s.name, s.tier, s.uplink, s.links, s.pod) for s in cluster.switches),
            None if cluster.fabric is None else (cluster.fabric.ports, cluster.fabric.channels,
                                                 cluster.fabric.ecmp_seed, cluster.fabric.ecmp_hash,
                                                 tuple(cluster.fabric.failed), cluster.fabric.nccl))
