"""GraphPipe's partitioner (Jeon et al., ASPLOS'25, §5): a DAG of pipeline stages for multi-branch models.

1. **Series-parallel decomposition** of the layer DAG (`plait.graph.sp`; layers that are not
   series-parallel are collapsed into one indivisible unit, reported in `GraphPartition.notes`).
2. **Binary search on the bottleneck** (GraphPipe: on the time per sample of the slowest
   stage). For a target ``T`` -- the most busy seconds per iteration any stage may have,
   ``T / B`` seconds per sample -- a dynamic programme over the decomposition finds the fewest
   GPUs (per GPU kind) that meet it. The smallest feasible ``T`` is found by bisection on a log
   scale; a few larger targets trade bottleneck for shorter pipelines, and the plans are scored
   by `plait.planners.graph_cost.StageCost.score`.
3. **The programme** ``Solve(node, k, tail)`` returns options (GPUs per kind, depth, latency,
   stages), Pareto-pruned on (GPUs, latency), for sub-graph `node` when `k` stages follow it on
   the longest path to the loss (the neighbouring schedule: a stage keeps ``1 + k + its own
   depth`` micro-batches in flight under graph 1F1B, which its memory check uses):

   * series node ``c_1; ...; c_n`` (solved from the back, so each part knows the depth after it):
     a run ``c_i..c_j`` as one stage, or ``c_i`` solved on its own; GPUs add, depths add;
     a parallel ``c_p`` inside a run ``c_i..c_j`` may take the run before it into one branch's
     first stage and the run after it into one branch's last stage (a stem or a small head
     shares a GPU with a branch instead of taking one of its own). A handed-on run reaches the
     stage that holds it however deep the branch nests (a branch that is itself a series ending
     in a parallel part hands it on again), never both ends of one branch (other branches would
     run both before and after that stage: a cycle); every stage list is checked to hold each
     layer exactly once (`StageCost.owners`);
   * parallel node: its branches sorted by work, runs of them grouped into one stage or solved
     on their own; GPUs add, depth and latency are the maximum;
   * a stage's GPUs: the fewest data-parallel replicas of one kind, at the micro-batch of least
     work that fits memory (each stage has its own micro-batch size), meeting ``T``.
4. Spare GPUs go one at a time to the stage with the most work while that lowers it; devices
   are handed out per kind in node order (`StageCost.to_plan`), so mixed kinds and uneven
   links enter through the kinds' speeds and memory and the all-reduce groups' links.

The result is a `plait.ir.plan.Plan` with `stages` and `stage_edges`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from plait.graph.sp import SPNode, decompose
from plait.planners.graph_cost import GraphPlanError, StageChoice, StageCost, best_micro_batch


@dataclass(frozen=True)
class _Opt:
    devs: tuple[int, ...]  # GPUs per kind (StageCost.kinds order)
    depth: int  # stages on its longest path
    lat: float  # one micro-batch's forward + backward along its longest path
    stages: tuple[StageChoice, ...]


@dataclass
class GraphPartition:
    """What the partitioner found: plans best first (analytic score), and how it searched."""

    stages: list[list[StageChoice]]  # candidate stage lists, best score first
    scores: list[float]
    search_time_s: float
    targets_tried: int
    tree: SPNode
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> list[StageChoice]:
        return self.stages[0]


class _NoFit(GraphPlanError):
    """No stage list meets any target at the current data-parallel degree."""


def _prune(opts: list[_Opt], limit: int, caps: tuple[int, ...]) -> list[_Opt]:
    """Drop options over the GPU counts and those another beats on every GPU count and latency."""
    opts = [o for o in opts if all(d <= c for d, c in zip(o.devs, caps))]
    opts.sort(key=lambda o: (sum(o.devs), o.lat, o.depth))
    kept: list[_Opt] = []
    for o in opts:
        if any(all(a <= b for a, b in zip(k.devs, o.devs)) and k.lat <= o.lat for k in kept):
            continue
        kept.append(o)
        if len(kept) >= limit:
            break
    return kept


class _Solver:
    def __init__(self, cost: StageCost, target: float, limit: int = 12) -> None:
        self.cost, self.T, self.limit = cost, target, limit
        self.caps = cost.counts
        self.nk = len(cost.kinds)
        self.memo: dict[tuple, list[_Opt]] = {}
        self.stage_memo: dict[tuple, list[_Opt]] = {}

    def zero(self) -> _Opt:
        return _Opt((0,) * self.nk, 0, 0.0, ())

    def stage(self, layers: tuple[str, ...], k: int) -> list[_Opt]:
        """One-stage options, one per GPU kind: the fewest replicas meeting the target."""
        key = (layers, k)
        hit = self.stage_memo.get(key)
        if hit is not None:
            return hit
        out = []
        for i, kind in enumerate(self.cost.kinds):
            cap, only = self.cost.dp_cap(kind), self.cost.uniform_dp
            # one allowed degree (uniform_dp): try it alone rather than skip the hundreds below it
            for dp in (range(1, cap + 1) if only is None else range(only, min(only, cap) + 1)):
                if not self.cost.dp_allowed(dp) or self.cost.row(layers, kind, dp)[0][0] > self.T:
                    continue
                ch = best_micro_batch(self.cost, layers, kind, dp, k + 1, self.T)
                if ch is not None:
                    devs = tuple(dp if j == i else 0 for j in range(self.nk))
                    out.append(_Opt(devs, 1, ch.t_mb, (ch,)))
                    break
        self.stage_memo[key] = out
        return out

    @staticmethod
    def series(a: _Opt, b: _Opt) -> _Opt:
        return _Opt(tuple(x + y for x, y in zip(a.devs, b.devs)), a.depth + b.depth, a.lat + b.lat,
                    a.stages + b.stages)

    @staticmethod
    def parallel(a: _Opt, b: _Opt) -> _Opt:
        return _Opt(tuple(x + y for x, y in zip(a.devs, b.devs)), max(a.depth, b.depth), max(a.lat, b.lat),
                    a.stages + b.stages)

    def solve(self, node: SPNode, k: int, tail: tuple[str, ...] = (), tail_branch: int = -1,
              head: tuple[str, ...] = (), head_branch: int = -1) -> list[_Opt]:
        """Options of `node` with `k` stages after it; `tail` layers join its sink stage and `head`
        layers its source stage (for a parallel node: those of branch `tail_branch` / `head_branch`;
        -1 tries each branch `_tail_branches` allows -- a tail must never be dropped, whatever the
        nesting: a series whose last part is parallel hands its tail on to that part)."""
        if node.kind == "parallel" and ((tail and tail_branch < 0) or (head and head_branch < 0)):
            tbs = self._tail_branches(node) if tail and tail_branch < 0 else [tail_branch]
            hbs = self._tail_branches(node) if head and head_branch < 0 else [head_branch]
            # not both on one branch: other branches would both follow and precede its stage
            out = [o for tb in tbs for hb in hbs if not (tail and head and tb == hb)
                   for o in self.solve(node, k, tail, tb, head, hb)]
            return _prune(out, self.limit, self.caps)
        key = (id(node), k, tail, tail_branch, head, head_branch)
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        if node.kind == "leaf":
            out = self.stage(head + node.layers + tail, k)
        elif node.kind == "series":
            out = self._series(node, k, tail, head)
        else:
            out = self._parallel(node, k, tail, tail_branch, head, head_branch)
        out = _prune(out, self.limit, self.caps)
        self.memo[key] = out
        return out

    def _series(self, node: SPNode, k: int, tail: tuple[str, ...], head: tuple[str, ...] = ()) -> list[_Opt]:
        ch = node.children
        n = len(ch)
        after: list[list[_Opt]] = [[] for _ in range(n + 1)]
        after[n] = [self.zero()]
        for i in range(n - 1, -1, -1):
            opts: list[_Opt] = []
            run: tuple[str, ...] = ()
            start = head if i == 0 else ()  # the series' own head joins its first stage
            for j in range(i + 1, n + 1):
                run = run + ch[j - 1].layers
                end_tail = tail if j == n else ()
                for o in after[j]:
                    for s in self.stage(start + run + end_tail, k + o.depth):
                        opts.append(self.series(s, o))
                    if j == i + 1 and ch[i].kind != "leaf":
                        for s in self.solve(ch[i], k + o.depth, end_tail, head=start):
                            opts.append(self.series(s, o))
                    for p in range(i, j) if j > i + 1 else ():
                        if ch[p].kind != "parallel":
                            continue
                        # the run before the parallel part joins one branch's first stage, the run
                        # after it one branch's last stage (a stem or a head sharing a branch's GPU)
                        lead = start + tuple(x for c in ch[i:p] for x in c.layers)
                        joined = tuple(x for c in ch[p + 1:j] for x in c.layers) + end_tail
                        for s in self.solve(ch[p], k + o.depth, joined, head=lead):
                            opts.append(self.series(s, o))
            after[i] = _prune(opts, self.limit, self.caps)
        return after[0]

    def _tail_branches(self, node: SPNode) -> list[int]:
        """Branches that may take a following run: the two with the least work (the balance
        a join layer can improve) -- all when there are few."""
        kind = self.cost.kinds[0]
        work = [(self.cost.seg_time(c.layers, kind, 1), i) for i, c in enumerate(node.children)]
        return [i for _, i in sorted(work)[:2]]

    def _parallel(self, node: SPNode, k: int, tail: tuple[str, ...], tail_branch: int,
                  head: tuple[str, ...] = (), head_branch: int = -1) -> list[_Opt]:
        kind = self.cost.kinds[0]
        order = sorted(range(len(node.children)),
                       key=lambda i: -self.cost.seg_time(node.children[i].layers, kind, 1))
        n = len(order)
        rest: list[list[_Opt]] = [[] for _ in range(n + 1)]
        rest[n] = [self.zero()]
        for i in range(n - 1, -1, -1):
            opts: list[_Opt] = []
            group: tuple[str, ...] = ()
            for j in range(i + 1, n + 1):
                members = order[i:j]
                group = group + node.children[order[j - 1]].layers
                t = tail if tail_branch in members else ()
                h = head if head_branch in members else ()
                if h and t and j - i < n:
                    continue  # head and tail in one stage that other branches run beside: a cycle
                layers = h + tuple(sorted(group, key=self.cost.pos.__getitem__)) + t
                singles = (self.solve(node.children[members[0]], k, t, head=h) if j == i + 1 else
                           self.stage(layers, k))
                for o in rest[j]:
                    for s in singles:
                        opts.append(self.parallel(s, o))
            rest[i] = _prune(opts, self.limit, self.caps)
        return rest[0]


def _spread(cost: StageCost, stages: list[StageChoice]) -> list[StageChoice]:
    """Hand the GPUs no stage needed to the stage with the most work while that lowers it."""
    stages = list(stages)
    used = {k: 0 for k in cost.kinds}
    for st in stages:
        used[st.kind] += st.dp
    spare = {k: c - used[k] for k, c in zip(cost.kinds, cost.counts)}
    depths = cost.depths(stages)
    stuck: set[int] = set()
    while True:
        cand = [i for i, st in enumerate(stages) if spare[st.kind] > 0 and i not in stuck
                and st.dp < cost.dp_cap(st.kind) and cost.uniform_dp is None]
        if not cand:
            return stages
        i = max(cand, key=lambda s: stages[s].work)
        st = stages[i]
        better = best_micro_batch(cost, st.layers, st.kind, st.dp + 1, depths[i] + 1)
        if better is None or better.work >= st.work * (1 - 1e-6):
            stuck.add(i)
            continue
        stages[i] = better
        spare[st.kind] -= 1


def _capped(cost: StageCost, stages: list[StageChoice]) -> list[list[StageChoice]]:
    """The stage list, and the same stages with their micro-batches capped at each smaller power
    of two: each stage's own choice minimises its busy time (the largest micro-batch that fits),
    a cap trades that for less pipeline fill -- the score (`StageCost.score`) weighs the two."""
    out = [stages]
    depths = cost.depths(stages)
    top = max(s.micro_batch for s in stages)
    for cap in (b for b in cost.micro_batches(1) if b < top and b & (b - 1) == 0):
        capped = []
        for st, k in zip(stages, depths):
            ch = best_micro_batch(cost, st.layers, st.kind, st.dp, k + 1, max_b=cap) \
                if st.micro_batch > cap else st
            capped.append(ch if ch is not None else st)
        out.append(capped)
    return out


def replica_counts(cost: StageCost) -> list[int | None]:
    """Data-parallel degrees the search tries for every stage at once: powers of two up to the GPUs
    of the most common kind, and that count itself."""
    n = max(cost.counts)
    out = sorted({d for d in (2**i for i in range(12)) if d <= n} | {n})
    if cost.max_dp is not None:
        out = [d for d in out if d <= cost.max_dp]
    return out


def partition(cost: StageCost, *, candidates: int = 4, tolerance: float = 0.03, limit: int = 12,
              replicas: list[int | None] | None = None) -> GraphPartition:
    """GraphPipe's search (module docstring): candidate stage lists, best analytic score first.

    `replicas`: the data-parallel degrees to try: ``None`` for any degree per stage (GraphPipe's
    own space: the stage graph deals each stage's micro-batches to its replicas in turn, so
    stages of different degrees keep each other busy, `plait.ir.stage_graph`), an integer ``d``
    for every stage at ``d`` (the stage graph replicated d times; `StageCost.uniform_dp`).
    Default: ``None`` and each of `replica_counts` -- the uniform plans are a few more
    candidates for the same score, cheap next to the per-stage search."""
    t0 = time.perf_counter()
    graph = cost.graph
    if not graph.layers:
        raise GraphPlanError(f"graph plan: model {graph.model!r} has no layers")
    tree = decompose(graph)
    notes = []
    if not any(n.kind == "parallel" for n in _walk(tree)):
        notes.append(f"model {graph.model!r} has no branches (its layer DAG is a chain): the graph plan is a "
                     "sequential pipeline")
    for leaf in tree.collapsed_leaves():
        notes.append(f"layers {list(leaf.layers)[:4]}{'...' if len(leaf.layers) > 4 else ''} are not "
                     "series-parallel: kept together in one stage")
    found: dict[tuple, tuple[float, int, list[StageChoice], bool]] = {}
    tried = 0
    saved = cost.uniform_dp
    try:
        for d in (replicas if replicas is not None else [None, *replica_counts(cost)]):
            cost.uniform_dp = d
            try:
                tried += _search(cost, tree, found, tolerance, limit)
            except _NoFit:  # this degree fits nowhere; any other error is a bug to surface
                continue
    finally:
        cost.uniform_dp = saved
    if not found:
        raise GraphPlanError(f"graph plan: no partition of model {graph.model!r} fits the memory of "
                             f"cluster {cost.cluster.name!r} (every stage over its GPUs' memory)")
    # Equal scores: the shorter pipeline first (less fill than the score counts, fewer in flight).
    # The analytic score only approximates the simulator that ranks the candidates, so the best of
    # the plain space (every stage one degree, each stage's own micro-batch) are kept beside the
    # best of the wider one (per-stage degrees, capped micro-batches) rather than crowded out.
    order = sorted(found.values(), key=lambda x: (x[0] * (1 + 1e-9), x[1]))
    ranked = order[:candidates]
    ranked += [x for x in order if x[3] and not any(x is y for y in ranked)][:max(0, candidates - sum(
        1 for x in ranked if x[3]))]
    ranked.sort(key=lambda x: (x[0] * (1 + 1e-9), x[1]))
    return GraphPartition([x[2] for x in ranked], [x[0] for x in ranked], time.perf_counter() - t0,
                          tried, tree, notes)


def _search(cost: StageCost, tree: SPNode, found: dict, tolerance: float, limit: int) -> int:
    """Bisection on the bottleneck target for the current `cost` (module docstring, step 2);
    adds every stage list it meets to `found`; returns the targets tried."""
    names = tuple(cost.graph.layer_names)
    fastest = cost.kinds[0]
    b_top = cost.micro_batches(1)[-1]
    per_sample = cost.seg_time(names, fastest, b_top) / b_top
    lo = per_sample * cost.global_batch / max(1, sum(cost.counts)) * 0.5
    hi = per_sample * cost.global_batch * 2 + cost.allreduce(cost.params(names), fastest, 2)
    tried = 0

    def attempt(target: float) -> bool:
        nonlocal tried
        tried += 1
        opts = _Solver(cost, target, limit).solve(tree, 0)
        for o in opts:
            spread = _spread(cost, list(o.stages))
            for i, st in enumerate(_capped(cost, spread)):
                key = tuple(sorted((s.layers, s.kind, s.dp, s.micro_batch) for s in st))
                base = i == 0 and cost.uniform_dp is not None
                if key not in found or (base and not found[key][3]):
                    found[key] = (cost.score(st), cost.pipeline_depth(st), st, base)
        return bool(opts)

    grow = 0
    while not attempt(hi):
        hi *= 4
        grow += 1
        if grow > 6:
            raise _NoFit("no partition fits")
    while hi / lo > 1 + tolerance:
        mid = math.sqrt(hi * lo)
        if attempt(mid):
            hi = mid
        else:
            lo = mid
    for f in (1.1, 1.3, 1.6):  # trade bottleneck for a shorter pipeline
        attempt(hi * f)
    return tried


def _walk(node: SPNode):
    yield node
    for c in node.children:
        yield from _walk(c)
