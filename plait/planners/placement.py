"""GPU-to-rank placement on uneven links: Pipette's simulated annealing (SYSTEMS.md §2).

A 3D plan numbers its ranks in Megatron order (tensor fastest, then data, then
pipeline), so rank r = (p*dp + d)*tp + t. A placement `order` says which cluster
device runs each rank (`Plan.device_order`); Megatron's default is the identity.

Objective -- Pipette's path-based latency model with the measured (or modelled)
device-to-device bandwidth matrix BW, per iteration:

* tensor parallel: every TP group all-reduces `tp_count` times a message of
  `tp_bytes`; a ring costs ``2(t-1)/t * msg * max_link 1/BW + 2(t-1) * max_link alpha``
  and the slowest group sets the pace;
* pipeline: each pipeline (data-parallel replica d) sends activations forward and
  gradients backward between adjacent stages, ``path_d = sum_p 2*msg/BW[p][p+1]``
  (the slowest tensor rank of each hop counts), paid ``pp_count`` times
  (Pipette: ``gas // pp`` in the 1F1B formula); the slowest pipeline sets the pace;
* data parallel: every DP group (same stage, same tensor rank) all-reduces its
  gradients, ``2(d-1)/d * msg * max_link 1/BW``; the slowest ring sets the pace.

Message sizes come from `plait.cost.traffic` (`traffic_of`); ring and send/recv times are
`plait.cost.collectives`' formulas evaluated at the slowest link, vectorised over orders.

Search space: permutations that keep each rank on the same GPU kind as in the
starting order (the kind layout is chosen by `plait.planners.hetero`; placement only
chooses among GPUs of equal kind). Moves (Pipette): swap, insert, 2-opt (reverse a
segment) and reversed insert (move a reversed segment), applied either to GPUs of
one kind or to whole nodes with the same GPU kinds. Annealing is deterministic for
a given seed and never returns a placement worse than its start.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.cluster.topology import bandwidth_matrix, latency_matrix
from plait.cost.collectives import ring_all_reduce_time, send_recv_time
from plait.errors import PlaitError

if TYPE_CHECKING:
    from plait.cluster.spec import Cluster
    from plait.cost.traffic import IterationTraffic
    from plait.ir.opgraph import OpGraph
    from plait.ir.plan import Plan

MOVES = ("swap", "insert", "2opt", "reversed_insert")


class PlacementError(PlaitError, ValueError):
    """A placement request that cannot be satisfied (the message says which field)."""


@dataclass(frozen=True)
class Traffic:
    """Per-iteration traffic of one 3D plan, in the units of Pipette's path model."""

    tp_bytes: float = 0.0  # bytes of one tensor-parallel all-reduce, per rank
    tp_count: float = 0.0  # tensor-parallel all-reduces per iteration on the critical path
    pp_bytes: float = 0.0  # bytes one rank sends to the next stage per micro-batch
    pp_count: float = 0.0  # weight of the pipeline path (Pipette: gas // pp)
    dp_bytes: float = 0.0  # gradient bytes each rank all-reduces per iteration


