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
axis; `plait.planners.placement` then permutes GPUs only among equal kinds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.errors import PlaitError
from plait.ir.stage_graph import micro_batch_count

if TYPE_CHECKING:
    from plait.cluster.spec import Cluster, GPUKind
    from plait.cost.compute import ComputeModel
    from plait.ir.opgraph import Layer, OpGraph
    from plait.ir.plan import Plan

# (layer, kind, plan) -> seconds for one micro-batch's forward + backward (+ recompute)
LayerTimeFn = Callable[["Layer", "GPUKind", "Plan"], float]
# plan -> per-device peak bytes (indexed by device id)
PeakFn = Callable[["Plan"], "list[int] | np.ndarray"]


class HeteroError(PlaitError, ValueError):
    """A heterogeneous split that cannot be made (the message says why)."""


def cost_layer_time(graph: OpGraph, model: ComputeModel | None = None) -> LayerTimeFn:
    """Layer time from plait's compute model (`plait.cost.compute.layer_cost`; `model`: its
    parameters and profile, default the A100-fitted one): forward + backward + recompute kernels
    of one micro-batch on one tensor rank of `kind`."""
    from plait.cost.compute import DEFAULT_MODEL, layer_cost

    model = DEFAULT_MODEL if model is None else model

    def time(layer: Layer, kind: GPUKind, plan: Plan) -> float:
        c = layer_cost(layer, graph, plan.micro_batch, kind, plan.dtype, tp=plan.tp,
                       sequence_parallel=plan.sequence_parallel, model=model)
        return c.fwd.compute_s + c.bwd.compute_s + c.recompute(plan.recompute).compute_s

    return time


# ---------------------------------------------------------------- kind layout
_DEVICE_FACTS: dict[tuple[int, str], tuple[list, list[str], np.ndarray]] = {}


def _facts(devices: list, dtype: str) -> tuple[list[str], np.ndarray]:
    """Kind names and peak FLOP/s per device, memoised per device list (the search asks often)."""
    key = (id(devices), dtype)
    hit = _DEVICE_FACTS.get(key)
    if hit is None or hit[0] is not devices:
        hit = (devices, [d.kind.name for d in devices], np.asarray([d.kind.flops(dtype) for d in devices]))
        if len(_DEVICE_FACTS) > 64:
            _DEVICE_FACTS.clear()
        _DEVICE_FACTS[key] = hit
    return hit[1], hit[2]


_DEVICE_KINDS: dict[int, tuple[list, dict[str, Any], np.ndarray]] = {}


def _kinds_and_capacity(devices: list) -> tuple[dict[str, Any], np.ndarray]:
    """{kind name: kind} and memory bytes per device, memoised per device list like `_facts`."""
    hit = _DEVICE_KINDS.get(id(devices))
    if hit is None or hit[0] is not devices:
        hit = (devices, {d.kind.name: d.kind for d in devices}, np.asarray([d.kind.memory_bytes for d in devices]))
        if len(_DEVICE_KINDS) > 64:
            _DEVICE_KINDS.clear()
        _DEVICE_KINDS[id(devices)] = hit
    return hit[1], hit[2]


def rank_order(plan: Plan) -> np.ndarray:
    """Device id of every rank (the identity without a placement)."""
    if plan.device_order is not None:
        return np.asarray(plan.device_order)
    return np.arange(plan.world_size)


def kind_grid(cluster: Cluster, plan: Plan, devices: list | None = None) -> list[list[str]]:
    """Kind of each (stage p, replica d) tensor group: its slowest GPU (by peak FLOP/s)."""
    devices = devices if devices is not None else cluster.devices
    names, speed = _facts(devices, plan.dtype)
    if len(set(names)) == 1:
        return [[names[0]] * plan.dp for _ in range(plan.pp)]
    order = rank_order(plan).reshape(plan.pp, plan.dp, plan.tp)
    slowest = np.take_along_axis(order, speed[order].argmin(axis=-1)[..., None], axis=-1)[..., 0]
    return [[names[dev] for dev in row] for row in slowest.tolist()]


_KIND_INDEX: dict[int, tuple[list, list[str], np.ndarray]] = {}


