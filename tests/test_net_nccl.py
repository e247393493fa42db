"""Flows as NCCL opens them (plait.net.nccl): counts by message size, algorithm and queue pairs,
the YAML settings and their errors, and ECMP's collision loss on a tiny fabric against a
hand-computed expectation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from plait.cluster.loader import dump_cluster, parse_yaml_text
from plait.cluster.spec import ClusterError, NcclSpec
from plait.ir.plan import Plan
from plait.net import nccl, planner
from plait.net.ecmp import expected_max_load
from plait.net.fabric import Fabric
from plait.net.flows import plan_flows

TINY = """
name: tiny
node_groups:
  - {name: n, count: 2, gpus: {kind: h100, count: 1}}
fabric:
  type: ethernet
  bandwidth: 100 Gb/s
  nics: 1
  channels: CH
  NCCL
  switches:
    leaves: {count: 2, uplink: {bandwidth: 100 Gb/s, links: 1}}
    spines: 2
"""


def tiny(channels: int = 2, nccl_line: str = "") -> Fabric:
    return Fabric(parse_yaml_text(TINY.replace("CH", str(channels)).replace("NCCL", nccl_line), "tiny.yaml"))


def test_flow_counts_by_message_size():
    d = NcclSpec()
    # Simple protocol: a channel needs 512 threads x 64 bytes = 32 KiB (NCCL's thread threshold)
    assert nccl.flows_per_connection(1 << 30, 4, d) == 4
    assert nccl.flows_per_connection(128 * 1024, 4, d) == 4
    assert nccl.flows_per_connection(100 * 1024, 4, d) == 3  # 100 KiB < 4 x 32 KiB
    assert nccl.flows_per_connection(70 * 1024, 4, d) == 2
    # LL below 64 KiB: 4 KiB per channel
    assert nccl.flows_per_connection(12 * 1024, 4, d) == 3
    assert nccl.flows_per_connection(1024, 4, d) == 1
    # queue pairs multiply; channel bounds clamp the communicator; the tree halves per edge
    qp4 = NcclSpec(qps_per_connection=4)
    assert nccl.flows_per_connection(1 << 30, 4, qp4) == 16
    assert nccl.flows_per_connection(1024, 4, qp4) == 4
    assert nccl.flows_per_connection(1 << 30, 4, NcclSpec(max_channels=2)) == 2
    assert nccl.flows_per_connection(1 << 30, 2, NcclSpec(min_channels=8)) == 8
    assert nccl.flows_per_connection(1 << 30, 4, NcclSpec(algorithm="tree")) == 2
    # every size opens between one channel's QPs and all of them; Simple grows monotonically
    sizes = [2 ** k for k in range(8, 31)]
    counts = [nccl.flows_per_connection(s, 8, qp4) for s in sizes]
    assert min(counts) == 4 and max(counts) == 32 == counts[-1]
    simple = [c for s, c in zip(sizes, counts) if s >= nccl.LL_BELOW]
    assert simple == sorted(simple)


def test_plan_flows_per_message_size():
    """A pair's bytes are split over the flows NCCL opens for its message: big gradients on every
    channel x QP, a small one on fewer."""
    fab = tiny(4, "nccl: {qps_per_connection: 2}")
    plan = Plan(dp=2, pp=1, tp=1, global_batch=2)
    big = plan_flows(plan, fab.cluster, fab, [1e9])
    small = plan_flows(plan, fab.cluster, fab, [2048.0])
    assert len(big) == 2 * 4 * 2  # 2 ring hops x 4 channels x 2 QPs
    assert len(small) == 2 * 1 * 2
    assert len({f.key.five_tuple() for f in big}) == len(big)  # each its own 5-tuple
    assert sum(f.bytes for f in big) == pytest.approx(2 * 1e9)  # 2 hops, each (n-1)/n x 2 x 1e9


def test_nccl_yaml_round_trip_and_errors():
    fab = tiny(2, "nccl: {qps_per_connection: 4, max_channels: 16, algorithm: tree, pxn: false}")
    assert fab.nccl == NcclSpec(4, 1, 16, "tree", False)
    again = parse_yaml_text(dump_cluster(fab.cluster), "again.yaml")
    assert again.fabric.nccl == fab.nccl
    for line, field in (("nccl: {qps_per_connection: 0}", "fabric.nccl.qps_per_connection"),
                        ("nccl: {min_channels: 0}", "fabric.nccl.min_channels"),
                        ("nccl: {min_channels: 8, max_channels: 4}", "fabric.nccl.min_channels"),
                        ("nccl: {algorithm: collnet}", "fabric.nccl.algorithm"),
                        ("nccl: {qp: 2}", "fabric.nccl")):
        with pytest.raises(ClusterError, match=field.replace(".", r"\.")):
            tiny(2, line)
    with pytest.raises(ClusterError, match=r"fabric\.channels"):
        tiny(0)


def spine_bottleneck_flows(qps: int, seeds: int) -> float:
    """Mean over ECMP seeds of the busiest leaf0 -> spine cable's load, in flows."""
    base = tiny(2, f"nccl: {{qps_per_connection: {qps}}}").cluster
    plan = Plan(dp=2, pp=1, tp=1, global_batch=2)
    out = []
    for s in range(seeds):
        c = dataclasses.replace(base, fabric=dataclasses.replace(base.fabric, ecmp_seed=s))
        fab = Fabric(c)
        flows = [f for f in plan_flows(plan, c, fab, [1e9]) if f.key.src == 0]  # n0 -> n1
        a = planner.assign(fab, flows, planner.ecmp_routes(fab, flows))
        up = [fab.index[f"leaf{0}>spine{k}#0"] for k in range(2)]
        out.append(max(a.load[up]) / flows[0].bytes)
    return float(np.mean(out))