def traffic_of(graph: OpGraph, plan: Plan, messages: IterationTraffic | None = None) -> Traffic:
    """The path model's summary of a plan's messages (`plait.cost.traffic`, computed unless given).

    TP: the busiest tensor group's collectives (Megatron: 2 all-reduces forward and 2
    backward per transformer layer and micro-batch), as a count of its largest message.
    PP: the largest message one tensor rank sends over a stage edge, weighted by
    Pipette's ``gas // pp``. DP: the largest gradient reduction of one tensor rank, in
    the plan's gradient dtype."""
    from plait.cost.traffic import iteration_traffic

    tr = messages if messages is not None else iteration_traffic(graph, plan)
    tp_msgs = tr.of_class("tp")
    tp_bytes = float(max((m.nbytes for m in tp_msgs), default=0))
    volume: dict[tuple[int, int], float] = defaultdict(float)
    for m in tp_msgs:
        volume[(m.stage, m.replica)] += m.count * m.nbytes
    pp_bytes = float(max((m.nbytes for m in tr.of_class("pp")), default=0))
    dp_bytes = float(max((m.nbytes for m in tr.of_class("dp")), default=0))
    gas = max((r.count for st in tr.stage_graph.stages for r in st.replicas), default=1)
    return Traffic(
        tp_bytes=tp_bytes,
        tp_count=max(volume.values(), default=0.0) / tp_bytes if plan.tp > 1 and tp_bytes else 0.0,
        pp_bytes=pp_bytes,
        pp_count=float(max(1, gas // plan.pp)) if plan.pp > 1 else 0.0,
        dp_bytes=dp_bytes if plan.dp > 1 else 0.0,
    )


def _max(x: np.ndarray, axis: int | tuple[int, ...]) -> np.ndarray:
    """`x.max(axis)` without its Python wrapper (the same ufunc reduction)."""
    return np.maximum.reduce(x, axis=axis)


def _mean(x: np.ndarray, axis: int | tuple[int, ...]) -> np.ndarray:
    """`x.mean(axis)` without its Python wrapper: NumPy's mean is this sum divided by the count,
    bit for bit (tests/test_plan_placement.py checks it)."""
    axes = (axis,) if isinstance(axis, int) else axis
    return np.add.reduce(x, axis=axis) / math.prod(x.shape[a] for a in axes)


def _pairwise_sum(x: list[float]) -> float:
    """`np.add.reduce` of a contiguous 1-D float64 array, bit for bit: NumPy's pairwise
    summation (`pairwise_sum` in its loops: a plain loop below 8 elements, 8 accumulators up to
    128, halves above), added to the reduction's identity 0.0."""
    n = len(x)
    if n < 8:
        res = 0.0
        for v in x:
            res += v
        return res
    if n <= 128:
        r = x[:8]
        i, stop = 8, n - n % 8
        while i < stop:
            r = [r[j] + x[i + j] for j in range(8)]
            i += 8
        res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
        for v in x[stop:]:
            res += v
        return res
    half = n // 2
    half -= half % 8
    return _pairwise_sum(x[:half]) + _pairwise_sum(x[half:])


def _sequential_sum(x: list[float]) -> float:
    """A sum element by element from the identity 0.0 (how NumPy reduces a non-innermost axis)."""
    res = 0.0
    for v in x:
        res += v
    return res


class _OneOrder:
    """`PathModel._terms_from` of one order in plain Python floats: the same formulas and the
    same reductions in NumPy's order (`_pairwise_sum`; a sum over the hop axis of a (hops,
    replicas) array runs hop by hop, pairwise when there is one replica), so the same seconds to
    the last bit (tests/test_plan_placement.py) at a fraction of the cost of NumPy's calls on
    arrays of a few elements -- what the annealing's walk evaluates thousands of times."""

    def __init__(self, model: PathModel) -> None:
        self.inv, self.lat = model.inv_bw.tolist(), model.lat.tolist()
        rings = model._ring_positions()
        self.tr, self.k = model.traffic, {"tp": model.tp, "dp": model.dp}
        # per ring class: its groups in C order, each a list of (rank, successor rank)
        self.groups = {name: [list(zip(a.tolist(), b.tolist())) for a, b in
                              zip(rings[name][0].reshape(-1, rings[name][0].shape[-1]),
                                  rings[name][1].reshape(-1, rings[name][1].shape[-1]))]
                       for name in ("tp", "dp")}
        a, b = rings["pp"]  # (pp - 1, dp, tp)
        self.hops = [[list(zip(a[h, d].tolist(), b[h, d].tolist())) for d in range(a.shape[1])]
                     for h in range(a.shape[0])]
        self.dp = model.dp
        self.on = {"tp": model.tp > 1 and bool(model.traffic.tp_count),
                   "pp": model.pp > 1 and bool(model.traffic.pp_bytes), "dp": model.dp > 1}

    def _ring(self, o: list[int], name: str, msg: float) -> tuple[float, float]:
        k = self.k[name]
        if k == 1 or msg == 0:
            return 0.0, 0.0
        inv, lat = self.inv, self.lat
        # the data-parallel rings are a transposed view of the rank grid: with tensor ranks, NumPy
        # runs their sum along each ring element by element, else pairwise
        total = _sequential_sum if name == "dp" and self.k["tp"] > 1 else _pairwise_sum
        worst, smooth = [], []
        for links in self.groups[name]:
            il = [inv[o[x]][o[y]] for x, y in links]
            ll = [lat[o[x]][o[y]] for x, y in links]
            worst.append(ring_all_reduce_time(msg, k, 1.0 / max(il), max(ll)))
            smooth.append(ring_all_reduce_time(msg, k, 1.0 / (total(il) / k), total(ll) / k))
        return max(worst), _pairwise_sum(smooth) / len(smooth)

    def _pipeline(self, o: list[int]) -> tuple[float, float]:
        inv, lat, tr = self.inv, self.lat, self.tr
        path = [0.0] * self.dp
        smooth = [0.0] * self.dp
        worst_hops, mean_hops = [], []
        for hop in self.hops:
            w, m = [], []
            for links in hop:
                t = [2.0 * send_recv_time(tr.pp_bytes, 1.0 / inv[o[x]][o[y]], lat[o[x]][o[y]]) for x, y in links]
                w.append(max(t))
                m.append(_pairwise_sum(t) / len(t))
            worst_hops.append(w)
            mean_hops.append(m)
        if self.dp == 1:  # a (hops, 1) array is summed as one contiguous run: pairwise
            path = [_pairwise_sum([w[0] for w in worst_hops])]
            smooth = [_pairwise_sum([m[0] for m in mean_hops])]
        else:  # hop by hop, every replica at once
            for w, m in zip(worst_hops, mean_hops):
                path = [p + x for p, x in zip(path, w)]
                smooth = [s_ + x for s_, x in zip(smooth, m)]
        path = [tr.pp_count * p for p in path]
        smooth = [tr.pp_count * s_ for s_ in smooth]
        return max(path), _pairwise_sum(smooth) / len(smooth)

    def cost_and_mean(self, order: np.ndarray) -> tuple[float, float]:
        o = order.tolist()
        tr = self.tr
        tp = pp = dp = (0.0, 0.0)
        if self.on["tp"]:
            worst, mean = self._ring(o, "tp", tr.tp_bytes)
            tp = (tr.tp_count * worst, tr.tp_count * mean)
        if self.on["pp"]:
            pp = self._pipeline(o)
        if self.on["dp"]:
            dp = self._ring(o, "dp", tr.dp_bytes)
        return tp[0] + pp[0] + dp[0], tp[1] + pp[1] + dp[1]


class PathModel:
    """Pipette's path-based communication latency of a rank-to-device order (module docstring)."""

    def __init__(self, bandwidth: np.ndarray, traffic: Traffic, *, dp: int, tp: int, pp: int,
                 latency: np.ndarray | None = None) -> None:
        bw = np.asarray(bandwidth, dtype=float)
        if bw.ndim != 2 or bw.shape[0] != bw.shape[1]:
            raise PlacementError(f"bandwidth matrix must be square, got shape {bw.shape}")
        self.n = bw.shape[0]
        self.world = dp * tp * pp
        if self.world > self.n:
            raise PlacementError(f"plan needs {self.world} devices but the cluster has {self.n}")
        with np.errstate(divide="ignore"):
            inv = np.where(bw > 0, 1.0 / np.where(bw > 0, bw, 1.0), np.inf)
        np.fill_diagonal(inv, 0.0)
        self.inv_bw = inv
        self.lat = np.zeros_like(inv) if latency is None else np.asarray(latency, dtype=float)
        self.traffic = traffic
        self.dp, self.tp, self.pp = dp, tp, pp

    def with_plan(self, traffic: Traffic, *, dp: int, tp: int, pp: int) -> PathModel:
        """The same links with another plan shape and traffic (no matrix recomputed)."""
        if dp * tp * pp > self.n:
            raise PlacementError(f"plan needs {dp * tp * pp} devices but the cluster has {self.n}")
        other = object.__new__(PathModel)
        other.__dict__.update(self.__dict__)
        other.traffic, other.dp, other.tp, other.pp, other.world = traffic, dp, tp, pp, dp * tp * pp
        other.__dict__.pop("_rings", None)
        other.__dict__.pop("_one", None)
        return other

    # Above this many ranks NumPy's calls cost less than Python's loop over the links (measured:
    # 16 ranks 37 vs 64 us an order, 64 ranks 90 vs 69 us).
    ONE_ORDER_MAX_RANKS = 40

    def one_order(self) -> _OneOrder | None:
        """The plain-Python evaluator of one order (`_OneOrder`), or None for plans of more than
        `ONE_ORDER_MAX_RANKS` ranks and where some link has no bandwidth (NumPy's division by
        zero gives inf; Python's raises)."""
        if "_one" not in self.__dict__:
            finite = bool(np.isfinite(self.inv_bw).all() and np.isfinite(self.lat).all())
            self._one = _OneOrder(self) if finite and self.world <= self.ONE_ORDER_MAX_RANKS else None
        return self._one

    def _ring_positions(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Rank positions of every link of the tensor rings, pipeline hops and data rings: the
        index arrays `_terms` builds from an order's grid, built once from the grid of positions
        by the same operations (same shapes and memory layouts, so the same reductions)."""
        rings = self.__dict__.get("_rings")
        if rings is None:
            pos = np.arange(self.world).reshape(self.pp, self.dp, self.tp)
            swapped = np.swapaxes(pos, -1, -2)
            rings = self._rings = {"tp": (pos, np.roll(pos, -1, axis=-1)),
                                   "pp": (pos[:-1, :, :], pos[1:, :, :]),
                                   "dp": (swapped, np.roll(swapped, -1, axis=-1))}
        return rings

    # Each term takes orders of shape (..., n) and returns seconds of shape (...).
    def _grid(self, orders: np.ndarray) -> np.ndarray:
        o = np.asarray(orders)[..., : self.world]
        return o.reshape(o.shape[:-1] + (self.pp, self.dp, self.tp))

    def _ring(self, groups: np.ndarray, msg: float, nxt: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Ring all-reduce of `msg` bytes over the last axis of (..., a, b, k) groups: the
        slowest of the a*b groups (it sets the pace) and their mean. `nxt`: each rank's
        successor in its ring (default: the groups rolled by one)."""
        k = groups.shape[-1]
        batch = groups.shape[:-3]
        if k == 1 or msg == 0:
            return np.zeros(batch), np.zeros(batch)
        if nxt is None:
            nxt = np.roll(groups, -1, axis=-1)
        inv_links = self.inv_bw[groups, nxt]
        lat_links = self.lat[groups, nxt]
        # plait.cost.collectives' ring all-reduce at the slowest link (vectorised over orders)
        with np.errstate(divide="ignore"):
            per_group = ring_all_reduce_time(msg, k, 1.0 / _max(inv_links, -1), _max(lat_links, -1))
            # smooth companion: every link of every ring counts, not only the slowest
            smooth = ring_all_reduce_time(msg, k, 1.0 / _mean(inv_links, -1), _mean(lat_links, -1))
        return _max(per_group, (-1, -2)), _mean(smooth, (-1, -2))

    def _terms(self, orders: np.ndarray, fast: bool = True) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        """(slowest group, smooth mean over groups and links) for the tensor, pipeline and
        data-parallel terms. `fast=False`: one order is reshaped and rolled like a batch (the
        baseline of bench/plan_search_time.py; the same numbers)."""
        orders = np.asarray(orders)
        if orders.ndim == 1 and fast:  # one order (the annealing's walk): gather its rings directly
            return self._terms_of(orders)
        g = self._grid(orders)  # (..., pp, dp, tp)
        rings = {"tp": (g, None), "pp": (g[..., :-1, :, :], g[..., 1:, :, :]),
                 "dp": (np.swapaxes(g, -1, -2), None)}
        return self._terms_from(rings, g.shape[:-3])

    def _terms_of(self, order: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        """`_terms` of one order: the same arrays gathered by precomputed rank positions
        (no grid reshaping or rolling per call), hence the same seconds to the last bit."""
        o = order[: self.world]
        rings = {name: (o[a], o[b]) for name, (a, b) in self._ring_positions().items()}
        return self._terms_from(rings, ())

    def _terms_from(self, rings: dict[str, tuple[np.ndarray, np.ndarray | None]],
                    batch: tuple[int, ...]) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        """The three terms from the device ids of every ring: (groups, successors) per class."""
        zero = (np.zeros(batch), np.zeros(batch))
        # tensor parallel: ring over the tensor ranks of each (stage, replica)
        tp = zero
        if self.tp > 1 and self.traffic.tp_count:
            worst, mean = self._ring(rings["tp"][0], self.traffic.tp_bytes, rings["tp"][1])
            tp = (self.traffic.tp_count * worst, self.traffic.tp_count * mean)
        pp = zero
        if self.pp > 1 and self.traffic.pp_bytes:
            a, b = rings["pp"]
            # forward activation + backward gradient per hop; the slowest tensor rank of a hop counts
            with np.errstate(divide="ignore"):
                links = 2.0 * send_recv_time(self.traffic.pp_bytes, 1.0 / self.inv_bw[a, b], self.lat[a, b])
            path = self.traffic.pp_count * np.add.reduce(_max(links, -1), axis=-2)  # per pipeline (replica)
            smooth = self.traffic.pp_count * np.add.reduce(_mean(links, -1), axis=-2)
            pp = (_max(path, -1), _mean(smooth, -1))
        # data parallel: ring over the replicas of each (stage, tensor rank)
        dp = self._ring(rings["dp"][0], self.traffic.dp_bytes, rings["dp"][1]) if self.dp > 1 else zero
        return tp, pp, dp

    def cost(self, orders: np.ndarray) -> np.ndarray:
        """Pipette's latency: per traffic class, its slowest group (seconds per iteration)."""
        tp, pp, dp = self._terms(orders)
        return tp[0] + pp[0] + dp[0]

    def cost_and_mean(self, orders: np.ndarray, fast: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """The cost and the same sum averaged over all groups and all their links instead of
        the slowest: it moves when a change speeds up some link but not yet the slowest one,
        which the annealing needs on the plateaus of the max."""
        tp, pp, dp = self._terms(orders, fast)
        return tp[0] + pp[0] + dp[0], tp[1] + pp[1] + dp[1]

    def breakdown(self, order: np.ndarray | list[int]) -> dict[str, float]:
        tp, pp, dp = self._terms(np.asarray(order))
        parts = {"tp": float(tp[0]), "pp": float(pp[0]), "dp": float(dp[0])}
        parts["total"] = parts["tp"] + parts["pp"] + parts["dp"]
        return parts


@dataclass
class PlacementResult:
    order: list[int]  # rank -> device id (first `world` entries are used by the plan)
    cost: float  # Pipette path-model seconds per iteration for `order`
    default_cost: float  # the same for Megatron's default order (the starting order)
    breakdown: dict[str, float] = field(default_factory=dict)
    default_breakdown: dict[str, float] = field(default_factory=dict)
    iterations: int = 0
    accepted: int = 0

    @property
    def gain(self) -> float:
        """default_cost / cost (>= 1: how much less communication time placement buys)."""
        return self.default_cost / self.cost if self.cost > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"order": self.order, "cost_s": self.cost, "default_cost_s": self.default_cost,
                "breakdown": self.breakdown, "default_breakdown": self.default_breakdown,
                "iterations": self.iterations, "accepted": self.accepted}


# ---------------------------------------------------------------- moves
def apply_move(seq: np.ndarray, move: str, i: int, j: int, k: int = 0) -> np.ndarray:
    """Pipette's permutation moves on a 1-D sequence (returns a new array), i < j.

    swap: exchange seq[i] and seq[j]; insert: move seq[i] to position j;
    2opt: reverse seq[i..j]; reversed_insert: cut seq[i..j], reverse it and insert it
    at position k of what is left."""
    s = list(seq)
    if move == "swap":
        s[i], s[j] = s[j], s[i]
    elif move == "insert":
        x = s.pop(i)
        s.insert(j, x)
    elif move == "2opt":
        s[i : j + 1] = s[i : j + 1][::-1]
    elif move == "reversed_insert":
        seg = s[i : j + 1][::-1]
        rest = s[:i] + s[j + 1 :]
        k = min(k, len(rest))
        s = rest[:k] + seg + rest[k:]
    else:
        raise PlacementError(f"unknown move {move!r}; use {MOVES}")
    return np.asarray(s, dtype=seq.dtype)


class _Space:
    """Kind-preserving permutations: GPU moves inside a kind class, node moves among twin nodes."""

    def __init__(self, start: np.ndarray, kinds: list[str], nodes: list[int]) -> None:
        self.start = start
        n = len(start)
        kind_of_pos = [kinds[d] for d in start]
        cls: dict[str, list[int]] = defaultdict(list)
        for pos in range(n):
            cls[kind_of_pos[pos]].append(pos)
        self.classes = [np.asarray(v) for v in cls.values() if len(v) >= 2]
        # nodes with identical GPU-kind lists can trade all their GPUs at once
        members: dict[int, list[int]] = defaultdict(list)
        for d in range(n):
            members[nodes[d]].append(d)
        sig: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for node, devs in sorted(members.items()):
            sig[tuple(kinds[d] for d in sorted(devs))].append(node)
        # per twin-node group: (nodes, their devices as a nodes x gpus array in local order)
        self.node_groups = [(np.asarray(v), np.asarray([sorted(members[x]) for x in v]))
                            for v in sig.values() if len(v) >= 2]
        self.nodes = np.asarray(nodes)

    @property
    def trivial(self) -> bool:
        return not self.classes and not self.node_groups

    @staticmethod
    def _pick(m: int, rng: np.random.Generator) -> tuple[int, int, int]:
        """Two distinct indices i < j of m, and an insertion point k for reversed insert."""
        i = int(rng.integers(m))
        j = int(rng.integers(m - 1))
        j += j >= i
        i, j = min(i, j), max(i, j)
        rest = m - (j - i + 1)
        return i, j, int(rng.integers(rest + 1))

    @property
    def levels(self) -> list[str]:
        """Move levels available: whole twin nodes first (coarse), then single GPUs."""
        return (["nodes"] if self.node_groups else []) + (["gpus"] if self.classes else [])

    def shuffle(self, order: np.ndarray, rng: np.random.Generator, level: str = "gpus") -> np.ndarray:
        """A random kind-preserving permutation of `order` at `level` (a restart point)."""
        if level == "nodes":
            relabel = np.arange(len(order))
            for _, devs in self.node_groups:
                relabel[devs] = devs[rng.permutation(len(devs))]
            return relabel[order]
        out = order.copy()
        for pos in self.classes:
            out[pos] = rng.permutation(order[pos])
        return out

    def propose(self, order: np.ndarray, rng: np.random.Generator, level: str | None = None) -> np.ndarray:
        """One Pipette move (swap, insert, 2-opt or reversed insert) at `level` (None: either)."""
        if level is None:
            level = "nodes" if self.node_groups and (not self.classes or rng.random() < 0.5) else "gpus"
        move = MOVES[int(rng.integers(len(MOVES)))]
        if level == "nodes":
            _, devs = self.node_groups[int(rng.integers(len(self.node_groups)))]
            m = len(devs)
            i, j, k = self._pick(m, rng)
            perm = apply_move(np.arange(m), move, i, j, k)
            relabel = np.arange(len(order))
            relabel[devs] = devs[perm]  # node slot a now holds node perm[a]'s GPUs
            return relabel[order]
        pos = self.classes[int(rng.integers(len(self.classes)))]
        i, j, k = self._pick(len(pos), rng)
        out = order.copy()
        out[pos] = apply_move(order[pos], move, i, j, k)
        return out


# Weight of the mean term in the annealing energy: the cost is a sum of maxima, flat while
# any slowest link stays slow; the mean over links rewards fixing them one at a time.
MEAN_WEIGHT = 0.25


def anneal(model: PathModel, kinds: list[str], nodes: list[int], *, start: list[int] | None = None,
           seed: int = 0, iterations: int | None = None, restarts: int = 3, fast: bool = True) -> PlacementResult:
    """Simulated annealing over kind-preserving GPU/node permutations (Pipette §IV).

    `kinds[d]` and `nodes[d]` describe device d. Each run anneals first with node moves
    (whole nodes of identical GPU kinds trade places: which node pairs carry the pipeline
    and data-parallel traffic) and then with GPU moves (which GPUs form tensor groups and
    where each rank sits), each for `iterations` / 2 steps. The walk minimises the energy
    ``cost + MEAN_WEIGHT * mean cost over groups and links`` with Metropolis acceptance and
    a geometric temperature schedule from T0 (mean uphill step of that level's random
    moves / ln 2: early on half of the uphill moves pass) down to T0/1000; the best order
    is kept by (cost, mean). The first run starts from `start`, later runs from random
    node shuffles; the best order is polished by steepest descent over all pair swaps
    (small clusters) and returned. Deterministic for a given seed. `fast` (the default) remembers
    the energy of every order visited (the walk revisits about half of them) and evaluates one
    order in plain Python floats (`_OneOrder`, NumPy's arithmetic and reductions to the last
    bit); False recomputes each with NumPy (the same walk, slower)."""
    n = model.n
    order0 = np.arange(n) if start is None else np.asarray(start, dtype=int)
    if sorted(order0.tolist()) != list(range(n)):
        raise PlacementError(f"start order must be a permutation of the {n} device ids")
    space = _Space(order0, kinds, nodes)
    c0, m0 = (float(x) for x in model.cost_and_mean(order0))
    result = PlacementResult(order=order0.tolist(), cost=c0, default_cost=c0,
                             breakdown=model.breakdown(order0), default_breakdown=model.breakdown(order0))
    if space.trivial or c0 == 0.0:
        return result
    # each step costs O(n): small spaces need few steps, big clusters get fewer so that a
    # placement stays around a second
    iters = iterations if iterations is not None else int(max(400, min(4e5 / n, 250 * n, 8000)))
    levels = space.levels
    per_level = max(1, iters // len(levels))
    rng = np.random.default_rng(seed)

    seen: dict[bytes, tuple[float, float, float]] = {}
    one = model.one_order() if fast else None
    cost_and_mean = one.cost_and_mean if one is not None else (lambda o: model.cost_and_mean(o, fast))

    def energy(order: np.ndarray) -> tuple[float, float, float]:
        key = order.tobytes() if fast else b""
        hit = seen.get(key) if fast else None
        if hit is None:
            c, m = cost_and_mean(order)
            hit = (float(c) + MEAN_WEIGHT * float(m), float(c), float(m))
            if fast:
                seen[key] = hit
        return hit

    best, best_key = order0, (c0, m0)
    accepted = 0
    for r in range(max(1, restarts)):
        cur = order0 if r == 0 else space.shuffle(order0, rng, levels[0])
        cur_e, c, m = energy(cur)
        if (c, m) < best_key:
            best, best_key = cur, (c, m)
        for level in levels:
            # temperature from the typical uphill step of this level's random moves
            probes = [energy(space.propose(cur, rng, level))[0] - cur_e for _ in range(32)]
            ups = [x for x in probes if x > 0]
            temp = (sum(ups) / len(ups) if ups else max(cur_e, 1e-12) * 0.05) / math.log(2)
            alpha = 1e-3 ** (1.0 / max(1, per_level - 1))
            for _ in range(per_level):
                cand = space.propose(cur, rng, level)
                e, c, m = energy(cand)
                if e <= cur_e or rng.random() < math.exp(-(e - cur_e) / temp):
                    cur, cur_e = cand, e
                    accepted += 1
                    if (c, m) < best_key:
                        best, best_key = cand, (c, m)
                temp *= alpha
    best, best_key = _polish(model, space, best, best_key)
    result.order = best.tolist()
    result.cost = best_key[0]
    result.breakdown = model.breakdown(best)
    result.iterations = per_level * len(levels) * max(1, restarts)
    result.accepted = accepted
    return result


def _polish(model: PathModel, space: _Space, order: np.ndarray, key: tuple[float, float],
            max_devices: int = 128) -> tuple[np.ndarray, tuple[float, float]]:
    """Steepest descent by (cost, mean) over every same-kind pair swap, evaluated in one batch."""
    if model.n > max_devices:
        return order, key
    pairs = np.asarray([(int(a), int(b)) for pos in space.classes
                        for a, b in itertools.combinations(pos.tolist(), 2)], dtype=int)
    if len(pairs) == 0:
        return order, key
    rows = np.arange(len(pairs))
    for _ in range(4 * model.n):
        cands = np.repeat(order[None, :], len(pairs), axis=0)
        cands[rows, pairs[:, 0]] = order[pairs[:, 1]]
        cands[rows, pairs[:, 1]] = order[pairs[:, 0]]
        costs, means = model.cost_and_mean(cands)
        i = int(np.lexsort((means, costs))[0])
        new = (float(costs[i]), float(means[i]))
        if not (new[0] < key[0] * (1 - 1e-12) or (new[0] <= key[0] and new[1] < key[1] * (1 - 1e-12))):
            break
        order, key = cands[i], new
    return order, key


def brute_force(model: PathModel) -> tuple[list[int], float]:
    """Exhaustive minimum over all permutations of the devices (tests; n <= 8)."""
    if model.n > 8:
        raise PlacementError(f"brute force over {model.n}! orders is too many; use anneal")
    perms = np.asarray(list(itertools.permutations(range(model.n))), dtype=int)
    costs = np.concatenate([model.cost(chunk) for chunk in np.array_split(perms, max(1, len(perms) // 5040))])
    i = int(np.argmin(costs))
    return perms[i].tolist(), float(costs[i])


def place(cluster: Cluster, plan: Plan, traffic: Traffic, *, start: list[int] | None = None,
          seed: int = 0, iterations: int | None = None) -> PlacementResult:
    """Best rank-to-device order for `plan` on `cluster`, compared with `start` (default identity)."""
    devices = cluster.devices
    model = PathModel(bandwidth_matrix(cluster), traffic, dp=plan.dp, tp=plan.tp, pp=plan.pp,
                      latency=latency_matrix(cluster))
    kinds = [d.kind.name for d in devices]
    nodes = [d.node for d in devices]
    return anneal(model, kinds, nodes, start=start, seed=seed, iterations=iterations)