def kind_index_grid(cluster: Cluster, plan: Plan, devices: list | None = None) -> tuple[list[str], np.ndarray]:
    """`kind_grid` as (sorted kind names, (pp, dp) array of indices into them): the same slowest
    GPU of each tensor group, without a Python list of names per group."""
    devices = devices if devices is not None else cluster.devices
    names, speed = _facts(devices, plan.dtype)
    hit = _KIND_INDEX.get(id(devices))
    if hit is None or hit[0] is not devices:
        kinds = sorted(set(names))
        hit = (devices, kinds, np.asarray([kinds.index(k) for k in names], dtype=np.int64))
        if len(_KIND_INDEX) > 64:
            _KIND_INDEX.clear()
        _KIND_INDEX[id(devices)] = hit
    kinds, index_of = hit[1], hit[2]
    if len(kinds) == 1:
        return kinds, np.zeros((plan.pp, plan.dp), dtype=np.int64)
    order = rank_order(plan).reshape(plan.pp, plan.dp, plan.tp)
    slowest = np.take_along_axis(order, speed[order].argmin(axis=-1)[..., None], axis=-1)[..., 0]
    return kinds, index_of[slowest]


def is_mixed(cluster: Cluster) -> bool:
    return len({d.kind.name for d in cluster.devices}) > 1


def layouts(cluster: Cluster, plan: Plan, devices: list | None = None) -> dict[str, list[int]]:
    """Candidate rank-to-device starting orders that keep each tensor group on one kind.

    "default": Megatron's order (identity). On a mixed cluster also "pp": GPUs sorted
    fastest kind first along the pipeline axis (stages differ in kind, replicas equal),
    and "dp": the same along the data axis (replicas differ, stages equal). Orders that
    put two kinds in one tensor group, or that repeat another layout, are dropped."""
    n = plan.world_size
    out: dict[str, list[int]] = {"default": list(range(n))}
    all_devices = devices if devices is not None else cluster.devices
    if len({d.kind.name for d in all_devices}) == 1:
        return out
    devices = all_devices[:n]
    by_speed = [d.id for d in sorted(devices, key=lambda d: (-d.kind.flops(plan.dtype), d.kind.name, d.node, d.local))]
    ranks_pp = [plan.rank(p, d, t) for p in range(plan.pp) for d in range(plan.dp) for t in range(plan.tp)]
    ranks_dp = [plan.rank(p, d, t) for d in range(plan.dp) for p in range(plan.pp) for t in range(plan.tp)]
    for name, ranks in (("pp", ranks_pp), ("dp", ranks_dp)):
        order = [0] * n
        for r, dev in zip(ranks, by_speed):
            order[r] = dev
        if order not in out.values():
            out[name] = order
    kinds = [d.kind.name for d in all_devices]
    return {name: order for name, order in out.items()
            if all(len({kinds[order[plan.rank(p, d, t)]] for t in range(plan.tp)}) == 1
                   for p in range(plan.pp) for d in range(plan.dp))}


# ---------------------------------------------------------------- exact splits
_SPLITS: dict[tuple, list[int] | None] = {}


def split_layers(times: np.ndarray, caps: list[int] | None = None) -> list[int] | None:
    """`_split_layers`, remembered by its inputs (plans that differ only in what the layer
    times do not see -- ZeRO stage, layout twins -- ask the same)."""
    times = np.asarray(times, dtype=float)
    key = (times.shape, times.tobytes(), None if caps is None else tuple(caps))
    if key not in _SPLITS:
        if len(_SPLITS) > 4096:
            _SPLITS.clear()
        _SPLITS[key] = _split_layers(times, caps)
    hit = _SPLITS[key]
    return None if hit is None else list(hit)


