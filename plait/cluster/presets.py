"""Built-in clusters by name: ``name[:key=value,...]``.

* ``<kind>:nodes=N,gpus_per_node=G[,intra=...,nic=...,nics=K]`` -- any catalog GPU kind
  (``a100-80g:nodes=8``) in the server it usually comes in (`catalog.NODE_TEMPLATES`);
* ``dgx-a100``, ``dgx-h100``, ``dgx-1`` (V100) ``:nodes=N`` -- those NVIDIA servers;
* ``mixed-a100-v100:a100_nodes=2,v100_nodes=2`` -- DGX A100 nodes next to DGX-1 V100
  nodes (NVLink 3 vs NVLink 2 inside, 8x200 Gb/s HDR vs 4x100 Gb/s EDR outside);
* ``uneven:nodes=8,slow_fraction=0.5,slow_factor=0.25,seed=0`` -- 8x8 A100 where a
  seeded random half of the node pairs get a quarter of the inter-node bandwidth
  (Pipette's setting: links differ from pair to pair);
* ``large-mixed:nodes=128`` -- 1024 GPUs for planning benchmarks: half DGX A100, half
  DGX-1 V100 nodes, 16 nodes per leaf switch, 8 spines, and 10% slow node pairs;
* ``emulated-mixed`` -- the default cluster of ``plait plan``: small enough to emulate
  on this machine (see `_emulated_mixed`).

Every preset is built as the YAML form and parsed by the same loader as a file, so a
preset and its ``plait cluster show --yaml`` dump are the same cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from plait.cluster import units
from plait.cluster.catalog import GPU_KINDS, NODE_TEMPLATES, resolve_kind_name
from plait.cluster.loader import parse_cluster
from plait.cluster.spec import Cluster, ClusterError

_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


@dataclass(frozen=True)
class Param:
    name: str
    type: str  # int | float | fraction | kind | bandwidth | bool
    default: Any
    help: str
    lo: float = 1  # ints: smallest allowed value
    allow_zero: bool = False  # floats/fractions: is 0 allowed

    def parse(self, text: str, where: str) -> Any:
        """The typed value of `text`; ClusterError "preset ...: name: reason, got 'text'"."""

        def fail(reason: str) -> ClusterError:
            shown = text if len(text) <= 60 else text[:57] + "..."
            return ClusterError(f"{where}: {self.name}: {reason}, got {shown!r}")

        if self.type == "int":
            try:
                value = int(text)
            except ValueError:
                raise fail("expected an integer") from None
            if not self.lo <= value <= 65536:
                raise fail(f"must be between {int(self.lo)} and 65536")
            return value
        if self.type in ("float", "fraction"):
            try:
                value = float(text)
            except ValueError:
                raise fail("expected a number") from None
            if not np.isfinite(value) or value < 0 or (value == 0 and not self.allow_zero):
                raise fail("must be >= 0" if self.allow_zero else "must be > 0")
            if self.type == "fraction" and value > 1:
                raise fail(f"must be in {'[0' if self.allow_zero else '(0'}, 1]")
            return value
        if self.type == "kind":
            kind = resolve_kind_name(text)
            if kind is None:
                raise fail(f"unknown GPU kind (known: {', '.join(GPU_KINDS)})")
            return kind
        if self.type == "bandwidth":
            try:
                value = units.parse_bandwidth(text)
            except units.UnitError as exc:
                raise fail(str(exc)) from None
            if value <= 0:
                raise fail("must be > 0")
            return value
        if self.type == "bool":
            if text.lower() not in _BOOLS:
                raise fail("expected true or false")
            return _BOOLS[text.lower()]
        raise AssertionError(f"unknown parameter type {self.type}")


@dataclass(frozen=True)
class Preset:
    name: str
    summary: str
    params: tuple[Param, ...]
    build: Callable[..., dict[str, Any]]  # params -> the cluster's YAML form


# --- node building blocks ---------------------------------------------------------------

def _link(link: Any, bandwidth: float | None = None) -> dict[str, Any]:
    return {"type": link.kind, "bandwidth": bandwidth if bandwidth is not None else link.bandwidth,
            "latency": link.latency}


def _node(kind: str, name: str, gpus: int | None = None, intra: float | None = None,
          nic: float | None = None, nics: int | None = None) -> dict[str, Any]:
    """A node of `kind` in its usual server, with optional replacements."""
    tpl = NODE_TEMPLATES[kind]
    return {
        "name": name,
        "gpus": {"kind": kind, "count": gpus or tpl.gpus_per_node},
        "intra": _link(tpl.intra, intra),
        "nic": {**_link(tpl.nic, nic), "count": nics or tpl.nics},
    }


def _homogeneous(kind: str, nodes: int, gpus_per_node: int | None = None,
                 intra: float | None = None, nic: float | None = None,
                 nics: int | None = None, name: str | None = None) -> dict[str, Any]:
    gpn = gpus_per_node or NODE_TEMPLATES[kind].gpus_per_node
    return {
        "name": name or f"{kind}-{nodes}x{gpn}",
        "nodes": [_node(kind, f"node{i}", gpn, intra, nic, nics) for i in range(nodes)],
    }


def _slow_pairs(n: int, fraction: float, seed: int) -> list[tuple[int, int]]:
    """round(fraction * n(n-1)/2) node pairs, chosen uniformly by `seed` (reproducible)."""
    a, b = np.triu_indices(n, k=1)
    k = int(round(fraction * len(a)))
    chosen = np.sort(np.random.default_rng(seed).choice(len(a), size=k, replace=False))
    return [(int(a[i]), int(b[i])) for i in chosen]


# --- presets ----------------------------------------------------------------------------

def _dgx(kind: str, label: str) -> Callable[..., dict[str, Any]]:
    def build(nodes: int) -> dict[str, Any]:
        return _homogeneous(kind, nodes, name=f"{label}-{nodes}")

    return build


def _mixed_a100_v100(a100_nodes: int, v100_nodes: int, gpus_per_node: int) -> dict[str, Any]:
    nodes = [_node("a100-80gb", f"a100-{i}", gpus_per_node) for i in range(a100_nodes)]
    nodes += [_node("v100-32gb", f"v100-{i}", gpus_per_node) for i in range(v100_nodes)]
    return {"name": f"mixed-a100x{a100_nodes}-v100x{v100_nodes}", "nodes": nodes}


def _uneven(nodes: int, gpus_per_node: int, slow_fraction: float, slow_factor: float,
            seed: int, kind: str) -> dict[str, Any]:
    out = _homogeneous(kind, nodes, gpus_per_node, name=f"uneven-{kind}-{nodes}x{gpus_per_node}")
    nic = NODE_TEMPLATES[kind].nic.bandwidth
    out["overrides"] = [{"nodes": [a, b], "bandwidth": nic * slow_factor}
                        for a, b in _slow_pairs(nodes, slow_fraction, seed)]
    return out


def _large_mixed(nodes: int, fast: str, slow: str, slow_share: float, gpus_per_node: int,
                 nodes_per_leaf: int, spines: int, uplink: float, slow_fraction: float,
                 slow_factor: float, seed: int) -> dict[str, Any]:
    n_slow = int(round(nodes * slow_share))
    n_fast = nodes - n_slow
    node_list = [_node(fast, f"{fast}-{i}", gpus_per_node) for i in range(n_fast)]
    node_list += [_node(slow, f"{slow}-{i}", gpus_per_node) for i in range(n_slow)]
    leaves = -(-nodes // nodes_per_leaf)
    for i, node in enumerate(node_list):
        node["leaf"] = f"leaf{i // nodes_per_leaf}"
    out: dict[str, Any] = {"name": f"large-mixed-{nodes}x{gpus_per_node}", "nodes": node_list}
    out["fabric"] = {"switches": {
        "leaves": {"count": leaves, "uplink": {"type": "infiniband", "bandwidth": uplink,
                                               "latency": units.parse_duration("1 us")}},
        "spines": spines,
    }}
    nic = np.array([NODE_TEMPLATES[n["gpus"]["kind"]].nic.bandwidth for n in node_list])
    out["overrides"] = [{"nodes": [a, b], "bandwidth": float(min(nic[a], nic[b]) * slow_factor)}
                        for a, b in _slow_pairs(nodes, slow_fraction, seed)]
    return out


def _emulated_mixed(bandwidth_scale: float, namespaces: bool, gpus_per_node: int = 2) -> dict[str, Any]:
    """2 nodes x 2 GPUs: node 0 two A100-80GB (NVLink 3), node 1 two V100-32GB (NVLink 2),
    joined by one 200 Gb/s HDR NIC per GPU. `gpus_per_node=1` gives one rank per CPU of a
    2-core machine (what `plait.measure.machine` predicts best).

    Emulation (issue 5's runtime): 4 gloo worker processes on CPU; V100 ranks are slowed
    by the A100:V100 peak FLOP/s ratio (slowdown None = derived); each node lives in a
    network namespace whose veth link tc shapes to ``bandwidth * bandwidth_scale``.
    Scale 1/200 turns the 25 GB/s NIC into 125 MB/s (1 Gb/s), which a veth pair on
    a 2-core machine can carry (gloo over loopback measured 0.46 GB/s for 16 MB
    messages on this machine while it was shared by 8 jobs), so the shaper -- not
    the CPU -- sets the inter-node figure. Intra-node traffic stays on loopback inside
    one namespace: nominally 1.5 GB/s (A100) / 0.75 GB/s (V100) at this scale, in
    practice as fast as the CPU copies, but always faster than the shaped inter-node
    link -- the ratio that matters for plans.
    """
    return {
        "name": "emulated-mixed",
        "nodes": [_node("a100-80gb", "a100-node", gpus=gpus_per_node, nics=gpus_per_node),
                  _node("v100-32gb", "v100-node", gpus=gpus_per_node, nic=units.parse_bandwidth("200 Gb/s"),
                        nics=gpus_per_node)],
        "emulation": {"enabled": True, "namespaces": namespaces, "bandwidth_scale": bandwidth_scale},
    }


PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("dgx-a100", "NVIDIA DGX A100 (8x A100-80GB, NVSwitch, 8x 200 Gb/s HDR)",
           (Param("nodes", "int", 1, "number of DGX nodes"),), _dgx("a100-80gb", "dgx-a100")),
    Preset("dgx-h100", "NVIDIA DGX H100 (8x H100-80GB, NVSwitch, 8x 400 Gb/s NDR)",
           (Param("nodes", "int", 1, "number of DGX nodes"),), _dgx("h100-80gb", "dgx-h100")),
    Preset("dgx-1", "NVIDIA DGX-1 (8x V100-32GB, NVLink 2, 4x 100 Gb/s EDR)",
           (Param("nodes", "int", 1, "number of DGX nodes"),), _dgx("v100-32gb", "dgx-1")),
    Preset("mixed-a100-v100", "DGX A100 nodes followed by DGX-1 V100 nodes",
           (Param("a100_nodes", "int", 2, "A100-80GB nodes", lo=0),
            Param("v100_nodes", "int", 2, "V100-32GB nodes", lo=0),
            Param("gpus_per_node", "int", 8, "GPUs per node")), _mixed_a100_v100),
    Preset("uneven", "homogeneous nodes where a seeded fraction of node pairs is slow",
           (Param("nodes", "int", 8, "nodes", lo=2),
            Param("gpus_per_node", "int", 8, "GPUs per node"),
            Param("slow_fraction", "fraction", 0.5, "fraction of node pairs that are slow",
                  allow_zero=True),
            Param("slow_factor", "fraction", 0.25, "their share of the NIC bandwidth"),
            Param("seed", "int", 0, "which pairs (numpy default_rng seed)", lo=0),
            Param("kind", "kind", "a100-80gb", "GPU kind")), _uneven),
    Preset("large-mixed", "1024 GPUs: A100 + V100 halves, leaf/spine fabric, slow node pairs",
           (Param("nodes", "int", 128, "nodes", lo=2),
            Param("fast", "kind", "a100-80gb", "kind of the first nodes"),
            Param("slow", "kind", "v100-32gb", "kind of the last nodes"),
            Param("slow_share", "fraction", 0.5, "fraction of nodes of the slow kind",
                  allow_zero=True),
            Param("gpus_per_node", "int", 8, "GPUs per node"),
            Param("nodes_per_leaf", "int", 16, "nodes under each leaf switch"),
            Param("spines", "int", 8, "spine switches"),
            Param("uplink", "bandwidth", units.parse_bandwidth("400 Gb/s"), "leaf-to-spine link bandwidth"),
            Param("slow_fraction", "fraction", 0.1, "fraction of node pairs that are slow",
                  allow_zero=True),
            Param("slow_factor", "fraction", 0.25, "their share of the NIC bandwidth"),
            Param("seed", "int", 0, "which pairs (numpy default_rng seed)", lo=0)),
           _large_mixed),
    Preset("emulated-mixed", "2 nodes x 2 GPUs (A100 + V100) emulated on this machine; "
                             "the default of `plait plan`",
           (Param("bandwidth_scale", "float", 1 / 200, "link bandwidth scale for tc shaping"),
            Param("namespaces", "bool", True, "emulate nodes with network namespaces"),
            Param("gpus_per_node", "int", 2, "GPUs (CPU ranks) per node")),
           _emulated_mixed),
]}

_KIND_PARAMS = (
    Param("nodes", "int", 1, "nodes"),
    Param("gpus_per_node", "int", None, "GPUs per node (default: the usual server's)"),
    Param("intra", "bandwidth", None, "intra-node link bandwidth (default: datasheet)"),
    Param("nic", "bandwidth", None, "bandwidth per NIC (default: the usual server's)"),
    Param("nics", "int", None, "NICs per node (default: the usual server's)"),
)


def preset_names() -> list[str]:
    """Valid preset names, the generic `<kind>` form included."""
    return list(PRESETS) + ["<gpu-kind> (" + ", ".join(GPU_KINDS) + ")"]


def split_preset(text: str) -> tuple[str, dict[str, str]]:
    """("name", {"key": "value"}) from "name:key=value,key=value"."""
    name, _, rest = text.strip().partition(":")
    params: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key or not value.strip():
            raise ClusterError(f"preset {text!r}: expected key=value, got {item!r}")
        if key in params:
            raise ClusterError(f"preset {text!r}: {key} given twice")
        params[key] = value.strip()
    return name.strip(), params


def _bind(text: str, params: tuple[Param, ...], given: dict[str, str]) -> dict[str, Any]:
    known = {p.name: p for p in params}
    for key in given:
        if key not in known:
            raise ClusterError(f"preset {text!r}: unknown parameter {key!r}; "
                               f"parameters: {', '.join(known) or 'none'}")
    shown = text if len(text) <= 80 else text[:77] + "..."  # a pasted megabyte stays out of the message
    return {p.name: p.parse(given[p.name], f"preset {shown!r}") if p.name in given else p.default
            for p in params}


def build_preset(text: str) -> Cluster:
    """The Cluster named by `text`; ClusterError listing the presets for an unknown name."""
    name, given = split_preset(text)
    key = name.lower()
    if key in PRESETS:
        preset = PRESETS[key]
        args = _bind(text, preset.params, given)
        if key == "mixed-a100-v100" and args["a100_nodes"] + args["v100_nodes"] == 0:
            raise ClusterError(f"preset {text!r}: a100_nodes + v100_nodes must be at least 1")
        data = preset.build(**args)
    else:
        kind = resolve_kind_name(name)
        if kind is None:
            raise ClusterError(
                f"unknown cluster {text!r}: not a file, and not a preset; presets: "
                + ", ".join(preset_names())
            )
        args = _bind(text, _KIND_PARAMS, given)
        data = _homogeneous(kind, args["nodes"], args["gpus_per_node"], args["intra"],
                            args["nic"], args["nics"])
    return parse_cluster(data, source=f"preset {text.strip()}")
