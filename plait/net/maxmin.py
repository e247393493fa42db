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

_INF = float("inf")
_EPS = 1e-12


def max_min_rates(capacity: Sequence[float], flows: Sequence[Sequence[tuple[int, float]]]) -> list[float]:
    """Max-min fair level of each flow; ``flows[f]`` lists ``(link, coefficient)``.

    A flow with no link (or only zero coefficients) is unconstrained: ``inf``."""
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
