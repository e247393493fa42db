"""`plait cluster show SPEC [--json|--yaml] [--matrix]`, `plait cluster presets` and
`plait cluster add-nccl-tests SPEC FILE... --out OUT.yaml`.

SPEC is a cluster YAML file or a preset string (``a100-80g:nodes=8``); without it,
the default cluster of `plait plan`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from plait.cluster.spec import Cluster
from plait.cluster.topology import bandwidth_matrix, latency_matrix

_SUMMARY_MATRIX_NODES = 16  # print the node-to-node matrix up to this many nodes


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cluster", help="show a cluster (YAML file or preset), list presets",
        description="Show a cluster's GPU kinds, nodes and effective bandwidths, or list presets.",
    )
    actions = parser.add_subparsers(dest="cluster_action", metavar="ACTION")
    show = actions.add_parser("show", help="GPU kinds, nodes, links and a bandwidth summary")
    show.add_argument("spec", nargs="?", default=None,
                      help="cluster YAML or preset, e.g. a100-80g:nodes=8 (default: emulated-mixed)")
    fmt = show.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="machine-readable JSON (SI units)")
    fmt.add_argument("--yaml", action="store_true", help="the cluster as a YAML file that loads back")
    show.add_argument("--matrix", action="store_true",
                      help="also the device-to-device bandwidth (GB/s) and latency (us) matrices")
    presets = actions.add_parser("presets", help="list the built-in presets and GPU kinds")
    presets.add_argument("--json", action="store_true", help="machine-readable JSON")
    nccl = actions.add_parser(
        "add-nccl-tests", help="add measured collective bus bandwidths (nccl-tests output) to a cluster",
        description="Read the output of nccl-tests (all_reduce_perf, all_gather_perf, ...) and write the "
                    "cluster with the measured busbw per message size; the simulator and the planner then "
                    "take collective times from it (clusters without a switched fabric).")
    nccl.add_argument("spec", help="cluster YAML or preset the measurements were taken on")
    nccl.add_argument("files", nargs="+", help="nccl-tests output files (one run each)")
    nccl.add_argument("--op", choices=("all_reduce", "reduce_scatter", "all_gather", "all_to_all",
                                       "broadcast", "send_recv"),
                      help="the collective (default: read from the output's 'Collective test starting' line)")
    nccl.add_argument("--out", required=True, help="write the cluster YAML here")
    parser.set_defaults(func=run, _cluster_parser=parser)


def run(args: argparse.Namespace) -> int:
    if args.cluster_action == "show":
        return _show(args)
    if args.cluster_action == "presets":
        return _presets(args)
    if args.cluster_action == "add-nccl-tests":
        return _add_nccl_tests(args)
    args._cluster_parser.print_help()
    return 2


def _add_nccl_tests(args: argparse.Namespace) -> int:
    """Every input is read and checked before the output is written."""
    import dataclasses
    from pathlib import Path

    from plait.cluster import load_cluster
    from plait.cluster.loader import save_cluster
    from plait.cluster.nccl_tests import parse_nccl_tests
    from plait.cluster.spec import ClusterError

    out = Path(args.out)
    if not out.parent.exists():
        raise ClusterError(f"--out {out}: folder {out.parent} does not exist")
    cluster = load_cluster(args.spec)
    tables = []
    for name in args.files:
        path = Path(name)
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise ClusterError(f"{name}: cannot read ({exc.strerror})") from None
        table = parse_nccl_tests(text, source=name, op=args.op)
        if table.nodes > cluster.num_nodes or table.ranks > cluster.num_devices:
            raise ClusterError(f"{name}: measured on {table.ranks} ranks over {table.nodes} nodes, more than "
                               f"{cluster.name} has ({cluster.num_devices} GPUs, {cluster.num_nodes} nodes)")
        tables.append(table)
    merged = dataclasses.replace(cluster, collectives=[*cluster.collectives, *tables])
    save_cluster(merged, out)
    for t in tables:
        print(f"{t.op} on {t.ranks} ranks / {t.nodes} node(s): {len(t.sizes)} sizes, "
              f"busbw {min(t.busbw) / 1e9:.1f}-{max(t.busbw) / 1e9:.1f} GB/s")
    print(f"wrote {out}")
    return 0


# --- summaries -------------------------------------------------------------------------

def _stats(values: np.ndarray) -> dict[str, float] | None:
    if values.size == 0:
        return None
    return {"min": float(values.min()), "median": float(np.median(values)),
            "max": float(values.max()), "pairs": int(values.size)}


def bandwidth_summary(cluster: Cluster) -> dict[str, Any]:
    """Bandwidth/latency statistics over intra-node and inter-node device pairs (i < j)."""
    from plait.cluster.topology import node_of_device

    bw, lat = bandwidth_matrix(cluster), latency_matrix(cluster)
    node_of = node_of_device(cluster)
    i, j = np.triu_indices(len(node_of), k=1)
    same = node_of[i] == node_of[j]
    return {
        "intra_node": {"bandwidth": _stats(bw[i[same], j[same]]),
                       "latency": _stats(lat[i[same], j[same]])},
        "inter_node": {"bandwidth": _stats(bw[i[~same], j[~same]]),
                       "latency": _stats(lat[i[~same], j[~same]])},
        "overrides": {"node_pairs": sum(o.scope == "node" for o in cluster.overrides),
                      "device_pairs": sum(o.scope == "device" for o in cluster.overrides)},
    }


def _node_groups(cluster: Cluster) -> list[tuple[int, int]]:
    """[first, last] node index runs whose nodes differ only in name (and leaf)."""
    runs: list[tuple[int, int]] = []
    for n, node in enumerate(cluster.nodes):
        if runs:
            prev = cluster.nodes[runs[-1][1]]
            if (prev.gpus, prev.intra, prev.nic, prev.nics) == (node.gpus, node.intra, node.nic, node.nics):
                runs[-1] = (runs[-1][0], n)
                continue
        runs.append((n, n))
    return runs


def _gpus_text(gpus: list[str]) -> str:
    parts: list[list[Any]] = []
    for k in gpus:
        if parts and parts[-1][1] == k:
            parts[-1][0] += 1
        else:
            parts.append([1, k])
    return " + ".join(f"{c}x {k}" for c, k in parts)


def show_json(cluster: Cluster, matrix: bool = False) -> dict[str, Any]:
    from plait.cluster.loader import cluster_to_dict
    from plait.cluster.topology import node_bandwidth_matrix

    out: dict[str, Any] = {
        "source": cluster.source,
        "num_nodes": cluster.num_nodes,
        "num_devices": cluster.num_devices,
        "cluster": cluster_to_dict(cluster, human=False),
        "devices": [{"id": d.id, "node": d.node, "local": d.local, "kind": d.kind.name}
                    for d in cluster.devices],
        "summary": bandwidth_summary(cluster),
        "node_bandwidth_matrix": node_bandwidth_matrix(cluster).tolist(),
    }
    if matrix:
        out["bandwidth_matrix"] = bandwidth_matrix(cluster).tolist()
        out["latency_matrix"] = latency_matrix(cluster).tolist()
    return out


def _show(args: argparse.Namespace) -> int:
    from plait.cluster import load_cluster
    from plait.cluster.loader import dump_cluster

    cluster = load_cluster(args.spec)
    if args.json:
        json.dump(show_json(cluster, args.matrix), sys.stdout, indent=1)
        print()
        return 0
    if args.yaml:
        sys.stdout.write(dump_cluster(cluster))
        return 0
    _print_rich(cluster, args.matrix)
    return 0


def _print_rich(cluster: Cluster, matrix: bool) -> None:
    """`plait cluster show` for people: a header line, then one table or section per aspect."""
    from rich.console import Console

    console = Console()
    console.print(f"[bold]{cluster.name}[/bold]  ({cluster.source}): {cluster.num_nodes} nodes, "
                  f"{cluster.num_devices} GPUs")
    console.print(_kinds_table(cluster))
    console.print(_nodes_table(cluster))
    _print_fabric(console, cluster)
    _print_pair_figures(console, cluster)
    if cluster.num_nodes <= _SUMMARY_MATRIX_NODES:
        console.print(_node_matrix_table(cluster))
    if matrix:
        _print_device_matrices(console, cluster)


def _kinds_table(cluster: Cluster) -> Any:
    """The GPU kinds table: how many of each, peak FLOP/s per dtype, memory and its bandwidth."""
    from rich.table import Table

    from plait.cluster.spec import DTYPES
    from plait.cluster.units import format_bandwidth, format_bytes

    counts: dict[str, int] = {}
    for node in cluster.nodes:
        for k in node.gpus:
            counts[k] = counts.get(k, 0) + 1
    kinds = Table(title="GPU kinds (dense peak TFLOP/s; '-' = no such unit, fp32 used)")
    for col in ("kind", "GPUs", *DTYPES, "memory", "memory BW"):
        kinds.add_column(col, justify="left" if col == "kind" else "right")
    for name, kind in cluster.kinds.items():
        flops = [f"{kind.peak_flops[d] / 1e12:.4g}" if d in kind.peak_flops else "-" for d in DTYPES]
        kinds.add_row(name, str(counts.get(name, 0)), *flops, format_bytes(kind.memory_bytes),
                      format_bandwidth(kind.memory_bandwidth))
    return kinds


def _nodes_table(cluster: Cluster) -> Any:
    """The nodes table, one row per run of alike nodes (`_node_groups`)."""
    from rich.table import Table

    from plait.cluster.units import format_bandwidth, format_duration

    nodes = Table(title="Nodes (link figures per direction)")
    for col in ("nodes", "GPU ids", "GPUs", "intra-node link", "NICs", "leaf"):
        nodes.add_column(col)
    starts = np.concatenate([[0], np.cumsum([len(n.gpus) for n in cluster.nodes])])
    for first, last in _node_groups(cluster):
        a, b = cluster.nodes[first], cluster.nodes[last]
        names = a.name if first == last else f"{a.name} .. {b.name} ({last - first + 1})"
        leaves = sorted({cluster.nodes[n].leaf for n in range(first, last + 1)} - {None})
        nodes.add_row(
            names, f"{starts[first]}-{starts[last + 1] - 1}", _gpus_text(a.gpus),
            f"{a.intra.kind} {format_bandwidth(a.intra.bandwidth)}, {format_duration(a.intra.latency)}",
            f"{a.nics}x {a.nic.kind} {format_bandwidth(a.nic.bandwidth * 8).replace('B/s', 'b/s')}, "
            f"{format_duration(a.nic.latency)}",
            ", ".join(leaves) if len(leaves) <= 3 else f"{leaves[0]} .. {leaves[-1]}",
        )
    return nodes


def _print_fabric(console: Any, cluster: Cluster) -> None:
    """The switch fabric in a line or two: leaf/spine/core counts, uplinks, NIC ports and ECMP."""
    from plait.cluster.units import format_bandwidth

    leaves = [s for s in cluster.switches if s.tier == "leaf"]
    spines = [s for s in cluster.switches if s.tier == "spine"]
    if not leaves:
        console.print("Fabric: one non-blocking switch (no leaf/spine given)")
        return
    uplinks = sorted({format_bandwidth(s.uplink.bandwidth) for s in leaves if s.uplink})
    cores = [s for s in cluster.switches if s.tier == "core"]
    console.print(f"Fabric: {len(leaves)} leaf and {len(spines)} spine switches"
                  + (f", {len(cores)} cores" if cores else "")
                  + f"; leaf-spine uplinks {', '.join(uplinks) or 'unconstrained'}"
                  + (f" x {leaves[0].links} cables" if leaves[0].links > 1 else ""))
    if cluster.fabric is not None:
        fab = cluster.fabric
        console.print(f"  NIC ports {fab.ports}{' (bonded)' if fab.ports > 1 else ''}, {fab.channels} "
                      f"channel(s) per neighbour, ECMP hash {fab.ecmp_hash} seed {fab.ecmp_seed}"
                      + (f", {len(fab.failed)} failed link(s)" if fab.failed else ""))


def _print_pair_figures(console: Any, cluster: Cluster) -> None:
    """The effective device-pair figures (`bandwidth_summary`), its measured overrides and emulation."""
    from rich.table import Table

    from plait.cluster.units import format_bandwidth, format_duration

    summary = bandwidth_summary(cluster)
    table = Table(title="Effective device-pair figures (min / median / max)")
    for col in ("pairs", "count", "bandwidth", "latency"):
        table.add_column(col)
    for label, key in (("intra-node", "intra_node"), ("inter-node", "inter_node")):
        bw, lat = summary[key]["bandwidth"], summary[key]["latency"]
        if bw is None:
            continue
        table.add_row(label, str(bw["pairs"]),
                      " / ".join(format_bandwidth(bw[s]) for s in ("min", "median", "max")),
                      " / ".join(format_duration(lat[s]) for s in ("min", "median", "max")))
    console.print(table)
    ov = summary["overrides"]
    if ov["node_pairs"] or ov["device_pairs"]:
        console.print(f"Measured overrides: {ov['node_pairs']} node pairs, {ov['device_pairs']} device pairs")
    if cluster.emulation is not None:
        e = cluster.emulation
        console.print(f"Emulation: {'on' if e.enabled else 'off'}, namespaces={e.namespaces}, "
                      f"bandwidth_scale={e.bandwidth_scale:g}, slowdown={e.slowdown or 'from peak FLOP/s'}")


def _node_matrix_table(cluster: Cluster) -> Any:
    """The node-to-node bandwidth matrix (slowest device pair of each node pair) as a table."""
    from rich.table import Table

    from plait.cluster.topology import node_bandwidth_matrix

    nb = node_bandwidth_matrix(cluster)
    m = Table(title="Node-to-node bandwidth, GB/s (slowest device pair; diagonal: intra-node)")
    m.add_column("")
    for node in cluster.nodes:
        m.add_column(node.name, justify="right")
    for r, node in enumerate(cluster.nodes):
        m.add_row(node.name, *[f"{v / 1e9:.4g}" for v in nb[r]])
    return m


def _print_device_matrices(console: Any, cluster: Cluster) -> None:
    """--matrix: the full device-to-device bandwidth and latency matrices."""
    np.set_printoptions(linewidth=200, threshold=sys.maxsize)
    console.print("Device bandwidth matrix (GB/s):")
    console.print(np.array2string(bandwidth_matrix(cluster) / 1e9, precision=4), markup=False)
    console.print("Device latency matrix (us):")
    console.print(np.array2string(latency_matrix(cluster) * 1e6, precision=4), markup=False)


def _presets(args: argparse.Namespace) -> int:
    from plait.cluster import DEFAULT_CLUSTER
    from plait.cluster.catalog import GPU_KINDS, LATENCY_SOURCE, NODE_TEMPLATES
    from plait.cluster.presets import _KIND_PARAMS, PRESETS

    if args.json:
        out = {
            "default": DEFAULT_CLUSTER,
            "presets": {name: {"summary": p.summary,
                               "params": {q.name: {"type": q.type, "default": q.default, "help": q.help}
                                          for q in p.params}}
                        for name, p in PRESETS.items()},
            "gpu_kind_preset": {"params": {q.name: {"type": q.type, "default": q.default,
                                                    "help": q.help} for q in _KIND_PARAMS},
                                "kinds": {k: {"server": NODE_TEMPLATES[k].source} for k in GPU_KINDS}},
            "latency_source": LATENCY_SOURCE,
        }
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="Cluster presets: NAME[:key=value,...]")
    table.add_column("preset")
    table.add_column("parameters (default)")
    table.add_column("what")
    for name, p in PRESETS.items():
        params = ", ".join(f"{q.name}={_fmt_default(q)}" for q in p.params)
        label = f"{name} (default)" if name == DEFAULT_CLUSTER else name
        table.add_row(label, params, p.summary)
    table.add_row("<gpu-kind>", ", ".join(q.name for q in _KIND_PARAMS),
                  "any catalog kind in its usual server, e.g. a100-80g:nodes=8")
    console.print(table)
    kinds = Table(title="GPU kinds (for <gpu-kind> and YAML `gpus`): datasheet figures, with their source")
    for col in ("kind", "intra link (per direction)", "NICs", "usual server: source"):
        kinds.add_column(col)
    for name in GPU_KINDS:
        t = NODE_TEMPLATES[name]
        kinds.add_row(name, f"{t.intra.kind} {t.intra.bandwidth / 1e9:g} GB/s",
                      f"{t.nics} x {t.nic.bandwidth * 8 / 1e9:g} Gb/s", t.source)
    console.print(kinds)
    console.print(f"Latencies: {LATENCY_SOURCE}. Measured collective bandwidths: `plait cluster "
                  f"add-nccl-tests` or `plait profile`.")
    return 0


def _fmt_default(q: Any) -> str:
    if q.type == "bandwidth" and q.default is not None:
        from plait.cluster.units import format_bandwidth

        return format_bandwidth(q.default).replace(" ", "")
    if isinstance(q.default, float):
        return f"{q.default:g}"
    return str(q.default).lower() if isinstance(q.default, bool) else str(q.default)
