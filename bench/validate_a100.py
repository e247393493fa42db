"""Validate the simulator against measured Megatron-DeepSpeed iterations on one A100 node.

Data: ``shared/data/a100_single_node_megatron.csv`` (1440 rows; GPT, h in {1024, 2048},
16 heads, seq 1024, 12-24 layers, 2-8 GPUs, every tp x dp x pp, 1F1B). Setup from the
data README: A100, 8 per node, 150 GB/s intra-node, mixed precision (fp16), vocab 50257,
no gradient bucketing (one all-reduce after the backward), activation recompute on.

Split (fixed, written here, not chosen by results): rows are numbered 0..1439 in file order;
**even rows are the training half, odd rows the held-out half**. ``--fit`` fits the compute
model's physical parameters (GEMM efficiency, unaligned-GEMM penalty, memory-bandwidth
efficiency, per kernel GPU and host times, per collective / p2p host time, per micro-batch and
per step host work) and the NVLink latency (and, with ``--fit-bandwidth``, bandwidth) on the
even rows only, by soft-L1 least squares on log(predicted / measured) (linear above 0.5 %,
``--f-scale``); without ``--fit`` the
defaults shipped in `plait.cost.compute.ComputeModel` (the result of that fit) are used. MAPE is
reported overall and on both halves, with the rank correlation per model, the parameters used
and a variants table simulated in the same run: the baseline (calib4's defaults), each model change
of calib5 on calib4's parameters, this run's parameters with each change undone, the other
recompute setting, and the earlier calibrations. ``--json``: the same figures as one JSON object.

Recompute: simulated as measured, ``--recompute full`` by default (the README: activation
recompute on; Megatron checkpoints the transformer layers only, so the embedding, LM head and
loss are not recomputed -- `plait.cost.compute` costs it so).

**Shipped now (calib5): Megatron's fused softmax runs only where its CUDA kernel is available.**
`FusedScaleMaskSoftmax.is_kernel_available` (Megatron-LM / Megatron-DeepSpeed
megatron/model/fused_softmax.py, and vTrain's own copy of the layer, src/model/fused_softmax.py:
``attn_batch_size % 4 == 0``) needs ``micro-batch x heads per tensor rank`` to be a multiple of 4
(of the causal kernel's 4 rows per block at seq 1024). 16 heads at tp = 8 leave 2 per rank, so at
micro-batch 1 -- and only there in this data -- Megatron falls back to
``forward_torch_softmax``: cast to fp32, scale, masked_fill, softmax, cast back, five kernels each
way instead of one (fp32 because query-key layer scaling forces ``attention_softmax_in_fp32``),
in the forward, its recompute and the backward (`plait.cost.compute.fused_softmax_available`).
These are exactly the cells the docstring below names as under-predicted by 19-24 % "at both hidden
sizes" (tp = 8, micro-batch 1): they go from 0.73 / 0.76 of the measured layer time to 0.86 / 0.89
(``--cells``); the rest of the shortfall (~0.6 ms per layer) is unexplained. Also as Megatron does it:
the vocab-parallel cross-entropy all-reduces three per-token values under TP (maximum, the target's
logit, sum of exponentials; `_VocabParallelCrossEntropy.forward`), plait had two (no effect on the
MAPE: 4.94 / 4.99 without it, same parameters). Checked and left as they were: the nccl-tests tables
are read at the tensor-parallel message size (``b s h`` x 2 bytes; nccl-tests' size is the buffer in
bytes, ``t = S 2 (n-1)/n / busbw``), and in-place and out-of-place differ by at most 4 % there; vTrain's
model (src/model/gpt_model.py: ``checkpoint_activations``, ``checkpoint_num_layers=1``) is Megatron's
full per-layer recompute, so ``--recompute full`` stays. Refitted on the even rows, same bounds
(``--fit --max-nfev 80``, 612 CPU s), with the soft-L1 scale at 0.5 % instead of 3 % (``--f-scale``:
residuals above it count linearly, so the fit minimises about the mean absolute log error, the
statistic the goal is stated in, instead of a squared error below 3 %): GEMM 0.859, HBM 0.899 (both
at their ceilings, as before), unaligned penalty 2.43, per-kernel GPU time 8.56 us, host per forward
/ backward kernel 47.6 / 60.8 us, host per collective call 0.54 us, p2p step 442 us, loss / batch /
step host 0.392 / 0.433 / 0.016 ms, NVLink p2p latency 1.59 us. **MAPE 4.92 % overall, 4.87 % on
the fit half, 4.98 % held out**; Spearman rho 0.990-0.995 per model. Same run (variants table):
calib4's defaults 5.23 / 5.16 / 5.31; calib4's parameters with the softmax rule, not refitted, 4.96 /
4.90 / 5.02; the same refit at the former 3 % scale 4.94 / 4.88 / 5.00. Tried and not shipped: odd
fp16 dimensions priced apart (``--odd-penalty``, refit: 4.92 / 4.86 / 4.98, odd 2.35, partly aligned
1.73) -- no better held out, and as calib4 found it buys its fit-half gain by lowering the tp = 4 / 8
rest to 0.78-0.90 of measured (``--cells``) with the host times per step and per collective at 0.
The goal is met, at its edge (0.02 points of margin held out): what bounds the error (below) is
unchanged, and the ~0.6 ms per layer still missing at tp = 8, micro-batch 1 is unexplained.

What the previous calibration (recompute none, 4.93 % MAPE) absorbed in the wrong place, and
what changed physically to fit with recompute full:

1. **The vocabulary shard of a tensor rank is an integer.** The per-sample time outside the
   layers (``--cells``, 'rest') drops 5x from tp = 1 to tp = 2 and hardly at all from tp = 2 to
   tp = 4 (h = 2048: 8.3, 1.6, 1.5 ms per sample): the logits GEMM is unaligned at 50257 and
   12564 rows and aligned at 25128 = 50257 // 2, the floor split that vTrain, the data's own
   simulator, builds (src/model/gpt_modeling.py, ``vocab_size // world_size``). The previous
   model used the fractional 50257 / 2 = 25128.5 rows, which counted as unaligned: at tp = 2 it
   charged the head ~2x too much and, to match the totals, the fit lowered the per-layer time --
   room the missing recompute then filled. `shard_vocab` gives each rank VOCAB // tp rows.
2. **Efficiencies are bounded by measured physical ceilings** instead of free ranges: GEMM
   efficiency <= 0.859 (A100 maximum achievable matmul FLOPS, 267.9 of 312 TFLOP/s, best shape
   of a sweep; S. Bekman, ml-engineering), streaming-kernel efficiency <= 0.9 of HBM, NVLink
   all-reduce bus bandwidth <= 229 GB/s (nccl-tests on the same machine, shipped with vTrain:
   trace/a100/AR_GPU8_1M_1024M_LUT, 1 GiB over 8 GPUs). The old fit's 0.998 GEMM efficiency and
   275 GB/s NVLink (recompute full) are outside them.
3. With recompute, the forward kernels are launched twice per micro-batch, so the host time
   per forward kernel falls (69.5 -> 46.5 us) and the GPU-side efficiencies rise (GEMM 0.814 ->
   0.856, streaming 0.643 -> 0.873): the old fit had paid for the unrecomputed forward with
   slow kernels. NVLink: 216 -> 224 GB/s and 13.7 -> 5.5 us per ring step (nccl-tests on that
   machine: ~92 us for a 1 MiB all-reduce over 8 GPUs, i.e. ~6.6 us per step of 14).

**calib4: every all-reduce is timed from the nccl-tests tables measured on the
data's own node** (vTrain's trace/a100/AR_GPU{2..8}_1M_1024M_LUT, ``bench/data/vtrain_a100_allreduce.yaml``;
``--alpha-beta`` restores the fitted ring) instead of one (latency, bandwidth) ring fitted to the
rows: at the tensor-parallel sizes (2-32 MiB) the measured all-reduce takes 45-230 us, 2-3x the
ring's at tp = 2 (52 vs 20 us at 2 MiB) and about the ring's at tp = 8 -- a measured property of the
fabric, not a fitted one (issue 12's "measured collective bus bandwidth per size"). The NVLink ring
now times only the pipeline's point-to-point transfers (latency 3.43 us, fitted). Refitted on the
even rows with the same bounds (``--fit --max-nfev 80``, from calib3's defaults): GEMM 0.859, HBM
0.893, unaligned GEMM penalty 2.36, per-kernel GPU time 7.8 us, host per forward / backward kernel
46.0 / 62.2 us, host per collective call 4.4 us, p2p step 485 us, loss / batch / step host 0.39 /
0.46 / 0.06 ms. **MAPE 5.23 % overall, 5.16 % on the fit half, 5.31 % held out** (calib3's
calibration, same run: 5.33 / 5.27 / 5.40). Not only the total moved: the per-micro-batch rest of
the tp = 1 rows (the odd 50257-row LM head), which calib3's fit held at 0.72-0.91 of measured to
offset its over-predicted h = 2048 layer, is now 0.83-1.01 of measured (``--cells``), with the
unaligned penalty nearer the ~3 that head needs. Still above the 5 % goal, for the reasons below.

calib3's result (its defaults, alpha-beta ring): MAPE 5.33 % overall, 5.26 % on
the fit half, 5.39 % held out (previous calibration, recompute none: 4.93 / 4.87 / 4.99 %;
recompute none with the new parameters: 20.0 %); Spearman rho 0.988-0.993 per model. The
goal of <= 5 % is not reached with honest parameters, and the per-cell table (``--cells``)
shows why: (a) in the GPU-bound cells (h = 2048, tp = 1, micro-batch 2 and 4) the measured time
per layer (4.76, 8.78 ms) is 13-18 % *below* a layer with its forward recomputed at the best
achievable matmul rate (5.63, 9.90 ms: the fit pins the GEMM efficiency at the ceiling, 0.856
of 0.859), and the fit balances that by under-predicting the per-micro-batch rest of those
rows (0.72-0.75 of measured). The measurements hold less recompute work than a full
recompute of every layer. Two documented mechanisms would explain it: vTrain's simulator
does not recompute on the last pipeline stage (src/predictor.py: "Last rank worker doesn't
perform recomputation"), which is the only stage when pp = 1; and Megatron-DeepSpeed's
DeepSpeed-pipeline model did not recompute under ``--recompute-granularity full`` (only
``--checkpoint-activations`` set its checkpoint interval), reported and fixed in PR #243
(microsoft/Megatron-DeepSpeed, Sept. 2023). Which flags vTrain's runs used is not published. (b) h = 2048,
tp = 4, micro-batch 2 (the worst rows, ~33 %): the measured per-layer time (2.75 ms) is below
h = 1024's at the same tp and micro-batch (3.31 ms), which no model monotone in the work can
follow. (c) tp = 8, micro-batch 1: the per-layer time is under-predicted by 19-24 %; nccl-tests
on that machine show all-reduces of 1-8 MiB (the tensor-parallel messages) at 20-110 GB/s bus
bandwidth with a 45-95 us floor that grows with the group size, which one (latency, bandwidth)
ring fitted to the large gradient all-reduces cannot follow.

What bounds the error (``--floor``, helper calib3): other physically motivated models, each
refitted on the even rows with the same bounds, did not reach <= 5 % either (MAPE all / held out):
recompute none, i.e. Megatron-DeepSpeed's GPTModelPipe before PR #243 (microsoft/Megatron-DeepSpeed
b91bfd4d, Sept. 2023), which set no checkpoint interval for ``--recompute-granularity full``
(only ``--checkpoint-activations`` did): 5.19 / 5.25 (with ``--nccl-tests``: 5.18 / 5.26; GEMM
0.77, HBM 0.64 of peak); vTrain's rule that the last pipeline stage does not recompute
(src/predictor.py): 6.48 / 6.50; the host running ahead of the GPU across tensor-parallel
collectives (NCCL calls do not block the host): 5.74 / 5.84; 64-wide instead of 128-wide output
tiles in the wave model (cuBLAS also picks smaller tiles): full recompute 5.31 / 5.35 with the
GEMM and HBM efficiencies pinned at their ceilings, recompute none 5.12 / 5.15 (per-kernel time at
its 30 us bound). Two facts in the data bound any such
model: (a) at h = 2048, tp = 1, micro-batch 4 the measured layer (8.78 ms) is faster than the GPU
floor of a layer with its forward recomputed (8.86 ms: every GEMM at 0.859 of peak with no wave
quantisation, every streaming kernel at 0.9 of HBM, no per-kernel, host or collective time); (b)
8 of the 24 (hidden, tp, micro-batch) cells take part in a measured time per layer or per
micro-batch that *falls* as the micro-batch or the hidden size grows (e.g. h = 1024, tp = 8: 4.99,
4.04, 3.70 ms per layer at micro-batch 1, 2, 4; tp = 4, micro-batch 2: 3.31 ms at h = 1024, 2.75 ms
at h = 2048); their rows (every pp) hold 35 % of the shipped model's absolute error. No
model whose times grow with the work can follow them: a linear programme over every monotone
choice of the per-cell layer and rest times, with everything else in each row exact, leaves a
floor of 2.29 % MAPE on the 648 identifiable pp = 1 rows (``monotone_floor``). That floor is a
lower bound, not a proof that 5 % is out of reach.

A third fact (``--floor``, helper calib4; `pp_invariance`): fitted per (hidden, tp, micro-batch,
pp) as 1F1B, ``(g + pp - 1) (rest + layer L / pp)`` plus a gradient and optimizer term per dp, the
measured time of one layer for one micro-batch is *the same* at pp = 1, 2 and 4 in all 18 cells that
have pp > 1 rows (largest difference 0.00 %; fit residuals <= 0.03 % except six h = 2048, tp <= 2
cells, <= 0.84 %), and the per-slot rest is the same at pp = 2 and 4. Whatever the runs recomputed,
every pipeline stage did the same: under vTrain's rule (only non-last stages recompute, so pp = 1
not at all) a pipeline's slot is the slower of a recomputing first stage and a non-recomputing last
one, so its layer term would differ from pp = 1's, or the rows would bend where the slower stage
changes with L. With (a), the data is consistent with no recompute or
a partial one on every stage, and not with full recompute at the GEMM ceiling -- but (a) is a 1 %
margin against a ceiling measured on another A100, so it cannot settle which.

Variants tried by calib4 (each "refit" fitted on the even rows with the bounds above; MAPE all /
held out; the shipped defaults: 5.33 / 5.40, refitted from them: 5.34 / 5.40):

- GEMMs with an odd fp16 dimension (2-byte aligned: Ampere's ``cp.async`` copies 4, 8 or 16
  bytes, so they leave the asynchronous-copy kernels) priced apart from 4- and 8-byte aligned ones
  (``--odd-penalty``; `plait.cost.compute.alignment_penalty`), full recompute, refit: 5.30 / 5.37
  (odd 1.96, partly aligned 1.18). Only the partly-aligned penalty lowered, everything else as
  shipped: best 5.29 / 5.35 at 1.0. Not shipped: the gain comes from the tp = 4 and 8 rows, whose
  per-micro-batch rest (LM head on a 12564- or 6282-row shard) falls to 0.66-0.80 of measured
  (``--cells``; 0.86-0.99 as shipped) to offset their over-predicted layer -- the compensation this
  calibration exists to remove; and the tp = 1 rest (the odd 50257-row head, 0.72-0.79 of measured)
  wants an odd penalty near 3, which the fit refuses because the h = 2048, tp = 1 layer is already
  above measured at the GEMM ceiling;
- all-reduce times from the node's nccl-tests tables with full recompute and calib3's parameters,
  not refitted: 6.23 / 6.27 (host time per collective 0: 5.65 / 5.69); refitted: 5.23 / 5.31
  (shipped, above);
- a per-tile prologue and epilogue worth k0 main-loop K elements (``t *= (k + k0) / k``), full
  recompute, shipped parameters with GEMM efficiency 0.859: k0 = 32-256 with 2-11 us per kernel,
  best 5.57 / 5.62 (k0 = 128, 6 us) -- not refitted, dropped;
- selective recompute (attention core only; Megatron-DeepSpeed's pipeline model honoured
  ``--recompute-granularity selective`` before PR #243), refit: 5.14 / 5.20 (GEMM 0.748, HBM 0.775,
  NVLink 158 GB/s / 10.3 us); with the odd-dimension penalty: 5.13 / 5.19 (odd 1.75, partly
  aligned 1.55); recompute none refitted again: 5.19 / 5.25, as calib3 found; with the
  odd-dimension penalty: 5.18 / 5.24 (odd 1.73, partly aligned 1.60, GEMM 0.762, HBM 0.626).

None reaches 5 %. Of those below calib3's 5.33, only the measured all-reduce tables keep the data's
documented full recompute and improve the decomposition rather than trading one cell's error for
another's; they are shipped. Selective recompute or none fit better (5.13-5.19) but contradict the
data's documented setting by choice of the error, so they are not.

Baseline (same run): Pipette's closed form (SYSTEMS.md §2) with the model FLOPs at a
single MFU fitted on the even rows, plus a ring all-reduce of the gradients.

Link bandwidth: the README gives 150 GB/s; ``--bandwidth 150e9`` evaluates with it.

Usage: ``python bench/validate_a100.py [--fit [--fit-bandwidth]] [--recompute none|selective|full]
[--odd-penalty P] [--nccl-tests] [--bandwidth B] [--rows N] [--cells] [--floor]`` (``--cells``: measured vs predicted ms per layer and per
micro-batch for every (hidden, tp, micro-batch) cell, from the pp = 1 rows).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from scipy.optimize import least_squares
from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plait.cluster.catalog import GPU_KINDS  # noqa: E402
from plait.cluster.spec import Cluster, Link, NodeSpec  # noqa: E402
from plait.cost.compute import DEFAULT_MODEL, ComputeModel, TransformerShape, transformer_layer_cost  # noqa: E402
from plait.graph.gpt_closed_form import gpt_opgraph  # noqa: E402
from plait.ir.plan import Plan  # noqa: E402
from plait.net.view import ClusterView  # noqa: E402
from plait.sim.engine import simulate as run_engine  # noqa: E402
from plait.sim.lowering import SimOptions, lower  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "a100_single_node_megatron.csv"
VOCAB = 50257  # GPT-2, unpadded; each tensor rank holds VOCAB // tp rows (`shard_vocab`)
README_BW = 150e9  # data README: intra-node bandwidth
INTRA_BW = 223.8e9  # achieved NVLink bandwidth, fitted on the even rows (--fit --fit-bandwidth)
NVLINK_LATENCY = 1.59e-6  # per ring step / p2p message, fitted on the even rows (collectives: nccl-tests tables)
CALIB3_LATENCY = 5.57e-6  # the calibration before (alpha-beta ring for every collective), for the comparison row
KIND = GPU_KINDS["a100-80gb"]

FIT_FIELDS = ["gemm_efficiency", "unaligned_penalty", "memory_efficiency", "kernel_gpu_s", "host_fwd_s",
              "host_bwd_s", "host_comm_s", "p2p_host_s", "loss_host_s", "batch_host_s", "step_host_s"]
# Physical ceilings, not free ranges: a GEMM main loop cannot beat the A100's maximum achievable
# matmul FLOPS (267.9 of 312 TFLOP/s = 0.859, the best shape of a sweep; S. Bekman, ml-engineering,
# "Maximum Achievable Matmul FLOPS comparison table"); streaming kernels reach at most ~90 % of HBM
# bandwidth (device-to-device copy); the NVLink all-reduce bus bandwidth at most the 229 GB/s that
# nccl-tests measured on this very machine (vTrain's trace/a100/AR_GPU8_1M_1024M_LUT, 1 GiB, 8 GPUs).
BOUNDS = {"gemm_efficiency": (0.3, 0.859), "unaligned_penalty": (1.0, 8.0), "memory_efficiency": (0.2, 0.9),
          "kernel_gpu_s": (0.0, 30e-6), "host_fwd_s": (0.0, 400e-6), "host_bwd_s": (0.0, 400e-6),
          "host_comm_s": (0.0, 1e-3), "p2p_host_s": (0.0, 5e-3), "loss_host_s": (0.0, 10e-3),
          "batch_host_s": (0.0, 5e-3), "step_host_s": (0.0, 30e-3), "latency": (0.2e-6, 60e-6),
          "bandwidth": (100e9, 229e9), "odd_penalty": (1.0, 8.0)}
SCALE = {"gemm_efficiency": 1, "unaligned_penalty": 1, "memory_efficiency": 1, "kernel_gpu_s": 1e-6,
         "host_fwd_s": 1e-5, "host_bwd_s": 1e-5, "host_comm_s": 1e-5, "p2p_host_s": 1e-4, "loss_host_s": 1e-3,
         "batch_host_s": 1e-4, "step_host_s": 1e-3, "latency": 1e-6, "bandwidth": 1e10, "odd_penalty": 1}


# The calibration shipped before this one (fitted with recompute none on the even rows, fractional
# vocabulary shard); kept to print it as a comparison row.
BEFORE_CALIB5 = dict(softmax_fallback=False, ce_target_allreduce=False)  # the model as priced up to calib4
PREVIOUS_NONE_FIT = DEFAULT_MODEL.replace(**BEFORE_CALIB5, gemm_efficiency=0.814, unaligned_penalty=2.28, memory_efficiency=0.643,
                                          kernel_gpu_s=20.6e-6, host_fwd_s=69.5e-6, host_bwd_s=72.8e-6,
                                          host_comm_s=13.8e-6, p2p_host_s=137e-6, loss_host_s=0.469e-3,
                                          batch_host_s=0.310e-3, step_host_s=0.016e-3)
PREVIOUS_LATENCY, PREVIOUS_BANDWIDTH = 13.7e-6, 215.9e9
# The calibration shipped before calib4's (recompute full, every all-reduce on the fitted alpha-beta ring).
CALIB3_FIT = DEFAULT_MODEL.replace(**BEFORE_CALIB5, gemm_efficiency=0.856, unaligned_penalty=1.89, memory_efficiency=0.873,
                                   kernel_gpu_s=11.0e-6, host_fwd_s=46.5e-6, host_bwd_s=63.0e-6, host_comm_s=20.6e-6,
                                   p2p_host_s=705e-6, loss_host_s=0.319e-3, batch_host_s=0.565e-3,
                                   step_host_s=0.046e-3)
# calib4's calibration (the defaults before calib5): every all-reduce from the nccl-tests tables, the
# fused softmax everywhere, two cross-entropy all-reduces; the baseline of the variants table.
CALIB4_FIT = DEFAULT_MODEL.replace(**BEFORE_CALIB5, gemm_efficiency=0.859, unaligned_penalty=2.36,
                                   memory_efficiency=0.893, kernel_gpu_s=7.79e-6, host_fwd_s=46.0e-6,
                                   host_bwd_s=62.2e-6, host_comm_s=4.37e-6, p2p_host_s=485e-6,
                                   loss_host_s=0.392e-3, batch_host_s=0.462e-3, step_host_s=0.063e-3)
CALIB4_LATENCY = 3.43e-6
# calib5's other refits (the model as shipped; even rows, --max-nfev 80), kept as variants rows:
# soft-L1 at f_scale 0.03 (the scale before), and odd fp16 dimensions priced apart (--odd-penalty 2.8).
CALIB5_FSCALE03_FIT = DEFAULT_MODEL.replace(gemm_efficiency=0.859, unaligned_penalty=2.34, memory_efficiency=0.900,
                                            kernel_gpu_s=8.45e-6, host_fwd_s=46.9e-6, host_bwd_s=61.9e-6,
                                            host_comm_s=0.64e-6, p2p_host_s=472e-6, loss_host_s=0.394e-3,
                                            batch_host_s=0.355e-3, step_host_s=0.018e-3)
CALIB5_FSCALE03_LATENCY = 1.83e-6
CALIB5_ODD_FIT = DEFAULT_MODEL.replace(gemm_efficiency=0.859, unaligned_penalty=1.73, odd_penalty=2.35,
                                       memory_efficiency=0.900, kernel_gpu_s=8.68e-6, host_fwd_s=47.9e-6,
                                       host_bwd_s=61.3e-6, host_comm_s=0.09e-6, p2p_host_s=453e-6,
                                       loss_host_s=0.288e-3, batch_host_s=0.324e-3, step_host_s=0.0)
CALIB5_ODD_LATENCY = 0.24e-6


def load_rows(path: Path = DATA) -> list[dict]:
    with open(path, encoding="utf-8-sig") as fh:
        raw = list(csv.reader(fh))
    rows = []
    for i, r in enumerate(raw[1:]):
        g, gb, mb, h, a, L, s, tp, dp, pp = (int(x) for x in r[:10])
        rows.append(dict(index=i, gpus=g, global_batch=gb, micro_batch=mb, hidden=h, heads=a, layers=L, seq=s,
                         tp=tp, dp=dp, pp=pp, measured_s=float(r[10]) / 1e3))
    return rows


NCCL_TESTS = ROOT / "bench" / "data" / "vtrain_a100_allreduce.yaml"
MEASURED: list = []  # the node's measured all-reduce busbw tables (loaded by main), empty: alpha-beta ring


RECOMPUTE = "full"  # the data's setting (README: activation recompute on; vTrain's use_checkpoint, per layer)


def load_measured(path: str | Path = NCCL_TESTS) -> list:
    """Load the node's measured all-reduce tables into MEASURED (every all-reduce is timed from them)."""
    from plait.cluster import load_cluster

    MEASURED[:] = load_cluster(str(path)).collectives
    return MEASURED


