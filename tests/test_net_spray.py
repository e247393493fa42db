"""Per-packet spraying (fluid adaptive routing, `plait.net.spray`) and ECMP's collision odds,
against hand-computed link loads on a four-spine leaf/spine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from plait.cluster.loader import parse_yaml_text
from plait.cluster.spec import FailedLink
from plait.ir.plan import Plan
from plait.net import planner
from plait.net.ecmp import expected_max_load
from plait.net.fabric import Fabric, FabricError, FlowKey
from plait.net.flows import Flow, plan_flows
from plait.net.spray import spray_load, spray_time

FOUR_SPINES = """
name: four-spines
node_groups:
  - {name: n, count: 4, gpus: {kind: h100, count: 1}}
fabric:
  type: ethernet
  bandwidth: 400 Gb/s
  nics: 1
  ports: PORTS
  channels: 1
  switches:
    leaves: {count: 2, uplink: {bandwidth: 400 Gb/s, links: CABLES}}
    spines: 4
"""
B = 1e9  # bytes per flow


def fabric(ports: int = 1, cables: int = 1, failed: list[FailedLink] | None = None) -> Fabric:
    c = parse_yaml_text(FOUR_SPINES.replace("PORTS", str(ports)).replace("CABLES", str(cables)), "four-spines.yaml")
    if failed:
        c.fabric = dataclasses.replace(c.fabric, failed=failed)
    return Fabric(c)


def two_flows(fab: Fabric) -> list[Flow]:
    """Node 0 -> node 2 and node 1 -> node 3: both from leaf0 to leaf1 (two nodes per leaf)."""
    assert fab.nic_leaf[0][0] == fab.nic_leaf[1][0] != fab.nic_leaf[2][0] == fab.nic_leaf[3][0]
    return [Flow(FlowKey(0, 0, 2, 0, 7), 0, 2, 0, B, "dp"), Flow(FlowKey(1, 0, 3, 0, 9), 1, 3, 0, B, "dp")]


def cable_loads(fab: Fabric, load: np.ndarray, a: str, b: str) -> list[float]:
    return [float(load[i]) for i in fab.cables[(a, b)]]


def test_two_flows_on_four_spines_each_cable_carries_its_share() -> None:
    fab = fabric()
    load = spray_load(fab, two_flows(fab))
    leaf0, leaf1 = fab.nic_leaf[0][0], fab.nic_leaf[2][0]
    for s in range(4):
        assert cable_loads(fab, load, leaf0, f"spine{s}") == pytest.approx([2 * B / 4])
        assert cable_loads(fab, load, f"spine{s}", leaf1) == pytest.approx([2 * B / 4])
    # NIC ports carry their whole flow; links towards leaf0 carry nothing
    assert load[fab.port_up[0][0][0]] == pytest.approx(B) and load[fab.port_down[3][0][0]] == pytest.approx(B)
    assert sum(load[i] for i in fab.cables[("spine0", leaf0)]) == 0
    # T is the NIC port (B at 400 Gb/s), the LP bound too
    cap = 400e9 / 8
    assert spray_time(fab, two_flows(fab)) == pytest.approx(B / cap)
    assert spray_time(fab, two_flows(fab)) == pytest.approx(planner.ideal(fab, two_flows(fab)))


def test_bonded_ports_split_each_flow_evenly() -> None:
    fab = fabric(ports=2)
    load = spray_load(fab, two_flows(fab))
    assert [load[p] for p in fab.port_up[0][0]] == pytest.approx([B / 2, B / 2])
    assert [load[p] for p in fab.port_down[2][0]] == pytest.approx([B / 2, B / 2])


def test_a_spine_cut_off_from_the_destination_gets_nothing() -> None:
    fab = fabric(failed=[FailedLink("leaf1", "spine0", None)])
    load = spray_load(fab, two_flows(fab))
    leaf0 = fab.nic_leaf[0][0]
    assert cable_loads(fab, load, leaf0, "spine0") == [0.0]
    for s in (1, 2, 3):
        assert cable_loads(fab, load, leaf0, f"spine{s}") == pytest.approx([2 * B / 3])


def test_spraying_is_not_optimal_after_one_of_two_cables_fails() -> None:
    # 2 cables per leaf-spine pair; spine0 -> leaf1 cable #0 down; two flows of 4B each (8B).
    # leaf0 still sprays 1/8 of the 8B on each of its 8 up-cables (B each), so spine0 gets 2B
    # and its one cable left carries all of it, the other spines' down-cables B each:
    # T = 2B/cap. The LP spreads 8B over the 7 cables left: 8B/7 each. Spraying's switch T is
    # 7/4 of the bound (the reason for weighted ECMP).
    fab = fabric(cables=2, failed=[FailedLink("spine0", "leaf1", 0)])
    flows = [dataclasses.replace(f, bytes=4 * B) for f in two_flows(fab)]
    load = spray_load(fab, flows)
    assert cable_loads(fab, load, "spine0", "leaf1") == pytest.approx([0.0, 2 * B])
    assert cable_loads(fab, load, "spine1", "leaf1") == pytest.approx([B, B])
    cap = 400e9 / 8
    switch_t = max(load[i] / cap for ids in fab.cables.values() for i in ids)
    assert switch_t == pytest.approx(2 * B / cap)
    assert switch_t / (8 * B / 7 / cap) == pytest.approx(7 / 4)


def test_no_path_left_names_the_failed_links() -> None:
    fab = fabric(failed=[FailedLink("leaf1", s, None) for s in ("spine0", "spine1", "spine2", "spine3")])
    with pytest.raises(FabricError, match="spine"):
        spray_load(fab, two_flows(fab))


def test_ecmp_collision_rate_over_seeds_matches_the_hand_expectation() -> None:
    # Two flows hashed onto 4 spines collide with probability 1/4: the busiest up-cable carries
    # on average 1 + 1/4 flows (`expected_max_load(2, 4)`). Over 1000 hash seeds the fabric's
    # ECMP must land within 4 standard errors (sd of the indicator sqrt(3)/4, / sqrt(1000)).
    fab = fabric()
    flows = two_flows(fab)
    busiest = []
    for seed in range(1000):
        fab.seed = seed
        a = planner.assign(fab, flows, planner.ecmp_routes(fab, flows))
        busiest.append(max(a.load[i] for ids in fab.cables.values() for i in ids) / B)
    assert expected_max_load(2, 4) == pytest.approx(1.25)
    assert abs(float(np.mean(busiest)) - 1.25) < 4 * (3 ** 0.5 / 4) / 1000 ** 0.5
    # spraying never collides: the busiest switch cable carries half a flow
    assert max(spray_load(fab, flows)[i] for ids in fab.cables.values() for i in ids) / B == pytest.approx(0.5)


def test_spraying_reaches_the_lp_bound_on_a_symmetric_fabric() -> None:
    c = parse_yaml_text(FOUR_SPINES.replace("PORTS", "2").replace("CABLES", "2").replace("count: 1}", "count: 2}")
                        .replace("nics: 1", "nics: 2"), "four-spines.yaml")
    fab = Fabric(c)
    plan = Plan(dp=8, pp=1, tp=1, global_batch=8, micro_batch=1)
    flows = plan_flows(plan, c, fab, [1e9])
    assert flows
    t_spray, t_lp = spray_time(fab, flows), planner.ideal(fab, flows)
    assert t_spray == pytest.approx(t_lp, rel=1e-6)
    t_ecmp = planner.assign(fab, flows, planner.ecmp_routes(fab, flows)).bottleneck(fab)[0]
    assert t_ecmp >= t_spray * (1 - 1e-9)
