"""One constant set per GPU kind and engine, fitted on many public sources at once (issue 37, item 3).

The shipped analytic model (`plait.cost.compute.DEFAULT_MODEL`) was fitted on one A100 Megatron set.
This fit scales four groups of its constants, each by one factor, shared where the physics is:

- ``compute:<kind>:<unit>`` -- the GEMM main loop's achieved fraction of the kind's peak
  (``gemm_efficiency``) on tensor cores (``tc``: fp16, bf16, tf32) or CUDA cores (``fp32``): a
  property of the GPU kind and unit, whichever engine runs it;
- ``host:<engine>`` -- every host-time constant (per-kernel dispatch forward and backward, per
  collective, per pipeline message, per micro-batch loss and batch, per step): a property of the
  engine (Megatron's fused kernels vs eager PyTorch);
- ``memory:<kind>`` -- the achieved fraction of HBM/GDDR bandwidth of streaming kernels
  (``memory_efficiency``): a property of the kind's memory system;
- ``traffic:<engine>`` -- the bytes an engine's memory-bound ops move beside the fused kernels'
  (at most 1: an eager engine's unfused norms, activations and residuals move more).

So a row of GPU kind K, unit U, run by engine E is priced with (compute:K:U, host:E, memory:K,
traffic:E) --
its `cell` -- and a source left out of the fit still gets the factors the other sources pin down
(its engine's host factor from other kinds, its kind's factors from other engines): the
leave-one-source-out check measures what transfers.

The fit minimises the squared log ratios predicted / measured, each source weighted 1/sqrt(rows) so
one large table does not outvote the others, plus a weak ridge on each log factor (a prior of
sd 30: it keeps the normal equations solvable; a factor no row informs stays 1, any row outweighs
it). The cell the shipped constants were fitted on (`REFERENCE`) keeps its factors at 1. Gauss-Newton:
each iteration simulates the training rows once at the current factors and once per factor group
with that group's factors raised 5 % (every row depends on exactly one factor of each group, so
four perturbed runs give every row's Jacobian),
then takes a damped step within the bounds (a fraction of peak at most 1). The rows' engines map
to an engine family by `engine_family`: "megatron" is the fused family; every other engine named
in the sources (FSDP, DDP, DeepSpeed, Lightning, HF Trainer) is eager PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from plait.cost.compute import DEFAULT_MODEL, ComputeModel

GROUPS = ("compute", "host", "memory", "traffic")
HOST_FIELDS = ("host_fwd_s", "host_bwd_s", "host_comm_s", "p2p_host_s", "loss_host_s", "batch_host_s",
               "step_host_s")
PRIOR_SD = 30.0  # sd of each log factor's prior: a ridge that keeps the normal equations solvable, weak beside any row
STEP = 0.05  # log step of the finite-difference Jacobian
ITERATIONS = 6
LOW = np.log(0.1)


def engine_family(engine: str) -> str:
    """"fused" for Megatron-LM's fused kernels, "eager" for the PyTorch engines."""
    return "fused" if engine.startswith("megatron") else "eager"


def unit(dtype: str) -> str:
    """The GPU unit a dtype's GEMMs run on: tensor cores ("tc": fp16, bf16, tf32) or the CUDA cores
    ("fp32"); their achieved fractions of peak differ (e.g. V100: 125 vs 15.7 TFLOP/s)."""
    return "fp32" if dtype == "fp32" else "tc"


def cell(row: dict) -> tuple[str, str, str]:
    """Rows of one cell share every factor: GPU kind, GEMM unit, engine family."""
    return row["gpu"], unit(row["dtype"]), row["family"]


def group_key(group: str, row: dict) -> str:
    if group == "compute":
        return f"compute:{row['gpu']}:{unit(row['dtype'])}"
    if group == "memory":
        return f"memory:{row['gpu']}"
    if group == "traffic":
        return f"traffic:{row['family']}"
    return f"host:{row['family']}"


def upper(group: str, base: ComputeModel) -> float:
    """Largest log factor of a group: a fraction of peak or of bandwidth stays <= 1."""
    if group == "compute":
        return float(-np.log(base.gemm_efficiency))
    if group == "memory":
        return float(-np.log(base.memory_efficiency))
    if group == "traffic":
        return 0.0  # an engine moves at least the bytes the fused kernels move
    return float(np.log(10.0))


