"""One call for a planner or a command: a plan's flows on a cluster's fabric, their planned
paths (whole flows: one path per queue pair) stored in the plan, and what the planning bought
(bottleneck times of ECMP, of the planned paths, the whole-flow bound and the LP bound)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from plait.cluster.spec import Cluster
from plait.ir.opgraph import OpGraph
from plait.ir.plan import Plan
from plait.net import planner
from plait.net.fabric import fabric_of
from plait.net.flows import traffic_flows
from plait.net.paths import to_plan_field


@dataclass(frozen=True)
class TrafficReport:
    flows: int
    ecmp_s: float  # busiest cable's time under the cluster's ECMP seed
    planned_s: float  # ... with the planned paths
    ideal_s: float  # LP lower bound over fractional path splits
    planner_s: float  # wall time of the planner
    whole_bound_s: float = 0.0  # lower bound for whole flows (`planner.whole_bound`)
    settings: dict | None = dataclasses.field(default=None, compare=False, repr=False)  # plait.net.deploy

    @property
    def achieved_over_ideal(self) -> float:
        return self.ideal_s / self.planned_s if self.planned_s > 0 else 1.0


def plan_traffic(plan: Plan, cluster: Cluster, graph: OpGraph, settings: bool = False
                 ) -> tuple[Plan, TrafficReport | None]:
    """`plan` with `flow_paths` for its inter-node flows on `cluster`'s fabric; unchanged (and no
    report) when the cluster describes no switched fabric or the plan sends nothing across it.
    `settings`: also the deployment settings of the planned paths in the report
    (`plait.net.deploy.settings`: NCCL env, policy routes, per-QP source ports)."""
    fabric = fabric_of(cluster)
    if fabric is None:
        return plan, None
    flows = traffic_flows(plan, cluster, fabric, graph)
    if not flows:
        return plan, None
    best = planner.plan_paths(fabric, flows)  # whole flows: one path per queue pair
    ecmp = planner.assign(fabric, flows, planner.ecmp_routes(fabric, flows))
    report = TrafficReport(len(flows), ecmp.bottleneck(fabric)[0], best.bottleneck(fabric)[0],
                           planner.ideal(fabric, flows), best.seconds, planner.whole_bound(fabric, flows))
    if settings:
        from plait.net.deploy import settings as deployment

        report = dataclasses.replace(report, settings=deployment(fabric, flows, best))
    return dataclasses.replace(plan, flow_paths=to_plan_field(fabric, flows, best.paths())), report
