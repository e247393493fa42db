"""Time of a layer's forward and backward on one GPU kind: roofline kernels plus host dispatch.

Every layer pass is a list of GPU kernels (and the tensor-parallel collectives between
them). Each kernel costs

* a **GEMM**: ``max(t_compute, t_memory) + t_kernel`` with
  ``t_compute = 2 m n k / (peak(dtype) * e_gemm * u_wave)`` -- ``u_wave`` is the wave
  quantisation of 128x128 output tiles over the GPU's SMs (``tiles / (waves * SMs)``),
  so small or oddly shaped GEMMs lose efficiency exactly as tiles leave SMs idle -- and
  ``t_memory = bytes(A, B, C) / (HBM bandwidth * e_mem)``. When a GEMM dimension is not
  a multiple of 16 bytes (8 fp16 elements) cuBLAS cannot use its aligned tensor-core
  kernels (NVIDIA's "Matrix Multiplication Background" guide): ``t_compute`` is
  multiplied by ``unaligned_penalty``. GPT-2's vocabulary (50257) is the classic case;
  with ``odd_penalty`` set, an odd fp16 dimension (2-byte aligned, below the 4 bytes of
  Ampere's ``cp.async``) is priced apart (`alignment_penalty`; the shipped calibration
  leaves it unset -- see ``bench/validate_a100.py`` for why);
* a **memory-bound** kernel (norms, softmax, dropout, GELU, casts, adds):
  ``bytes / (HBM bandwidth * e_mem) + t_kernel`` (roofline: these have arithmetic
  intensity far below the ridge point);
* **host dispatch**: the CPU must launch every kernel (Python, the dispatcher, autograd
  in backward, the CUDA launch): ``host_fwd_s`` / ``host_bwd_s`` per kernel and
  ``host_comm_s`` per collective call.

The host runs ahead of the GPU asynchronously, so a *segment* of kernels between two
collectives takes ``max(sum GPU time, sum host time)``; collectives (costed by
`plait.cost.collectives` on the group's links) separate segments. Small layers are
host-bound, large ones GPU-bound, and the transition follows from the physics rather
than from a fitted curve.

Efficiencies depend only on physical quantities (matrix shape through the tile/wave
model, alignment, bytes moved). The defaults in `ComputeModel()` were fitted on the
even-numbered rows of ``shared/data/a100_single_node_megatron.csv`` (Megatron-DeepSpeed,
A100, fp16, simulated with full activation recompute as the runs were measured) by
``bench/validate_a100.py --fit`` (every all-reduce timed from the nccl-tests tables measured on
that node), within physical ceilings (GEMM efficiency at
most the A100's maximum achievable matmul rate, 0.859 of peak; streaming kernels at most 0.9 of
HBM), and are reported against the odd rows; see that script's docstring for the split, the
fitted values and what changed from the previous (recompute-none) calibration.

Transformer layers, embeddings and LM heads are costed with Megatron-LM's kernel
sequence (`transformer_layer_cost`, `embedding_cost`, `head_cost`) when the OpGraph's
config names their shape (hidden, heads, seq, vocab, ffn) -- including where Megatron picks
a different kernel by shape: its fused scale-mask-softmax only where the CUDA kernel accepts
the scores (`fused_softmax_available`; otherwise five unfused fp32 kernels each way); any other layer is costed op
by op from its captured FLOPs and bytes (`generic_layer_cost`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from plait.cluster.spec import Cluster, GPUKind
from plait.errors import PlaitError
from plait.ir.opgraph import Layer, Op, OpGraph
from plait.ir.profile import ModelProfile, profile_for

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}

# Streaming multiprocessors per GPU (NVIDIA architecture whitepapers); the wave model
# needs them. Unknown kinds fall back to 108 (A100), which only affects wave quantisation.
_SM_COUNT = {
    "a100": 108, "h100": 132, "h200": 132, "v100": 80, "t4": 40, "a10": 72,
    "l40s": 142, "rtx-3090": 82, "rtx-4090": 128, "titan-rtx": 72,
}


class ComputeError(PlaitError, ValueError):
    """A layer that cannot be costed (missing shape facts, bad dtype)."""


def sm_count(kind: GPUKind) -> int:
    name = kind.name.lower()
    for prefix, sms in _SM_COUNT.items():
        if name.startswith(prefix):
            return sms
    return 108


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ComputeError(f"dtype: must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}") from None


@dataclass(frozen=True)
class ComputeModel:
    """Physical parameters of the compute model (see module docstring).

    Defaults: fitted on the even rows of the A100 Megatron-DeepSpeed data set (fp16, full
    recompute as measured, all-reduces from the node's nccl-tests tables, Megatron's softmax rule);
    `bench/validate_a100.py --fit --max-nfev 80` reproduces them."""

    gemm_efficiency: float = 0.859  # achieved fraction of tensor-core peak in a GEMM main loop
    unaligned_penalty: float = 2.43  # t_compute multiplier for GEMMs with a dim not a multiple of 16 B
    odd_penalty: float | None = None  # multiplier when a dim is only 2-byte aligned (odd fp16); None: unaligned_penalty
    memory_efficiency: float = 0.899  # achieved fraction of HBM bandwidth by streaming kernels
    kernel_gpu_s: float = 8.56e-6  # per-kernel GPU time besides its work (launch gap, ramp, tail)
    host_fwd_s: float = 47.6e-6  # host time to dispatch one forward kernel (Python + dispatcher + launch)
    host_bwd_s: float = 60.8e-6  # host time per backward kernel (autograd engine)
    host_comm_s: float = 0.54e-6  # host time per collective call
    p2p_host_s: float = 442e-6  # per pipeline send/recv step (batch_isend_irecv + stream synchronize)
    loss_host_s: float = 0.392e-3  # host work per micro-batch at the loss (loss, averaging, bookkeeping)
    batch_host_s: float = 0.433e-3  # host work per micro-batch to fetch and place a batch (get_batch)
    step_host_s: float = 0.016e-3  # per-iteration host work besides the kernels (timers, LR, zero_grad)
    optimizer_bytes_per_param: float = 34.0  # fused Adam r/w p,g,m,v fp32 (28) + fp16 param copy (6)
    grad_accum_bytes_per_param: float = 4.0  # .grad += w-grad per micro-batch (fp16 read+write)
    embedding_grad_bytes_per_param: float = 2.0  # dense embedding backward zero-fills a [V, h] grad
    ce_bytes_fwd: float = 38.0  # Megatron vocab-parallel CE in fp32 (cast 6, max 4, sub 8, exp 8, sum 4, div 8)
    ce_bytes_bwd: float = 14.0  # (softmax - onehot) * grad (8) + cast back to fp16 (6)
    tile: int = 128  # output tile edge of the GEMM wave model
    softmax_fallback: bool = True  # Megatron's fused-softmax availability rule (False: always fused)
    ce_target_allreduce: bool = True  # all-reduce the target logit in the vocab-parallel CE (Megatron does)
    # Under tensor parallelism the embedding and LM head are vocabulary-parallel (Megatron: split
    # by the rank's share, with their all-reduces); False: replicated on every tensor rank, whole
    # compute and no collectives -- what plait's own runtime runs (`plait.runtime.tensor_parallel`)
    vocab_parallel: bool = True
    # How the collective library runs a reduce-scatter (`plait.cost.collectives`): "auto" (NCCL's
    # ring) or "allreduce" (gloo: an all-reduce of the whole input, then this rank's slice).
    reduce_scatter_algorithm: str = "auto"
    # Per-GPU-kind measured layer times (`plait.ir.profile.ModelProfile`): `layer_cost` uses them
    # where the profile has the kind, layer, tp degree and a micro-batch inside its sweep, and this
    # analytic model elsewhere. Part of equality and hash, so no cost cache mixes measured and
    # modelled costs; `with_profile` attaches a cluster's (`Cluster.model_profiles`).
    profile: ModelProfile | None = None

    def replace(self, **changes: Any) -> ComputeModel:
        return dataclasses.replace(self, **changes)

    def with_profile(self, cluster: Cluster, graph: OpGraph, dtype: str, engine: str = "plait") -> ComputeModel:
        """This model carrying the cluster's profile of `graph` in `dtype` (`Cluster.model_profiles`,
        merged; `plait.ir.profile.profile_for` refuses a profile of another model in one line). A
        model that already carries a profile keeps it; a cluster with none leaves it unchanged."""
        profiles = getattr(cluster, "model_profiles", None)
        if self.profile is not None or not profiles:
            return self
        prof = profile_for(profiles, graph, dtype, engine)
        return self if prof is None else dataclasses.replace(self, profile=prof)


DEFAULT_MODEL = ComputeModel()


# ---------------------------------------------------------------- kernels
def gemm_time(m: float, n: float, k: float, kind: GPUKind, dtype: str = "bf16",
              model: ComputeModel = DEFAULT_MODEL, batch: float = 1) -> float:
    """GPU time of ``batch`` independent (m x k) @ (k x n) products (see module docstring)."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    size = dtype_bytes(dtype)
    peak = kind.flops(dtype)
    sms = sm_count(kind)
    tiles = math.ceil(m / model.tile) * math.ceil(n / model.tile) * math.ceil(batch)
    waves = math.ceil(tiles / sms)
    wave_util = tiles / (waves * sms)
    t_compute = 2.0 * m * n * k * batch / (peak * model.gemm_efficiency * wave_util)
    t_compute *= alignment_penalty(m, n, k, size, model)
    t_memory = (m * k + k * n + m * n) * batch * size / (kind.streaming_bandwidth * model.memory_efficiency)
    return max(t_compute, t_memory) + model.kernel_gpu_s


