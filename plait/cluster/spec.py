"""Cluster: GPU kinds, nodes, links and fabric of a real (heterogeneous) cluster.

Units everywhere: bytes, bytes/second, seconds, FLOP/s. YAML files may write
bandwidths with units ("600 GB/s", "200 Gb/s", "25 GB/s") and latencies
("2 us", "1.5 ms"); see `plait.cluster.units`.

Devices are numbered node-major: node 0's GPUs are 0..g0-1, node 1's follow, etc.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TypeAlias

from plait.errors import PlaitError
from plait.ir.profile import ModelProfile

DTYPES = ("fp32", "tf32", "bf16", "fp16")


class ClusterError(PlaitError, ValueError):
    """A malformed cluster description: the message names the file, the field and the reason."""


@dataclass(frozen=True)
class GPUKind:
    name: str
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s (fp32, tf32, bf16, fp16)
    memory_bytes: int
    memory_bandwidth: float  # HBM/GDDR bytes/s
    # Tensor-core throughput sustained under load, as a fraction of the datasheet figure, relative
    # to the A100s that `ComputeModel.gemm_efficiency` was fitted on (1.0). Parts whose board
    # power limit holds the clock below the datasheet's under long GEMMs sustain less: measured
    # 0.85 on an H100 SXM (bench/gpu_check.py --gemm). fp32 (CUDA cores) is not scaled.
    tensor_sustained: float = 1.0
    # Bandwidth streaming kernels sustain, as a fraction of the datasheet's, relative to the A100s
    # that `ComputeModel.memory_efficiency` was fitted on (1.0); fitted per kind on public
    # measurements of that kind (bench/validate.py, the catalog says which).
    memory_sustained: float = 1.0

    @property
    def streaming_bandwidth(self) -> float:
        """Memory bytes/s streaming kernels reach before `ComputeModel.memory_efficiency`:
        datasheet x `memory_sustained`."""
        return self.memory_bandwidth * self.memory_sustained

    def flops(self, dtype: str) -> float:
        """Dense FLOP/s for `dtype` as sustained (datasheet peak x `tensor_sustained` for the
        tensor-core dtypes); falls back to fp32 when the kind has no such unit."""
        rate = self.peak_flops.get(dtype)
        if not rate:
            return self.peak_flops["fp32"]
        return rate if dtype == "fp32" else rate * self.tensor_sustained

    def __hash__(self) -> int:
        return hash(self.name)


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s, one direction
    latency: float  # seconds
    kind: str = "generic"  # nvlink | pcie | ethernet | infiniband | loopback | generic


@dataclass
class NodeSpec:
    name: str
    gpus: list[str]  # GPU kind name per local GPU
    intra: Link  # GPU<->GPU inside the node (NVLink/NVSwitch or PCIe)
    nic: Link  # the node's network: bandwidth per GPU-facing NIC share, latency
    nics: int = 1  # NICs per node (bandwidth above is per NIC)
    leaf: str | None = None  # leaf switch this node hangs off, when the fabric has switches
    # rail-optimised fabric: the leaf of each NIC (NIC r on rail r's leaf); leaf is leaves[0]
    leaves: list[str] | None = None


SWITCH_TIERS = ("leaf", "spine", "core")
ECMP_HASHES = ("per_tier", "same")


@dataclass
class SwitchSpec:
    """A switch of a leaf/spine(/core) fabric. A leaf's uplinks go to every spine (of its pod,
    when the fabric has pods); a spine's go to every core. `links` parallel cables of
    `uplink`'s bandwidth join the switch to each upper switch (ECMP spreads over all)."""

    name: str
    tier: str  # "leaf" | "spine" | "core"
    uplink: Link | None = None  # leaf -> each spine, spine -> each core (per cable)
    links: int = 1  # parallel uplink cables to each upper-tier switch
    pod: int | None = None  # three tiers: leaves and spines of a pod are fully connected
    rail: int | None = None  # rail-optimised fabric: the rail (NIC index) this leaf serves


@dataclass(frozen=True)
class FailedLink:
    """A failed cable (both directions): between switches `a` and `b` (`index`: which of their
    parallel cables, None: all), or between node `a` and leaf `b` (`index`: NIC port)."""

    a: str
    b: str
    index: int | None = None


@dataclass(frozen=True)
class NcclSpec:
    """How NCCL opens flows on the fabric (`plait.net.nccl` turns these into flow counts).

    Defaults are NCCL's documented ones (docs.nvidia.com/deeplearning/nccl, "Environment
    Variables"): `qps_per_connection` is ``NCCL_IB_QPS_PER_CONNECTION`` (default 1; each queue
    pair is its own RoCE flow with its own UDP source port); `min_channels` / `max_channels`
    are ``NCCL_MIN_NCHANNELS`` / ``NCCL_MAX_NCHANNELS`` (bounds on the channels a
    communicator runs; NCCL's own limits 1 and 32 when unset); `algorithm` is ``NCCL_ALGO``
    for the data-parallel collectives ("ring" or "tree"); `pxn` is PXN, on unless
    ``NCCL_PXN_DISABLE=1`` (since NCCL 2.12: a GPU sends to a peer on another rail through the
    local GPU of that rail, so the flow leaves from the peer's rail NIC)."""

    qps_per_connection: int = 1
    min_channels: int = 1
    max_channels: int = 32
    algorithm: str = "ring"
    pxn: bool = True


