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
    for i, item in enumerate(value["paths"]):
        src, dst, channel, names = item[:4]
        share = float(item[4]) if len(item) > 4 else 1.0
        ids = []
        for name in names:
            if name not in fabric.index:
                raise PlanError(f"plan field 'flow_paths.paths[{i}]': link {name!r} is not in the fabric of "
                                f"cluster {fabric.cluster.name!r}")
            if not fabric.alive[fabric.index[name]]:
                raise PlanError(f"plan field 'flow_paths.paths[{i}]': link {name!r} has failed; re-plan")
            ids.append(fabric.index[name])
        out.setdefault((src, dst, channel), []).append((share, tuple(ids)))
    for (src, dst, channel), pieces in out.items():
        total = sum(share for share, _ids in pieces)
        if abs(total - 1.0) > 1e-6:
            raise PlanError(f"plan field 'flow_paths': the shares of flow {src}->{dst} channel {channel} "
                            f"add up to {total:.6g}, not 1")
    return out
