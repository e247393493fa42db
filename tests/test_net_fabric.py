"""Fabric model: YAML round trip and errors, routes, bonded ports, polarisation, failures,
the traffic planner against the LP bound, and the simulator honouring planned paths."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from plait.cluster.loader import dump_cluster, parse_yaml_text
from plait.cluster.spec import ClusterError, FailedLink
from plait.cluster.topology import bandwidth_matrix
from plait.ir.plan import Plan, PlanError
from plait.net import planner
from plait.net.fabric import Fabric, FabricError, FlowKey, fabric_of
from plait.net.flows import Flow, device_flow, plan_flows
from plait.net.paths import from_plan_field, to_plan_field

SMALL = """
name: small
node_groups:
  - {name: n, count: 8, gpus: {kind: h100, count: 2}}
fabric:
  type: ethernet
  bandwidth: 400 Gb/s
  nics: 2
  ports: 2
  channels: 2
  ecmp: {seed: 3}
  switches:
    rails: true
    leaves: {count: 2, uplink: {oversubscription: 1, links: 2}}
    spines: 2
"""

THREE_TIER = """
name: three-tier
node_groups:
  - {name: n, count: 8, gpus: {kind: h100, count: 1}}
fabric:
  type: ethernet
  bandwidth: 100 Gb/s
  nics: 1
  ecmp: {seed: 1, hash: HASH}
  switches:
    pods: 2
    leaves: {count: 4, uplink: {bandwidth: 100 Gb/s}}
    spines: {count: 4, uplink: {bandwidth: 100 Gb/s}}
    cores: 2
