"""Adaptive routing as per-packet spraying, in the fluid limit: the second ECMP baseline.

A fabric that sprays packets (InfiniBand adaptive routing, Ethernet packet spraying with
receivers that reorder) does not pin a flow to one path: every switch sends each packet of a
flow to one of its equal-cost next hops, round-robin or at random, so over a collective's
many packets each next hop carries an equal share of the flow. Random packet spraying
(Dixit, Prakash, Hu, Kompella, "On the Impact of Packet Spraying in Data Center Networks",
INFOCOM 2013) is the oblivious form; the fluid limit of it is an even split at every hop:

* a bonded NIC sends ``1/p`` of the flow on each of its ``p`` alive ports;
* every switch splits what reaches it evenly over its alive next hops towards the
  destination leaf (`Fabric.choices`: the cables a routing protocol still offers);
* the destination leaf splits evenly over the receiving NIC's alive ports.

On a symmetric leaf/spine this is an even split over all equal-cost paths and reaches the LP
bound (`planner.ideal`) for any traffic whose leaf-level demands are balanced; with a failed
cable it is not optimal: a leaf still sends ``1/s`` to a spine that has lost one of its
``c`` cables towards the destination, whose ``c - 1`` others then carry ``1/(s (c - 1))``
each (the reason for weighted ECMP). Packet reordering, congestion control and the
receivers' reorder buffers are not modelled: this is the best a sprayed fabric can do.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from plait.net.fabric import Fabric, FabricError
from plait.net.flows import Flow


def _switch_shares(fabric: Fabric, src_leaf: str, dst_leaf: str) -> dict[int, float]:
    """Share of a flow's bytes on each switch link between two leaves when every switch splits
    evenly over its alive next hops (raises FabricError naming the dead links when cut)."""
    if src_leaf == dst_leaf:
        return {}
    shares: dict[int, float] = defaultdict(float)
    mass: dict[tuple[str, str], float] = {(src_leaf, "up"): 1.0}
    # Hops only climb then descend, so states come in rounds: spread each round's mass.
    while mass:
        nxt_mass: dict[tuple[str, str], float] = defaultdict(float)
        for (at, phase), m in mass.items():
            opts = fabric.choices(at, dst_leaf, phase)
            if not opts:  # as `Fabric.walk`: name the failed links that cut it
                raise fabric._no_path(f"from {at} towards {dst_leaf}", fabric._dead_between(at, dst_leaf, phase))
            for link, nxt, nph in opts:
                shares[link] += m / len(opts)
                if nph != "end":
                    nxt_mass[(nxt, nph)] += m / len(opts)
        mass = nxt_mass
    return dict(shares)


def _alive_ports(fabric: Fabric, table: list[list[list[int]]], node: int, nic: int) -> list[int]:
    ports = [p for p in table[node][nic] if fabric.alive[p]]
    if not ports:
        raise FabricError(f"{fabric.cluster.source}: fabric: NIC {fabric.cluster.nodes[node].name}.nic{nic} "
                          f"has no port left; failed links: {', '.join(fabric.names[p] for p in table[node][nic])}")
    return ports


def spray_load(fabric: Fabric, flows: Sequence[Flow]) -> np.ndarray:
    """Bytes on each link (indexed as `Fabric.names`) when every flow is sprayed evenly at every
    hop (module doc). ``max(load / capacity)`` is the network time T, as for `planner.Assignment`."""
    load = np.zeros(len(fabric.names))
    pair_bytes: dict[tuple[str, str], float] = defaultdict(float)
    for f in flows:
        k = f.key
        up = _alive_ports(fabric, fabric.port_up, k.src, k.src_nic)
        down = _alive_ports(fabric, fabric.port_down, k.dst, k.dst_nic)
        for p in up:
            load[p] += f.bytes / len(up)
        for p in down:
            load[p] += f.bytes / len(down)
        pair_bytes[(fabric.nic_leaf[k.src][k.src_nic], fabric.nic_leaf[k.dst][k.dst_nic])] += f.bytes
    for (a, b), nbytes in pair_bytes.items():
        for link, share in _switch_shares(fabric, a, b).items():
            load[link] += nbytes * share
    return load


def spray_time(fabric: Fabric, flows: Sequence[Flow]) -> float:
    """T (seconds): bytes on the busiest link over its capacity, flows sprayed."""
    return float(np.max(spray_load(fabric, flows) / np.asarray(fabric.capacity)))
