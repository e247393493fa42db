"""Traffic planning (C4P, HPCA'25): give each flow a path so that no link is busier than needed.

A synchronous collective runs at the pace of its busiest link, so the job's communication
time is ``T = max over links of (bytes on the link / capacity)``. The planner

1. places flows one by one, largest first, each on its sending port, switch path and
   receiving port that minimise ``(max, sum)`` of the utilisations along it after adding it
   (a bottleneck-shortest path over the fabric's equal-cost next hops, `Fabric.choices`);
   a bonded NIC's ports are balanced because each port is a link like any other;
2. improves: while moving one flow off the busiest link lowers ``T``, moves it;
3. on small instances (a few thousand flow-path pairs) solves the integral problem exactly
   as a MILP (HiGHS, 1 s limit) and keeps it when better: the greedy reaches the integral
   optimum on most shapes, not all (unequal flows can need swaps).

`ideal` is the fractional lower bound: the LP ``min T`` s.t. every link carries at most
``T x capacity`` when every flow may be split over all its paths (scipy's HiGHS). Ports
are independent of the switch path (all ports of a NIC reach the same leaf), so the LP
works on leaf-pair aggregates with flow conservation at every switch, and the ports'
bound (a NIC's bytes over its alive ports) is taken apart: both are exact.

`replan` moves only the flows whose path crossed a failed link.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from plait.net.fabric import Fabric, FabricError, Route
from plait.net.flows import Flow


@dataclass
class Assignment:
    """Paths of flows and the bytes they put on each link."""

    routes: list[Route]
    load: np.ndarray  # bytes per link
    seconds: float = 0.0  # time the planner took
    moved: int = 0  # flows re-planned (replan)
    on_link: list[set[int]] = field(default_factory=list, repr=False)

    def bottleneck(self, fabric: Fabric) -> tuple[float, int]:
        """(T in seconds, busiest link id)."""
        util = self.load / np.asarray(fabric.capacity)
        i = int(np.argmax(util))
        return float(util[i]), i


def assign(fabric: Fabric, flows: Sequence[Flow], routes: Sequence[Route]) -> Assignment:
    """An Assignment of given routes (ECMP's, say), with its loads."""
    load = np.zeros(len(fabric.names))
    on_link: list[set[int]] = [set() for _ in fabric.names]
    for i, (f, r) in enumerate(zip(flows, routes)):
        for link in r.links:
            load[link] += f.bytes
            on_link[link].add(i)
    return Assignment(list(routes), load, on_link=on_link)


def ecmp_routes(fabric: Fabric, flows: Sequence[Flow]) -> list[Route]:
    return [fabric.route_ecmp(f.key) for f in flows]


class _Placer:
    def __init__(self, fabric: Fabric, flows: Sequence[Flow], a: Assignment) -> None:
        self.fabric, self.flows, self.a = fabric, flows, a
        self.cap = fabric.capacity

    def util(self, link: int, b: float) -> float:
        return (self.a.load[link] + b) / self.cap[link]

    def best_route(self, i: int) -> Route:
        f, fab = self.flows[i], self.fabric
        b = f.bytes
        sp = [p for p in fab.port_up[f.key.src][f.key.src_nic] if fab.alive[p]]
        dp = [p for p in fab.port_down[f.key.dst][f.key.dst_nic] if fab.alive[p]]
        if not sp or not dp:
            fab.route_ecmp(f.key)  # raises FabricError naming the dead ports
        src = min(sp, key=lambda p: (self.util(p, b), p))
        dst = min(dp, key=lambda p: (self.util(p, b), p))
        src_leaf, dst_leaf = fab.nic_leaf[f.key.src][f.key.src_nic], fab.nic_leaf[f.key.dst][f.key.dst_nic]
        memo: dict[tuple[str, str], tuple[float, float, tuple[int, ...]]] = {}

        def best(at: str, phase: str) -> tuple[float, float, tuple[int, ...]]:
            if phase == "end":
                return 0.0, 0.0, ()
            hit = memo.get((at, phase))
            if hit is not None:
                return hit
            out = None
            for link, nxt, ph in fab.choices(at, dst_leaf, phase):
                m, s, rest = best(nxt, ph)
                u = self.util(link, b)
                cand = (max(m, u), s + u, (link,) + rest)
                if out is None or cand[:2] < out[:2]:
                    out = cand
            if out is None:
                fab.walk(at, dst_leaf, lambda o, t: 0)  # raises FabricError naming the dead links
                raise FabricError(f"no path from {at} to {dst_leaf}")
            memo[(at, phase)] = out
            return out

        mid = best(src_leaf, "up")[2] if src_leaf != dst_leaf else ()
        return Route((src,) + mid + (dst,))

    def put(self, i: int, r: Route) -> None:
        self.a.routes[i] = r
        for link in r.links:
            self.a.load[link] += self.flows[i].bytes
            self.a.on_link[link].add(i)

    def take(self, i: int) -> Route:
        r = self.a.routes[i]
        for link in r.links:
            self.a.load[link] -= self.flows[i].bytes
            self.a.on_link[link].discard(i)
        return r

    def improve(self, rounds: int = 10000) -> None:
        """Move flows off the busiest link while that lowers the bottleneck."""
        for _ in range(rounds):
            t, link = self.a.bottleneck(self.fabric)
            moved = False
            for i in sorted(self.a.on_link[link], key=lambda j: -self.flows[j].bytes):
                old = self.take(i)
                new = self.best_route(i)
                if max(self.util(x, self.flows[i].bytes) for x in new.links) < t * (1 - 1e-9):
                    self.put(i, new)
                    moved = True
                    break
                self.put(i, old)
            if not moved:
                return


EXACT_COLUMNS = 4000  # (flow, path) pairs up to which a MILP looks for a better assignment
EXACT_SECONDS = 1.0  # its time limit


def plan_paths(fabric: Fabric, flows: Sequence[Flow], improve: bool = True, exact: bool = True) -> Assignment:
    """Paths for every flow (see module doc); deterministic. With `exact`, small instances
    (at most EXACT_COLUMNS flow-path pairs) are also solved as a MILP, kept when better."""
    t0 = time.perf_counter()
    a = Assignment([Route(())] * len(flows), np.zeros(len(fabric.names)),
                   on_link=[set() for _ in fabric.names])
    placer = _Placer(fabric, flows, a)
    for i in sorted(range(len(flows)), key=lambda j: (-flows[j].bytes, j)):
        placer.put(i, placer.best_route(i))
    if improve:
        placer.improve()
    if exact:
        better = _exact(fabric, flows, a.bottleneck(fabric)[0])
        if better is not None:
            a = assign(fabric, flows, better)
    a.seconds = time.perf_counter() - t0
    return a


def _columns(fabric: Fabric, flows: Sequence[Flow]) -> list[tuple[int, tuple[int, ...]]] | None:
    """Every (flow, full path) pair, or None when there are more than EXACT_COLUMNS."""
    cols: list[tuple[int, tuple[int, ...]]] = []
    mids: dict[tuple[str, str], list[tuple[int, ...]]] = {}
    for i, f in enumerate(flows):
        k = f.key
        sps = [p for p in fabric.port_up[k.src][k.src_nic] if fabric.alive[p]]
        dps = [p for p in fabric.port_down[k.dst][k.dst_nic] if fabric.alive[p]]
        pair = (fabric.nic_leaf[k.src][k.src_nic], fabric.nic_leaf[k.dst][k.dst_nic])
        if pair not in mids:
            mids[pair] = fabric.all_switch_paths(*pair)
        if len(cols) + len(sps) * len(dps) * len(mids[pair]) > EXACT_COLUMNS:
            return None
        cols += [(i, (sp,) + mid + (dp,)) for sp in sps for mid in mids[pair] for dp in dps]
    return cols


def _exact(fabric: Fabric, flows: Sequence[Flow], incumbent: float) -> list[Route] | None:
    """Routes of an integral min-max assignment (scipy's HiGHS MILP) when it beats `incumbent`."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    cols = _columns(fabric, flows) if flows else None
    if not cols:
        return None
    links = sorted({link for _i, path in cols for link in path})
    row = {link: j for j, link in enumerate(links)}
    cap = np.asarray(fabric.capacity)
    scale, unit = max(f.bytes for f in flows), float(max(cap[link] for link in links))
    r, c, v = [], [], []
    for j, (i, path) in enumerate(cols):
        for link in path:
            r.append(row[link])
            c.append(j)
            v.append(flows[i].bytes / scale)
        r.append(len(links) + i)  # each flow takes exactly one path
        c.append(j)
        v.append(1.0)
    n = len(cols) + 1
    r += list(range(len(links)))
    c += [n - 1] * len(links)
    v += [-cap[link] / unit for link in links]
    a = coo_matrix((v, (r, c)), shape=(len(links) + len(flows), n)).tocsr()
    lo = [-np.inf] * len(links) + [1.0] * len(flows)
    hi = [0.0] * len(links) + [1.0] * len(flows)
    cost = np.zeros(n)
    cost[-1] = 1.0
    integrality = np.ones(n)
    integrality[-1] = 0
    res = milp(cost, constraints=LinearConstraint(a, lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(n), np.r_[np.ones(n - 1), np.inf]),
               options={"time_limit": EXACT_SECONDS})
    if res.x is None or res.x[-1] * scale / unit >= incumbent * (1 - 1e-9):
        return None
    routes: list[Route | None] = [None] * len(flows)
    for j, (i, path) in enumerate(cols):
        if res.x[j] > 0.5:
            routes[i] = Route(path)
    if any(x is None for x in routes):
        return None
    return routes  # type: ignore[return-value]


def replan(fabric: Fabric, flows: Sequence[Flow], before: Assignment, improve: bool = True) -> Assignment:
    """After links failed (`Fabric.fail`): re-plan the flows whose path crosses a dead link,
    keep the others; raises FabricError when some flow has no path left."""
    t0 = time.perf_counter()
    a = Assignment(list(before.routes), before.load.copy(), on_link=[set(s) for s in before.on_link])
    placer = _Placer(fabric, flows, a)
    hit = sorted({i for link, ok in enumerate(fabric.alive) if not ok for i in a.on_link[link]},
                 key=lambda j: (-flows[j].bytes, j))
    for i in hit:
        placer.take(i)
    for i in hit:
        placer.put(i, placer.best_route(i))
    if improve:
        placer.improve()
    a.moved = len(hit)
    a.seconds = time.perf_counter() - t0
    return a


def ideal(fabric: Fabric, flows: Sequence[Flow]) -> float:
    """The LP lower bound on T (seconds) over all fractional path assignments (see module doc)."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    cap = np.asarray(fabric.capacity)
    # Ports: a NIC's bytes spread evenly over its alive ports is optimal (ports are parallel).
    port_t = 0.0
    nic_out: dict[tuple[int, int], float] = defaultdict(float)
    nic_in: dict[tuple[int, int], float] = defaultdict(float)
    pairs: dict[tuple[str, str], float] = defaultdict(float)
    for f in flows:
        k = f.key
        nic_out[(k.src, k.src_nic)] += f.bytes
        nic_in[(k.dst, k.dst_nic)] += f.bytes
        a, b = fabric.nic_leaf[k.src][k.src_nic], fabric.nic_leaf[k.dst][k.dst_nic]
        if a != b:
            pairs[(a, b)] += f.bytes
    for table, nic_bytes in ((fabric.port_up, nic_out), (fabric.port_down, nic_in)):
        for (n, r), nbytes in nic_bytes.items():
            alive = [p for p in table[n][r] if fabric.alive[p]]
            if not alive:
                raise FabricError(f"{fabric.cluster.source}: fabric: NIC {fabric.cluster.nodes[n].name}.nic{r} "
                                  f"has no port left; failed links: "
                                  f"{', '.join(fabric.names[p] for p in table[n][r])}")
            port_t = max(port_t, nbytes / sum(cap[p] for p in alive))
    if not pairs:
        return port_t
    # Switch links: one commodity per leaf pair, arc variables on its equal-cost DAG.
    rows, cols, vals = [], [], []  # equality rows (conservation)
    b_eq: list[float] = []
    arc_link: list[int] = []
    row = 0
    for (src, dst), demand in pairs.items():
        states: dict[tuple[str, str], int] = {}
        arcs: list[tuple[tuple[str, str], tuple[str, str], int]] = []
        stack = [(src, "up")]
        seen = {(src, "up")}
        while stack:
            at, ph = stack.pop()
            for link, nxt, nph in fabric.choices(at, dst, ph):
                arcs.append(((at, ph), (nxt, nph), link))
                if (nxt, nph) not in seen and nph != "end":
                    seen.add((nxt, nph))
                    stack.append((nxt, nph))
        if not arcs:
            fabric.walk(src, dst, lambda o, t: 0)  # raises FabricError naming the links
        for s in seen:
            states[s] = row
            row += 1
            b_eq.append(demand if s == (src, "up") else 0.0)
        for u, v, link in arcs:
            j = len(arc_link)
            arc_link.append(link)
            rows.append(states[u])
            cols.append(j)
            vals.append(1.0)  # out of u
            if v[1] != "end":
                rows.append(states[v])
                cols.append(j)
                vals.append(-1.0)  # into v
    # Scale bytes and capacities to order 1: HiGHS's tolerances are absolute.
    scale = float(max(b_eq)) or 1.0
    b_eq = [x / scale for x in b_eq]
    n = len(arc_link) + 1  # last variable: T
    a_eq = coo_matrix((vals, (rows, cols)), shape=(row, n)).tocsr()
    links = sorted(set(arc_link))
    where = {link: i for i, link in enumerate(links)}
    ub_rows = [where[link] for link in arc_link] + list(range(len(links)))
    ub_cols = list(range(len(arc_link))) + [n - 1] * len(links)
    unit = float(max(cap[link] for link in links))  # T is solved in units of scale / unit: order 1
    ub_vals = [1.0] * len(arc_link) + [-cap[link] / unit for link in links]
    a_ub = coo_matrix((ub_vals, (ub_rows, ub_cols)), shape=(len(links), n)).tocsr()
    c = np.zeros(n)
    c[-1] = 1.0
    res = linprog(c, A_ub=a_ub, b_ub=np.zeros(len(links)), A_eq=a_eq, b_eq=np.array(b_eq),
                  bounds=[(0, None)] * n, method="highs")
    if res.status != 0:
        raise FabricError(f"traffic LP failed: {res.message}")
    return max(port_t, float(res.x[-1]) * scale / unit)