"""


def small(**fabric_changes):
    c = parse_yaml_text(SMALL, "small.yaml")
    if fabric_changes:
        c.fabric = dataclasses.replace(c.fabric, **fabric_changes)
    return c


def test_yaml_round_trip_and_derived_figures() -> None:
    c = small()
    assert parse_yaml_text(dump_cluster(c), "again.yaml") == c
    assert c.nodes[5].leaves == ["leaf1-r0", "leaf1-r1"]  # nodes 4..7 on leaf group 1
    # 1:1 -> 4 nodes x 400 Gb/s below a rail leaf over 2 spines x 2 cables = 400 Gb/s per cable
    leaf = next(s for s in c.switches if s.name == "leaf0-r0")
    assert leaf.uplink.bandwidth == pytest.approx(400e9 / 8)
    c2 = parse_yaml_text(SMALL.replace("oversubscription: 1", "oversubscription: 4"), "o.yaml")
    assert next(s for s in c2.switches if s.name == "leaf0-r0").uplink.bandwidth == pytest.approx(100e9 / 8)
    # two channels on distinct 100 Gb/s cables: a cross-leaf pair gets 2 cables' worth
    assert bandwidth_matrix(c2)[0, 8] == pytest.approx(200e9 / 8)
    broken = parse_yaml_text(SMALL.replace("ecmp: {seed: 3}", "failed_links: [[leaf0-r0, spine0, 1], [n-0, leaf0-r1]]"),
                             "f.yaml")
    assert parse_yaml_text(dump_cluster(broken), "f2.yaml") == broken
    dead = [n for n, ok in zip(Fabric(broken).names, Fabric(broken).alive) if not ok]
    assert sorted(dead) == sorted(["leaf0-r0>spine0#1", "spine0>leaf0-r0#1", "n-0.nic1.p0>leaf0-r1",
                                   "n-0.nic1.p1>leaf0-r1", "leaf0-r1>n-0.nic1.p0", "leaf0-r1>n-0.nic1.p1"])
    three = parse_yaml_text(THREE_TIER.replace("HASH", "same"), "t.yaml")
    assert parse_yaml_text(dump_cluster(three), "t2.yaml") == three


@pytest.mark.parametrize("edit,field", [
    (("ports: 2", "ports: 3"), "fabric.ports"),
    (("ecmp: {seed: 3}", "ecmp: {hash: crc}"), "fabric.ecmp.hash"),
    (("ecmp: {seed: 3}", "failed_links: [[leaf0-r0, leaf1-r0]]"), "fabric.failed_links[0]"),
    (("ecmp: {seed: 3}", "failed_links: [[leaf0-r0, spine9]]"), "fabric.failed_links[0]"),
    (("ecmp: {seed: 3}", "failed_links: [[leaf0-r0, spine0, 5]]"), "fabric.failed_links[0][2]"),
    (("ecmp: {seed: 3}", "failed_links: [[n-0, leaf0-r0, 2]]"), "fabric.failed_links[0][2]"),
    (("ecmp: {seed: 3}", "failed_links: [[n-0, leaf1-r0]]"), "fabric.failed_links[0]"),
    (("oversubscription: 1, links: 2", "oversubscription: 1, bandwidth: 1 Gb/s"), "leaves.uplink"),
    (("    rails: true\n", "    rails: true\n    pods: 2\n"), "fabric.switches.pods"),
])
def test_bad_fabric_yaml_names_file_and_field(edit: tuple[str, str], field: str) -> None:
    with pytest.raises(ClusterError) as err:
        parse_yaml_text(SMALL.replace(*edit), "bad.yaml")
    assert "bad.yaml" in str(err.value) and field in str(err.value)


def test_routes_cross_ports_leaves_and_spines() -> None:
    f = Fabric(small())
    route = f.route_ecmp(FlowKey(0, 0, 5, 0, 7))
    names = [f.names[i] for i in route.links]
    assert names[0].startswith("n-0.nic0.p") and names[0].endswith(">leaf0-r0")
    assert names[1].startswith("leaf0-r0>spine") and names[2].endswith(">leaf1-r0#0") or "#1" in names[2]
    assert names[3].startswith("leaf1-r0>n-5.nic0.p")
    assert len(f.all_switch_paths("leaf0-r0", "leaf1-r0")) == 2 * 2 * 2  # spine x up cable x down cable
    assert f.all_switch_paths("leaf0-r0", "leaf0-r0") == [()]


def test_bond_splits_flows_over_its_ports() -> None:
    f = Fabric(small())
    ports = Counter(f.route_ecmp(FlowKey(0, 0, 5, 0, tag)).links[0] for tag in range(400))
    assert set(ports) == set(f.port_up[0][0])
    assert min(ports.values()) > 150  # a hash splits flows about evenly, not all on one port
    # the planner balances exactly: 4 equal flows out of one NIC -> 2 per port
    flows = [Flow(FlowKey(0, 0, 5, 0, t), 0, 10, t, 1.0, "dp") for t in range(4)]
    a = planner.plan_paths(f, flows, max_split=planner.MAX_SPLIT)
    assert sorted(Counter(r.links[0] for r in a.routes).values()) == [2, 2]


def test_same_hash_at_every_tier_polarises() -> None:
    def core_uplinks_used(mode: str) -> int:
        f = Fabric(parse_yaml_text(THREE_TIER.replace("HASH", mode), "t.yaml"))
        used = Counter()
        for tag in range(300):
            route = f.route_ecmp(FlowKey(0, 0, 4 + tag % 4, 0, tag))  # pod 0 -> pod 1
            spine_up = f.names[route.links[2]]  # spine -> core
            used[spine_up.split("#")[0]] += 1
        return len(used)

    # 2 spines x 2 cores = 4 spine->core links; one hash at both tiers: the spine that
    # hash mod 2 chose always sends to core hash mod 2 -- each spine uses one core only.
    assert core_uplinks_used("per_tier") == 4
    assert core_uplinks_used("same") == 2


def test_failures_reroute_and_a_cut_fabric_names_the_link() -> None:
    c = small()
    c.fabric = dataclasses.replace(c.fabric, failed=[FailedLink("leaf0-r0", "spine0")])
    f = Fabric(c)
    for tag in range(50):
        names = [f.names[i] for i in f.route_ecmp(FlowKey(0, 0, 5, 0, tag)).links]
        assert not any(n.startswith("leaf0-r0>spine0") for n in names)
    f.fail("leaf0-r0", "spine1")
    with pytest.raises(FabricError, match=r"leaf0-r0>spine1#0"):
        f.route_ecmp(FlowKey(0, 0, 5, 0, 1))
    g = Fabric(small())
    g.fail("spine0", "leaf1-r0")
    g.fail("spine1", "leaf1-r0")  # the destination leaf is cut off: the error names its cables
    with pytest.raises(FabricError, match=r"spine0>leaf1-r0#0.*spine1>leaf1-r0#1"):
        g.route_ecmp(FlowKey(0, 0, 5, 0, 1))
    f.fail("n-0", "leaf0-r0")
    with pytest.raises(FabricError, match=r"n-0\.nic0\.p0>leaf0-r0"):
        f.route_ecmp(FlowKey(0, 0, 1, 0, 1))


def _ring_flows(c):
    f = fabric_of(c)
    order = [d for n in (0, 4, 1, 5, 2, 6, 3, 7) for d in (2 * n, 2 * n + 1)]  # alternate leaf groups
    plan = Plan(dp=8, tp=2, micro_batch=1, global_batch=8, device_order=order)
    return f, plan, plan_flows(plan, c, f, [1e9])


def test_planner_reaches_the_lp_bound_and_beats_ecmp() -> None:
    c = small()
    f, _plan, flows = _ring_flows(c)
    assert len(flows) == 2 * 8 * 2  # 2 rails x 8 hops x 2 channels, all across leaves
    best = planner.plan_paths(f, flows, max_split=planner.MAX_SPLIT)
    t_plan, _ = best.bottleneck(f)
    lp = planner.ideal(f, flows)
    assert t_plan == pytest.approx(lp, rel=1e-6)
    worst = max(planner.assign(f, flows, [Fabric(small(ecmp_seed=s)).route_ecmp(x.key) for x in flows])
                .bottleneck(f)[0] for s in range(20))
    assert worst > t_plan * 1.2


def test_replan_moves_only_hit_flows_and_keeps_throughput() -> None:
    c = small()
    f, _plan, flows = _ring_flows(c)
    before = planner.plan_paths(f, flows, max_split=planner.MAX_SPLIT)
    t0, _ = before.bottleneck(f)
    dead = f.fail("leaf0-r0", "spine0", 0)
    after = planner.replan(f, flows, before, max_split=planner.MAX_SPLIT)
    assert 0 < after.moved < len(flows)
    assert not any(link in dead for r in after.routes for link in r.links)
    t1, _ = after.bottleneck(f)
    assert t1 >= planner.ideal(f, flows) * (1 - 1e-9) and t1 >= t0
    ecmp_after = []
    for s in range(10):
        g = Fabric(small(ecmp_seed=s))
        g.fail("leaf0-r0", "spine0", 0)
        ecmp_after.append(planner.assign(g, flows, planner.ecmp_routes(g, flows)).bottleneck(g)[0])
    assert t1 < max(ecmp_after)


def test_plan_field_round_trip_and_simulator_honours_paths() -> None:
    from plait.graph.gpt_closed_form import gpt_opgraph
    from plait.net.view import ClusterView
    from plait.sim.api import simulate

    c = small()
    f, plan, flows = _ring_flows(c)
    graph = gpt_opgraph({"layers": 2, "hidden": 1024, "heads": 8, "seq": 256, "vocab": 1000}, "bf16")
    grads = graph.param_count * 2 / plan.tp
    flows = plan_flows(plan, c, f, [grads])
    a = planner.plan_paths(f, flows, max_split=planner.MAX_SPLIT)
    field = to_plan_field(f, flows, a.paths())
    planned = dataclasses.replace(plan, flow_paths=field)
    again = Plan.from_json(planned.to_json())
    assert again.flow_paths == field and "flow_paths" not in plan.to_dict()
    assert from_plan_field(f, field)[(flows[0].src_device, flows[0].dst_device, 0)] == [(1.0, a.routes[0].links)]
    view = ClusterView.from_cluster(c)
    assert view.route(0, 8)[0][0][0] == "link"
    t_plan = simulate(graph, view, planned, memory=False).iteration_time_s
    worst = max(simulate(graph, ClusterView.from_cluster(small(ecmp_seed=s)), plan, memory=False).iteration_time_s
                for s in range(8))
    assert t_plan < worst
    with pytest.raises(PlanError, match="flow_paths"):
        Plan(dp=8, global_batch=8, flow_paths={"version": 9, "paths": []})
    bad = {"version": 1, "paths": [[0, 8, 0, ["no-such-link"]]]}
    with pytest.raises(PlanError, match="no-such-link"):
        from_plan_field(f, bad)
    assert device_flow(f, 0, 8, 1) != device_flow(f, 0, 8, 0)


def test_three_tiers_planner_and_lp_cross_pods() -> None:
    c = parse_yaml_text(THREE_TIER.replace("HASH", "per_tier"), "t.yaml")
    f = Fabric(c)
    # nodes 0..3 in pod 0 (leaves 0, 1), 4..7 in pod 1; each pod-0 node sends 2 flows to pod 1
    flows = [Flow(FlowKey(n, 0, 4 + (n + j) % 4, 0, 10 * n + j), n, 4 + n, j, 1.0, "dp")
             for n in range(4) for j in range(2)]
    paths = f.all_switch_paths("leaf0", "leaf2")
    assert len(paths) == 2 * 2 * 2 and all(len(p) == 4 for p in paths)  # spine, core, spine
    a = planner.plan_paths(f, flows, max_split=planner.MAX_SPLIT)
    lp = planner.ideal(f, flows)
    t, _ = a.bottleneck(f)
    assert t == pytest.approx(lp, rel=1e-6)
    ecmp = planner.assign(f, flows, planner.ecmp_routes(f, flows)).bottleneck(f)[0]
    assert ecmp >= t


def test_plan_traffic_in_one_call() -> None:
    from plait.graph.gpt_closed_form import gpt_opgraph
    from plait.net.api import plan_traffic

    c = small()
    _f, plan, _flows = _ring_flows(c)
    graph = gpt_opgraph({"layers": 2, "hidden": 512, "heads": 8, "seq": 128, "vocab": 1000}, "bf16")
    planned, report = plan_traffic(plan, c, graph)
    assert planned.flow_paths is not None and report is not None
    assert report.flows == len(planned.flow_paths["paths"]) == 32
    assert report.ideal_s <= report.planned_s * (1 + 1e-9) <= report.ecmp_s * (1 + 1e-9)
    assert report.achieved_over_ideal == pytest.approx(1.0)
    flat = parse_yaml_text("nodes: [{gpus: {kind: h100, count: 2}}, {gpus: {kind: h100, count: 2}}]", "f.yaml")
    assert plan_traffic(Plan(dp=2, tp=2, global_batch=2), flat, graph) == (Plan(dp=2, tp=2, global_batch=2), None)


def test_exact_milp_fixes_a_greedy_local_optimum(monkeypatch) -> None:
    monkeypatch.setattr(planner, "EXACT_SECONDS", 60.0)  # HiGHS' limit is wall time: a loaded machine
    # Five flows 3, 3, 2, 2, 2 out of one bonded NIC (two ports): largest-first gives one port
    # 3 + 2 + 2 = 7 and no single move helps; the optimum is {3, 3} and {2, 2, 2}: 6.
    f = Fabric(small())
    cap = f.capacity[f.port_up[0][0][0]]
    flows = [Flow(FlowKey(0, 0, 1, 0, t), 0, 2, t, float(b), "dp") for t, b in enumerate((3, 3, 2, 2, 2))]
    greedy = planner.plan_paths(f, flows, exact=False, max_split=1).bottleneck(f)[0]
    best = planner.plan_paths(f, flows, max_split=1).bottleneck(f)[0]
    assert greedy == pytest.approx(7 / cap) and best == pytest.approx(6 / cap)
    assert planner.ideal(f, flows) == pytest.approx(6 / cap)


def test_traffic_flows_carry_the_traffic_modules_inter_node_bytes() -> None:
    """One source of bytes: the fabric's flows of a plan are `plait.cost.traffic`'s flows between
    nodes (summed per device pair, split over the channels), in the plan's gradient dtype."""
    from plait.cost.traffic import iteration_traffic
    from plait.graph.gpt_closed_form import gpt_opgraph
    from plait.net.flows import traffic_flows

    c = small()
    f, plan, _flows = _ring_flows(c)
    graph = gpt_opgraph({"layers": 2, "hidden": 512, "heads": 8, "seq": 128, "vocab": 1000}, "bf16")
    flows = traffic_flows(plan, c, f, graph)
    node = c.devices
    expected = sum(x.nbytes for x in iteration_traffic(graph, plan).flows()
                   if x.src != x.dst and node[x.src].node != node[x.dst].node)
    assert flows and sum(x.bytes for x in flows) == pytest.approx(expected)
    assert all(node[x.src_device].node != node[x.dst_device].node for x in flows)
    fp32 = traffic_flows(dataclasses.replace(plan, grad_reduce_dtype="bf16"), c, f, graph)
    assert sum(x.bytes for x in fp32) == pytest.approx(expected / 2)  # bf16 plan: fp32 grads by default


