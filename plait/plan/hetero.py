"""Mixed GPU kinds in a 3D plan: uneven layers per stage, uneven batch per replica.

A 3D plan on a cluster with several GPU kinds runs each tensor-parallel group at
the pace of its slowest GPU. With Megatron's even split a fast stage waits for a
slow one and a fast replica waits for a slow one at the gradient all-reduce. Two
knobs of the Plan IR fix that:

* `layer_split` -- layers per pipeline stage. Chosen by an exact dynamic program
  that minimises the bottleneck stage time (the 1F1B steady state is paced by the
  slowest stage: ``t_iter ~ (M-1)*max_p t_p + sum_p t_p``), then, among splits with
  that bottleneck, the total (the fill/drain term). Memory enters as a cap on the
  layers of a stage, tightened from the memory estimator's verdict until it fits.
* `dp_shares`   -- share of the global batch per data-parallel replica, in whole
  micro-batches. Replica d finishes M_d micro-batches in ``(M_d-1)*b_d + s_d``
  (b_d its bottleneck stage, s_d the sum of its stage times); giving the next
  micro-batch to the replica that would finish it first is exact for this min-max.

Which GPUs form which stage and replica is the "kind layout": `layouts()` proposes
Megatron's default order, kinds along the pipeline axis and kinds along the data
axis; `plait.plan.placement` then permutes GPUs only among equal kinds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.errors import PlaitError

if TYPE_CHECKING:
    from plait.cluster.spec import Cluster, GPUKind
    from plait.graph.opgraph import Layer, OpGraph
    from plait.plan.ir import Plan

# (layer, kind, plan) -> seconds for one micro-batch's forward + backward (+ recompute)
LayerTimeFn = Callable[["Layer", "GPUKind", "Plan"], float]
# plan -> per-device peak bytes (indexed by device id)
PeakFn = Callable[["Plan"], "list[int] | np.ndarray"]


class HeteroError(PlaitError, ValueError):
    """A heterogeneous split that cannot be made (the message says why)."""


def flops_layer_time(layer: Layer, kind: GPUKind, plan: Plan) -> float:
    """Fallback layer time: FLOPs / peak FLOP/s of the kind (same efficiency on every kind).

    Full recompute runs the forward twice; tensor parallelism divides the work."""
    flops = layer.fwd_flops * (2 if plan.recompute == "full" else 1) + layer.bwd_flops
    div = plan.tp if layer.tp_style != "none" else 1
    return flops * plan.micro_batch / div / kind.flops(plan.dtype)


# ---------------------------------------------------------------- kind layout
def kind_grid(cluster: Cluster, plan: Plan) -> list[list[str]]:
    """Kind of each (stage p, replica d) tensor group: its slowest GPU (by peak FLOP/s)."""
    devices = cluster.devices
    grid = []
    for p in range(plan.pp):
        row = []
        for d in range(plan.dp):
            kinds = [devices[plan.device_of(plan.rank(p, d, t))].kind for t in range(plan.tp)]
            row.append(min(kinds, key=lambda k: k.flops(plan.dtype)).name)
        grid.append(row)
    return grid


def is_mixed(cluster: Cluster) -> bool:
    return len({d.kind.name for d in cluster.devices}) > 1


def layouts(cluster: Cluster, plan: Plan) -> dict[str, list[int]]:
    """Candidate rank-to-device starting orders that keep each tensor group on one kind.

    "default": Megatron's order (identity). On a mixed cluster also "pp": GPUs sorted
    fastest kind first along the pipeline axis (stages differ in kind, replicas equal),
    and "dp": the same along the data axis (replicas differ, stages equal). Orders that
    put two kinds in one tensor group, or that repeat another layout, are dropped."""
    n = plan.world_size
    out: dict[str, list[int]] = {"default": list(range(n))}
    if not is_mixed(cluster):
        return out
    devices = cluster.devices[:n]
    by_speed = [d.id for d in sorted(devices, key=lambda d: (-d.kind.flops(plan.dtype), d.kind.name, d.node, d.local))]
    ranks_pp = [plan.rank(p, d, t) for p in range(plan.pp) for d in range(plan.dp) for t in range(plan.tp)]
    ranks_dp = [plan.rank(p, d, t) for d in range(plan.dp) for p in range(plan.pp) for t in range(plan.tp)]
    for name, ranks in (("pp", ranks_pp), ("dp", ranks_dp)):
        order = [0] * n
        for r, dev in zip(ranks, by_speed):
            order[r] = dev
        if order not in out.values():
            out[name] = order
    kinds = [d.kind.name for d in cluster.devices]
    return {name: order for name, order in out.items()
            if all(len({kinds[order[plan.rank(p, d, t)]] for t in range(plan.tp)}) == 1
                   for p in range(plan.pp) for d in range(plan.dp))}


# ---------------------------------------------------------------- exact splits
def split_layers(times: np.ndarray, caps: list[int] | None = None) -> list[int] | None:
    """Layers per stage minimising the bottleneck stage time, then the sum (exact DP).

    `times[p, i]` is the time of layer i if it runs on stage p (stages may differ in kind).
    `caps[p]` bounds the layers of stage p (memory). Returns None when no split obeys the
    caps. Phase 1: f[p][j] = min_i max(f[p-1][i], T_p(i, j)) gives the optimal bottleneck
    B*; phase 2: g[p][j] = min_i g[p-1][i] + T_p(i, j) over stages with T_p <= B*."""
    times = np.asarray(times, dtype=float)
    pp, n = times.shape
    caps = [n] * pp if caps is None else [min(n, max(0, int(c))) for c in caps]
    if pp > n or sum(caps) < n or min(caps) < 1:
        return None
    prefix = np.concatenate([np.zeros((pp, 1)), np.cumsum(times, axis=1)], axis=1)  # (pp, n+1)
    idx = np.arange(n + 1)
    span = idx[None, :] - idx[:, None]  # span[i, j] = j - i layers in a stage [i, j)

    def stage_cost(p: int) -> np.ndarray:
        cost = prefix[p][None, :] - prefix[p][:, None]  # cost[i, j] of layers [i, j)
        return np.where((span >= 1) & (span <= caps[p]), cost, np.inf)

    costs = [stage_cost(p) for p in range(pp)]
    inf = np.full(n + 1, np.inf)
    f = inf.copy()
    f[0] = 0.0
    for p in range(pp):
        f = np.min(np.maximum(f[:, None], costs[p]), axis=0)
    bottleneck = f[n]
    if not np.isfinite(bottleneck):
        return None
    tol = bottleneck * 1e-12
    g = inf.copy()
    g[0] = 0.0
    choice = np.zeros((pp, n + 1), dtype=int)
    for p in range(pp):
        c = np.where(costs[p] <= bottleneck + tol, costs[p], np.inf)
        total = g[:, None] + c
        choice[p] = np.argmin(total, axis=0)
        g = total[choice[p], idx]
    split, j = [], n
    for p in range(pp - 1, -1, -1):
        i = int(choice[p][j])
        split.append(j - i)
        j = i
    return split[::-1]


def split_micro_batches(bottleneck: list[float], total: list[float], micro_batches: int) -> list[int]:
    """Micro-batches per replica minimising max_d (M_d - 1)*b_d + s_d, every M_d >= 1.

    Greedy: each next micro-batch goes to the replica that would finish it earliest;
    exact because every replica's finish time grows linearly in its own M_d."""
    dp = len(bottleneck)
    if micro_batches < dp:
        raise HeteroError(f"{micro_batches} micro-batches cannot give each of {dp} replicas one")
    counts = [1] * dp
    for _ in range(micro_batches - dp):
        d = min(range(dp), key=lambda d: (counts[d] * bottleneck[d] + total[d], d))
        counts[d] += 1
    return counts