def alignment_penalty(m: float, n: float, k: float, size: int, model: ComputeModel = DEFAULT_MODEL) -> float:
    """Main-loop slowdown of a GEMM whose dimensions are not all multiples of 16 bytes.

    16-byte aligned: 1. Otherwise ``unaligned_penalty``, except when a dimension is aligned to
    no more than one element of at most 2 bytes (an odd fp16 dimension such as GPT-2's 50257):
    Ampere's asynchronous global-to-shared copy (``cp.async``, PTX ISA) moves 4, 8 or 16 bytes,
    so such a GEMM cannot use it at all and pays ``odd_penalty`` (None: ``unaligned_penalty``)."""
    align = 16 // size
    if any(abs(x - round(x)) > 1e-9 for x in (m, n, k)):
        return model.unaligned_penalty  # a fractional (uneven-share) shape: no alignment known
    dims = [round(x) for x in (m, n, k)]
    if all(d % align == 0 for d in dims):
        return 1.0
    if model.odd_penalty is not None and size <= 2 and any(d % 2 for d in dims):
        return model.odd_penalty
    return model.unaligned_penalty


def memory_time(nbytes: float, kind: GPUKind, model: ComputeModel = DEFAULT_MODEL) -> float:
    """GPU time of a memory-bound kernel moving `nbytes` (roofline: bytes / bandwidth)."""
    if nbytes <= 0:
        return 0.0
    return nbytes / (kind.streaming_bandwidth * model.memory_efficiency) + model.kernel_gpu_s


def flops_time(flops: float, kind: GPUKind, dtype: str, model: ComputeModel = DEFAULT_MODEL,
               efficiency: float | None = None) -> float:
    """GPU time of a compute-bound kernel whose shape is unknown (peak * efficiency)."""
    if flops <= 0:
        return 0.0
    eff = model.gemm_efficiency if efficiency is None else efficiency
    return flops / (kind.flops(dtype) * eff) + model.kernel_gpu_s


def op_time(flops: float, nbytes: float, kind: GPUKind, dtype: str, model: ComputeModel = DEFAULT_MODEL) -> float:
    """Roofline time of one op's work, ``max(flops / (peak * e_gemm), bytes / (HBM * e_mem))``,
    without the fixed per-kernel time: linear in the work, so a device doing a share ``r`` of
    the op takes ``r`` of it (what HAP's per-device ratios and their LP need)."""
    if flops <= 0 and nbytes <= 0:
        return 0.0
    t_compute = flops / (kind.flops(dtype) * model.gemm_efficiency) if flops > 0 else 0.0
    return max(t_compute, nbytes / (kind.streaming_bandwidth * model.memory_efficiency))


# ---------------------------------------------------------------- fused attention
# FlashAttention (Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with
# IO-Awareness", Alg. 1-2 and Thm. 2; FlashAttention-2, Dao 2023, sec. 3) computes softmax(QK^T)V
# tile by tile in on-chip SRAM: it never writes the s x s scores to HBM, keeps only the output and
# the fp32 log-sum-exp for backward (O(s) memory per head), and fuses scale, mask, softmax and
# dropout. Work: per head, the forward's two products are 4 s_q s_k d FLOPs; the backward
# recomputes S = QK^T and forms dV, dP, dQ, dK (five products, 2.5x the forward). Causal masking
# skips the key blocks above the diagonal.
#
# Achieved fraction of the *datasheet* dense tensor-core peak at long sequences (head dim 128),
# per architecture, from the kernels' own published benchmarks (measured under each board's
# power limit, so `GPUKind.tensor_sustained` is already inside them):
# * Ampere (A100): FlashAttention-2 reaches up to 73 % forward and 63 % backward (Dao 2023,
#   sec. 4.1). Used for every kind not listed (Ampere/Ada parts run the same kernels).
# * Hopper (H100/H200): FlashAttention-2 -- what PyTorch's SDPA and flash-attn 2.x run -- cannot use
#   wgmma/TMA and reaches about a third of the peak: ~335 TFLOP/s forward (Dao 2023, sec. 4.1)
#   and 291-322 TFLOP/s backward at 2k-16k tokens (Shah et al. 2024, "FlashAttention-3", fig. 5).
FLASH_PEAK_FRACTION = {"a100": (0.73, 0.63), "h100": (0.34, 0.33), "h200": (0.34, 0.33)}
FLASH_BLOCK = 128  # query / key block edge of the FlashAttention-2 kernels (d = 64-128)
# Per query block the kernel loads its Q tile, and at the end rescales and writes O (and in backward
# dQ/dK/dV): fixed work worth about this many key-block iterations. It is why the kernels' rate
# ramps with sequence length -- FlashAttention-3's fig. 5 shows FA2 at 214 TFLOP/s at 512 tokens
# and 322 at 16k on H100 (4 key blocks: 4 / (4 + 2) = 0.67 of the long-sequence rate).
FLASH_BLOCK_OVERHEAD = 2.0


def flash_peak_fraction(kind: GPUKind, backward: bool) -> float:
    name = kind.name.lower()
    for prefix, (fwd, bwd) in FLASH_PEAK_FRACTION.items():
        if name.startswith(prefix):
            return bwd if backward else fwd
    fwd, bwd = FLASH_PEAK_FRACTION["a100"]
    return bwd if backward else fwd


