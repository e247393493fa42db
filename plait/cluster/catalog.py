"""Built-in GPU kinds with datasheet figures, and the node each kind usually lives in.

Peak FLOP/s are NVIDIA's *dense* figures (datasheets print tensor-core numbers "with
sparsity", i.e. doubled; we halve those). Keys per kind:

* ``fp32`` -- the non-tensor-core FP32 rate (CUDA cores);
* ``tf32`` -- TF32 tensor cores (Ampere and later) -- what PyTorch uses for fp32 matmuls
  when ``torch.backends.cuda.matmul.allow_tf32`` is on;
* ``bf16``/``fp16`` -- tensor cores with FP32 accumulate (what PyTorch autocast uses).

A key is *absent* where the hardware has no such unit (V100 and T4 have no TF32 or
BF16 tensor cores): `GPUKind.flops` then falls back to fp32, which is what such a GPU
does with a TF32 request, and an upper bound for BF16, which it emulates.

Memory capacity: datasheets say "80 GB" for stacks of binary size; `nvidia-smi` shows
81920 MiB for an A100-80GB, so capacities are taken as GiB. Memory and link
bandwidths are decimal (GB/s = 1e9 B/s). Link figures are *per direction*: NVIDIA
quotes NVLink as bidirectional totals (A100 "600 GB/s" = 300 GB/s each way).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from plait.cluster.spec import ClusterError, GPUKind, Link
from plait.cluster.units import parse_bandwidth, parse_duration, parse_flops


# Figures go through the unit parser so they are the floats nearest to the datasheet
# decimals (15.7 * 1e12 is not 15.7e12), identical to what a YAML file with the same
# text gives.
def _kind(name: str, memory_gib: int, bandwidth: str, sustained: float = 1.0, memory_sustained: float = 1.0,
          **tflops: float) -> GPUKind:
    return GPUKind(
        name=name,
        peak_flops={dtype: parse_flops(f"{value} TFLOPS") for dtype, value in tflops.items()},
        memory_bytes=memory_gib * 2**30,
        memory_bandwidth=parse_bandwidth(bandwidth),
        tensor_sustained=sustained,
        memory_sustained=memory_sustained,
    )


# H100 SXM (700 W): bf16 GEMMs of transformer shapes (512-8192 tokens, hidden 1024-8192, tp 1 and
# 8) that run >= 0.5 ms sustained 680-780 TFLOP/s on an H100 80GB HBM3, 0.853 (geometric mean,
# 0.81-0.90) of what gemm_time predicts from the datasheet with the A100-fitted efficiency
# (`python bench/gpu_check.py --gemm`, 2026-11-25); this workplace's device notes read 769-798
# TFLOP/s on 8192^3 for both the H100 and the H200, which share the chip and the power limit.
HOPPER_SXM_SUSTAINED = 0.853

# T4 (70 W): its power cap lowers the clock under continuous tensor-core work -- cuBLAS fp16
# 4096^3 GEMMs run back to back reach about 24 TFLOP/s of the datasheet's 65 (a user's measurement,
# explained by NVIDIA's moderator as the expected power capping at about 70 W:
# forums.developer.nvidia.com/t/about-gpu-peak-performance/264462, 2023), 0.438 of the 54.8 TFLOP/s
# gemm_time predicts for that GEMM from the datasheet with the A100-fitted efficiency. No training
# measurement of a T4 is among the fitted sources (AMP's T4 trials are held out: bench/amp_cases.py).
T4_POWER_CAPPED_SUSTAINED = 0.438

# Per-kind efficiencies fitted on public measurements of that kind (issue 37): `python
# bench/validate.py` fits one factor per GPU kind and GEMM unit (tensor cores) and one per kind's
# memory system, beside one host and one traffic factor per engine family, on the even rows of
# every source at once (bench/data/sources, docs/DATA_SOURCES.md), the A100 80GB Megatron cell the
# shipped constants were fitted on held at 1. The factors below (tensor, memory) are that fit's
# (2026-12-07), applied on top of the kind's figures above them (datasheet; the H100's measured
# 0.853); `unfitted` takes them off again, which is where bench/validate.py fits from:
# - V100: DLPerf's Megatron-LM GPT runs on DGX-1 V100 16GB (9 fitted rows; their held-out rows
#   31.1 % -> 12.4 % MAPE); the V100 32GB is the same chip and memory system;
# - A100 40GB: llm-foundry's MPT tables on A100 40GB beside its A100 80GB rows (and ColossalAI's
#   Lightning GPT-2 XL row);
# - H100 80GB: llm-foundry's MPT tables on H100. The H200 has no source: it keeps the measured
#   GEMM fraction and its datasheet memory.
# The TITAN RTX is not set: its one fitted row drove both its factors to their bounds.
FITTED: dict[str, tuple[float, float]] = {
    "v100-16gb": (0.516, 1.010),
    "v100-32gb": (0.516, 1.010),
    "a100-40gb": (0.904, 1.086),
    "h100-80gb": (0.936, 0.917),
}


def _fitted(kind: GPUKind) -> GPUKind:
    tensor, memory = FITTED.get(kind.name, (1.0, 1.0))
    return replace(kind, tensor_sustained=kind.tensor_sustained * tensor,
                   memory_sustained=kind.memory_sustained * memory)


def unfitted(kind: GPUKind) -> GPUKind:
    """`kind` without the factors `FITTED` gives it (a catalog kind's figures before the fit)."""
    tensor, memory = FITTED.get(kind.name, (1.0, 1.0))
    return replace(kind, tensor_sustained=kind.tensor_sustained / tensor,
                   memory_sustained=kind.memory_sustained / memory)


GPU_KINDS: dict[str, GPUKind] = {
    # NVIDIA Tesla V100 datasheet (V100 SXM2): FP32 15.7 TFLOPS, Tensor Performance
    # 125 TFLOPS (FP16 in, FP32 accumulate), HBM2 16/32 GB at 900 GB/s. Volta has no
    # TF32 or BF16 tensor cores.
    "v100-16gb": _kind("v100-16gb", 16, "900 GB/s", fp32=15.7, fp16=125),
    # NVIDIA Tesla P100 datasheet: SXM2 (NVLink) part: double 5.3, single 10.6, half 21.2
    # TFLOPS, 16 GB CoWoS HBM2 at 732 GB/s; PCIe parts: double 4.7, single 9.3, half 18.7
    # TFLOPS, 16 GB at 732 GB/s or 12 GB at 549 GB/s. Pascal has no tensor cores: its fp16 is
    # the CUDA cores' paired half2 rate, 2x fp32 -- no TF32 or BF16 units either.
    "p100-16gb": _kind("p100-16gb", 16, "732 GB/s", fp32=10.6, fp16=21.2),
    "p100-pcie-16gb": _kind("p100-pcie-16gb", 16, "732 GB/s", fp32=9.3, fp16=18.7),
    "p100-pcie-12gb": _kind("p100-pcie-12gb", 12, "549 GB/s", fp32=9.3, fp16=18.7),
    "v100-32gb": _kind("v100-32gb", 32, "900 GB/s", fp32=15.7, fp16=125),
    # NVIDIA T4 datasheet: single precision 8.1 TFLOPS, mixed precision (FP16/FP32)
    # 65 TFLOPS, 16 GB GDDR6 at 320 GB/s. Turing: no TF32/BF16 units.
    "t4": _kind("t4", 16, "320 GB/s", T4_POWER_CAPPED_SUSTAINED, fp32=8.1, fp16=65),
    # NVIDIA A10 datasheet: FP32 31.2 TF, TF32 62.5 TF (125 sparse), BF16 and FP16
    # 125 TF (250 sparse), 24 GB GDDR6 at 600 GB/s.
    "a10": _kind("a10", 24, "600 GB/s", fp32=31.2, tf32=62.5, bf16=125, fp16=125),
    # NVIDIA L40S datasheet: FP32 91.6 TF, TF32 183 TF (366 sparse), BF16/FP16
    # 362.05 TF (733 sparse), 48 GB GDDR6 at 864 GB/s.
    "l40s": _kind("l40s", 48, "864 GB/s", fp32=91.6, tf32=183, bf16=362.05, fp16=362.05),
    # NVIDIA Ampere GA102 architecture whitepaper, GeForce RTX 3090 column: peak FP32
    # 35.6 TF, TF32 tensor 35.6 TF, BF16 and FP16 tensor with FP32 accumulate 71 TF
    # (GeForce runs FP32-accumulate at half rate; FP16 accumulate is 142), 24 GB
    # GDDR6X at 936 GB/s.
    "rtx-3090": _kind("rtx-3090", 24, "936 GB/s", fp32=35.6, tf32=35.6, bf16=71, fp16=71),
    # NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090 column: peak FP32
    # 82.6 TF, TF32 tensor 82.6 TF, BF16 and FP16 tensor with FP32 accumulate 165.2 TF,
    # 24 GB GDDR6X at 1008 GB/s.
    "rtx-4090": _kind("rtx-4090", 24, "1008 GB/s", fp32=82.6, tf32=82.6, bf16=165.2, fp16=165.2),
    # NVIDIA TITAN RTX (Turing TU102) product specifications: FP32 16.3 TFLOPS, Tensor 130 TFLOPS
    # (FP16 with FP32 accumulate at full rate on the TITAN, unlike GeForce Turing), 24 GB GDDR6 at
    # 672 GB/s. Turing has no TF32 or BF16 units.
    "titan-rtx": _kind("titan-rtx", 24, "672 GB/s", fp32=16.3, fp16=130),
    # NVIDIA A100 Tensor Core GPU datasheet, SXM columns: FP32 19.5 TF, TF32 156 TF
    # (312 sparse), BF16/FP16 312 TF (624 sparse); 40 GB HBM2 at 1,555 GB/s and
    # 80 GB HBM2e at 2,039 GB/s.
    "a100-40gb": _kind("a100-40gb", 40, "1555 GB/s", fp32=19.5, tf32=156, bf16=312, fp16=312),
    "a100-80gb": _kind("a100-80gb", 80, "2039 GB/s", fp32=19.5, tf32=156, bf16=312, fp16=312),
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: FP32 67 TF, TF32 989 TF,
    # BF16/FP16 1,979 TF -- the tensor figures are "with sparsity", so dense is half
    # (the H100 whitepaper lists 494.7 and 989.4 dense); 80 GB HBM3 at 3.35 TB/s.
    "h100-80gb": _kind("h100-80gb", 80, "3350 GB/s", HOPPER_SXM_SUSTAINED, fp32=67, tf32=494.7, bf16=989.4,
                       fp16=989.4),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: same compute as H100 SXM
    # (FP32 67, TF32 989 / BF16 1,979 with sparsity); 141 GB HBM3e at 4.8 TB/s.
    "h200": _kind("h200", 141, "4800 GB/s", HOPPER_SXM_SUSTAINED, fp32=67, tf32=494.7, bf16=989.4, fp16=989.4),
}
GPU_KINDS = {name: _fitted(kind) for name, kind in GPU_KINDS.items()}


# Short names people write. Anything else is matched after dropping case, spaces,
# '-' and '_' and a trailing "b" of the memory size ("a100-80g" == "A100_80GB").
_ALIASES = {
    "v100": "v100-32gb",  # the DGX-1V / DGX-2 era part most clusters still run
    "v100-sxm2": "v100-32gb",
    "p100": "p100-16gb",  # the SXM2 part of DGX-1 (P100), HAP's P100 machines
    "p100-sxm2": "p100-16gb",
    "p100-sxm2-16gb": "p100-16gb",
    "p100-pcie": "p100-pcie-16gb",
    "a100": "a100-80gb",
    "a100-sxm": "a100-80gb",
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
    "h100-sxm5": "h100-80gb",
    "h200-141gb": "h200",
    "h200-sxm": "h200",
    "a10g": "a10",
    "3090": "rtx-3090",
    "4090": "rtx-4090",
    "geforce-rtx-3090": "rtx-3090",
    "geforce-rtx-4090": "rtx-4090",
}


def _squash(name: str) -> str:
    s = re.sub(r"[\s_\-]", "", name.lower())
    return s[:-1] if re.search(r"\dgb$", s) else s  # 80gb -> 80g


_LOOKUP: dict[str, str] = {_squash(k): k for k in GPU_KINDS}
_LOOKUP.update({_squash(alias): target for alias, target in _ALIASES.items()})


def resolve_kind_name(name: str) -> str | None:
    """Canonical catalog name of `name` (alias- and case-insensitive), or None if unknown."""
    if not isinstance(name, str):
        return None
    return _LOOKUP.get(_squash(name))


def get_kind(name: str) -> GPUKind:
    """The catalog GPUKind called `name`; ClusterError listing the known kinds otherwise."""
    canonical = resolve_kind_name(name)
    if canonical is None:
        raise ClusterError(f"unknown GPU kind {name!r}; known: {', '.join(GPU_KINDS)}")
    return GPU_KINDS[canonical]


# --- the node a kind usually comes in ------------------------------------------------

# Default link latencies by link type: orders of magnitude of nccl-tests small-message
# times on such links (alpha of the alpha-beta model); replace with `plait profile`
# measurements where it matters. They are not datasheet figures (vendors publish none).
LATENCY_SOURCE = ("per-link-type alpha (nvlink 2 us, pcie 4 us, infiniband 5 us, ethernet 10 us): orders "
                  "of magnitude of nccl-tests small-message times, not datasheet figures")
DEFAULT_LATENCY = {
    "nvlink": parse_duration("2 us"),
    "pcie": parse_duration("4 us"),
    "infiniband": parse_duration("5 us"),
    "ethernet": parse_duration("10 us"),
    "loopback": parse_duration("20 us"),
    "generic": parse_duration("5 us"),
}


@dataclass(frozen=True)
class NodeTemplate:
    """The server a GPU kind is typically sold in: GPUs, intra-node link, NICs."""

    gpus_per_node: int
    intra: Link
    nic: Link  # per NIC
    nics: int
    source: str  # where the figures come from


def _link(kind: str, bandwidth: str) -> Link:
    return Link(bandwidth=parse_bandwidth(bandwidth), latency=DEFAULT_LATENCY[kind], kind=kind)


# Interconnect figures: NVLink per direction (half the bidirectional datasheet total),
# PCIe x16 per direction (Gen3 15.75 GB/s, Gen4 31.5 GB/s after 128b/130b encoding).
_PCIE3, _PCIE4 = "15.75 GB/s", "31.5 GB/s"
_A100_SOURCE = ("NVIDIA DGX A100 datasheet (peak NVLink; achieved all-reduce busbw is lower: 216 GB/s "
                "fitted in bench/validate_a100.py)")
NODE_TEMPLATES: dict[str, NodeTemplate] = {
    # DGX-1V: 8x V100 SXM2, NVLink 2.0 300 GB/s per GPU (hybrid cube-mesh; modelled as
    # all-to-all 150 GB/s each way, as on DGX-2's NVSwitch), 4x 100 Gb/s EDR InfiniBand.
    "v100-16gb": NodeTemplate(8, _link("nvlink", "150 GB/s"), _link("infiniband", "100 Gb/s"), 4,
                              "NVIDIA DGX-1 (V100) datasheet"),
    "v100-32gb": NodeTemplate(8, _link("nvlink", "150 GB/s"), _link("infiniband", "100 Gb/s"), 4,
                              "NVIDIA DGX-1 (V100) datasheet"),
    # DGX-1 (P100): 8x P100 SXM2, NVLink 1.0, four 20 GB/s-per-direction links per GPU (160 GB/s
    # bidirectional; hybrid cube-mesh, modelled as all-to-all 80 GB/s each way), 4x 100 Gb/s EDR
    # InfiniBand.
    "p100-16gb": NodeTemplate(8, _link("nvlink", "80 GB/s"), _link("infiniband", "100 Gb/s"), 4,
                              "NVIDIA DGX-1 (P100) datasheet"),
    # P100 PCIe servers: PCIe Gen3 x16 (32 GB/s bidirectional per the P100 PCIe datasheet),
    # 100 Gb/s networking (an assumption; such servers vary).
    "p100-pcie-16gb": NodeTemplate(8, _link("pcie", _PCIE3), _link("ethernet", "100 Gb/s"), 1,
                                   "NVIDIA Tesla P100 PCIe datasheet (PCIe Gen3 x16); 100 GbE assumed"),
    "p100-pcie-12gb": NodeTemplate(8, _link("pcie", _PCIE3), _link("ethernet", "100 Gb/s"), 1,
                                   "NVIDIA Tesla P100 PCIe datasheet (PCIe Gen3 x16); 100 GbE assumed"),
    # AWS g4dn.metal: 8x T4 on PCIe Gen3, 100 Gb/s networking.
    "t4": NodeTemplate(8, _link("pcie", _PCIE3), _link("ethernet", "100 Gb/s"), 1,
                       "AWS g4dn.metal"),
    # AWS g5.48xlarge: 8x A10G on PCIe Gen4, 100 Gb/s networking.
    "a10": NodeTemplate(8, _link("pcie", _PCIE4), _link("ethernet", "100 Gb/s"), 1,
                        "AWS g5.48xlarge"),
    # AWS g6e.48xlarge: 8x L40S on PCIe Gen4, 400 Gb/s networking.
    "l40s": NodeTemplate(8, _link("pcie", _PCIE4), _link("ethernet", "400 Gb/s"), 1,
                         "AWS g6e.48xlarge"),
    # Self-built GeForce servers: PCIe Gen4 x16 (no NVSwitch), 25 GbE (an assumption).
    "rtx-3090": NodeTemplate(8, _link("pcie", _PCIE4), _link("ethernet", "25 Gb/s"), 1,
                             "assumed PCIe Gen4 server, 25 GbE"),
    "rtx-4090": NodeTemplate(8, _link("pcie", _PCIE4), _link("ethernet", "25 Gb/s"), 1,
                             "assumed PCIe Gen4 server, 25 GbE"),
    # A workstation of TITAN RTX cards: PCIe Gen3 x16 (the NVLink bridge pairs two cards: give the
    # link where a cluster has it), 10 GbE (an assumption).
    "titan-rtx": NodeTemplate(2, _link("pcie", _PCIE3), _link("ethernet", "10 Gb/s"), 1,
                              "assumed PCIe Gen3 workstation, 10 GbE"),
    # DGX A100: NVSwitch, NVLink 3.0 600 GB/s per GPU, 8x 200 Gb/s HDR InfiniBand (compute).
    # These are the datasheet's peak link figures. What collectives achieve on such a node is
    # lower: the calibration on measured Megatron runs (bench/validate_a100.py) fits 216 GB/s
    # and 13.7 us per ring step for its all-reduces; measured figures belong in the cluster's
    # `collectives:` (plait cluster add-nccl-tests, plait profile), not in the preset.
    "a100-40gb": NodeTemplate(8, _link("nvlink", "300 GB/s"), _link("infiniband", "200 Gb/s"), 8,
                              _A100_SOURCE),
    "a100-80gb": NodeTemplate(8, _link("nvlink", "300 GB/s"), _link("infiniband", "200 Gb/s"), 8,
                              _A100_SOURCE),
    # DGX H100 / H200: NVLink 4.0 900 GB/s per GPU, 8x 400 Gb/s NDR (ConnectX-7).
    "h100-80gb": NodeTemplate(8, _link("nvlink", "450 GB/s"), _link("infiniband", "400 Gb/s"), 8,
                              "NVIDIA DGX H100 datasheet"),
    "h200": NodeTemplate(8, _link("nvlink", "450 GB/s"), _link("infiniband", "400 Gb/s"), 8,
                         "NVIDIA DGX H200 datasheet"),
}
