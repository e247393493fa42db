"""Issue 14 item 5: each collective's algorithm is chosen per message (padded vs grouped uneven
all-gather / reduce-scatter; NCCL's all-reduce algorithm), and its time is the one cost module's
on the program's real device group (intra- vs inter-node links)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from plait.cluster.loader import parse_cluster
from plait.cluster.topology import bandwidth_matrix, latency_matrix
from plait.cost.collectives import (
    CollectiveError,
    choose_algorithm,
    choose_uneven,
    collective_time,
    group_links,
    uneven_collective_time,
)
from plait.cost.program import Problem, evaluate
from plait.cost.spmd import Devices, choose, comm_affine
from plait.graph.aten_capture import capture_aten
from plait.ir.program import Comm, ShardingError
from plait.spmd.search import search


def two_nodes(gpus: int = 2, inter: str = "10.4 Gb/s"):
    """Two nodes of `gpus` GPUs: a V100 node (NVLink) and a P100 node (NVLink), `inter` between."""
    return parse_cluster({"name": "v100-p100", "nodes": [
        {"name": "v", "gpus": {"kind": "v100-16gb", "count": gpus},
         "intra": {"type": "nvlink", "bandwidth": "100 GB/s", "latency": "2 us"},
         "nic": {"type": "ethernet", "bandwidth": inter, "latency": "20 us"}},
        {"name": "p", "gpus": {"kind": "p100-16gb", "count": gpus},
         "intra": {"type": "nvlink", "bandwidth": "80 GB/s", "latency": "2 us"},
         "nic": {"type": "ethernet", "bandwidth": inter, "latency": "20 us"}},
    ]})


def test_padded_and_grouped_by_hand() -> None:
    """n = 4 ranks: padded all-gather ``3a + 3 m S/B`` (ring on 4 shards padded to the largest, m);
    grouped ``sum_i (3a + s_i S/B) = 12a + S/B``. Skewed shards of a large tensor: grouped; even
    shards or a small tensor (latency-bound): padded -- chosen per message."""
    devices = Devices.from_cluster(two_nodes(4, inter="100 Gb/s"), devices=[0, 1, 2, 3])  # one node
    links = devices.links
    a, B = links.ring_latency, links.ring_bandwidth
    assert links.nodes == 1 and a > 0
    skew = np.array([0.7, 0.1, 0.1, 0.1])
    big, small = 64 << 20, 4 << 10
    for S, shares in ((big, skew), (small, skew), (big, np.full(4, 0.25))):
        padded = 3 * a + 3 * shares.max() * S / B
        grouped = 12 * a + S / B
        assert uneven_collective_time("all_gather", S, shares, links, "padded") == pytest.approx(padded)
        assert uneven_collective_time("all_gather", S, shares, links, "grouped") == pytest.approx(grouped)
        want = "grouped" if grouped < padded else "padded"
        comm, t = choose(Comm("all_gather", "x", S, dim=0), devices, shares)
        assert (comm.algorithm, t) == (want, pytest.approx(min(padded, grouped)))
        # a reduce-scatter the same way (reduce per owner instead of broadcast)
        assert choose(Comm("reduce_scatter", "g", S, "bwd", 0), devices, shares)[0].algorithm == want
    assert choose(Comm("all_gather", "x", big, dim=0), devices, skew)[0].algorithm == "grouped"
    assert choose(Comm("all_gather", "x", small, dim=0), devices, skew)[0].algorithm == "padded"
    # one global flag (HAP's) overrides the per-message choice
    assert choose(Comm("all_gather", "x", big, dim=0), devices, skew, "padded")[0].algorithm == "padded"
    assert choose_uneven("all_to_all", big, skew, links)[0] == "padded"  # no grouped all-to-all
    with pytest.raises(CollectiveError, match="grouped"):
        uneven_collective_time("all_to_all", big, skew, links, "grouped")


def test_affine_coefficients_come_from_the_cost_module() -> None:
    devices = Devices.from_cluster(two_nodes(4, inter="100 Gb/s"), devices=[0, 1, 2, 3])
    for algo in ("padded", "grouped"):
        comm = Comm("all_gather", "x", 8 << 20, dim=0, algorithm=algo)
        a, b = comm_affine(comm, devices)
        for shares in (np.full(4, 0.25), np.array([0.4, 0.2, 0.2, 0.2]), np.array([0.85, 0.05, 0.05, 0.05])):
            want = uneven_collective_time("all_gather", comm.nbytes, shares, devices.links, algo)
            assert a + b * shares.max() == pytest.approx(want, rel=1e-9)
        assert (b > 0) == (algo == "padded")  # grouped does not depend on the ratios


def test_all_reduce_algorithm_is_nccls_choice_on_the_group_and_ring_under_haps_model() -> None:
    devices = Devices.from_cluster(two_nodes(4))  # 8 GPUs over 2 nodes
    comm = Comm("all_reduce", "g", 256 << 20, "bwd")
    want = choose_algorithm("all_reduce", comm.nbytes, devices.links)
    chosen, t = choose(comm, devices, np.full(8, 1 / 8))
    assert chosen.algorithm == want == "hierarchical"
    assert t == pytest.approx(collective_time("all_reduce", comm.nbytes, devices.links, want))
    hap, t_hap = choose(comm, devices.hap_model(), np.full(8, 1 / 8))
    assert hap.algorithm == "ring" and t_hap > t


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(512, 2048), nn.Linear(2048, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_same_program_on_an_intra_node_and_an_inter_node_group() -> None:
    """The same strategies cost what the cost module says on each group's links: two GPUs of one
    node (NVLink) against one GPU on each node (10.4 Gb/s Ethernet)."""
    cluster = two_nodes(2)
    graph = capture_aten(Mlp(), (torch.randn(512, 512),), name="mlp")
    bw, lat = bandwidth_matrix(cluster), latency_matrix(cluster)
    node_of = [d.node for d in cluster.devices]
    costs = {}
    for ids in ([2, 3], [1, 2]):  # two P100s in node p | the V100 and a P100 across nodes
        devices = Devices.from_cluster(cluster, devices=ids)
        problem = Problem.build(graph, devices)
        r = np.full(2, 0.5)
        # data parallel: every op's first sharded strategy along the batch, weights replicated
        choice = [next(i for i, s in enumerate(opts) if s.inputs[0] == "S0" and all(
            q == "R" for t, q in zip(op.inputs, s.inputs) if graph.tensors[t].role == "param"))
            for op, opts in zip(graph.ops, problem.options)]
        program = evaluate(problem, choice, r)
        links = group_links(ids, bw, lat, node_of, [1, 1])
        want = sum(collective_time(c.op, c.nbytes, links, choose_algorithm(c.op, c.nbytes, links))
                   for _, c in program.comms)
        assert {c.op for _, c in program.comms} == {"all_reduce"}
        assert program.communication == pytest.approx(want, rel=1e-12)
        costs[tuple(ids)] = program.communication
    assert costs[(1, 2)] > 10 * costs[(2, 3)]  # Ethernet between nodes vs NVLink inside one


def test_per_message_choice_is_never_worse_than_one_global_flag() -> None:
    cluster = two_nodes(2, inter="100 Gb/s")
    graph = capture_aten(Mlp(), (torch.randn(64, 512),), name="mlp")
    r = np.array([0.4, 0.4, 0.1, 0.1])
    costs = {mode: search(Problem.build(graph, Devices.from_cluster(cluster), mode), r).cost
             for mode in ("auto", "padded", "grouped")}
    assert costs["auto"] <= min(costs["padded"], costs["grouped"]) * (1 + 1e-12)
    with pytest.raises(ShardingError, match="collectives"):
        Problem.build(graph, Devices.from_cluster(cluster), "sometimes")
