"""Sequential pipeline planners GraphPipe compares against: PipeDream's and Piper's dynamic programmes.

Both return stage lists (`plait.planners.graph_cost.StageChoice`) scored with the same analytic
objective as GraphPipe's partitioner; the search driver ranks all of them with the simulator.

* **PipeDream** (Narayanan et al., SOSP'19, §3.1): the layer DAG is linearised into a chain (the
  model's topological order; PipeDream's antichain DAG of a branchy model is the chain of its
  downsets along one such order), then ``A[i][m] = min_{j, m'} max(A[j][m - m'], T(i..j, m'))``
  over the suffix from layer ``i`` on ``m`` GPUs, where ``T`` is a stage's busy time with ``m'``
  data-parallel replicas (`StageCost.work`: compute plus gradient all-reduce). One micro-batch
  size for all stages (the best of the candidates by the analytic score). On a mixed cluster the
  GPUs are taken fastest kind first and a stage runs at the pace of its slowest GPU.
* **Piper** (Tarnawski et al., NeurIPS'21): a DP over *ideals* (predecessor-closed layer sets; the
  stage between two nested ideals is convex). Its public code enumerates the ideals and gives up
  past 40,000; b parallel chains of L layers have (L+1)^b of them. `piper` counts them first
  (`plait.graph.sp.count_ideals`) and answers "would need N ideals" past the cap; it also stops
  where the pairs of ideals the DP visits exceed `pair_budget` (this port is Python).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import networkx as nx
import numpy as np

from plait.graph.sp import count_ideals
from plait.planners.graph_cost import StageChoice, StageCost

PIPER_IDEAL_CAP = 40_000


@dataclass
class BaselineResult:
    name: str
    stages: list[StageChoice] | None  # None: the planner could not run (see `note`)
    score: float
    search_time_s: float
    note: str = ""
    ideals: int | None = None


def _device_order(cost: StageCost) -> list[str]:
    """Kind of each GPU position, fastest kind first (a stage spanning positions is as slow as its last)."""
    return [k for k, n in zip(cost.kinds, cost.counts) for _ in range(n)]


def pipedream(cost: StageCost, replicas: list[int | None] | None = None) -> BaselineResult:
    """PipeDream's planner on the linearised model (module docstring). `replicas`: as
    `plait.planners.graphpipe.partition` (default: PipeDream's own per-stage degrees, ``None``, and
    every stage the same degree, each of `replica_counts`)."""
    from plait.planners.graphpipe import replica_counts

    t0 = time.perf_counter()
    names = cost.graph.layer_names
    n, D = len(names), sum(cost.counts)
    kind_at = _device_order(cost)
    best: tuple[float, list[StageChoice]] | None = None
    saved = cost.uniform_dp
    try:
        for d in (replicas if replicas is not None else [None, *replica_counts(cost)]):
            cost.uniform_dp = d
            for b in _powers(cost):
                stages = _pipedream_dp(cost, names, n, D, kind_at, b)
                if stages is None:
                    continue
                score = cost.score(stages, chain=True)
                if best is None or score < best[0]:
                    best = (score, stages)
    finally:
        cost.uniform_dp = saved
    dt = time.perf_counter() - t0
    if best is None:
        return BaselineResult("pipedream", None, math.inf, dt, "no chain partition fits memory")
    return BaselineResult("pipedream", best[1], best[0], dt)


def _powers(cost: StageCost) -> list[int]:
    """One micro-batch size for every stage: the powers of two a single replica can take."""
    return [b for b in cost.micro_batches(1) if b & (b - 1) == 0]


def _pipedream_dp(cost: StageCost, names: list[str], n: int, D: int, kind_at: list[str],
                  b: int) -> list[StageChoice] | None:
    inf = math.inf
    A = np.full((n + 1, D + 1), inf)  # A[i][m]: bottleneck of layers i.. on the last m GPUs
    A[n][0] = 0.0
    depth = np.zeros((n + 1, D + 1), dtype=np.int64)
    arg: dict[tuple[int, int], tuple[int, int]] = {}
    for i in range(n - 1, -1, -1):
        for j in range(i + 1, n + 1):
            seg = tuple(names[i:j])
            dps = [cost.uniform_dp] if cost.uniform_dp else range(1, D + 1)
            by_kind = {}
            for k in set(kind_at):
                vec = np.full(D, math.inf)
                for dp in dps:
                    if dp <= D:
                        vec[dp - 1] = _work(cost, seg, k, dp, b)
                by_kind[k] = vec
            step = cost.uniform_dp or 1
            for rest in range(0, D, step):
                if not math.isfinite(A[j][rest]) or (j == n) != (rest == 0):
                    continue
                kind = kind_at[D - rest - 1]  # the slowest GPU of any range ending there
                width = D - rest
                w = by_kind[kind][:width]
                val = np.maximum(w, A[j][rest])
                for dp in np.flatnonzero(val < A[i][rest + 1:rest + 1 + width]) + 1:
                    if not cost.fits(seg, kind, int(dp), b, int(depth[j][rest]) + 1):
                        continue
                    A[i][rest + dp] = val[dp - 1]
                    depth[i][rest + dp] = depth[j][rest] + 1
                    arg[(i, rest + dp)] = (j, rest)
    m = int(np.argmin(A[0]))
    if not math.isfinite(A[0][m]):
        return None
    stages, i = [], 0
    while i < n:
        j, rest = arg[(i, m)]
        dp = m - rest
        kind = kind_at[D - rest - 1]
        w, t = cost.work(tuple(names[i:j]), kind, dp, b)
        stages.append(StageChoice(tuple(names[i:j]), kind, dp, b, w, t))
        i, m = j, rest
    return stages


def _work(cost: StageCost, seg: tuple[str, ...], kind: str, dp: int, b: int) -> float:
    n = -(-cost.global_batch // dp)
    if b > n or dp > cost.dp_cap(kind) or not cost.dp_allowed(dp):
        return math.inf
    return cost.work(seg, kind, dp, b)[0]


def piper(cost: StageCost, *, cap: int = PIPER_IDEAL_CAP, pair_budget: int = 300_000) -> BaselineResult:
    """Piper's DP over ideals, or why it was not run (module docstring)."""
    t0 = time.perf_counter()
    n_ideals = count_ideals(cost.graph)
    if n_ideals > cap:
        return BaselineResult("piper", None, math.inf, time.perf_counter() - t0,
                              f"would need {n_ideals:,} ideals (Piper gives up past {cap:,})", n_ideals)
    ideals = _ideals(cost)
    D = sum(cost.counts)
    pairs = len(ideals) * (len(ideals) - 1) // 2
    if pairs * D > pair_budget:
        return BaselineResult("piper", None, math.inf, time.perf_counter() - t0,
                              f"{n_ideals:,} ideals: {pairs:,} ideal pairs x {D} GPUs is past this port's "
                              f"budget of {pair_budget:,}", n_ideals)
    kind_at = _device_order(cost)
    best: tuple[float, list[StageChoice]] | None = None
    for b in _powers(cost):
        stages = _piper_dp(cost, ideals, D, kind_at, b)
        if stages is not None:
            score = cost.score(stages, chain=True)
            if best is None or score < best[0]:
                best = (score, stages)
    dt = time.perf_counter() - t0
    if best is None:
        return BaselineResult("piper", None, math.inf, dt, "no partition fits memory", n_ideals)
    return BaselineResult("piper", best[1], best[0], dt, "", n_ideals)


