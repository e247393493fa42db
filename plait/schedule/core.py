"""The data types of a pipeline schedule: the stage DAG it runs on, actions, per-rank lists.

Input: `PipelineGraph`
----------------------
A DAG of *nodes*. A node is one model piece that one pipeline rank runs: a pipeline
stage of a linear or graph pipeline, or one model chunk of interleaved 1F1B (Megatron's
virtual stage ``k = chunk * pp + rank``). Each node names the pipeline rank (``stage``)
that runs it, its local chunk index on that rank, and the sizes of the micro-batches it
runs, in sample order. Stages whose micro-batch sizes differ are joined by sample
ranges: a micro-batch of the consumer needs every producer micro-batch whose samples
overlap its own (the tensors are split or concatenated along the batch dimension).

Output: `Schedule`
------------------
Per pipeline rank, the ordered list of `Action`s it executes. An action is one of

* ``fwd`` / ``bwd``: compute of one node on one micro-batch;
* ``send_fwd`` / ``recv_fwd``: the activations of one producer micro-batch's samples
  that one consumer micro-batch needs (``peer`` = the other side: stage, chunk, micro-batch);
* ``send_bwd`` / ``recv_bwd``: the gradients of those same samples, the other way.

A transfer between two nodes on the same rank has no send/recv action (the tensors are
handed over in memory); the compute order alone keeps its dependency.

Execution semantics (what `plait.schedule.check` verifies and the runtime's executor
does): a rank runs its actions in order; a ``recv`` blocks until the matching ``send``
has been posted; a ``send`` is posted without waiting (its buffer is held until the
step ends). Messages between one pair of ranks are matched in order (FIFO), as with
torch.distributed's untagged point-to-point calls, so every schedule here posts the
sends from rank a to rank b in the same order as rank b posts their receives.

Reading a schedule: `in_flight` gives, per rank, the most micro-batches whose forward has run
and whose backward has not (the activations the rank holds at once), off the action lists.

Event keys follow the scheme shared by the simulator and the runtime:
``f"{op} s{stage} c{chunk} mb{micro_batch}"`` (e.g. ``"fwd s1 c0 mb3"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.errors import PlaitError

COMPUTE_OPS = ("fwd", "bwd")
COMM_OPS = ("send_fwd", "recv_fwd", "send_bwd", "recv_bwd")
OPS = COMPUTE_OPS + COMM_OPS


class ScheduleError(PlaitError, ValueError):
    """A stage graph or schedule request that no schedule can be built for; names the field."""


def event_key(op: str, stage: int, chunk: int, micro_batch: int) -> str:
    """The event name shared by simulator and runtime timelines."""
    return f"{op} s{stage} c{chunk} mb{micro_batch}"


@dataclass(frozen=True)
class Node:
    """One model piece on one pipeline rank (a stage, or one chunk of an interleaved rank)."""

    stage: int  # pipeline rank that runs it
    chunk: int  # local model-chunk index on that rank (0 unless interleaved)
    sizes: tuple[int, ...]  # micro-batch sizes, in sample order
    # data-parallel replicas the micro-batches are dealt to in turn (micro-batch i on replica
    # i mod replicas; `plait.ir.stage_graph`): each replica keeps its own 1F1B warm-up in flight
    replicas: int = 1

    @property
    def micro_batches(self) -> int:
        return len(self.sizes)

    def ranges(self) -> list[tuple[int, int]]:
        """(first sample, end) of each micro-batch."""
        out, first = [], 0
        for s in self.sizes:
            out.append((first, first + s))
            first += s
        return out


@dataclass(frozen=True)
class PipelineGraph:
    """The stage DAG a schedule runs on: nodes (see `Node`) and edges between node ids.

    Build it with `chain` (linear or interleaved pipeline) or `dag` (graph pipeline), or
    directly; `validate` is called on construction."""

    nodes: tuple[Node, ...]
    edges: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------ constructors
    @classmethod
    def chain(cls, pp: int, micro_batches: int, virtual_stages: int = 1, micro_batch: int = 1) -> PipelineGraph:
        """A linear pipeline of ``pp * virtual_stages`` nodes; node ``k`` runs on rank ``k % pp``
        as its chunk ``k // pp`` (Megatron's interleaved layout, Narayanan et al. SC'21 §2.2)."""
        for name, value in (("pp", pp), ("micro_batches", micro_batches), ("virtual_stages", virtual_stages),
                            ("micro_batch", micro_batch)):
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"pipeline graph field {name!r}: must be a positive integer, got {value!r}")
        n = pp * virtual_stages
        sizes = (micro_batch,) * micro_batches
        nodes = tuple(Node(k % pp, k // pp, sizes) for k in range(n))
        return cls(nodes, tuple((k, k + 1) for k in range(n - 1)))

    @classmethod
    def dag(cls, sizes: list[list[int]] | list[tuple[int, ...]], edges: list[tuple[int, int]],
            replicas: list[int] | None = None) -> PipelineGraph:
        """A graph pipeline: node ``s`` is stage ``s`` on rank ``s`` with micro-batch sizes ``sizes[s]``
        (all its replicas' micro-batches, in sample order; ``replicas[s]`` of them, default 1)."""
        reps = replicas or [1] * len(sizes)
        return cls(tuple(Node(s, 0, tuple(sz), int(reps[s])) for s, sz in enumerate(sizes)),
                   tuple(tuple(e) for e in edges))

    # ------------------------------------------------------------ checks
    def validate(self) -> None:
        if not self.nodes:
            raise ScheduleError("pipeline graph field 'nodes': needs at least one node")
        seen: set[tuple[int, int]] = set()
        for i, node in enumerate(self.nodes):
            if node.stage < 0 or node.chunk < 0:
                raise ScheduleError(f"pipeline graph field 'nodes[{i}]': stage and chunk must be >= 0")
            if (node.stage, node.chunk) in seen:
                raise ScheduleError(f"pipeline graph field 'nodes[{i}]': stage {node.stage} chunk {node.chunk} "
                                    f"is used twice")
            seen.add((node.stage, node.chunk))
            if not isinstance(node.replicas, int) or node.replicas < 1:
                raise ScheduleError(f"pipeline graph field 'nodes[{i}].replicas': must be a positive integer, "
                                    f"got {node.replicas!r}")
            if not node.sizes or min(node.sizes) < 1:
                raise ScheduleError(f"pipeline graph field 'nodes[{i}].sizes': needs positive micro-batch sizes, "
                                    f"got {list(node.sizes)}")
        n = len(self.nodes)
        for a, b in self.edges:
            if not (0 <= a < n and 0 <= b < n) or a == b:
                raise ScheduleError(f"pipeline graph field 'edges': ({a}, {b}) does not join two of {n} nodes")
            if sum(self.nodes[a].sizes) != sum(self.nodes[b].sizes):
                raise ScheduleError(f"pipeline graph field 'nodes': edge ({a}, {b}) joins nodes that run "
                                    f"{sum(self.nodes[a].sizes)} and {sum(self.nodes[b].sizes)} samples")
        if len(set(self.edges)) != len(self.edges):
            raise ScheduleError("pipeline graph field 'edges': an edge is listed twice")
        self.topological_order()  # raises on a cycle

    # ------------------------------------------------------------ derived
    @property
    def num_stages(self) -> int:
        """Pipeline ranks (the largest stage id + 1)."""
        return max(n.stage for n in self.nodes) + 1

    def successors(self, i: int) -> list[int]:
        return [b for a, b in self.edges if a == i]

    def predecessors(self, i: int) -> list[int]:
        return [a for a, b in self.edges if b == i]

    def topological_order(self) -> list[int]:
        """Node ids, producers first (Kahn; ties by id, so a chain stays in order)."""
        indeg = [0] * len(self.nodes)
        for _, b in self.edges:
            indeg[b] += 1
        ready = sorted(i for i, d in enumerate(indeg) if d == 0)
        order: list[int] = []
        while ready:
            i = ready.pop(0)
            order.append(i)
            for b in sorted(self.successors(i)):
                indeg[b] -= 1
                if indeg[b] == 0:
                    ready.append(b)
            ready.sort()
        if len(order) != len(self.nodes):
            raise ScheduleError("pipeline graph field 'edges': the stage graph has a cycle")
        return order

    def depth(self) -> dict[int, int]:
        """Stages on the longest path from each node to a sink, minus one (GraphPipe's warm-up): an
        edge between two nodes of one stage (the segments of a stage that runs per input) adds none."""
        out: dict[int, int] = {}
        for i in reversed(self.topological_order()):
            out[i] = max((out[b] + (self.nodes[b].stage != self.nodes[i].stage) for b in self.successors(i)),
                         default=0)
        return out

    def nodes_of(self, stage: int) -> list[int]:
        """Node ids that rank `stage` runs, by chunk index."""
        return sorted((i for i, n in enumerate(self.nodes) if n.stage == stage), key=lambda i: self.nodes[i].chunk)

    def node_id(self, stage: int, chunk: int) -> int:
        for i, n in enumerate(self.nodes):
            if n.stage == stage and n.chunk == chunk:
                return i
        raise ScheduleError(f"pipeline graph: no node runs stage {stage} chunk {chunk}")

    def overlaps(self, a: int, b: int) -> list[tuple[int, int, int, int]]:
        """Pieces crossing edge a -> b: (producer mb, consumer mb, first sample, end), sample order."""
        out = []
        ra, rb = self.nodes[a].ranges(), self.nodes[b].ranges()
        j = 0
        for i, (qs, qe) in enumerate(rb):
            while j < len(ra) and ra[j][1] <= qs:
                j += 1
            k = j
            while k < len(ra) and ra[k][0] < qe:
                lo, hi = max(qs, ra[k][0]), min(qe, ra[k][1])
                out.append((k, i, lo, hi))
                k += 1
        return out


@dataclass(frozen=True)
class Action:
    """One step of one rank's schedule. `peer` is (stage, chunk, micro_batch) of the other side
    of a send/recv; `samples` the (first, end) sample range it carries (None for compute)."""

    op: str
    stage: int
    chunk: int
    micro_batch: int
    peer: tuple[int, int, int] | None = None
    samples: tuple[int, int] | None = None

    @property
    def key(self) -> str:
        return event_key(self.op, self.stage, self.chunk, self.micro_batch)

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    def __str__(self) -> str:
        if self.peer is None:
            return self.key
        arrow = "->" if self.op.startswith("send") else "<-"
        return f"{self.key} {arrow} s{self.peer[0]} c{self.peer[1]} mb{self.peer[2]}"


@dataclass(frozen=True)
class Schedule:
    """Per pipeline rank, the ordered actions of one training step."""

    name: str
    graph: PipelineGraph
    actions: tuple[tuple[Action, ...], ...] = field(default=())  # index: pipeline rank

    def of(self, stage: int) -> tuple[Action, ...]:
        return self.actions[stage]

    def compute(self, stage: int) -> list[Action]:
        """Only the fwd/bwd actions of rank `stage`, in order."""
        return [a for a in self.actions[stage] if a.is_compute]

    def lines(self, stage: int) -> list[str]:
        return [str(a) for a in self.actions[stage]]


def in_flight(schedule: Schedule) -> list[float]:
    """Per pipeline rank, the most micro-batches whose forward has run and whose backward has not
    yet run, at any point of the rank's action list: what the rank keeps activations for.

    Counted in whole-stage units: a rank running ``k`` nodes (the ``v`` model chunks of
    interleaved 1F1B, or the segments of a graph stage) holds ``1 / k`` of a micro-batch per
    node forward, so interleaved 1F1B's ``w`` chunk-forwards in flight count ``w / v`` (Korthikanti
    et al. 2022 §4.2.3). A node whose micro-batches are dealt to ``d`` data-parallel replicas in
    turn (`Node.replicas`: micro-batch ``i`` on replica ``i mod d``) counts each replica's own and
    reports the busiest replica's, the count one device holds."""
    out: list[float] = []
    nodes = schedule.graph.nodes
    for stage, acts in enumerate(schedule.actions):
        local = {nodes[i].chunk: nodes[i] for i in schedule.graph.nodes_of(stage)}
        held: dict[int, int] = {}  # replica -> node forwards without their backward
        peak = 0
        for a in acts:
            if a.op == "fwd":
                r = a.micro_batch % local[a.chunk].replicas
                held[r] = held.get(r, 0) + 1
                peak = max(peak, held[r])
            elif a.op == "bwd":
                held[a.micro_batch % local[a.chunk].replicas] -= 1
        out.append(peak / len(local))
    return out
