"""Schedule builders: GPipe, 1F1B, interleaved 1F1B and graph 1F1B as per-rank action lists.

Each builder first fixes the order of the compute actions of every rank (the schedule
proper) and then `_with_comm` places the point-to-point actions: the receives of a
compute action just before it, its sends just after it, peers in sample order.

* **GPipe** (Huang et al. 2019): all forwards, then all backwards (latest first).
* **1F1B** (PipeDream-Flush, Narayanan et al. 2021 §2.2; Megatron-LM's
  `forward_backward_pipelining_without_interleaving`): rank ``p`` of ``pp`` runs
  ``min(pp - p - 1, m)`` warm-up forwards, then alternates one forward and one backward,
  then drains the remaining backwards.
* **Eager 1F1B** (the 1F1B variant with a longer warm-up that overlaps point-to-point
  messages with compute; Qi et al., Zero Bubble Pipeline Parallelism, ICLR'24 §4): rank
  ``p`` runs ``min(2 (pp - p - 1), m)`` warm-up forwards, so about twice as many
  micro-batches are in flight -- a message's round trip over a slow link between stages
  is covered by compute instead of stalling the stage -- at the memory of up to
  ``2 (pp - p) - 1`` micro-batches' activations. Chains only.
* **Interleaved 1F1B** (Narayanan et al. SC'21 §2.2; Megatron-LM's
  `forward_backward_pipelining_with_interleaving`): rank ``p`` holds ``v`` chunks;
  micro-batches go through the chunks in groups of ``pp``; warm-up is
  ``(pp - p - 1) * 2 + (v - 1) * pp`` units (all ``m * v`` when ``m == pp``).
* **Graph 1F1B** (GraphPipe, Jeon et al. ASPLOS'25): 1F1B on every stage of a DAG, with
  the warm-up of a stage counting all its successors -- the longest path to a sink --
  so each stage keeps enough micro-batches in flight to fill its deepest branch. A stage
  that runs per input has one node per segment: a micro-batch's forward runs its segments
  in order, each after its own inputs, so a fan-in stage starts its own branch's work before
  the other inputs arrive (GraphPipe runs operators as their inputs arrive).
"""

from __future__ import annotations

from functools import lru_cache

from plait.schedule.core import Action, PipelineGraph, Schedule, ScheduleError, in_flight

# (op, node id, micro-batch)
_Step = tuple[str, int, int]

SCHEDULES = ("gpipe", "1f1b", "eager_1f1b", "interleaved", "graph_1f1b")


# ---------------------------------------------------------------- compute orders
def _order_1f1b(node: int, warm: int, m: int) -> list[_Step]:
    warm = min(warm, m)
    order: list[_Step] = [("fwd", node, i) for i in range(warm)]
    for i in range(m - warm):
        order.append(("fwd", node, warm + i))
        order.append(("bwd", node, i))
    order += [("bwd", node, i) for i in range(m - warm, m)]
    return order


def _order_gpipe(graph: PipelineGraph, stage: int) -> list[_Step]:
    topo = graph.topological_order()
    nodes = sorted(graph.nodes_of(stage), key=topo.index)
    m = max(graph.nodes[n].micro_batches for n in nodes)
    order: list[_Step] = []
    for i in range(m):
        order += [("fwd", n, i) for n in nodes if i < graph.nodes[n].micro_batches]
    for i in reversed(range(m)):
        order += [("bwd", n, i) for n in reversed(nodes) if i < graph.nodes[n].micro_batches]
    return order


def _order_interleaved(graph: PipelineGraph, stage: int, pp: int, v: int, m: int) -> list[_Step]:
    """Megatron-LM's order: unit k is chunk (k mod pp*v) // pp of micro-batch group k // (pp*v)."""
    total = m * v
    warm = total if m == pp else min((pp - stage - 1) * 2 + (v - 1) * pp, total)
    node_of = [graph.node_id(stage, c) for c in range(v)]

    def unit(k: int, forward: bool) -> tuple[int, int]:
        group = k // (pp * v)
        chunk = (k % (pp * v)) // pp
        if not forward:
            chunk = v - 1 - chunk
        return node_of[chunk], group * pp + k % pp

    order: list[_Step] = [("fwd", *unit(k, True)) for k in range(warm)]
    for k in range(total - warm):
        order.append(("fwd", *unit(warm + k, True)))
        order.append(("bwd", *unit(k, False)))
    order += [("bwd", *unit(k, False)) for k in range(total - warm, total)]
    return order


