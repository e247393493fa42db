"""Per-device sharding ratios by linear programming, with each device's memory as a constraint,
alternated with the program search until the cost stops falling (HAP section 5).

For a fixed program (one strategy per op) the iteration time is piecewise linear in the ratios
``r`` (one per device, summing to 1):

    sum over sharded ops j of  max_i r_i w_ij           (t_j >= r_i w_ij for every device i)
  + sum over redundant ops of  max_i w_ij               (a constant)
  + sum over collectives c of  a_c + b_c max_i r_i       (m >= r_i; padded shards)

so ``min sum_j t_j + (sum_c b_c) m`` is an LP (scipy's HiGHS). HAP's LP stops there; here every
device also gets a memory row, linear in its ratio:

    R + r_i S  <=  capacity_i - framework overhead

with ``R`` the bytes every device keeps whole (replicated parameters with their gradients and
optimizer state, replicated saved activations) and ``S`` the bytes split by the ratio (sharded
parameters and activations). Bytes per parameter are `plait.cost.memory.state_bytes_per_param`
(the same rule as the memory estimator), the overhead is its `FRAMEWORK_OVERHEAD_BYTES`.
Activations: every floating tensor an op reads and autograd may keep, at the placement the op
reads it in (an upper bound of what the op saves; in-place and view savings are ignored).

`synthesize` alternates search and LP. When the searched program does not fit at any ratio, it
searches again with the largest replicated parameters forced to shards (their redundant and
data-parallel strategies removed), and gives up -- naming the device -- only when even fully
sharded parameters do not fit. `round_shards` turns the ratios into integer shard sizes that keep
every shape valid: dimensions linked through ops (a view merging ``b`` with the heads, an
elementwise op) are split together, in proportion, from their greatest common divisor.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import sparse
from scipy.optimize import linprog

from plait.cost.memory import (
    FRAMEWORK_OVERHEAD_BYTES,
    MemoryModel,
    memory_model,
    state_bytes_per_param,
)
from plait.cost.program import (
    Problem,
    Program,
    Segments,
    Synthesis,
    evaluate,
    future_needs_of,
    segments,
    stored_placements,
)
from plait.cost.spmd import PADDED, choose, comm_affine, compute_time
from plait.ir.program import PARTIAL, REPLICATED, Comm, ShardingError, shard_dim
from plait.spmd.search import SearchBudgetExceeded, beam_search, search


@dataclass
class RatioSolution:
    ratios: np.ndarray  # one vector: the work-weighted mean over segments (what the next search uses)
    cost: float  # predicted iteration time of the program at these ratios (LP objective + constants)
    memory: np.ndarray  # bytes per device
    by_segment: np.ndarray | None = None  # (segments, devices)
    segments: Segments | None = None


def _comm_segment(comm: Comm, segs: Segments) -> int | None:
    """The segment whose largest ratio pads this collective (None: not padded -- an all-reduce, a
    grouped collective)."""
    if comm.op not in PADDED or comm.algorithm not in (None, "padded"):
        return None
    return segs.of_dim.get((comm.tensor, comm.dim), 0) if comm.dim is not None else 0


def segmented_cost(problem: Problem, program: Program, segs: Segments, by_segment: np.ndarray) -> float:
    """The program's time with each segment at its own ratios (the LP's objective, evaluated)."""
    r = np.asarray(by_segment, dtype=float)
    total = 0.0
    for k, op in enumerate(problem.graph.ops):
        s = program.strategies[op.name]
        total += compute_time(problem.work[k], s.splits_work, r[segs.of_op.get(op.name, 0)])
    for _, comm in program.comms:
        a, b = comm_affine(comm, problem.devices)
        g = _comm_segment(comm, segs)
        total += (a + (b * float(np.max(r[g])) if g is not None else 0.0)) * problem.weight(comm)
    return total


def solve_ratios(problem: Problem, program: Program, memory: MemoryModel | None = None,
                 min_ratio: float = 0.0, start: np.ndarray | None = None,
                 segs: Segments | None = None) -> RatioSolution | None:
    """The ratios minimising `program`'s time, within each device's memory; None if it cannot fit.

    One ratio vector per segment (`segs`; default: one for the whole program). Variables
    ``[r_gi (g-major), t_j, m_g]`` (one t_j per group of proportional sharded ops, `_op_directions`);
    HiGHS through `scipy.optimize.linprog`. When the time does not
    depend on the ratios (nothing sharded) and `start` fits, `start` is kept rather than an
    arbitrary vertex of the LP."""
    devices = problem.devices
    n = devices.n
    segs = segs or Segments.single(problem, program)
    G = segs.count
    ops = problem.graph.ops
    split = [k for k, op in enumerate(ops) if program.strategies[op.name].splits_work]
    constant, slope = _fixed_terms(problem, program, segs)
    if start is not None and not split and not slope.any():
        rows = np.tile(np.asarray(start, dtype=float), (G, 1))
        rows[sorted(segs.even)] = 1.0 / n  # storage segments stay even
        mem = (memory.on(rows if G > 1 else rows[0]) if memory is not None else np.zeros(n))
        if memory is None or np.all(mem <= devices.memory):
            return RatioSolution(np.asarray(start, dtype=float), constant, mem, rows, segs)
    seg_of, work, scale = _op_directions(problem, split, segs)
    lp = _ratio_lp(problem, memory, segs, seg_of, work, scale, slope, min_ratio)
    result = linprog(lp.c, A_ub=lp.a_ub, b_ub=lp.b_ub, A_eq=lp.a_eq, b_eq=lp.b_eq, bounds=lp.bounds,
                     method="highs")
    if result.status != 0:
        return None
    by_segment = np.clip(result.x[:G * n].reshape(G, n), 0.0, None)
    by_segment /= by_segment.sum(axis=1, keepdims=True)
    weight = np.zeros(G)
    for k in split:
        weight[segs.of_op.get(ops[k].name, 0)] += float(np.max(problem.work[k]))
    mean = (weight @ by_segment) / weight.sum() if weight.sum() > 0 else by_segment.mean(axis=0)
    mem = (memory.on(by_segment) if G > 1 else memory.on(by_segment[0])) if memory is not None else np.zeros(n)
    return RatioSolution(mean, float(result.fun) + constant, mem, by_segment, segs)


def _fixed_terms(problem: Problem, program: Program, segs: Segments) -> tuple[float, np.ndarray]:
    """(the time that does not depend on the ratios: unsharded ops and the collectives' latency
    terms, each segment's padded-collective slope ``sum_c b_c``)."""
    ops = problem.graph.ops
    constant = sum(float(np.max(problem.work[k])) for k, op in enumerate(ops)
                   if not program.strategies[op.name].splits_work)
    slope = np.zeros(segs.count)
    for _, comm in program.comms:
        a, b = comm_affine(comm, problem.devices)
        w = problem.weight(comm)
        constant += a * w
        g = _comm_segment(comm, segs)
        if g is not None:
            slope[g] += b * w
    return constant, slope


@dataclass
class _RatioLP:
    """`solve_ratios`' LP in `scipy.optimize.linprog`'s form."""

    c: np.ndarray
    a_ub: sparse.csr_matrix
    b_ub: np.ndarray
    a_eq: sparse.csr_matrix  # each segment's ratios sum to 1
    b_eq: np.ndarray
    bounds: list[tuple[float, float | None]]


def _ratio_lp(problem: Problem, memory: MemoryModel | None, segs: Segments, seg_of: np.ndarray, work: np.ndarray,
              scale: np.ndarray, slope: np.ndarray, min_ratio: float) -> _RatioLP:
    """`solve_ratios`' LP over ``[r_gi (g-major), t_j, m_g]`` (`_op_directions`' merged rows
    `seg_of`, `work`, `scale`; each segment's padded-collective `slope`)."""
    devices = problem.devices
    n = devices.n
    G = segs.count
    n_t = len(seg_of)
    n_r = G * n
    n_var = n_r + n_t + G
    c = np.zeros(n_var)
    c[n_r:n_r + n_t] = scale
    c[n_r + n_t:] = slope
    # the constraint matrix is sparse (two entries per row, G per memory row): built as COO for HiGHS
    dev = np.arange(n)
    # r_gi w_ik - t_j <= 0, g the op's segment: rows j * n + i
    rows_t = np.arange(n_t * n)
    ri = [rows_t, rows_t]
    ci = [(seg_of[:, None] * n + dev[None, :]).ravel(), np.repeat(n_r + np.arange(n_t), n)]
    vals = [work.ravel(), np.full(n_t * n, -1.0)]
    rhs = [np.zeros(n_t * n)]
    # r_gi - m_g <= 0: rows n_t n + g n + i
    rows_m = n_t * n + np.arange(G * n)
    ri += [rows_m, rows_m]
    ci += [np.arange(G * n), n_r + n_t + np.repeat(np.arange(G), n)]
    vals += [np.ones(G * n), -np.ones(G * n)]
    rhs.append(np.zeros(G * n))
    if memory is not None:  # sum_g r_gi S_g <= capacity_i - overhead - R
        per_seg = memory.by_segment if G > 1 else {0: memory.sharded}
        base = (n_t + G) * n
        for g, nbytes in per_seg.items():
            ri.append(base + dev)
            ci.append(g * n + dev)
            vals.append(np.full(n, float(nbytes)))
        rhs.append(np.asarray(devices.memory, dtype=float) - memory.overhead - memory.replicated)
    b_ub = np.concatenate(rhs)
    A_ub = sparse.coo_matrix((np.concatenate(vals), (np.concatenate(ri), np.concatenate(ci))),
                             shape=(len(b_ub), n_var)).tocsr()
    eq = sparse.coo_matrix((np.ones(G * n), (np.repeat(np.arange(G), n), np.arange(G * n))), shape=(G, n_var))
    bounds: list[tuple[float, float | None]] = [(min_ratio, 1.0)] * n_r + [(0.0, None)] * (n_t + G)
    for g in segs.even:  # storage segments: even shards
        bounds[g * n:(g + 1) * n] = [(1.0 / n, 1.0 / n)] * n
    return _RatioLP(c, A_ub, b_ub, eq.tocsr(), np.ones(G), bounds)


def _op_directions(problem: Problem, split: list[int], segs: Segments) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sharded ops' rows of the LP, merged where exact: ops of one segment whose work vectors
    are proportional (``w_k = c_k u``: every compute-bound op of a kind, every memory-bound one)
    have ``sum_k max_i r_i w_ik = (sum_k c_k) max_i r_i u_i``, so one variable ``t >= r_i u_i``
    with cost ``sum_k c_k`` stands for all of them (the same LP, a fraction of its rows).
    Returns (segment, unit work vector ``u`` (max 1), ``sum c``) per merged row."""
    ops = problem.graph.ops
    rows: dict[tuple, int] = {}
    seg: list[int] = []
    units: list[np.ndarray] = []
    scale: list[float] = []
    for k in split:
        w = np.asarray(problem.work[k], dtype=float)
        top = float(np.max(w))
        if top <= 0:
            continue  # no work on any device: no term
        u = w / top
        g = segs.of_op.get(ops[k].name, 0)
        key = (g, u.round(12).tobytes())
        j = rows.get(key)
        if j is None:
            rows[key] = len(seg)
            seg.append(g)
            units.append(u)
            scale.append(top)
        else:
            scale[j] += top
    n = problem.devices.n
    return (np.array(seg, dtype=int), np.array(units, dtype=float).reshape(len(seg), n),
            np.array(scale, dtype=float))


def synthesize(problem: Problem, *, dtype: str = "fp32", optimizer: str = "adam", memory: bool = True,
               heuristic: bool = True, max_rounds: int = 8, overhead: float = FRAMEWORK_OVERHEAD_BYTES,
               max_states: int = 200_000, segmented: bool = True, forced: Sequence[str] = ()) -> Synthesis:
    """Search and LP in turn, from ratios proportional to FLOP/s, until the cost stops falling.

    `segmented`: one ratio vector per segment (HAP), else one for the whole program. The search
    runs at one vector, the work-weighted mean of the segments' (the segments are the program's).
    `forced`: parameters to try sharded first (a previous synthesis's `Synthesis.forced`): the set
    that made a program fit carries over from round to round instead of being found again."""
    start = time.perf_counter()
    devices = problem.devices
    r = devices.flops / devices.flops.sum()
    best: Synthesis | None = None
    expanded = 0
    rounds: list[float] = []
    budget = [max_states]  # set to 0 once the exact search overran it: later rounds go to the beam
    carried = set(forced)  # parameters the last fitting program needed sharded
    for _ in range(max_rounds):
        program, solution, n_exp = _fitting_program(problem, r, dtype, optimizer, memory, heuristic, overhead,
                                                    budget, segmented, carried)
        expanded += n_exp
        rounds.append(solution.cost)
        if best is not None and solution.cost >= best.cost * (1 - 1e-9):
            break
        best = Synthesis(program, solution.ratios, solution.cost, solution.memory,
                         segment_ratios=solution.by_segment, segments=solution.segments,
                         forced=tuple(sorted(carried)))
        if np.allclose(solution.ratios, r, rtol=0.0, atol=1e-6):
            break  # the LP kept the ratios the search ran at: searching again finds the same program
        r = solution.ratios
    assert best is not None
    best.rounds, best.expanded, best.seconds = rounds, expanded, time.perf_counter() - start
    best.capacity = devices.memory
    return best


def synthesize_overlapped(problem: Problem, evaluate: Callable[[Problem, Synthesis], float],
                          weights: Sequence[float] = (1.0, 0.5, 0.0), **options: Any) -> Synthesis:
    """`synthesize` at a few weights of the parameter-gradient collectives (`Problem.overlap`),
    keeping the program `evaluate` ranks first -- the planners' contract: the search driver hands
    them the simulator, which overlaps those collectives with backward where dependencies allow.

    The search's objective is a sum (every instruction's time, HAP's cost), so it cannot see that
    a data-parallel gradient all-reduce runs behind the backward of earlier layers; weight 1 is
    that sum, 0 treats them as fully hidden, values between trade the two. `expanded` and
    `seconds` of the result count every candidate's synthesis; `overlap` says which won."""
    best: tuple[float, Synthesis] | None = None
    expanded, seconds = 0, 0.0
    for w in weights:
        candidate = synthesize(dataclasses.replace(problem, overlap=float(w)), **options)
        options = {**options, "forced": candidate.forced}  # what made it fit, tried first by the next
        if not candidate.program.optimal:  # the graph overran the exact search: the others go to the beam
            options["max_states"] = 0
        expanded += candidate.expanded
        seconds += candidate.seconds
        candidate.overlap = float(w)
        score = evaluate(problem, candidate)
        if best is None or score < best[0] * (1 - 1e-9):
            best = (score, candidate)
    if best is None:
        raise ShardingError("synthesize_overlapped: no weights given")
    result = best[1]
    result.expanded, result.seconds = expanded, seconds
    return result


STORE_MIN_NUMEL = 1 << 16  # parameters smaller than this stay whole in `stored_homes` (biases, norms)
STORE_MIN_ROWS = 4  # ... and those without a dimension of this many rows per device at even shards


def stored_homes(problem: Problem, program: Program, min_numel: int = STORE_MIN_NUMEL,
                 min_rows: int = STORE_MIN_ROWS) -> dict[str, str]:
    """ZeRO-3 / FSDP storage (Rajbhandari et al. SC'20; Zhao et al. VLDB'23) for `program`'s
    whole parameters: each one it stores replicated, of at least `min_numel` elements, sharded
    along its largest dimension with `min_rows` rows per device at even shards -- where every
    read of it can be made from there (`placement.conversion`: a partial read cannot)."""
    graph, n = problem.graph, problem.devices.n
    stored = stored_placements(graph, program)
    reads: dict[str, set[str]] = {}
    for op in graph.ops:
        for t, q in zip(op.inputs, program.strategies[op.name].inputs):
            reads.setdefault(t, set()).add(q)
    homes: dict[str, str] = {}
    for t, q in stored.items():
        meta = graph.tensors[t]
        if q != REPLICATED or meta.numel < min_numel or PARTIAL in reads.get(t, ()):
            continue
        dims = [d for d, size in enumerate(meta.shape) if size >= min_rows * n]
        if dims:
            homes[t] = f"S{max(dims, key=lambda d: meta.shape[d])}"
    return homes


def synthesize_stored(problem: Problem, syn: Synthesis, *, dtype: str = "fp32", optimizer: str = "adam",
                      overhead: float = FRAMEWORK_OVERHEAD_BYTES, memory: bool = True,
                      homes: dict[str, str] | None = None) -> Synthesis | None:
    """`syn`'s program with its whole parameters stored sharded (`stored_homes`, or `homes`): the
    same op strategies, each such parameter all-gathered before its readers in the forward and its
    gradient reduce-scattered home (the all-reduce's bytes, split: half behind the forward),
    the optimizer stepping each device's even shard; ratios by the LP with memory (the storage
    segments held even). None when no parameter qualifies or it does not fit. Which of `syn` and
    this runs faster is the simulator's call: the search's sum of instruction times is the same
    (an all-reduce costs its reduce-scatter and all-gather), what differs is overlap and the
    optimizer step -- HAP's cost model sees neither."""
    start = time.perf_counter()
    homes = stored_homes(problem, syn.program) if homes is None else homes
    if not homes:
        return None
    p = dataclasses.replace(problem, homes=dict(homes))
    graph, n = p.graph, p.devices.n
    choice = [p.options[k].index(syn.program.strategies[op.name]) for k, op in enumerate(graph.ops)]
    r = np.asarray(syn.ratios, dtype=float)
    program = evaluate(p, choice, r / r.sum())
    even = np.full(n, 1.0 / n)
    stored = set(homes)
    # the storage collectives run on even shards: their algorithm chosen there
    program.comms = [(name, choose(dataclasses.replace(c, algorithm=None), p.devices, even, p.collectives)[0]
                      if c.tensor in stored and c.op in PADDED else c) for name, c in program.comms]
    program.optimal, program.expanded = syn.program.optimal, syn.program.expanded
    segs = segments(p, program)
    model = memory_model(p, program, dtype, optimizer, overhead, segs)
    solution = solve_ratios(p, program, model if memory else None, min_ratio=0.01 / n, start=r / r.sum(), segs=segs)
    if solution is None:
        return None
    if not memory:
        by_seg = solution.by_segment
        solution.memory = model.on(by_seg if by_seg is not None and by_seg.shape[0] > 1 else solution.ratios)
    return Synthesis(program, solution.ratios, solution.cost, solution.memory, [*syn.rounds, solution.cost],
                     syn.expanded, syn.seconds + time.perf_counter() - start, solution.by_segment,
                     solution.segments, p.devices.memory, syn.overlap, syn.forced)


def _fitting_program(problem: Problem, r: np.ndarray, dtype: str, optimizer: str, memory: bool,
                     heuristic: bool, overhead: float, budget: list[int],
                     segmented: bool, carried: set[str]) -> tuple[Program, RatioSolution, int]:
    """The searched program at `r` and its best ratios; if it cannot fit, search again with the
    largest replicated parameters forced to shards: first as many as the memory model says are
    needed (`_needed_forced`), then doubling that set until it fits. Starts from `carried` (the
    set the previous round needed) and leaves the set it ended with there.

    Where the graph has overrun the exact search, the searches that only find out whether a
    forced set fits run the beam at width `PROBE_WIDTH`, and the set that fits is searched once
    more at full width (the memory rows decide on the narrow beam's program, the cost on the
    full one's). The first search of a call is at full width: most rounds need no more forced
    parameters than they start with (`carried` fitted the last round), and a probe would only
    confirm it (the full program's memory rows decide then); probes start once the set grows."""
    params = sorted(_shardable_params(problem), key=lambda t: -problem.graph.tensors[t].numel)
    forced: set[str] = set(carried) & set(params)
    expanded = 0
    w_b, g_b, k_b = state_bytes_per_param(dtype, optimizer)
    probe = False
    while True:
        restricted = _forbid_replicated(problem, forced) if forced else problem
        program = _search(restricted, r / r.sum(), heuristic, budget, PROBE_WIDTH if probe else BEAM_WIDTH)
        expanded += program.expanded
        segs = segments(restricted, program) if segmented else Segments.single(restricted, program)
        model = memory_model(restricted, program, dtype, optimizer, overhead, segs)
        # every device keeps a share (1% of even) so that every shard has rows; leaving a device
        # out altogether is a different program (a smaller group), not a ratio
        solution = solve_ratios(restricted, program, model if memory else None, min_ratio=0.01 / len(r),
                                start=r, segs=segs)
        if solution is not None and probe:  # this set fits: the real search, at full width
            probe = False
            continue
        if solution is not None:
            carried.clear()
            carried.update(forced)
            if not memory:  # HAP's LP ignores memory: say what the program would need anyway
                by_seg = solution.by_segment
                solution.memory = model.on(by_seg if by_seg is not None and by_seg.shape[0] > 1 else solution.ratios)
            return program, solution, expanded
        left = [t for t in params if t not in forced]
        if not left:
            raise _too_big(problem, model)
        need = _needed_forced(restricted, program, model, left, w_b + g_b + k_b, 0.01 / len(r)) if memory else 0
        forced.update(left[:max(1, need, len(forced))])  # at least double the forced set each time
        probe = probe or (memory and budget[0] == 0)


BEAM_WIDTH = 32  # states the beam keeps per op (64 costs twice the time; same BERT-MoE program)
PROBE_WIDTH = 8  # ... when it only finds out whether a forced set fits


def _search(problem: Problem, r: np.ndarray, heuristic: bool, budget: list[int], width: int = BEAM_WIDTH) -> Program:
    """The exact search within ``budget[0]`` states; past it, the beam search (not optimal, says
    so), and ``budget[0] = 0`` so that the synthesis's later searches of the same graph (the next
    rounds, forced parameters) go straight to the beam instead of overrunning again."""
    if budget[0] > 0:
        try:
            return search(problem, r, heuristic=heuristic, max_states=budget[0])
        except SearchBudgetExceeded:
            budget[0] = 0
    return beam_search(problem, r, width)


def _needed_forced(problem: Problem, program: Program, model: MemoryModel, left: list[str],
                   per_param: float, min_ratio: float) -> int:
    """How many of `left` (largest first) must move from replicated to sharded for the memory
    rows of the LP to admit some ratios, the rest of the program unchanged: ratios exist iff
    ``sum_i min(1, (capacity_i - overhead - R) / S) >= 1`` with every term at least `min_ratio`
    (``R`` replicated, ``S`` sharded bytes; forcing a parameter moves its state from R to S).
    A parameter the program already shards moves nothing; 0 when no count suffices."""
    cap = problem.devices.memory
    stored = stored_placements(problem.graph, program)
    R, S = model.replicated, model.sharded
    for count, t in enumerate(left, start=1):
        if shard_dim(stored.get(t, REPLICATED)) is None:
            moved = problem.graph.tensors[t].numel * per_param
            R, S = R - moved, S + moved
        room = cap - model.overhead - R
        if S > 0 and np.all(room >= min_ratio * S) and np.minimum(1.0, room / S).sum() >= 1.0:
            return count
    return 0


def _shardable_params(problem: Problem) -> list[str]:
    """Parameters that every op reading them can read sharded (layer-norm weights cannot)."""
    ok = {t: True for t in problem.graph.params}
    for op, opts in zip(problem.graph.ops, problem.options):
        for t in set(op.inputs) & ok.keys():
            ok[t] = ok[t] and any(shard_dim(q) is not None for s in opts
                                  for u, q in zip(op.inputs, s.inputs) if u == t)
    return [t for t, can in ok.items() if can]


def _forbid_replicated(problem: Problem, params: set[str]) -> Problem:
    """A copy of `problem` whose strategies never keep one of `params` whole."""
    options = []
    for op, opts in zip(problem.graph.ops, problem.options):
        keep = [s for s in opts if not any(t in params and shard_dim(q) is None
                                           for t, q in zip(op.inputs, s.inputs))]
        if not keep:
            raise ShardingError(f"op {op.name} ({op.target}): no strategy shards its parameters "
                                f"{sorted(set(op.inputs) & params)}; the model cannot be made to fit")
        options.append(keep)
    return dataclasses.replace(problem, options=options, future_needs=future_needs_of(problem.graph, options),
                               homes=dict(problem.homes))


def _bytes(x: float) -> str:
    return f"{x / 2**30:.2f} GiB" if abs(x) >= 2**30 else f"{x / 2**20:.1f} MiB"


def _too_big(problem: Problem, model: MemoryModel | None) -> ShardingError:
    devices = problem.devices
    if model is None:
        return ShardingError(f"{problem.graph.model}: no program fits")
    room = devices.memory - model.overhead - model.replicated
    worst = int(np.argmin(room))
    if room[worst] < 0:
        return ShardingError(
            f"model {problem.graph.model} does not fit: {devices.names[worst]} has "
            f"{_bytes(devices.memory[worst])} but needs {_bytes(model.overhead + model.replicated)} "
            f"for what every device keeps whole, before its share of {_bytes(model.sharded)} of sharded state")
    return ShardingError(
        f"model {problem.graph.model} does not fit: its sharded state ({_bytes(model.sharded)}) "
        f"exceeds the room left on all devices together ({_bytes(room.clip(0).sum())}; the fullest is "
        f"{devices.names[worst]} with {_bytes(room[worst])} free)")


# ----------------------------------------------------------------------------- rounding


