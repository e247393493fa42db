"""Alpha-beta costs of collectives and point-to-point transfers, and NCCL-like algorithm choice.

Conventions follow nccl-tests (``doc/PERFORMANCE.md``): ``S`` is the message size in
bytes *per rank* as the API sees it (the full buffer of an all-reduce; the full output
of an all-gather / full input of a reduce-scatter), ``n`` the number of ranks,
``algbw = S / t`` and ``busbw = algbw * factor`` with

==================  =====================
operation           bus factor
==================  =====================
all_reduce          2 (n - 1) / n
reduce_scatter      (n - 1) / n
all_gather          (n - 1) / n
all_to_all          (n - 1) / n
broadcast, send     1
==================  =====================

so that ``busbw`` of a bandwidth-bound collective is the link bandwidth it runs at.

Costs (``a`` the per-step latency alpha of the slowest link, ``B`` its bandwidth,
``g`` an optional reduction cost per byte, Shi et al. 2018's gamma):

* ring all-reduce (SYSTEMS.md §1): ``2(n-1) a + 2(n-1)/n S/B + (n-1)/n S g``;
* ring reduce-scatter / all-gather: ``(n-1) a + (n-1)/n S/B`` (+ ``(n-1)/n S g`` for RS);
* tree all-reduce (NCCL's pipelined double binary tree): ``2 ceil(log2 n) a + 2 S/B`` --
  the reduce and the broadcast each move the whole buffer once, so the bandwidth term
  does not shrink with ``n`` but the latency grows only logarithmically;
* hierarchical all-reduce (SYSTEMS.md reference numbers): intra-node reduce-scatter,
  inter-node all-reduce of each ``S/g`` shard, intra-node all-gather;
* all-to-all: ``(n-1) a + (n-1)/n S/B`` (each rank sends ``S/n`` to every other rank); across
  nodes of ``g`` ranks each, ``(n-1) a + max(g (n-g)/n S / (B_inter c), (g-1)/n S / B_intra)``: a
  node's ranks share its ``c`` NICs for what leaves the node;
* reduce-scatter as an all-reduce ("allreduce", gloo's ``ProcessGroupGloo::reduce_scatter_tensor``:
  it clones the input, all-reduces all of it and keeps this rank's slice): the ring all-reduce of
  the whole input, ``2(n-1) a + 2(n-1)/n S/B + (n-1)/n S g`` -- twice the bytes and latency steps
  of a ring reduce-scatter;
* send/recv: ``a + S/B``; broadcast (pipelined ring): ``(n-1) a + S/B``; reduce (pipelined
  ring to one root): ``(n-1) a + S/B + S g``.

Uneven shards (HAP, Zhang et al. EuroSys'24 section 5.3), `uneven_collective_time`: device ``i``
holds ``s_i`` of an ``S``-byte tensor (``sum s_i = 1``). NCCL's all-gather and reduce-scatter need
equal shards, so either every shard is *padded* to the largest -- the ring collective on
``n max_i s_i S`` bytes -- or the collective is *grouped*: one broadcast (all-gather) or reduce
(reduce-scatter) per owner of ``s_i S`` bytes, issued back to back, ``sum_i [(n-1) a + s_i S/B]
= n (n-1) a + S/B``. Padded wins on even shards and many devices (latency), grouped on skewed
shards (bandwidth); `choose_uneven` takes the cheaper per message.

A collective runs at the pace of its slowest link: ``B`` is the smallest and ``a`` the
largest over the links its ring/tree uses (Pipette: ``max(1/BW)`` over the ring).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from plait.cluster.spec import Cluster, MeasuredCollective
from plait.errors import PlaitError

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce", "send_recv")
UNEVEN_OPS = ("all_gather", "reduce_scatter", "all_to_all")  # collectives whose shards may be uneven
ALGORITHMS = ("auto", "ring", "tree", "hierarchical", "padded", "grouped", "measured", "allreduce")


class CollectiveError(PlaitError, ValueError):
    """A collective asked for with impossible arguments."""


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor for `op` on `n` ranks."""
    if n <= 1:
        return 1.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "send_recv"):
        return 1.0
    raise CollectiveError(f"unknown collective {op!r}; use one of {OPS}")


