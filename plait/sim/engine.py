"""Discrete-event simulation of a task DAG with bandwidth-shared links.

A `TaskGraph` holds tasks in flat lists (fast to build and walk for 10^5 tasks):

* a **compute** task has a fixed duration (its device's stream order is encoded as
  dependencies by the lowering, so a stream runs one task at a time, in program order);
* a **flow** task (a transfer or a collective) first waits its latency, then moves a
  given number of bytes across each of its resources (a link, a port, a NIC). The
  flows active at a moment share the resources' bandwidth *max-min fairly* (progressive
  filling, `plait.net.maxmin`): a flow standing for `copies` identical flows weighs that
  many times, and a flow's level is its bandwidth on the resource where it moves the
  most bytes. So two equal transfers on one link take twice as long as one, a ring
  collective runs at the pace of its slowest link, and bandwidth a flow bottlenecked
  elsewhere leaves unused goes to the others.

A task starts when its last dependency ends. Rates change only when a flow starts or
ends, so the simulation jumps from event to event (a heap of times) and recomputes the
rates of the active flows connected to the one that changed through shared resources
(the only ones whose max-min rates can change).

The *critical path* is read backwards from the last task through, at each step, the
dependency that ended last (the one that made the task wait).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plait.net.maxmin import max_min_rates

_INF = float("inf")


@dataclass
class TaskGraph:
    name: list[str] = field(default_factory=list)
    category: list[str] = field(default_factory=list)
    resource: list[str] = field(default_factory=list)  # stream label for the timeline
    duration: list[float] = field(default_factory=list)  # compute time, or latency of a flow
    flow: list[list[tuple[int, float, float]] | None] = field(default_factory=list)  # (res, bytes, copies)
    succ: list[list[int]] = field(default_factory=list)
    npred: list[int] = field(default_factory=list)
    device: list[int | None] = field(default_factory=list)
    stage: list[int | None] = field(default_factory=list)
    micro_batch: list[int | None] = field(default_factory=list)
    chunk: list[int | None] = field(default_factory=list)  # model chunk on its stage (interleaved 1F1B)
    args: list[dict[str, Any] | None] = field(default_factory=list)
    capacity: list[float] = field(default_factory=list)  # per resource, bytes/s
    resource_key: list[tuple] = field(default_factory=list)
    _resource_index: dict[tuple, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.name)

    def add_resource(self, key: tuple, capacity: float) -> int:
        idx = self._resource_index.get(key)
        if idx is None:
            idx = len(self.capacity)
            self._resource_index[key] = idx
            self.capacity.append(float(capacity))
            self.resource_key.append(key)
        return idx

    def add(self, name: str, category: str, resource: str, duration: float = 0.0,
            deps: list[int] | tuple[int, ...] = (), flow: list[tuple[int, float, float]] | None = None,
            device: int | None = None, stage: int | None = None, micro_batch: int | None = None,
            args: dict[str, Any] | None = None, chunk: int | None = None) -> int:
        """Add a task; `deps` are ids of tasks it waits for; `flow` makes it a transfer."""
        tid = len(self.name)
        self.name.append(name)
        self.category.append(category)
        self.resource.append(resource)
        duration = float(duration)
        self.duration.append(duration if duration > 0.0 else 0.0)  # max(0.0, d), -0.0 and nan included
        self.flow.append(flow if flow else None)
        succ = self.succ
        succ.append([])
        n = 0
        for d in deps:
            if d is None or d < 0:
                continue
            succ[d].append(tid)
            n += 1
        self.npred.append(n)
        self.device.append(device)
        self.stage.append(stage)
        self.micro_batch.append(micro_batch)
        self.chunk.append(chunk)
        self.args.append(args)
        return tid

    def add_dep(self, before: int, after: int) -> None:
        self.succ[before].append(after)
        self.npred[after] += 1


@dataclass
class Schedule:
    start: list[float]
    end: list[float]
    binding: list[int]  # the dependency that ended last (-1: none)
    makespan: float
    events: int

    def critical_path(self) -> list[int]:
        """Task ids from the first to the last task of the longest (binding) chain."""
        if not self.end:
            return []
        last = max(range(len(self.end)), key=self.end.__getitem__)
        path = []
        while last >= 0:
            path.append(last)
            last = self.binding[last]
        path.reverse()
        return path


class EngineError(RuntimeError):
    """The task graph has a cycle (a lowering bug): some tasks never became ready."""


# The event loop stays one function (pyproject.toml's size rules): it is the simulator's hot path,
# each branch a few lines of bookkeeping on the same heaps and arrays, and split it would pass
# them all to every helper per event.
def simulate(graph: TaskGraph) -> Schedule:  # noqa: C901, PLR0915
    """Run the discrete-event simulation; returns start/end of every task."""
    n = len(graph.name)
    start = [0.0] * n
    end = [0.0] * n
    binding = [-1] * n
    ready_at = [0.0] * n
    remaining = list(graph.npred)
    durations = graph.duration
    flows = graph.flow
    succ = graph.succ
    capacity = graph.capacity
    capacity_array = np.asarray(capacity, dtype=float)
    heap: list[tuple[float, int, int, int]] = []  # (time, seq, task, version)
    seq = 0
    # Flow state.
    version = [0] * n
    rem = [0.0] * n  # remaining fraction of the transfer
    rate = [0.0] * n  # fraction per second
    last = [0.0] * n
    users: list[set[int]] = [set() for _ in capacity]
    active_flow = [False] * n
    done = 0
    events = 0

    # Max-min coefficients per flow: copies x bytes on the resource / the flow's largest bytes.
    coef: list[tuple[tuple[int, float], ...] | None] = [None] * n
    scale = [1.0] * n
    # Equal coefficient lists are one object (`interned`), so a component of flows is keyed by
    # their ids and its max-min levels -- a pure function of the lists and the fixed
    # capacities -- computed once: a pipeline meets the same sets of flows every micro-batch.
    interned: dict[tuple, tuple] = {}
    levels_of: dict[tuple, list[float]] = {}

    # (scale, coefficients) per flow list: the lowering hands equal transfers one list
    of_list: dict[int, tuple[float, tuple[tuple[int, float], ...]]] = {}

    def coefficients(t: int) -> tuple[tuple[int, float], ...]:
        out = coef[t]
        if out is None:
            fl = flows[t]
            hit = of_list.get(id(fl))
            if hit is None:
                m = 0.0
                for _r, b, _c in fl:  # type: ignore[union-attr]
                    if b > m:
                        m = b
                out = tuple([(r, c * b / m) for r, b, c in fl if b > 0])  # type: ignore[union-attr]
                hit = of_list[id(fl)] = (m or 1.0, interned.setdefault(out, out))
            scale[t], out = hit
            coef[t] = out
        return out

    def component(seeds: set[int]) -> list[int]:
        """Active flows connected to `seeds` (resources) through shared resources."""
        seen_r = set(seeds)
        stack = list(seeds)
        found: dict[int, None] = {}
        while stack:
            r = stack.pop()
            for u in users[r]:
                if u in found:
                    continue
                found[u] = None
                cu = coef[u]
                for r2, _a in (cu if cu is not None else coefficients(u)):
                    if r2 not in seen_r:
                        seen_r.add(r2)
                        stack.append(r2)
        return list(found)

    def refresh(resources: set[int], now: float) -> None:
        comp = component(resources)
        if not comp:
            return
        if len(comp) == 1:  # alone: the level its tightest resource allows
            levels = [min((capacity[r] / a for r, a in coef[comp[0]]), default=_INF)]  # type: ignore[union-attr]
        else:
            key = tuple([id(coef[u]) for u in comp])
            levels = levels_of.get(key)  # type: ignore[assignment]
            if levels is None:
                levels = levels_of[key] = max_min_rates(capacity, [coef[u] for u in comp],
                                                        capacity_array)
        for u, g in zip(comp, levels):
            new = g / scale[u] if g < _INF else _INF
            if new != rate[u] and not (new < _INF and abs(new - rate[u]) <= 1e-12 * new):
                reschedule(u, now, new)

    def reschedule(t: int, now: float, new_rate: float) -> None:
        nonlocal seq
        rem[t] -= rate[t] * (now - last[t]) if rate[t] < _INF else rem[t]
        if rem[t] < 0.0:
            rem[t] = 0.0
        last[t] = now
        rate[t] = new_rate
        version[t] += 1
        finish = now + (rem[t] / rate[t] if rate[t] < _INF else 0.0)
        seq += 1
        heapq.heappush(heap, (finish, seq, t, version[t]))

    def begin(t: int, now: float) -> None:
        nonlocal seq
        start[t] = now
        seq += 1
        if flows[t] is None:
            heapq.heappush(heap, (now + durations[t], seq, t, -1))
        else:
            # Latency first; the bandwidth phase starts at a "flow start" event (version -2).
            heapq.heappush(heap, (now + durations[t], seq, t, -2))

    for t in range(n):
        if remaining[t] == 0:
            begin(t, 0.0)

    heappop, heappush = heapq.heappop, heapq.heappush
    while heap:
        now, _, t, ver = heappop(heap)
        events += 1
        if ver == -2:
            # Bandwidth phase begins.
            touched: set[int] = set()
            alone = _INF  # fraction/s if no other flow shares a resource: its tightest resource
            for r, b, c in flows[t]:  # type: ignore[union-attr]
                if b > 0:
                    users[r].add(t)
                    touched.add(r)
                    if alone > 0.0:
                        alone = 0.0 if len(users[r]) > 1 else min(alone, capacity[r] / (b * c))
            active_flow[t] = True
            rem[t] = 1.0
            last[t] = now
            rate[t] = 0.0
            if alone > 0.0:  # alone on its resources (or on none): no fair sharing to compute
                reschedule(t, now, alone)
            else:
                refresh(touched, now)
            continue
        if ver >= 0:
            if ver != version[t] or not active_flow[t]:
                continue  # stale completion of a flow whose rate changed
            active_flow[t] = False
            touched = set()
            for r, b, _c in flows[t]:  # type: ignore[union-attr]
                if b > 0:
                    users[r].discard(t)
                    if users[r]:
                        touched.add(r)
            if touched:
                refresh(touched, now)
        end[t] = now
        done += 1
        for s in succ[t]:
            if now >= ready_at[s]:
                ready_at[s] = now
                binding[s] = t
            remaining[s] -= 1
            if remaining[s] == 0:  # `begin(s, now)`, inlined: the loop's commonest call
                start[s] = now
                seq += 1
                heappush(heap, (now + durations[s], seq, s, -1 if flows[s] is None else -2))
    if done != n:
        stuck = [graph.name[i] for i in range(n) if remaining[i] > 0][:5]
        raise EngineError(f"task graph has a cycle or a missing dependency; waiting forever: {stuck}")
    makespan = max(end) if end else 0.0
    return Schedule(start, end, binding, makespan, events)