NCCL_ALGORITHMS = ("ring", "tree")


@dataclass
class FabricSpec:
    """Multi-path behaviour of a switched fabric (issue 16; C4P).

    `ports`: ports per NIC (2: a bonded NIC; the node's `nic.bandwidth` is the NIC's total,
    each port carries an equal part); `channels`: flows (queue pairs, each its own 5-tuple)
    a collective opens between two neighbouring NICs, as NCCL's channels; `ecmp_hash`:
    "per_tier" (independent hash per tier) or "same" (one hash at every tier: polarisation);
    `ecmp_seed`: the switches' hash seed; `failed`: cables that are down; `nccl`: NCCL's
    settings that multiply and shape the flows (queue pairs per channel, channel bounds, the
    algorithm, PXN)."""

    ports: int = 1
    channels: int = 1
    ecmp_seed: int = 0
    ecmp_hash: str = "per_tier"
    failed: list[FailedLink] = field(default_factory=list)
    nccl: NcclSpec = field(default_factory=NcclSpec)


@dataclass
class PairOverride:
    """A measured bandwidth/latency between two devices (e.g. from `plait profile`).

    `scope="node"`: `a` and `b` are node indices and the figures hold for every device
    pair across the two nodes (a == b: the node's intra-node pairs). Overrides replace
    the figures derived from links, node ones first, then device ones, in list order."""

    a: int
    b: int
    bandwidth: float | None = None
    latency: float | None = None
    scope: str = "device"  # "device" | "node"


@dataclass
class EmulationSpec:
    """How to emulate this cluster on one machine for `plait run` (see runtime.emulate).

    `slowdown` maps GPU kind -> compute slowdown factor relative to the fastest kind
    (None: derived from peak FLOP/s); `namespaces` asks for Linux network namespaces
    shaped with tc to the inter-node links (root only)."""

    enabled: bool = True
    slowdown: dict[str, float] | None = None
    namespaces: bool = True
    bandwidth_scale: float = 1.0  # scale link bandwidths down so a CPU run sees the same ratios


COLLECTIVE_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send_recv")


@dataclass(frozen=True)
class MeasuredCollective:
    """One collective measured on a group of devices, in nccl-tests' vocabulary: the bus
    bandwidth (``busbw = S / t * bus factor``) at each message size ``S`` (bytes per rank as
    the API sees it). nccl-tests' `*_perf` tables or `plait profile` fill it; the cost model
    reads the time of a collective off it for groups spanning the same number of nodes."""

    op: str  # one of COLLECTIVE_OPS
    nodes: int  # nodes the measured group spanned
    ranks: int  # ranks in the measured group
    sizes: tuple[float, ...]  # bytes, ascending
    busbw: tuple[float, ...]  # bytes/s at each size
    source: str = ""  # where the figures come from (tool, machine, date)


@dataclass(frozen=True)
class Device:
    id: int
    node: int  # index into Cluster.nodes
    local: int  # index within the node
    kind: GPUKind


@dataclass
class Cluster:
    name: str
    kinds: dict[str, GPUKind]
    nodes: list[NodeSpec]
    switches: list[SwitchSpec] = field(default_factory=list)
    overrides: list[PairOverride] = field(default_factory=list)
    emulation: EmulationSpec | None = None
    # measured collective bus bandwidths (nccl-tests / plait profile); used on clusters described
    # without a switched fabric (see plait.cost.collectives.measured_time)
    collectives: list[MeasuredCollective] = field(default_factory=list)
    fabric: FabricSpec | None = None  # multi-path behaviour of the switched fabric (plait.net)
    # per-GPU-kind measured model costs (`model_profiles:` files, plait.ir.profile); every compute
    # model built for this cluster carries the one of the model planned (`ComputeModel.with_profile`)
    model_profiles: list[ModelProfile] = field(default_factory=list)
    # file or preset it came from, for error messages; not part of equality, so a
    # cluster saved to YAML and loaded back compares equal
    source: str = field(default="<memory>", compare=False)

    @property
    def devices(self) -> list[Device]:
        """Devices numbered node-major: node 0's GPUs first, then node 1's, ... (cached on the
        object, keyed by the nodes' GPU lists and the kinds, so an edited copy is recomputed).

        The derived views (bandwidth and latency matrices, fabric graph) are functions in
        `plait.cluster.topology`; YAML output is `plait.cluster.loader.dump_cluster`. This type
        imports neither: spec is the bottom of the cluster package."""
        key = (tuple(tuple(n.gpus) for n in self.nodes), tuple(self.kinds.items()))
        hit = self.__dict__.get("_plait_devices")
        if hit is None or hit[0] != key:
            devices, ident = [], 0
            for n, node in enumerate(self.nodes):
                for local, kind in enumerate(node.gpus):
                    if kind not in self.kinds:
                        raise ClusterError(f"{self.source}: nodes[{n}].gpus: kind {kind!r} is not in the "
                                           f"cluster's kinds ({', '.join(self.kinds)})")
                    devices.append(Device(id=ident, node=n, local=local, kind=self.kinds[kind]))
                    ident += 1
            hit = (key, tuple(devices))
            self.__dict__["_plait_devices"] = hit
        return list(hit[1])

    @property
    def num_devices(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)


# What `plait.cluster.load_cluster` accepts: a Cluster (as is), a cluster YAML path or a preset string.
ClusterSource: TypeAlias = Cluster | str | os.PathLike[str]
