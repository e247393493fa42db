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
4. only on request (`max_split` > 1; the default keeps every flow whole, as a fabric carries
   it out): when whole flows stay above the LP bound (flows not a multiple of the cables, a failed
   cable), splits the flows of the busiest links over a few paths each (`split`: an LP over
   each flow's arcs, decomposed into paths, at most `MAX_SPLIT` per flow): a connection's
   queue pairs each take one path (C4P spreads a connection's traffic over its queue pairs).

`ideal` is the fractional lower bound: the LP ``min T`` s.t. every link carries at most
``T x capacity`` when every flow may be split over all its paths (scipy's HiGHS). Ports
are independent of the switch path (all ports of a NIC reach the same leaf), so the LP
works on leaf-pair aggregates with flow conservation at every switch, and the ports'
bound (a NIC's bytes over its alive ports) is taken apart: both are exact.

`replan` moves the flows whose path crossed a failed link (whole, or split when that keeps
more of the throughput), then re-balances the busiest links towards the LP bound.
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
    seconds: float = 0.0  # time the planner took (wall)
    moved: int = 0  # flows re-planned (replan)
    on_link: list[set[int]] = field(default_factory=list, repr=False)
    pieces: dict[int, Pieces] = field(default_factory=dict)  # flows split over several paths
    bound: float | None = None  # the LP bound `ideal` when the planner computed it
    cpu_seconds: float = 0.0  # the planner's CPU time (its wall time counts other processes too)

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
                          [set(s) for s in self.on_link], dict(self.pieces), self.bound, self.cpu_seconds)


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
MAX_SPLIT = 16  # most paths one flow is split over (queue pairs of one connection)


def plan_paths(fabric: Fabric, flows: Sequence[Flow], improve: bool = True, exact: bool = True,
               max_split: int = 1) -> Assignment:
    """Paths for every flow (see module doc); deterministic. With `exact`, small instances
    (at most EXACT_COLUMNS flow-path pairs) are also solved as a MILP, kept when better. By
    default every flow (a queue pair) stays whole on one path: what a NIC, NCCL and the switches
    can carry out. With `max_split` > 1, when whole flows stay above the LP bound the flows of
    the busiest links are split over up to `max_split` paths each (`split`: fractional, for
    comparison with the LP bound; no stock deployment splits one queue pair)."""
    import scipy.optimize  # noqa: F401  (loaded before the clock starts: seconds on a first call)

    t0, c0 = time.perf_counter(), time.process_time()
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
    a.seconds, a.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    return a


def _split_hot(fabric: Fabric, flows: Sequence[Flow], a: Assignment, bound: float, max_split: int,
               rounds: int = 4) -> Assignment:
    """Split the flows of the busiest links while that lowers T towards `bound`: each round
    takes the flows on links within 1%, 5%, 20%, ... of the bottleneck and re-places them
    with `split`."""
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


SPLIT_ARCS = 60000  # (flow, arc) variables up to which the split LP runs


def _switch_arcs(fabric: Fabric, src: str, dst: str) -> list[tuple[tuple[str, str], tuple[str, str], int]]:
    """Arcs (state, next state, link) of the equal-cost DAG from leaf `src` to leaf `dst`
    (states are (switch, phase); the destination is (dst, "end")); FabricError when cut."""
    arcs = []
    seen = {(src, "up")}
    stack = [(src, "up")]
    while stack:
        at, ph = stack.pop()
        for link, nxt, nph in fabric.choices(at, dst, ph):
            arcs.append(((at, ph), (nxt, nph), link))
            if nph != "end" and (nxt, nph) not in seen:
                seen.add((nxt, nph))
                stack.append((nxt, nph))
    if not arcs:
        fabric.walk(src, dst, lambda o, t: 0)  # raises FabricError naming the dead links
    return arcs


def _flow_arcs(fabric: Fabric, f: Flow, memo: dict) -> list[tuple[object, object, int]]:
    """Arcs of flow `f`'s DAG: "S" -> sending ports -> switch DAG -> receiving ports -> "D"."""
    k = f.key
    sps = [p for p in fabric.port_up[k.src][k.src_nic] if fabric.alive[p]]
    dps = [p for p in fabric.port_down[k.dst][k.dst_nic] if fabric.alive[p]]
    if not sps or not dps:
        fabric.route_ecmp(k)  # raises FabricError naming the dead ports
    src, dst = fabric.nic_leaf[k.src][k.src_nic], fabric.nic_leaf[k.dst][k.dst_nic]
    end = (dst, "end")
    if src == dst:
        mid: list = []
        first = end
    else:
        if (src, dst) not in memo:
            memo[(src, dst)] = _switch_arcs(fabric, src, dst)
        mid, first = memo[(src, dst)], (src, "up")
    return [("S", first, p) for p in sps] + list(mid) + [(end, "D", p) for p in dps]


def _decompose(arcs: list[tuple[object, object, int]], x: np.ndarray) -> list[tuple[float, tuple[int, ...]]]:
    """Paths S -> D with their shares from an arc flow `x` (flow decomposition: follow positive
    arcs, take the smallest, subtract; at most one path per positive arc)."""
    x = x.copy()
    out: dict[tuple[int, ...], float] = {}
    by_tail: dict[object, list[int]] = defaultdict(list)
    for j, (u, _v, _l) in enumerate(arcs):
        by_tail[u].append(j)
    for _ in range(len(arcs)):
        at, path = "S", []
        while at != "D":
            nxt = [j for j in by_tail[at] if x[j] > 1e-9]
            if not nxt:
                break
            j = max(nxt, key=lambda q: x[q])
            path.append(j)
            at = arcs[j][1]
        if at != "D" or not path:
            break
        amount = min(x[j] for j in path)
        for j in path:
            x[j] -= amount
        key = tuple(arcs[j][2] for j in path)
        out[key] = out.get(key, 0.0) + float(amount)
    return [(share, links) for links, share in out.items()]


def split(fabric: Fabric, flows: Sequence[Flow], a: Assignment, subset: Sequence[int],
          max_split: int = MAX_SPLIT) -> Assignment | None:
    """`a` with the flows `subset` re-placed, each split over up to `max_split` paths.

    The LP ``min T`` over each flow's fractions on the arcs of its equal-cost DAG (ports,
    cables; flow conservation), the other flows' bytes fixed (scipy's HiGHS), decomposed into
    paths; a flow on more than `max_split` paths keeps its largest ones and the LP over those
    paths is solved again. A split flow is a connection whose queue pairs (one UDP source
    port, so one path, each) carry their shares of its bytes -- C4P balances a connection's
    load over its queue pairs. None when `subset` is empty or has more than SPLIT_ARCS arcs."""
    subset = sorted(set(subset))
    if not subset:
        return None
    memo: dict = {}
    arcs = {i: _flow_arcs(fabric, flows[i], memo) for i in subset}
    if sum(map(len, arcs.values())) > SPLIT_ARCS:
        return None
    b = a.copy()
    placer = _Placer(fabric, flows, b)
    for i in subset:
        placer.take(i)
    x = _arc_lp(fabric, flows, b, arcs)
    if x is None:
        return None
    pieces = {i: _decompose(arcs[i], x[i]) for i in subset}
    many = [i for i in subset if len(pieces[i]) > max_split]
    if many:
        cols = {i: [links for _s, links in sorted(pieces[i], reverse=True)[:max_split]] for i in subset}
        shares = _path_lp(fabric, flows, b, cols)
        if shares is None:
            return None
        pieces = {i: [(float(w), links) for w, links in zip(shares[i], cols[i])] for i in subset}
    for i in subset:
        kept = [(w, links) for w, links in sorted(pieces[i], reverse=True) if w > 1e-6]
        norm = sum(w for w, _l in kept)
        placer.put(i, [(w / norm, Route(links)) for w, links in kept])
    return b


def _lp_rows(fabric: Fabric, b: Assignment, links: list[int]) -> tuple[np.ndarray, float, dict[int, int]]:
    cap = np.asarray(fabric.capacity)
    return cap, float(max(cap[link] for link in links)), {link: k for k, link in enumerate(links)}


def _arc_lp(fabric: Fabric, flows: Sequence[Flow], b: Assignment,
            arcs: dict[int, list[tuple[object, object, int]]]) -> dict[int, np.ndarray] | None:
    """Arc fractions of each flow minimising the busiest link's time over the links they use."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    links = sorted({link for v in arcs.values() for _u, _w, link in v})
    cap, unit, row = _lp_rows(fabric, b, links)
    scale = max(flows[i].bytes for i in arcs) or 1.0
    ur, uc, uv = [], [], []
    er, ec, ev = [], [], []
    b_eq: list[float] = []
    offset: dict[int, int] = {}
    col = eq = 0
    for i, fa in arcs.items():
        offset[i] = col
        states: dict[object, int] = {}
        for u, v, _l in fa:
            for st in (u, v):
                if st != "D" and st not in states:
                    states[st] = eq + len(states)
        for st in states:
            b_eq.append(1.0 if st == "S" else 0.0)
        for j, (u, v, link) in enumerate(fa):
            ur.append(row[link])
            uc.append(col + j)
            uv.append(flows[i].bytes / scale)
            er.append(states[u])
            ec.append(col + j)
            ev.append(1.0)
            if v != "D":
                er.append(states[v])
                ec.append(col + j)
                ev.append(-1.0)
        eq += len(states)
        col += len(fa)
    n = col + 1
    ur += list(range(len(links)))
    uc += [n - 1] * len(links)
    uv += [-cap[link] / unit for link in links]
    res = linprog(np.r_[np.zeros(col), 1.0],
                  A_ub=coo_matrix((uv, (ur, uc)), shape=(len(links), n)).tocsr(), b_ub=-b.load[links] / scale,
                  A_eq=coo_matrix((ev, (er, ec)), shape=(eq, n)).tocsr(), b_eq=np.array(b_eq),
                  bounds=[(0, None)] * n, method="highs")
    if res.status != 0:
        return None
    return {i: res.x[offset[i]:offset[i] + len(fa)] for i, fa in arcs.items()}


def _path_lp(fabric: Fabric, flows: Sequence[Flow], b: Assignment,
             cols: dict[int, list[tuple[int, ...]]]) -> dict[int, np.ndarray] | None:
    """Shares of each flow over the given paths minimising the busiest link's time."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    links = sorted({link for v in cols.values() for path in v for link in path})
    cap, unit, row = _lp_rows(fabric, b, links)
    scale = max(flows[i].bytes for i in cols) or 1.0
    r, c, v, er, ec = [], [], [], [], []
    offset: dict[int, int] = {}
    j = 0
    for k, (i, paths) in enumerate(cols.items()):
        offset[i] = j
        for path in paths:
            for link in path:
                r.append(row[link])
                c.append(j)
                v.append(flows[i].bytes / scale)
            er.append(k)
            ec.append(j)
            j += 1
    n = j + 1
    r += list(range(len(links)))
    c += [n - 1] * len(links)
    v += [-cap[link] / unit for link in links]
    res = linprog(np.r_[np.zeros(j), 1.0], A_ub=coo_matrix((v, (r, c)), shape=(len(links), n)).tocsr(),
                  b_ub=-b.load[links] / scale,
                  A_eq=coo_matrix(([1.0] * len(er), (er, ec)), shape=(len(cols), n)).tocsr(),
                  b_eq=np.ones(len(cols)), bounds=[(0, None)] * n, method="highs")
    if res.status != 0:
        return None
    return {i: res.x[offset[i]:offset[i] + len(paths)] for i, paths in cols.items()}


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
           max_split: int = 1) -> Assignment:
    """After links failed (`Fabric.fail`): re-plan the flows whose path crosses a dead link,
    keep the others; raises FabricError when some flow has no path left. The hit flows are
    placed whole (best path each, then `improve`) and, with `max_split` > 1, also split over
    several paths (`split`, an LP): the better of the two is kept; then, while the busiest
    link is above the LP bound, the flows of the busiest links are split again (`_split_hot`:
    other flows may move too). `moved` counts the flows whose paths changed. Whole flows cannot use the
    capacity a failure leaves as well as split ones: with one flow per cable and one cable
    of ``k`` lost, some cable must carry two whole flows (half the throughput), while
    splitting the hit flow over the ``k - 1`` others keeps ``(k - 1) / k``."""
    import scipy.optimize  # noqa: F401  (loaded before the clock starts)

    t0, c0 = time.perf_counter(), time.process_time()
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
        # Where the cables left were already full (whole flows did not divide them), moving the
        # hit flows is not enough: re-balance the flows of the busiest links towards the bound.
        a = _split_hot(fabric, flows, a, ideal(fabric, flows), max_split)
    a.moved = sum(1 for i in range(len(flows)) if a.paths_of(i) != before.paths_of(i))
    a.seconds, a.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    return a


def whole_bound(fabric: Fabric, flows: Sequence[Flow]) -> float:
    """A lower bound on T for whole flows (no flow split), at least the LP bound `ideal`.

    Every flow between two leaves crosses one of its source leaf's alive up-cables and one of
    its destination leaf's down-cables; every flow one of its NIC's alive ports. On such a cut
    of ``k`` parallel cables, whole flows of sizes ``b_1 >= b_2 >= ...`` are jobs on ``k``
    machines: some cable carries at least ``sum b / k`` and, of the ``m k + 1`` largest flows,
    ``m + 1`` share a cable, so at least ``(m + 1) b_{mk+1}`` (pigeonhole). With one cable of
    16 lost under 16 equal flows: 2 flows on one cable, half the throughput."""
    cap = np.asarray(fabric.capacity)
    cuts: dict[tuple, list[float]] = defaultdict(list)
    for f in flows:
        k = f.key
        cuts[("out", k.src, k.src_nic)].append(f.bytes)
        cuts[("in", k.dst, k.dst_nic)].append(f.bytes)
        a, b = fabric.nic_leaf[k.src][k.src_nic], fabric.nic_leaf[k.dst][k.dst_nic]
        if a != b:
            cuts[("up", a)].append(f.bytes)
            cuts[("down", b)].append(f.bytes)
    best = 0.0
    for key, sizes in cuts.items():
        if key[0] in ("out", "in"):
            table = fabric.port_up if key[0] == "out" else fabric.port_down
            links = [p for p in table[key[1]][key[2]] if fabric.alive[p]]
        else:
            links = _leaf_cut(fabric, key)
        if not links:
            continue
        c, k = float(max(cap[link] for link in links)), len(links)
        sizes.sort(reverse=True)
        t = sum(sizes) / float(sum(cap[link] for link in links))
        for m in range(1, (len(sizes) - 1) // k + 1):
            t = max(t, (m + 1) * sizes[m * k] / c)
        best = max(best, t)
    return max(best, ideal(fabric, flows))


def _leaf_cut(fabric: Fabric, key: tuple) -> list[int]:
    """Alive cables from a leaf up to its spines ("up") or down into it ("down"): every flow
    between two leaves crosses one of each (a flow that may use fewer only tightens it)."""
    side, leaf = key
    s = fabric.switch[leaf]
    pairs = [(leaf, t.name) if side == "up" else (t.name, leaf) for t in fabric.upper(s)]
    return [link for p in pairs for link in fabric.cables.get(p, []) if fabric.alive[link]]


def ideal(fabric: Fabric, flows: Sequence[Flow]) -> float:
    """The LP lower bound on T (seconds) over all fractional path assignments (see module doc)."""
    cap = np.asarray(fabric.capacity)
    nic_out, nic_in, pairs = _nic_and_leaf_bytes(fabric, flows)
    port_t = _port_bound(fabric, cap, nic_out, nic_in)
    if not pairs:
        return port_t
    return float(max(port_t, _switch_bound(cap, _conservation(fabric, pairs))))


def _nic_and_leaf_bytes(fabric: Fabric, flows: Sequence[Flow]
                        ) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float],
                                   dict[tuple[str, str], float]]:
    """Bytes each NIC sends, each NIC receives, and each pair of distinct leaves carries."""
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
    return nic_out, nic_in, pairs


def _port_bound(fabric: Fabric, cap: np.ndarray, nic_out: dict[tuple[int, int], float],
                nic_in: dict[tuple[int, int], float]) -> float:
    """The busiest NIC's time with its bytes on its alive ports; raises FabricError for a NIC with none."""
    # Ports: a NIC's bytes spread evenly over its alive ports is optimal (ports are parallel).
    port_t = 0.0
    for table, nic_bytes in ((fabric.port_up, nic_out), (fabric.port_down, nic_in)):
        for (n, r), nbytes in nic_bytes.items():
            alive = [p for p in table[n][r] if fabric.alive[p]]
            if not alive:
                raise FabricError(f"{fabric.cluster.source}: fabric: NIC {fabric.cluster.nodes[n].name}.nic{r} "
                                  f"has no port left; failed links: "
                                  f"{', '.join(fabric.names[p] for p in table[n][r])}")
            port_t = max(port_t, nbytes / sum(cap[p] for p in alive))
    return port_t


@dataclass
class _Conservation:
    """Flow conservation of every leaf pair's commodity on its equal-cost DAG, as COO equality rows."""

    rows: list[int] = field(default_factory=list)
    cols: list[int] = field(default_factory=list)
    vals: list[float] = field(default_factory=list)
    b_eq: list[float] = field(default_factory=list)
    arc_link: list[int] = field(default_factory=list)  # the link of each arc variable
    row: int = 0  # rows so far


def _conservation(fabric: Fabric, pairs: dict[tuple[str, str], float]) -> _Conservation:
    """The conservation rows of every leaf pair's demand, in `pairs`' order."""
    # Switch links: one commodity per leaf pair, arc variables on its equal-cost DAG.
    eq = _Conservation()
    for (src, dst), demand in pairs.items():
        states: dict[tuple[str, str], int] = {}
        arcs, seen = _commodity_arcs(fabric, src, dst)
        for s in seen:
            states[s] = eq.row
            eq.row += 1
            eq.b_eq.append(demand if s == (src, "up") else 0.0)
        for u, v, link in arcs:
            j = len(eq.arc_link)
            eq.arc_link.append(link)
            eq.rows.append(states[u])
            eq.cols.append(j)
            eq.vals.append(1.0)  # out of u
            if v[1] != "end":
                eq.rows.append(states[v])
                eq.cols.append(j)
                eq.vals.append(-1.0)  # into v
    return eq


def _commodity_arcs(fabric: Fabric, src: str, dst: str
                    ) -> tuple[list[tuple[tuple[str, str], tuple[str, str], int]], set[tuple[str, str]]]:
    """The arcs (state, next state, link) of the equal-cost DAG from leaf `src` up to leaf `dst`,
    and the states they leave; raises FabricError when there is no path."""
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
    return arcs, seen


def _switch_bound(cap: np.ndarray, eq: _Conservation) -> float:
    """``min T`` with every link's arcs at most ``T x capacity`` under the conservation rows `eq`."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    # Scale bytes and capacities to order 1: HiGHS's tolerances are absolute.
    scale = float(max(eq.b_eq)) or 1.0
    b_eq = [x / scale for x in eq.b_eq]
    arc_link = eq.arc_link
    n = len(arc_link) + 1  # last variable: T
    a_eq = coo_matrix((eq.vals, (eq.rows, eq.cols)), shape=(eq.row, n)).tocsr()
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
    return float(res.x[-1]) * scale / unit
