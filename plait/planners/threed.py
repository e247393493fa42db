"""The Pipette-style 3D configurator (SYSTEMS.md §2), the planner behind `plait plan`.

Given a model, a cluster and a global batch, find the fastest data x tensor x
pipeline configuration that fits in every GPU's memory and place its ranks on the
GPUs:

1. **Enumerate** dp x tp x pp = GPUs (tensor parallel inside a node and dividing the
   attention heads, at most one pipeline stage per layer), micro-batch size (dividing
   the per-replica batch), recompute (none / selective / full), ZeRO stage (0-3;
   ZeRO-2/3 only without pipeline parallelism, as DeepSpeed requires), schedule
   (1F1B, GPipe, interleaved 1F1B with 2 chunks), sequence parallelism with tp > 1,
   and on a mixed cluster the kind layout (`plait.planners.hetero.layouts`), whose
   stages or replicas then get uneven layers or batch shares (`hetero.balance`).
2. **Prune** every candidate the memory estimator (`plait.cost.memory`) says does not
   fit on some GPU; the reasons are counted per GPU kind. Peak memory grows with the
   micro-batch, so once a micro-batch size overflows, the larger ones of the same
   configuration are pruned for the same reason without asking again.
3. **Rank** the survivors with a cheap analytic model (Pipette's 1F1B formula
   ``(M-1)*max_p t_p + sum_p t_p`` over per-layer compute times, plus the path-model
   communication of `plait.planners.placement`) at each candidate's placed order -- its ranks
   placed by simulated annealing, once per shape and kind layout, in lower-bound order -- keep
   the best `finalists`, and rank those by the `evaluate` function the search driver hands in
   (`plait.search`: the simulator) -- the number plait reports. This module never imports the
   simulator: planners sit below it (docs/DESIGN.md).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.cluster.topology import bandwidth_matrix, latency_matrix
from plait.cost.collectives import measured_tables
from plait.ir.plan import RECOMPUTE_CHOICES, Plan
from plait.ir.stage_graph import stage_graph
from plait.planners import hetero
from plait.planners.placement import PathModel, PlacementResult, anneal, traffic_of
from plait.planners.types import (
    DEFAULT_CLUSTER,
    DEFAULT_GLOBAL_BATCH,
    DEFAULT_MODEL,
    Candidate,
    Evaluate,
    GiB,
    PlanResult,
    SearchError,
    Simulator,
    auto_dtype,
    load_graph,
    memory_headroom,
)
from plait.workers import Workers, map_parallel, resolve_jobs

if TYPE_CHECKING:
    from plait.cluster.spec import Cluster, ClusterSource
    from plait.cost.traffic import IterationTraffic, Message
    from plait.graph.resolve import ModelSource
    from plait.ir.opgraph import OpGraph
    from plait.planners.options import SearchOptions, ThreeDOptions


# ============================================================================ search space


@dataclass
class SearchSpace:
    """What to enumerate; None means every valid value."""

    tp: list[int] | None = None
    pp: list[int] | None = None
    micro_batch: list[int] | None = None
    recompute: tuple[str, ...] = RECOMPUTE_CHOICES
    zero: tuple[int, ...] = (0, 1, 2, 3)
    schedules: tuple[str, ...] = ("1f1b", "gpipe", "interleaved")
    sequence_parallel: tuple[bool, ...] = (False, True)
    layouts: bool = True  # on mixed clusters: try kinds along pp and along dp
    hetero: bool = True  # on mixed clusters: uneven layers/batch shares (False: treat GPUs as equal)
    dtype: str | None = None  # None: bf16, or fp16 when some GPU kind has no bf16 unit (V100, T4)
    # data-parallel degrees that do not divide the global batch (even shares, the remainder carried by
    # the first replicas); False where the plan must be a framework's (Megatron needs B % (mb dp) == 0)
    uneven_dp: bool = True
    allow: Callable[[Plan], bool] | None = None  # extra filter on candidates (e.g. a fixed list)


# ============================================================================ model / cluster


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ============================================================================ enumeration


@dataclass
class _Group:
    """Candidates that differ only in micro-batch size (ascending): memory grows along it."""

    key: tuple
    plans: list[Plan]
    layout: str
    order: list[int]


def enumerate_groups(graph: OpGraph, cluster: Cluster, global_batch: int,
                     space: SearchSpace | None = None) -> Iterator[_Group]:
    """Every valid configuration, grouped by everything but the micro-batch size."""
    space = space or SearchSpace()
    dtype = space.dtype or auto_dtype(cluster)
    devices = cluster.devices
    world = len(devices)
    per_node = min(len(n.gpus) for n in cluster.nodes)
    heads = int(graph.config.get("heads") or graph.config.get("num_heads") or 0)
    kv_heads = int(graph.config.get("kv_heads") or heads or 0)
    n_layers = len(graph.layers)
    has_tp = any(layer.tp_style == "transformer" for layer in graph.layers)
    layout_cache: dict[tuple[int, int, int], dict[str, list[int]]] = {}
    tps = [t for t in _divisors(per_node) if world % t == 0
           and (t == 1 or (has_tp and heads and heads % t == 0 and kv_heads % t == 0))]
    if space.tp is not None:
        tps = [t for t in tps if t in space.tp]
    for tp in tps:
        for pp in _divisors(world // tp):
            if pp > n_layers or (space.pp is not None and pp not in space.pp):
                continue
            dp = world // (tp * pp)
            if dp > global_batch:
                continue  # a replica without a sample
            # A degree that does not divide the global batch gets even shares, the remainder carried by
            # the first replicas (`Plan.samples_per_replica`): floor or ceil(B / dp) samples each, cut
            # into micro-batches of at most `mb` (`plait.ir.stage_graph.micro_batch_sizes`); `mb`
            # divides B so a mixed cluster's re-balancing hands out whole micro-batches (`hetero.balance`).
            uneven = global_batch % dp != 0
            if uneven and not space.uneven_dp:
                continue
            shares = [1.0 / dp] * dp if uneven else None
            mbs = _micro_batch_sizes(global_batch, dp, uneven, space)
            if not mbs:
                continue
            schedules = ["1f1b"] if pp == 1 else [s for s in space.schedules if not (uneven and s == "interleaved")]
            # ZeRO-2/3 shard gradients/parameters that gradient accumulation across pipeline
            # micro-batches keeps whole (DeepSpeed refuses ZeRO-2/3 with pipeline parallelism).
            zeros = [z for z in space.zero if (dp > 1 or z == 0) and (pp == 1 or z <= 1)]
            sps = [s for s in space.sequence_parallel if tp > 1 or not s]
            for schedule in schedules:
                v = 2 if schedule == "interleaved" else 1
                if pp * v > n_layers:
                    continue
                for sp in sps:
                    for zero in zeros:
                        for recompute in space.recompute:
                            plans = []
                            for mb in mbs:
                                m = global_batch // (dp * mb)
                                if schedule == "interleaved" and m % pp:
                                    continue
                                plans.append(Plan(dp=dp, tp=tp, pp=pp, micro_batch=mb, global_batch=global_batch,
                                                  recompute=recompute, zero=zero, schedule=schedule,
                                                  virtual_stages=v, sequence_parallel=sp, dtype=dtype,
                                                  dp_shares=shares))
                            if space.allow is not None:
                                plans = [q for q in plans if space.allow(q)]
                            if not plans:
                                continue
                            lays = _layouts(cluster, plans[0], space, layout_cache)
                            for name, order in lays.items():
                                key = (dp, tp, pp, schedule, sp, zero, recompute, name)
                                yield _Group(key, plans, name, order)


def _micro_batch_sizes(global_batch: int, dp: int, uneven: bool, space: SearchSpace) -> list[int]:
    """The micro-batch sizes of `dp` replicas: divisors of each replica's samples (of the global
    batch, at most a replica's ceiling, when `dp` does not divide it), as `space` allows."""
    mbs = ([m for m in _divisors(global_batch) if m <= -(-global_batch // dp)] if uneven
           else _divisors(global_batch // dp))
    if space.micro_batch is not None:
        mbs = [m for m in mbs if m in space.micro_batch]
    return mbs


def _layouts(cluster: Cluster, plan: Plan, space: SearchSpace,
             cache: dict[tuple[int, int, int], dict[str, list[int]]]) -> dict[str, list[int]]:
    """The GPU orders to try for `plan`'s shape: the cluster's own order, or on a mixed cluster the
    kind layouts of `plait.planners.hetero.layouts` (they depend on the shape only: cached)."""
    if not (space.layouts and space.hetero):
        return {"default": list(range(cluster.num_devices))}
    shape = (plan.dp, plan.tp, plan.pp)
    lays = cache.get(shape)
    if lays is None:
        lays = hetero.layouts(cluster, plan, cluster.devices)
        cache[shape] = lays
    return lays


# ============================================================================ cheap ranker


class CommBound:
    """Lower bounds of `plait.cost.traffic.message_time` over every placement that keeps each
    rank's GPU kind: a message's time is the maximum over its groups, so a bound of its first
    group's time on *any* devices of that group's kinds bounds it (`message_s`).

    For `n` devices of kind set K, the alpha-beta formulas of `plait.cost.collectives` run at the
    ring's slowest link, so they are bounded by the same formulas at the fastest link a ring of
    K-devices can have -- a node-internal pair, or a cross-node pair driven by the most NICs a
    K-node has (only the latter when `n` exceeds the most K-devices on one node: the ring must
    leave a node; a cross-node hop runs on as many NICs as the group has members on its
    emptiest node, at most ``n // 2``, and at most the NICs of a node holding each of its kinds) --
    and the least latency. The algorithms NCCL may pick (ring, tree and, across
    nodes, hierarchical: at least ``S / B_intra + S / (B_inter c)`` for its reduce-scatter +
    all-gather and inter-node all-reduce of two or more nodes and members) are each bounded and
    the least is taken. A cluster with measured collective tables gives collectives no bound (0).
    Every bound is scaled by ``1 - 1e-9`` so rounding never lifts it above the placed time."""

    SAFETY = 1.0 - 1e-9

    def __init__(self, bw: np.ndarray, lat: np.ndarray, node_of: list[int], node_nics: list[int],
                 devices: list, measured: bool) -> None:
        self.bw, self.lat, self.measured = np.asarray(bw, dtype=float), np.asarray(lat, dtype=float), measured
        self.node = np.asarray(node_of)
        self.nics = np.asarray(node_nics)
        names = sorted({d.kind.name for d in devices})
        self.kind = np.asarray([names.index(d.kind.name) for d in devices])
        self.per_node_kind = np.zeros((int(self.node.max()) + 1, len(names)), dtype=int)  # GPUs per node and kind
        np.add.at(self.per_node_kind, (self.node, self.kind), 1)
        # per kind: the most NICs of a node holding it
        self.kind_nics = ((self.per_node_kind > 0) * self.nics[: len(self.per_node_kind), None]).max(axis=0)
        self._links: dict[frozenset, tuple[int, float, float, float, float]] = {}
        self._cache: dict[tuple, float] = {}

    def _links_of(self, kinds: frozenset) -> tuple[int, float, float, float, float]:
        """(most K-devices on one node, fastest node-internal K-pair bandwidth, fastest cross-node
        K-pair bandwidth, most NICs of a K-node, least K-pair latency); 0 bandwidth where none."""
        hit = self._links.get(kinds)
        if hit is None:
            sel = np.flatnonzero(np.isin(self.kind, list(kinds)))
            bw, lat = self.bw[np.ix_(sel, sel)], self.lat[np.ix_(sel, sel)]
            nodes = self.node[sel]
            off = ~np.eye(len(sel), dtype=bool)
            same = (nodes[:, None] == nodes[None, :]) & off
            cross = nodes[:, None] != nodes[None, :]
            per_node = int(np.bincount(nodes).max())
            hit = self._links[kinds] = (
                per_node, float(bw[same].max()) if same.any() else 0.0,
                float(bw[cross].max()) if cross.any() else 0.0, int(self.nics[np.unique(nodes)].max()),
                float(lat[off].min()) if off.any() else 0.0)
        return hit

    def message_s(self, msg: Message, plan: Plan) -> float:
        """A lower bound of `msg`'s time on its slowest group, wherever its ranks are placed."""
        if msg.nbytes <= 0 or not msg.groups:
            return 0.0
        group = msg.groups[0]
        counts = tuple(np.bincount(self.kind[list(group)], minlength=self.per_node_kind.shape[1]).tolist())
        key = (msg.op, msg.nbytes, len(group), counts)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._bound(msg.op, float(msg.nbytes), len(group), counts) * self.SAFETY
        return hit

    def _bound(self, op: str, S: float, n: int, counts: tuple[int, ...]) -> float:
        """The bound for a group of `n` devices with `counts[k]` of kind k."""
        from plait.cost.collectives import (
            all_to_all_time,
            broadcast_time,
            reduce_time,
            ring_all_gather_time,
            ring_all_reduce_time,
            ring_reduce_scatter_time,
            send_recv_time,
            tree_all_reduce_time,
        )

        kinds = frozenset(k for k, c in enumerate(counts) if c)
        per_node, b_in, b_x, nics, a = self._links_of(kinds)
        # the group must leave a node when no node holds that many GPUs of each of its kinds
        spans = not bool((self.per_node_kind >= np.asarray(counts)).all(axis=1).any())
        if op == "send_recv":  # one pair, raw link (message_time's send/recv)
            return send_recv_time(S, b_x if spans else max(b_in, b_x), a) if n == 2 else 0.0
        if n <= 1 or self.measured:
            return 0.0
        # NICs a group drives at once: its fewest members on one of its nodes (at most n // 2 of
        # two or more nodes), capped by the NICs there -- at most the most NICs of a node holding
        # its scarcest-NIC kind (it has a member on such a node)
        nics = max(1, min(nics, n // 2, *(int(self.kind_nics[k]) for k in kinds)))
        ring_b = b_x * nics if spans else max(b_in, b_x * nics)
        if ring_b <= 0:
            return 0.0
        if op == "all_reduce":
            lbs = [ring_all_reduce_time(S, n, ring_b, a), tree_all_reduce_time(S, n, ring_b, a)]
            if per_node > 1 and b_in > 0 and b_x > 0:  # hierarchical: two or more nodes and members
                lbs.append(S / b_in + S / (b_x * nics))
            return min(lbs)
        fns = {"reduce_scatter": ring_reduce_scatter_time, "all_gather": ring_all_gather_time,
               "broadcast": broadcast_time, "reduce": reduce_time}
        if op in fns:
            return fns[op](S, n, ring_b, a)
        if op == "all_to_all":  # its cross-node form has no smaller latency term than (n - 1) a
            return min(all_to_all_time(S, n, ring_b, a), (n - 1) * a)
        return 0.0


class AnalyticModel:
    """Pipette's latency model on plait's cost functions: a fast first-pass ranker.

    Compute: per-layer forward + backward (+ recompute) kernel time of one micro-batch on
    each GPU kind from `plait.cost.compute.layer_cost` (Megatron's kernel sequence);
    the pipeline of replica d takes ``M_d * b_d + (s_d - b_d) / v`` (Pipette's 1F1B
    formula ``(M-1) max_p t_p + sum_p t_p``, the fill/drain part divided by the v
    interleaved chunks). Communication: every message of the iteration from
    `plait.cost.traffic` (the same messages the simulator lowers), each timed by
    `plait.cost.collectives` on its slowest group in the plan's placement (`comm_times`),
    plus the optimizer step. Nothing overlaps, so it over-estimates communication-heavy
    plans; the simulator decides the final ranking."""

    def __init__(self, graph: OpGraph, cluster: Cluster,
                 layer_time: hetero.LayerTimeFn | None = None, compute: Any = None, fast: bool = True) -> None:
        from plait.cost.compute import DEFAULT_MODEL

        self.graph, self.cluster, self.fast = graph, cluster, fast
        self._stage_graphs: dict[str, Any] = {}
        self._memo: dict[tuple, Any] = {}
        self.compute = compute if compute is not None else DEFAULT_MODEL
        self.devices = cluster.devices
        self.kinds = {d.kind.name: d.kind for d in self.devices}
        self.flops_per_sample = graph.fwd_flops + graph.bwd_flops
        self.bw = bandwidth_matrix(cluster)
        self.lat = latency_matrix(cluster)
        self.node_of = [d.node for d in self.devices]
        self.node_nics = [max(1, n.nics) for n in cluster.nodes]
        self.measured = measured_tables(cluster)
        self._custom = layer_time
        self._costs: dict[tuple, Any] = {}
        self._grads: dict[tuple, list[float]] = {}  # `_grad_params`
        self._times: dict[tuple, np.ndarray] = {}
        self._coll: dict[tuple, float] = {}
        self._comm: dict[str, dict[str, float]] = {}  # comm_times by plan (GPipe as its 1F1B twin)
        self._links: dict[tuple, Any] = {}
        self._traffic: dict[str, IterationTraffic] = {}
        self._cost_fns: dict[tuple, Any] = {}
        self._paths: dict[tuple, PathModel] = {}
        self._bound: CommBound | None = None
        self._base_path = PathModel(self.bw, traffic_of(graph, Plan()), dp=1, tp=1, pp=1, latency=self.lat)
        # identical transformer blocks cost the same: cost one, reuse it -- unless each has its
        # own measured time (a model profile)
        shared = getattr(self.compute, "profile", None) is None
        self._sig = [("t", layer.param_count, layer.fwd_flops) if shared and layer.tp_style == "transformer"
                     else ("l", i) for i, layer in enumerate(graph.layers)]
        self._index = {id(layer): i for i, layer in enumerate(graph.layers)}

    # ---------------------------------------------------------------- compute
    def layer_cost(self, i: int, plan: Plan, kind_name: str) -> Any:
        from plait.cost.compute import layer_cost

        key = (self._sig[i], kind_name, plan.micro_batch, plan.tp, plan.dtype, plan.sequence_parallel)
        cost = self._costs.get(key)
        if cost is None:
            cost = layer_cost(self.graph.layers[i], self.graph, plan.micro_batch, self.kinds[kind_name],
                              plan.dtype, tp=plan.tp, sequence_parallel=plan.sequence_parallel,
                              model=self.compute)
            self._costs[key] = cost
        return cost

    def _grad_params(self, plan: Plan, kind_name: str) -> list[float]:
        """Gradient parameters of every layer (`layer_cost(...).grad_params`), per the keys of
        `layer_cost`: the optimizer step of every candidate sums them per stage."""
        key = (kind_name, plan.micro_batch, plan.tp, plan.dtype, plan.sequence_parallel)
        hit = self._grads.get(key)
        if hit is None:
            hit = self._grads[key] = [self.layer_cost(i, plan, kind_name).grad_params
                                      for i in range(len(self.graph.layers))]
        return hit

    def layer_time(self, layer: Any, kind: Any, plan: Plan) -> float:
        """A `hetero.LayerTimeFn`: compute seconds of one micro-batch of `layer` on `kind`."""
        return float(self.layer_times(plan, kind.name)[self._index[id(layer)]])

    def layer_times(self, plan: Plan, kind_name: str) -> np.ndarray:
        key = (kind_name, plan.micro_batch, plan.tp, plan.recompute, plan.dtype, plan.sequence_parallel)
        t = self._times.get(key)
        if t is None:
            if self._custom is not None:
                kind = self.kinds[kind_name]
                t = np.asarray([self._custom(layer, kind, plan) for layer in self.graph.layers])
            else:
                costs = [self.layer_cost(i, plan, kind_name) for i in range(len(self.graph.layers))]
                t = np.asarray([c.fwd.compute_s + c.bwd.compute_s + c.recompute(plan.recompute).compute_s
                                for c in costs])
            self._times[key] = t
        return t

    # ---------------------------------------------------------------- communication
    def path_model(self, plan: Plan) -> PathModel:
        """Pipette's path model of the plan, for placement (`plait.planners.placement`)."""
        traffic = traffic_of(self.graph, plan, self.traffic(plan))
        key = (traffic, plan.dp, plan.tp, plan.pp)
        path = self._paths.get(key)
        if path is None:
            path = self._base_path.with_plan(traffic, dp=plan.dp, tp=plan.tp, pp=plan.pp)
            self._paths[key] = path
        return path

    def traffic(self, plan: Plan) -> IterationTraffic:
        """Every message of one iteration of `plan` (`plait.cost.traffic`): what `estimate` times."""
        from plait.cost.traffic import iteration_traffic, layer_cost_fn

        key = str(plan)
        hit = self._traffic.get(key)
        if hit is None:
            grid = hetero.kind_grid(self.cluster, plan, self.devices)
            ckey = (plan.dtype, plan.sequence_parallel, grid[0][0])
            cost = self._cost_fns.get(ckey)
            if cost is None:
                cost = self._cost_fns[ckey] = layer_cost_fn(self.graph, plan, self.kinds[grid[0][0]], self.compute)
            if not self.fast:
                hit = self._traffic[key] = iteration_traffic(self.graph, plan, stage_graph(plan, self.graph),
                                                             cost=cost)
                return hit
            # ZeRO and recompute change messages, not the stage graph: one per shape, and the
            # messages that depend on it alone replayed (`iteration_traffic`'s memo)
            skey = str(dataclasses.replace(plan, zero=0, recompute="none"))
            sg = self._stage_graphs.get(skey)
            if sg is None:
                sg = self._stage_graphs[skey] = stage_graph(plan, self.graph)
            hit = self._traffic[key] = iteration_traffic(self.graph, plan, sg, cost=cost, memo=self._memo)
        return hit

    def _message_s(self, msg: Message, plan: Plan) -> float:
        """Seconds of one call of `msg` on its slowest group, as NCCL would run it."""
        from plait.cost.traffic import message_time

        key = (msg.op, msg.nbytes, msg.groups, plan.collectives.get(msg.cls if msg.cls != "tied" else "dp"))
        t = self._coll.get(key)
        if t is None:
            t = self._coll[key] = message_time(msg, self.bw, self.lat, self.node_of, key[-1], self._group_links)
        return t

    def _group_links(self, group: tuple[int, ...]) -> Any:
        """`plait.cost.collectives.group_links` of a device group, cached (planners ask again and again)."""
        hit = self._links.get(group)
        if hit is None:
            from plait.cost.collectives import group_links

            hit = self._links[group] = group_links(list(group), self.bw, self.lat, self.node_of,
                                                   self.node_nics, self.measured)
        return hit

    def comm_times(self, plan: Plan) -> dict[str, float]:
        """Seconds of communication per traffic class on the critical path, nothing overlapped:
        tp -- the busiest replica's tensor-parallel collectives (every pass of every micro-batch);
        pp -- every stage edge's activation and gradient (largest micro-batch, slowest tensor
        rank), Pipette's path weighted by ``max(1, M // pp)``; dp -- the busiest stage's
        gradient reduction, ZeRO gathers/scatters and tied-embedding all-reduce.

        GPipe and 1F1B send the same messages (neither the stage graph nor the traffic reads
        the schedule, only the virtual stages), so a GPipe plan reuses its 1F1B twin's times."""
        if self.fast and plan.schedule == "gpipe":
            key = str(dataclasses.replace(plan, schedule="1f1b"))
            hit = self._comm.get(key)
            if hit is None:
                hit = self._comm[key] = self._comm_times(plan)
            return dict(hit)
        if self.fast:
            key = str(plan)
            hit = self._comm.get(key)
            if hit is None:
                hit = self._comm[key] = self._comm_times(plan)
            return dict(hit)
        return self._comm_times(plan)

    def _comm_times(self, plan: Plan, message_s: Callable[[Message, Plan], float] | None = None
                    ) -> dict[str, float]:
        """`comm_times` with each message timed by `message_s` (default: on its groups,
        `_message_s`; `comm_lower_bound` hands in a bound of it)."""
        message_s = message_s or self._message_s
        tr = self.traffic(plan)
        m = max((r.count for st in tr.stage_graph.stages for r in st.replicas), default=1)
        busy: dict[tuple, float] = defaultdict(float)
        hops: dict[str, float] = defaultdict(float)
        for msg in tr.messages:
            if msg.cls == "tp":
                busy[("tp", msg.stage, msg.replica)] += msg.count * message_s(msg, plan)
            elif msg.cls == "pp":
                hops[msg.name] = max(hops[msg.name], message_s(msg, plan))
            else:
                busy[("dp", msg.stage)] += msg.count * message_s(msg, plan)
        return {"tp": max((t for k, t in busy.items() if k[0] == "tp"), default=0.0),
                "pp": sum(hops.values()) * max(1, m // plan.pp),
                "dp": max((t for k, t in busy.items() if k[0] == "dp"), default=0.0)}

    def comm_lower_bound(self, plan: Plan) -> dict[str, float]:
        """Lower bounds of the ``tp``, ``pp`` and ``dp`` parts of `comm_times` at every placement of `plan`'s ranks
        that keeps each rank's GPU kind (`plait.planners.placement` moves only such): the same sums
        and maxima over the same messages (their sizes, counts and group sizes do not depend on
        the placement), each message timed by `CommBound` -- at most its time on any group of
        devices of its kinds -- so each sum and maximum is at most the placed one (rounding is
        monotone)."""
        if self._bound is None:
            self._bound = CommBound(self.bw, self.lat, self.node_of, self.node_nics, self.devices,
                                    bool(self.measured))
        return self._comm_times(plan, self._bound.message_s)

    def estimate(self, plan: Plan, parts: tuple[float, float] | None = None) -> float:
        """Seconds per iteration: the slowest replica's pipeline compute, every class's
        communication on the critical path (`comm_times`) and the optimizer step.
        `parts`: this plan's `compute_and_optimizer`, when already known."""
        compute_s, opt_s = parts if parts is not None else self.compute_and_optimizer(plan)
        comm = self.comm_times(plan)
        return compute_s + comm["tp"] + comm["pp"] + comm["dp"] + opt_s

    def bound_with_comm(self, plan: Plan, parts: tuple[float, float]) -> float:
        """A lower bound of `estimate` at every kind-preserving placement of `plan`: compute,
        `comm_lower_bound`'s parts and the optimizer step, summed in `estimate`'s order."""
        lb = self.comm_lower_bound(plan)
        return parts[0] + lb["tp"] + lb["pp"] + lb["dp"] + parts[1]

    def lower_bound(self, parts: tuple[float, float]) -> float:
        """A lower bound of `estimate` from its compute and optimizer parts alone: communication
        is never negative and rounding is monotone, so ``c + tp + pp + dp + o >= c + o`` holds
        in floating point too."""
        return parts[0] + parts[1]

    def compute_and_optimizer(self, plan: Plan) -> tuple[float, float]:
        """(the slowest replica's pipeline compute, the slowest optimizer step) in seconds."""
        from plait.cost.compute import optimizer_time

        graph = self.graph
        grid = hetero.kind_grid(self.cluster, plan, self.devices)
        v = plan.virtual_stages
        bounds = np.concatenate([[0], np.cumsum(plan.layers_per_stage(len(graph.layers)))])
        chunk_stage = [c % plan.pp for c in range(plan.pp * v)]
        counts = hetero.replica_micro_batch_counts(plan)
        # compute: the slowest replica's pipeline
        compute_s = 0.0
        columns: dict[tuple[str, ...], tuple[float, float]] = {}  # replicas of equal kinds: equal stages
        for d, col in enumerate(zip(*grid)):  # col: the kinds of replica d's stages
            bs = columns.get(col) if self.fast else None
            if bs is None:
                st = np.zeros(plan.pp)
                for c, p in enumerate(chunk_stage):
                    st[p] += self.layer_times(plan, grid[p][d])[bounds[c]:bounds[c + 1]].sum()
                bs = columns[col] = (float(st.max()), float(st.sum()))
            b, s = bs
            compute_s = max(compute_s, counts[d] * b + (s - b) / v)
        kind0 = grid[0][0]
        grads = self._grad_params(plan, kind0)
        params = np.zeros(plan.pp)
        for c, p in enumerate(chunk_stage):
            params[p] += sum(grads[bounds[c]:bounds[c + 1]])  # the layers' sum, in layer order
        shard = plan.dp if plan.zero >= 1 else 1
        # the step of stage p on kind k is one number, however many replicas share it
        pairs = ({(p, k) for p, row in enumerate(grid) for k in set(row)} if self.fast else
                 [(p, grid[p][d]) for p in range(plan.pp) for d in range(plan.dp)])
        opt_s = max(optimizer_time(params[p] / shard, self.kinds[k], self.compute) for p, k in pairs)
        return compute_s, opt_s


# ============================================================================ simulator


# ============================================================================ the search


def search_3d(model: ModelSource | None, cluster: ClusterSource | None, common: SearchOptions,
              simulator: Simulator | None, options: ThreeDOptions) -> PlanResult:
    """Search for the fastest 3D plan that fits (module docstring); returns the top `common.top`.

    `common` holds what every family is asked (`plait.planners.options.SearchOptions`: the global
    batch, the dtype -- it overrides `options.space.dtype` -- the compute model of both rankers, the
    runtime's `supports`, the worker processes of the memory check and the finalists' simulations,
    the progress), `options` the family's own (`ThreeDOptions`: finalists, space, placement, ...).
    `simulator.evaluate(graph, plan) -> dict` times the placed finalists (the search driver,
    `plait.search`, hands it in; the keys read are ``iteration_time_s``, ``tflops_per_gpu``,
    ``throughput_samples_per_s``); None: the analytic model ranks alone."""
    t_start = time.perf_counter()
    evaluate = simulator.evaluate if simulator is not None else None
    finalists, space = options.finalists, options.space
    cluster_obj, gb, space, dtype = _search_inputs(cluster, common.global_batch, space, common.dtype)
    spec, graph = load_graph(DEFAULT_MODEL if model is None else model, dtype, common.precision)
    from plait.cost.compute import DEFAULT_MODEL as DEFAULT_COMPUTE

    compute = (common.compute or DEFAULT_COMPUTE).with_profile(cluster_obj, graph, dtype)  # measured where profiled
    analytic = AnalyticModel(graph, cluster_obj, options.layer_time, compute, fast=options.fast)

    bar = Progress(common.progress, common.on_progress)
    groups = list(enumerate_groups(graph, cluster_obj, gb, space))
    total = sum(len(g.plans) for g in groups)
    if total == 0:
        raise SearchError(f"plan: no dp x tp x pp configuration of {cluster_obj.num_devices} GPUs gives every "
                          f"data-parallel replica a sample of global batch {gb} for model {graph.model}")
    mem = _MemoryFilter(graph, cluster_obj, dict(options.memory_kwargs or {}))
    jobs = _search_jobs(common.jobs, cluster_obj)
    kept = _surviving_candidates(groups, total, graph, cluster_obj, mem, analytic,
                                 space.hetero if space is not None else True, common.supports, bar, jobs)

    # ---- analytic first pass, then place and simulate the finalists
    _first_pass(kept, analytic, cluster_obj, finalists if options.fast else None, bar,
                options.placement, options.seed, options.placement_iterations, options.fast, jobs)
    kept.sort(key=lambda c: (c.analytic_s, str(c.plan)))
    chosen = kept if finalists is None else kept[:finalists]
    ahead = _place_and_rank(chosen, graph, analytic, mem, evaluate, gb, bar, jobs, groups)
    chosen.sort(key=_final_order)
    best = chosen[:common.top]
    _default_order_baseline(best, groups, graph, evaluate, mem, ahead)

    return PlanResult(model=getattr(spec, "spec", None) or graph.model, cluster=cluster_obj.name,
                      global_batch=gb, world_size=cluster_obj.num_devices, top=best, enumerated=total,
                      pruned=sum(mem.reasons.values()), pruned_reasons=dict(mem.reasons),
                      pruned_examples=mem.examples, memory_checked=len(mem.checked),
                      ranked_analytic=len(kept), simulated=len(chosen) if evaluate is not None else 0,
                      search_time_s=time.perf_counter() - t_start,
                      ranker="simulator" if evaluate is not None else "analytic")


def _search_inputs(cluster: ClusterSource | None, global_batch: int | None, space: SearchSpace | None,
                   dtype: str | None) -> tuple[Cluster, int, SearchSpace | None, str]:
    """`search_3d`'s inputs resolved (the options checked their own values when built): (the cluster,
    the global batch, the space with `dtype` set in it, the plans' dtype)."""
    from plait.cluster import load_cluster

    cluster_obj = load_cluster(DEFAULT_CLUSTER if cluster is None else cluster)
    gb = DEFAULT_GLOBAL_BATCH if global_batch is None else int(global_batch)
    if dtype is not None:
        space = dataclasses.replace(space or SearchSpace(), dtype=dtype)
    dtype = (space.dtype if space is not None and space.dtype else None) or auto_dtype(cluster_obj)
    return cluster_obj, gb, space, dtype


def _surviving_candidates(groups: list[_Group], total: int, graph: OpGraph, cluster: Cluster,
                          mem: _MemoryFilter, analytic: AnalyticModel, space_hetero: bool,
                          supports: Callable[[Plan], tuple[bool, str]] | None, bar: Progress,
                          jobs: int) -> list[Candidate]:
    """The enumerated plans that fit in memory and, given `supports`, that the runtime runs;
    raises a SearchError naming the commonest reasons when none is left."""
    kept = _fitting_candidates(groups, mem, analytic, space_hetero, bar, total, jobs)
    if supports is not None:  # what the runtime would refuse is never offered
        kept = _runnable(kept, supports, mem)
    if not kept:
        worst = ", ".join(f"{n} x {r}" for r, n in mem.reasons.most_common(3))
        raise SearchError(f"plan: none of the {total} configurations of {graph.model} fits in memory on "
                          f"{cluster.name} ({worst}); try more GPUs or a smaller global batch")
    return kept


def _first_pass(kept: list[Candidate], analytic: AnalyticModel, cluster: Cluster, finalists: int | None,
                bar: Progress, placement: bool, seed: int, iterations: int | None, fast: bool, jobs: int) -> None:
    """`_rank_analytic` with, given `placement`, each candidate timed at its placed order (`_Placer`,
    its pending annealing dropped however the ranking ends)."""
    placer = _Placer(analytic, cluster, seed, iterations, fast, jobs) if placement else None
    try:
        _rank_analytic(kept, analytic, finalists, bar, placer)
    finally:
        if placer is not None:
            placer.close()


def _rank_analytic(kept: list[Candidate], analytic: AnalyticModel, finalists: int | None, bar: Progress,
                   place: _Placer | None = None) -> None:
    """Every candidate's analytic time, or -- with `finalists` -- enough of them to know the
    best `finalists` exactly: candidates are timed in order of a lower bound of their time
    (compute, communication at any placement and optimizer, `AnalyticModel.bound_with_comm`), and
    once a bound exceeds the `finalists`-th best time so far, that candidate and every later one
    cannot be a finalist; they keep an infinite time (never chosen, never shown), and are never
    placed nor timed. The communication bound is priced lazily: only for candidates whose compute
    + optimizer bound (`AnalyticModel.lower_bound`, at most the full one) is below the least full
    bound not yet timed (`_BoundOrder`).

    With `place`, each candidate is timed at its placed order (`_Placer`: one annealed placement
    per shape and kind layout), the order it is simulated at -- a layout's start order can put
    a tied embedding's two stages or a data-parallel group across a slow link that placement
    then avoids, so ranking unplaced orders drops plans whose placed time is the best. Placement
    keeps every rank's GPU kind, so both bounds hold for the placed plan; a shape is annealed on
    its first candidate in compute-bound order (`_Placer.first_of_shapes`), so each shape gets the
    same placement whether the ranking is bounded or exhaustive."""
    bar.start("analytic", len(kept))
    if finalists is None and place is None:
        for c in kept:
            c.analytic_s = analytic.estimate(c.plan)
            bar.advance(1)
        bar.stop()
        return
    parts = [analytic.compute_and_optimizer(c.plan) for c in kept]
    bounds = [analytic.lower_bound(p) for p in parts]
    ranked = sorted(range(len(kept)), key=bounds.__getitem__)
    if place is not None:
        pos = {id(c): i for i, c in enumerate(kept)}
        place.first_of_shapes((kept[i] for i in ranked),
                              lambda c: analytic.bound_with_comm(c.plan, parts[pos[id(c)]]))
    best: list[float] = []  # max-heap (negated) of the `finalists` smallest times so far
    timed = 0
    order = ranked if finalists is None else _BoundOrder(kept, analytic, parts, bounds, ranked, place)
    for i in order:
        if finalists is not None and len(best) == finalists and order.bound > -best[0]:  # type: ignore[attr-defined]
            break  # every later bound is at least this one
        if place is not None:
            place(kept[i])
        t = kept[i].analytic_s = analytic.estimate(kept[i].plan, parts[i])
        if finalists is not None and len(best) < finalists:
            heapq.heappush(best, -t)
        elif finalists is not None and t < -best[0]:
            heapq.heapreplace(best, -t)
        timed += 1
        bar.advance(1)
    bar.advance(len(kept) - timed)
    bar.stop()


class _BoundOrder:
    """The candidates in ascending order of `AnalyticModel.bound_with_comm` (its value of the
    current one in `bound`), pricing a candidate's communication only once its compute +
    optimizer bound (`bounds`, `ranked` in ascending order of it) is at most the least full bound
    pending: every candidate not yet priced has a full bound at least its compute bound, so the
    least pending one is the least of all. A candidate whose shape is already placed is priced
    on its placed order (its traffic is then reused when it is timed)."""

    def __init__(self, kept: list[Candidate], analytic: AnalyticModel, parts: list[tuple[float, float]],
                 bounds: list[float], ranked: list[int], place: _Placer | None) -> None:
        self.kept, self.analytic, self.parts, self.bounds, self.ranked, self.place = (
            kept, analytic, parts, bounds, ranked, place)
        self.pending: list[tuple[float, int]] = []  # min-heap of (full bound, index)
        self.next = 0
        self.bound = -math.inf

    def __iter__(self) -> _BoundOrder:
        return self

    def __next__(self) -> int:
        while self.next < len(self.ranked) and (
                not self.pending or self.bounds[self.ranked[self.next]] <= self.pending[0][0]):
            i = self.ranked[self.next]
            self.next += 1
            if self.place is not None:
                self.place(self.kept[i], only_known=True)
            heapq.heappush(self.pending, (self.analytic.bound_with_comm(self.kept[i].plan, self.parts[i]), i))
        if not self.pending:
            raise StopIteration
        self.bound, i = heapq.heappop(self.pending)
        return i


_SPECULATE = 5  # shapes annealed ahead per worker process


class _Placer:
    """Places candidates: one annealed placement (`_place`) per shape and kind layout
    (dp, tp, pp, layout), annealed on the path model of the shape's first candidate in lower-bound
    order (`first_of_shapes`; the ranking places in that order, so the shape's placement is the
    same whether the ranking is bounded -- and may rule that candidate out -- or exhaustive) and
    shared by the shape's other candidates."""

    def __init__(self, analytic: AnalyticModel, cluster: Cluster, seed: int, iterations: int | None,
                 fast: bool, jobs: int = 1) -> None:
        self.analytic, self.cluster, self.seed, self.iterations, self.fast = analytic, cluster, seed, iterations, fast
        self.placements: dict[tuple, PlacementResult] = {}
        self.first: dict[tuple, Plan] = {}
        self.jobs = jobs
        self.pool: Workers | None = None
        self.ahead: dict[tuple, Future] = {}

    def first_of_shapes(self, ordered: Iterator[Candidate],
                        full_bound: Callable[[Candidate], float] | None = None) -> None:
        """Remember each shape's first candidate plan of `ordered` (lower-bound order). With
        `jobs` > 1, start annealing shapes in worker processes, `_SPECULATE` per worker, for the
        ranking to take when it asks for them: of the first 2 x that many shapes, those whose
        first candidate has the least `full_bound` (the bound the ranking walks in; on 175B /
        1024 GPUs it asks for 7 shapes, all among the first 9, but not for the first two, whose
        communication rules them out)."""
        reps: dict[tuple, Candidate] = {}
        for c in ordered:
            key = (c.plan.dp, c.plan.tp, c.plan.pp, c.layout)
            if key not in self.first:
                self.first[key], reps[key] = c.plan, c
        if self.jobs > 1 and len(self.first) > 1:
            keys = list(self.first)[: 2 * _SPECULATE * self.jobs]
            if full_bound is not None:
                keys.sort(key=lambda k: full_bound(reps[k]))
            self.pool = Workers(self._anneal, self.jobs)
            self.ahead = {key: self.pool.submit(key) for key in keys[: _SPECULATE * self.jobs]}

    def _anneal(self, key: tuple) -> PlacementResult:
        rep = self.first[key]
        return _place(self.analytic.path_model(rep), self.cluster, rep, self.seed, self.iterations, self.fast)

    def close(self) -> None:
        """Drop the annealing nobody asked for (a worker still running one finishes it alone)."""
        if self.pool is not None:
            self.pool.close(wait=False)
            self.pool, self.ahead = None, {}

    def __call__(self, c: Candidate, only_known: bool = False) -> None:
        """Give `c` its shape's placement (`only_known`: only when already annealed)."""
        if c.placement is not None or c.plan.world_size <= 1:
            return
        key = (c.plan.dp, c.plan.tp, c.plan.pp, c.layout)
        res = self.placements.get(key)
        if res is None and only_known:
            return
        if res is None:
            ahead = self.ahead.pop(key, None)
            if ahead is not None and not ahead.cancel():  # a worker has it (or has it queued next)
                res = self.placements[key] = ahead.result()
            else:
                rep = self.first.get(key, c.plan)
                res = self.placements[key] = _place(self.analytic.path_model(rep), self.cluster, rep, self.seed,
                                                    self.iterations, self.fast)
        c.placement = res
        if res.order[: c.plan.world_size] != [c.plan.device_of(r) for r in range(c.plan.world_size)]:
            c.plan = dataclasses.replace(c.plan, device_order=res.order[: c.plan.world_size])
            if c.plan.device_order == list(range(c.plan.world_size)):
                c.plan = dataclasses.replace(c.plan, device_order=None)


class _MemoryFilter:
    """Per-device peaks of candidate plans (the one estimator, cached by unplaced plan) against
    each GPU's capacity, and the tally of what was pruned and why."""

    def __init__(self, graph: OpGraph, cluster: Cluster, memory_kwargs: dict[str, Any]) -> None:
        self.graph, self.cluster, self.memory_kwargs = graph, cluster, memory_kwargs
        self.devices = cluster.devices
        self.capacity = np.asarray([d.kind.memory_bytes for d in self.devices], dtype=np.int64)
        self.peak_cache: dict[str, np.ndarray] = {}
        self.checked: set[str] = set()  # every plan estimated, here or in a worker process
        self.reasons: Counter[str] = Counter()
        self.examples: dict[str, str] = {}
        self.events: list[tuple[str, str, int]] | None = None  # a worker's prunes, replayed in order

    def prune(self, reason: str, example: str, n: int = 1) -> None:
        self.reasons[reason] += n
        self.examples.setdefault(reason, example)
        if self.events is not None:
            self.events.append((reason, example, n))

    def rank_peaks(self, p: Plan) -> np.ndarray:
        """Peak bytes per rank; they do not depend on where the ranks are placed."""
        from plait.cost.memory import estimate_memory

        unplaced = p if p.device_order is None else dataclasses.replace(p, device_order=None)
        key = str(unplaced)
        hit = self.peak_cache.get(key)
        if hit is None:
            est = estimate_memory(self.graph, unplaced, self.cluster, **self.memory_kwargs)
            hit = np.asarray(est.peak_bytes[: p.world_size], dtype=np.int64)
            self.peak_cache[key] = hit
            self.checked.add(key)
        return hit

    def device_peaks(self, p: Plan) -> np.ndarray:
        out = np.zeros(len(self.devices), dtype=np.int64)
        out[_order(p)] = self.rank_peaks(p)
        return out

    def oom_reason(self, p: Plan, peaks: np.ndarray, suffix: str = "") -> tuple[str, str] | None:
        """(reason, example) naming the GPU that overflows most and by how much, or None."""
        order = _order(p)
        over = peaks[order] - self.capacity[order]
        worst = int(np.argmax(over))
        if over[worst] <= 0:
            return None
        dev = self.devices[order[worst]]
        return (f"out of memory on {dev.kind.name} ({dev.kind.memory_bytes / GiB:.0f} GiB){suffix}",
                f"{p}: GPU {dev.id} needs {peaks[order[worst]] / GiB:.2f} GiB")


def _fitting_candidates(groups: list[_Group], mem: _MemoryFilter, analytic: AnalyticModel,
                        space_hetero: bool, bar: Progress, total: int, jobs: int = 1) -> list[Candidate]:
    """Every enumerated plan that fits in memory (on a mixed cluster, after the uneven split).

    Sharding can only lower memory: with sequence parallelism, or a higher ZeRO stage up to 2,
    every term of a device's peak is at most what it is without. So once a configuration
    overflows at micro-batch m, the ones it dominates overflow at m too; dominators are checked
    first and their first failing micro-batch is remembered. That bound never crosses a family
    (every option but sequence parallelism, ZeRO and the micro-batch), so with `jobs` > 1 blocks of
    whole families are checked in worker processes (`plait.workers`) and their candidates and
    prunes are merged in block order: the same list, tally and examples as one process gives."""
    groups.sort(key=lambda g: (_memory_family(g), not g.key[4], -g.key[5] if g.key[5] <= 2 else 9))
    mixed = hetero.is_mixed(mem.cluster) and space_hetero
    bar.start("memory", total)
    blocks = _family_blocks(groups, 8 * jobs) if jobs > 1 else [groups]
    if len(blocks) < 2:
        kept = _fit_block(groups, mem, analytic, mixed, bar.advance)
        bar.stop()
        return kept

    def check(block: list[_Group]) -> tuple[list[Candidate], list[tuple[str, str, int]], set[str]]:
        # in a worker: this block's prunes and estimated plans, reported back to the parent
        mem.events, seen = [], set(mem.checked)
        kept = _fit_block(block, mem, analytic, mixed, lambda n: None)
        return kept, mem.events, mem.checked - seen

    kept: list[Candidate] = []

    def merge(i: int, result: tuple[list[Candidate], list[tuple[str, str, int]], set[str]]) -> None:
        block_kept, events, checked = result
        kept.extend(block_kept)
        for reason, example, n in events:
            mem.prune(reason, example, n)
        mem.checked |= checked
        bar.advance(sum(len(g.plans) for g in blocks[i]))

    map_parallel(check, blocks, jobs, on_each=merge)
    bar.stop()
    return kept


def _memory_family(g: _Group) -> tuple:
    """What the memory bound of `_fitting_candidates` compares across: all but sp, ZeRO, micro-batch."""
    dp, tp, pp, schedule, sp, zero, recompute, layout = g.key
    return (dp, tp, pp, schedule, recompute, layout)


def _family_blocks(groups: list[_Group], n: int) -> list[list[_Group]]:
    """`groups` (sorted by family) cut into about `n` runs of whole families of about equal plan
    counts (more blocks than workers: a block's work varies with how early it overflows)."""
    per = max(1, sum(len(g.plans) for g in groups) // max(1, n))
    blocks: list[list[_Group]] = []
    size = 0
    for i, g in enumerate(groups):
        if not blocks or (size >= per and _memory_family(g) != _memory_family(groups[i - 1])):
            blocks.append([])
            size = 0
        blocks[-1].append(g)
        size += len(g.plans)
    return blocks


def _fit_block(groups: list[_Group], mem: _MemoryFilter, analytic: AnalyticModel, mixed: bool,
               advance: Callable[[int], None]) -> list[Candidate]:
    """`_fitting_candidates` over `groups` (whole families, sorted), pruning into `mem`."""
    graph, cluster, devices = mem.graph, mem.cluster, mem.devices
    kept: list[Candidate] = []
    fails: dict[tuple, tuple[int, str, str]] = {}
    for g in groups:
        fam, sp, zero = _memory_family(g), g.key[4], g.key[5]
        bound: tuple[int, str, str] | None = None
        if zero <= 2:
            for sp_x in ((True, False) if not sp else (True,)):
                for zero_x in range(zero, 3):
                    hit = fails.get((fam, sp_x, zero_x))
                    if hit is not None and (sp_x, zero_x) != (sp, zero) and (bound is None or hit[0] < bound[0]):
                        bound = hit
        caps = None  # layer limits found for a smaller micro-batch still hold for larger ones
        for i, base in enumerate(g.plans):
            left = len(g.plans) - i  # larger micro-batches need more memory still
            if bound is not None and base.micro_batch >= bound[0]:
                mem.prune(bound[1], bound[2] + " (implied for less sharded variants)", left)
                advance(left)
                break
            p = base if g.order == list(range(base.world_size)) else dataclasses.replace(base, device_order=g.order)
            why = None
            if mixed:
                bal = hetero.balance(graph, p, cluster, layer_time=analytic.layer_time,
                                     peak_bytes=mem.device_peaks, caps=caps, devices=devices,
                                     kind_times=lambda k, q: analytic.layer_times(q, k))
                if bal is None:
                    why = mem.oom_reason(p, mem.device_peaks(p), " with any uneven split") or (
                        "no uneven split of layers/batch fits", str(p))
                else:
                    p, caps = bal.plan, bal.caps
            if why is None:
                why = mem.oom_reason(p, mem.device_peaks(p))
            if why is not None:
                fails[(fam, sp, zero)] = (base.micro_batch, *why)
                mem.prune(*why, left)
                advance(left)
                break
            kept.append(Candidate(plan=p, layout=g.layout))
            advance(1)
    return kept


def _runnable(kept: list[Candidate], supports: Callable[[Plan], tuple[bool, str]],
              mem: _MemoryFilter) -> list[Candidate]:
    """The candidates the runtime can run; the others are counted among the pruned."""
    runnable = []
    for c in kept:
        ok, why = supports(c.plan)
        if ok:
            runnable.append(c)
        else:
            mem.prune(f"the runtime cannot run it ({why.split(': ', 1)[0]})", f"{c.plan}: {why}")
    return runnable


def _place_and_rank(chosen: list[Candidate], graph: OpGraph, analytic: AnalyticModel, mem: _MemoryFilter,
                    evaluate: Evaluate | None, gb: int, bar: Progress, jobs: int = 1,
                    groups: list[_Group] | None = None) -> dict[str, dict[str, Any]]:
    """Fill each finalist's memory figures and time it (placed by the ranking, `_rank_analytic`):
    by `evaluate` when given, else analytically. With `jobs` > 1 the simulations run on worker
    processes (each is independent and deterministic: the same times), and once a worker would
    idle -- every finalist started -- it simulates the best finished finalist's start order
    (`_start_order_plan`), which `_default_order_baseline` needs for the best plan: on 175B /
    1024 GPUs the pick is a long simulation and finishes early. Returns those speculative
    simulations by plan text."""
    bar.start("simulate", len(chosen))
    for c in chosen:
        c.peak_bytes = mem.device_peaks(c.plan).tolist()
        c.headroom_by_kind = memory_headroom(c.peak_bytes, mem.devices, c.plan)
    ahead: dict[str, dict[str, Any]] = {}
    if evaluate is None:
        for c in chosen:
            c.tflops_per_gpu = analytic.flops_per_sample * gb / c.analytic_s / c.plan.world_size / 1e12
            c.throughput = gb / c.analytic_s
            bar.advance(1)
        bar.stop()
        return ahead

    def record(i: int, sim: dict[str, Any]) -> None:
        c = chosen[i]
        c.sim = sim
        c.iteration_time_s = float(sim["iteration_time_s"])
        c.tflops_per_gpu = sim.get("tflops_per_gpu")
        c.throughput = sim.get("throughput_samples_per_s")
        bar.advance(1)

    with Workers(lambda p: evaluate(graph, p), min(jobs, len(chosen) + 1)) as pool:
        futures = {pool.submit(c.plan): i for i, c in enumerate(chosen)}
        spare: tuple[Plan, Future] | None = None
        while futures:
            done, _ = wait(futures, return_when=FIRST_COMPLETED)
            for f in done:
                record(futures.pop(f), f.result())
            if spare is None and pool.parallel and groups is not None and len(futures) < pool.jobs:
                finished = [c for c in chosen if c.iteration_time_s is not None]
                base = _start_order_plan(min(finished, key=_final_order), groups)
                if base is not None:
                    spare = (base, pool.submit(base))
        if spare is not None:
            best = min(chosen, key=_final_order)
            if str(_start_order_plan(best, groups)) == str(spare[0]):  # type: ignore[arg-type]
                ahead[str(spare[0])] = spare[1].result()
            else:
                pool.close(wait=False)  # not the pick's: leave it
    bar.stop()
    return ahead


def _final_order(c: Candidate) -> tuple[float, str]:
    """The key the finalists are ranked by: near-ties go to the plan with fewer moving parts (each
    ZeRO stage or recompute level must buy 0.2 % to be preferred: a tiny model's ZeRO-3 "wins" by
    0.07 % of optimizer time, far inside the simulator's error, at the price of a harder run)."""
    return (c.time_s * (1 + TIE_PENALTY * _complexity(c.plan)), str(c.plan))


# Clusters from this many GPUs up search on every CPU by default: below it a simulation takes
# tens of milliseconds and forking workers costs more than it saves (bench/plan_search_time.py
# --nodes N --jobs J measures both sides).
PARALLEL_MIN_DEVICES = 256


def _search_jobs(jobs: int | None, cluster: Cluster) -> int:
    """Worker processes for a search: `jobs` when given, else every CPU on a large cluster."""
    if jobs is not None:
        return resolve_jobs(jobs)
    return resolve_jobs(None) if cluster.num_devices >= PARALLEL_MIN_DEVICES else 1


def _default_order_baseline(best: list[Candidate], groups: list[_Group], graph: OpGraph,
                            evaluate: Evaluate | None, mem: _MemoryFilter,
                            ahead: dict[str, dict[str, Any]] | None = None) -> None:
    """The best plan's time on its layout's start order (Megatron's default order on one kind),
    so the gain of placement is measured, not assumed. The annealing minimises a path model of
    communication, not the simulated time; where the start order simulates faster (and fits), the
    start order is kept and the annealed order's time is recorded (`placed_time_s`). `ahead`: start
    orders already simulated (by plan text, `_place_and_rank`)."""
    if not best:
        return
    c = best[0]
    base = _start_order_plan(c, groups)
    if evaluate is not None and base is not None:
        sim = (ahead or {}).get(str(base)) or evaluate(graph, base)
        c.default_order_time_s = float(sim["iteration_time_s"])
        peaks = mem.device_peaks(base)
        if c.default_order_time_s < c.time_s and mem.oom_reason(base, peaks) is None:
            c.placed_time_s, c.plan, c.sim = c.time_s, base, sim
            c.iteration_time_s = c.default_order_time_s
            c.tflops_per_gpu = sim.get("tflops_per_gpu")
            c.throughput = sim.get("throughput_samples_per_s")
            c.peak_bytes = peaks.tolist()
            c.headroom_by_kind = memory_headroom(c.peak_bytes, mem.devices, c.plan)
    else:
        c.default_order_time_s = c.iteration_time_s


def _start_order_plan(c: Candidate, groups: list[_Group]) -> Plan | None:
    """`c`'s plan on its layout's start order, or None when placement kept that order."""
    if c.placement is None or c.plan.device_order is None:
        return None
    start = _start_order(groups, c)
    return dataclasses.replace(c.plan, device_order=None if start == list(range(c.plan.world_size)) else start)


TIE_PENALTY = 0.002
_RECOMPUTE_LEVEL = {"none": 0, "selective": 1, "full": 2}


def _complexity(p: Plan) -> int:
    return p.zero + _RECOMPUTE_LEVEL.get(p.recompute, 0)


def _order(p: Plan) -> np.ndarray:
    return hetero.rank_order(p)


def _start_order(groups: list[_Group], c: Candidate) -> list[int]:
    p = c.plan
    key = (p.dp, p.tp, p.pp, p.schedule, p.sequence_parallel, p.zero, p.recompute, c.layout)
    for g in groups:
        if g.key == key:
            return g.order
    return list(range(p.world_size))


def _place(path: PathModel, cluster: Cluster, plan: Plan, seed: int, iterations: int | None,
           fast: bool = True) -> PlacementResult:
    """Pipette placement, starting from (and never worse than) the plan's current order."""
    devices = cluster.devices
    start = [plan.device_of(r) for r in range(plan.world_size)]
    taken = set(start)
    start += [d for d in range(len(devices)) if d not in taken]
    off = ~np.eye(len(start), dtype=bool)
    inv, lat = path.inv_bw[off], path.lat[off]
    if len(inv) == 0 or (np.allclose(inv, inv[0]) and np.allclose(lat, lat[0])):
        # every link alike: every order costs the same, keep Megatron's
        c = float(path.cost(np.asarray(start)))
        return PlacementResult(order=start, cost=c, default_cost=c, breakdown=path.breakdown(start),
                               default_breakdown=path.breakdown(start))
    return anneal(path, [d.kind.name for d in devices], [d.node for d in devices], start=start, seed=seed,
                  iterations=iterations, fast=fast)


PHASE_LABELS = {"memory": "checking memory", "analytic": "ranking analytically",
                "simulate": "placing + simulating", "search": "searching"}


class Progress:
    """A rich progress bar on stderr (or a callback), silent when disabled; `prefix` (the
    family, when the search driver runs several) leads the bar's label."""

    def __init__(self, enabled: bool, callback: Callable[[str, int, int], None] | None,
                 prefix: str = "") -> None:
        self.enabled, self.callback, self.prefix = enabled, callback, prefix
        self._bar: Any = None
        self._task: Any = None
        self.phase, self.done, self.total = "", 0, 0

    def start(self, phase: str, total: int) -> None:
        self.phase, self.done, self.total = phase, 0, total
        if self.callback is not None:  # the phase starts now (a caller timing phases needs to know)
            self.callback(phase, 0, total)
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            label = self.prefix + PHASE_LABELS.get(phase, phase)
            self._bar = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(phase, total=total)

    def advance(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.advance(self._task, n)
        if self.callback is not None:
            self.callback(self.phase, self.done, self.total)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
