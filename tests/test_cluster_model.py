"""Generated clusters: YAML round trip is exact, the vectorised matrices equal a plain
per-pair reference of the documented model, and the fabric graph agrees with them."""

from __future__ import annotations

import networkx as nx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait.cluster import dump_cluster, fabric_graph, parse_yaml_text
from plait.cluster.catalog import GPU_KINDS
from plait.cluster.loader import LINK_TYPES
from plait.cluster.spec import (
    DTYPES,
    Cluster,
    EmulationSpec,
    GPUKind,
    Link,
    NodeSpec,
    PairOverride,
    SwitchSpec,
)
from plait.cluster.topology import bandwidth_matrix, latency_matrix

SETTINGS = settings(max_examples=30, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

pos = st.floats(min_value=1e-6, max_value=1e16, allow_nan=False, allow_infinity=False)
lat = st.floats(min_value=0.0, max_value=1.0, allow_nan=False, allow_infinity=False)
# names that need YAML quoting ("yes", "1e3", "null") or unicode must survive too
NAMES = ["n0", "node-1", "yes", "1e3", "null", "x y", "ü", "a:b", "on", "0x10"]


def links() -> st.SearchStrategy[Link]:
    return st.builds(Link, bandwidth=pos, latency=lat, kind=st.sampled_from(LINK_TYPES))


@st.composite
def clusters(draw: st.DrawFn, max_nodes: int = 5, max_gpus: int = 3,
             overrides: bool = True) -> Cluster:
    kinds: dict[str, GPUKind] = {}
    for k in range(draw(st.integers(0, 2))):
        flops = draw(st.dictionaries(st.sampled_from(DTYPES[1:]), pos, max_size=3))
        flops["fp32"] = draw(pos)
        kinds[f"gpu{k}"] = GPUKind(f"gpu{k}", {d: flops[d] for d in DTYPES if d in flops},
                                   memory_bytes=draw(st.integers(1, 2**50)), memory_bandwidth=draw(pos))
    for name in draw(st.lists(st.sampled_from(list(GPU_KINDS)), max_size=2, unique=True,
                              min_size=0 if kinds else 1)):
        kinds[name] = GPU_KINDS[name]
    n_leaves = draw(st.integers(0, 3))
    switches = [SwitchSpec(f"leaf{i}", "leaf", draw(links())) for i in range(n_leaves)]
    if n_leaves:
        switches += [SwitchSpec(f"spine{i}", "spine") for i in range(draw(st.integers(1, 2)))]
    node_names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=max_nodes, unique=True))
    nodes = [NodeSpec(name=n, gpus=draw(st.lists(st.sampled_from(list(kinds)), min_size=1, max_size=max_gpus)),
                      intra=draw(links()), nic=draw(links()), nics=draw(st.integers(1, 4)),
                      leaf=f"leaf{draw(st.integers(0, n_leaves - 1))}" if n_leaves else None)
             for n in node_names]
    n_dev = sum(len(n.gpus) for n in nodes)
    pairs = []
    if overrides:
        for _ in range(draw(st.integers(0, 4))):
            scope = draw(st.sampled_from(["node", "device"] if n_dev > 1 else ["node"]))
            limit = len(nodes) if scope == "node" else n_dev
            a = draw(st.integers(0, limit - 1))
            b = draw(st.integers(0, limit - 1))
            if scope == "device" and a == b:
                b = (a + 1) % limit
            bw, la = draw(st.one_of(st.tuples(pos, st.none() | lat), st.tuples(st.none(), lat)))
            pairs.append(PairOverride(a=a, b=b, bandwidth=bw, latency=la, scope=scope))
    emulation = draw(st.none() | st.builds(
        EmulationSpec, enabled=st.booleans(), namespaces=st.booleans(), bandwidth_scale=pos,
        slowdown=st.none() | st.dictionaries(st.sampled_from(list(kinds)), pos, max_size=2)))
    return Cluster(name=draw(st.sampled_from(NAMES)), kinds=kinds, nodes=nodes, switches=switches,
                   overrides=pairs, emulation=emulation)