def _split_layers(times: np.ndarray, caps: list[int] | None = None) -> list[int] | None:
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

    memo: dict[tuple[bytes, int], np.ndarray] = {}

    def stage_cost(p: int) -> np.ndarray:
        key = (times[p].tobytes(), caps[p])  # stages of one kind share their cost matrix
        if key not in memo:
            cost = prefix[p][None, :] - prefix[p][:, None]  # cost[i, j] of layers [i, j)
            memo[key] = np.where((span >= 1) & (span <= caps[p]), cost, np.inf)
        return memo[key]

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
    allowed: dict[int, np.ndarray] = {}  # stages sharing a cost matrix share its allowed spans
    for p in range(pp):
        c = allowed.get(id(costs[p]))
        if c is None:
            c = allowed[id(costs[p])] = np.where(costs[p] <= bottleneck + tol, costs[p], np.inf)
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

    Replica d's k-th micro-batch finishes at (k-1)*b_d + s_d, an increasing sequence, so
    the optimum takes the M smallest finish times of all replicas (each replica's first
    one is forced). Start from the continuous optimum T* (sum_d ((T*-s_d)/b_d + 1) = M),
    whose floors are all among those M, and hand out the rest from a heap."""
    import heapq

    dp = len(bottleneck)
    if micro_batches < dp:
        raise HeteroError(f"{micro_batches} micro-batches cannot give each of {dp} replicas one")
    b = [max(x, 1e-30) for x in bottleneck]
    inv = sum(1.0 / x for x in b)
    t_star = (micro_batches - sum(1.0 - s_ / x for s_, x in zip(total, b))) / inv
    counts = [max(1, int(np.floor((t_star - s_) / x + 1.0 + 1e-9))) for s_, x in zip(total, b)]
    while sum(counts) > micro_batches:  # float slack: drop the latest finishers
        d = max((i for i in range(dp) if counts[i] > 1), key=lambda i: ((counts[i] - 1) * b[i] + total[i], -i))
        counts[d] -= 1
    heap = [(counts[d] * b[d] + total[d], d) for d in range(dp)]
    heapq.heapify(heap)
    for _ in range(micro_batches - sum(counts)):
        _, d = heapq.heappop(heap)
        counts[d] += 1
        heapq.heappush(heap, (counts[d] * b[d] + total[d], d))
    return counts


@dataclass
class HeteroResult:
    plan: Plan  # the balanced plan (layer_split / dp_shares set where kinds differ)
    stage_times: list[list[float]]  # (pp, dp) seconds per micro-batch per tensor group
    micro_batches: list[int]  # per replica
    predicted: float  # (M_d-1)*b_d + s_d of the slowest replica (compute only)
    even_predicted: float  # the same for Megatron's even split
    memory_rounds: int = 0
    caps: list[int] | None = None  # layer limits per stage the memory check left (warm start)

    def to_dict(self) -> dict[str, Any]:
        return {"layer_split": self.plan.layer_split, "dp_shares": self.plan.dp_shares,
                "micro_batches": self.micro_batches, "stage_times_s": self.stage_times,
                "predicted_compute_s": self.predicted, "even_predicted_compute_s": self.even_predicted,
                "memory_rounds": self.memory_rounds}


def replica_micro_batch_counts(plan: Plan) -> list[int]:
    """Micro-batches each replica runs under the stage graph's rounding rule (`plait.ir.stage_graph`)."""
    return [micro_batch_count(n, plan.micro_batch) for n in plan.samples_per_replica()]


class _KindTimes:
    """The per-layer times of every tensor group (p, d) -- `times[p, d, i]`, layer i on the kind
    of group (p, d) -- held as one row per GPU kind and a (pp, dp) grid of kind indices: a
    1024-GPU plan has thousands of groups but two or three kinds."""

    def __init__(self, per_kind: dict[str, np.ndarray], names: list[str], index: np.ndarray) -> None:
        """`index[p, d]`: position in `names` of group (p, d)'s kind; `per_kind[name]`: its row."""
        self.rows = np.stack([np.asarray(per_kind[k], dtype=float) if k in per_kind else
                              np.zeros(len(next(iter(per_kind.values())))) for k in names])  # (kinds, layers)
        self.index = np.asarray(index, dtype=np.int64)  # (pp, dp)
        self.pp, self.dp = self.index.shape
        self.n_layers = self.rows.shape[1]

    def stage_max(self) -> np.ndarray:
        """(pp, layers): each layer's time on each stage's slowest group, ``times.max(axis=1)``."""
        present = np.zeros((self.pp, len(self.rows)), dtype=bool)  # the kinds each stage holds
        present[np.repeat(np.arange(self.pp), self.dp), self.index.reshape(-1)] = True
        patterns, which = np.unique(present, axis=0, return_inverse=True)  # a few distinct kind sets
        maxima = np.stack([self.rows[pattern].max(axis=0) for pattern in patterns])
        return maxima[which.reshape(-1)]

    def stage_times(self, split: list[int]) -> np.ndarray:
        """(pp, dp) seconds per micro-batch of each group for a split into chunks (chunk c on stage
        c % pp): per chunk, each kind's slice summed once and handed to the groups of that kind --
        the same sums, added in the same chunk order, as summing every group's own row."""
        bounds = np.concatenate([[0], np.cumsum(split)])
        st = np.zeros((self.pp, self.dp))
        for c in range(len(split)):
            p = c % self.pp
            st[p] += self.rows[:, bounds[c]:bounds[c + 1]].sum(axis=-1)[self.index[p]]
        return st


