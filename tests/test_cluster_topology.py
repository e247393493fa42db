"""Topology: leaf/spine paths, overrides, node-level matrices, caching, removing nodes."""

from __future__ import annotations

import copy
import dataclasses
import textwrap

import networkx as nx
import numpy as np
import pytest

from plait.cluster import (
    fabric_graph,
    load_cluster,
    node_bandwidth_matrix,
    node_latency_matrix,
    parse_yaml_text,
    without_nodes,
)
from plait.cluster.spec import ClusterError, Link, PairOverride
from plait.cluster.topology import bandwidth_matrix, latency_matrix, nic_of_gpu, node_of_device

LEAF_SPINE = textwrap.dedent("""
    name: ls
    fabric:
      type: infiniband
      bandwidth: 200 Gb/s
      latency: 4 us
      nics: 2
      switches:
        leaves:
          - {name: L0, uplink: {bandwidth: 100 Gb/s, latency: 1 us}}
          - {name: L1, uplink: {bandwidth: 400 Gb/s, latency: 0.5 us}}
        spines: [S0, S1, S2]
    nodes:
      - {name: a, gpus: {kind: a100, count: 2}, leaf: L0}
      - {name: b, gpus: {kind: a100, count: 2}, leaf: L0, nic: {bandwidth: 400 Gb/s, latency: 2 us}}
      - {name: c, gpus: {kind: v100, count: 2}, leaf: L1, intra: {type: pcie, bandwidth: 16 GB/s}}
    overrides:
      - {nodes: [b, c], latency: 50 us}
      - {devices: ["a:0", "b:1"], bandwidth: 1 GB/s}
      - {devices: [3, 2], bandwidth: 2 GB/s}
""")


@pytest.fixture(scope="module")
def ls():
    return parse_yaml_text(LEAF_SPINE, source="ls.yaml")


def test_leaf_spine_bandwidth_and_latency(ls) -> None:
    bw, lat = bandwidth_matrix(ls), latency_matrix(ls)
    G = 1e9
    # same node: intra link; diagonal: memory bandwidth and zero latency
    assert bw[0, 1] == 300 * G and lat[0, 1] == 2e-6
    assert bw[4, 5] == 16 * G and lat[4, 5] == 4e-6       # pcie default latency
    assert bw[0, 0] == 2039 * G and bw[4, 4] == 900 * G and lat[3, 3] == 0
    # same leaf: min of the NICs; latency half of each end's NIC figure
    assert bw[1, 2] == 25 * G and lat[1, 2] == pytest.approx(3e-6)
    # overridden device pairs (symmetric, ids or "node:local")
    assert bw[0, 3] == bw[3, 0] == 1 * G and bw[2, 3] == 2 * G
    # across leaves: the slower uplink caps it, latency adds both uplinks
    assert bw[0, 4] == 12.5 * G and lat[0, 4] == pytest.approx(4e-6 + 1.5e-6)
    assert bw[2, 4] == 12.5 * G                            # L0 uplink 100 Gb/s
    assert lat[2, 4] == 50e-6 and lat[3, 5] == 50e-6        # node override: latency only
    assert (bw == bw.T).all() and (lat == lat.T).all()


def test_node_matrices(ls) -> None:
    nb, nl = node_bandwidth_matrix(ls), node_latency_matrix(ls)
    G = 1e9
    assert nb.shape == (3, 3)
    assert nb[0, 0] == 300 * G and nb[2, 2] == 16 * G
    assert nb[0, 1] == nb[1, 0] == 1 * G                    # slowest device pair incl. overrides
    assert nb[1, 2] == 12.5 * G and nl[1, 2] == 50e-6
    assert nl[0, 0] == 2e-6


def test_single_gpu_nodes_node_matrix() -> None:
    c = load_cluster("a100:nodes=3,gpus_per_node=1")
    nb = node_bandwidth_matrix(c)
    assert nb[0, 0] == 300e9 and nb[0, 1] == 25e9
    assert node_latency_matrix(c)[1, 1] == c.nodes[1].intra.latency