def _sustained(kind: GPUKind, dtype: str) -> float:
    """`kind.flops(dtype)` over the datasheet rate (the power-limit factor `flops` applies)."""
    peak = kind.peak_flops.get(dtype) or kind.peak_flops["fp32"]
    return kind.flops(dtype) / peak


def flash_attention_time(b: float, heads: float, sq: int, sk: int, d: int, causal: bool, kind: GPUKind,
                         dtype: str, model: ComputeModel = DEFAULT_MODEL, backward: bool = False
                         ) -> tuple[float, float]:
    """(GPU seconds, FLOPs) of one FlashAttention forward or backward kernel over ``b x heads``
    heads of ``sq`` queries and ``sk`` keys of width ``d`` (see the comment above).

    Compute: the executed products (causal: the key blocks on and below the diagonal) at
    ``flash_peak_fraction`` of the datasheet peak, scaled by ``n / (n + FLASH_BLOCK_OVERHEAD)`` for
    ``n`` key blocks per query block, and by the wave quantisation of the ``b x heads x
    ceil(sq / 128)`` thread blocks over the SMs. Memory: Q, K, V, O (+ dO, dQ, dK, dV) and the
    fp32 log-sum-exp once each through HBM. The roofline max of the two plus ``kernel_gpu_s``."""
    if b <= 0 or heads <= 0 or sq <= 0 or sk <= 0:
        return 0.0, 0.0
    qb, kb = math.ceil(sq / FLASH_BLOCK), math.ceil(sk / FLASH_BLOCK)
    # causal (bottom-right aligned): query block i visits key blocks 0..i (of the qb == kb grid)
    n = (kb + 1) / 2.0 if causal and qb == kb else float(kb)
    visited = n / kb
    flops = 4.0 * b * heads * sq * sk * d * visited * (2.5 if backward else 1.0)
    blocks = math.ceil(b * heads) * qb
    sms = sm_count(kind)
    waves = math.ceil(blocks / sms)
    wave_util = blocks / (waves * sms)
    peak = kind.peak_flops.get(dtype) or kind.peak_flops["fp32"]
    eff = flash_peak_fraction(kind, backward) * n / (n + FLASH_BLOCK_OVERHEAD) * wave_util
    t_compute = flops / (peak * eff)
    a = dtype_bytes(dtype)
    tensors = 8 if backward else 4  # q k v o (+ do dq dk dv)
    nbytes = tensors * a * b * heads * sq * d + 4 * b * heads * sq
    t_memory = nbytes / (kind.streaming_bandwidth * model.memory_efficiency)
    causal_flops = 4.0 * b * heads * sq * sk * d * (0.5 if causal else 1.0) * (2.5 if backward else 1.0)
    return max(t_compute, t_memory) + model.kernel_gpu_s, causal_flops


# ---------------------------------------------------------------- passes
@dataclass
class Segment:
    """Kernels between two collectives: GPU and host time run concurrently (host runs ahead)."""

    gpu_s: float = 0.0
    host_s: float = 0.0
    kernels: int = 0
    flops: float = 0.0

    @property
    def time(self) -> float:
        return max(self.gpu_s, self.host_s)


@dataclass
class Collective:
    """A collective inside a pass, over the layer's tensor-parallel group (costed by the lowering)."""

    op: str  # all_reduce | reduce_scatter | all_gather
    nbytes: float
    group: str = "tp"


@dataclass
class PassCost:
    """One forward or backward pass of a layer on one device: segments and collectives in order."""

    items: list[Segment | Collective] = field(default_factory=list)

    @property
    def compute_s(self) -> float:
        return sum(i.time for i in self.items if isinstance(i, Segment))

    @property
    def gpu_s(self) -> float:
        return sum(i.gpu_s for i in self.items if isinstance(i, Segment))

    @property
    def host_s(self) -> float:
        return sum(i.host_s for i in self.items if isinstance(i, Segment))

    @property
    def flops(self) -> float:
        return sum(i.flops for i in self.items if isinstance(i, Segment))

    @property
    def collectives(self) -> list[Collective]:
        return [i for i in self.items if isinstance(i, Collective)]

    def extend(self, other: PassCost) -> None:
        self.items.extend(other.items)


@dataclass
class LayerCost:
    """Cost of one layer for one micro-batch on one device (one tensor-parallel rank).

    `recompute` is the forward work redone before the backward under activation
    recompute (the whole forward for "full", the attention core for "selective")."""

    name: str
    fwd: PassCost
    bwd: PassCost
    recompute_full: PassCost
    recompute_selective: PassCost
    params: float  # parameters held by this rank
    grad_params: float  # parameters whose gradient this rank reduces (same as params unless tied copies)

    def recompute(self, mode: str) -> PassCost:
        if mode == "full":
            return self.recompute_full
        if mode == "selective":
            return self.recompute_selective
        return PassCost()


class _Builder:
    """Accumulates kernels of one pass into segments split at collectives."""

    def __init__(self, kind: GPUKind, dtype: str, model: ComputeModel, backward: bool) -> None:
        self.kind, self.dtype, self.model = kind, dtype, model
        self.host = model.host_bwd_s if backward else model.host_fwd_s
        self.cost = PassCost()
        self.seg = Segment()

    def _kernel(self, gpu: float, flops: float = 0.0, host: float | None = None) -> None:
        self.seg.gpu_s += gpu
        self.seg.host_s += self.host if host is None else host
        self.seg.kernels += 1
        self.seg.flops += flops

    def kernel(self, gpu: float, flops: float) -> None:
        """One kernel priced by its caller (e.g. `flash_attention_time`)."""
        if gpu > 0:
            self._kernel(gpu, flops)

    def gemm(self, m: float, n: float, k: float, batch: float = 1) -> None:
        if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
            return
        self._kernel(gemm_time(m, n, k, self.kind, self.dtype, self.model, batch), 2.0 * m * n * k * batch)

    def mem(self, nbytes: float) -> None:
        if nbytes > 0:
            self._kernel(memory_time(nbytes, self.kind, self.model))

    def compute(self, flops: float, efficiency: float | None = None) -> None:
        if flops > 0:
            self._kernel(flops_time(flops, self.kind, self.dtype, self.model, efficiency), flops)

    def host_only(self, seconds: float) -> None:
        self.seg.host_s += seconds

    def collective(self, op: str, nbytes: float, ranks: int) -> None:
        if ranks <= 1 or nbytes <= 0:
            return
        self.seg.host_s += self.model.host_comm_s  # the host launches the NCCL call
        self._flush()
        self.cost.items.append(Collective(op, nbytes))

    def _flush(self) -> None:
        if self.seg.kernels or self.seg.host_s:
            self.cost.items.append(self.seg)
        self.seg = Segment()

    def done(self) -> PassCost:
        self._flush()
        return self.cost


# ---------------------------------------------------------------- Megatron layers
# Megatron's unfused softmax (`FusedScaleMaskSoftmax.forward_torch_softmax`), in fp32 because
# query-key layer scaling (on by default) forces ``attention_softmax_in_fp32``: bytes per score
# element of each kernel -- fwd: cast to fp32 (2 + 4), scale (4 + 4), masked_fill_ (4 + 1-byte
# mask + 4), softmax (4 + 4), cast back (4 + 2); bwd (autograd of each, reversed): cast (2 + 4),
# softmax backward (4 + 4 + 4), masked_fill (4 + 1 + 4), scale (4 + 4), cast (4 + 2).
UNFUSED_SOFTMAX_FWD_BYTES = (6.0, 8.0, 9.0, 8.0, 6.0)
UNFUSED_SOFTMAX_BWD_BYTES = (6.0, 12.0, 9.0, 8.0, 6.0)