def test_ecmp_on_a_tiny_fabric_matches_a_hand_computed_expectation():
    """Two leaves, two spines, one cable each. 2 channels x 1 QP: 2 flows hashed onto 2 cables
    collide with probability 1/2, so the busiest carries 1.5 flows on average (ideal: 1).
    2 QPs: 4 flows; of the 16 assignments 2 put all 4 on one cable, 8 put 3, 6 put 2:
    (2*4 + 8*3 + 6*2) / 16 = 2.75 (ideal: 2): more flows, less collision loss."""
    assert expected_max_load(2, 2) == pytest.approx(1.5)
    assert expected_max_load(4, 2) == pytest.approx(44 / 16)
    assert spine_bottleneck_flows(1, 400) == pytest.approx(1.5, abs=0.08)
    assert spine_bottleneck_flows(2, 400) == pytest.approx(2.75, abs=0.1)
    # the planner puts them evenly
    fab = tiny(2, "nccl: {qps_per_connection: 2}")
    flows = plan_flows(Plan(dp=2, pp=1, tp=1, global_batch=2), fab.cluster, fab, [1e9])
    best = planner.plan_paths(fab, flows, max_split=1)
    assert best.bottleneck(fab)[0] == pytest.approx(planner.ideal(fab, flows))


# ---------------------------------------------------------------- plans a fabric can carry out
RAILS = """
name: rails
node_groups:
  - {name: n, count: 8, gpus: {kind: h100, count: 2}}
fabric:
  type: ethernet
  bandwidth: 400 Gb/s
  nics: 2
  ports: 2
  channels: 2
  nccl: {qps_per_connection: 2}
  ecmp: {seed: 3}
  switches:
    rails: true
    leaves: {count: 2, uplink: {oversubscription: 1, links: 2}}
    spines: 2
"""