# ---------------------------------------------------------------- send / recv placement
def _with_comm(graph: PipelineGraph, name: str, orders: list[list[_Step]]) -> Schedule:
    """Receives just before each compute action, sends just after it (peers in sample order)."""
    pieces_in: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}  # (node, mb) -> (pred, mb, lo, hi)
    pieces_out: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}  # (node, mb) -> (succ, mb, lo, hi)
    for a, b in sorted(graph.edges):
        for j, i, lo, hi in graph.overlaps(a, b):
            pieces_in.setdefault((b, i), []).append((a, j, lo, hi))
            pieces_out.setdefault((a, j), []).append((b, i, lo, hi))
    nodes = graph.nodes
    # Pieces to or from one peer go in the peer's compute order, so both ends of a channel
    # post their messages in the same (FIFO) order.
    pos = {step: k for order in orders for k, step in enumerate(order)}
    out: list[tuple[Action, ...]] = []
    for stage, order in enumerate(orders):
        acts: list[Action] = []
        for op, n, mb in order:
            me = nodes[n]

            def peer_order(piece: tuple[int, int, int, int], op: str = op) -> tuple[int, int]:
                return pos.get((op, piece[0], piece[1]), 0), piece[0]

            remote_in = sorted((p for p in pieces_in.get((n, mb), []) if nodes[p[0]].stage != stage), key=peer_order)
            remote_out = sorted((p for p in pieces_out.get((n, mb), []) if nodes[p[0]].stage != stage),
                                key=peer_order)
            if op == "fwd":
                before = [Action("recv_fwd", stage, me.chunk, mb, (nodes[a].stage, nodes[a].chunk, j), (lo, hi))
                          for a, j, lo, hi in remote_in]
                after = [Action("send_fwd", stage, me.chunk, mb, (nodes[b].stage, nodes[b].chunk, i), (lo, hi))
                         for b, i, lo, hi in remote_out]
            else:
                before = [Action("recv_bwd", stage, me.chunk, mb, (nodes[b].stage, nodes[b].chunk, i), (lo, hi))
                          for b, i, lo, hi in remote_out]
                after = [Action("send_bwd", stage, me.chunk, mb, (nodes[a].stage, nodes[a].chunk, j), (lo, hi))
                         for a, j, lo, hi in remote_in]
            acts += before + [Action(op, stage, me.chunk, mb)] + after
        out.append(tuple(acts))
    return Schedule(name, graph, tuple(out))


# ---------------------------------------------------------------- builders
def _stages(graph: PipelineGraph) -> range:
    missing = [s for s in range(graph.num_stages) if not graph.nodes_of(s)]
    if missing:
        raise ScheduleError(f"pipeline graph field 'nodes': stages {missing[:3]} run no node")
    return range(graph.num_stages)


@lru_cache(maxsize=512)
def gpipe(graph: PipelineGraph) -> Schedule:
    """GPipe: every forward of the step, then every backward (any DAG, any chunks per rank)."""
    return _with_comm(graph, "gpipe", [_order_gpipe(graph, s) for s in _stages(graph)])


def _is_chain(graph: PipelineGraph) -> bool:
    return sorted(graph.edges) == [(k, k + 1) for k in range(len(graph.nodes) - 1)] and \
        all(node.stage == k and node.chunk == 0 for k, node in enumerate(graph.nodes))


@lru_cache(maxsize=512)
def one_f_one_b(graph: PipelineGraph) -> Schedule:
    """1F1B on a linear pipeline (node k on rank k): warm-up of pp - p - 1 forwards."""
    if not _is_chain(graph):
        raise ScheduleError("1f1b: the pipeline graph is not a chain of one node per stage "
                            "(use graph_1f1b for a DAG, interleaved for several chunks per stage)")
    pp = len(graph.nodes)
    return _with_comm(graph, "1f1b", [_order_1f1b(p, pp - p - 1, graph.nodes[p].micro_batches) for p in range(pp)])


