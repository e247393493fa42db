"""Max-min fair rates of flows sharing capacitated links, by progressive filling.

Bertsekas & Gallager, *Data Networks* (6.5.2): raise the rate of every flow together;
when a link saturates, the flows crossing it are frozen at the current level; continue
with the others until every flow is frozen. The result is the unique max-min fair
allocation: no flow's rate can grow without lowering a flow whose rate is not larger.

Weighted form used by the simulator: flow ``f`` at level ``x_f`` consumes ``a_fr * x_f``
of link ``r`` (``a_fr`` > 0: the copies it stands for times the share of its bytes that
cross ``r``). With all ``a_fr = 1`` this is classic max-min fairness.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_INF = float("inf")
_EPS = 1e-12
VECTOR_ENTRIES = 200  # from this many (flow, link) entries the numpy form beats the dictionaries


def max_min_rates(capacity: Sequence[float], flows: Sequence[Sequence[tuple[int, float]]],
                  capacity_array: np.ndarray | None = None) -> list[float]:
    """Max-min fair level of each flow; ``flows[f]`` lists ``(link, coefficient)``.

    A flow with no link (or only zero coefficients) is unconstrained: ``inf``.
    `capacity_array`: `capacity` as a float array, when the caller keeps one (the simulator asks
    thousands of times over one list of resources)."""
    if sum(map(len, flows)) >= VECTOR_ENTRIES:
        return max_min_rates_np(capacity, flows, capacity_array)
    return _max_min_dict(capacity, flows)


def max_min_rates_np(capacity: Sequence[float], flows: Sequence[Sequence[tuple[int, float]]],
                     capacity_array: np.ndarray | None = None) -> list[float]:
    """`max_min_rates` on arrays: each round of the filling is a few passes over the
    (flow, link, coefficient) entries (a sparse incidence matrix), not a loop over dicts."""
    n = len(flows)
    fl: list[int] = []
    ll: list[int] = []
    cl: list[float] = []
    for f, links in enumerate(flows):  # one pass over the entries
        for r, a in links:
            if a > 0:
                fl.append(f)
                ll.append(r)
                cl.append(a)
    fi, li, co = np.array(fl, dtype=np.int64), np.array(ll, dtype=np.int64), np.array(cl, dtype=float)
    rate = np.full(n, _INF)
    if fi.size == 0:
        return rate.tolist()
    used, inv = np.unique(li, return_inverse=True)
    cap = (np.asarray(capacity, dtype=float) if capacity_array is None else capacity_array)[used]
    tol = _EPS * np.maximum(1.0, cap)
    left = cap.copy()
    live = np.ones(fi.size, dtype=bool)  # entries of flows not yet frozen
    frozen = np.zeros(n, dtype=bool)
    level = 0.0
    while live.any():
        weight = np.bincount(inv[live], weights=co[live], minlength=used.size)
        on = weight > _EPS
        if not on.any():
            break
        step = max(float(np.min(left[on] / weight[on])), 0.0)
        level += step
        left -= step * weight
        full = on & (left <= tol)
        hit = np.unique(fi[live & full[inv]])
        rate[hit] = level
        frozen[hit] = True
        live &= ~frozen[fi]
    return rate.tolist()


def _max_min_dict(capacity: Sequence[float], flows: Sequence[Sequence[tuple[int, float]]]) -> list[float]:
    n = len(flows)
    rate = [_INF] * n
    weight: dict[int, float] = {}
    users: dict[int, list[int]] = {}
    for f, links in enumerate(flows):
        for r, a in links:
            if a > 0:
                weight[r] = weight.get(r, 0.0) + a
                users.setdefault(r, []).append(f)
    left = {r: float(capacity[r]) for r in weight}
    frozen = [False] * n
    level = 0.0
    while weight:
        # The next link to saturate: smallest headroom per unit of level.
        step = min(left[r] / w for r, w in weight.items())
        step = max(step, 0.0)
        level += step
        full = []
        for r, w in weight.items():
            left[r] -= step * w
            if left[r] <= _EPS * max(1.0, capacity[r]):
                full.append(r)
        for r in full:
            for f in users[r]:
                if frozen[f]:
                    continue
                frozen[f] = True
                rate[f] = level
                for r2, a in flows[f]:
                    if a > 0 and r2 in weight:
                        weight[r2] -= a
        for r in list(weight):
            if weight[r] <= _EPS or r in full:
                del weight[r]
    return rate


def link_loads(num_links: int, flows: Sequence[Sequence[tuple[int, float]]], rates: Sequence[float]) -> list[float]:
    """Traffic on each link (sum of coefficient x rate of the flows crossing it)."""
    load = [0.0] * num_links
    for links, x in zip(flows, rates):
        if x == _INF:
            continue
        for r, a in links:
            load[r] += a * x
    return load