def data_cluster(gpus: int = 8, latency: float = NVLINK_LATENCY, bandwidth: float = INTRA_BW,
                 measured: bool = True) -> Cluster:
    """The data's node with `gpus` A100s; `measured`: all-reduces timed from the nccl-tests tables
    in MEASURED (`load_measured`), else the (latency, bandwidth) ring. `bench/plan_quality.py`
    plans on this same cluster."""
    node = NodeSpec(name="dgx-a100", gpus=[KIND.name] * gpus, intra=Link(bandwidth, latency, "nvlink"),
                    nic=Link(800e9 / 8 / 8, 5e-6, "infiniband"), nics=8)
    return Cluster(name=f"a100x{gpus}", kinds={KIND.name: KIND}, nodes=[node],
                   collectives=list(MEASURED) if measured else [], source="validate_a100")


def make_view(latency: float, bandwidth: float = INTRA_BW, measured: bool = True) -> ClusterView:
    """The data's node (`data_cluster`, 8 GPUs) as the simulator sees it."""
    return ClusterView.from_cluster(data_cluster(8, latency, bandwidth, measured))


def shard_vocab(tp: int) -> int:
    """The vocabulary whose 1/tp share is each tensor rank's integer shard, VOCAB // tp rows.

    The runs' logits GEMM is an integer number of vocabulary rows per rank; the data shows which:
    the per-sample time outside the layers (``--cells``, 'rest') drops 5x from tp = 1 to tp = 2 and
    hardly at all from tp = 2 to tp = 4 (h = 2048: 8.3, 1.6, 1.5 ms), the signature of a GEMM that
    is unaligned at 50257 and 12564 rows and aligned at 25128 -- the floor split that vTrain (the
    data's own simulator, src/model/gpt_modeling.py ``vocab_size // world_size``) builds. Megatron's
    default padding (a multiple of 128 tp) would make every shard aligned, which the data rules
    out. A fractional share 50257 / 2 would wrongly count as unaligned."""
    return VOCAB if tp == 1 else (VOCAB // tp) * tp


class Evaluator:
    """Predicts rows with one recompute setting; `floor_vocab` gives each tensor rank the integer
    shard VOCAB // tp (`shard_vocab`; False: the fractional 50257 / tp of the previous calibration)."""

    def __init__(self, rows: list[dict], recompute: str, floor_vocab: bool = True) -> None:
        self.rows, self.recompute, self.floor_vocab = rows, recompute, floor_vocab
        self.graphs: dict[tuple, object] = {}
        self.views: dict[float, ClusterView] = {}
        self.plans = [Plan(dp=r["dp"], tp=r["tp"], pp=r["pp"], micro_batch=r["micro_batch"],
                           global_batch=r["global_batch"], recompute=recompute, schedule="1f1b", dtype="fp16")
                      for r in rows]

    def graph(self, r: dict):
        vocab = shard_vocab(r["tp"]) if self.floor_vocab else VOCAB
        key = (r["layers"], r["hidden"], r["heads"], r["seq"], vocab)
        if key not in self.graphs:
            self.graphs[key] = gpt_opgraph({"layers": r["layers"], "hidden": r["hidden"], "heads": r["heads"],
                                            "seq": r["seq"], "vocab": vocab}, "fp16")
        return self.graphs[key]

    def predict(self, model: ComputeModel, latency: float, idx: list[int], bandwidth: float = INTRA_BW,
                measured: bool = True) -> np.ndarray:
        key = (latency, bandwidth, measured and bool(MEASURED))
        view = self.views.get(key)
        if view is None:
            view = self.views[key] = make_view(latency, bandwidth, measured)
        cache: dict = {}
        # vTrain's Megatron-LM runs: its legacy scatter-gather of pipeline tensors (1/tp per tensor rank)
        opts = SimOptions(granularity="stage", compute=model, cost_cache=cache, pp_scatter_gather=True)
        out = np.empty(len(idx))
        for j, i in enumerate(idx):
            lw = lower(self.graph(self.rows[i]), self.plans[i], view, opts)
            out[j] = run_engine(lw.graph).makespan
        return out


def fit(ev: Evaluator, train: list[int], console: Console, max_nfev: int, fit_bandwidth: bool,
        start: ComputeModel = DEFAULT_MODEL, fields: list[str] = FIT_FIELDS,
        f_scale: float = 0.005) -> tuple[ComputeModel, float, float]:
    """Fit `fields` of `start` (and the NVLink latency, with `fit_bandwidth` its bandwidth) on `train`."""
    names = fields + ["latency"] + (["bandwidth"] if fit_bandwidth else [])
    x0 = np.array([getattr(start, f) for f in fields] + [NVLINK_LATENCY]
                  + ([INTRA_BW] if fit_bandwidth else []))
    scale = np.array([SCALE[n] for n in names])
    lo = np.array([BOUNDS[n][0] for n in names]) / scale
    hi = np.array([BOUNDS[n][1] for n in names]) / scale
    y = np.array([ev.rows[i]["measured_s"] for i in train])
    calls = [0]

    k = len(fields)

    def unpack(x: np.ndarray) -> tuple[ComputeModel, float, float]:
        v = x * scale
        bw = float(v[k + 1]) if fit_bandwidth else INTRA_BW
        return start.replace(**dict(zip(fields, v[:k]))), float(v[k]), bw

    def residuals(x: np.ndarray) -> np.ndarray:
        calls[0] += 1
        model, lat, bw = unpack(x)
        return np.log(ev.predict(model, lat, train, bw) / y)

    t0 = time.time()
    # soft-L1 on log ratios, linear above f_scale: close to minimising MAPE, and robust to the rows
    # whose measured per-layer time is not monotone in the micro-batch size.
    sol = least_squares(residuals, np.clip(x0 / scale, lo, hi), bounds=(lo, hi), x_scale="jac",
                        diff_step=1e-3, max_nfev=max_nfev, loss="soft_l1", f_scale=f_scale)
    model, lat, bw = unpack(sol.x)
    console.print(f"fit: {calls[0]} evaluations of {len(train)} rows in {time.time() - t0:.0f} s, "
                  f"status {sol.status}")
    for n, v in zip(names, sol.x * scale):
        console.print(f"  {n:20s} = {v:.6g}")
    return model, lat, bw


def baseline(rows: list[dict], train: list[int]) -> np.ndarray:
    """Pipette's 1F1B closed form with FLOPs at one fitted MFU, plus a ring gradient all-reduce."""
    peak = KIND.flops("fp16")

    def parts(r: dict) -> tuple[float, float]:
        s, h, L, b = r["seq"], r["hidden"], r["layers"], r["micro_batch"]
        layer = 24 * b * s * h * h + 4 * b * s * s * h
        head = 2 * b * s * h * VOCAB
        per_stage = 3 * (layer * L / r["pp"] + head) / r["tp"]  # fwd + bwd FLOPs of the busiest stage
        gas = r["global_batch"] // (r["dp"] * b)
        pp = r["pp"]
        steps = (gas // pp) * pp + (pp - 1) if gas >= pp else gas + pp - 1
        msg = b * s * h * 2
        comm = (gas // max(1, pp)) * 2 * msg / INTRA_BW * (pp - 1)
        params = (12 * h * h * L / pp + VOCAB * h) / r["tp"]
        ar = 2 * (r["dp"] - 1) / r["dp"] * params * 2 / INTRA_BW if r["dp"] > 1 else 0.0
        return steps * per_stage / peak, comm + ar

    flop_t = np.array([parts(r)[0] for r in rows])
    comm_t = np.array([parts(r)[1] for r in rows])
    y = np.array([r["measured_s"] for r in rows])
    # One MFU, fitted on the even rows (log least squares has a closed form: geometric mean).
    resid = np.log(y[train] - np.minimum(comm_t[train], 0.9 * y[train])) - np.log(flop_t[train])
    mfu = 1.0 / math.exp(float(np.mean(resid)))
    return flop_t / mfu + comm_t


def ape(pred: np.ndarray, meas: np.ndarray) -> np.ndarray:
    return np.abs(pred / meas - 1.0) * 100.0


def report(console: Console, rows: list[dict], pred: np.ndarray, base: np.ndarray, train: list[int],
           test: list[int], title: str) -> dict:
    y = np.array([r["measured_s"] for r in rows])
    e, eb = ape(pred, y), ape(base, y)
    t = Table(title=title)
    t.add_column("rows")
    t.add_column("n", justify="right")
    t.add_column("plait MAPE %", justify="right")
    t.add_column("median APE %", justify="right")
    t.add_column("max APE %", justify="right")
    t.add_column("within 5 % / 10 %", justify="right")
    t.add_column("baseline MAPE %", justify="right")
    out = {}
    for name, idx in (("all", list(range(len(rows)))), ("fit half (even)", train), ("held-out half (odd)", test)):
        if not idx:
            continue
        ee = e[idx]
        t.add_row(name, str(len(idx)), f"{ee.mean():.2f}", f"{np.median(ee):.2f}", f"{ee.max():.1f}",
                  f"{(ee <= 5).mean() * 100:.0f} / {(ee <= 10).mean() * 100:.0f}", f"{eb[idx].mean():.2f}")
        out[name] = float(ee.mean())
    console.print(t)
    # Per model: MAPE and Spearman rank correlation across its configurations.
    groups = defaultdict(list)
    for i, r in enumerate(rows):
        groups[(r["hidden"], r["layers"])].append(i)
    t2 = Table(title="per model (GPT h, L): rank correlation across configurations")
    for c in ("model", "rows", "MAPE %", "held-out MAPE %", "Spearman rho", "baseline rho"):
        t2.add_column(c, justify="right")
    test_set = set(test)
    for (h, L), idx in sorted(groups.items()):
        rho = spearmanr(y[idx], pred[idx]).statistic
        rho_b = spearmanr(y[idx], base[idx]).statistic
        held = [i for i in idx if i in test_set]
        t2.add_row(f"h={h} L={L}", str(len(idx)), f"{e[idx].mean():.2f}",
                   f"{e[held].mean():.2f}" if held else "-", f"{rho:.4f}", f"{rho_b:.4f}")
    console.print(t2)
    worst = np.argsort(-e)[:10]
    t3 = Table(title="worst rows")
    for c in ("row", "gpus", "gb", "mb", "h", "L", "tp", "dp", "pp", "measured ms", "plait ms", "APE %"):
        t3.add_column(c, justify="right")
    for i in worst:
        r = rows[i]
        t3.add_row(str(r["index"]), str(r["gpus"]), str(r["global_batch"]), str(r["micro_batch"]),
                   str(r["hidden"]), str(r["layers"]), str(r["tp"]), str(r["dp"]), str(r["pp"]),
                   f"{y[i] * 1e3:.1f}", f"{pred[i] * 1e3:.1f}", f"{e[i]:.1f}")
    console.print(t3)
    return out


def pp1_cells(rows: list[dict]) -> dict[tuple, list[int]]:
    """Row indices of the pp = 1 rows per (hidden, tp, micro-batch) cell."""
    cells: dict[tuple, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        if r["pp"] == 1:
            cells[(r["hidden"], r["tp"], r["micro_batch"])].append(i)
    return cells


def cell_design(rows: list[dict], idx: list[int]) -> np.ndarray | None:
    """Design matrix of one cell's rows, columns ``g, g L`` then one intercept and one L-slope per dp
    (gradient all-reduce and optimizer depend on it); None when the cell cannot identify them."""
    mb = rows[idx[0]]["micro_batch"]
    g = np.array([rows[i]["global_batch"] // (rows[i]["dp"] * mb) for i in idx], dtype=float)
    L = np.array([rows[i]["layers"] for i in idx], dtype=float)
    dp = np.array([rows[i]["dp"] for i in idx])
    cols = [g, g * L] + [(dp == d).astype(float) for d in sorted(set(dp))] \
        + [(dp == d) * L for d in sorted(set(dp))]
    X = np.stack(cols, 1)
    if np.linalg.matrix_rank(X) < X.shape[1] or len(idx) <= X.shape[1]:
        return None
    return X


def cell_table(console: Console, rows: list[dict], pred: np.ndarray) -> None:
    """Per (hidden, tp, micro-batch) cell: per-layer and per-micro-batch time, measured vs predicted.

    On the pp = 1 rows of one (h, tp, mb, dp) the data is exactly ``c0 + c1 g + c2 g L + c3 L``
    (g micro-batches per replica, L layers), so least squares recovers the time of one layer
    for one micro-batch (forward + backward, TP collectives included, ``c2``) and of the rest of
    a micro-batch (embedding, LM head, loss, batch fetch, ``c1``) from the measurements and, the
    same way, from the predictions. This is where the simulator's error sits, cell by cell."""
    cells = pp1_cells(rows)
    t = Table(title="per cell (pp = 1 rows): ms per layer per micro-batch and per micro-batch outside the layers")
    for c in ("hidden", "tp", "mb", "rows", "layer measured", "layer plait", "ratio", "rest measured",
              "rest plait", "ratio", "fit residual %"):
        t.add_column(c, justify="right")
    for (h, tp, mb), idx in sorted(cells.items()):
        X = cell_design(rows, idx)
        if X is None:
            continue
        y = np.array([rows[i]["measured_s"] for i in idx])
        cy, cp = np.linalg.lstsq(X, y, rcond=None)[0], np.linalg.lstsq(X, pred[idx], rcond=None)[0]
        resid = float(np.abs(X @ cy / y - 1).max() * 100)
        t.add_row(str(h), str(tp), str(mb), str(len(idx)), f"{cy[1] * 1e3:.2f}", f"{cp[1] * 1e3:.2f}",
                  f"{cp[1] / cy[1]:.3f}", f"{cy[0] * 1e3:.2f}", f"{cp[0] * 1e3:.2f}", f"{cp[0] / cy[0]:.3f}",
                  f"{resid:.3f}")
    console.print(t)


def monotone_floor(rows: list[dict]) -> tuple[float, dict[tuple, tuple[float, float, float, float]]]:
    """The lowest MAPE on the pp = 1 rows that *any* model can reach whose time per layer and per
    micro-batch (``c2``) and time per micro-batch outside the layers (``c1``) do not decrease
    when the micro-batch or the hidden size grows at the same tp (more work, the same kernels),
    even if it predicted everything else in every row exactly.

    Each row's prediction is its measured time with the cell's measured ``c1, c2`` (`cell_table`)
    replaced by the model's ``u, v``: ``y + g (u - c1) + g L (v - c2)``. A linear programme picks
    the monotone ``u, v`` minimising the mean absolute percentage error. Returns the floor (%)
    and, per cell, (measured c2, monotone v, measured c1, monotone u) in seconds."""
    from scipy.optimize import linprog

    coef: dict[tuple, np.ndarray] = {}
    for key, idx in pp1_cells(rows).items():
        X = cell_design(rows, idx)
        if X is not None:
            coef[key] = np.linalg.lstsq(X, np.array([rows[i]["measured_s"] for i in idx]), rcond=None)[0]
    keys = sorted(coef)
    col = {k: j for j, k in enumerate(keys)}
    cells = pp1_cells(rows)
    rws = [(k, i) for k in keys for i in cells[k]]
    nk, nr = len(keys), len(rws)
    n = 2 * nk + nr  # v (layer), u (rest) per cell, then one |error| bound per row
    A, b = [], []
    for j, (k, i) in enumerate(rws):
        r = rows[i]
        g = r["global_batch"] // (r["dp"] * r["micro_batch"]) / r["measured_s"]
        c1, c2 = coef[k][0], coef[k][1]
        for sign in (1.0, -1.0):  # t_j >= +-(g L (v - c2) + g (u - c1)) / y
            a = np.zeros(n)
            a[col[k]], a[nk + col[k]], a[2 * nk + j] = sign * g * r["layers"], sign * g, -1.0
            A.append(a)
            b.append(sign * (g * r["layers"] * c2 + g * c1))
    for (h, tp, mb) in keys:
        for bigger in ((h, tp, 2 * mb), (2 * h, tp, mb)):
            if bigger in col:
                for off in (0, nk):  # v and u: the smaller cell's at most the bigger's
                    a = np.zeros(n)
                    a[off + col[(h, tp, mb)]], a[off + col[bigger]] = 1.0, -1.0
                    A.append(a)
                    b.append(0.0)
    cost = np.r_[np.zeros(2 * nk), np.full(nr, 100.0 / nr)]
    sol = linprog(cost, A_ub=np.array(A), b_ub=np.array(b), bounds=[(0, None)] * n, method="highs")
    if not sol.success:
        raise RuntimeError(f"monotone floor: linear programme failed: {sol.message}")
    out = {k: (coef[k][1], sol.x[col[k]], coef[k][0], sol.x[nk + col[k]]) for k in keys}
    return float(sol.fun), out


def recompute_floor(h: int, tp: int, mb: int) -> tuple[float, float]:
    """GPU time of one layer for one micro-batch at the physical ceilings, (no recompute, full
    recompute): every GEMM at the A100's best achievable matmul rate (0.859 of peak) with no wave
    quantisation, every streaming kernel at 0.9 of HBM, no per-kernel time, no host time and no
    collectives. A measured layer faster than the second cannot hold a full recompute."""
    best = DEFAULT_MODEL.replace(gemm_efficiency=BOUNDS["gemm_efficiency"][1],
                                 memory_efficiency=BOUNDS["memory_efficiency"][1], kernel_gpu_s=0.0,
                                 host_fwd_s=0.0, host_bwd_s=0.0, host_comm_s=0.0, tile=1)
    shape = TransformerShape(hidden=h, heads=16, seq=1024, ffn=4 * h, kv_heads=16, head_dim=h // 16)
    c = transformer_layer_cost(shape, mb, KIND, "fp16", tp=tp, model=best)
    none = c.fwd.gpu_s + c.bwd.gpu_s
    return none, none + c.recompute_full.gpu_s


def pp_invariance(rows: list[dict]) -> dict[tuple, dict[int, tuple[float, float, float]]]:
    """Per (hidden, tp, micro-batch) and pipeline depth: the measured time of one layer for one
    micro-batch, the time per 1F1B slot outside the layers, and the worst relative residual.

    The rows of one (h, tp, mb, pp) are fitted by ``(g + pp - 1) (c1 + c2 L / pp) + c0(dp) + c3(dp) L``
    (1F1B: ``g + pp - 1`` slots of one stage's forward and backward; gradient all-reduce and
    optimizer per dp), the form a pipeline of equal stages takes. Returns {cell: {pp: (c2, c1,
    max |residual|)}} in seconds; cells whose rows cannot identify the four terms are left out."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        groups[(r["hidden"], r["tp"], r["micro_batch"], r["pp"])].append(i)
    out: dict[tuple, dict[int, tuple[float, float, float]]] = defaultdict(dict)
    for (h, tp, mb, pp), idx in groups.items():
        slots = np.array([rows[i]["global_batch"] // (rows[i]["dp"] * mb) + pp - 1 for i in idx], dtype=float)
        L = np.array([rows[i]["layers"] for i in idx], dtype=float)
        dp = np.array([rows[i]["dp"] for i in idx])
        ds = sorted(set(dp))
        X = np.stack([slots, slots * L / pp] + [(dp == d).astype(float) for d in ds] + [(dp == d) * L for d in ds], 1)
        if np.linalg.matrix_rank(X) < X.shape[1] or len(idx) <= X.shape[1]:
            continue
        y = np.array([rows[i]["measured_s"] for i in idx])
        c = np.linalg.lstsq(X, y, rcond=None)[0]
        out[(h, tp, mb)][pp] = (float(c[1]), float(c[0]), float(np.abs(X @ c / y - 1).max()))
    return dict(out)


def pp_table(console: Console, rows: list[dict]) -> float:
    """``--floor``: the measured layer time per pipeline depth (`pp_invariance`); returns the
    largest relative difference of a cell's layer time at pp = 2 or 4 from its pp = 1 value."""
    inv = pp_invariance(rows)
    t = Table(title="per cell: measured ms per layer per micro-batch at each pipeline depth (1F1B fit, "
                    "`pp_invariance`) -- the same layer time with and without a pipeline")
    for c in ("hidden", "tp", "mb", "layer pp=1", "pp=2", "pp=4", "slot rest pp=1", "pp=2", "pp=4", "max resid %"):
        t.add_column(c, justify="right")
    worst = 0.0
    for (h, tp, mb), by_pp in sorted(inv.items()):
        if 1 not in by_pp or len(by_pp) < 2:
            continue
        worst = max([worst] + [abs(v[0] / by_pp[1][0] - 1) for v in by_pp.values()])
        layer = [f"{by_pp[p][0] * 1e3:.3f}" if p in by_pp else "-" for p in (1, 2, 4)]
        rest = [f"{by_pp[p][1] * 1e3:.3f}" if p in by_pp else "-" for p in (1, 2, 4)]
        t.add_row(str(h), str(tp), str(mb), *layer, *rest, f"{max(v[2] for v in by_pp.values()) * 100:.2f}")
    console.print(t)
    console.print(f"largest difference of a layer time at pp > 1 from pp = 1: {worst * 100:.2f} %")
    return worst


def floor_tables(console: Console, rows: list[dict]) -> dict:
    """``--floor``: what bounds the error of any physical model on this data (see the docstring)."""
    floor, cells = monotone_floor(rows)
    t = Table(title=f"per cell (pp = 1): measured vs the closest monotone values; floor MAPE {floor:.2f} % "
                    f"on these rows for any model monotone in micro-batch and hidden size")
    for c in ("hidden", "tp", "mb", "layer measured", "layer monotone", "rest measured", "rest monotone",
              "layer GPU floor: none", "full recompute", "measured < full floor"):
        t.add_column(c, justify="right")
    below = 0
    for (h, tp, mb), (c2, v, c1, u) in sorted(cells.items()):
        none, full = recompute_floor(h, tp, mb)
        below += c2 < full
        t.add_row(str(h), str(tp), str(mb), f"{c2 * 1e3:.2f}", f"{v * 1e3:.2f}", f"{c1 * 1e3:.2f}",
                  f"{u * 1e3:.2f}", f"{none * 1e3:.2f}", f"{full * 1e3:.2f}", "yes" if c2 < full else "")
    console.print(t)
    worst = pp_table(console, rows)
    return {"monotone_floor_mape_pp1": floor, "cells_below_full_recompute_floor": int(below),
            "layer_time_pp_vs_pp1_max_rel_diff": worst}


def main(argv: list[str] | None = None) -> int:
    global INTRA_BW
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", action="store_true", help="fit the physical parameters on the even rows first")
    ap.add_argument("--recompute", choices=("none", "full", "selective"), default=RECOMPUTE,
                    help="activation recompute of the simulated plans (default: full, as the data was measured)")
    ap.add_argument("--rows", type=int, default=0, help="use only the first N rows (quick look)")
    ap.add_argument("--max-nfev", type=int, default=60)
    ap.add_argument("--f-scale", type=float, default=0.005,
                    help="soft-L1 scale of the fit on log(predicted / measured): residuals above it count about "
                         "linearly (default 0.005, the shipped fit: about the mean absolute log error; "
                         "0.03 before calib5)")
    ap.add_argument("--bandwidth", type=float, default=None,
                    help=f"intra-node bandwidth in bytes/s (default: the fitted {INTRA_BW:.4g})")
    ap.add_argument("--fit-bandwidth", action="store_true",
                    help="also fit the achieved NVLink bandwidth (the README's 150 GB/s otherwise)")
    ap.add_argument("--nccl-tests", metavar="YAML", default=str(NCCL_TESTS),
                    help="the node's measured nccl-tests all-reduce busbw tables that time every all-reduce "
                         "(default: bench/data/vtrain_a100_allreduce.yaml, measured on the data's own machine)")
    ap.add_argument("--alpha-beta", action="store_true",
                    help="time all-reduces with the fitted (latency, bandwidth) ring instead of the nccl-tests tables")
    ap.add_argument("--odd-penalty", type=float, default=None, metavar="P",
                    help="price GEMMs with an odd fp16 dimension (2-byte aligned, no cp.async) at P instead of the "
                         "unaligned penalty of 4- and 8-byte aligned ones (`plait.cost.compute.alignment_penalty`); "
                         "with --fit, P is the start value and is fitted")
    ap.add_argument("--json", action="store_true",
                    help="print the headline figures, parameters and variants as one JSON object on stdout")
    ap.add_argument("--cells", action="store_true",
                    help="also print measured vs predicted time per layer and per micro-batch for each "
                         "(hidden, tp, micro-batch) cell (pp = 1 rows)")
    ap.add_argument("--floor", action="store_true",
                    help="also print what bounds any physical model's error on this data: the lowest MAPE of a "
                         "model monotone in micro-batch and hidden size, and each cell's layer time against a "
                         "layer's GPU floor with and without full recompute")
    args = ap.parse_args(argv)
    console = Console(width=140, stderr=args.json)  # --json: the tables go to stderr, the JSON to stdout
    rows = load_rows()
    if args.rows:
        rows = rows[: args.rows]
    train = [i for i, r in enumerate(rows) if r["index"] % 2 == 0]
    test = [i for i, r in enumerate(rows) if r["index"] % 2 == 1]
    if not args.alpha_beta:
        load_measured(args.nccl_tests)
        console.print(f"all-reduce times from {args.nccl_tests}: {len(MEASURED)} measured tables "
                      f"({', '.join(str(m.ranks) for m in MEASURED)} ranks)")
    ev = Evaluator(rows, args.recompute)
    if args.bandwidth:
        INTRA_BW = args.bandwidth
    model, lat, bw = DEFAULT_MODEL, NVLINK_LATENCY, INTRA_BW
    fields = FIT_FIELDS
    if args.odd_penalty is not None:
        model = model.replace(odd_penalty=args.odd_penalty)
        fields = FIT_FIELDS + ["odd_penalty"]
    if args.fit:
        model, lat, bw = fit(ev, train, console, args.max_nfev, args.fit_bandwidth, model, fields, args.f_scale)
    t0 = time.time()
    pred = ev.predict(model, lat, list(range(len(rows))), bw)
    wall = time.time() - t0
    base = baseline(rows, train)
    title = (f"A100 Megatron-DeepSpeed, {len(rows)} rows, recompute={args.recompute}, NVLink {bw / 1e9:.0f} GB/s, "
             f"{'fitted now' if args.fit else 'shipped defaults'} ({wall:.1f} s to simulate all rows)")
    mape = report(console, rows, pred, base, train, test, title)
    if args.cells:
        cell_table(console, rows, pred)
    if args.floor:
        floor_tables(console, rows)
    params = parameter_table(console, model, lat, bw, "fitted now on the even rows" if args.fit else "shipped defaults")
    variants = comparison_table(console, rows, train, test, pred, args.recompute, model, lat, bw)
    if args.json:
        y = np.array([r["measured_s"] for r in rows])
        print(json.dumps({"summary": {"mape_all": mape.get("all"), "mape_fit_half": mape.get("fit half (even)"),
                                      "mape_held_out": mape.get("held-out half (odd)"),
                                      "baseline_mape_all": float(ape(base, y).mean()), "recompute": args.recompute,
                                      "fitted_now": args.fit},
                          "parameters": params, "variants": variants}, indent=1))
    return 0


def parameter_table(console: Console, model: ComputeModel, latency: float, bandwidth: float, source: str) -> dict:
    """The parameters the predictions above used, with their physical bounds."""
    t = Table(title=f"parameters ({source})")
    for c in ("parameter", "value", "bound (physical ceiling)"):
        t.add_column(c, justify="right")
    values = {f: getattr(model, f) for f in FIT_FIELDS} | {"latency": latency, "bandwidth": bandwidth}
    if model.odd_penalty is not None:
        values["odd_penalty"] = model.odd_penalty
    for name, v in values.items():
        lo, hi = BOUNDS[name]
        t.add_row(name, f"{v:.4g}", f"{lo:.3g} .. {hi:.3g}")
    console.print(t)
    return {k: float(v) for k, v in values.items()}


def comparison_table(console: Console, rows: list[dict], train: list[int], test: list[int], pred: np.ndarray,
                     recompute: str, model: ComputeModel, latency: float, bandwidth: float) -> list[dict]:
    """The run above next to the previous calibration (recompute none, its own parameters and the
    fractional vocabulary shard) and to the other recompute setting with the same parameters."""
    y = np.array([r["measured_s"] for r in rows])
    every = list(range(len(rows)))
    other = "none" if recompute != "none" else "full"
    ev = Evaluator(rows, recompute)
    runs = [(f"this run: recompute={recompute}", pred),
            ("baseline: calib4's defaults (fused softmax everywhere, 2 cross-entropy all-reduces)",
             ev.predict(CALIB4_FIT, CALIB4_LATENCY, every, INTRA_BW)),
            ("calib4's parameters + Megatron's fused-softmax availability rule (not refitted)",
             ev.predict(CALIB4_FIT.replace(softmax_fallback=True), CALIB4_LATENCY, every, INTRA_BW)),
            ("calib4's parameters + softmax rule + the target-logit all-reduce (not refitted)",
             ev.predict(CALIB4_FIT.replace(softmax_fallback=True, ce_target_allreduce=True), CALIB4_LATENCY,
                        every, INTRA_BW)),
            ("calib5 refit with soft-L1 scale 0.03 (--f-scale 0.03), its own parameters",
             ev.predict(CALIB5_FSCALE03_FIT, CALIB5_FSCALE03_LATENCY, every, INTRA_BW)),
            ("calib5 refit with odd fp16 dimensions priced apart (--odd-penalty), its own parameters",
             ev.predict(CALIB5_ODD_FIT, CALIB5_ODD_LATENCY, every, INTRA_BW)),
            ("this run's parameters, softmax always fused", ev.predict(model.replace(softmax_fallback=False),
                                                                      latency, every, bandwidth)),
            ("this run's parameters, 2 cross-entropy all-reduces",
             ev.predict(model.replace(ce_target_allreduce=False), latency, every, bandwidth)),
            (f"recompute={other}, same parameters", Evaluator(rows, other).predict(model, latency, every, bandwidth)),
            ("calib3's calibration: recompute=full, alpha-beta ring for every all-reduce, its own parameters",
             Evaluator(rows, "full").predict(CALIB3_FIT, CALIB3_LATENCY, every, INTRA_BW, measured=False)),
            ("previous calibration: recompute=none, 50257/tp vocab shard, its own parameters",
             Evaluator(rows, "none", floor_vocab=False).predict(PREVIOUS_NONE_FIT, PREVIOUS_LATENCY, every,
                                                                PREVIOUS_BANDWIDTH, measured=False))]
    t = Table(title="variants and earlier calibrations, all simulated in this run (MAPE %)")
    for c in ("prediction", "all", "fit half (even)", "held-out half (odd)"):
        t.add_column(c, justify="right")
    out = []
    for name, p in runs:
        e = ape(p, y)
        t.add_row(name, f"{e.mean():.2f}", f"{e[train].mean():.2f}", f"{e[test].mean():.2f}")
        out.append({"prediction": name, "all": float(e.mean()), "fit_half": float(e[train].mean()),
                    "held_out": float(e[test].mean())})
    console.print(t)
    return out


if __name__ == "__main__":
    sys.exit(main())