def eager_warmup(pp: int, p: int) -> int:
    """Eager 1F1B's warm-up forwards on rank `p` of `pp` (before capping at m)."""
    return 2 * (pp - p - 1)


@lru_cache(maxsize=512)
def eager_1f1b(graph: PipelineGraph) -> Schedule:
    """Eager 1F1B on a linear pipeline: warm-up of 2 (pp - p - 1) forwards (module docstring)."""
    if not _is_chain(graph):
        raise ScheduleError("eager_1f1b: the pipeline graph is not a chain of one node per stage")
    pp = len(graph.nodes)
    return _with_comm(graph, "eager_1f1b", [_order_1f1b(p, eager_warmup(pp, p), graph.nodes[p].micro_batches)
                                            for p in range(pp)])


def _forwards_before_backwards(graph: PipelineGraph) -> dict[int, list[int]]:
    """Per node, how many of its forwards must precede its backward of each micro-batch.

    GraphPipe's rule is the 1F1B warm-up with depth = longest path to a sink: before
    backward ``i`` a stage has run ``depth + i + 1`` forwards -- ``depth * d + i + 1`` on a
    stage whose micro-batches are dealt to ``d`` replicas in turn, so that each replica keeps
    its own ``depth + 1`` in flight (PipeDream's 1F1B-RR). When stages' micro-batch
    sizes differ that is not always enough: backward ``i`` waits for the successors'
    backwards of the micro-batches that overlap its samples, and those successors have
    by then run their own quota of forwards, which need this stage's forwards of every
    micro-batch that overlaps theirs. So the quota is also at least what the successors'
    quotas need from this stage, along every path (sinks first)."""
    topo = graph.topological_order()
    depth = graph.depth()
    ends = {n: [hi for _, hi in graph.nodes[n].ranges()] for n in range(len(graph.nodes))}
    reach: dict[int, set[int]] = {}
    for n in reversed(topo):
        reach[n] = {n}.union(*(reach[b] for b in graph.successors(n)))
    memo: dict[tuple[int, int, int], int] = {}

    def cover(p: int, samples: int) -> int:
        """Forwards of node p needed to produce its first `samples` samples."""
        return next(k + 1 for k, e in enumerate(ends[p]) if e >= samples)

    def needed(n: int, b: int, count: int) -> int:
        """Forwards of n needed for descendant b to run its first `count` forwards."""
        key = (n, b, count)
        if key not in memo:
            samples = ends[b][count - 1]
            memo[key] = max((cover(p, samples) if p == n else needed(n, p, cover(p, samples))
                             for p in graph.predecessors(b) if p in reach[n]), default=0)
        return memo[key]

    quota: dict[int, list[int]] = {}
    for n in reversed(topo):
        m = graph.nodes[n].micro_batches
        q = []
        for i in range(m):
            want = depth[n] * graph.nodes[n].replicas + i + 1
            for b in graph.successors(n):
                for j, k, _, _ in graph.overlaps(n, b):
                    if j == i:
                        want = max(want, needed(n, b, quota[b][k]))
            q.append(min(m, max(want, q[-1] if q else 0)))
        quota[n] = q
    return quota


@lru_cache(maxsize=512)
def graph_1f1b(graph: PipelineGraph) -> Schedule:
    """GraphPipe's 1F1B on a stage DAG: a stage's warm-up is its longest path to a sink
    (raised where differing micro-batch sizes need more, see `_forwards_before_backwards`)."""
    _segments_only(graph, "graph_1f1b")
    quota = _forwards_before_backwards(graph)
    topo = graph.topological_order()
    orders = []
    for s in _stages(graph):
        # a stage that runs per input has one node per segment: each micro-batch's forward runs
        # them in order (each after its own inputs), its backward in reverse
        nodes = sorted(graph.nodes_of(s), key=topo.index)
        q_stage = [max(qs) for qs in zip(*(quota[n] for n in nodes))]
        order: list[_Step] = []
        f = 0
        for i, q in enumerate(q_stage):
            order += [("fwd", n, k) for k in range(f, q) for n in nodes]
            f = max(f, q)
            order += [("bwd", n, i) for n in reversed(nodes)]
        orders.append(order)
    return _with_comm(graph, "graph_1f1b", orders)


