"""The inter-node flows of a plan: every ring neighbour pair of its collectives and every
pipeline send between nodes, split into the fabric's channels (one 5-tuple each).

TODO(plait.cost.traffic): the traffic module being written on branch ``traffic`` lists every
message of a plan (source, destination, bytes, class); once it is on main this module's
`plan_flows` should read its flows from there instead of deriving ring hops itself.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from plait.cluster.spec import Cluster
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
    """The flow (queue pair) of `channel` between two devices: its NICs by GPU-NIC affinity and
    a tag naming the device pair, so distinct communicators get distinct 5-tuples."""
    sn, snic = fabric.endpoint(src)
    dn, dnic = fabric.endpoint(dst)
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
    ch = fabric.channels
    per_pair: dict[tuple[int, int], list[float | str]] = {}

    def add(a: int, b: int, nbytes: float, traffic: str) -> None:
        if node[a].node == node[b].node or nbytes <= 0:
            return
        entry = per_pair.setdefault((a, b), [0.0, traffic])
        entry[0] = float(entry[0]) + nbytes

    for s in range(plan.pp):
        for t in range(plan.tp):
            ring = [plan.device_of(plan.rank(s, d, t)) for d in range(plan.dp)]
            hop = ring_hop_bytes("all_reduce", grad_bytes[s], len(ring))
            for a, b in zip(ring, ring[1:] + ring[:1]):
                if a != b:
                    add(a, b, hop, "dp")
    m = plan.num_micro_batches
    for s in range(plan.pp - 1):
        for d in range(plan.dp):
            for t in range(plan.tp):
                a, b = plan.device_of(plan.rank(s, d, t)), plan.device_of(plan.rank(s + 1, d, t))
                add(a, b, activation_bytes * m, "pp")
                add(b, a, activation_bytes * m, "pp")
    out = []
    for (a, b), (nbytes, traffic) in per_pair.items():
        for c in range(ch):
            out.append(Flow(device_flow(fabric, a, b, c), a, b, c, float(nbytes) / ch, str(traffic)))
    return out


def stage_traffic(plan: Plan, graph: OpGraph, grad_bytes_per_param: int = 2) -> tuple[list[float], float]:
    """(gradient bytes of one tensor rank per pipeline stage, activation bytes a tensor rank sends
    to the next stage per micro-batch) of `plan` on `graph`: the inputs of `plan_flows`.

    Interleaved stages (virtual chunks) are summed per device stage. The activation message is
    the first stage's last layer's output, as the simulator's pipeline sends carry it, split
    over the tensor ranks."""
    counts = plan.layers_per_stage(len(graph.layers), [layer.tp_style for layer in graph.layers])
    grads = [0.0] * plan.pp
    start = 0
    for chunk, count in enumerate(counts):
        layers = graph.layers[start:start + count]
        grads[chunk % plan.pp] += sum(layer.param_count for layer in layers) * grad_bytes_per_param / plan.tp
        start += count
    boundary = graph.layers[counts[0] - 1] if counts and counts[0] > 0 else None
    per_sample = boundary.output_bytes if boundary is not None else 0.0
    return grads, per_sample * plan.micro_batch / plan.tp