def test_replan_splits_hit_flows_to_keep_what_the_failure_leaves() -> None:
    # Each leaf sends 8 whole flows over its 4 uplink cables (2 each). One cable fails: whole flows
    # put 3 on some cable (2/3 kept); split over the 3 others the bound (k-1)/k = 3/4 is reached.
    c = small()
    f, _plan, flows = _ring_flows(c)
    before = planner.plan_paths(f, flows, max_split=planner.MAX_SPLIT)
    t0, _ = before.bottleneck(f)
    f.fail("leaf0-r0", "spine0", 0)
    whole = planner.replan(f, flows, before, max_split=1)
    split = planner.replan(f, flows, before, max_split=planner.MAX_SPLIT)
    assert t0 / whole.bottleneck(f)[0] == pytest.approx(2 / 3)
    assert t0 / split.bottleneck(f)[0] == pytest.approx(3 / 4)
    assert split.bottleneck(f)[0] == pytest.approx(planner.ideal(f, flows), rel=1e-6)
    assert split.pieces and all(len(p) <= planner.MAX_SPLIT for p in split.pieces.values())
    for pieces in split.pieces.values():
        assert sum(s for s, _r in pieces) == pytest.approx(1.0)
        assert not any(not f.alive[link] for _s, r in pieces for link in r.links)
    # The shares reach the plan file and the simulator's routes.
    field = to_plan_field(f, flows, split.paths())
    assert any(len(item) == 5 for item in field["paths"])
    assert Plan.from_json(dataclasses.replace(_plan, flow_paths=field).to_json()).flow_paths == field
    back = from_plan_field(f, field)
    i = next(iter(split.pieces))
    key = (flows[i].src_device, flows[i].dst_device, flows[i].channel)
    assert sorted(back[key]) == sorted((s, r.links) for s, r in split.pieces[i])
    bad = {"version": 2, "paths": [item[:4] + [0.5] for item in field["paths"][:1]]}
    with pytest.raises(PlanError, match="add up to 0.5"):
        from_plan_field(f, bad)


