"""Derived views of a Cluster: devices, effective bandwidth/latency matrices, fabric graph.

Model (all figures one direction, bytes/s and seconds):

* same node, devices i != j: the node's intra link (NVLink/NVSwitch or PCIe);
* different nodes: a flow uses one NIC at each end (GPU-NIC affinity, as NCCL does with
  one NIC per GPU), so ``bw = min(nic_a, nic_b)``; when the fabric has leaf/spine
  switches and the nodes hang off different leaves, the flow also crosses one uplink at
  each leaf (ECMP picks one spine), so ``bw = min(nic_a, nic_b, uplink_a, uplink_b)``;
* latency is the sum of the hops: ``nic_a/2 + nic_b/2`` (a NIC's latency is given as its
  node-to-node figure, so two equal NICs give exactly that), plus ``uplink_a + uplink_b``
  across leaves; same node: the intra latency;
* measured `PairOverride`s then replace these figures (node pairs first, then devices);
* the diagonal is the device's memory bandwidth and zero latency.

These are *pairwise* figures: they ignore contention between concurrent flows, which
the flow-level simulator over `fabric_graph` models.

Clusters are used read-only after loading; the matrices are cached on the object,
keyed by the cluster's content (so a copied-and-edited cluster is recomputed), and
returned read-only. Everything is vectorised with numpy: 1024 devices take
milliseconds.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.cluster.spec import (
    ECMP_HASHES,
    NCCL_ALGORITHMS,
    SWITCH_TIERS,
    Cluster,
    ClusterError,
    Device,
    FabricSpec,
    PairOverride,
)

if TYPE_CHECKING:
    import networkx as nx

_CACHE_ATTR = "_plait_topology_cache"


def _fingerprint(cluster: Cluster) -> tuple:
    """Everything the derived views depend on, as a hashable value (cheap: O(nodes + overrides))."""
    return (
        tuple((n.name, tuple(n.gpus), n.intra, n.nic, n.nics, n.leaf, tuple(n.leaves or ()))
              for n in cluster.nodes),
        tuple(
            (name, k.memory_bandwidth, k.memory_bytes, tuple(sorted(k.peak_flops.items())))
            for name, k in cluster.kinds.items()
        ),
        tuple((s.name, s.tier, s.uplink, s.links, s.pod, s.rail) for s in cluster.switches),
        None if cluster.fabric is None else (cluster.fabric.ports, cluster.fabric.channels,
                                             cluster.fabric.ecmp_seed, cluster.fabric.ecmp_hash,
                                             tuple(cluster.fabric.failed)),
        tuple((o.a, o.b, o.bandwidth, o.latency, o.scope) for o in cluster.overrides),
    )


def _cache(cluster: Cluster) -> dict[str, Any]:
    key = _fingerprint(cluster)
    entry = cluster.__dict__.get(_CACHE_ATTR)
    if entry is None or entry[0] != key:
        check_cluster(cluster)
        entry = (key, {})
        cluster.__dict__[_CACHE_ATTR] = entry
    return entry[1]


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def check_cluster(cluster: Cluster) -> None:
    """Consistency a cluster built in code must have (the YAML loader checks more, with paths)."""
    where = cluster.source
    if not cluster.nodes:
        raise ClusterError(f"{where}: nodes: a cluster needs at least one node")
    leaves = {s.name for s in cluster.switches if s.tier == "leaf"}
    spines = [s for s in cluster.switches if s.tier == "spine"]
    for i, node in enumerate(cluster.nodes):
        if not node.gpus:
            raise ClusterError(f"{where}: nodes[{i}].gpus: a node needs at least one GPU")
        for kind in node.gpus:
            if kind not in cluster.kinds:
                raise ClusterError(
                    f"{where}: nodes[{i}].gpus: kind {kind!r} is not in the cluster's kinds "
                    f"({', '.join(cluster.kinds)})"
                )
        for field_name, link in (("intra", node.intra), ("nic", node.nic)):
            if not (link.bandwidth > 0 and np.isfinite(link.bandwidth)):
                raise ClusterError(f"{where}: nodes[{i}].{field_name}.bandwidth: must be > 0")
            if not (link.latency >= 0 and np.isfinite(link.latency)):
                raise ClusterError(f"{where}: nodes[{i}].{field_name}.latency: must be >= 0")
        if leaves and node.leaf not in leaves:
            raise ClusterError(
                f"{where}: nodes[{i}].leaf: {node.leaf!r} is not a leaf switch "
                f"({', '.join(sorted(leaves))})"
            )
        if not leaves and node.leaf is not None:
            raise ClusterError(f"{where}: nodes[{i}].leaf: {node.leaf!r} but the fabric has no leaves")
    if len(leaves) > 1 and not spines:
        raise ClusterError(f"{where}: fabric.switches.spines: {len(leaves)} leaves need spines")
    for s in cluster.switches:
        if s.tier == "leaf" and len(leaves) > 1 and s.uplink is None:
            raise ClusterError(f"{where}: fabric.switches.leaves: leaf {s.name!r} needs an uplink")
    _check_fabric(cluster)
    n_dev, n_node = cluster.num_devices, cluster.num_nodes
    for i, o in enumerate(cluster.overrides):
        limit = n_node if o.scope == "node" else n_dev
        if o.scope not in ("node", "device"):
            raise ClusterError(f"{where}: overrides[{i}]: scope must be 'node' or 'device'")
        for v in (o.a, o.b):
            if not (isinstance(v, (int, np.integer)) and 0 <= v < limit):
                raise ClusterError(
                    f"{where}: overrides[{i}]: {o.scope} {v!r} is out of range 0..{limit - 1}"
                )


def _check_fabric(cluster: Cluster) -> None:
    """The multi-path parts: tiers, pods, rails, ports, channels, hash mode (failed links are
    checked against the link graph by `plait.net.fabric`)."""
    where = cluster.source
    names = {s.name: s for s in cluster.switches}
    for s in cluster.switches:
        if s.tier not in SWITCH_TIERS:
            raise ClusterError(f"{where}: fabric.switches: switch {s.name!r}: tier must be one of "
                               f"{', '.join(SWITCH_TIERS)}, got {s.tier!r}")
        if s.links < 1:
            raise ClusterError(f"{where}: fabric.switches: switch {s.name!r}: links must be >= 1")
    cores = [s for s in cluster.switches if s.tier == "core"]
    if cores and any(s.uplink is None for s in cluster.switches if s.tier == "spine"):
        raise ClusterError(f"{where}: fabric.switches.spines: a fabric with cores needs the spines' uplink")
    for i, node in enumerate(cluster.nodes):
        for r, leaf in enumerate(node.leaves or ()):
            if leaf not in names or names[leaf].tier != "leaf":
                raise ClusterError(f"{where}: nodes[{i}].leaf[{r}]: {leaf!r} is not a leaf switch")
        if node.nics < 1:
            raise ClusterError(f"{where}: nodes[{i}].nic.count: a node needs at least one NIC, got {node.nics}")
        for r, leaf in enumerate(node.leaves or ()):
            rail = names[leaf].rail if leaf in names else None
            if rail is not None and rail != r:
                raise ClusterError(f"{where}: nodes[{i}].leaf[{r}]: {leaf!r} serves rail {rail}, not NIC {r}")
        if node.leaves and len(node.leaves) != node.nics:
            raise ClusterError(f"{where}: nodes[{i}].leaf: {len(node.leaves)} leaves for {node.nics} NICs "
                               "(a rail-optimised node names one leaf per NIC)")
    fab = cluster.fabric
    if fab is not None:
        if not 1 <= fab.ports <= 2:
            raise ClusterError(f"{where}: fabric.ports: a NIC has 1 or 2 (bonded) ports, got {fab.ports}")
        if fab.channels < 1:
            raise ClusterError(f"{where}: fabric.channels: must be >= 1, got {fab.channels}")
        n = fab.nccl
        for key, v in (("qps_per_connection", n.qps_per_connection), ("min_channels", n.min_channels),
                       ("max_channels", n.max_channels)):
            if v < 1:
                raise ClusterError(f"{where}: fabric.nccl.{key}: a flow count must be >= 1, got {v}")
        if n.min_channels > n.max_channels:
            raise ClusterError(f"{where}: fabric.nccl.min_channels: {n.min_channels} is above "
                               f"fabric.nccl.max_channels {n.max_channels}")
        if n.algorithm not in NCCL_ALGORITHMS:
            raise ClusterError(f"{where}: fabric.nccl.algorithm: must be one of {', '.join(NCCL_ALGORITHMS)}, "
                               f"got {n.algorithm!r}")
        if fab.ecmp_hash not in ECMP_HASHES:
            raise ClusterError(f"{where}: fabric.ecmp.hash: must be one of {', '.join(ECMP_HASHES)}, "
                               f"got {fab.ecmp_hash!r}")


def devices_of(cluster: Cluster) -> list[Device]:
    """Devices numbered node-major (`Cluster.devices`), after the consistency checks."""
    _cache(cluster)
    return cluster.devices


def node_of_device(cluster: Cluster) -> np.ndarray:
    """(n,) node index of each device."""
    cache = _cache(cluster)
    if "node_of" not in cache:
        sizes = [len(n.gpus) for n in cluster.nodes]
        cache["node_of"] = _readonly(np.repeat(np.arange(len(sizes)), sizes))
    return cache["node_of"]


def _node_level(cluster: Cluster) -> tuple[np.ndarray, np.ndarray]:
    """(N, N) per-device-pair bandwidth and latency between nodes; diagonal: intra link."""
    nodes = cluster.nodes
    nic_bw = np.array([n.nic.bandwidth for n in nodes], dtype=float)
    nic_lat = np.array([n.nic.latency for n in nodes], dtype=float)
    bw = np.minimum.outer(nic_bw, nic_bw)
    lat = np.add.outer(nic_lat, nic_lat) / 2
    leaves = [s for s in cluster.switches if s.tier == "leaf"]
    if leaves:
        index = {s.name: i for i, s in enumerate(leaves)}
        # A hop's channels (distinct 5-tuples) can take distinct cables, so uncontended a hop
        # gets up to channels x one cable (plait.net models which cables they really take).
        spread = 1 if cluster.fabric is None else cluster.fabric.channels
        up_bw = np.array([s.uplink.bandwidth * min(spread, s.links * max(1, len(cluster.switches)))
                          if s.uplink else np.inf for s in leaves])
        up_lat = np.array([s.uplink.latency if s.uplink else 0.0 for s in leaves])
        leaf = np.array([index[n.leaf] for n in nodes])
        cross = leaf[:, None] != leaf[None, :]
        bw = np.where(cross, np.minimum(bw, np.minimum.outer(up_bw[leaf], up_bw[leaf])), bw)
        lat = lat + np.where(cross, np.add.outer(up_lat[leaf], up_lat[leaf]), 0.0)
    idx = np.arange(len(nodes))
    bw[idx, idx] = [n.intra.bandwidth for n in nodes]
    lat[idx, idx] = [n.intra.latency for n in nodes]
    _apply_overrides(bw, lat, [o for o in cluster.overrides if o.scope == "node"])
    return bw, lat


def _apply_overrides(bw: np.ndarray, lat: np.ndarray, overrides: list[PairOverride]) -> None:
    """Symmetric assignment, later overrides winning (pairs normalised so (a,b)==(b,a))."""
    for attr, target in (("bandwidth", bw), ("latency", lat)):
        chosen = [o for o in overrides if getattr(o, attr) is not None]
        if not chosen:
            continue
        a = np.array([min(o.a, o.b) for o in chosen], dtype=np.int64)
        b = np.array([max(o.a, o.b) for o in chosen], dtype=np.int64)
        values = np.array([getattr(o, attr) for o in chosen], dtype=float)
        target[a, b] = values
        target[b, a] = values


def _matrices(cluster: Cluster) -> tuple[np.ndarray, np.ndarray]:
    cache = _cache(cluster)
    if "bw" not in cache:
        node_bw, node_lat = _node_level(cluster)
        node_of = node_of_device(cluster)
        bw = node_bw[np.ix_(node_of, node_of)]
        lat = node_lat[np.ix_(node_of, node_of)]
        _apply_overrides(bw, lat, [o for o in cluster.overrides if o.scope == "device"])
        # Diagonal: a device "talking to itself" moves data through its own memory.
        mem_bw = np.array([cluster.kinds[k].memory_bandwidth for n in cluster.nodes for k in n.gpus])
        np.fill_diagonal(bw, mem_bw)
        np.fill_diagonal(lat, 0.0)
        cache["bw"], cache["lat"] = _readonly(bw), _readonly(lat)
    return cache["bw"], cache["lat"]


def bandwidth_matrix(cluster: Cluster) -> np.ndarray:
    """(n, n) effective device-to-device bandwidth in bytes/s (read-only; copy to edit)."""
    return _matrices(cluster)[0]


def latency_matrix(cluster: Cluster) -> np.ndarray:
    """(n, n) device-to-device latency in seconds (read-only; copy to edit)."""
    return _matrices(cluster)[1]


def _block_reduce(m: np.ndarray, starts: np.ndarray, ufunc: np.ufunc) -> np.ndarray:
    return ufunc.reduceat(ufunc.reduceat(m, starts, axis=0), starts, axis=1)


def node_bandwidth_matrix(cluster: Cluster) -> np.ndarray:
    """(N, N) slowest device-pair bandwidth between nodes i and j (diagonal: within node i).

    The min over device pairs is what a ring or pipeline step across the two nodes is
    paced by (Pipette's "slowest link dominates"); overrides are included."""
    cache = _cache(cluster)
    if "node_bw" not in cache:
        bw = bandwidth_matrix(cluster).copy()
        np.fill_diagonal(bw, np.inf)
        starts = np.concatenate([[0], np.cumsum([len(n.gpus) for n in cluster.nodes])[:-1]])
        out = _block_reduce(bw, starts, np.minimum)
        single = ~np.isfinite(np.diag(out))  # one-GPU nodes have no intra pair: link figure
        out[single, single] = [n.intra.bandwidth for n, s in zip(cluster.nodes, single) if s]
        cache["node_bw"] = _readonly(out)
    return cache["node_bw"]


def node_latency_matrix(cluster: Cluster) -> np.ndarray:
    """(N, N) largest device-pair latency between nodes i and j (diagonal: within node i)."""
    cache = _cache(cluster)
    if "node_lat" not in cache:
        lat = latency_matrix(cluster).copy()
        np.fill_diagonal(lat, -np.inf)
        starts = np.concatenate([[0], np.cumsum([len(n.gpus) for n in cluster.nodes])[:-1]])
        out = _block_reduce(lat, starts, np.maximum)
        single = ~np.isfinite(np.diag(out))
        out[single, single] = [n.intra.latency for n, s in zip(cluster.nodes, single) if s]
        cache["node_lat"] = _readonly(out)
    return cache["node_lat"]


def nic_of_gpu(local: int, gpus: int, nics: int) -> list[int]:
    """NICs a GPU uses (rail affinity): GPU j -> NIC floor(j*k/g); with more NICs than GPUs
    each GPU gets the NICs i with floor(i*g/k) == j."""
    if nics <= gpus:
        return [local * nics // gpus]
    return [i for i in range(nics) if i * gpus // nics == local]


def fabric_graph(cluster: Cluster) -> nx.Graph:
    """The physical fabric as an undirected graph (frozen: copy with `nx.Graph(g)` to edit).

    Vertices (attribute ``type``): ``gpu{i}`` (``device``, ``node``), ``node{n}`` the
    node's internal switch (NVSwitch / PCIe root, ``node``), ``nic{n}.{k}`` (``node``),
    ``leaf:{name}``, ``spine:{name}``, and ``core`` -- one non-blocking switch standing
    for the fabric when no switches are given. Edges carry ``bandwidth`` (bytes/s, one
    direction), ``latency`` (s) and ``kind`` (link type):

    * gpu -- node switch: intra link, half its latency (so gpu-gpu is the intra latency);
    * gpu -- nic: PCIe/GPUDirect, NIC bandwidth, no latency;
    * nic -- leaf (or core): the NIC, half its latency;
    * leaf -- each spine (of its pod), spine -- each core: the lower switch's uplink times its
      parallel cables (attribute ``cables``); a rail-optimised node's NIC k hangs off its
      k-th leaf. `plait.net.fabric` keeps each cable and direction apart for flows.

    So the widest path between two GPUs is the `bandwidth_matrix` figure and the
    lowest-latency path its latency, before overrides (measured pair figures have no
    place in a physical graph).
    """
    import networkx as nx  # here, not at module import: `import plait.cluster` stays light

    cache = _cache(cluster)
    if "graph" in cache:
        return cache["graph"]
    g = nx.Graph(name=cluster.name)
    leaves = [s for s in cluster.switches if s.tier == "leaf"]
    spines = [s for s in cluster.switches if s.tier == "spine"]
    if not leaves:
        g.add_node("core", type="core")
    for s in leaves:
        g.add_node(f"leaf:{s.name}", type="leaf")
    for s in spines:
        g.add_node(f"spine:{s.name}", type="spine")
    cores = [s for s in cluster.switches if s.tier == "core"]
    for s in cores:
        g.add_node(f"core:{s.name}", type="core")
    # leaf -- each spine of its pod, spine -- each core; `cables` parallel cables, whose
    # aggregate the edge's bandwidth is (plait.net.fabric keeps them apart, one link each)
    for lo, his, tier in [(leaf, [t for t in spines if leaf.pod is None or t.pod == leaf.pod], "spine")
                          for leaf in leaves] + [(spine, cores, "core") for spine in spines]:
        if lo.uplink is None:
            continue
        for hi in his:
            g.add_edge(f"{lo.tier}:{lo.name}", f"{tier}:{hi.name}", bandwidth=lo.uplink.bandwidth * lo.links,
                       latency=lo.uplink.latency, kind=lo.uplink.kind, cables=lo.links)
    dev = 0
    for n, node in enumerate(cluster.nodes):
        sw = f"node{n}"
        g.add_node(sw, type="node_switch", node=n)
        for k in range(node.nics):
            up = (f"leaf:{node.leaves[k]}" if node.leaves else f"leaf:{node.leaf}") if leaves else "core"
            nic = f"nic{n}.{k}"
            g.add_node(nic, type="nic", node=n)
            g.add_edge(nic, up, bandwidth=node.nic.bandwidth, latency=node.nic.latency / 2,
                       kind=node.nic.kind)
        for local, _kind in enumerate(node.gpus):
            gpu = f"gpu{dev + local}"
            g.add_node(gpu, type="gpu", device=dev + local, node=n, kind=_kind)
            g.add_edge(gpu, sw, bandwidth=node.intra.bandwidth, latency=node.intra.latency / 2,
                       kind=node.intra.kind)
            for k in nic_of_gpu(local, len(node.gpus), node.nics):
                g.add_edge(gpu, f"nic{n}.{k}", bandwidth=node.nic.bandwidth, latency=0.0,
                           kind="pcie")
        dev += len(node.gpus)
    cache["graph"] = nx.freeze(g)
    return cache["graph"]


def without_nodes(cluster: Cluster, drop: list[int] | set[int]) -> Cluster:
    """The cluster left after isolating nodes `drop` (C4D's recovery): devices renumbered,
    overrides remapped, those touching dropped nodes/devices removed."""
    drop = set(drop)
    bad = [i for i in drop if not 0 <= i < cluster.num_nodes]
    if bad:
        raise ClusterError(f"{cluster.source}: cannot remove nodes {bad}: out of range")
    if len(drop) == cluster.num_nodes:
        raise ClusterError(f"{cluster.source}: cannot remove every node")
    keep = [i for i in range(cluster.num_nodes) if i not in drop]
    node_map = {old: new for new, old in enumerate(keep)}
    node_of = node_of_device(cluster)
    dev_map, new_id = {}, 0
    for d in range(cluster.num_devices):
        if int(node_of[d]) in node_map:
            dev_map[d] = new_id
            new_id += 1
    overrides = []
    for o in cluster.overrides:
        m = node_map if o.scope == "node" else dev_map
        if o.a in m and o.b in m:
            overrides.append(dataclasses.replace(o, a=m[o.a], b=m[o.b]))
    nodes = [dataclasses.replace(cluster.nodes[i], gpus=list(cluster.nodes[i].gpus)) for i in keep]
    used = {k for n in nodes for k in n.gpus}
    return Cluster(
        name=f"{cluster.name}-without-{'-'.join(str(i) for i in sorted(drop))}",
        kinds={k: v for k, v in cluster.kinds.items() if k in used},
        nodes=nodes,
        switches=list(cluster.switches),
        overrides=overrides,
        emulation=cluster.emulation,
        fabric=_fabric_without(cluster, {cluster.nodes[i].name for i in drop}),
        model_profiles=list(cluster.model_profiles),  # the kinds left keep their measured costs
        source=cluster.source,
    )


def _fabric_without(cluster: Cluster, dropped: set[str]) -> FabricSpec | None:
    """The multi-path settings minus failed cables of dropped nodes."""
    fab = cluster.fabric
    if fab is None:
        return None
    return dataclasses.replace(fab, failed=[f for f in fab.failed if f.a not in dropped and f.b not in dropped])