def test_fabric_graph_structure(ls) -> None:
    g = fabric_graph(ls)
    types = nx.get_node_attributes(g, "type")
    assert sorted(set(types.values())) == ["gpu", "leaf", "nic", "node_switch", "spine"]
    assert sum(t == "gpu" for t in types.values()) == 6
    assert sum(t == "nic" for t in types.values()) == 6    # fabric.nics: 2 per node
    assert g.edges["leaf:L0", "spine:S2"]["bandwidth"] == 12.5e9
    assert g.edges["nic1.0", "leaf:L0"]["bandwidth"] == 50e9
    assert g.edges["gpu3", "nic1.1"]["kind"] == "pcie"     # rail affinity: GPU j -> NIC j
    assert g.nodes["gpu4"]["kind"] == "v100-32gb"
    with pytest.raises(nx.NetworkXError):                  # frozen: cached, shared
        g.add_edge("x", "y")
    assert nx.is_connected(g)


def test_no_switches_means_one_core() -> None:
    g = fabric_graph(load_cluster("dgx-a100:nodes=2"))
    assert g.nodes["core"]["type"] == "core" and g.degree["core"] == 16


@pytest.mark.parametrize("gpus, nics, expected", [
    (8, 8, [[0], [1], [2], [3], [4], [5], [6], [7]]),
    (8, 4, [[0], [0], [1], [1], [2], [2], [3], [3]]),
    (8, 1, [[0]] * 8),
    (2, 4, [[0, 1], [2, 3]]),
])
def test_nic_affinity(gpus, nics, expected) -> None:
    assert [nic_of_gpu(j, gpus, nics) for j in range(gpus)] == expected


def test_matrices_are_cached_read_only_and_follow_edits(ls) -> None:
    bw = bandwidth_matrix(ls)
    assert bandwidth_matrix(ls) is bw
    with pytest.raises(ValueError):
        bw[0, 1] = 0
    # a copy that is then edited is recomputed, not served stale
    edited = copy.deepcopy(ls)
    edited.nodes[0].intra = Link(bandwidth=1e9, latency=1e-6, kind="pcie")
    edited.overrides.append(PairOverride(a=4, b=5, bandwidth=3e9))
    b2 = bandwidth_matrix(edited)
    assert b2[0, 1] == 1e9 and b2[4, 5] == 3e9 and bw[0, 1] == 300e9
    assert edited != ls and copy.deepcopy(ls) == ls


def test_code_built_cluster_is_checked(ls) -> None:
    bad = copy.deepcopy(ls)
    bad.nodes[0].gpus = ["nope"]
    with pytest.raises(ClusterError, match=r"nodes\[0\].gpus: kind 'nope'"):
        bandwidth_matrix(bad)
    bad = copy.deepcopy(ls)
    bad.overrides.append(PairOverride(a=0, b=99))
    with pytest.raises(ClusterError, match=r"overrides\[3\]: device 99 is out of range"):
        latency_matrix(bad)


def test_without_nodes(ls) -> None:
    rest = without_nodes(ls, [1])
    assert [n.name for n in rest.nodes] == ["a", "c"] and rest.num_devices == 4
    # device overrides touching node b are dropped; node override (b, c) too
    assert rest.overrides == []
    assert bandwidth_matrix(rest)[0, 2] == 12.5e9
    rest2 = without_nodes(ls, [0])
    assert rest2.overrides == [dataclasses.replace(ls.overrides[0], a=0, b=1),
                               dataclasses.replace(ls.overrides[2], a=1, b=0)]
    assert bandwidth_matrix(rest2)[0, 1] == 2e9
    assert set(rest2.kinds) == {"a100-80gb", "v100-32gb"}
    with pytest.raises(ClusterError, match="cannot remove every node"):
        without_nodes(ls, [0, 1, 2])


def test_1024_devices() -> None:
    c = load_cluster("large-mixed:nodes=128")
    assert c.num_devices == 1024 and len(c.devices) == 1024
    bw = bandwidth_matrix(c)
    node_of = node_of_device(c)
    assert bw.shape == (1024, 1024)
    inter = bw[node_of[:, None] != node_of[None, :]]
    # A100 and V100 NICs, slow pairs at a quarter: 4 distinct inter-node figures
    assert sorted(np.unique(inter) / 1e9) == [3.125, 6.25, 12.5, 25.0]
    assert fabric_graph(c).number_of_nodes() == 1024 + 128 + 128 * 8 - 64 * 4 + 8 + 8
