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


def to_plan_field(fabric: Fabric, flows: Sequence[Flow], routes: Sequence[Route]) -> dict[str, Any]:
    """The `Plan.flow_paths` value of planned `routes`."""
    return {"version": FLOW_PATHS_VERSION,
            "paths": [[f.src_device, f.dst_device, f.channel, [fabric.names[i] for i in r.links]]
                      for f, r in zip(flows, routes)]}


def from_plan_field(fabric: Fabric, value: dict[str, Any]) -> dict[tuple[int, int, int], tuple[int, ...]]:
    """Link ids per (src device, dst device, channel); PlanError naming an unknown link."""
    out = {}
    for i, (src, dst, channel, names) in enumerate(value["paths"]):
        ids = []
        for name in names:
            if name not in fabric.index:
                raise PlanError(f"plan field 'flow_paths.paths[{i}]': link {name!r} is not in the fabric of "
                                f"cluster {fabric.cluster.name!r}")
            if not fabric.alive[fabric.index[name]]:
                raise PlanError(f"plan field 'flow_paths.paths[{i}]': link {name!r} has failed; re-plan")
            ids.append(fabric.index[name])
        out[(src, dst, channel)] = tuple(ids)
    return out