def _segments_only(graph: PipelineGraph, name: str) -> None:
    """Several nodes on one stage only as the segments of one stage: the same micro-batches."""
    for s in _stages(graph):
        nodes = [graph.nodes[n] for n in graph.nodes_of(s)]
        if len({(n.sizes, n.replicas) for n in nodes}) != 1:
            raise ScheduleError(f"{name}: stage {s} runs {len(nodes)} chunks with different micro-batches; "
                                f"{name} runs one node per stage or the segments of one (use the interleaved "
                                "schedule for model chunks)")


@lru_cache(maxsize=512)
def interleaved_1f1b(graph: PipelineGraph) -> Schedule:
    """Megatron's interleaved 1F1B: a chain of pp * v nodes, node k on rank k % pp as chunk k // pp."""
    pp = graph.num_stages
    n = len(graph.nodes)
    if n % pp:
        raise ScheduleError(f"interleaved: {n} nodes on {pp} stages is not the same number of chunks per stage")
    v = n // pp
    if sorted(graph.edges) != [(k, k + 1) for k in range(n - 1)] or \
            any(node.stage != k % pp or node.chunk != k // pp for k, node in enumerate(graph.nodes)):
        raise ScheduleError("interleaved: the pipeline graph is not a chain with node k on stage k % pp, "
                            "chunk k // pp (PipelineGraph.chain)")
    ms = {node.micro_batches for node in graph.nodes}
    if len(ms) != 1:
        raise ScheduleError(f"interleaved: every chunk must run the same number of micro-batches, got {sorted(ms)}")
    m = ms.pop()
    if v > 1 and m % pp:
        raise ScheduleError(f"interleaved: {m} micro-batches is not a multiple of pp={pp} "
                            f"(Megatron's interleaved schedule runs them in groups of pp)")
    if v == 1:  # one chunk per rank: interleaving is plain 1F1B
        return one_f_one_b(graph)
    return _with_comm(graph, "interleaved", [_order_interleaved(graph, p, pp, v, m) for p in range(pp)])


def build(name: str, graph: PipelineGraph) -> Schedule:
    """The schedule called `name` ("gpipe", "1f1b", "eager_1f1b", "interleaved", "graph_1f1b") on `graph`.

    "1f1b" on a graph that is not a chain builds graph 1F1B (its generalisation)."""
    if name == "gpipe":
        return gpipe(graph)
    if name == "1f1b":
        return one_f_one_b(graph) if _is_chain(graph) else graph_1f1b(graph)
    if name == "eager_1f1b":
        return eager_1f1b(graph)
    if name == "interleaved":
        return interleaved_1f1b(graph)
    if name == "graph_1f1b":
        return graph_1f1b(graph)
    raise ScheduleError(f"schedule: must be one of {SCHEDULES}, got {name!r}")


@lru_cache(maxsize=4096)
def chain_in_flight(name: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> tuple[float, ...]:
    """`in_flight` of schedule `name` on a linear pipeline of `pp` ranks (`PipelineGraph.chain`):
    per rank, the micro-batches whose activations it holds at once, read off the built action lists
    once per (schedule, pp, m, v) -- the planners ask for the same few thousands of times."""
    return tuple(in_flight(build(name, PipelineGraph.chain(pp, micro_batches, virtual_stages))))


@lru_cache(maxsize=4096)
def graph_in_flight(name: str, sizes: tuple[tuple[int, ...], ...], edges: tuple[tuple[int, int], ...],
                    replicas: tuple[int, ...]) -> tuple[float, ...]:
    """`in_flight` of schedule `name` (gpipe or graph_1f1b) on a graph pipeline
    (`PipelineGraph.dag`: stage ``s`` runs micro-batches of ``sizes[s]`` in sample order, dealt to
    ``replicas[s]`` replicas in turn): what each stage's busiest replica holds at once, read off the
    built action lists -- where stages' micro-batch sizes or replicas differ a stage holds more
    than one plus its depth (`_forwards_before_backwards`)."""
    return tuple(in_flight(build(name, PipelineGraph.dag(list(sizes), list(edges), list(replicas)))))