def test_split_reaches_the_lp_bound_where_whole_flows_cannot() -> None:
    # 3 flows of one NIC over its 2 bonded ports: whole flows load one port with 2; split, 1.5.
    f = Fabric(small())
    cap = f.capacity[f.port_up[0][0][0]]
    flows = [Flow(FlowKey(0, 0, 2, 0, t), 0, 4, t, 1.0, "dp") for t in range(3)]
    assert planner.plan_paths(f, flows, max_split=1).bottleneck(f)[0] == pytest.approx(2 / cap)
    a = planner.plan_paths(f, flows, max_split=planner.MAX_SPLIT)
    assert a.bottleneck(f)[0] == pytest.approx(1.5 / cap) == pytest.approx(planner.ideal(f, flows))


def test_replan_with_no_path_left_names_the_failed_links() -> None:
    c = small()
    f, _plan, flows = _ring_flows(c)
    before = planner.plan_paths(f, flows, max_split=planner.MAX_SPLIT)
    f.fail("spine0", "leaf1-r0")
    f.fail("spine1", "leaf1-r0")  # leaf1-r0 is cut off from the spines
    with pytest.raises(FabricError, match=r"no path left.*spine0>leaf1-r0#0"):
        planner.replan(f, flows, before, max_split=planner.MAX_SPLIT)
    with pytest.raises(FabricError, match=r"spine1>leaf1-r0"):
        planner.ideal(f, flows)