def busbw(op: str, nbytes: float, n: int, seconds: float) -> float:
    """Bus bandwidth (bytes/s) of a measured or predicted collective (nccl-tests convention)."""
    return nbytes / seconds * bus_factor(op, n) if seconds > 0 else float("inf")


# ---------------------------------------------------------------- alpha-beta formulas
def ring_all_reduce_time(nbytes: float, n: int, bandwidth: float, alpha: float,
                         gamma: float = 0.0) -> float:
    """Ring all-reduce: ``2(n-1) a + 2(n-1)/n S/B + (n-1)/n S g`` (Shi et al. 2018, SYSTEMS.md §1)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bandwidth + (n - 1) / n * nbytes * gamma


def tree_all_reduce_time(nbytes: float, n: int, bandwidth: float, alpha: float,
                         gamma: float = 0.0) -> float:
    """Pipelined (double binary) tree all-reduce: ``2 ceil(log2 n) a + 2 S/B + S g``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * alpha + 2 * nbytes / bandwidth + nbytes * gamma


def ring_reduce_scatter_time(nbytes: float, n: int, bandwidth: float, alpha: float,
                             gamma: float = 0.0) -> float:
    """Ring reduce-scatter of an `nbytes` input: ``(n-1) a + (n-1)/n S/B (+ (n-1)/n S g)``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * alpha + (n - 1) / n * nbytes / bandwidth + (n - 1) / n * nbytes * gamma


def ring_all_gather_time(nbytes: float, n: int, bandwidth: float, alpha: float) -> float:
    """Ring all-gather of an `nbytes` output: ``(n-1) a + (n-1)/n S/B``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * alpha + (n - 1) / n * nbytes / bandwidth


def all_to_all_time(nbytes: float, n: int, bandwidth: float, alpha: float) -> float:
    """All-to-all of `nbytes` per rank: ``(n-1) a + (n-1)/n S/B``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * alpha + (n - 1) / n * nbytes / bandwidth


def send_recv_time(nbytes: float, bandwidth: float, alpha: float) -> float:
    """Point-to-point: ``a + S/B``."""
    if nbytes <= 0:
        return 0.0
    return alpha + nbytes / bandwidth


def broadcast_time(nbytes: float, n: int, bandwidth: float, alpha: float) -> float:
    """Pipelined ring broadcast: ``(n-1) a + S/B``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * alpha + nbytes / bandwidth


