"""Per-flow paths as a Plan stores them (`Plan.flow_paths`) and back to link ids.

Stored by link *name* (``h-3.nic0.p1>leaf0-r0``, ``leaf0-r0>spine2#1``, ...) so that a plan
file reads on any load of the same cluster description. Applying them on a real fabric:
RoCEv2 switches hash the UDP source port of each queue pair, so a planner that knows the
switches' hash picks, per queue pair, a source port that hashes onto the planned cable
(C4P's approach); alternatively policy routes per (source, destination) address pair on
hosts and switches. A bonded NIC's port follows its transmit hash the same way, or the
flow is sent from the port's own address.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait.ir.plan import FLOW_PATHS_VERSION, PlanError
from plait.net.fabric import Fabric, Route
from plait.net.flows import Flow


def to_plan_field(fabric: Fabric, flows: Sequence[Flow],
                  routes: Sequence[Route | Sequence[tuple[float, Route]]]) -> dict[str, Any]:
    """The `Plan.flow_paths` value of planned `routes` (`Assignment.paths()`: a flow split over
    several paths has one entry per path, its share of the flow's bytes fifth)."""
    out = []
    for f, r in zip(flows, routes):
        pieces = [(1.0, r)] if isinstance(r, Route) else list(r)
        for share, route in pieces:
            item: list[Any] = [f.src_device, f.dst_device, f.channel, [fabric.names[i] for i in route.links]]
            if len(pieces) > 1:
                item.append(float(share))
            out.append(item)
    return {"version": FLOW_PATHS_VERSION, "paths": out}


def from_plan_field(fabric: Fabric, value: dict[str, Any]
                    ) -> dict[tuple[int, int, int], list[tuple[float, tuple[int, ...]]]]:
    """(share, link ids) of each path per (src device, dst device, channel); PlanError naming an
    unknown or failed link, or a flow whose shares do not add up to 1."""
    out: dict[tuple[int, int, int], list[tuple[float, tuple[int, ...]]]] = {}
    devices = len(fabric.cluster.devices)
    for i, item in enumerate(value["paths"]):
        src, dst, channel, names = item[:4]
        where = f"plan field 'flow_paths.paths[{i}]'"
        share = float(item[4]) if len(item) > 4 else 1.0
        for d in (src, dst):
            if d >= devices:
                raise PlanError(f"{where}: device {d} is not in cluster {fabric.cluster.name!r} ({devices} devices)")
        if channel >= fabric.channels:
            raise PlanError(f"{where}: flow index {channel}, but the fabric opens {fabric.channels} flows per "
                            f"connection (fabric.channels x fabric.nccl.qps_per_connection); re-plan")
        ids = []
        for name in names:
            if name not in fabric.index:
                raise PlanError(f"{where}: link {name!r} is not in the fabric of cluster {fabric.cluster.name!r}")
            if not fabric.alive[fabric.index[name]]:
                raise PlanError(f"{where}: link {name!r} has failed; re-plan")
            ids.append(fabric.index[name])
        _check_ends(fabric, where, src, dst, ids)
        out.setdefault((src, dst, channel), []).append((share, tuple(ids)))
    for (src, dst, channel), pieces in out.items():
        total = sum(share for share, _ids in pieces)
        if abs(total - 1.0) > 1e-6:
            raise PlanError(f"plan field 'flow_paths': the shares of flow {src}->{dst} channel {channel} "
                            f"add up to {total:.6g}, not 1")
    return out


def _check_ends(fabric: Fabric, where: str, src: int, dst: int, ids: list[int]) -> None:
    """A stored path must leave from a port of the sending node's NICs and end at one of the
    receiving node's (a path copied from another plan or cluster names the wrong ones)."""
    sn, dn = fabric.endpoint(src)[0], fabric.endpoint(dst)[0]
    up = {p for ports in fabric.port_up[sn] for p in ports}
    down = {p for ports in fabric.port_down[dn] for p in ports}
    if not ids or ids[0] not in up or ids[-1] not in down:
        raise PlanError(f"{where}: the path does not run from a NIC port of node "
                        f"{fabric.cluster.nodes[sn].name!r} (device {src}) to one of node "
                        f"{fabric.cluster.nodes[dn].name!r} (device {dst})")