@dataclass
class HeteroResult:
    plan: Plan  # the balanced plan (layer_split / dp_shares set where kinds differ)
    stage_times: list[list[float]]  # (pp, dp) seconds per micro-batch per tensor group
    micro_batches: list[int]  # per replica
    predicted: float  # (M_d-1)*b_d + s_d of the slowest replica (compute only)
    even_predicted: float  # the same for Megatron's even split
    memory_rounds: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"layer_split": self.plan.layer_split, "dp_shares": self.plan.dp_shares,
                "micro_batches": self.micro_batches, "stage_times_s": self.stage_times,
                "predicted_compute_s": self.predicted, "even_predicted_compute_s": self.even_predicted,
                "memory_rounds": self.memory_rounds}


def _pipeline_time(times: np.ndarray, counts: list[int], split: list[int]) -> tuple[np.ndarray, float, list[float], list[float]]:
    """Stage times (pp, dp) for a split, and the compute-only iteration estimate."""
    bounds = np.concatenate([[0], np.cumsum(split)])
    st = np.stack([times[p, :, bounds[p]:bounds[p + 1]].sum(axis=-1) for p in range(len(split))])
    b = st.max(axis=0).tolist()
    s = st.sum(axis=0).tolist()
    pred = max((m - 1) * bd + sd for m, bd, sd in zip(counts, b, s))
    return st, pred, b, s


