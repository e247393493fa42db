"""A node's NIC total means the same on every cost path: one 800 Gb/s NIC and eight 100 Gb/s
NICs per node give the same collective times in the planner's analytic model and in the
simulator (issue 12: "the NIC count x per-NIC bandwidth must mean the same")."""

from __future__ import annotations

import pytest

from plait.cluster import load_cluster
from plait.cluster.topology import bandwidth_matrix, latency_matrix
from plait.cost.collectives import collective_time, group_links, ring_all_reduce_time
from plait.cost.traffic import Message
from plait.ir.plan import Plan
from plait.net.view import ClusterView
from plait.planners.threed import AnalyticModel
from plait.sim.api import simulate

ONE_BIG = "a100-80g:nodes=2,nics=1,nic=800 Gb/s"
EIGHT_SMALL = "a100-80g:nodes=2,nics=8,nic=100 Gb/s"
MODEL = "gpt:layers=2,hidden=256,heads=4,seq=128,vocab=512"


def _links(spec: str, devices: list[int]):
    c = load_cluster(spec)
    return group_links(devices, bandwidth_matrix(c), latency_matrix(c), [d.node for d in c.devices],
                       [n.nics for n in c.nodes])


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical", "tree"])
def test_one_800g_nic_equals_eight_100g_nics(algorithm: str) -> None:
    devices = list(range(16))
    big, small = _links(ONE_BIG, devices), _links(EIGHT_SMALL, devices)
    assert (big.inter_channels, small.inter_channels) == (1, 8)
    for nbytes in (1e6, 256e6, 4e9):
        t_big = collective_time("all_reduce", nbytes, big, algorithm)
        t_small = collective_time("all_reduce", nbytes, small, algorithm)
        assert t_small == pytest.approx(t_big, rel=1e-9)


def test_ring_across_nodes_runs_on_the_node_nic_total_hand_computed() -> None:
    # 2 nodes x 8 GPUs, ring 0..15: two hops cross nodes, each node has 8 x 12.5 GB/s NICs.
    links = _links(EIGHT_SMALL, list(range(16)))
    nic_total = 8 * 12.5e9
    assert links.ring_bandwidth == pytest.approx(min(nic_total, links.intra_bandwidth))
    expected = ring_all_reduce_time(1e9, 16, links.ring_bandwidth, links.ring_latency)
    assert collective_time("all_reduce", 1e9, links, "ring") == pytest.approx(expected)
    # Two GPUs per node drive only two of the NICs.
    two = _links(EIGHT_SMALL, [0, 1, 8, 9])
    assert two.inter_channels == 2 and two.ring_bandwidth == pytest.approx(2 * 12.5e9)


def test_planner_and_simulator_agree_for_both_nic_layouts() -> None:
    """Data parallelism over 16 GPUs of 2 nodes: the planner's gradient all-reduce estimate and the
    simulator's lowered all-reduce take the same time for both NIC layouts."""
    plan = Plan(dp=16, micro_batch=1, global_batch=16, dtype="bf16")
    sims, analytic = [], []
    for spec in (ONE_BIG, EIGHT_SMALL):
        c = load_cluster(spec)
        res = simulate(MODEL, ClusterView.from_cluster(c), plan, memory=False)
        sims.append(res.iteration_time_s)
        model = AnalyticModel(res_graph(plan), c)
        msg = Message("grads", "dp", "all_reduce", 512 * 2**20, (tuple(range(16)),), 1, 0)
        analytic.append(model._message_s(msg, plan))
    assert sims[1] == pytest.approx(sims[0], rel=1e-6)
    assert analytic[1] == pytest.approx(analytic[0], rel=1e-9)


def res_graph(plan: Plan):
    from plait.graph.resolve import resolve_model

    return resolve_model(MODEL, plan)


def test_ring_hops_spread_a_node_crossing_over_the_rails_hand_computed() -> None:
    from plait.cost.collectives import ring_hops

    node_of = [0] * 4 + [1] * 4
    hops = ring_hops(list(range(8)), node_of, [4, 4])
    # Inside nodes: 0->1->2->3 and 4->5->6->7, all of a hop's bytes; each crossing (3->4, 7->0)
    # runs on four rails, rail c from the c-th GPU of one node to the c-th of the other.
    assert [(a, b) for a, b, s in hops if s == 1.0] == [(0, 1), (1, 2), (2, 3), (4, 5), (5, 6), (6, 7)]
    rails = [(a, b) for a, b, s in hops if s == pytest.approx(0.25)]
    assert rails == [(0, 4), (1, 5), (2, 6), (3, 7), (4, 0), (5, 1), (6, 2), (7, 3)]
    # One NIC per node (or one member per node): the ring's own hops.
    assert ring_hops(list(range(8)), node_of, [1, 1]) == [(i, (i + 1) % 8, 1.0) for i in range(8)]
    assert ring_hops([0, 4], node_of, [4, 4]) == [(0, 4, 1.0), (4, 0, 1.0)]
    # Two GPUs per node in the group drive two rails.
    assert {(a, b) for a, b, s in ring_hops([0, 1, 4, 5], node_of, [4, 4]) if s == 0.5} == \
        {(0, 4), (1, 5), (4, 0), (5, 1)}


@pytest.mark.parametrize("spec", [EIGHT_SMALL, "a100-80g:nodes=3,nics=4,nic=100 Gb/s"])
def test_traffic_flows_and_simulator_loads_put_the_same_bytes_on_every_pair(spec: str) -> None:
    """One ring layout (issue 11's one-truth rule): the flows the traffic module lists for a
    fabric planner and the loads the simulator's one ring flow puts on each device pair carry the
    same bytes, a node crossing spread over the node's NICs in both."""
    from collections import defaultdict

    c = load_cluster(spec)
    view = ClusterView.from_cluster(c)
    ring = [d for d in range(len(c.devices)) if d % 8 in (0, 1, 2, 5, 6)]  # 5 GPUs a node
    nbytes = 64e6
    msg = Message("grads", "dp", "all_reduce", int(nbytes), (tuple(ring),), 1, 0)
    listed: dict[tuple[int, int], float] = defaultdict(float)
    for f in msg.flows([d.node for d in c.devices], [n.nics for n in c.nodes]):
        listed[(f.src, f.dst)] += f.nbytes
    # The simulator runs the ring as one flow of t x B bytes, t = per-hop bytes / ring bandwidth.
    per_hop = 2 * (len(ring) - 1) / len(ring) * int(nbytes)
    slowest, hops = view.ring_loads(ring)
    flow_bytes = per_hop / view.group(ring).ring_bandwidth * slowest
    loaded: dict[tuple[int, int], float] = defaultdict(float)
    for a, b, x in hops:
        loaded[(a, b)] += flow_bytes * x
    assert loaded.keys() == listed.keys()
    for pair, b in listed.items():
        assert loaded[pair] == pytest.approx(b, rel=1e-9)
    nodes = {d.node for d in c.devices}
    cross = [p for p in listed if c.devices[p[0]].node != c.devices[p[1]].node]
    rails = min(5, c.nodes[0].nics)  # 5 members a node drive min(5, NICs) rails
    assert len({a for a, _ in cross}) == rails * len(nodes)
