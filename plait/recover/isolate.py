"""Which nodes to isolate for a diagnosis, and the cluster that is left.

A diagnosis names ranks (`plait.ir.diagnosis.Finding.ranks`); the plan maps a rank to a cluster
device (`Plan.device_order`, a graph plan's stage-major ranks) and the cluster a device to its
node. Isolation is by whole node, as C4 does (C4D, HPCA'25 §5: the faulty node is cordoned and
the job restarted without it): a bad GPU, NIC or cable is replaced with its server, and the
cluster model's unit of removal is the node (`plait.cluster.topology.without_nodes`).

A slow link names two ranks and only one end needs to go. The rule (`link_end`), first that
decides:

1. an end whose node is isolated anyway (another finding names it) -- nothing more is lost;
2. an end shared by more slow links than the other -- a bad NIC or cable shows as several slow
   links with one end in common (C4D §4.3's row of the rank x rank matrix);
3. the end whose node has the smaller peak compute (sum of its GPUs' FLOP/s at the plan's dtype)
   -- keep the most compute;
4. the end with the higher rank -- rank 0's node keeps the job's rendezvous store.

Both ends on one node: that node.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from plait.cluster.spec import Cluster
from plait.cluster.topology import without_nodes
from plait.errors import PlaitError
from plait.ir.diagnosis import REPORT_ONLY, Diagnosis, Finding
from plait.ir.plan import Plan


class RecoveryError(PlaitError, RuntimeError):
    """The recovery loop cannot go on: nothing left to run on, no culprit named, no plan fits."""


@dataclass
class Isolation:
    """The nodes a diagnosis isolates and why."""

    nodes: list[str] = field(default_factory=list)
    """Names of the nodes to remove (cluster file names), in the order first named."""
    reasons: dict[str, str] = field(default_factory=dict)
    """Node name -> the finding (and, for a slow link, the rule) that isolates it."""

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": list(self.nodes), "reasons": dict(self.reasons)}


def rank_nodes(plan: Plan, cluster: Cluster) -> list[int]:
    """Per plan rank, the index of the cluster node holding its device."""
    node_of = [d.node for d in cluster.devices]
    out = []
    for r in range(plan.world_size):
        dev = plan.device_of(r)
        if not 0 <= dev < len(node_of):
            raise RecoveryError(f"plan field 'device_order': rank {r} is on device {dev}, which cluster "
                                f"'{cluster.name}' does not have ({len(node_of)} devices)")
        out.append(node_of[dev])
    return out


def node_compute(cluster: Cluster, node: int, dtype: str) -> float:
    """Peak FLOP/s of a node's GPUs together at `dtype`."""
    return sum(cluster.kinds[k].flops(dtype) for k in cluster.nodes[node].gpus)


def link_end(finding: Finding, plan: Plan, cluster: Cluster, isolated: set[int],
             links: list[Finding]) -> tuple[int, str]:
    """(node index, rule) of the end of a slow link to isolate; the rule as in the module doc."""
    if len(finding.ranks) != 2:
        raise RecoveryError(f"slow_link finding names ranks {list(finding.ranks)}: a link needs two ranks")
    nodes = rank_nodes(plan, cluster)
    a, b = sorted(finding.ranks)
    na, nb = nodes[a], nodes[b]
    if na == nb:
        return na, "both ends on one node"
    for n in (na, nb):
        if n in isolated:
            return n, "its node is isolated by another finding"
    shared = Counter(r for f in links for r in f.ranks)
    if shared[a] != shared[b]:
        end = a if shared[a] > shared[b] else b
        return nodes[end], f"rank {end} is an end of {shared[end]} slow links"
    ca, cb = node_compute(cluster, na, plan.dtype), node_compute(cluster, nb, plan.dtype)
    if ca != cb:
        return (na, "less compute on its node") if ca < cb else (nb, "less compute on its node")
    return nb, "the higher rank (rank 0's node keeps the rendezvous)"


def nodes_to_isolate(diagnosis: Diagnosis, plan: Plan, cluster: Cluster) -> Isolation:
    """The nodes to remove for `diagnosis` of a job running `plan` on `cluster`: the nodes of
    every culprit rank, then one end of each slow link (`link_end`)."""
    nodes = rank_nodes(plan, cluster)
    world = plan.world_size
    for f in diagnosis.findings:
        bad = [r for r in f.ranks if not 0 <= r < world]
        if bad:
            raise RecoveryError(f"diagnosis of {diagnosis.run_dir}: finding '{f.kind}' names ranks {bad}, "
                                f"outside the plan's {world} ranks")
    out = Isolation()
    chosen: list[int] = []

    def add(node: int, why: str) -> None:
        name = cluster.nodes[node].name
        if node not in chosen:
            chosen.append(node)
            out.nodes.append(name)
            out.reasons[name] = why

    for f in diagnosis.findings:
        if f.kind not in ("slow_link", *REPORT_ONLY):  # a slow rank is reported, never dropped
            for r in f.ranks:
                add(nodes[r], f"{f.kind} of rank {r}")
    links = [f for f in diagnosis.findings if f.kind == "slow_link"]
    for f in links:
        node, rule = link_end(f, plan, cluster, set(chosen), links)
        a, b = sorted(f.ranks)
        add(node, f"slow_link between ranks {a} and {b}: {rule}")
    return out


def remaining_cluster(original: Cluster, excluded: list[str] | set[str], dtype: str | None = None) -> Cluster:
    """`original` without the nodes named in `excluded`. On an emulated cluster the kinds left keep
    the compute slowdown they had in `original` (`emulation.slowdown`): the emulation's reference
    is the fastest kind of the *original* cluster, so isolating the fast node does not make the
    slow ones fast."""
    names = [n.name for n in original.nodes]
    unknown = sorted(set(excluded) - set(names))
    if unknown:
        raise RecoveryError(f"cluster '{original.name}': no node named {', '.join(map(repr, unknown))} "
                            f"(its nodes: {', '.join(names)})")
    drop = {names.index(n) for n in excluded}
    if len(drop) == len(names):
        raise RecoveryError(f"cluster '{original.name}': isolating {', '.join(sorted(excluded))} would remove "
                            f"every node; nothing is left to train on")
    if not drop:
        return original
    left = without_nodes(original, drop)
    emu = original.emulation
    if emu is not None and emu.enabled:
        from plait.runtime.emulate import compute_slowdown

        first: dict[str, int] = {}
        for d in original.devices:
            first.setdefault(d.kind.name, d.id)
        frozen = {k: compute_slowdown(original, first[k], dtype) for k in left.kinds}
        left = dataclasses.replace(left, emulation=dataclasses.replace(emu, slowdown=frozen))
    return left