def reference(c: Cluster) -> tuple[np.ndarray, np.ndarray]:
    """The documented model, one pair at a time."""
    devs = [(n, k) for n, node in enumerate(c.nodes) for k in node.gpus]
    uplink = {s.name: s.uplink for s in c.switches if s.tier == "leaf"}
    bw = np.zeros((len(devs), len(devs)))
    la = np.zeros_like(bw)
    for i, (na, ka) in enumerate(devs):
        for j, (nb, _) in enumerate(devs):
            A, B = c.nodes[na], c.nodes[nb]
            if i == j:
                bw[i, j], la[i, j] = c.kinds[ka].memory_bandwidth, 0.0
                continue
            if na == nb:
                b, t = A.intra.bandwidth, A.intra.latency
            else:
                b, t = min(A.nic.bandwidth, B.nic.bandwidth), (A.nic.latency + B.nic.latency) / 2
                if uplink and A.leaf != B.leaf:
                    ua, ub = uplink[A.leaf], uplink[B.leaf]
                    b, t = min(b, ua.bandwidth, ub.bandwidth), t + (ua.latency + ub.latency)
            for o in [o for o in c.overrides if o.scope == "node"] + \
                     [o for o in c.overrides if o.scope == "device"]:
                ends = {na, nb} if o.scope == "node" else {i, j}
                if {o.a, o.b} == ends and (o.scope == "device" or (o.a == o.b) == (na == nb)):
                    b = o.bandwidth if o.bandwidth is not None else b
                    t = o.latency if o.latency is not None else t
            bw[i, j], la[i, j] = b, t
    return bw, la


@SETTINGS
@given(clusters())
def test_yaml_round_trip_is_exact_and_matrices_match_reference(c: Cluster) -> None:
    text = dump_cluster(c)
    back = parse_yaml_text(text, source="round-trip.yaml")
    assert back == c
    assert dump_cluster(back) == text
    bw, la = reference(c)
    np.testing.assert_allclose(bandwidth_matrix(c), bw, rtol=1e-12)
    np.testing.assert_allclose(latency_matrix(c), la, rtol=1e-12, atol=1e-300)
    assert (bandwidth_matrix(c) == bandwidth_matrix(c).T).all()
    dev = c.devices
    assert [d.id for d in dev] == list(range(c.num_devices))
    assert [(d.node, d.local) for d in dev] == [(n, k) for n, node in enumerate(c.nodes)
                                                for k in range(len(node.gpus))]


def _widest(tree: nx.Graph, a: str, b: str) -> float:
    path = nx.shortest_path(tree, a, b)
    return min(tree.edges[u, v]["bandwidth"] for u, v in zip(path, path[1:]))


@settings(SETTINGS, max_examples=20)
@given(clusters(overrides=False))
def test_fabric_graph_agrees_with_matrices(c: Cluster) -> None:
    g = fabric_graph(c)
    bw, la = bandwidth_matrix(c), latency_matrix(c)
    # the widest path is the path in a maximum spanning tree (bottleneck property)
    tree = nx.maximum_spanning_tree(g, weight="bandwidth")
    node_of = [d.node for d in c.devices]
    n = c.num_devices
    assert sum(1 for _, t in g.nodes(data="type") if t == "gpu") == n
    assert sum(1 for _, t in g.nodes(data="type") if t == "nic") == sum(x.nics for x in c.nodes)
    for i in range(n):
        dist = nx.single_source_dijkstra_path_length(g, f"gpu{i}", weight="latency")
        for j in range(i + 1, n):
            if node_of[i] != node_of[j]:
                assert _widest(tree, f"gpu{i}", f"gpu{j}") == bw[i, j]
                assert np.isclose(dist[f"gpu{j}"], la[i, j], rtol=1e-9, atol=1e-300)
            else:  # the direct hop through the node's switch carries the intra link
                sw = f"node{node_of[i]}"
                assert min(g.edges[f"gpu{i}", sw]["bandwidth"], g.edges[sw, f"gpu{j}"]["bandwidth"]) == bw[i, j]
                assert np.isclose(g.edges[f"gpu{i}", sw]["latency"] + g.edges[sw, f"gpu{j}"]["latency"],
                                  la[i, j], rtol=1e-12)
