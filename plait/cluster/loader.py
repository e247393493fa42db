"""Cluster YAML: read (with errors that name file, field and reason) and write.

Format (every field but ``nodes``/``node_groups`` is optional; quantities take unit
strings, see `plait.cluster.units`; examples in ``examples/clusters/``)::

    name: lab-cluster                  # default: the file name
    description: free text, ignored
    gpu_kinds:                         # custom kinds, or overrides of catalog ones
      a100-80g:                        #   a catalog name/alias: given fields replace
        memory_bandwidth: 1.9 TB/s     #   the datasheet ones
      my-gpu:                          #   a new kind: flops.fp32, memory and
        like: a10                      #   memory_bandwidth are required unless it is
        flops: {fp32: 20 TFLOPS, bf16: 90 TFLOPS}   # `like` a catalog kind
        memory: 24 GiB
        memory_bandwidth: 700 GB/s
    nodes:                             # devices are numbered node-major in this order
      - name: n0                       # default node<i>
        gpus: {kind: a100-80g, count: 8}          # or a list: [a100, a100, {kind: v100, count: 2}]
        intra: {type: nvlink, bandwidth: 300 GB/s, latency: 2 us}   # per direction
        nic: {type: infiniband, bandwidth: 200 Gb/s, latency: 5 us, count: 8}  # per NIC
        leaf: leaf0                    # with switches; default: nodes spread evenly; a list
                                       #   (one leaf per NIC) on a rail-optimised fabric
    node_groups:                       # after `nodes`: `count` copies named <name>-<j>
      - {name: v100, count: 2, gpus: {kind: v100-32gb, count: 8}}
    fabric:                            # defaults for the nodes' `nic` fields
      type: infiniband
      bandwidth: 200 Gb/s
      latency: 5 us
      nics: 8
      ports: 2                         # ports per NIC (2: bonded; nic bandwidth is the total)
      channels: 2                      # NCCL channels per ring neighbour (large messages); default: ports
      nccl: {qps_per_connection: 1, min_channels: 1, max_channels: 32, algorithm: ring, pxn: true}
                                       # NCCL's flow settings (plait.net.nccl; these are the defaults):
                                       #   flows per neighbour = channels for the message size x QPs
      ecmp: {seed: 0, hash: per_tier}  # switches' hash seed; `same`: one hash at every tier
      failed_links: [[leaf0, spine1], [leaf0, spine1, 2], [n0, leaf0, 1]]  # cable down (index:
                                       #   which parallel cable, or the node's NIC port)
      switches:                        # optional leaf/spine(/core) fabric (plait.net)
        leaves: {count: 2, uplink: {bandwidth: 400 Gb/s, latency: 1 us, links: 1}}  # or a list
                                       # `oversubscription: 2` instead of `bandwidth` derives it;
                                       # `links`: parallel cables to each spine
        spines: 4                      # or a list of names; {count, uplink} with cores
        cores: 2                       # optional third tier; with `pods: P` leaves and spines
        pods: 2                        #   split into P pods joined by the cores
        rails: true                    # rail-optimised: `leaves.count` leaf groups x fabric.nics
                                       #   rails, NIC r of a node on its group's rail-r leaf
    overrides:                         # measured figures replace derived ones
      - {devices: [0, 9], bandwidth: 10 GB/s, latency: 9 us}   # ids or "node:local"
      - {nodes: [n0, 1], bandwidth: 50 Gb/s}                   # names or indices
    model_profiles: [gpt-a100.yaml]    # per-GPU-kind measured layer times (plait.ir.profile;
                                       #   `plait profile --model`), paths relative to this file
    emulation:                         # how `plait run` emulates it on one machine
      enabled: true
      namespaces: true                 # Linux netns + tc (root only)
      bandwidth_scale: 0.005           # shape links to bandwidth * scale
      slowdown: {v100-32gb: 2.5}       # default: from peak FLOP/s

Missing link fields fall back, field by field: a node's ``nic`` to ``fabric`` then to
the node the GPU kind usually comes in (`catalog.NODE_TEMPLATES`); ``intra`` to that
template; a missing latency to the link type's typical figure (`DEFAULT_LATENCY`).

Any problem raises `ClusterError` "FILE: FIELD.PATH: reason", e.g.
``lab.yaml: nodes[2].intra.bandwidth: must be > 0, got -5 GB/s``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from pathlib import Path
from typing import Any, NoReturn

import yaml

from plait.cluster import units
from plait.cluster.catalog import DEFAULT_LATENCY, GPU_KINDS, NODE_TEMPLATES, resolve_kind_name
from plait.cluster.spec import (
    COLLECTIVE_OPS,
    DTYPES,
    ECMP_HASHES,
    NCCL_ALGORITHMS,
    SWITCH_TIERS,
    Cluster,
    ClusterError,
    EmulationSpec,
    FabricSpec,
    FailedLink,
    GPUKind,
    Link,
    MeasuredCollective,
    NcclSpec,
    NodeSpec,
    PairOverride,
    SwitchSpec,
)
from plait.ir.formats import FORMAT_VERSIONS, check_version
from plait.ir.profile import ModelProfile, load_profile

LINK_TYPES = tuple(DEFAULT_LATENCY)
MAX_DEVICES = 65536  # a guard against `count: 10**12` exhausting memory

_TOP_KEYS = ("format_version", "name", "description", "gpu_kinds", "nodes", "node_groups", "fabric",
             "overrides", "emulation", "collectives", "model_profiles")


class _Ctx:
    """Where we are: the file, to prefix every error."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.bases: dict[str, str] = {}  # custom kind -> catalog kind it is `like`

    def fail(self, path: str, reason: str) -> NoReturn:
        raise ClusterError(f"{self.source}: {path or '<top level>'}: {reason}")

    # --- typed getters ---------------------------------------------------------------

    def mapping(self, value: Any, path: str, allowed: tuple[str, ...],
                required: tuple[str, ...] = ()) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(path, f"expected a mapping with keys {', '.join(allowed)}, got "
                            f"{_describe(value)}")
        for key in value:
            if not isinstance(key, str):
                self.fail(path, f"keys must be strings, got {_describe(key)}")
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                self.fail(_join(path, key), f"unknown field{hint}; allowed: {', '.join(allowed)}")
        for key in required:
            if key not in value or value[key] is None:
                self.fail(_join(path, key), "required field is missing")
        return value

    def seq(self, value: Any, path: str, what: str) -> list[Any]:
        if not isinstance(value, list):
            self.fail(path, f"expected a list of {what}, got {_describe(value)}")
        return value

    def string(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or not value.strip():
            self.fail(path, f"expected a non-empty string, got {_describe(value)}")
        return value.strip()

    def boolean(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            self.fail(path, f"expected true or false, got {_describe(value)}")
        return value

    def integer(self, value: Any, path: str, lo: int = 1, hi: int = MAX_DEVICES) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"expected an integer, got {_describe(value)}")
        if not lo <= value <= hi:
            self.fail(path, f"must be between {lo} and {hi}, got {value}")
        return value

    def number(self, value: Any, path: str, positive: bool = True) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(path, f"expected a number, got {_describe(value)}")
        x = float(value)
        if not math.isfinite(x) or (x <= 0 if positive else x < 0):
            self.fail(path, f"must be {'> 0' if positive else '>= 0'} and finite, got {value!r}")
        return x

    def quantity(self, value: Any, path: str, parse, positive: bool = True) -> float:
        try:
            x = parse(value)
        except units.UnitError as exc:
            self.fail(path, str(exc))
        if x <= 0 if positive else x < 0:
            self.fail(path, f"must be {'> 0' if positive else '>= 0'}, got {value!r}")
        return x


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


# --- GPU kinds -------------------------------------------------------------------------

# Streaming kernels never beat the datasheet: the A100 fit reaches 0.899 of it (ComputeModel.memory_efficiency).
MEMORY_SUSTAINED_MAX = 1.11
_KIND_KEYS = ("like", "flops", "memory", "memory_bandwidth", "tensor_sustained", "memory_sustained")


def _parse_kinds(ctx: _Ctx, raw: Any) -> dict[str, GPUKind]:
    """Custom kinds by name (catalog overrides under their canonical name)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        ctx.fail("gpu_kinds", f"expected a mapping of kind name -> figures, got {_describe(raw)}")
    kinds: dict[str, GPUKind] = {}
    for name, spec in raw.items():
        if not isinstance(name, str) or not name.strip():
            ctx.fail("gpu_kinds", f"kind names must be non-empty strings, got {_describe(name)}")
        path = f"gpu_kinds.{name}"
        spec = ctx.mapping({} if spec is None else spec, path, _KIND_KEYS)
        canonical = resolve_kind_name(name)
        base: GPUKind | None = GPU_KINDS[canonical] if canonical else None
        key = canonical or name.strip()
        if "like" in spec:
            like = ctx.string(spec["like"], _join(path, "like"))
            like_name = resolve_kind_name(like)
            if like_name is None:
                ctx.fail(_join(path, "like"), f"unknown GPU kind {like!r}; known: {', '.join(GPU_KINDS)}")
            base = GPU_KINDS[like_name]
            ctx.bases[name.strip()] = like_name
        flops = dict(base.peak_flops) if base else {}
        if "flops" in spec:
            fpath = _join(path, "flops")
            given = ctx.mapping(spec["flops"], fpath, DTYPES)
            for dtype, value in given.items():
                flops[dtype] = ctx.quantity(value, _join(fpath, dtype), units.parse_flops)
        if "fp32" not in flops:
            ctx.fail(_join(path, "flops.fp32"), "required for a kind not in the catalog")
        if "memory" in spec:
            memory = int(ctx.quantity(spec["memory"], _join(path, "memory"), units.parse_bytes))
            if memory < 1:
                ctx.fail(_join(path, "memory"), f"must be at least 1 byte, got {spec['memory']!r}")
        elif base:
            memory = base.memory_bytes
        else:
            ctx.fail(_join(path, "memory"), "required for a kind not in the catalog")
        if "memory_bandwidth" in spec:
            mem_bw = ctx.quantity(spec["memory_bandwidth"], _join(path, "memory_bandwidth"),
                                  units.parse_bandwidth)
        elif base:
            mem_bw = base.memory_bandwidth
        else:
            ctx.fail(_join(path, "memory_bandwidth"), "required for a kind not in the catalog")
        sustained = base.tensor_sustained if base else 1.0
        if "tensor_sustained" in spec:
            sustained = ctx.number(spec["tensor_sustained"], _join(path, "tensor_sustained"))
            if sustained > 1.0:
                ctx.fail(_join(path, "tensor_sustained"), f"a fraction of the datasheet peak, at most 1, got {sustained!r}")
        mem_sustained = base.memory_sustained if base else 1.0
        if "memory_sustained" in spec:
            mem_sustained = ctx.number(spec["memory_sustained"], _join(path, "memory_sustained"))
            if not 0 < mem_sustained <= MEMORY_SUSTAINED_MAX:
                ctx.fail(_join(path, "memory_sustained"), "relative to the A100 fit's fraction of the datasheet "
                         f"bandwidth (0.899), in (0, {MEMORY_SUSTAINED_MAX}], got {mem_sustained!r}")
        if key in kinds:
            ctx.fail(path, f"kind {key!r} is defined twice")
        kinds[key] = GPUKind(name=key, peak_flops={d: flops[d] for d in DTYPES if d in flops},
                             memory_bytes=memory, memory_bandwidth=mem_bw, tensor_sustained=sustained,
                             memory_sustained=mem_sustained)
    return kinds


def _resolve_kind(ctx: _Ctx, name: Any, path: str, custom: dict[str, GPUKind]) -> str:
    name = ctx.string(name, path)
    if name in custom:
        return name
    canonical = resolve_kind_name(name)
    if canonical is None:
        known = list(custom) + [k for k in GPU_KINDS if k not in custom]
        ctx.fail(path, f"unknown GPU kind {name!r}; known: {', '.join(known)}")
    return canonical


# --- links ------------------------------------------------------------------------------

def _partial_link(ctx: _Ctx, spec: dict[str, Any], path: str) -> dict[str, Any]:
    """The link fields `spec` gives explicitly, parsed: a subset of kind/bandwidth/latency."""
    out: dict[str, Any] = {}
    if "type" in spec:
        kind = ctx.string(spec["type"], _join(path, "type")).lower()
        if kind not in LINK_TYPES:
            ctx.fail(_join(path, "type"), f"unknown link type {kind!r}; use one of {', '.join(LINK_TYPES)}")
        out["kind"] = kind
    if "bandwidth" in spec:
        out["bandwidth"] = ctx.quantity(spec["bandwidth"], _join(path, "bandwidth"),
                                        units.parse_bandwidth)
    if "latency" in spec:
        out["latency"] = ctx.quantity(spec["latency"], _join(path, "latency"),
                                      units.parse_duration, positive=False)
    return out


def _resolve_link(ctx: _Ctx, layers: list[dict[str, Any]], template: Link | None, path: str,
                  default_latency: float | None = None, hint: str = "") -> Link:
    """A Link field by field: the first layer (most specific first) that gives a field wins,
    then the template; a latency nobody gives is the template's when the type is the
    template's, else the type's typical figure."""

    def first(key: str) -> Any:
        return next((layer[key] for layer in layers if key in layer), None)

    kind = first("kind") or (template.kind if template else "generic")
    bandwidth = first("bandwidth")
    if bandwidth is None:
        if template is None:
            ctx.fail(_join(path, "bandwidth"), f"required (no default for this node's GPU kind{hint})")
        bandwidth = template.bandwidth
    latency = first("latency")
    if latency is None:
        if template is not None and kind == template.kind:
            latency = template.latency
        else:
            latency = default_latency if default_latency is not None else DEFAULT_LATENCY[kind]
    return Link(bandwidth=bandwidth, latency=latency, kind=kind)


class _Fabric:
    def __init__(self, nic: dict[str, Any], nics: int | None, leaves: list[SwitchSpec],
                 spines: list[SwitchSpec], cores: list[SwitchSpec] | None = None,
                 spec: FabricSpec | None = None, rails: bool = False,
                 oversubscription: float | None = None) -> None:
        self.nic, self.nics, self.leaves, self.spines = nic, nics, leaves, spines
        self.cores = cores or []
        self.spec, self.rails, self.oversubscription = spec, rails, oversubscription

    @property
    def switches(self) -> list[SwitchSpec]:
        return self.leaves + self.spines + self.cores


# Latency of one switch hop (leaf <-> spine) when an uplink gives none: cut-through
# InfiniBand/Ethernet switches forward in well under a microsecond.
UPLINK_LATENCY = 1e-6

_FABRIC_KEYS = ("type", "bandwidth", "latency", "nics", "ports", "channels", "ecmp", "failed_links", "nccl",
                "switches")


def _parse_fabric(ctx: _Ctx, raw: Any) -> _Fabric:
    if raw is None:
        return _Fabric({}, None, [], [])
    spec = ctx.mapping(raw, "fabric", _FABRIC_KEYS)
    nic = _partial_link(ctx, spec, "fabric")
    nics = ctx.integer(spec["nics"], "fabric.nics", 1, 1024) if "nics" in spec else None
    multipath = _parse_multipath(ctx, spec)
    if spec.get("switches") is None:
        if multipath is not None and multipath.failed:
            ctx.fail("fabric.failed_links", "a fabric without switches has no links to fail")
        return _Fabric(nic, nics, [], [], spec=multipath)
    path = "fabric.switches"
    sw = ctx.mapping(spec["switches"], path, ("leaves", "spines", "cores", "pods", "rails"),
                     required=("leaves",))
    kind = nic.get("kind")
    rails = ctx.boolean(sw["rails"], f"{path}.rails") if "rails" in sw else False
    pods = ctx.integer(sw["pods"], f"{path}.pods", 1, 4096) if "pods" in sw else None
    leaves, oversub = _parse_switch_list(ctx, sw["leaves"], f"{path}.leaves", "leaf", kind)
    spines = (_parse_switch_list(ctx, sw["spines"], f"{path}.spines", "spine", kind)[0]
              if sw.get("spines") is not None else [])
    cores = (_parse_switch_list(ctx, sw["cores"], f"{path}.cores", "core", kind)[0]
             if sw.get("cores") is not None else [])
    if len(leaves) > 1 and not spines:
        ctx.fail(f"{path}.spines", f"{len(leaves)} leaves need at least one spine to connect them")
    if cores and any(s.uplink is None for s in spines):
        ctx.fail(f"{path}.spines.uplink", "required with cores: the spines' uplink to each core")
    if pods is not None:
        if pods > 1 and not cores:
            ctx.fail(f"{path}.pods", f"{pods} pods need cores to connect them")
        for tier, group in (("leaves", leaves), ("spines", spines)):
            if len(group) % pods:
                ctx.fail(f"{path}.pods", f"{len(group)} {tier} do not split evenly into {pods} pods")
            for i, s in enumerate(group):
                if s.pod is None:
                    s.pod = i * pods // len(group)
    if rails:
        if nics is None:
            ctx.fail("fabric.nics", "required with switches.rails: the number of rails (NICs per node)")
        leaves = [dataclasses.replace(s, name=f"{s.name}-r{r}", rail=r) for s in leaves for r in range(nics)]
    names = [s.name for s in leaves + spines + cores]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        ctx.fail(path, f"switch names must be unique: {', '.join(dup)}")
    return _Fabric(nic, nics, leaves, spines, cores, multipath, rails, oversub)


def _parse_multipath(ctx: _Ctx, spec: dict[str, Any]) -> FabricSpec | None:
    """ports / channels / ecmp / failed_links of `fabric:` (None when none is given)."""
    if not any(k in spec for k in ("ports", "channels", "ecmp", "failed_links", "nccl")):
        return None
    out = FabricSpec()
    if "ports" in spec:
        out.ports = ctx.integer(spec["ports"], "fabric.ports", 1, 2)
    out.channels = ctx.integer(spec["channels"], "fabric.channels", 1, 64) if "channels" in spec else out.ports
    if spec.get("ecmp") is not None:
        e = ctx.mapping(spec["ecmp"], "fabric.ecmp", ("seed", "hash"))
        if "seed" in e:
            out.ecmp_seed = ctx.integer(e["seed"], "fabric.ecmp.seed", 0, 2**32 - 1)
        if "hash" in e:
            mode = ctx.string(e["hash"], "fabric.ecmp.hash")
            if mode not in ECMP_HASHES:
                ctx.fail("fabric.ecmp.hash", f"must be one of {', '.join(ECMP_HASHES)} ('same': one hash at "
                                             f"every tier, which polarises), got {mode!r}")
            out.ecmp_hash = mode
    if spec.get("nccl") is not None:
        out.nccl = _parse_nccl(ctx, spec["nccl"])
    for i, item in enumerate(ctx.seq(spec.get("failed_links") or [], "fabric.failed_links", "links")):
        ipath = f"fabric.failed_links[{i}]"
        if not isinstance(item, list) or len(item) not in (2, 3):
            ctx.fail(ipath, f"expected [a, b] or [a, b, cable index], got {_describe(item)}")
        a, b = ctx.string(item[0], _join(ipath, 0)), ctx.string(item[1], _join(ipath, 1))
        index = ctx.integer(item[2], _join(ipath, 2), 0, 4096) if len(item) == 3 else None
        out.failed.append(FailedLink(a, b, index))
    return out


def _parse_nccl(ctx: _Ctx, raw: Any) -> NcclSpec:
    """`fabric.nccl`: NCCL's flow settings (a flow count of 0 is refused naming the field)."""
    e = ctx.mapping(raw, "fabric.nccl", ("qps_per_connection", "min_channels", "max_channels", "algorithm", "pxn"))
    d = NcclSpec()
    qps = ctx.integer(e["qps_per_connection"], "fabric.nccl.qps_per_connection", 1, 128) \
        if "qps_per_connection" in e else d.qps_per_connection
    lo = ctx.integer(e["min_channels"], "fabric.nccl.min_channels", 1, 64) if "min_channels" in e else d.min_channels
    hi = ctx.integer(e["max_channels"], "fabric.nccl.max_channels", 1, 64) if "max_channels" in e else d.max_channels
    if lo > hi:
        ctx.fail("fabric.nccl.min_channels", f"{lo} is above fabric.nccl.max_channels {hi}")
    algo = ctx.string(e["algorithm"], "fabric.nccl.algorithm") if "algorithm" in e else d.algorithm
    if algo not in NCCL_ALGORITHMS:
        ctx.fail("fabric.nccl.algorithm", f"must be one of {', '.join(NCCL_ALGORITHMS)}, got {algo!r}")
    pxn = ctx.boolean(e["pxn"], "fabric.nccl.pxn") if "pxn" in e else d.pxn
    return NcclSpec(qps, lo, hi, algo, pxn)


def _parse_switch_list(ctx: _Ctx, raw: Any, path: str, tier: str,
                       kind: str | None) -> tuple[list[SwitchSpec], float | None]:
    """Switches of one tier, and the leaves' oversubscription when given instead of a bandwidth."""
    keys = {"leaf": ("name", "uplink", "pod", "rail"), "spine": ("name", "uplink", "pod")}.get(tier, ("name",))
    needs_uplink = tier == "leaf"
    if isinstance(raw, bool):
        ctx.fail(path, f"expected a count, a list or {{count: N}}, got {_describe(raw)}")
    if isinstance(raw, int):
        count = ctx.integer(raw, path, 1, 4096)
        if needs_uplink:
            ctx.fail(_join(path, "uplink"), "required: give leaves as {count: N, uplink: {...}}")
        return [SwitchSpec(name=f"{tier}{i}", tier=tier) for i in range(count)], None
    if isinstance(raw, dict):
        spec = ctx.mapping(raw, path, ("count",) + tuple(k for k in keys if k == "uplink"), required=("count",))
        count = ctx.integer(spec["count"], _join(path, "count"), 1, 4096)
        uplink, links, oversub = None, 1, None
        if needs_uplink or spec.get("uplink") is not None:
            uplink, links, oversub = _parse_uplink(ctx, spec.get("uplink"), _join(path, "uplink"), kind)
        return [SwitchSpec(name=f"{tier}{i}", tier=tier, uplink=uplink, links=links)
                for i in range(count)], oversub
    items = ctx.seq(raw, path, f"{tier} switches")
    if not items:
        ctx.fail(path, f"expected at least one {tier}")
    if len(items) > 4096:
        ctx.fail(path, f"at most 4096 {tier} switches, got {len(items)}")
    out = []
    for i, item in enumerate(items):
        ipath = _join(path, i)
        if isinstance(item, str):
            item = {"name": item}
        spec = ctx.mapping(item, ipath, keys, required=("name",))
        name = ctx.string(spec["name"], _join(ipath, "name"))
        uplink, links = None, 1
        if needs_uplink or spec.get("uplink") is not None:
            uplink, links, oversub = _parse_uplink(ctx, spec.get("uplink"), _join(ipath, "uplink"), kind)
            if oversub is not None:
                ctx.fail(_join(ipath, "uplink.oversubscription"), "give it on {count: N, uplink: ...} leaves")
        pod = ctx.integer(spec["pod"], _join(ipath, "pod"), 0, 4095) if "pod" in spec else None
        rail = ctx.integer(spec["rail"], _join(ipath, "rail"), 0, 1023) if "rail" in spec else None
        out.append(SwitchSpec(name=name, tier=tier, uplink=uplink, links=links, pod=pod, rail=rail))
    return out, None


def _parse_uplink(ctx: _Ctx, raw: Any, path: str, kind: str | None) -> tuple[Link, int, float | None]:
    """(cable, parallel cables per upper switch, oversubscription to derive the bandwidth from)."""
    if raw is None:
        ctx.fail(path, "required: the switch's uplink to each upper switch {bandwidth, latency}")
    spec = ctx.mapping(raw, path, ("type", "bandwidth", "latency", "links", "oversubscription"))
    links = ctx.integer(spec["links"], _join(path, "links"), 1, 4096) if "links" in spec else 1
    oversub = None
    if ("bandwidth" in spec) == ("oversubscription" in spec):
        ctx.fail(path, "give exactly one of `bandwidth` (per cable) or `oversubscription` (downlink "
                       "capacity / uplink capacity, e.g. 1 or 2)")
    if "oversubscription" in spec:
        oversub = ctx.number(spec["oversubscription"], _join(path, "oversubscription"))
        spec = {**spec, "bandwidth": 1.0}  # placeholder, derived once the nodes are known
    layers = [_partial_link(ctx, spec, path), {"kind": kind} if kind else {}]
    return _resolve_link(ctx, layers, None, path, default_latency=UPLINK_LATENCY), links, oversub


def _apply_oversubscription(fabric: _Fabric, nodes: list[NodeSpec]) -> None:
    """Leaf uplink cable bandwidth = (NIC capacity below the leaf / oversubscription) spread over
    the leaf's cables to its spines."""
    if fabric.oversubscription is None:
        return
    down: dict[str, float] = {s.name: 0.0 for s in fabric.leaves}
    for node in nodes:
        for leaf in node.leaves or [node.leaf] * node.nics:
            down[leaf] += node.nic.bandwidth
    for s in fabric.leaves:
        spines = [t for t in fabric.spines if s.pod is None or t.pod == s.pod]
        cables = max(1, len(spines)) * s.links
        bw = down[s.name] / fabric.oversubscription / cables
        if bw > 0 and s.uplink is not None:
            s.uplink = dataclasses.replace(s.uplink, bandwidth=bw)


# --- nodes ------------------------------------------------------------------------------

_NODE_KEYS = ("name", "gpus", "intra", "nic", "leaf")


def _parse_gpus(ctx: _Ctx, raw: Any, path: str, custom: dict[str, GPUKind], budget: int) -> list[str]:
    def run(item: Any, ipath: str) -> list[str]:
        spec = ctx.mapping(item, ipath, ("kind", "count"), required=("kind",))
        kind = _resolve_kind(ctx, spec["kind"], _join(ipath, "kind"), custom)
        count = ctx.integer(spec.get("count", 1), _join(ipath, "count"), 1, budget)
        return [kind] * count

    if isinstance(raw, dict):
        gpus = run(raw, path)
    else:
        items = ctx.seq(raw, path, "GPU kinds (or {kind, count})")
        gpus = []
        for i, item in enumerate(items):
            ipath = _join(path, i)
            if isinstance(item, str):
                gpus.append(_resolve_kind(ctx, item, ipath, custom))
            else:
                gpus.extend(run(item, ipath))
            if len(gpus) > budget:
                ctx.fail(path, f"more than {MAX_DEVICES} devices in the cluster")
    if not gpus:
        ctx.fail(path, "a node needs at least one GPU")
    if len(gpus) > budget:
        ctx.fail(path, f"more than {MAX_DEVICES} devices in the cluster")
    return gpus


def _parse_node(ctx: _Ctx, raw: dict[str, Any], path: str, name: str, custom: dict[str, GPUKind],
                fabric: _Fabric, budget: int) -> NodeSpec:
    gpus = _parse_gpus(ctx, raw["gpus"], _join(path, "gpus"), custom, budget)
    # Defaults from the server the first GPU kind usually comes in (catalog kinds, their
    # overrides and kinds `like` them).
    tpl = NODE_TEMPLATES.get(ctx.bases.get(gpus[0], gpus[0]))
    intra_path, nic_path = _join(path, "intra"), _join(path, "nic")
    intra_spec = ctx.mapping({} if raw.get("intra") is None else raw["intra"], intra_path,
                             ("type", "bandwidth", "latency"))
    intra = _resolve_link(ctx, [_partial_link(ctx, intra_spec, intra_path)],
                          tpl.intra if tpl else None, intra_path)
    nic_spec = ctx.mapping({} if raw.get("nic") is None else raw["nic"], nic_path,
                           ("type", "bandwidth", "latency", "count"))
    nic = _resolve_link(ctx, [_partial_link(ctx, nic_spec, nic_path), fabric.nic],
                        tpl.nic if tpl else None, nic_path, hint=" and no fabric.bandwidth")
    if "count" in nic_spec:
        nics = ctx.integer(nic_spec["count"], _join(nic_path, "count"), 1, 1024)
    else:
        nics = fabric.nics or (tpl.nics if tpl else 1)
    leaf, leaves = None, None
    if raw.get("leaf") is not None:
        names = [s.name for s in fabric.leaves]
        given = raw["leaf"] if isinstance(raw["leaf"], list) else [raw["leaf"]]
        refs = [ctx.string(x, _join(path, "leaf") + (f"[{r}]" if isinstance(raw["leaf"], list) else ""))
                for r, x in enumerate(given)]
        for ref in refs:
            if ref not in names:
                ctx.fail(_join(path, "leaf"), f"unknown leaf {ref!r}; fabric.switches.leaves: "
                                              f"{', '.join(names) or 'none'}")
        if isinstance(raw["leaf"], list):
            if len(refs) != nics:
                ctx.fail(_join(path, "leaf"), f"{len(refs)} leaves for {nics} NICs: a rail-optimised node "
                                              "names one leaf per NIC")
            leaf, leaves = refs[0], refs
        else:
            leaf = refs[0]
    return NodeSpec(name=name, gpus=gpus, intra=intra, nic=nic, nics=nics, leaf=leaf, leaves=leaves)


def _parse_nodes(ctx: _Ctx, data: dict[str, Any], custom: dict[str, GPUKind],
                 fabric: _Fabric) -> list[NodeSpec]:
    nodes: list[NodeSpec] = []
    devices = 0
    if data.get("nodes") is None and data.get("node_groups") is None:
        ctx.fail("nodes", "required field is missing (give `nodes` or `node_groups`)")
    for i, raw in enumerate(ctx.seq(data.get("nodes") or [], "nodes", "nodes")):
        path = f"nodes[{i}]"
        raw = ctx.mapping(raw, path, _NODE_KEYS, required=("gpus",))
        name = ctx.string(raw["name"], _join(path, "name")) if "name" in raw else f"node{i}"
        node = _parse_node(ctx, raw, path, name, custom, fabric, MAX_DEVICES - devices)
        devices += len(node.gpus)
        nodes.append(node)
    for g, raw in enumerate(ctx.seq(data.get("node_groups") or [], "node_groups", "node groups")):
        path = f"node_groups[{g}]"
        raw = ctx.mapping(raw, path, _NODE_KEYS + ("count",), required=("gpus", "count"))
        count = ctx.integer(raw["count"], _join(path, "count"), 1, MAX_DEVICES)
        prefix = ctx.string(raw["name"], _join(path, "name")) if "name" in raw else f"group{g}"
        node = _parse_node(ctx, raw, path, prefix, custom, fabric, MAX_DEVICES - devices)
        if devices + count * len(node.gpus) > MAX_DEVICES:
            ctx.fail(_join(path, "count"), f"more than {MAX_DEVICES} devices in the cluster")
        devices += count * len(node.gpus)
        for j in range(count):
            nodes.append(NodeSpec(name=f"{prefix}-{j}", gpus=list(node.gpus), intra=node.intra,
                                  nic=node.nic, nics=node.nics, leaf=node.leaf,
                                  leaves=list(node.leaves) if node.leaves else None))
    if not nodes:
        ctx.fail("nodes", "a cluster needs at least one node")
    seen: dict[str, int] = {}
    for i, node in enumerate(nodes):
        if node.name in seen:
            ctx.fail(f"nodes[{i}].name", f"duplicate node name {node.name!r} (also node {seen[node.name]})")
        seen[node.name] = i
    if fabric.rails:  # nodes spread evenly over the leaf groups; NIC r on the group's rail-r leaf
        groups = len(fabric.leaves) // max(1, fabric.nics or 1)
        for i, node in enumerate(nodes):
            if node.leaves is None:
                if node.nics != fabric.nics:
                    ctx.fail(f"nodes[{i}].nic.count", f"{node.nics} NICs on a fabric of {fabric.nics} rails")
                g = i * groups // len(nodes)
                node.leaves = [fabric.leaves[g * node.nics + r].name for r in range(node.nics)]
                node.leaf = node.leaves[0]
    elif fabric.leaves:  # nodes without a leaf are spread evenly over the leaves, in order
        for i, node in enumerate(nodes):
            if node.leaf is None:
                node.leaf = fabric.leaves[i * len(fabric.leaves) // len(nodes)].name
    _apply_oversubscription(fabric, nodes)
    return nodes


# --- overrides and emulation ------------------------------------------------------------

def _parse_overrides(ctx: _Ctx, raw: Any, nodes: list[NodeSpec]) -> list[PairOverride]:
    if raw is None:
        return []
    names = {n.name: i for i, n in enumerate(nodes)}
    starts, total = [], 0
    for n in nodes:
        starts.append(total)
        total += len(n.gpus)
    out = []
    for i, item in enumerate(ctx.seq(raw, "overrides", "overrides")):
        path = f"overrides[{i}]"
        spec = ctx.mapping(item, path, ("devices", "nodes", "bandwidth", "latency"))
        if ("devices" in spec) == ("nodes" in spec):
            ctx.fail(path, "give exactly one of `devices: [a, b]` or `nodes: [a, b]`")
        scope = "devices" if "devices" in spec else "nodes"
        pair = spec[scope]
        ppath = _join(path, scope)
        if not isinstance(pair, list) or len(pair) != 2:
            ctx.fail(ppath, f"expected a pair [a, b], got {_describe(pair)}")
        ends = []
        for k, ref in enumerate(pair):
            rpath = _join(ppath, k)
            if scope == "nodes":
                ends.append(_node_ref(ctx, ref, rpath, names, len(nodes)))
            else:
                ends.append(_device_ref(ctx, ref, rpath, names, nodes, starts, total))
        if "bandwidth" not in spec and "latency" not in spec:
            ctx.fail(path, "give `bandwidth`, `latency` or both")
        bw = (ctx.quantity(spec["bandwidth"], _join(path, "bandwidth"), units.parse_bandwidth)
              if "bandwidth" in spec else None)
        lat = (ctx.quantity(spec["latency"], _join(path, "latency"), units.parse_duration, False)
               if "latency" in spec else None)
        if scope == "devices" and ends[0] == ends[1]:
            ctx.fail(ppath, "a device pair needs two different devices")
        out.append(PairOverride(a=ends[0], b=ends[1], bandwidth=bw, latency=lat,
                                scope="node" if scope == "nodes" else "device"))
    return out


def _parse_collectives(ctx: _Ctx, raw: Any, n_nodes: int) -> list[MeasuredCollective]:
    """`collectives:` -- measured bus bandwidth per message size, e.g.

        collectives:
          - {op: all_reduce, nodes: 1, ranks: 8, source: "nccl-tests 2.13, dgx-a100",
             busbw: {1 MiB: 40 GB/s, 64 MiB: 180 GB/s, 1 GiB: 225 GB/s}}
    """
    if raw is None:
        return []
    out = []
    for i, item in enumerate(ctx.seq(raw, "collectives", "measured collectives")):
        path = f"collectives[{i}]"
        spec = ctx.mapping(item, path, ("op", "nodes", "ranks", "busbw", "source"),
                           required=("op", "ranks", "busbw"))
        op = ctx.string(spec["op"], _join(path, "op"))
        if op not in COLLECTIVE_OPS:
            ctx.fail(_join(path, "op"), f"unknown collective {op!r}; use one of {', '.join(COLLECTIVE_OPS)}")
        nodes = ctx.integer(spec.get("nodes", 1), _join(path, "nodes"), 1, max(1, n_nodes))
        ranks = ctx.integer(spec["ranks"], _join(path, "ranks"), 2, MAX_DEVICES)
        if ranks < nodes:
            ctx.fail(_join(path, "ranks"), f"{ranks} ranks cannot span {nodes} nodes")
        table = spec["busbw"]
        bpath = _join(path, "busbw")
        if not isinstance(table, dict) or not table:
            ctx.fail(bpath, f"expected a mapping message size -> bus bandwidth, got {_describe(table)}")
        points = sorted((ctx.quantity(k, _join(bpath, str(k)), units.parse_bytes),
                         ctx.quantity(v, _join(bpath, str(k)), units.parse_bandwidth)) for k, v in table.items())
        if len({size for size, _ in points}) != len(points):
            ctx.fail(bpath, "two entries give the same message size")
        source = ctx.string(spec["source"], _join(path, "source")) if spec.get("source") is not None else ""
        out.append(MeasuredCollective(op=op, nodes=nodes, ranks=ranks, sizes=tuple(p[0] for p in points),
                                      busbw=tuple(p[1] for p in points), source=source))
    return out


def _node_ref(ctx: _Ctx, ref: Any, path: str, names: dict[str, int], n: int) -> int:
    if isinstance(ref, str) and ref in names:
        return names[ref]
    if isinstance(ref, int) and not isinstance(ref, bool) and 0 <= ref < n:
        return ref
    ctx.fail(path, f"expected a node name or an index 0..{n - 1}, got {_describe(ref)}")


def _device_ref(ctx: _Ctx, ref: Any, path: str, names: dict[str, int], nodes: list[NodeSpec],
                starts: list[int], total: int) -> int:
    if isinstance(ref, int) and not isinstance(ref, bool) and 0 <= ref < total:
        return ref
    if isinstance(ref, str) and ":" in ref:
        node, _, local = ref.rpartition(":")
        if node in names and local.strip().isdigit():
            idx, loc = names[node], int(local)
            if loc < len(nodes[idx].gpus):
                return starts[idx] + loc
    ctx.fail(path, f"expected a device id 0..{total - 1} or 'node:local', got {_describe(ref)}")


def _parse_model_profiles(ctx: _Ctx, raw: Any) -> list[ModelProfile]:
    """`model_profiles:` -- profile files (relative to the cluster file), read now so a bad one is
    refused before any work: ProfileError names the profile file, the entry and the reason."""
    if raw is None:
        return []
    base = Path(ctx.source).parent if ctx.source not in ("<string>", "<memory>") else Path.cwd()
    out = []
    for i, item in enumerate(ctx.seq(raw, "model_profiles", "profile file paths")):
        path = base / ctx.string(item, f"model_profiles[{i}]")
        if not path.is_file():
            ctx.fail(f"model_profiles[{i}]", f"no such profile file {path}")
        out.append(load_profile(path))
    return out


def _parse_emulation(ctx: _Ctx, raw: Any, kinds: dict[str, GPUKind]) -> EmulationSpec | None:
    if raw is None:
        return None
    if isinstance(raw, bool):
        return EmulationSpec(enabled=raw)
    spec = ctx.mapping(raw, "emulation", ("enabled", "slowdown", "namespaces", "bandwidth_scale"))
    out = EmulationSpec()
    if "enabled" in spec:
        out.enabled = ctx.boolean(spec["enabled"], "emulation.enabled")
    if "namespaces" in spec:
        out.namespaces = ctx.boolean(spec["namespaces"], "emulation.namespaces")
    if "bandwidth_scale" in spec:
        out.bandwidth_scale = ctx.number(spec["bandwidth_scale"], "emulation.bandwidth_scale")
    if spec.get("slowdown") is not None:
        raw_sd = spec["slowdown"]
        if not isinstance(raw_sd, dict):
            ctx.fail("emulation.slowdown", f"expected a mapping kind -> factor, got {_describe(raw_sd)}")
        slowdown = {}
        for name, factor in raw_sd.items():
            path = f"emulation.slowdown.{name}"
            kind = _resolve_kind(ctx, name, path, kinds)
            if kind not in kinds:
                ctx.fail(path, f"kind {kind!r} is not used by this cluster ({', '.join(kinds)})")
            slowdown[kind] = ctx.number(factor, path)
        out.slowdown = slowdown
    return out


# --- entry points -----------------------------------------------------------------------

def parse_cluster(data: Any, source: str = "<memory>", default_name: str = "cluster") -> Cluster:
    """A Cluster from parsed YAML (dicts/lists/scalars); errors name `source` and the field."""
    ctx = _Ctx(source)
    data = check_version("cluster", ctx.mapping(data, "", _TOP_KEYS), source, ClusterError)
    name = ctx.string(data["name"], "name") if data.get("name") is not None else default_name
    custom = _parse_kinds(ctx, data.get("gpu_kinds"))
    fabric = _parse_fabric(ctx, data.get("fabric"))
    nodes = _parse_nodes(ctx, data, custom, fabric)
    # Kinds: those the file defines (in file order), then catalog kinds the nodes use.
    kinds = dict(custom)
    for node in nodes:
        for k in node.gpus:
            if k not in kinds:
                kinds[k] = GPU_KINDS[k]
    overrides = _parse_overrides(ctx, data.get("overrides"), nodes)
    emulation = _parse_emulation(ctx, data.get("emulation"), kinds)
    collectives = _parse_collectives(ctx, data.get("collectives"), len(nodes))
    profiles = _parse_model_profiles(ctx, data.get("model_profiles"))
    cluster = Cluster(name=name, kinds=kinds, nodes=nodes, switches=fabric.switches, overrides=overrides,
                      emulation=emulation, collectives=collectives, fabric=fabric.spec,
                      model_profiles=profiles, source=source)
    _check_failed_links(ctx, cluster)
    return cluster


def _check_failed_links(ctx: _Ctx, cluster: Cluster) -> None:
    """Every failed link joins two adjacent things of the fabric (see plait.net.fabric)."""
    if cluster.fabric is None or not cluster.fabric.failed:
        return
    switches = {s.name: s for s in cluster.switches}
    nodes = {n.name: n for n in cluster.nodes}
    for i, f in enumerate(cluster.fabric.failed):
        path = f"fabric.failed_links[{i}]"
        a, b = (f.a, f.b) if f.a in nodes or f.a not in switches else (f.b, f.a)
        if a in nodes:
            node = nodes[a]
            if b not in (node.leaves or [node.leaf]):
                ctx.fail(path, f"node {a!r} is not cabled to leaf {b!r}")
            if f.index is not None and f.index >= cluster.fabric.ports:
                ctx.fail(_join(path, 2), f"NIC port {f.index} of {cluster.fabric.ports}")
            continue
        for name in (f.a, f.b):
            if name not in switches:
                ctx.fail(path, f"{name!r} is neither a switch nor a node of this cluster")
        lo, hi = sorted((switches[f.a], switches[f.b]), key=lambda s: SWITCH_TIERS.index(s.tier))
        adjacent = (SWITCH_TIERS.index(hi.tier) == SWITCH_TIERS.index(lo.tier) + 1
                    and (lo.pod is None or hi.tier == "core" or hi.pod is None or lo.pod == hi.pod))
        if not adjacent:
            ctx.fail(path, f"no cable joins {f.a!r} and {f.b!r}")
        if f.index is not None and f.index >= lo.links:
            ctx.fail(_join(path, 2), f"cable {f.index} of {lo.links} between {f.a!r} and {f.b!r}")


_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser is ~10x faster
_SafeDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _UniqueKeyLoader(_SafeLoader):  # type: ignore[misc,valid-type]
    """Safe loader that refuses duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: Any, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"unhashable key {key!r}", key_node.start_mark) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse_yaml_text(text: str, source: str = "<string>") -> Cluster:
    """A Cluster from YAML text."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "<top level>"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ClusterError(f"{source}: {where}: not valid YAML: {problem}") from None
    except RecursionError:
        raise ClusterError(f"{source}: <top level>: YAML nested too deeply") from None
    stem = Path(source).stem if source not in ("<string>", "<memory>") else "cluster"
    return parse_cluster(data, source=source, default_name=stem or "cluster")


def load_cluster_file(path: str | os.PathLike[str]) -> Cluster:
    """A Cluster from a YAML file; ClusterError (naming the file) for any problem."""
    source = os.fspath(path)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ClusterError(f"{source}: no such cluster file") from None
    except IsADirectoryError:
        raise ClusterError(f"{source}: is a directory, not a cluster file") from None
    except UnicodeDecodeError as exc:
        raise ClusterError(f"{source}: <top level>: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise ClusterError(f"{source}: cannot read: {exc.strerror}") from None
    return parse_yaml_text(text, source=source)


# --- writing ----------------------------------------------------------------------------

def _identity(x: Any, **_: Any) -> Any:
    return x


def _link_dict(link: Link, bits: bool = False, human: bool = True) -> dict[str, Any]:
    bw, dur = (units.exact_bandwidth, units.exact_duration) if human else (_identity, _identity)
    return {"type": link.kind, "bandwidth": bw(link.bandwidth, bits=bits),
            "latency": dur(link.latency)}


def _gpus_dict(gpus: list[str]) -> Any:
    runs: list[dict[str, Any]] = []
    for kind in gpus:
        if runs and runs[-1]["kind"] == kind:
            runs[-1]["count"] += 1
        else:
            runs.append({"kind": kind, "count": 1})
    return runs[0] if len(runs) == 1 else runs


def cluster_to_dict(cluster: Cluster, human: bool = True) -> dict[str, Any]:
    """The YAML form of `cluster`: self-contained (every kind's figures written out) and
    exact (loading it gives an equal Cluster). `human`: unit strings ("300 GB/s") that
    parse back exactly; else plain SI numbers (for JSON)."""
    flops, size, bw, dur = ((units.exact_flops, units.exact_bytes, units.exact_bandwidth,
                             units.exact_duration) if human else (_identity,) * 4)
    out: dict[str, Any] = {"format_version": FORMAT_VERSIONS["cluster"], "name": cluster.name}
    out["gpu_kinds"] = {
        name: {
            "flops": {d: flops(v) for d, v in kind.peak_flops.items()},
            "memory": size(kind.memory_bytes),
            "memory_bandwidth": bw(kind.memory_bandwidth),
            **({"tensor_sustained": kind.tensor_sustained} if kind.tensor_sustained != 1.0 else {}),
            **({"memory_sustained": kind.memory_sustained} if kind.memory_sustained != 1.0 else {}),
        }
        for name, kind in cluster.kinds.items()
    }
    nodes = []
    for node in cluster.nodes:
        entry: dict[str, Any] = {"name": node.name, "gpus": _gpus_dict(node.gpus),
                                 "intra": _link_dict(node.intra, human=human),
                                 "nic": {**_link_dict(node.nic, bits=True, human=human),
                                         "count": node.nics}}
        if node.leaves:
            entry["leaf"] = list(node.leaves)
        elif node.leaf is not None:
            entry["leaf"] = node.leaf
        nodes.append(entry)
    out["nodes"] = nodes
    fabric = _fabric_dict(cluster, human)
    if fabric:
        out["fabric"] = fabric
    if cluster.overrides:
        out["overrides"] = [
            {("nodes" if o.scope == "node" else "devices"): [int(o.a), int(o.b)],
             **({"bandwidth": bw(o.bandwidth)} if o.bandwidth is not None else {}),
             **({"latency": dur(o.latency)} if o.latency is not None else {})}
            for o in cluster.overrides
        ]
    if cluster.collectives:
        out["collectives"] = [
            {"op": m.op, "nodes": m.nodes, "ranks": m.ranks, **({"source": m.source} if m.source else {}),
             "busbw": {size(x): bw(b) for x, b in zip(m.sizes, m.busbw)}}
            for m in cluster.collectives
        ]
    if cluster.model_profiles:  # the files they were read from (absolute: the output may live elsewhere)
        out["model_profiles"] = [str(Path(p.source).resolve()) for p in cluster.model_profiles]
    if cluster.emulation is not None:
        e = cluster.emulation
        out["emulation"] = {"enabled": e.enabled, "namespaces": e.namespaces,
                            "bandwidth_scale": e.bandwidth_scale}
        if e.slowdown is not None:
            out["emulation"]["slowdown"] = dict(e.slowdown)
    return out


def _switch_dict(s: SwitchSpec, human: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"name": s.name}
    if s.uplink is not None:
        out["uplink"] = _link_dict(s.uplink, bits=True, human=human)
        if s.links != 1:
            out["uplink"]["links"] = s.links
    if s.pod is not None:
        out["pod"] = s.pod
    if s.rail is not None:
        out["rail"] = s.rail
    return out


def _fabric_dict(cluster: Cluster, human: bool) -> dict[str, Any]:
    """`fabric:` -- switches listed one by one (rails, pods and derived uplinks written out)."""
    out: dict[str, Any] = {}
    fab = cluster.fabric
    if fab is not None:
        out.update({"ports": fab.ports, "channels": fab.channels,
                    "ecmp": {"seed": fab.ecmp_seed, "hash": fab.ecmp_hash}})
        if fab.nccl != NcclSpec():
            out["nccl"] = dataclasses.asdict(fab.nccl)
        if fab.failed:
            out["failed_links"] = [[f.a, f.b] + ([f.index] if f.index is not None else []) for f in fab.failed]
    tiers = {t: [s for s in cluster.switches if s.tier == t] for t in SWITCH_TIERS}
    if tiers["leaf"]:
        out["switches"] = {"leaves": [_switch_dict(s, human) for s in tiers["leaf"]]}
        for key, tier in (("spines", "spine"), ("cores", "core")):
            if tiers[tier]:
                out["switches"][key] = [_switch_dict(s, human) for s in tiers[tier]]
    return out


def dump_cluster(cluster: Cluster) -> str:
    """`cluster` as YAML text (see `cluster_to_dict`)."""
    return yaml.dump(cluster_to_dict(cluster), Dumper=_SafeDumper, sort_keys=False,
                     default_flow_style=None, allow_unicode=True, width=100)


def save_cluster(cluster: Cluster, path: str | os.PathLike[str]) -> None:
    """Write `cluster` as YAML to `path` (atomically: a reader never sees half a file)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    tmp.write_text(dump_cluster(cluster), encoding="utf-8")
    os.replace(tmp, target)