def _ideals(cost: StageCost) -> list[frozenset[str]]:
    """Every ideal of the layer DAG, smallest first."""
    dag = cost.graph.layer_dag()
    preds = {v: set(dag.predecessors(v)) for v in dag.nodes}
    seen = {frozenset()}
    frontier = [frozenset()]
    while frontier:
        nxt = []
        for cur in frontier:
            for v in dag.nodes:
                if v not in cur and preds[v] <= cur:
                    s = cur | {v}
                    if s not in seen:
                        seen.add(s)
                        nxt.append(s)
        frontier = nxt
    # ties between ideals of one size broken by their layers' positions, not by the set's order
    # (string hashes change with every process: the DP then kept a different one of two
    # equal-bottleneck partitions from run to run, and the bench's Piper row moved by 0.2 %)
    pos = cost.pos
    return sorted(seen, key=lambda s: (len(s), sorted(pos[v] for v in s)))


def _piper_dp(cost: StageCost, ideals: list[frozenset[str]], D: int, kind_at: list[str],
              b: int) -> list[StageChoice] | None:
    """best[I][m]: bottleneck of the ideal I on the first m GPUs; the last stage is I minus a
    smaller ideal J (`ideals` grow in size, so J is solved before I)."""
    pos = cost.pos
    index = {s: k for k, s in enumerate(ideals)}
    best = np.full((len(ideals), D + 1), math.inf)
    best[0][0] = 0.0
    arg: dict[tuple[int, int], tuple[int, int]] = {}
    for k, big in enumerate(ideals[1:], start=1):
        for small in itertools.islice(ideals, 0, k):
            if not small < big:
                continue
            j = index[small]
            seg = tuple(sorted(big - small, key=pos.__getitem__))
            for used in range(0, D):
                if not math.isfinite(best[j][used]):
                    continue
                for dp in range(1, D - used + 1):
                    kind = kind_at[used + dp - 1]
                    w = _work(cost, seg, kind, dp, b)
                    val = max(w, best[j][used])
                    if val < best[k][used + dp]:
                        best[k][used + dp] = val
                        arg[(k, used + dp)] = (j, used)
    full = len(ideals) - 1
    m = int(np.argmin(best[full]))
    if not math.isfinite(best[full][m]):
        return None
    stages = []
    k = full
    while k:
        j, used = arg[(k, m)]
        seg = tuple(sorted(ideals[k] - ideals[j], key=pos.__getitem__))
        dp = m - used
        kind = kind_at[used + dp - 1]
        w, t = cost.work(seg, kind, dp, b)
        stages.append(StageChoice(seg, kind, dp, b, w, t))
        k, m = j, used
    stages.reverse()
    if not nx.is_directed_acyclic_graph(nx.DiGraph(cost.stage_edges(stages, chain=True))):
        return None
    return stages
