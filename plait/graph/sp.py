"""Series-parallel decomposition of a model's layer DAG (the first step of GraphPipe's partitioner).

GraphPipe (Jeon et al., ASPLOS'25, §5) runs its dynamic programme over a series-parallel
decomposition of the model: a *series* node is a sequence of parts where every layer of a part
precedes every layer of the next, a *parallel* node a set of parts with no path between them.
Node-level rule used here, applied recursively to a set of layers S:

* its weakly connected components, when there are several, are the children of a parallel node;
* otherwise its *separators* -- layers comparable (ancestor or descendant) with every other layer
  of S -- cut it into a series node: the runs of layers between two separators, and the
  separators themselves, in topological order (a skip edge such as ``a -> c`` over ``b`` keeps
  ``a, b, c`` a series: each is comparable with the others);
* a connected set with no separator is **not series-parallel** (e.g. two sources crossing into
  two sinks, ``a->c, a->d, b->d``). It becomes one *collapsed* leaf: an indivisible unit that a
  stage takes whole. This is the smallest offending sub-graph: it is what is left after every
  series and parallel split of its enclosing parts has been taken, so collapsing never crosses a
  cut that could have been made; `SPNode.collapsed` records it so the planner can say so.

Pure function of the layer DAG (layer names and edges); no costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from plait.ir.opgraph import OpGraph


@dataclass
class SPNode:
    """A node of the decomposition. `kind` is "leaf", "series" or "parallel"; `layers` are the
    layer names under it in the model's topological order."""

    kind: str
    layers: tuple[str, ...]
    children: list[SPNode] = field(default_factory=list)
    collapsed: bool = False  # a leaf of several layers that are not series-parallel

    def leaves(self) -> list[SPNode]:
        if self.kind == "leaf":
            return [self]
        return [leaf for c in self.children for leaf in c.leaves()]

    def collapsed_leaves(self) -> list[SPNode]:
        return [leaf for leaf in self.leaves() if leaf.collapsed]

    def describe(self, depth: int = 0) -> str:
        pad = "  " * depth
        if self.kind == "leaf":
            tag = " (collapsed: not series-parallel)" if self.collapsed else ""
            return f"{pad}{', '.join(self.layers)}{tag}"
        return "\n".join([f"{pad}{self.kind}"] + [c.describe(depth + 1) for c in self.children])


def decompose(graph: OpGraph | nx.DiGraph, order: list[str] | None = None) -> SPNode:
    """The series-parallel tree of `graph`'s layer DAG (module docstring)."""
    if isinstance(graph, OpGraph):
        dag = graph.layer_dag()
        order = graph.layer_names
    else:
        dag = graph
    if order is None:
        order = list(nx.lexicographical_topological_sort(dag))
    pos = {n: i for i, n in enumerate(order)}
    desc = {n: nx.descendants(dag, n) for n in dag.nodes}
    return _split(dag, frozenset(dag.nodes), pos, desc)


def _split(dag: nx.DiGraph, nodes: frozenset[str], pos: dict[str, int], desc: dict[str, set[str]]) -> SPNode:
    ordered = tuple(sorted(nodes, key=pos.__getitem__))
    if len(ordered) == 1:
        return SPNode("leaf", ordered)
    sub = dag.subgraph(nodes)
    comps = list(nx.weakly_connected_components(sub))
    if len(comps) > 1:
        kids = [_split(dag, frozenset(c), pos, desc) for c in comps]
        kids.sort(key=lambda k: pos[k.layers[0]])
        return SPNode("parallel", ordered, kids)
    # comparable with every other node of the set: an ancestor or a descendant of each
    anc = {n: set() for n in ordered}
    for n in ordered:
        for d in desc[n] & nodes:
            anc[d].add(n)
    seps = [n for n in ordered if len((desc[n] & nodes) | anc[n]) == len(ordered) - 1]
    if not seps:
        return SPNode("leaf", ordered, collapsed=True)
    kids: list[SPNode] = []
    run: list[str] = []
    sep_set = set(seps)
    for n in ordered:  # separators are totally ordered, and every other layer sits between two
        if n in sep_set:
            if run:
                kids.append(_split(dag, frozenset(run), pos, desc))
                run = []
            kids.append(SPNode("leaf", (n,)))
        else:
            run.append(n)
    if run:
        kids.append(_split(dag, frozenset(run), pos, desc))
    flat: list[SPNode] = []
    for k in kids:  # a run that is itself a series joins this one
        flat.extend(k.children if k.kind == "series" else [k])
    return SPNode("series", ordered, flat)


def count_ideals(graph: OpGraph | nx.DiGraph, cap: int | None = None) -> int:
    """How many ideals (predecessor-closed layer sets, Piper's DP states; the successor-closed
    sets are their complements, as many) the layer DAG has, the empty and full sets included.

    On the series-parallel tree: a leaf has 2 (a collapsed leaf: the ideals of its own DAG), a
    series ``a; b`` has ``I(a) + I(b) - 1`` (a part of `a` alone, or all of `a` and an ideal of
    `b`), a parallel node the product of its children's. b parallel chains of L layers give
    (L+1)^b; `cap` is not needed for the count (it is exact arithmetic) but bounds the
    enumeration of collapsed leaves."""
    dag = graph.layer_dag() if isinstance(graph, OpGraph) else graph
    tree = decompose(graph)
    return _ideals(tree, dag, cap)


def _ideals(node: SPNode, dag: nx.DiGraph, cap: int | None) -> int:
    if node.kind == "leaf":
        if not node.collapsed:
            return 2
        return _enumerate_ideals(dag.subgraph(node.layers), cap)
    counts = [_ideals(c, dag, cap) for c in node.children]
    if node.kind == "parallel":
        out = 1
        for c in counts:
            out *= c
        return out
    return sum(counts) - (len(counts) - 1)


def _enumerate_ideals(dag: nx.DiGraph, cap: int | None) -> int:
    """Ideals of a small DAG by depth-first growth from the empty set (stops at `cap`)."""
    order = list(nx.topological_sort(dag))
    preds = {n: set(dag.predecessors(n)) for n in order}
    seen: set[frozenset[str]] = {frozenset()}
    stack = [frozenset()]
    while stack:
        cur = stack.pop()
        for n in order:
            if n not in cur and preds[n] <= cur:
                nxt = cur | {n}
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
                    if cap is not None and len(seen) > cap:
                        return len(seen)
    return len(seen)
