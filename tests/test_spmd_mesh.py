"""Hierarchical SPMD programs (`plait.spmd.mesh`): op-level sharding inside each node, data
parallelism across nodes. Costs checked against hand-computed cases; on a slow inter-node link the
hierarchical program beats the flat one exactly where the hand calculation says it should."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_spmd_collectives import two_nodes
from torch import nn

from plait.cluster.loader import parse_cluster
from plait.cost.program import Problem
from plait.cost.spmd import Devices, mesh_of, rail_links, rail_time
from plait.graph.aten_capture import capture_aten
from plait.ir.program import RAIL, ShardingError
from plait.sim.api import simulate_spmd
from plait.spmd.mesh import node_batches, synthesize_hierarchical
from plait.spmd.ratios import synthesize

H = 256
INTER = 10.4e9 / 8  # bytes/s of the 10.4 Gb/s NIC


def two_nodes_one_nic():
    """`two_nodes(2)` with one 10.4 Gb/s NIC per node (the rails share it, as on HAP's testbed)."""
    return parse_cluster({"name": "v100-p100-1nic", "nodes": [
        {"name": name, "gpus": {"kind": kind, "count": 2},
         "intra": {"type": "nvlink", "bandwidth": bw, "latency": "2 us"},
         "nic": {"type": "ethernet", "bandwidth": "10.4 Gb/s", "latency": "20 us", "count": 1}}
        for name, kind, bw in (("v", "v100-16gb", "100 GB/s"), ("p", "p100-16gb", "80 GB/s"))]})


def mlp(batch: int):
    model = nn.Sequential(nn.Linear(H, 4 * H, bias=False), nn.ReLU(), nn.Linear(4 * H, H, bias=False)).to("meta")
    return capture_aten(model, (torch.empty(batch, H, device="meta"),), name="mlp")


def test_mesh_rows_and_rails() -> None:
    cluster = two_nodes(2)
    mesh = mesh_of(cluster)
    assert mesh.nodes == ((0, 1), (2, 3)) and mesh.rails() == [(0, 2), (1, 3)]
    assert mesh.ids == (0, 1, 2, 3) and (mesh.outer, mesh.inner) == (2, 2)
    # node batches in proportion to the node's FLOP/s (V100 node faster than the P100 node)
    b = node_batches(cluster, mesh, 100)
    assert sum(b) == 100 and b[0] > b[1]


def test_uneven_nodes_are_refused_naming_the_node() -> None:
    cluster = parse_cluster({"name": "odd", "nodes": [
        {"name": "big", "gpus": {"kind": "v100-16gb", "count": 2}},
        {"name": "small", "gpus": {"kind": "v100-16gb", "count": 1}}]})
    with pytest.raises(ShardingError, match="node 'small' has 1"):
        mesh_of(cluster)


def test_rail_all_reduce_by_hand() -> None:
    """Two nodes of two GPUs, one NIC each: the two rails share the NIC, so one rail gets half of
    its bandwidth. A parameter of P bytes stored sharded 1:1 inside the node: each rail ring
    all-reduces P/2 on 2 ranks, ``2a + (P/2) / (B/2)``. Stored replicated: P/2 per rail as well,
    then the intra-node all-gather of P, ``a_i + P/2 / B_i``."""
    cluster = two_nodes_one_nic()
    mesh = mesh_of(cluster)
    rails = rail_links(cluster, mesh)
    nodes = [Devices.from_cluster(cluster, devices=n).links for n in mesh.nodes]
    a = rails[0].ring_latency
    assert rails[0].ring_bandwidth == pytest.approx(INTER / 2) and a > 0
    P = 8 << 20
    assert rail_time(P, np.array([0.5, 0.5]), rails, nodes) == pytest.approx(2 * a + (P / 2) / (INTER / 2))
    # uneven shards: the rail with the larger share decides
    assert rail_time(P, np.array([0.75, 0.25]), rails, nodes) == pytest.approx(2 * a + 0.75 * P / (INTER / 2))
    slow_node = min(nodes, key=lambda x: x.ring_bandwidth)
    gather = slow_node.ring_latency + (P / 2) / slow_node.ring_bandwidth
    assert rail_time(P, None, rails, nodes) == pytest.approx(2 * a + (P / 2) / (INTER / 2) + gather)
    # a NIC per rail: no sharing
    assert rail_links(two_nodes(2), mesh)[0].ring_bandwidth == pytest.approx(INTER)


def _flat(cluster, batch: int) -> float:
    problem = Problem.build(mlp(batch), Devices.from_cluster(cluster))
    return simulate_spmd(problem, synthesize(problem), cluster).iteration_time_s


def _hier(cluster, batch: int):
    def evaluate(h) -> float:
        return simulate_spmd(h.world_problem, h, cluster, device_scale=h.device_scale, mesh=h.mesh).iteration_time_s

    h = synthesize_hierarchical(mlp, cluster, batch, evaluate=evaluate)
    return h, evaluate(h)


def test_hierarchical_against_flat_as_the_hand_calculation_says() -> None:
    """An MLP ``x[b, H] -> 4H -> H`` (weights ``P = 32 H^2`` bytes, no input gradient) on 2 nodes
    x 2 GPUs, one 10.4 Gb/s NIC each. Hand calculation of the bytes on the slow link:

    * small batch (``b = 2H``): the flat program can run every op redundantly on the whole batch
      -- nothing crosses the link -- while the hierarchical one splits the batch across nodes and
      must all-reduce the weights' gradients on the rails, ``P / B``: flat wins by about that;
    * large batch (``b = 32 H``): the best flat program is data parallel (the output's all-reduce
      of a Megatron split, ``4 b H = 4P`` bytes, costs more than the weights' ``P``), whose
      all-reduce of P runs NCCL's hierarchical algorithm -- each node's NIC carries
      ``2 (1/2) (P/2) / (B/2) = P / B``, exactly the rails' time: the two tie (within compute
      and intra-node terms).

    A hierarchical program only wins where memory forbids the flat program's replicated weights
    and the flat one must move activations instead (`bench/hap.py` measures HAP's testbed)."""
    cluster = two_nodes_one_nic()
    P = 2 * 4 * H * H * 4
    small, large = 2 * H, 32 * H
    flat_small = _flat(cluster, small)
    h, hier_small = _hier(cluster, small)
    assert h.fits and {c.tensor for _, c in h.world_program.comms if c.group == RAIL} == set(h.problem.graph.params)
    assert hier_small - flat_small > 0.5 * P / INTER
    flat_large = _flat(cluster, large)
    _, hier_large = _hier(cluster, large)
    assert 4 * large * H > P  # Megatron's activation traffic exceeds the weights'
    assert hier_large == pytest.approx(flat_large, rel=0.1)


def test_one_node_is_the_flat_program() -> None:
    """A one-node mesh: no rails, the inner program is the flat search's, and the simulated time
    is the flat program's."""
    cluster = parse_cluster({"name": "one", "nodes": [
        {"name": "n", "gpus": [{"kind": "a100-40gb", "count": 1}, {"kind": "t4", "count": 1}],
         "intra": {"type": "pcie", "bandwidth": "12 GB/s"}}]})
    h, hier = _hier(cluster, 64)
    assert mesh_of(cluster).outer == 1
    assert not [c for _, c in h.world_program.comms if c.group == RAIL]
    assert hier == pytest.approx(_flat(cluster, 64), rel=1e-6)


def test_rail_collective_in_the_simulator_takes_its_priced_time() -> None:
    """The simulated rail all-reduce of the weights' gradients (one DDP bucket: both weights)
    lasts the host's call cost plus `rail_time` of its bytes -- it runs alone on the NICs."""
    from plait.cost.compute import DEFAULT_MODEL

    cluster = two_nodes_one_nic()
    mesh = mesh_of(cluster)
    h, _ = _hier(cluster, 2 * H)
    result = simulate_spmd(h.world_problem, h, cluster, device_scale=h.device_scale, mesh=h.mesh)
    events = [e for e in result.timeline.events if e.args.get("group") == RAIL]
    assert len(events) == 1  # one bucket
    nbytes = sum(h.problem.graph.tensors[t].nbytes for t in h.problem.graph.params)
    sharded = {c.dim is not None for _, c in h.world_program.comms if c.group == RAIL}
    assert len(sharded) == 1  # both weights stored alike inside the node: one bucket
    shares = np.asarray(h.world_ratios, dtype=float).mean(axis=0)[:mesh.inner] if sharded == {True} else None
    rails = rail_links(cluster, mesh)
    nodes = [Devices.from_cluster(cluster, devices=n).links for n in mesh.nodes]
    want = DEFAULT_MODEL.host_comm_s + rail_time(nbytes, shares, rails, nodes)
    assert events[0].end - events[0].start == pytest.approx(want, rel=1e-6)
