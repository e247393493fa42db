"""`plait plan --traffic-plan`: the chosen plan's inter-node flows placed on paths of the cluster's
switched fabric (`plait.net.api.plan_traffic`, C4P), stored in the plan (`Plan.flow_paths`, so
`--out` writes them and `plait simulate --plan` honours them; the deployment settings,
`plait.net.deploy`, go beside it as PLAN.traffic.json), and the simulated iteration with ECMP's
paths beside the planned ones."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plait.errors import PlaitError

if TYPE_CHECKING:  # the CLI imports this module to add its flag: the fabric code loads on use
    from plait.cluster.spec import Cluster, ClusterSource
    from plait.graph.resolve import ModelSource
    from plait.ir.plan import Plan
    from plait.net.api import TrafficReport


def add_traffic_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--traffic-plan", action="store_true",
                   help="on a cluster with a leaf/spine fabric: plan the best plan's inter-node flows (whole "
                        "queue pairs) onto paths (C4P), store them in the plan (--out; the settings a deployment "
                        "applies -- NCCL env, policy routes, per-QP source ports -- beside it as PLAN.traffic.json) "
                        "and print its simulated iteration with ECMP's paths vs the planned ones")


def check_traffic_cluster(cluster: ClusterSource | None) -> Cluster:
    """The cluster of `--traffic-plan`; a PlaitError naming it when it describes no switched fabric
    (checked before the search)."""
    from plait.cluster import load_cluster
    from plait.net.fabric import fabric_of

    c = load_cluster(cluster)
    if fabric_of(c) is None:
        raise PlaitError(f"--traffic-plan: cluster {c.name!r} ({c.source}) describes no switched fabric: "
                         "give fabric.switches with leaves (and spines) to plan flows onto paths")
    return c


@dataclass
class TrafficOutcome:
    plan: Plan  # the plan with `flow_paths` (unchanged when nothing crosses the fabric)
    report: TrafficReport | None  # None: the plan sends nothing between nodes
    ecmp_iteration_s: float  # simulated with the paths ECMP hashes the flows to (the cluster's seed)
    planned_iteration_s: float  # simulated with the planned paths

    def to_dict(self) -> dict[str, Any]:
        r = self.report
        return {"flows": r.flows if r else 0, "ecmp_iteration_s": self.ecmp_iteration_s,
                "planned_iteration_s": self.planned_iteration_s,
                "faster": self.ecmp_iteration_s / self.planned_iteration_s - 1 if self.planned_iteration_s else 0.0,
                "bottleneck_ecmp_s": r.ecmp_s if r else None, "bottleneck_planned_s": r.planned_s if r else None,
                "bottleneck_ideal_s": r.ideal_s if r else None,
                "achieved_over_ideal": r.achieved_over_ideal if r else None,
                "planner_s": r.planner_s if r else None,
                "split_flows": sum(1 for key in _keys(self.plan) if key[1] > 1)}


def _keys(plan: Plan) -> list[tuple[tuple[int, int, int], int]]:
    count: dict[tuple[int, int, int], int] = {}
    for item in (plan.flow_paths or {}).get("paths", []):
        key = (item[0], item[1], item[2])
        count[key] = count.get(key, 0) + 1
    return list(count.items())


def traffic_plan(model: ModelSource, cluster: Cluster, plan: Plan, settings: bool = False,
                 precision: str = "amp") -> TrafficOutcome:
    """Plan `plan`'s flows on `cluster`'s fabric and simulate the iteration both ways (`settings`:
    with the deployment settings, `plait.net.deploy`); the model resolved at `precision`, as the
    search and `plait simulate` resolve it."""
    from plait.graph.resolve import resolve_model
    from plait.net.api import plan_traffic
    from plait.net.view import ClusterView
    from plait.sim.api import simulate

    graph = resolve_model(model, plan, precision=precision)
    planned, report = plan_traffic(plan, cluster, graph, settings=settings)
    view = ClusterView.from_cluster(cluster)
    ecmp = simulate(graph, view, dataclasses.replace(plan, flow_paths=None),
                    memory=False).iteration_time_s
    mine = simulate(graph, view, planned, memory=False).iteration_time_s if report else ecmp
    return TrafficOutcome(planned, report, ecmp, mine)


def print_traffic(t: TrafficOutcome, console: Any) -> None:
    if t.report is None:
        console.print("traffic plan: the plan sends nothing between nodes; nothing to place on the fabric")
        return
    r = t.report
    d = t.to_dict()
    console.print(f"traffic plan (C4P): {r.flows} inter-node flows placed on fabric paths in {r.planner_s:.2f} s"
                  + (f", {d['split_flows']} split over several paths" if d["split_flows"] else ""))
    console.print(f"  simulated iteration: ECMP {t.ecmp_iteration_s * 1e3:.2f} ms, planned "
                  f"{t.planned_iteration_s * 1e3:.2f} ms ({d['faster']:+.1%})")
    console.print(f"  busiest link: ECMP {r.ecmp_s * 1e3:.2f} ms, planned {r.planned_s * 1e3:.2f} ms, "
                  f"ideal (LP bound) {r.ideal_s * 1e3:.2f} ms: achieved/ideal {r.achieved_over_ideal:.3f}")
