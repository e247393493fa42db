"""Program search: the cheapest SPMD program by best-first search over tensor placements.

HAP (Zhang et al. EuroSys'24, section 4.2) searches, op by op in program order, over the set of
properties it holds ("tensor t is available as placement q"), for the cheapest sequence of
compute and communication instructions that computes the single-device program. Its public code
keys the heap on ``cost + 0``: uniform-cost search. Here the heap is keyed on ``g + h`` with
``h(k) = sum over the ops not yet placed of the compute of their cheapest strategy at the
ratios`` -- at least their perfect-balance time (`cost.balanced_time`, `Problem.lower`): no
strategy of an op takes less, and communication is never negative, so ``h`` is admissible
and consistent (it drops by exactly the bound of the op just placed); A* with a closed set
then returns an optimal program, expanding no more states than uniform-cost search (Hart,
Nilsson & Raphael 1968). `search(..., heuristic=False)` is the uniform-cost baseline.

The states, the step and the replay (`evaluate`) are the program's cost model, shared with the
simulator and the runtime: `plait.cost.program`. `evaluate` replays one assignment with the same
step function, so the search, the exhaustive enumeration of the tests and the ratio LP all count
the same costs.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import numpy as np

from plait.cost.program import Live, Problem, Program, StepCosts, check_ratios, evaluate, step
from plait.cost.spmd import compute_time
from plait.ir.program import (
    ShardingError,
)
from plait.workers import paused_gc


class SearchBudgetExceeded(ShardingError):
    """The exact search expanded more states than it was allowed."""


def _key(k: int, live: dict[str, Live]) -> tuple:
    return k, tuple(sorted(live.items()))


def search(problem: Problem, ratios: Sequence[float], *, heuristic: bool = True,
           max_states: int = 2_000_000) -> Program:
    """The cheapest program at these `ratios`: A* (`heuristic`) or uniform-cost search."""
    # the collector paused (`paused_gc`): a search allocates hundreds of thousands of states (dicts,
    # tuples, frozensets -- no reference cycles) that its passes would walk again and again (a third
    # of the exact search's time on BERT-MoE)
    with paused_gc():
        return _astar(problem, ratios, heuristic, max_states)


def _astar(problem: Problem, ratios: Sequence[float], heuristic: bool, max_states: int) -> Program:
    r = check_ratios(ratios, problem.devices)
    n = len(problem.graph.ops)
    lower = _lower_bounds(problem, r) if heuristic else [0.0] * (n + 1)
    counter = itertools.count()
    times = StepCosts(problem, r)
    start: dict[str, Live] = {}
    # ties on f go to the deeper state (-k): on the plateaus of equal-cost choices (cheap ops whose
    # strategies cost the same) this finishes one path instead of widening all of them
    heap = [(lower[0], 0, next(counter), 0.0, 0, start, None)]
    best = {_key(0, start): 0.0}
    expanded = generated = 0
    while heap:
        f, _, _, g, k, live, path = heapq.heappop(heap)
        if best.get(_key(k, live), float("inf")) < g:
            continue  # a cheaper way here was found after this one was pushed
        expanded += 1
        if k == n:
            return _finish(problem, path, r, expanded, generated)
        if expanded > max_states:
            raise SearchBudgetExceeded(f"{problem.graph.model}: search stopped after {max_states} states "
                                       "(beam_search finds a program in linear time, not always the best)")
        for index, strategy in enumerate(problem.options[k]):
            done = step(problem, k, live, strategy, r, times)
            if done is None:
                continue
            compute, communication, _, new = done
            g2 = g + compute + communication
            key = _key(k + 1, new)
            if g2 < best.get(key, float("inf")) - 1e-18:
                best[key] = g2
                generated += 1
                heapq.heappush(heap, (g2 + lower[k + 1], -(k + 1), next(counter), g2, k + 1, new, (index, path)))
    raise ShardingError(f"{problem.graph.model}: no program computes the model (every path needs a "
                        "conversion that does not exist)")


def beam_search(problem: Problem, ratios: Sequence[float], width: int = 64) -> Program:
    """A program found by keeping, after each op, the `width` states of least ``g + h``: not
    optimal in general (`Program.optimal` is False), but linear in the graph's size, for graphs
    whose exact search exceeds its state budget."""
    # the collector paused, as in `search`
    with paused_gc():
        return _beam(problem, ratios, width)


def _beam(problem: Problem, ratios: Sequence[float], width: int) -> Program:
    r = check_ratios(ratios, problem.devices)
    lower = _lower_bounds(problem, r)
    level: list[tuple[float, dict[str, Live], tuple | None]] = [(0.0, {}, None)]
    times = StepCosts(problem, r)
    expanded = generated = 0
    for k in range(len(problem.graph.ops)):
        seen: dict[tuple, tuple[float, dict[str, Live], tuple | None]] = {}
        for g, live, path in level:
            expanded += 1
            for index, strategy in enumerate(problem.options[k]):
                done = step(problem, k, live, strategy, r, times)
                if done is None:
                    continue
                g2 = g + done[0] + done[1]
                key = _key(k + 1, done[3])
                if key not in seen or g2 < seen[key][0]:
                    seen[key] = (g2, done[3], (index, path))
                    generated += 1
        if not seen:
            raise ShardingError(f"{problem.graph.model}: no program computes the model")
        level = sorted(seen.values(), key=lambda x: x[0] + lower[k + 1])[:width]
    program = _finish(problem, level[0][2], r, expanded, generated)
    program.optimal = False
    return program


def _lower_bounds(problem: Problem, r: np.ndarray) -> list[float]:
    """h(k): the least compute of ops k.. at these ratios, each op's cheapest strategy alone.

    At least the perfect-balance bound `Problem.lower` (a sharded op at ratios r takes
    ``max_i r_i w_i >= 1 / sum_i 1/w_i``), and still admissible: every program runs each op with
    one of its strategies and pays communication on top."""
    least = [min(compute_time(w, s.splits_work, r) for s in opts) for w, opts in zip(problem.work, problem.options)]
    return [float(x) for x in np.cumsum(least[::-1])[::-1]] + [0.0]


def _finish(problem: Problem, path: tuple | None, r: np.ndarray, expanded: int, generated: int) -> Program:
    choice: list[int] = []
    while path is not None:
        choice.append(path[0])
        path = path[1]
    program = evaluate(problem, choice[::-1], r)
    program.expanded, program.generated = expanded, generated
    return program


def exhaustive(problem: Problem, ratios: Sequence[float]) -> Program:
    """The cheapest program by trying every combination (small graphs only: the tests' oracle)."""
    best: Program | None = None
    for choice in itertools.product(*(range(len(o)) for o in problem.options)):
        try:
            program = evaluate(problem, choice, ratios)
        except ShardingError:
            continue
        if best is None or program.cost < best.cost - 1e-15:
            best = program
    if best is None:
        raise ShardingError(f"{problem.graph.model}: no program computes the model")
    return best


