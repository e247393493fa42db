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
   optimum on most shapes, not all (unequal flows can need swaps);
4. when whole flows stay above the LP bound (flows not a multiple of the cables, a failed
   cable), splits the flows of the busiest links over a few paths each (`split`: an LP over
   the fractions, rounded to at most `MAX_SPLIT` paths per flow): a connection's queue pairs
   each take one path (C4P spreads a connection's traffic over its queue pairs).

`ideal` is the fractional lower bound: the LP ``min T`` s.t. every link carries at most
``T x capacity`` when every flow may be split over all its paths (scipy's HiGHS). Ports
are independent of the switch path (all ports of a NIC reach the same leaf), so the LP
works on leaf-pair aggregates with flow conservation at every switch, and the ports'
bound (a NIC's bytes over its alive ports) is taken apart: both are exact.

`replan` moves only the flows whose path crossed a failed link (whole, or split when that
keeps more of the throughput).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from plait.net.fabric import Fabric, FabricError, Route
from plait.net.flows import Flow

Pieces = list[tuple[float, Route]]  # a split flow: (share of its bytes, path), shares summing to 1


@dataclass
class Assignment:
    """Paths of flows and the bytes they put on each link."""

    routes: list[Route]  # each flow's path (a split flow: its largest piece's)
    load: np.ndarray  # bytes per link
    seconds: float = 0.0  # time the planner took
    moved: int = 0  # flows re-planned (replan)
    on_link: list[set[int]] = field(default_factory=list, repr=False)
    pieces: dict[int, Pieces] = field(default_factory=dict)  # flows split over several paths
    bound: float | None = None  # the LP bound `ideal` when the planner computed it

    def bottleneck(self, fabric: Fabric) -> tuple[float, int]:
        """(T in seconds, busiest link id)."""
        util = self.load / np.asarray(fabric.capacity)
        i = int(np.argmax(util))
        return float(util[i]), i

    def paths_of(self, i: int) -> Pieces:
        """Flow `i`'s paths with the share of its bytes each carries."""
        return self.pieces.get(i) or [(1.0, self.routes[i])]

    def paths(self) -> list[Pieces]:
        return [self.paths_of(i) for i in range(len(self.routes))]

    def copy(self) -> Assignment:
        return Assignment(list(self.routes), self.load.copy(), self.seconds, self.moved,
                          [set(s) for s in self.on_link], dict(self.pieces), self.bound)


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

    def put(self, i: int, r: Route | Pieces) -> None:
        pieces = [(1.0, r)] if isinstance(r, Route) else r
        self.a.routes[i] = max(pieces, key=lambda p: p[0])[1]
        if len(pieces) > 1:
            self.a.pieces[i] = pieces
        for share, route in pieces:
            for link in route.links:
                self.a.load[link] += self.flows[i].bytes * share
                self.a.on_link[link].add(i)

    def take(self, i: int) -> Pieces:
        pieces = self.a.paths_of(i)
        self.a.pieces.pop(i, None)
        for share, route in pieces:
            for link in route.links:
                self.a.load[link] -= self.flows[i].bytes * share
                self.a.on_link[link].discard(i)
        return pieces

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
SPLIT_COLUMNS = 20000  # (flow, path) pairs up to which the split LP runs
MAX_SPLIT = 16  # most paths one flow is split over (queue pairs of one connection)


def plan_paths(fabric: Fabric, flows: Sequence[Flow], improve: bool = True, exact: bool = True,
               max_split: int = MAX_SPLIT) -> Assignment:
    """Paths for every flow (see module doc); deterministic. With `exact`, small instances
    (at most EXACT_COLUMNS flow-path pairs) are also solved as a MILP, kept when better. With
    `max_split` > 1, when whole flows stay above the LP bound the flows of the busiest links
    are split over up to `max_split` paths each (`split`)."""
    import scipy.optimize  # noqa: F401  (loaded before the clock starts: seconds on a first call)

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
    if max_split > 1 and flows:
        bound = ideal(fabric, flows)
        a = _split_hot(fabric, flows, a, bound, max_split)
        a.bound = bound
    a.seconds = time.perf_counter() - t0
    return a


def _split_hot(fabric: Fabric, flows: Sequence[Flow], a: Assignment, bound: float, max_split: int,
               rounds: int = 4) -> Assignment:
    """Split the flows of the busiest links while that lowers T towards `bound`: each round
    takes the flows on links within 1%, 5%, 20%, ... of the bottleneck (as many as
    SPLIT_COLUMNS allows) and re-places them with `split`."""
    cap = np.asarray(fabric.capacity)
    for near in (1e-9, 0.01, 0.05, 0.2)[:rounds]:
        t, _ = a.bottleneck(fabric)
        if t <= bound * (1 + 1e-6):
            break
        util = a.load / cap
        hot = [link for link in np.argsort(-util) if util[link] >= t * (1 - near)]
        subset: dict[int, None] = {}
        for link in hot:
            subset.update(dict.fromkeys(sorted(a.on_link[int(link)])))
        b = split(fabric, flows, a, list(subset), max_split)
        if b is not None and b.bottleneck(fabric)[0] < t * (1 - 1e-9):
            a = b
    return a


def _flow_paths(fabric: Fabric, f: Flow, mids: dict[tuple[str, str], list[tuple[int, ...]]]
                ) -> list[tuple[int, ...]]:
    """Every alive path of flow `f` (sending port, switch path, receiving port)."""
    k = f.key
    sps = [p for p in fabric.port_up[k.src][k.src_nic] if fabric.alive[p]]
    dps = [p for p in fabric.port_down[k.dst][k.dst_nic] if fabric.alive[p]]
    pair = (fabric.nic_leaf[k.src][k.src_nic], fabric.nic_leaf[k.dst][k.dst_nic])
    if pair not in mids:
        mids[pair] = fabric.all_switch_paths(*pair)
    return [(sp,) + mid + (dp,) for sp in sps for mid in mids[pair] for dp in dps]


def split(fabric: Fabric, flows: Sequence[Flow], a: Assignment, subset: Sequence[int],
          max_split: int = MAX_SPLIT) -> Assignment | None:
    """`a` with the flows `subset` re-placed, each split over up to `max_split` paths.

    The LP ``min T`` over the fractions ``x_fp`` of each flow on each of its paths, the other
    flows' bytes fixed (scipy's HiGHS; a simplex vertex, so few fractions are non-zero), then
    each flow keeps its `max_split` largest fractions and the LP is solved again on those.
    A split flow is a connection whose queue pairs (one UDP source port, so one path, each)
    carry their shares of its bytes -- C4P balances a connection's load over its queue
    pairs. None when `subset` has more than SPLIT_COLUMNS flow-path pairs or is empty."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    subset = sorted(set(subset))
    if not subset:
        return None
    mids: dict[tuple[str, str], list[tuple[int, ...]]] = {}
    cols: list[tuple[int, tuple[int, ...]]] = []
    for i in subset:
        paths = _flow_paths(fabric, flows[i], mids)
        if not paths:
            return None
        cols += [(i, p) for p in paths]
        if len(cols) > SPLIT_COLUMNS:
            return None
    b = a.copy()
    placer = _Placer(fabric, flows, b)
    for i in subset:
        placer.take(i)
    cap = np.asarray(fabric.capacity)
    scale = max(flows[i].bytes for i in subset) or 1.0
    links = sorted({link for _i, p in cols for link in p})
    unit = float(max(cap[link] for link in links))
    row = {link: k for k, link in enumerate(links)}
    slot = {i: k for k, i in enumerate(subset)}

    def solve(use: list[int]) -> np.ndarray | None:
        n = len(use) + 1
        r, c, v = [], [], []
        er, ec = [], []
        for j, col in enumerate(use):
            i, path = cols[col]
            for link in path:
                r.append(row[link])
                c.append(j)
                v.append(flows[i].bytes / scale)
            er.append(slot[i])
            ec.append(j)
        r += list(range(len(links)))
        c += [n - 1] * len(links)
        v += [-cap[link] / unit for link in links]
        a_ub = coo_matrix((v, (r, c)), shape=(len(links), n)).tocsr()
        a_eq = coo_matrix(([1.0] * len(er), (er, ec)), shape=(len(subset), n)).tocsr()
        cost = np.zeros(n)
        cost[-1] = 1.0
        res = linprog(cost, A_ub=a_ub, b_ub=-b.load[links] / scale, A_eq=a_eq, b_eq=np.ones(len(subset)),
                      bounds=[(0, None)] * n, method="highs-ds")
        return None if res.status != 0 else res.x[:-1]

    use = list(range(len(cols)))
    x = solve(use)
    if x is None:
        return None
    by_flow: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for j, col in enumerate(use):
        if x[j] > 1e-9:
            by_flow[cols[col][0]].append((float(x[j]), col))
    if any(len(v) > max_split for v in by_flow.values()):
        use = [col for i in subset for _x, col in sorted(by_flow[i], reverse=True)[:max_split]]
        x = solve(use)
        if x is None:
            return None
        by_flow = defaultdict(list)
        for j, col in enumerate(use):
            if x[j] > 1e-9:
                by_flow[cols[col][0]].append((float(x[j]), col))
    for i in subset:
        total = sum(share for share, _col in by_flow[i])
        pieces = [(share / total, Route(cols[col][1])) for share, col in sorted(by_flow[i], reverse=True)
                  if share / total > 1e-6]
        norm = sum(share for share, _r in pieces)
        placer.put(i, [(share / norm, route) for share, route in pieces])
    return b


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


def replan(fabric: Fabric, flows: Sequence[Flow], before: Assignment, improve: bool = True,
           max_split: int = MAX_SPLIT) -> Assignment:
    """After links failed (`Fabric.fail`): re-plan the flows whose path crosses a dead link,
    keep the others; raises FabricError when some flow has no path left. The hit flows are
    placed whole (best path each, then `improve`) and, with `max_split` > 1, also split over
    several paths (`split`, an LP): the better of the two is kept. Whole flows cannot use the
    capacity a failure leaves as well as split ones: with one flow per cable and one cable
    of ``k`` lost, some cable must carry two whole flows (half the throughput), while
    splitting the hit flow over the ``k - 1`` others keeps ``(k - 1) / k``."""
    import scipy.optimize  # noqa: F401  (loaded before the clock starts)

    t0 = time.perf_counter()
    a = before.copy()
    placer = _Placer(fabric, flows, a)
    hit = sorted({i for link, ok in enumerate(fabric.alive) if not ok for i in a.on_link[link]},
                 key=lambda j: (-flows[j].bytes, j))
    for i in hit:
        placer.take(i)
    for i in hit:
        placer.put(i, placer.best_route(i))
    if improve:
        placer.improve()
    if max_split > 1 and hit:
        b = split(fabric, flows, a, hit, max_split)
        if b is not None and b.bottleneck(fabric)[0] < a.bottleneck(fabric)[0] * (1 - 1e-9):
            a = b
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
    return float(max(port_t, float(res.x[-1]) * scale / unit))