@dataclass
class Fit:
    """Log factors per key (``compute:<kind>:<unit>``, ``memory:<kind>``, ``host:<family>``,
    ``traffic:<family>``); a key absent is a factor of 1 (the shipped constant)."""

    log: dict[str, float] = field(default_factory=dict)
    base: ComputeModel = DEFAULT_MODEL
    objective: float = float("nan")
    simulations: int = 0

    def factor(self, group: str, row: dict) -> float:
        return float(np.exp(self.log.get(group_key(group, row), 0.0)))

    def model(self, row: dict, bump: str | None = None) -> ComputeModel:
        """The constants for `row` (and every row of its `cell`); `bump`: one group raised by STEP."""
        f = {g: self.factor(g, row) * (np.exp(STEP) if g == bump else 1.0) for g in GROUPS}
        b = self.base
        return b.replace(gemm_efficiency=min(1.0, b.gemm_efficiency * f["compute"]),
                         memory_efficiency=min(1.0, b.memory_efficiency * f["memory"]) * f["traffic"],
                         **{h: getattr(b, h) * f["host"] for h in HOST_FIELDS})


# simulate(rows, model) -> predicted seconds; a training set is (simulate, rows) per source.
Simulate = Callable[[list[dict], ComputeModel], np.ndarray]


def predict(fit: Fit, simulate: Simulate, rows: list[dict], bump: str | None = None) -> np.ndarray:
    """Predicted seconds of `rows`, each cell simulated with the fit's constants for it."""
    pred = np.empty(len(rows))
    for c in sorted({cell(r) for r in rows}):
        idx = [i for i, r in enumerate(rows) if cell(r) == c]
        pred[idx] = simulate([rows[i] for i in idx], fit.model(rows[idx[0]], bump))
    return pred


def _predict(fit: Fit, train: list[tuple[Simulate, list[dict]]], bump: str | None = None) -> np.ndarray:
    out = [predict(fit, simulate, rows, bump) for simulate, rows in train]
    return np.concatenate(out) if out else np.empty(0)


# The cell the shipped constants were fitted on (bench/validate_a100.py: Megatron on A100 80GB, fp16):
# its factors stay 1, so every other factor is relative to that fit and the dev set keeps its figure.
REFERENCE = dict(gpu="a100-80gb", dtype="fp16", family="fused")


def fit_factors(train: list[tuple[Simulate, list[dict]]], base: ComputeModel = DEFAULT_MODEL,
                pinned: dict | None = REFERENCE) -> Fit:
    """Fit the factors on `train` (rows carry ``gpu``, ``dtype``, ``family`` and ``measured_s``);
    the factors of the `pinned` row's cell stay 1 (None: every factor is fitted)."""
    train = [(s, rows) for s, rows in train if rows]
    rows = [r for _, rs in train for r in rs]
    fit = Fit(base=base)
    if not rows:
        return fit
    fixed = {group_key(g, pinned) for g in GROUPS} if pinned else set()
    keys = sorted({group_key(g, r) for r in rows for g in GROUPS} - fixed)
    col = {k: j for j, k in enumerate(keys)}
    hi = np.array([upper(k.split(":")[0], base) for k in keys])
    y = np.log([r["measured_s"] for r in rows])
    w = np.concatenate([np.full(len(rs), 1 / np.sqrt(len(rs))) for _, rs in train])
    theta = np.zeros(len(keys))

    def objective(res: np.ndarray, th: np.ndarray) -> float:
        return float(np.sum((w * res) ** 2) + np.sum((th / PRIOR_SD) ** 2))

    def at(th: np.ndarray) -> Fit:
        return Fit(log={k: float(th[col[k]]) for k in keys}, base=base)

    sims = 0
    base_pred = _predict(at(theta), train)
    sims += 1
    res = np.log(base_pred) - y
    best = objective(res, theta)
    damping = 1e-3
    for _ in range(ITERATIONS):
        cur = at(theta)
        jac = np.zeros((len(rows), len(keys)))
        for g in GROUPS:
            bumped = _predict(cur, train, bump=g)
            sims += 1
            d = (np.log(bumped) - y - res) / STEP
            for i, r in enumerate(rows):
                if group_key(g, r) in col:
                    jac[i, col[group_key(g, r)]] = d[i]
        jw = jac * w[:, None]
        lhs = jw.T @ jw + np.eye(len(keys)) / PRIOR_SD**2
        rhs = -(jw.T @ (w * res) + theta / PRIOR_SD**2)
        improved = False
        for _ in range(4):  # Levenberg damping: shrink the step until the objective falls
            step = np.linalg.solve(lhs + damping * np.diag(np.diag(lhs)), rhs)
            trial = np.clip(theta + step, LOW, hi)
            trial_res = np.log(_predict(at(trial), train)) - y
            sims += 1
            obj = objective(trial_res, trial)
            if obj < best:
                theta, res, best, improved = trial, trial_res, obj, True
                damping = max(damping / 10, 1e-6)
                break
            damping *= 10
        if not improved:
            break
    out = at(theta)
    out.objective, out.simulations = best, sims
    return out