def balance(graph: OpGraph, plan: Plan, cluster: Cluster, *, layer_time: LayerTimeFn | None = None,
            peak_bytes: PeakFn | None = None, max_rounds: int | None = None) -> HeteroResult | None:
    """Uneven layers per stage and batch per replica for the kinds `plan` places its ranks on.

    Leaves a single-kind plan as it is (Megatron's even split). `peak_bytes(plan)` (the
    memory estimator) is consulted after each split: a stage whose GPUs overflow gets
    one layer fewer allowed, and the split is solved again. Returns None when no split
    fits in memory."""
    layer_time = layer_time or flops_layer_time
    devices = cluster.devices
    grid = kind_grid(cluster, plan)
    kinds = {d.kind.name: d.kind for d in devices}
    layers = graph.layers
    n_layers = len(layers)
    chunks = plan.pp * plan.virtual_stages
    if n_layers < chunks:
        return None
    # times[p, d, i]: layer i on the kind of tensor group (p, d)
    per_kind = {k: np.asarray([layer_time(layer, kinds[k], plan) for layer in layers]) for k in {x for row in grid for x in row}}
    times = np.stack([np.stack([per_kind[grid[p][d]] for d in range(plan.dp)]) for p in range(plan.pp)])
    # kinds differ along the pipeline (some replica's stages differ) / along the replicas
    mixed_pp = any(grid[p][d] != grid[0][d] for p in range(plan.pp) for d in range(plan.dp))
    mixed_dp = any(len(set(row)) > 1 for row in grid)
    total_mb = plan.global_batch // plan.micro_batch
    even = plan.layers_per_stage(n_layers) if plan.virtual_stages == 1 else None
    even_counts = [plan.num_micro_batches] * plan.dp
    if even is None or not (mixed_pp or mixed_dp):
        # interleaved chunks keep Megatron's split; one kind needs no balancing
        if even is None and (mixed_pp or mixed_dp):
            return None
        st, pred, _, _ = _pipeline_time(times, even_counts, even) if even else (np.zeros((plan.pp, plan.dp)), 0.0, [], [])
        return HeteroResult(plan=plan, stage_times=st.tolist(), micro_batches=even_counts,
                            predicted=pred, even_predicted=pred)
    _, even_pred, _, _ = _pipeline_time(times, even_counts, even)
    caps = [n_layers] * plan.pp
    rounds = 0
    limit = max_rounds if max_rounds is not None else n_layers * plan.pp
    while True:
        if mixed_pp:
            # a stage's time is its slowest replica's (replicas re-balance by batch below)
            split = split_layers(times.max(axis=1), caps)
            if split is None:
                return None
        else:
            split = even
        _, _, b, s = _pipeline_time(times, [1] * plan.dp, split)
        counts = split_micro_batches(b, s, total_mb) if mixed_dp else even_counts
        new = dataclasses.replace(
            plan,
            layer_split=split if mixed_pp else plan.layer_split,
            dp_shares=[c * plan.micro_batch / plan.global_batch for c in counts] if mixed_dp else plan.dp_shares,
        )
        if peak_bytes is None:
            break
        peaks = np.asarray(peak_bytes(new))
        over_stages = set()
        for p, spec in enumerate(new.stage_specs()):
            if any(peaks[dev] > devices[dev].kind.memory_bytes for dev in spec.devices):
                over_stages.add(p)
        if not over_stages:
            break
        rounds += 1
        if not mixed_pp or rounds > limit:
            return None
        for p in over_stages:
            caps[p] = split[p] - 1
        if min(caps) < 1:
            return None
    st, pred, _, _ = _pipeline_time(times, counts, split)
    return HeteroResult(plan=new, stage_times=st.tolist(), micro_batches=counts, predicted=pred,
                        even_predicted=even_pred, memory_rounds=rounds)
