"""Presets: parameters, the mixed/uneven/large clusters, the emulated default, errors."""

from __future__ import annotations

import numpy as np
import pytest

from plait.cluster import DEFAULT_CLUSTER, PRESETS, dump_cluster, load_cluster, parse_yaml_text
from plait.cluster.catalog import GPU_KINDS, NODE_TEMPLATES
from plait.cluster.spec import Cluster, ClusterError
from plait.cluster.topology import bandwidth_matrix, node_bandwidth_matrix, node_of_device


@pytest.mark.parametrize("kind", list(GPU_KINDS))
def test_every_catalog_kind_is_a_preset(kind: str) -> None:
    c = load_cluster(f"{kind}:nodes=2,gpus_per_node=4")
    assert c.num_nodes == 2 and c.num_devices == 8 and list(c.kinds) == [kind]
    assert c.nodes[0].intra == NODE_TEMPLATES[kind].intra
    assert bandwidth_matrix(c)[0, 4] == NODE_TEMPLATES[kind].nic.bandwidth


def test_kind_preset_defaults_and_overrides() -> None:
    c = load_cluster("a100-80g:nodes=8")
    assert c.num_devices == 64 and c.source == "preset a100-80g:nodes=8"
    c = load_cluster("h100:nic=100Gb/s,nics=2,intra=900 GB/s")
    assert c.num_devices == 8 and c.nodes[0].nic.bandwidth == 12.5e9 and c.nodes[0].nics == 2
    assert c.nodes[0].intra.bandwidth == 900e9


def test_dgx_presets() -> None:
    for name, kind in (("dgx-a100", "a100-80gb"), ("dgx-h100", "h100-80gb"), ("dgx-1", "v100-32gb")):
        c = load_cluster(f"{name}:nodes=3")
        assert c.num_devices == 24 and set(c.kinds) == {kind}


def test_mixed_a100_v100() -> None:
    c = load_cluster("mixed-a100-v100:a100_nodes=2,v100_nodes=2")
    assert [n.gpus[0] for n in c.nodes] == ["a100-80gb"] * 2 + ["v100-32gb"] * 2
    nb = node_bandwidth_matrix(c)
    assert np.diag(nb).tolist() == [300e9, 300e9, 150e9, 150e9]   # NVLink 3 vs NVLink 2
    assert nb[0, 1] == 25e9 and nb[2, 3] == 12.5e9 and nb[0, 2] == 12.5e9
    assert load_cluster("mixed-a100-v100:a100_nodes=0,v100_nodes=1").num_devices == 8


def test_uneven_is_deterministic_and_has_the_asked_fraction() -> None:
    c = load_cluster("uneven:nodes=8,slow_fraction=0.5,slow_factor=0.25")
    nb = node_bandwidth_matrix(c)
    off = nb[np.triu_indices(8, k=1)]
    assert c.num_devices == 64 and len(off) == 28
    assert (off == 25e9 / 4).sum() == 14 and (off == 25e9).sum() == 14
    again = load_cluster("uneven:nodes=8,slow_fraction=0.5,slow_factor=0.25")
    assert again == c and (node_bandwidth_matrix(again) == nb).all()
    other = load_cluster("uneven:nodes=8,seed=1")
    assert not (node_bandwidth_matrix(other) == nb).all()
    # every device pair across a slow node pair is slow
    node_of = node_of_device(c)
    bw = bandwidth_matrix(c)
    a, b = np.argwhere(nb == 25e9 / 4)[0]
    assert (bw[np.ix_(node_of == a, node_of == b)] == 25e9 / 4).all()


def test_large_mixed() -> None:
    c = load_cluster("large-mixed:nodes=128")
    assert c.num_devices == 1024 and set(c.kinds) == {"a100-80gb", "v100-32gb"}
    leaves = [s for s in c.switches if s.tier == "leaf"]
    assert len(leaves) == 8 and sum(s.tier == "spine" for s in c.switches) == 8
    assert len({n.leaf for n in c.nodes}) == 8
    assert len(c.overrides) == round(0.1 * 128 * 127 / 2)


def test_emulated_mixed_default() -> None:
    assert DEFAULT_CLUSTER == "emulated-mixed"
    c = load_cluster(None)
    assert c == load_cluster("emulated-mixed") and c.num_devices == 4
    assert [n.gpus for n in c.nodes] == [["a100-80gb"] * 2, ["v100-32gb"] * 2]
    e = c.emulation
    assert e.enabled and e.namespaces and e.slowdown is None
    # scaled inter-node link ~1 Gb/s; scaled intra links faster than it
    inter = bandwidth_matrix(c)[0, 2] * e.bandwidth_scale
    assert inter * 8 == pytest.approx(1e9)
    assert min(n.intra.bandwidth for n in c.nodes) * e.bandwidth_scale > 5 * inter
    assert load_cluster("emulated-mixed:namespaces=false").emulation.namespaces is False


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_through_yaml(name: str) -> None:
    spec = f"{name}:nodes=20" if name == "large-mixed" else name
    c = load_cluster(spec)
    assert isinstance(c, Cluster)
    assert parse_yaml_text(dump_cluster(c)) == c


@pytest.mark.parametrize("spec, fragment", [
    ("nope", "unknown cluster 'nope': not a file, and not a preset; presets: dgx-a100"),
    ("a100:gpus=8", "unknown parameter 'gpus'; parameters: nodes, gpus_per_node"),
    ("a100:nodes=two", "nodes: expected an integer, got 'two'"),
    ("a100:nodes=0", "nodes: must be between 1 and 65536"),
    ("a100:nodes", "expected key=value"),
    ("a100:nodes=1,nodes=2", "nodes given twice"),
    ("uneven:slow_factor=0", "slow_factor: must be > 0"),
    ("uneven:slow_fraction=1.5", "slow_fraction: must be in [0, 1]"),
    ("large-mixed:fast=b200", "fast: unknown GPU kind"),
    ("h100:nic=fast", "nic: expected a bandwidth"),
    ("emulated-mixed:namespaces=maybe", "namespaces: expected true or false"),
    ("mixed-a100-v100:a100_nodes=0,v100_nodes=0", "must be at least 1"),
    ("missing.yaml", "missing.yaml: no such cluster file"),
])
def test_preset_errors(spec: str, fragment: str) -> None:
    with pytest.raises(ClusterError) as info:
        load_cluster(spec)
    assert fragment in str(info.value)


def test_load_cluster_passes_clusters_through_and_rejects_other_types() -> None:
    c = load_cluster("t4")
    assert load_cluster(c) is c
    with pytest.raises(ClusterError, match="expected a Cluster, a YAML path or a preset"):
        load_cluster(42)