def test_split_reaches_the_bound_when_cables_do_not_divide_the_flows() -> None:
    # 3 spines x 1 cable: each leaf sends 8 flows over 3 uplinks -- whole flows 3 on one cable,
    # split 8/3 on each (the LP bound); every split flow's shares add up to 1.
    c = parse_yaml_text(SMALL.replace("links: 2}}", "links: 1}}").replace("spines: 2", "spines: 3"), "s3.yaml")
    f, _plan, flows = _ring_flows(c)
    whole = planner.plan_paths(f, flows, max_split=1).bottleneck(f)[0]
    a = planner.plan_paths(f, flows, max_split=planner.MAX_SPLIT)
    lp = planner.ideal(f, flows)
    assert whole == pytest.approx(lp * 9 / 8)
    assert a.bottleneck(f)[0] == pytest.approx(lp, rel=1e-6) and a.bound == pytest.approx(lp)
    assert all(sum(s for s, _r in p) == pytest.approx(1.0) and len(p) <= planner.MAX_SPLIT
               for p in a.pieces.values())


def test_replan_rebalances_to_the_bound_when_the_cables_left_were_full() -> None:
    c = parse_yaml_text(SMALL.replace("links: 2}}", "links: 1}}").replace("spines: 2", "spines: 3"), "s3.yaml")
    f, _plan, flows = _ring_flows(c)
    before = planner.plan_paths(f, flows, max_split=planner.MAX_SPLIT)
    f.fail("leaf0-r0", "spine0")
    after = planner.replan(f, flows, before, max_split=planner.MAX_SPLIT)
    assert after.bottleneck(f)[0] == pytest.approx(planner.ideal(f, flows), rel=1e-6)
    assert all(f.alive[link] for p in after.paths() for _s, r in p for link in r.links)