def _pipeline_time(times: _KindTimes, counts: list[int], split: list[int],
                   v: int = 1) -> tuple[np.ndarray, float, list[float], list[float]]:
    """Stage times (pp, dp) for a split into pp*v chunks (chunk c on stage c % pp), and the
    compute-only iteration estimate ``M_d b_d + (s_d - b_d)/v`` of the slowest replica."""
    st = times.stage_times(split)
    b = st.max(axis=0).tolist()
    s = st.sum(axis=0).tolist()
    pred = max(m * bd + (sd - bd) / v for m, bd, sd in zip(counts, b, s))
    return st, pred, b, s


def balance(graph: OpGraph, plan: Plan, cluster: Cluster, *, layer_time: LayerTimeFn | None = None,
            peak_bytes: PeakFn | None = None, caps: list[int] | None = None,
            max_rounds: int | None = None,
            kind_times: Callable[[str, Plan], np.ndarray] | None = None,
            devices: list | None = None) -> HeteroResult | None:
    """Uneven layers per stage and batch per replica for the kinds `plan` places its ranks on.

    Leaves a single-kind plan as it is (Megatron's even split). `peak_bytes(plan)` (the
    memory estimator, per device id) is consulted after each split: an overflowing
    stage p may then hold at most ``floor(n_p * capacity / peak)`` (and fewer than n_p)
    layers -- never below the true limit when memory is an affine, non-negative
    function of the layer count -- and the split is solved again. `caps` warm-starts
    those limits (e.g. from a smaller micro-batch). `kind_times(kind, plan)` may supply
    the per-layer times of a kind at once (cached by the caller). Returns None when
    nothing fits."""
    layer_time = layer_time or cost_layer_time(graph)
    devices = devices if devices is not None else cluster.devices
    names, index = kind_index_grid(cluster, plan, devices)
    kinds, capacity = _kinds_and_capacity(devices)
    layers = graph.layers
    n_layers = len(layers)
    if n_layers < plan.pp * plan.virtual_stages:
        return None
    times = _group_times(layers, plan, names, index, kinds, layer_time, kind_times)
    mixed_pp, mixed_dp = _mixed_axes(times, plan)
    even_counts = replica_micro_batch_counts(plan)
    v = plan.virtual_stages
    even = plan.layers_per_stage(n_layers)
    _, even_pred, _, _ = _pipeline_time(times, even_counts, even, v)
    if not (mixed_pp or mixed_dp):
        st, _, _, _ = _pipeline_time(times, even_counts, even, v)
        return HeteroResult(plan=plan, stage_times=st.tolist(), micro_batches=even_counts,
                            predicted=even_pred, even_predicted=even_pred, caps=list(even))
    fitted = _fit_memory(times, plan, n_layers, even_counts, capacity, peak_bytes, caps, max_rounds,
                         mixed_pp, mixed_dp)
    if fitted is None:
        return None
    new, split, caps, rounds = fitted
    # the split as every room runs it: the stage graph's rounding of the new shares (whole
    # micro-batches per replica, so it gives `counts` back)
    counts = replica_micro_batch_counts(new)
    st, pred, _, _ = _pipeline_time(times, counts, split, v)
    return HeteroResult(plan=new, stage_times=st.tolist(), micro_batches=counts, predicted=pred,
                        even_predicted=even_pred, memory_rounds=rounds, caps=caps)


def _group_times(layers: list[Layer], plan: Plan, names: list[str], index: np.ndarray, kinds: dict[str, Any],
                 layer_time: LayerTimeFn, kind_times: Callable[[str, Plan], np.ndarray] | None) -> _KindTimes:
    """The per-layer times of every tensor group, priced once per GPU kind the plan uses."""
    # times[p, d, i]: layer i on the kind of tensor group (p, d)
    used = {names[i] for i in np.unique(index).tolist()}
    if kind_times is not None:
        per_kind = {k: np.asarray(kind_times(k, plan)) for k in used}
    else:
        per_kind = {k: np.asarray([layer_time(layer, kinds[k], plan) for layer in layers]) for k in used}
    return _KindTimes(per_kind, names, index)