def reduce_time(nbytes: float, n: int, bandwidth: float, alpha: float, gamma: float = 0.0) -> float:
    """Pipelined ring reduce to one root: ``(n-1) a + S/B + S g``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * alpha + nbytes / bandwidth + nbytes * gamma


def hierarchical_all_reduce_time(nbytes: float, nodes: int, per_node: int, intra_bw: float,
                                 intra_alpha: float, inter_bw: float, inter_alpha: float,
                                 gamma: float = 0.0) -> float:
    """Intra-node reduce-scatter + inter-node ring all-reduce of each 1/g shard + intra all-gather.

    With ``g`` GPUs per node each GPU drives its own inter-node ring on ``S/g`` bytes
    (NCCL's per-rail rings), so the inter-node phase costs ``ring(S/g, nodes)`` at
    `inter_bw`, the bandwidth one shard's ring gets (the node's NICs shared by g rings)."""
    if nodes * per_node <= 1 or nbytes <= 0:
        return 0.0
    t = ring_reduce_scatter_time(nbytes, per_node, intra_bw, intra_alpha, gamma)
    t += ring_all_reduce_time(nbytes / per_node, nodes, inter_bw, inter_alpha, gamma)
    t += ring_all_gather_time(nbytes, per_node, intra_bw, intra_alpha)
    return t


# ---------------------------------------------------------------- groups on a cluster
@dataclass(frozen=True)
class GroupLinks:
    """What the alpha-beta model needs to know about a group of devices.

    `ring_bandwidth` / `ring_latency` are the slowest link (smallest bandwidth, largest
    latency) of the ring through the devices in the given order; `intra_*` and `inter_*`
    the slowest intra-node and inter-node pairs (for hierarchical all-reduce); `nodes`
    the number of distinct nodes and `per_node` the largest number of group members on
    one node. `inter_channels` is how many NICs of each node the group drives at once
    (``min over its nodes of min(members there, NICs there)``): NCCL runs one ring or tree
    channel per NIC, rail-affine, so a group crossing nodes moves ``inter_channels`` times the
    bandwidth of one inter-node pair. That is why one 800 Gb/s NIC and eight 100 Gb/s NICs per
    node give the same collective time (each pair figure is one NIC's)."""

    n: int
    ring_bandwidth: float
    ring_latency: float
    nodes: int
    per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    inter_channels: int = 1
    # measured busbw tables of the cluster for groups of this span (see `measured_tables`)
    measured: tuple[MeasuredCollective, ...] = ()


def group_links(devices: Sequence[int], bandwidth: np.ndarray, latency: np.ndarray,
                node_of: Sequence[int] | np.ndarray, nics_of_node: Sequence[int] | None = None,
                measured: Sequence[MeasuredCollective] = ()) -> GroupLinks:
    """Slowest-link summary of the ring ``devices[0] -> devices[1] -> ... -> devices[0]``.

    `nics_of_node[k]`: NICs of node k (default one each); the inter-node hops of the ring run
    on `inter_channels` NICs at once (see `GroupLinks`). `measured`: the cluster's measured
    collectives (`measured_tables`); those of the group's span are kept."""
    devs = list(devices)
    n = len(devs)
    if n <= 1:
        return GroupLinks(n, float("inf"), 0.0, 1, 1, float("inf"), 0.0, float("inf"), 0.0)
    src = np.array(devs)
    dst = np.roll(src, -1)
    bw = np.asarray(bandwidth)[src, dst]
    lat = np.asarray(latency)[src, dst]
    nodes = np.asarray(node_of)[src]
    same = nodes[:, None] == nodes[None, :]
    np.fill_diagonal(same, False)
    cross = nodes[:, None] != nodes[None, :]
    sub_bw = np.asarray(bandwidth)[np.ix_(src, src)]
    sub_lat = np.asarray(latency)[np.ix_(src, src)]
    intra_bw = float(sub_bw[same].min()) if same.any() else float("inf")
    intra_lat = float(sub_lat[same].max()) if same.any() else 0.0
    inter_bw = float(sub_bw[cross].min()) if cross.any() else float("inf")
    inter_lat = float(sub_lat[cross].max()) if cross.any() else 0.0
    members, counts = np.unique(nodes, return_counts=True)
    channels = 1
    if len(members) > 1:
        channels = _inter_channels(members, counts, nics_of_node)
        hop_cross = nodes != np.roll(nodes, -1)
        bw = np.where(hop_cross, bw * channels, bw)
    span = len(counts)
    tables = tuple(m for m in measured if (m.nodes == 1) == (span == 1))
    return GroupLinks(n, float(bw.min()), float(lat.max()), span, int(counts.max()),
                      intra_bw, intra_lat, inter_bw, inter_lat, channels, tables)


def _inter_channels(members: Sequence[int] | np.ndarray, counts: Sequence[int] | np.ndarray,
                    nics_of_node: Sequence[int] | None) -> int:
    """NICs of each node a group spanning `members` (with `counts` devices on each) drives at
    once: min over its nodes of min(members there, NICs there) (see `GroupLinks`)."""
    nics = [1 if nics_of_node is None else max(1, int(nics_of_node[k])) for k in members]
    return int(min(min(int(c), k) for c, k in zip(counts, nics)))


def ring_hops(ring: Sequence[int], node_of: Sequence[int] | np.ndarray, nics_of_node: Sequence[int] | None = None
              ) -> list[tuple[int, int, float]]:
    """(src, dst, share) of every hop of the ring ``ring[0] -> ring[1] -> ... -> ring[0]``, `share`
    being the part of one ring hop's bytes it carries.

    A hop inside a node carries all of it. A hop between nodes runs on `inter_channels` rails at
    once, as NCCL runs one ring channel per NIC, rail-affine: channel ``c`` leaves node X from
    its ``c``-th group member (device order, i.e. the ``c``-th rail) and enters node Y at its
    ``c``-th member, carrying ``1/channels``. The one ring layout the traffic module's flows
    (`plait.cost.traffic`, which a fabric planner routes) and the simulator's link loads share."""
    devs = [int(d) for d in ring]
    if len(devs) < 2:
        return []
    nodes = [int(node_of[d]) for d in devs]
    members: dict[int, list[int]] = {}
    for d, k in zip(devs, nodes):
        members.setdefault(k, []).append(d)
    if len(members) == 1:
        return [(a, b, 1.0) for a, b in zip(devs, devs[1:] + devs[:1])]
    keys = list(members)
    channels = _inter_channels(keys, [len(members[k]) for k in keys], nics_of_node)
    local = {k: sorted(v) for k, v in members.items()}
    out: list[tuple[int, int, float]] = []
    for (a, b), (x, y) in zip(zip(devs, devs[1:] + devs[:1]), zip(nodes, nodes[1:] + nodes[:1])):
        if x == y:
            out.append((a, b, 1.0))
        elif channels == 1:
            out.append((a, b, 1.0))
        else:
            out += [(local[x][c], local[y][c], 1.0 / channels) for c in range(channels)]
    return out


def collective_time(op: str, nbytes: float, links: GroupLinks, algorithm: str = "ring",
                    gamma: float = 0.0) -> float:
    """Time of `op` on a group summarised by `links` with a *concrete* algorithm
    ("measured": read off the cluster's measured busbw table, see `measured_time`)."""
    n = links.n
    if n <= 1 or nbytes <= 0:
        return 0.0
    if algorithm == "measured":
        table = pick_measured(links, op)
        if table is None:
            raise CollectiveError(f"no measured {op} table for a group of {n} ranks on {links.nodes} node(s)")
        return measured_time(table, op, nbytes, n)
    B, a = links.ring_bandwidth, links.ring_latency
    if op == "all_reduce":
        if algorithm == "tree":
            return tree_all_reduce_time(nbytes, n, B, a, gamma)
        if algorithm == "hierarchical" and links.nodes > 1 and links.per_node > 1:
            # The per_node shard rings cross the nodes at once, sharing the node's channels.
            shard_bw = links.inter_bandwidth * links.inter_channels / links.per_node
            return hierarchical_all_reduce_time(
                nbytes, links.nodes, links.per_node, links.intra_bandwidth, links.intra_latency,
                shard_bw, links.inter_latency, gamma)
        return ring_all_reduce_time(nbytes, n, B, a, gamma)
    if op == "reduce_scatter":
        if algorithm == "allreduce":
            return ring_all_reduce_time(nbytes, n, B, a, gamma)
        return ring_reduce_scatter_time(nbytes, n, B, a, gamma)
    if op == "all_gather":
        return ring_all_gather_time(nbytes, n, B, a)
    if op == "all_to_all":
        if links.nodes > 1 and links.per_node > 1:
            # Every rank sends S/n to each other rank: a node's g ranks put g (n - g)/n S through
            # its inter_channels NICs at once, and (g - 1)/n S each over the intra-node links.
            g = links.per_node
            inter = g * (n - g) / n * nbytes / (links.inter_bandwidth * links.inter_channels)
            intra = (g - 1) / n * nbytes / links.intra_bandwidth
            return (n - 1) * a + max(inter, intra)
        return all_to_all_time(nbytes, n, B, a)
    if op == "broadcast":
        return broadcast_time(nbytes, n, B, a)
    if op == "reduce":
        return reduce_time(nbytes, n, B, a, gamma)
    if op == "send_recv":
        return send_recv_time(nbytes, B, a)
    raise CollectiveError(f"unknown collective {op!r}; use one of {OPS}")


def choose_algorithm(op: str, nbytes: float, links: GroupLinks, pinned: str | None = None) -> str:
    """The algorithm NCCL would pick for `op`, or `pinned` when the plan names one.

    NCCL's tuner estimates every algorithm with an alpha-beta model and keeps the fastest
    (``src/graph/tuning.cc``); in effect tree for latency-bound all-reduces across nodes
    and ring once the message is large enough for bandwidth to dominate. Only all-reduce
    has a choice here; "padded"/"grouped" (HAP's uneven-shard collectives) cost as ring
    at the padded size, which the caller supplies; "allreduce" is a reduce-scatter's only (gloo's),
    any other operation pinned to it runs its ring."""
    if pinned not in (None, "auto"):
        if pinned not in ALGORITHMS:
            raise CollectiveError(f"unknown collective algorithm {pinned!r}; use one of {ALGORITHMS}")
        if pinned == "allreduce" and op != "reduce_scatter":
            return "ring"
        return "ring" if pinned in ("padded", "grouped") else pinned
    if links.n > 1 and pick_measured(links, op) is not None:
        return "measured"  # the measurement already carries NCCL's own choice
    if op != "all_reduce" or links.n <= 2:
        return "ring"
    candidates = ["ring", "tree"] + (["hierarchical"] if links.nodes > 1 and links.per_node > 1 else [])
    # NCCL only uses tree across nodes; inside one NVSwitch node ring always wins.
    if links.nodes == 1:
        return "ring"
    return min(candidates, key=lambda algo: collective_time(op, nbytes, links, algo))


def flow_bytes_per_link(op: str, nbytes: float, n: int, algorithm: str = "ring") -> float:
    """Bytes each link of the ring carries for `op` (used to share link bandwidth in the engine).

    For a ring every link carries ``bus_factor * S`` bytes, which is why the collective's
    time is ``latency + bus_factor * S / B_slowest``; a tree's busiest links carry ``2S``."""
    if n <= 1:
        return 0.0
    if op == "all_reduce" and algorithm == "tree":
        return 2.0 * nbytes
    if op == "reduce_scatter" and algorithm == "allreduce":
        return bus_factor("all_reduce", n) * nbytes
    return bus_factor(op, n) * nbytes


def latency_steps(op: str, n: int, algorithm: str = "ring") -> int:
    """Number of alpha terms in the formula of `op` (ring steps or tree levels)."""
    if n <= 1:
        return 0
    if op == "all_reduce" or (op == "reduce_scatter" and algorithm == "allreduce"):
        return 2 * math.ceil(math.log2(n)) if algorithm == "tree" else 2 * (n - 1)
    if op in ("reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce"):
        return n - 1
    return 1


# ---------------------------------------------------------------- uneven shards (HAP)
def uneven_collective_time(op: str, nbytes: float, shares: Sequence[float] | np.ndarray, links: GroupLinks,
                           algorithm: str = "padded", gamma: float = 0.0) -> float:
    """Time of `op` (all-gather, reduce-scatter, all-to-all) of an `nbytes` tensor whose device
    ``i`` holds ``shares[i]`` of it (module docstring): "padded" -- the ring collective on every
    shard padded to the largest; "grouped" -- one broadcast (all-gather) or reduce
    (reduce-scatter) per shard owner, back to back. All-to-all has no grouped form here."""
    if op not in UNEVEN_OPS:
        raise CollectiveError(f"uneven shards: {op!r} is not one of {UNEVEN_OPS}")
    s = np.asarray(shares, dtype=float)
    if len(s) != links.n:
        raise CollectiveError(f"uneven {op}: {len(s)} shares for a group of {links.n} ranks")
    if links.n <= 1 or nbytes <= 0:
        return 0.0
    if algorithm == "padded":
        if op == "all_to_all":  # each rank's buffer is its own shard (split over the others): the largest's
            return collective_time(op, float(s.max()) * nbytes, links, "ring", gamma)
        return collective_time(op, links.n * float(s.max()) * nbytes, links, "ring", gamma)
    if algorithm == "grouped" and op != "all_to_all":
        root_op = "broadcast" if op == "all_gather" else "reduce"
        # each owner's ring broadcast / reduce is affine in its bytes, f(x) = c + k x for x > 0
        # (0 for an empty shard): the sum over m owners is f(X) + (m - 1) c, X their total,
        # with c = 2 f(X) - f(2X) -- one evaluation per message instead of one per device
        owners = s[s > 0]
        if owners.size == 0:
            return 0.0
        total = float(owners.sum()) * nbytes
        once = collective_time(root_op, total, links, "ring", gamma)
        fixed = 2.0 * once - collective_time(root_op, 2.0 * total, links, "ring", gamma)
        return once + (owners.size - 1) * fixed
    allowed = "'padded'" if op == "all_to_all" else "'padded' or 'grouped'"
    raise CollectiveError(f"uneven {op}: algorithm must be {allowed}, got {algorithm!r}")


def choose_uneven(op: str, nbytes: float, shares: Sequence[float] | np.ndarray, links: GroupLinks,
                  pinned: str | None = None) -> tuple[str, float]:
    """(algorithm, seconds): the cheaper of padded and grouped for this message, or `pinned`
    ("padded" / "grouped": one global choice, as HAP's code has it) where it applies."""
    algos = ["padded"] if op == "all_to_all" else ["padded", "grouped"]
    if pinned not in (None, "auto"):
        if pinned not in ("padded", "grouped"):
            raise CollectiveError(f"uneven {op}: pinned algorithm must be 'padded' or 'grouped', got {pinned!r}")
        algos = [pinned] if pinned in algos else ["padded"]
    times = {a: uneven_collective_time(op, nbytes, shares, links, a) for a in algos}
    best = min(algos, key=times.__getitem__)
    return best, times[best]


# ---------------------------------------------------------------- measured bus bandwidth
def measured_tables(cluster: Cluster) -> tuple[MeasuredCollective, ...]:
    """The measured collectives the cost model uses on `cluster`: all of them on a cluster
    described without a switched fabric; none where leaf/spine switches are described, because
    there flows on paths decide and measurements may only calibrate per-link efficiency --
    never both at once (issue 12 item 3)."""
    if any(s.tier in ("leaf", "spine") for s in cluster.switches):
        return ()
    return tuple(cluster.collectives)


def pick_measured(links: GroupLinks, op: str) -> MeasuredCollective | None:
    """The table of `op` measured on the group most like this one: same span (one node or
    several, `group_links` keeps only those), then the closest node count, then the closest
    rank count (busbw is by construction about independent of the rank count)."""
    tables = [m for m in links.measured if m.op == op]
    if not tables:
        return None
    return min(tables, key=lambda m: (abs(m.nodes - links.nodes), abs(m.ranks - links.n)))


def measured_busbw(table: MeasuredCollective, nbytes: float) -> float:
    """Bus bandwidth at `nbytes`: linear in log(size) between measured sizes, the end values
    outside them."""
    sizes = np.log(np.asarray(table.sizes, dtype=float))
    return float(np.interp(math.log(max(nbytes, 1.0)), sizes, np.asarray(table.busbw, dtype=float)))


def measured_time(table: MeasuredCollective, op: str, nbytes: float, n: int) -> float:
    """``t = S * busfactor(op, n) / busbw(S)`` (nccl-tests' definition read backwards). Below the
    smallest measured size the time of the smallest size is kept: small collectives are
    latency-bound, so their time does not shrink with the size."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    size = max(float(nbytes), float(table.sizes[0]))
    return size * bus_factor(op, n) / measured_busbw(table, size)