def rail_case():
    c = parse_yaml_text(RAILS, "rails.yaml")
    fab = Fabric(c)
    order = [2 * ((i % 2) * 4 + i // 2) + t for i in range(8) for t in range(2)]  # replicas alternate leaves
    plan = Plan(dp=8, pp=1, tp=2, global_batch=8, device_order=order)
    return c, fab, plan_flows(plan, c, fab, [1e9])


def test_planned_assignment_has_whole_flows_only_and_meets_the_whole_flow_bound():
    c, fab, flows = rail_case()
    best = planner.plan_paths(fab, flows)
    assert not best.pieces and all(len(p) == 1 and p[0][0] == 1.0 for p in best.paths())
    t = best.bottleneck(fab)[0]
    assert planner.ideal(fab, flows) <= planner.whole_bound(fab, flows) <= t * (1 + 1e-9)
    # every link's load is a sum of whole flows on it
    for link in range(len(fab.names)):
        on = [i for i, r in enumerate(best.routes) if link in r.links]
        assert best.load[link] == pytest.approx(sum(flows[i].bytes for i in on))
    # one spine cable lost under a full leaf: whole flows cannot keep the split figure
    fab.fail("leaf0-r0", "spine0", 0)
    whole = planner.replan(fab, flows, best)
    assert not whole.pieces
    assert whole.bottleneck(fab)[0] >= planner.whole_bound(fab, flows) * (1 - 1e-9)
    assert planner.whole_bound(fab, flows) > planner.ideal(fab, flows) * 1.05  # 8 QPs on 3 cables


def test_emitted_settings_parse_and_their_source_ports_give_the_planned_paths():
    import json

    from plait.net import deploy

    c, fab, flows = rail_case()
    best = planner.plan_paths(fab, flows)
    doc = deploy.check_settings(json.loads(json.dumps(deploy.settings(fab, flows, best))))
    assert doc["nccl_env"]["NCCL_IB_QPS_PER_CONNECTION"] == "2"
    assert doc["nccl_env"]["NCCL_MIN_NCHANNELS"] == doc["nccl_env"]["NCCL_MAX_NCHANNELS"] == "2"
    assert "source_ports" in doc["patched_nccl"] and "nccl_env" in doc["stock_nccl"]
    assert len(doc["source_ports"]) == len(flows)
    # a queue pair sent from its chosen port follows the planned path through the fabric's hash
    for f, p, r in zip(flows, doc["source_ports"], best.routes):
        assert p["udp_sport"] is not None
        five = f.key.five_tuple()
        from plait.net.ecmp import FiveTuple

        assert fab.route_ecmp(f.key, FiveTuple(five.src_ip, five.dst_ip, p["udp_sport"])).links == r.links
        assert p["path"] == [fab.names[link] for link in r.links]
    assert len(doc["policy_routes"]) + len(doc["not_pinnable"]) == len({(f.key.src, f.key.src_nic, f.key.dst,
                                                                          f.key.dst_nic) for f in flows})
    bad = json.loads(json.dumps(doc))
    bad["source_ports"][0]["udp_sport"] = 80
    with pytest.raises(deploy.SettingsError, match=r"source_ports\[0\]\.udp_sport"):
        deploy.check_settings(bad)
    bad = json.loads(json.dumps(doc))
    bad["nccl_env"]["NCCL_IB_QPS_PER_CONNECTION"] = "two"
    with pytest.raises(deploy.SettingsError, match=r"nccl_env\.NCCL_IB_QPS_PER_CONNECTION"):
        deploy.check_settings(bad)
    split = best.copy()
    split.pieces = {0: [(0.5, best.routes[0]), (0.5, best.routes[1])]}
    with pytest.raises(deploy.SettingsError, match="whole flows"):
        deploy.settings(fab, flows, split)


# ---------------------------------------------------------------- bad input, refused naming the field
def test_flow_paths_naming_a_missing_link_or_flow_are_refused():
    from plait.ir.plan import PlanError
    from plait.net.paths import from_plan_field, to_plan_field

    c, fab, flows = rail_case()
    best = planner.plan_paths(fab, flows)
    field = to_plan_field(fab, flows, best.paths())
    assert len(from_plan_field(fab, field)) == len(flows)

    def broken(edit):
        import copy

        f = copy.deepcopy(field)
        edit(f["paths"][3])
        return f

    for edit, msg in ((lambda p: p[3].__setitem__(1, "leaf0-r0>spine7#0"), r"paths\[3\].*'leaf0-r0>spine7#0' is not in"),
                      (lambda p: p.__setitem__(2, fab.channels), r"paths\[3\]': flow index 4, but the fabric opens 4 flows"),
                      (lambda p: p.__setitem__(0, 999), r"paths\[3\]': device 999 is not in"),
                      (lambda p: p.__setitem__(3, p[3][1:]), r"paths\[3\]': the path does not run from a NIC port")):
        with pytest.raises(PlanError, match=r"flow_paths\." + msg):
            from_plan_field(fab, broken(edit))


def test_simulating_planned_paths_on_a_cluster_without_a_fabric_is_refused():
    from plait.cluster import load_cluster
    from plait.graph.gpt_closed_form import gpt_opgraph
    from plait.net.paths import to_plan_field
    from plait.net.view import ClusterView
    from plait.sim.api import SimulateError, simulate

    c, fab, flows = rail_case()
    best = planner.plan_paths(fab, flows)
    graph = gpt_opgraph({"layers": 2, "hidden": 64, "heads": 2, "seq": 32, "vocab": 128}, "fp32")
    order = [2 * ((i % 2) * 4 + i // 2) + t for i in range(8) for t in range(2)]
    plan = Plan(dp=8, pp=1, tp=2, global_batch=8, device_order=order,
                flow_paths=to_plan_field(fab, flows, best.paths()))
    assert simulate(graph, ClusterView.from_cluster(c), plan, memory=False).iteration_time_s > 0
    flat = load_cluster("h100:nodes=8,gpus_per_node=2")
    with pytest.raises(SimulateError, match=r"plan field 'flow_paths'.*describes none"):
        simulate(graph, ClusterView.from_cluster(flat), plan, memory=False)


def test_nic_counts_contradicting_the_nodes_and_zero_flow_counts_are_refused():
    from plait.cluster.topology import check_cluster

    bad = RAILS.replace("  - {name: n, count: 8, gpus: {kind: h100, count: 2}}",
                        "  - {name: n, count: 8, gpus: {kind: h100, count: 2}, nic: {count: 4}}")
    with pytest.raises(ClusterError, match=r"nodes\[0\]\.nic\.count: 4 NICs on a fabric of 2 rails"):
        parse_yaml_text(bad, "rails.yaml")
    c = parse_yaml_text(RAILS, "rails.yaml")
    swapped = dataclasses.replace(c.nodes[0], leaves=list(reversed(c.nodes[0].leaves)))
    with pytest.raises(ClusterError, match=r"nodes\[0\]\.leaf\[0\]: 'leaf0-r1' serves rail 1, not NIC 0"):
        check_cluster(dataclasses.replace(c, nodes=[swapped] + c.nodes[1:]))
    for change, field in (({"qps_per_connection": 0}, "qps_per_connection"), ({"max_channels": 0}, "max_channels")):
        zero = dataclasses.replace(c, fabric=dataclasses.replace(
            c.fabric, nccl=dataclasses.replace(c.fabric.nccl, **change)))
        with pytest.raises(ClusterError, match=rf"fabric\.nccl\.{field}: a flow count must be >= 1, got 0"):
            check_cluster(zero)
    with pytest.raises(ClusterError, match=r"fabric\.channels: must be >= 1"):
        check_cluster(dataclasses.replace(c, fabric=dataclasses.replace(c.fabric, channels=0)))