def fused_softmax_available(b: int, heads: float, sq: int, sk: int, act_bytes: int, causal: bool = True) -> bool:
    """Whether Megatron's fused scale-mask-softmax CUDA kernel runs for ``[b, heads, sq, sk]`` scores.

    `FusedScaleMaskSoftmax.is_kernel_available` (Megatron-LM 2021-23 and Megatron-DeepSpeed,
    megatron/model/fused_softmax.py; vTrain's copy of it, src/model/fused_softmax.py, the code of
    the A100 data set): fp16/bf16 input, ``16 < sk <= 4096``, ``sq % 4 == 0``, ``sk % 4 == 0`` and
    ``attn_batches = b * heads % 4 == 0``; for the causal kernel also ``attn_batches`` a multiple of
    the kernel's batches per 128-thread block (warps of ``min(2^ceil(log2 sk), 32)`` threads, two
    rows per warp when ``2^ceil(log2 sk) <= 128``). Otherwise Megatron falls back to five unfused
    PyTorch kernels each way (`UNFUSED_SOFTMAX_FWD_BYTES`) -- e.g. 16 heads at tp = 8 (2 per rank)
    and micro-batch 1. A fractional head share (uneven tp ratios) is taken as fused."""
    if abs(heads - round(heads)) > 1e-9:
        return True
    batches = b * round(heads)
    if act_bytes != 2 or not 16 < sk <= 4096 or sq % 4 or sk % 4 or batches % 4:
        return False
    if not causal:
        return True  # the padding-mask kernel's rule is on sq, which sq % 4 already covers at sk > 128
    pow2 = 1 << max(0, math.ceil(math.log2(sk)))
    warp = min(pow2, 32)
    per_block = (128 // warp) * (2 if pow2 <= 128 else 1)
    return batches % per_block == 0


@dataclass(frozen=True)
class TransformerShape:
    hidden: int
    heads: int
    seq: int
    ffn: int
    kv_heads: int
    head_dim: int
    gated: bool = False  # SwiGLU MLP (gate, up, down) as in LLaMA
    flash: bool = False  # fused (flash / SDPA) attention instead of explicit bmm-softmax-bmm
    causal: bool = True

    @classmethod
    def from_config(cls, config: dict) -> TransformerShape | None:
        try:
            h, a, s = int(config["hidden"]), int(config["heads"]), int(config["seq"])
        except (KeyError, TypeError, ValueError):
            return None
        ffn = int(config.get("ffn") or 4 * h)
        family = str(config.get("family", "")).lower()
        gated = family in ("llama", "mistral") or str(config.get("activation", "")).lower() in ("swiglu", "silu")
        return cls(hidden=h, heads=a, seq=s, ffn=ffn, kv_heads=int(config.get("kv_heads") or a),
                   head_dim=int(config.get("head_dim") or h // a), gated=gated,
                   flash=bool(config.get("sdpa") or config.get("flash")),
                   causal=bool(config.get("causal", True)))


@dataclass(frozen=True)
class _TransformerDims:
    """One tensor rank's sizes of a Megatron transformer layer, shared by its passes' kernel lists."""

    shape: TransformerShape
    kind: GPUKind
    dtype: str
    model: ComputeModel
    tp: int
    b: int
    s: int
    h: int
    a: int  # activation bytes per element
    d: int
    bs: int
    E: float  # hidden activation elements
    Er: float
    Ln: float  # elements LN / dropout-add see per rank
    heads_r: float
    qkv_n: float
    F: float
    mlp_in_n: float
    Sa: float  # attention score elements per rank
    coll_in: str | None
    coll_out: str
    nbytes: float
    params: float
    fused: bool  # Megatron's fused scale-mask-softmax runs (else its unfused fp32 kernels)


def _transformer_dims(shape: TransformerShape, micro_batch: int, kind: GPUKind, dtype: str, tp: int,
                      share: float | None, sequence_parallel: bool, model: ComputeModel) -> _TransformerDims:
    """This rank's element counts, collectives and parameters of one transformer layer."""
    r = (1.0 / tp) if share is None else share
    b, s, h = micro_batch, shape.seq, shape.hidden
    a = dtype_bytes(dtype)
    d = shape.head_dim
    bs = b * s
    E = bs * h  # hidden activation elements
    Er = E * r
    Ln = E / tp if sequence_parallel else E  # elements LN / dropout-add see per rank
    heads_r = shape.heads * r
    qkv_n = (shape.heads + 2 * shape.kv_heads) * d * r
    F = shape.ffn * r
    mlp_in_n = 2 * F if shape.gated else F
    Sa = b * heads_r * s * s  # attention score elements per rank
    coll_in = "all_gather" if sequence_parallel else None
    coll_out = "reduce_scatter" if sequence_parallel else "all_reduce"
    nbytes = E * a
    params = (h * qkv_n + qkv_n + heads_r * d * h + h + h * mlp_in_n + mlp_in_n + F * h + h + 4 * h)

    fused = not model.softmax_fallback or fused_softmax_available(b, heads_r, s, s, a, shape.causal)
    return _TransformerDims(shape, kind, dtype, model, tp, b, s, h, a, d, bs, E, Er, Ln, heads_r, qkv_n, F,
                            mlp_in_n, Sa, coll_in, coll_out, nbytes, params, fused)


def _transformer_attention_fwd(x: _Builder, t: _TransformerDims) -> None:
    """The attention core's forward (what selective recompute re-runs)."""
    b, s, d, a, heads_r, Er, Sa = t.b, t.s, t.d, t.a, t.heads_r, t.Er, t.Sa
    if t.shape.flash:
        x.kernel(*flash_attention_time(b, heads_r, s, s, d, t.shape.causal, t.kind, t.dtype, t.model, False))
        x.mem(2 * a * Er)  # [b, s, a, d] -> [s, b, h] output layout copy
        return
    x.gemm(s, s, d, batch=b * heads_r)  # Q K^T (baddbmm)
    if t.fused:
        x.mem(2 * a * Sa)  # fused scale-mask-softmax
    else:
        for per_element in UNFUSED_SOFTMAX_FWD_BYTES:
            x.mem(per_element * Sa)
    x.mem(2 * a * Sa + Sa)  # attention dropout (+ 1-byte mask)
    x.gemm(s, d, s, batch=b * heads_r)  # probs V
    x.mem(2 * a * Er)  # [b*a, s, d] -> [s, b, h] head merge copy


def _transformer_forward(x: _Builder, t: _TransformerDims) -> None:
    """The layer's forward: attention block, then MLP block, each closed by its collective."""
    h, a, d, bs, Ln, F = t.h, t.a, t.d, t.bs, t.Ln, t.F
    coll_in, coll_out, nbytes, tp = t.coll_in, t.coll_out, t.nbytes, t.tp
    if coll_in:
        x.collective(coll_in, nbytes, tp)
    x.mem(2 * a * Ln)  # input LayerNorm
    x.gemm(bs, t.qkv_n, h)
    x.mem(a * bs * t.qkv_n)  # bias add
    _transformer_attention_fwd(x, t)
    x.gemm(bs, h, t.heads_r * d)  # output projection (row-parallel, bias skipped)
    x.collective(coll_out, nbytes, tp)
    x.mem(3 * a * Ln + Ln)  # bias-dropout-add
    x.mem(2 * a * Ln)  # post-attention LayerNorm
    if coll_in:
        x.collective(coll_in, nbytes, tp)
    x.gemm(bs, t.mlp_in_n, h)  # fc1 (gate+up when gated)
    x.mem((3 if t.shape.gated else 2) * a * bs * F)  # bias-GELU (or SiLU(gate)*up)
    x.gemm(bs, h, F)  # fc2
    x.collective(coll_out, nbytes, tp)
    x.mem(3 * a * Ln + Ln)  # bias-dropout-add


def _transformer_attention_bwd(x: _Builder, t: _TransformerDims) -> None:
    """The attention core's backward, from the head split to dQ and dK."""
    b, s, d, a, heads_r, Er, Sa = t.b, t.s, t.d, t.a, t.heads_r, t.Er, t.Sa
    if t.shape.flash:
        x.mem(2 * a * Er)  # output-gradient layout copy
        x.mem(2 * a * Er + 4 * b * heads_r * s)  # FA2's preprocessing: D = rowsum(dO * O), fp32
        x.kernel(*flash_attention_time(b, heads_r, s, s, d, t.shape.causal, t.kind, t.dtype, t.model, True))
        x.mem((4 + a) * Er)  # FA2 accumulates dQ in fp32: convert it to the activation dtype
        return
    x.mem(2 * a * Er)  # head split copy
    x.gemm(s, s, d, batch=b * heads_r)  # dP = dO V^T
    x.gemm(s, d, s, batch=b * heads_r)  # dV = P^T dO
    x.mem(2 * a * Sa + Sa)  # dropout backward
    if t.fused:
        x.mem(3 * a * Sa)  # fused softmax backward
    else:
        for per_element in UNFUSED_SOFTMAX_BWD_BYTES:
            x.mem(per_element * Sa)
    x.gemm(s, d, s, batch=b * heads_r)  # dQ = dS K
    x.gemm(s, d, s, batch=b * heads_r)  # dK = dS^T Q


def _transformer_backward(x: _Builder, t: _TransformerDims) -> None:
    """The layer's backward: the forward mirrored, a data- and a weight-gradient GEMM per linear."""
    h, a, d, bs, Ln, F, qkv_n, mlp_in_n = t.h, t.a, t.d, t.bs, t.Ln, t.F, t.qkv_n, t.mlp_in_n
    coll_in, coll_out, nbytes, tp = t.coll_in, t.coll_out, t.nbytes, t.tp
    if coll_in:
        x.collective(coll_in, nbytes, tp)  # SP: gather the MLP output grad
    x.mem(2 * a * Ln + Ln)  # bias-dropout-add backward
    x.mem(a * Ln)  # bias grad reduction
    x.gemm(bs, F, h)  # fc2 dgrad
    x.gemm(F, h, bs)  # fc2 wgrad
    x.mem((4 if t.shape.gated else 3) * a * bs * F)  # activation backward
    x.mem(a * bs * mlp_in_n)  # bias grad reduction
    x.gemm(bs, h, mlp_in_n)  # fc1 dgrad
    x.gemm(h, mlp_in_n, bs)  # fc1 wgrad
    x.collective(coll_out, nbytes, tp)  # column-parallel input grad
    x.mem(3 * a * Ln)  # LayerNorm backward
    x.mem(3 * a * Ln)  # residual gradient add
    if coll_in:
        x.collective(coll_in, nbytes, tp)
    x.mem(2 * a * Ln + Ln)  # bias-dropout-add backward
    x.mem(a * Ln)  # bias grad reduction
    x.gemm(bs, t.heads_r * d, h)  # proj dgrad
    x.gemm(t.heads_r * d, h, bs)  # proj wgrad
    _transformer_attention_bwd(x, t)
    x.gemm(bs, h, qkv_n)  # qkv dgrad
    x.gemm(qkv_n, h, bs)  # qkv wgrad
    x.mem(a * bs * qkv_n)  # bias grad reduction
    x.collective(coll_out, nbytes, tp)
    x.mem(3 * a * Ln)  # LayerNorm backward
    x.mem(3 * a * Ln)  # residual gradient add
    x.mem(t.model.grad_accum_bytes_per_param * t.params)  # accumulate weight grads


def transformer_layer_cost(shape: TransformerShape, micro_batch: int, kind: GPUKind, dtype: str = "bf16",
                           tp: int = 1, share: float | None = None, sequence_parallel: bool = False,
                           model: ComputeModel = DEFAULT_MODEL, name: str = "transformer") -> LayerCost:
    """One Megatron-LM transformer layer (pre-LN, fused softmax where its kernel is available
    -- `fused_softmax_available` -- bias-dropout-add, bias-GELU).

    `share` is this rank's fraction of the tensor-split dimensions (``1/tp`` unless the
    plan has uneven `tp_ratios`). Forward: LN, QKV GEMM (+bias), QK^T batched GEMM,
    scale-mask-softmax, dropout, PV batched GEMM, head merge copy, projection GEMM,
    **all-reduce** (reduce-scatter with sequence parallelism), bias-dropout-add, LN,
    fc1 GEMM, bias-GELU, fc2 GEMM, **all-reduce**, bias-dropout-add. Backward mirrors it
    with a data-gradient and a weight-gradient GEMM per linear and the two all-reduces at
    the column-parallel inputs (Shoeybi et al. 2019, fig. 3). Bytes per element: ``a`` =
    activation size, dropout masks 1 byte."""
    t = _transformer_dims(shape, micro_batch, kind, dtype, tp, share, sequence_parallel, model)
    f, bw = _Builder(kind, dtype, model, False), _Builder(kind, dtype, model, True)
    _transformer_forward(f, t)
    _transformer_backward(bw, t)
    rf = _Builder(kind, dtype, model, False)
    _transformer_forward(rf, t)
    rs = _Builder(kind, dtype, model, False)
    _transformer_attention_fwd(rs, t)
    return LayerCost(name, f.done(), bw.done(), rf.done(), rs.done(), t.params, t.params)


def embedding_cost(vocab: int, hidden: int, seq: int, micro_batch: int, kind: GPUKind, dtype: str = "bf16",
                   tp: int = 1, share: float | None = None, positions: bool = True,
                   model: ComputeModel = DEFAULT_MODEL, name: str = "embedding") -> LayerCost:
    """Megatron VocabParallelEmbedding (+ learned positions) and embedding dropout.

    Forward: gathers, add, dropout; under tensor parallelism out-of-shard ids are masked
    and the partial embeddings all-reduced. Backward: dropout backward and the dense
    embedding backward that fills a ``[V/t, h]`` gradient."""
    r = (1.0 / tp) if share is None else share
    a = dtype_bytes(dtype)
    E = micro_batch * seq * hidden
    f = _Builder(kind, dtype, model, False)
    f.host_only(model.batch_host_s)
    f.mem(2 * a * E)  # word-embedding gather
    if positions:
        f.mem(2 * a * E)  # position-embedding gather
        f.mem(3 * a * E)  # add
    f.collective("all_reduce", E * a, tp)
    f.mem(2 * a * E + E)  # dropout
    b = _Builder(kind, dtype, model, True)
    b.mem(2 * a * E + E)  # dropout backward
    b.mem(model.embedding_grad_bytes_per_param * vocab * hidden * r + 2 * a * E)  # dense embedding backward
    if positions:
        b.mem(2 * a * E)
    params = vocab * hidden * r + (seq * hidden if positions else 0)
    empty = PassCost()
    return LayerCost(name, f.done(), b.done(), empty, empty, params, params)


def head_cost(vocab: int, hidden: int, seq: int, micro_batch: int, kind: GPUKind, dtype: str = "bf16",
              tp: int = 1, share: float | None = None, tied: bool = True,
              model: ComputeModel = DEFAULT_MODEL, name: str = "head") -> LayerCost:
    """Final LayerNorm, vocab-parallel LM head GEMM and Megatron's vocab-parallel cross-entropy.

    The cross-entropy runs on fp32 logits (Megatron's default): a cast and max, subtract,
    exp, sum, divide passes over ``b s V/t`` elements (under TP three tiny all-reduces of
    per-token values, as `_VocabParallelCrossEntropy.forward` makes them: the maximum, the
    target's logit -- held by one rank, zero on the others -- and the sum of exponentials); backward scales the saved softmax and casts back. The
    head's input gradient is all-reduced across tensor ranks (``copy_to_tensor_model_
    parallel_region``'s backward)."""
    r = (1.0 / tp) if share is None else share
    a = dtype_bytes(dtype)
    bs = micro_batch * seq
    E = bs * hidden
    vr = vocab * r
    logits = bs * vr
    f = _Builder(kind, dtype, model, False)
    f.mem(2 * a * E)  # final LayerNorm
    f.gemm(bs, vr, hidden)  # logits
    f.host_only(model.loss_host_s)
    for share_bytes in (6, 4):  # cast to fp32, max
        f.mem(share_bytes * logits)
    f.collective("all_reduce", 4 * bs, tp)  # global max
    f.mem(8 * logits * model.ce_bytes_fwd / 38.0)  # subtract
    if model.ce_target_allreduce:
        f.collective("all_reduce", 4 * bs, tp)  # the target's logit, from the rank that holds it
    for share_bytes in (8, 4):  # exp, sum
        f.mem(share_bytes * logits * model.ce_bytes_fwd / 38.0)
    f.collective("all_reduce", 4 * bs, tp)  # global sum
    f.mem(8 * logits * model.ce_bytes_fwd / 38.0)  # divide (softmax kept for backward)
    b = _Builder(kind, dtype, model, True)
    b.mem(8 * logits * model.ce_bytes_bwd / 14.0)  # (softmax - onehot) * grad
    b.mem(6 * logits * model.ce_bytes_bwd / 14.0)  # cast back to the activation dtype
    b.gemm(bs, hidden, vr)  # dgrad
    b.gemm(vr, hidden, bs)  # wgrad
    b.collective("all_reduce", E * a, tp)
    b.mem(3 * a * E)  # final LayerNorm backward
    params = 2 * hidden + (0 if tied else vocab * hidden * r)
    empty = PassCost()
    return LayerCost(name, f.done(), b.done(), empty, empty, params, params + (vocab * hidden * r if tied else 0))


# ---------------------------------------------------------------- generic ops
_GEMM_TARGETS = re.compile(r"aten\.(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|addbmm)\b")
_ATTENTION_TARGETS = re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention")
_CONV_TARGETS = re.compile(r"aten\.(convolution|conv\d?d|cudnn_convolution|_convolution)")
_FREE_TARGETS = re.compile(r"aten\.(view|_unsafe_view|reshape|expand|permute|transpose|t|slice|select|"
                           r"split|split_with_sizes|unsqueeze|squeeze|as_strided|alias|detach|"
                           r"_reshape_alias|unbind|chunk|lift_fresh|empty|empty_like|arange|"
                           r"scalar_tensor|zeros|full)\b")


def infer_gemm_shape(op: Op, graph: OpGraph) -> tuple[float, float, float, float] | None:
    """(m, n, k, batch) per sample of a matmul-like op, from FLOPs and tensor sizes.

    For ``out = A @ B`` with ``|A| = m k``, ``|out| = m n`` and ``flops = 2 m n k``:
    a linear's weight ``k n`` comes from its parameter bytes, a batched product's first
    operand from its producer's output bytes. Returns None when the facts are missing."""
    if op.fwd_flops <= 0 or op.output_bytes <= 0:
        return None
    act = graph.activation_dtype_bytes or 2
    out = op.output_bytes / act
    mnk = op.fwd_flops / 2.0
    k = mnk / out
    if op.param_bytes > 0:
        weights = op.param_bytes / (graph.param_dtype_bytes or 4)
        n = max(1.0, round(weights / k)) if k >= 1 else 1.0
        m = out / n
        return m, n, k, 1.0
    if op.inputs and op.inputs[0] in graph.ops:
        a_elems = graph.ops[op.inputs[0]].output_bytes / act
        # |A| = B m k and |out| = B m n -> n / k = |out| / |A|; B m = |out| / n.
        if a_elems > 0:
            ratio = out / a_elems
            n = k * ratio
            if n >= 1:
                return out / n, n, k, 1.0
    side = math.sqrt(out)
    return side, side, k, 1.0


def _op_bytes(op: Op, graph: OpGraph) -> float:
    """Bytes a memory-bound op moves per sample: its output plus the outputs it reads."""
    read = sum(graph.ops[i].output_bytes for i in op.inputs if i in graph.ops)
    return op.output_bytes + (read if read > 0 else op.output_bytes)


def _tp_split(module: str) -> str | None:
    """Megatron TP role of a module inside a transformer layer, from the zoo's naming contract
    (other models' blocks: the role their markers gave the op, `Op.tp_role`)."""
    leaf = module.rsplit(".", 2)
    tail = ".".join(leaf[-2:]) if len(leaf) >= 2 else module
    if tail in ("attn.qkv", "attn.q", "attn.kv", "mlp.fc1", "mlp.gate", "mlp.up") or module.endswith(".lm"):
        return "column"
    if tail in ("attn.proj", "mlp.fc2", "mlp.down"):
        return "row"
    if ".attn.core" in module or module.endswith("mlp.act"):
        return "sharded"
    return None


def _cut_linear_collectives(op: Op, graph: OpGraph, layer: Layer, role: str, b: int, tp: int,
                            f: _Builder, bw: _Builder) -> str:
    """The collectives of a linear cut alone (`plait.graph.tp_plan`); returns the role its GEMM splits by."""
    # column_gather: its output features' slice, all-gathered; backward all-reduces the
    # input gradient. row_split: its input's slice taken, the output all-reduced; backward
    # all-gathers the input gradient. The ops around it run whole.
    out_b, in_b = op.output_bytes * b, sum(graph.ops[i].output_bytes for i in op.inputs[:1]
                                             if i in graph.ops) * b or layer.input_bytes * b
    if role == "column_gather":
        f.collective("all_gather", out_b, tp)
        bw.collective("all_reduce", in_b, tp)
    else:
        f.collective("all_reduce", out_b, tp)
        bw.collective("all_gather", in_b, tp)
    return "column" if role == "column_gather" else "row_alone"


def _price_generic_gemm(op: Op, graph: OpGraph, role: str | None, frac: float, b: int, tp: int,
                        f: _Builder, bwd_ops: list[tuple[str, tuple]]) -> None:
    """A matmul or convolution: its forward GEMM (and a row-parallel one's all-reduce); its backward queued."""
    shape = infer_gemm_shape(op, graph)
    if shape is None:
        f.compute(op.fwd_flops * b * frac)
        bwd_ops.append(("flops", (op.bwd_flops * b * frac,)))
    else:
        m, n, k, _ = shape
        m *= b
        if role == "column" or role == "sharded":
            n *= frac
        elif role in ("row", "row_alone"):
            k *= frac
        f.gemm(m, n, k)
        bwd_ops.append(("gemm", (m, k, n)))
        if op.param_bytes > 0 or op.bwd_flops > op.fwd_flops * 1.5:
            bwd_ops.append(("gemm", (k, n, m)))
    if role == "row":
        f.collective("all_reduce", op.output_bytes * b, tp)


def _price_generic_op(op: Op, graph: OpGraph, role: str | None, frac: float, b: int, tp: int, kind: GPUKind,
                      dtype: str, f: _Builder, bwd_ops: list[tuple[str, tuple]]) -> None:
    """One op's forward kernel into `f`; its backward kernels queued on `bwd_ops` (replayed last op first)."""
    if _GEMM_TARGETS.match(op.target) or _CONV_TARGETS.match(op.target):
        _price_generic_gemm(op, graph, role, frac, b, tp, f, bwd_ops)
        return
    if _ATTENTION_TARGETS.search(op.target):
        # shape unknown here: the flash kernel's long-sequence rate (`flash_peak_fraction`)
        f.compute(op.fwd_flops * b * frac, flash_peak_fraction(kind, False) / _sustained(kind, dtype))
        bwd_ops.append(("flops", (op.bwd_flops * b * frac, flash_peak_fraction(kind, True) / _sustained(kind, dtype))))
        return
    nbytes = _op_bytes(op, graph) * b * frac
    if op.fwd_flops > 0 and op.fwd_flops * b > nbytes * kind.flops(dtype) / kind.streaming_bandwidth:
        f.compute(op.fwd_flops * b * frac)
    else:
        f.mem(nbytes)
    if op.bwd_flops > 0 or op.saved_bytes > 0 or op.inputs:
        bwd_ops.append(("mem", (op.output_bytes * b * frac + op.saved_bytes * b * frac
                                + sum(graph.ops[i].output_bytes for i in op.inputs if i in graph.ops) * b * frac,)))


def _replay_backward(bw: _Builder, bwd_ops: list[tuple[str, tuple]]) -> None:
    """The queued backward kernels into `bw`, in reverse of the forward's order."""
    for kind_, args in reversed(bwd_ops):
        if kind_ == "gemm":
            bw.gemm(*args)
        elif kind_ == "flops":
            bw.compute(*args)
        else:
            bw.mem(*args)


def _recompute_pass(fwd: PassCost, kind: GPUKind, dtype: str, model: ComputeModel) -> PassCost:
    """The forward again, as full recompute re-runs it: its kernels and collectives in fresh segments."""
    rec = _Builder(kind, dtype, model, False)
    for item in fwd.items:
        if isinstance(item, Segment):
            rec.seg.gpu_s += item.gpu_s
            rec.seg.host_s += item.host_s
            rec.seg.kernels += item.kernels
            rec.seg.flops += item.flops
        else:
            rec._flush()
            rec.cost.items.append(item)
    return rec.done()


def generic_layer_cost(layer: Layer, graph: OpGraph, micro_batch: int, kind: GPUKind, dtype: str = "bf16",
                       tp: int = 1, share: float | None = None, model: ComputeModel = DEFAULT_MODEL) -> LayerCost:
    """A layer costed op by op from its captured per-sample FLOPs and bytes.

    Matmuls and convolutions use the GEMM model with the shape inferred by
    `infer_gemm_shape` (convolutions as their implicit GEMM at the ops' FLOPs); other ops
    are memory-bound. Backward: two GEMMs per matmul (data and weight gradient), one
    memory-bound kernel reading the output gradient and saved tensors per other op.
    Under tensor parallelism a "transformer" layer splits its column/row/sharded ops by
    `share` and all-reduces after row-parallel ops, and in backward the gradient of each distinct
    input its column-parallel ops read (Megatron's f: the attention's input, the MLP's; the
    layer's input when it has no column op); other layers are replicated on every tensor rank."""
    r = (1.0 / tp) if share is None else share
    split_layer = layer.tp_style in ("transformer", "head", "embedding") and tp > 1
    b = micro_batch
    f = _Builder(kind, dtype, model, False)
    bw = _Builder(kind, dtype, model, True)
    bwd_ops: list[tuple[str, tuple]] = []
    params = 0.0
    experts_out: dict[str, float] = {}  # an experts module cut by features -> its output's bytes
    # f before column linears: one all-reduce in backward per distinct input they read (Megatron:
    # the attention's and the MLP's), so the bytes of each such input (None: the layer's input)
    column_inputs: dict[str | None, float] = {}
    # A block its markers cut takes their roles only: the zoo's names (`_tp_split`) would take
    # another model's router called `mlp.gate` (Mixtral's) for a column linear.
    by_marks = split_layer and any(graph.ops[n].tp_role for n in layer.ops if n in graph.ops)
    for name in layer.ops:
        op = graph.ops.get(name)
        if op is not None and split_layer and op.tp_role == "experts":  # (its children's ops too)
            home = next((k for k in experts_out if op.module == k or op.module.startswith(k + ".")), op.module)
            experts_out[home] = op.output_bytes  # the module's last op: what g all-reduces
        if op is None or _FREE_TARGETS.match(op.target):
            continue
        role = (op.tp_role or None) if by_marks else _tp_split(op.module) if split_layer else None
        if role == "column" and (_GEMM_TARGETS.match(op.target) or _CONV_TARGETS.match(op.target)):
            first = op.inputs[0] if op.inputs else None
            src = first if first in graph.ops else None
            column_inputs[src] = graph.ops[src].output_bytes if src is not None else layer.input_bytes
        if role == "experts":  # every expert's GEMMs on its slice of the intermediate features
            role = "sharded"
        if role in ("column_gather", "row_split"):  # a linear cut alone (`plait.graph.tp_plan`)
            role = _cut_linear_collectives(op, graph, layer, role, b, tp, f, bw)
        frac = r if role else 1.0
        params += op.param_bytes / (graph.param_dtype_bytes or 4) * frac
        _price_generic_op(op, graph, role, frac, b, tp, kind, dtype, f, bwd_ops)
    _replay_backward(bw, bwd_ops)
    if split_layer and layer.tp_style == "transformer":
        for nbytes in column_inputs.values() if column_inputs else [layer.input_bytes]:
            bw.collective("all_reduce", nbytes * b or layer.output_bytes * b, tp)
    for nbytes in experts_out.values():  # g after the experts (forward), f before them (backward)
        f.collective("all_reduce", nbytes * b, tp)
        bw.collective("all_reduce", nbytes * b, tp)
    bw.mem(model.grad_accum_bytes_per_param * params)
    fwd = f.done()
    return LayerCost(layer.name, fwd, bw.done(), _recompute_pass(fwd, kind, dtype, model), PassCost(), params, params)


# ---------------------------------------------------------------- dispatch
def layer_cost(layer: Layer, graph: OpGraph, micro_batch: int, kind: GPUKind, dtype: str = "bf16",
               tp: int = 1, share: float | None = None, sequence_parallel: bool = False,
               model: ComputeModel = DEFAULT_MODEL) -> LayerCost:
    """Cost of `layer` for one micro-batch on one tensor rank of `kind` (see module docstring);
    measured where `model.profile` has the entry (`measured_layer_cost`), modelled otherwise."""
    if tp > 1 and not model.vocab_parallel and layer.tp_style in ("embedding", "head"):
        # replicated on every tensor rank: the whole layer, no collectives (the profile, measured
        # through the engine at this tp degree, is still looked up at it)
        cost = _analytic_layer_cost(layer, graph, micro_batch, kind, dtype, 1, None, False, model)
    else:
        cost = _analytic_layer_cost(layer, graph, micro_batch, kind, dtype, tp, share, sequence_parallel, model)
    # measured at an even tensor split: used where this rank's share is the even one
    if model.profile is not None and (share is None or tp == 1 or abs(share * tp - 1.0) < 1e-6):
        given = model.profile.layer_time(kind.name, layer.name, micro_batch, tp)
        if given is not None:
            return measured_layer_cost(cost, *given, keep_collectives=not model.profile.collectives_included(kind.name))
    return cost


def layer_cost_key(layer: Layer, model: ComputeModel, kinds: Any, micro_batch: int, tp: int = 1) -> str | tuple:
    """What a cache of `layer_cost` results keys `layer` on: equal-shaped transformer blocks share
    one modelled cost, but a layer the profile measured on one of `kinds` (GPU kind names) is
    keyed on its name -- `layer_cost` reads the profile by layer name, so two equal-shaped layers
    measured apart must be priced apart. The shape key holds the op count and saved bytes too: a
    block priced op by op (a model without the closed form's shape) may carry glue its twins lack
    (BERT's first block builds the attention mask: keyed on FLOPs alone every block was priced as
    the first, BERT-large dp=8 871 ms instead of 783 ms)."""
    if layer.tp_style != "transformer":
        return layer.name
    prof = model.profile
    if prof is not None and any(prof.layer_time(k, layer.name, micro_batch, tp) is not None for k in kinds):
        return layer.name
    return ("T", layer.kind, layer.fwd_flops, layer.param_count, layer.output_bytes, len(layer.ops),
            layer.saved_bytes)


def compute_provenance(model: ComputeModel, entries: list[tuple[str, str, int, int]]) -> str:
    """Which compute costs `layer_cost` reads from the profile and which it models, in one line
    for a plan row and `plait simulate` ("compute measured on a100-80gb, modelled on v100-32gb").
    `entries`: the (GPU kind, layer, micro-batch, tp degree) a plan prices. A kind is "measured"
    where the profile has every one of its layers, "partly measured" where some."""
    kinds: dict[str, list[bool]] = {}
    for kind, layer, mb, tp in entries:
        hit = model.profile is not None and model.profile.layer_time(kind, layer, mb, tp) is not None
        kinds.setdefault(kind, []).append(hit)
    full = [k for k, v in kinds.items() if all(v)]
    part = [f"{k} ({sum(v)} of {len(v)} layer costs)" for k, v in kinds.items() if any(v) and not all(v)]
    none = [k for k, v in kinds.items() if not any(v)]
    where = f" (profile {model.profile.source})" if model.profile is not None and (full or part) else ""
    parts = [f"measured on {', '.join(full)}"] if full else []
    parts += [f"partly measured on {', '.join(part)}"] if part else []
    parts += [f"modelled on {', '.join(none)}"] if none else []
    return "compute " + ", ".join(parts) + where if parts else "compute modelled"


def measured_layer_cost(cost: LayerCost, fwd_s: float, bwd_s: float, keep_collectives: bool = True) -> LayerCost:
    """`cost` with its compute segments scaled so each pass's compute time is the measured one; its
    collectives (which, where and how many bytes) stay the model's, priced on links by the lowering,
    unless the measured times already include them (`keep_collectives=False`: dropped)."""
    def scaled(p: PassCost, target: float) -> PassCost:
        have = p.compute_s
        f = target / have if have > 0 else 0.0
        items: list[Segment | Collective] = [
            Segment(i.gpu_s * f, i.host_s * f, i.kernels, i.flops) if isinstance(i, Segment) else i
            for i in p.items if keep_collectives or not isinstance(i, Collective)]
        if have <= 0:
            items.insert(0, Segment(target, 0.0, 0, 0.0))
        return PassCost(items)
    fwd = scaled(cost.fwd, fwd_s)
    # recompute re-runs (part of) the forward: scaled by the forward's measured/modelled ratio
    ratio = fwd_s / cost.fwd.compute_s if cost.fwd.compute_s > 0 else 1.0
    return dataclasses.replace(cost, fwd=fwd, bwd=scaled(cost.bwd, bwd_s),
                               recompute_full=scaled(cost.recompute_full, cost.recompute_full.compute_s * ratio),
                               recompute_selective=scaled(cost.recompute_selective,
                                                          cost.recompute_selective.compute_s * ratio))


def _analytic_layer_cost(layer: Layer, graph: OpGraph, micro_batch: int, kind: GPUKind, dtype: str,
                         tp: int, share: float | None, sequence_parallel: bool, model: ComputeModel) -> LayerCost:
    cfg = graph.config or {}
    shape = TransformerShape.from_config(cfg)
    vocab = cfg.get("vocab")
    if layer.tp_style == "transformer" and shape is not None:
        return transformer_layer_cost(shape, micro_batch, kind, dtype, tp, share, sequence_parallel,
                                      model, layer.name)
    if layer.tp_style == "embedding" and shape is not None and vocab:
        positions = any(".pos" in graph.ops[o].module for o in layer.ops if o in graph.ops) \
            if layer.ops else True
        return embedding_cost(int(vocab), shape.hidden, shape.seq, micro_batch, kind, dtype, tp, share,
                              positions, model, layer.name)
    if layer.tp_style == "head" and shape is not None and vocab:
        out = int(cfg.get("head_out") or vocab)  # a classifier head (closed-form graph's `head_out`)
        tied = bool(cfg.get("tie", layer.param_count < out * shape.hidden)) and out == int(vocab)
        return head_cost(out, shape.hidden, shape.seq, micro_batch, kind, dtype, tp, share, tied,
                         model, layer.name)
    return generic_layer_cost(layer, graph, micro_batch, kind, dtype, tp, share, model)


def recompute_flops(layer: Layer, graph: OpGraph, mode: str) -> float:
    """Forward FLOPs per sample that activation recompute re-runs for `layer`.

    The extra term of *hardware* FLOPs (Narayanan et al., SC'21, eq. (3): with full recompute
    a transformer layer costs ``4 x`` its forward FLOPs, not ``3 x``). It follows what
    `layer_cost` costs as recompute and the simulator runs: ``"full"`` re-runs the whole forward
    of every checkpointed layer -- Megatron checkpoints the transformer layers only, so a
    Megatron-shaped embedding or LM head (costed by `embedding_cost` / `head_cost`) is not
    recomputed, while a layer costed op by op (`generic_layer_cost`) is; ``"selective"`` re-runs
    the attention core of transformer layers (Korthikanti et al. 2022, sec. 4.2: QK^T, softmax,
    dropout, PV), whose FLOPs are the two batched products of the ``.attn.core`` ops."""
    if mode == "none":
        return 0.0
    cfg = graph.config or {}
    shape = TransformerShape.from_config(cfg)
    megatron = shape is not None and bool(cfg.get("vocab"))
    if mode == "full":
        if megatron and layer.tp_style in ("embedding", "head"):
            return 0.0
        return layer.fwd_flops
    if mode == "selective":
        if layer.tp_style != "transformer" or shape is None:
            return 0.0
        core = sum(graph.ops[o].fwd_flops for o in layer.ops if o in graph.ops and ".attn.core" in graph.ops[o].module)
        if core > 0:
            return core
        return 4.0 * shape.seq * shape.seq * shape.heads * shape.head_dim  # QK^T and PV, 2 s^2 d each per head
    raise ComputeError(f"recompute: must be 'none', 'selective' or 'full', got {mode!r}")


def optimizer_time(params: float, kind: GPUKind, model: ComputeModel = DEFAULT_MODEL) -> float:
    """Mixed-precision Adam step over `params` parameters: memory-bound multi-tensor kernels."""
    if params <= 0:
        return 0.0
    return params * model.optimizer_bytes_per_param / (kind.streaming_bandwidth * model.memory_efficiency)
