"""The cluster model: GPU kinds, nodes, links and fabric, from YAML, presets or code.

    from plait.cluster import load_cluster
    c = load_cluster("mixed-a100-v100:a100_nodes=2,v100_nodes=2")   # or a YAML path
    c.devices, bandwidth_matrix(c), latency_matrix(c)

See `plait.cluster.loader` for the YAML format and `plait.cluster.presets` for presets.
"""

from __future__ import annotations

import os
from pathlib import Path

from plait.cluster.catalog import GPU_KINDS, get_kind, resolve_kind_name
from plait.cluster.loader import (
    cluster_to_dict,
    dump_cluster,
    load_cluster_file,
    parse_cluster,
    parse_yaml_text,
    save_cluster,
)
from plait.cluster.presets import PRESETS, build_preset, preset_names
from plait.cluster.spec import (
    DTYPES,
    Cluster,
    ClusterError,
    ClusterSource,
    Device,
    EmulationSpec,
    FabricSpec,
    FailedLink,
    GPUKind,
    Link,
    NodeSpec,
    PairOverride,
    SwitchSpec,
)
from plait.cluster.topology import (
    bandwidth_matrix,
    devices_of,
    fabric_graph,
    latency_matrix,
    node_bandwidth_matrix,
    node_latency_matrix,
    without_nodes,
)

# The cluster `plait plan` uses when none is given (see presets._emulated_mixed).
DEFAULT_CLUSTER = "emulated-mixed"

__all__ = [
    "DEFAULT_CLUSTER", "DTYPES", "GPU_KINDS", "PRESETS", "Cluster", "ClusterError", "ClusterSource", "Device",
    "EmulationSpec", "FabricSpec", "FailedLink", "GPUKind", "Link", "NodeSpec", "PairOverride", "SwitchSpec",
    "bandwidth_matrix", "build_preset", "cluster_to_dict", "devices_of", "dump_cluster",
    "fabric_graph", "get_kind", "latency_matrix", "load_cluster", "load_cluster_file",
    "node_bandwidth_matrix", "node_latency_matrix", "parse_cluster", "parse_yaml_text",
    "preset_names", "resolve_kind_name", "save_cluster", "without_nodes",
]


def load_cluster(spec: ClusterSource | None = None) -> Cluster:
    """A Cluster from a Cluster (returned as is), a YAML path, or a preset string
    ``name[:key=value,...]``; None gives `DEFAULT_CLUSTER`.

    A string is a file when such a file exists or it ends in .yaml/.yml; otherwise a
    preset. ClusterError for anything else, listing the presets for unknown names."""
    if spec is None:
        spec = DEFAULT_CLUSTER
    if isinstance(spec, Cluster):
        return spec
    if isinstance(spec, os.PathLike):
        return load_cluster_file(spec)
    if not isinstance(spec, str):
        raise ClusterError(
            f"expected a Cluster, a YAML path or a preset string, got {type(spec).__name__}"
        )
    text = spec.strip()
    if not text:
        raise ClusterError("empty cluster spec; presets: " + ", ".join(preset_names()))
    if text.lower().endswith((".yaml", ".yml")) or _is_file(text):
        return load_cluster_file(text)
    return build_preset(text)


def _is_file(text: str) -> bool:
    """Whether `text` names an existing file; a string the OS cannot take as a path (too long
    for a file name, NUL bytes) is a preset string, not an OSError."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):
        return False
