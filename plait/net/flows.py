"""The inter-node flows of a plan, split into the flows NCCL opens (channels x queue pairs, one
5-tuple each; `plait.net.nccl`).

`traffic_flows` takes them from the one traffic module (`plait.cost.traffic`: every message of a
plan over the one stage graph, ring hops, pipeline edges, ZeRO and tied traffic, in the plan's
gradient dtype); `plan_flows` builds the same ring and pipeline flows from given per-stage
gradient and activation bytes, for a model given only by its sizes (bench/traffic.py's 22B GPT).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from plait.cluster.spec import Cluster
from plait.cost.collectives import ring_hops
from plait.ir.opgraph import OpGraph
from plait.ir.plan import Plan
from plait.net.fabric import Fabric, FlowKey


@dataclass(frozen=True)
class Flow:
    key: FlowKey
    src_device: int
    dst_device: int
    channel: int
    bytes: float
    traffic: str  # "dp" | "pp" | "tp"


def device_flow(fabric: Fabric, src: int, dst: int, channel: int) -> FlowKey:
    """The flow (queue pair `channel`, `plait.net.nccl` numbering) between two devices: its NICs
    by GPU-NIC affinity and a tag naming the device pair, so distinct communicators get distinct
    5-tuples. With PXN on a rail-optimised fabric a send to a peer on another rail leaves from
    the sender node's NIC of the peer's rail (NCCL relays it over NVLink), so it stays on-rail."""
    sn, snic = fabric.endpoint(src)
    dn, dnic = fabric.endpoint(dst)
    if fabric.rails and fabric.nccl.pxn and snic != dnic and dnic < len(fabric.nic_leaf[sn]):
        snic = dnic
    tag = zlib.crc32(struct.pack(">3q", src, dst, channel))
    return FlowKey(sn, snic, dn, dnic, tag)


def ring_hop_bytes(op: str, nbytes: float, n: int) -> float:
    """Bytes one ring neighbour sends in a ring collective of `n` ranks over `nbytes` per rank
    (Patarasuk & Yuan: all-reduce sends 2(n-1)/n of the buffer, reduce-scatter and
    all-gather (n-1)/n)."""
    if n < 2:
        return 0.0
    return nbytes * (2 if op == "all_reduce" else 1) * (n - 1) / n


def plan_flows(plan: Plan, cluster: Cluster, fabric: Fabric, grad_bytes: Sequence[float],
               activation_bytes: float = 0.0) -> list[Flow]:
    """Inter-node flows of one iteration of `plan` on `cluster`.

    `grad_bytes[s]`: gradient bytes of one tensor rank of stage `s` (the data-parallel ring
    all-reduces them; ZeRO >= 1 reduce-scatters and all-gathers, the same bytes on the wire);
    `activation_bytes`: bytes a tensor rank sends to the next stage per micro-batch (and the
    same gradient back)."""
    node = cluster.devices
    per_pair: dict[tuple[int, int], list] = {}

    def add(a: int, b: int, nbytes: float, traffic: str, call: float) -> None:
        if node[a].node == node[b].node or nbytes <= 0:
            return
        entry = per_pair.setdefault((a, b), [0.0, traffic, 0.0])
        entry[0] += nbytes
        entry[2] = max(entry[2], call)

    node_of = [d.node for d in node]
    nics = [max(1, n.nics) for n in cluster.nodes]
    for s in range(plan.pp):
        for t in range(plan.tp):
            ring = [plan.device_of(plan.rank(s, d, t)) for d in range(plan.dp)]
            hop = ring_hop_bytes("all_reduce", grad_bytes[s], len(ring))
            for a, b, share in ring_hops(ring, node_of, nics):  # a node crossing on NCCL's rails
                if a != b:
                    add(a, b, hop * share, "dp", grad_bytes[s])
    m = plan.num_micro_batches
    for s in range(plan.pp - 1):
        for d in range(plan.dp):
            for t in range(plan.tp):
                a, b = plan.device_of(plan.rank(s, d, t)), plan.device_of(plan.rank(s + 1, d, t))
                add(a, b, activation_bytes * m, "pp", activation_bytes)
                add(b, a, activation_bytes * m, "pp", activation_bytes)
    return _split(fabric, per_pair)


def _split(fabric: Fabric, per_pair: dict[tuple[int, int], list]) -> list[Flow]:
    """Each device pair's bytes split evenly over the flows NCCL opens for its largest message
    (`Fabric.flows_for`: channels for that size x queue pairs), each flow whole."""
    out = []
    for (a, b), (nbytes, traffic, call) in per_pair.items():
        ch = fabric.flows_for(call)
        out += [Flow(device_flow(fabric, a, b, c), a, b, c, float(nbytes) / ch, str(traffic)) for c in range(ch)]
    return out


def traffic_flows(plan: Plan, cluster: Cluster, fabric: Fabric, graph: OpGraph) -> list[Flow]:
    """Inter-node flows of one iteration of `plan` on `graph`, from `plait.cost.traffic` (the bytes
    the planner and the simulator carry; a ring hop between nodes spread over the rails NCCL
    drives, `plait.cost.collectives.ring_hops`), summed per device pair and split over the
    fabric's channels."""
    from plait.cost.traffic import iteration_traffic

    node = cluster.devices
    node_of = [d.node for d in node]
    per_pair: dict[tuple[int, int], list] = {}
    for f in iteration_traffic(graph, plan).flows(node_of, [max(1, n.nics) for n in cluster.nodes]):
        if f.src == f.dst or node[f.src].node == node[f.dst].node or f.nbytes <= 0:
            continue
        entry = per_pair.setdefault((f.src, f.dst), [0.0, f.cls, 0.0])
        entry[0] += f.nbytes
        entry[2] = max(entry[2], f.call_bytes)
    return _split(fabric, per_pair)