def _mixed_axes(times: _KindTimes, plan: Plan) -> tuple[bool, bool]:
    """(re-balance the layers along the pipeline, re-balance the batch over the replicas)."""
    # kinds differ along the pipeline (some replica's stages differ) / along the replicas
    mixed_pp = bool((times.index != times.index[0]).any())
    mixed_dp = bool((times.index != times.index[:, :1]).any())
    total_mb = plan.global_batch // plan.micro_batch
    v = plan.virtual_stages
    if total_mb // (plan.pp if v > 1 else 1) < plan.dp:
        # fewer whole micro-batches than replicas (a data-parallel degree that does not divide the
        # global batch, e.g. 1024 replicas of 1 or 2 samples at micro-batch 2): nothing to hand out
        # by batch, the replicas keep their even shares (split_micro_batches would refuse, and the
        # refusal ended the whole 3D search: GPT-3 175B on large-mixed:nodes=128 found no plan)
        mixed_dp = False
    if v != 1:
        # interleaved model chunks keep Megatron's even split (a stage's time sums chunks
        # from all over the model, so the chain DP does not apply); replicas still re-balance
        mixed_pp = False
    return mixed_pp, mixed_dp


def _fit_memory(times: _KindTimes, plan: Plan, n_layers: int, even_counts: list[int], capacity: np.ndarray,
                peak_bytes: PeakFn | None, caps: list[int] | None, max_rounds: int | None, mixed_pp: bool,
                mixed_dp: bool) -> tuple[Plan, list[int], list[int], int] | None:
    """Split, check memory and tighten the overflowing stages' layer caps until the plan fits:
    (the balanced plan, its layer split, the caps left, memory rounds), or None if nothing fits."""
    even = plan.layers_per_stage(n_layers)
    caps = [n_layers] * plan.pp if caps is None else list(caps)
    order = rank_order(plan).reshape(plan.pp, -1)
    rounds = 0
    limit = max_rounds if max_rounds is not None else n_layers * plan.pp
    while True:
        if mixed_pp:
            # a stage's time is its slowest replica's (replicas re-balance by batch below)
            split = split_layers(times.stage_max(), caps)
            if split is None:
                return None
        else:
            split = even
        new = _shared_plan(times, plan, split, even, even_counts, mixed_pp, mixed_dp)
        if peak_bytes is None:
            break
        peaks = np.asarray(peak_bytes(new))
        # per stage: the tightest ratio of capacity to peak over its GPUs
        ratio = (capacity[order] / np.maximum(peaks[order], 1)).min(axis=1)
        over = np.flatnonzero(ratio < 1.0)
        if len(over) == 0:
            break
        rounds += 1
        if not mixed_pp or rounds > limit:
            return None
        for p in over.tolist():
            caps[p] = min(split[p] - 1, int(np.floor(split[p] * ratio[p])))
        if min(caps) < 1 or sum(caps) < n_layers:
            return None
    return new, split, caps, rounds


def _shared_plan(times: _KindTimes, plan: Plan, split: list[int], even: list[int], even_counts: list[int],
                 mixed_pp: bool, mixed_dp: bool) -> Plan:
    """`plan` with the layer split `split` and the micro-batches handed out for it."""
    v = plan.virtual_stages
    total_mb = plan.global_batch // plan.micro_batch
    _, _, b, s = _pipeline_time(times, [1] * plan.dp, split, v)
    # replica d finishes M_d micro-batches in M_d b_d + (s_d - b_d)/v; interleaved 1F1B
    # needs M_d to be a multiple of pp, so hand out micro-batches in units of u
    u = plan.pp if v > 1 else 1
    counts = [u * c for c in split_micro_batches(
        [u * b_ for b_ in b], [u * b_ + (s_ - b_) / v for b_, s_ in zip(b, s)], total_mb // u)] \
        if mixed_dp else even_counts
    # an even outcome stays in Megatron's form (no layer_split / dp_shares)
    return dataclasses.replace(
        plan,
        layer_split=split if mixed_pp and split != even else plan.layer_split,
        dp_shares=([c * plan.micro_batch / plan.global_batch for c in counts]
                   if mixed_dp and counts != even_counts else plan.dp_shares),
    )
