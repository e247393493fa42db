"""What an SPMD program costs: one op's strategy at a time, replayed over tensor placements.

A `Problem` is a model's aten graph on a set of devices (`plait.cost.spmd.Devices`) with every
op's strategies (`plait.graph.sharding`) and per-device work, computed once. `step` places one
op: the conversions its inputs need (`plait.ir.program.conversion`, forward and gradient, HAP's
communication instructions; Zhang et al. EuroSys'24 section 4.2), their prices and the op's
compute at the ratios. `evaluate` replays one strategy per op with that same step, so the
planner's search (`plait.spmd.search`), its exhaustive oracle, the ratio LP, the simulator and
the runtime count the same collectives and the same costs.

A state after the first ``k`` ops: for every live tensor (read again later), the placement it was
made in and the (placement, compute kind) pairs already provided to readers. A reader that needs a
placement pays the forward conversion once (a second reader of an all-gathered tensor reuses it),
and the gradient conversion once per (placement, kind) -- gradients of readers that need the
same thing are summed before one collective. Gradients (`plait.ir.program.grad_placement`): a
reader's gradient must reach the placement the tensor was made in (parameters: where they are
stored, so a replicated parameter read by a sharded op pays the data-parallel all-reduce).

`Segments` groups the sharded dimensions split together (HAP's segments, each with its own
ratios); `round_shards` turns ratios into integer shard sizes per device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from plait.cost.compute import dtype_bytes
from plait.cost.spmd import Devices, balanced_time, choose, compute_time, measured_work, op_work
from plait.ir.aten_graph import AtenGraph
from plait.ir.plan import default_grad_dtype
from plait.ir.profile import ModelProfile
from plait.ir.program import (
    PARTIAL,
    REPLICATED,
    Comm,
    Mesh,
    ShardingError,
    Strategy,
    conversion,
    grad_home,
    grad_placement,
    shard_dim,
    shard_sizes,
)

# live tensor: (placement it was made in, frozenset of (placement provided, reader computes a shard))
Live = tuple[str, frozenset[tuple[str, bool]]]


@dataclass
class Problem:
    """A graph, its devices and every op's strategies and work, computed once."""

    graph: AtenGraph
    devices: Devices
    options: list[list[Strategy]]
    work: list[np.ndarray]
    remaining_reads: list[dict[str, int]]  # after op k: tensor -> reads still to come
    needs_grad: dict[str, bool]
    lower: list[float]  # lower[k] = sum of balanced times of ops k..end
    # after op k: tensor -> placements some later reader may ask for (what a state must remember)
    future_needs: list[dict[str, frozenset[str]]] = field(default_factory=list)
    # uneven all-gather / reduce-scatter: "auto" (padded or grouped, per message) or one global
    # choice for the whole program, "padded" | "grouped" (HAP's flag)
    collectives: str = "auto"
    # weight of parameter-gradient collectives in the objective: 1 counts them in full (HAP's
    # sum of every instruction's time); below 1 they are expected to run behind the backward of
    # earlier ops, as data parallelism overlaps them (`plait.spmd.ratios.synthesize_overlapped`)
    overlap: float = 1.0
    # parameter -> the placement it is stored in, where that is not its first reader's (ZeRO-3 /
    # FSDP storage, Rajbhandari et al. SC'20: a replicated reader all-gathers it in the forward and
    # reduce-scatters its gradient back; the optimizer steps the shard). Empty: HAP's rule
    homes: dict[str, str] = field(default_factory=dict)
    # placements each output may be left in at the program's end for free (None: any -- the loss
    # of a whole-model program); an output left in another one is gathered whole there and the
    # objective pays it: a pipeline stage's boundary (`plait.sim.lowering.spmd.boundary_comms`:
    # what the next stage receives is whole, the last stage's loss may read batch shards)
    outputs_free: dict[str, tuple[str, ...]] | None = None
    # (ops, devices): which ops' work is the model profile's measured time (`measured_work`), and
    # the line that says which kinds were measured (None: no profile -- every op modelled)
    measured: np.ndarray | None = None
    costs: str = "compute modelled per aten op"
    # the dtype parameter gradients are reduced in (`Plan.grad_dtype`, what the runtime's
    # `RankProgram.grad_dtype` sends); None: Megatron-LM's default for the devices' compute dtype
    grad_dtype: str | None = None

    def weight(self, comm: Comm) -> float:
        """The objective's weight of `comm` (`overlap` for a parameter's gradient collective)."""
        if self.overlap != 1.0 and comm.phase == "bwd" and self.graph.tensors[comm.tensor].role == "param":
            return self.overlap
        return 1.0

    @functools.cached_property
    def nbytes(self) -> dict[str, int]:
        return {name: t.nbytes for name, t in self.graph.tensors.items()}

    @functools.cached_property
    def grad_nbytes(self) -> dict[str, int]:
        """Bytes of each parameter's gradient as it is reduced: its elements in the gradient-reduction
        dtype, whatever dtype the graph was captured in (a bf16 capture's bf16 weights still have
        their fp32 gradients all-reduced, as Megatron-LM's default for bf16)."""
        size = dtype_bytes(self.grad_dtype or default_grad_dtype(self.devices.dtype))
        return {name: t.numel * size for name, t in self.graph.tensors.items() if t.role == "param"}

    @classmethod
    def build(cls, graph: AtenGraph, devices: Devices, collectives: str = "auto", overlap: float = 1.0,
              outputs_free: dict[str, tuple[str, ...]] | None = None,
              profile: ModelProfile | None = None, grad_dtype: str | None = None) -> Problem:
        """`profile`: the cluster's model profile (`plait.ir.profile.profile_for`); each op's work
        is then measured where it has the op's layer on the device's kind (`measured_work`).
        `grad_dtype`: the plan's gradient-reduction dtype (`Problem.grad_dtype`)."""
        if collectives not in ("auto", "padded", "grouped"):
            raise ShardingError(f"collectives: must be 'auto', 'padded' or 'grouped', got {collectives!r}")
        if not 0.0 <= overlap <= 1.0:
            raise ShardingError(f"overlap: the weight of gradient collectives must be in [0, 1], got {overlap}")
        from plait.graph.sharding import strategies  # torch: only where a program is priced

        options = [strategies(op, graph, devices.n) for op in graph.ops]
        work = [op_work(op, graph, devices) for op in graph.ops]
        measured, costs = None, "compute modelled per aten op"
        if profile is not None:
            work, measured, costs = measured_work(graph, devices, work, profile)
        reads: dict[str, int] = {}
        for op in graph.ops:
            for t in set(op.inputs):
                reads[t] = reads.get(t, 0) + 1
        for t in graph.outputs:
            reads[t] = reads.get(t, 0) + 1  # the loss reads the outputs
        remaining = []
        for op in graph.ops:
            for t in set(op.inputs):
                reads[t] -= 1
            remaining.append(dict(reads))
        needs_grad = {name: t.dtype.startswith(("float", "bfloat")) and t.role in ("activation", "param")
                      for name, t in graph.tensors.items()}
        bounds = [balanced_time(w) for w in work]
        lower = list(np.cumsum(bounds[::-1])[::-1]) + [0.0]
        return cls(graph, devices, options, work, remaining, needs_grad, [float(x) for x in lower],
                   future_needs_of(graph, options), collectives, overlap, outputs_free=outputs_free,
                   measured=measured, costs=costs, grad_dtype=grad_dtype)


@dataclass
class Program:
    """The result: one strategy per op, the collectives, the cost and how the search went."""

    strategies: dict[str, Strategy]
    comms: list[tuple[str, Comm]] = field(default_factory=list)  # (op that needs it, collective)
    cost: float = 0.0
    compute: float = 0.0
    communication: float = 0.0
    expanded: int = 0  # states taken off the heap
    generated: int = 0  # states pushed
    optimal: bool = True  # False when found by the beam search (`beam_search`)
    homes: dict[str, str] = field(default_factory=dict)  # `Problem.homes` of the parameters it reads


def stored_placements(graph: AtenGraph, program: Program) -> dict[str, str]:
    """Where each parameter the program reads is stored: its `Program.homes` entry, else where
    its first reader reads it (whole when that reader reads a partial sum) -- the one rule of the
    search, the memory model, the simulator's optimizer and the runtime."""
    stored: dict[str, str] = {}
    for op in graph.ops:
        s = program.strategies[op.name]
        for t, q in zip(op.inputs, s.inputs):
            if t not in stored and graph.tensors[t].role == "param":
                stored[t] = program.homes.get(t) or (REPLICATED if q == PARTIAL else q)
    return stored


def future_needs_of(graph: AtenGraph, options: list[list[Strategy]]) -> list[dict[str, frozenset[str]]]:
    """For each k, the placements the readers after op k may require of each tensor op k reads
    (`step` asks only about those): a state forgets what was provided that no one will ask for
    again (states that differ only there are the same state -- the search's main saving)."""
    needs: dict[str, set[str]] = {}
    out: list[dict[str, frozenset[str]]] = [{} for _ in graph.ops]
    for k in range(len(graph.ops) - 1, -1, -1):
        op = graph.ops[k]
        out[k] = {t: frozenset(needs[t]) for t in op.inputs if t in needs}
        for s in options[k]:
            for t, q in zip(op.inputs, s.inputs):
                needs.setdefault(t, set()).add(q)
    return out




class StepCosts:
    """Per-search caches at fixed ratios: compute of (op, strategy); each collective's algorithm
    (chosen per message, `plait.cost.spmd.choose`), time and weighted time; each (op, strategy)'s
    inputs as `step` walks them."""

    def __init__(self, problem: Problem, ratios: np.ndarray) -> None:
        self.problem, self.ratios = problem, ratios
        self.compute: dict[tuple[int, bool], float] = {}
        self.comm: dict[Comm, tuple[Comm, float]] = _shared_comm_times(problem, ratios)
        # id(comm) -> (comm, chosen comm, weighted seconds): `conversion` hands out the same Comm
        # objects, and an identity lookup skips hashing the dataclass (the entry keeps it alive)
        self.by_id: dict[int, tuple[Comm, Comm, float]] = {}
        self.walks: dict[tuple[int, int], tuple] = {}

    def of_compute(self, k: int, splits: bool) -> float:
        key = (k, splits)
        t = self.compute.get(key)
        if t is None:
            t = self.compute[key] = compute_time(self.problem.work[k], splits, self.ratios)
        return t

    def of_comm(self, c: Comm) -> tuple[Comm, float]:
        hit = self.comm.get(c)
        if hit is None:
            hit = self.comm[c] = choose(c, self.problem.devices, self.ratios, self.problem.collectives)
        return hit

    def weighted(self, c: Comm) -> tuple[Comm, float]:
        """`of_comm`'s chosen collective and its seconds times `Problem.weight`."""
        hit = self.by_id.get(id(c))
        if hit is None or hit[0] is not c:
            chosen, t = self.of_comm(c)
            hit = self.by_id[id(c)] = (c, chosen, t * self.problem.weight(c))
        return hit[1], hit[2]

    def walk(self, k: int, strategy: Strategy) -> tuple:
        """(tensor, placement, needs grad, last read, placements later readers may ask for or None,
        bytes) per distinct input of op `k` under `strategy`."""
        key = (k, id(strategy))
        hit = self.walks.get(key)
        if hit is None or hit[0] is not strategy:
            p = self.problem
            op = p.graph.ops[k]
            left = p.remaining_reads[k]
            wanted = p.future_needs[k] if p.future_needs else None
            items = tuple((t, q, p.needs_grad[t], left.get(t, 0) == 0,
                           None if wanted is None else wanted.get(t, frozenset()), p.nbytes[t])
                          for t, q in dict.fromkeys(zip(op.inputs, strategy.inputs)))
            outs = tuple((t, q) for t, q in zip(op.outputs, strategy.outputs) if left.get(t, 0) > 0)
            hit = self.walks[key] = (strategy, items, outs)
        return hit[1], hit[2]


_NOTHING: frozenset = frozenset()


# (devices, collective choice, ratios) -> {comm: (chosen comm, seconds)}, the last few: the searches
# of one synthesis round (probe and full width, forced parameters, overlap weights) share them
_COMM_TIMES: dict[tuple, tuple[Devices, dict[Comm, tuple[Comm, float]]]] = {}


def _shared_comm_times(problem: Problem, ratios: np.ndarray) -> dict[Comm, tuple[Comm, float]]:
    key = (id(problem.devices), problem.collectives, np.asarray(ratios, dtype=float).tobytes())
    hit = _COMM_TIMES.get(key)
    if hit is not None and hit[0] is problem.devices:
        return hit[1]
    while len(_COMM_TIMES) >= 8:
        _COMM_TIMES.pop(next(iter(_COMM_TIMES)))
    table: dict[Comm, tuple[Comm, float]] = {}
    _COMM_TIMES[key] = (problem.devices, table)
    return table


def step(problem: Problem, k: int, live: dict[str, Live], strategy: Strategy,
         ratios: np.ndarray, times: StepCosts | None = None) -> tuple[float, float, list[Comm], dict[str, Live]] | None:
    """Place op `k` with `strategy`: (compute, communication, collectives, new live set), or None
    when some input cannot be converted to the placement the strategy needs."""
    graph = problem.graph
    times = times or StepCosts(problem, ratios)
    items, outs = times.walk(k, strategy)
    sharded = strategy.sharded
    new = dict(live)
    comms: list[Comm] = []
    for t, q, needs_grad, dropped, need, nbytes in items:
        entry = new.get(t)
        if entry is not None:
            origin, given = entry
        else:  # a parameter or input, first read: stored as this reader wants it (sliced for free)
            origin, given = (problem.homes.get(t) or (REPLICATED if q == PARTIAL else q)), _NOTHING
        if q != origin and all(p != q for p, _ in given):
            conv = conversion(origin, q, t, nbytes)
            if conv is None:
                return None
            comms.extend(conv)
        mine = (q, sharded)
        if needs_grad and mine not in given:
            back = conversion(grad_placement(q, sharded), grad_home(origin), t,
                              problem.grad_nbytes.get(t, nbytes), "bwd")
            if back is None:
                return None
            comms.extend(back)
        if dropped:
            new.pop(t, None)
            continue
        if need is not None:  # forget what no later reader can ask for
            given = frozenset(g for g in (*given, mine) if g[0] in need)
        else:
            given = given | {mine}
        new[t] = (origin, given)
    for t, p in outs:
        new[t] = (p, _NOTHING)
    if k == len(graph.ops) - 1:  # the loss reads every output whole: partial sums are reduced
        for t, p in zip(graph.ops[k].outputs, strategy.outputs):
            new.setdefault(t, (p, _NOTHING))
        for t in graph.outputs:
            if t in new and new[t][0] == PARTIAL:
                comms.append(Comm("all_reduce", t, graph.tensors[t].nbytes))
            elif problem.outputs_free is not None and t in new and new[t][0] not in problem.outputs_free.get(t, ()):
                comms.extend(conversion(new[t][0], REPLICATED, t, graph.tensors[t].nbytes) or ())
    compute = times.of_compute(k, strategy.splits_work)
    communication = 0.0
    for i, c in enumerate(comms):
        comms[i], t = times.weighted(c)
        communication += t
    return compute, communication, comms, new


def evaluate(problem: Problem, choice: Sequence[int], ratios: Sequence[float] | np.ndarray) -> Program:
    """Replay one strategy index per op; ShardingError naming the op when one cannot follow."""
    r = check_ratios(ratios, problem.devices)
    live: dict[str, Live] = {}
    times = StepCosts(problem, r)
    program = Program(strategies={}, homes=dict(problem.homes))
    for k, index in enumerate(choice):
        op = problem.graph.ops[k]
        strategy = problem.options[k][index]
        done = step(problem, k, live, strategy, r, times)
        if done is None:
            raise ShardingError(f"op {op.name}: strategy {strategy} needs a conversion that does not exist")
        compute, communication, comms, live = done
        program.strategies[op.name] = strategy
        program.comms.extend((op.name, c) for c in comms)
        program.compute += compute
        program.communication += communication
    program.cost = program.compute + program.communication
    return program


def check_ratios(ratios: Sequence[float] | np.ndarray, devices: Devices) -> np.ndarray:
    r = np.asarray(ratios, dtype=float)
    if r.shape != (devices.n,):
        raise ShardingError(f"ratios: expected one per device ({devices.n}), got {len(r)}")
    if np.any(r < 0) or not np.isclose(r.sum(), 1.0):
        raise ShardingError(f"ratios: must be non-negative and sum to 1, got {list(ratios)}")
    return r


def sharded_dims(program: Program, problem: Problem) -> dict[str, tuple[str, int]]:
    """tensor -> (placement, size of its sharded dimension) for every tensor a strategy shards."""
    out: dict[str, tuple[str, int]] = {}
    for op in problem.graph.ops:
        s = program.strategies.get(op.name)
        if s is None:
            continue
        for t, p in (*zip(op.inputs, s.inputs), *zip(op.outputs, s.outputs)):
            d = shard_dim(p)
            if d is not None:
                out.setdefault(t, (p, problem.graph.tensors[t].shape[d]))
    return out


@dataclass
class Segments:
    """Groups of sharded dimensions split together (HAP's segments): an op links the sharded
    dimensions of its inputs and outputs; a collective or a free slice starts a new group. Each
    group can have its own ratios."""

    of_dim: dict[tuple[str, int], int]  # (tensor, dimension) -> segment
    of_op: dict[str, int]  # op that splits its work -> segment
    count: int
    # segments no op computes in (a parameter's storage, `Program.homes`): split evenly, as
    # ZeRO / FSDP shard state -- the LP holds them there
    even: frozenset[int] = frozenset()

    @classmethod
    def single(cls, problem: Problem, program: Program) -> Segments:
        """Everything in one segment: one ratio vector for the whole program."""
        found = segments(problem, program)
        if found.even and len(found.even) == found.count:
            return cls({k: 0 for k in found.of_dim}, {}, 1, frozenset({0}))
        if found.even:  # storage segments keep their own (even) ratios beside the computing one
            count = 1 + len(found.even)
            index = {g: 1 + i for i, g in enumerate(sorted(found.even))}
            return cls({k: index.get(g, 0) for k, g in found.of_dim.items()}, {k: 0 for k in found.of_op}, count,
                       frozenset(index.values()))
        return cls({k: 0 for k in found.of_dim}, {k: 0 for k in found.of_op}, 1)


def segments(problem: Problem, program: Program) -> Segments:
    parent: dict[tuple[str, int], tuple[str, int]] = {}

    def find(x: tuple[str, int]) -> tuple[str, int]:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    first: dict[str, tuple[str, int]] = {}
    for op in problem.graph.ops:
        s = program.strategies[op.name]
        members = [(t, d) for t, p in (*zip(op.inputs, s.inputs), *zip(op.outputs, s.outputs))
                   if (d := shard_dim(p)) is not None]
        if members:
            first[op.name] = members[0]
        for m in members:
            parent[find(m)] = find(members[0])
    for t, q in program.homes.items():  # a parameter's storage: its own segment unless an op shards it so
        if (d := shard_dim(q)) is not None:
            find((t, d))
    roots: dict[tuple[str, int], int] = {}
    of_dim = {m: roots.setdefault(find(m), len(roots)) for m in list(parent)}
    of_op = {name: of_dim[m] for name, m in first.items()}
    even = frozenset(set(roots.values()) - set(of_op.values())) if program.homes else frozenset()
    return Segments(of_dim, of_op, max(1, len(roots)), even)


def round_shards(problem: Problem, program: Program, ratios: Sequence[float] | np.ndarray,
                 segs: Segments | None = None) -> dict[tuple[str, int], list[int]]:
    """Integer shard sizes per device for every sharded (tensor, dimension) of `program`.

    `ratios`: one vector for every segment, or one row per segment of `segs`. Dimensions of one
    segment are split together: every member's size is a multiple of the segment's greatest
    common divisor G, so `shard_sizes(G, ratios)` scaled by ``size / G`` splits them all
    consistently (a view that merges b with the heads gets ``a`` times the rows of b).
    ShardingError naming the tensor, op and device when a device would get zero rows."""
    graph = problem.graph
    segs = segs or segments(problem, program)
    r = np.asarray(ratios, dtype=float)
    where: dict[tuple[str, int], str] = {}
    for op in graph.ops:
        s = program.strategies[op.name]
        for t, p in (*zip(op.inputs, s.inputs), *zip(op.outputs, s.outputs)):
            if (d := shard_dim(p)) is not None:
                where.setdefault((t, d), op.name)
    groups: dict[int, list[tuple[str, int]]] = {}
    for m, g in segs.of_dim.items():
        groups.setdefault(g, []).append(m)
    out: dict[tuple[str, int], list[int]] = {}
    for g, members in groups.items():
        sizes = [graph.tensors[t].shape[d] for t, d in members]
        gcd = math.gcd(*sizes)
        first = members[int(np.argmin(sizes))]
        base = shard_sizes(gcd, r if r.ndim == 1 else r[g],
                           what=f"tensor {first[0]} dim {first[1]} (op {where.get(first, '?')})",
                           devices=list(problem.devices.names))
        for (t, d), size in zip(members, sizes):
            out[(t, d)] = [b * (size // gcd) for b in base]
    return out


@dataclass
class Synthesis:
    """A program at its ratios (one vector, and one per segment), with its predicted cost and the bytes
    each device keeps: what the planner's synthesis (`plait.spmd.ratios.synthesize`) returns and
    the simulator runs (`plait.sim.api.simulate_spmd`)."""

    program: Program
    ratios: np.ndarray
    cost: float
    memory: np.ndarray
    rounds: list[float] = field(default_factory=list)  # cost after each search + LP round
    expanded: int = 0
    seconds: float = 0.0
    segment_ratios: np.ndarray | None = None  # (segments, devices)
    segments: Segments | None = None
    capacity: np.ndarray | None = None  # bytes per device
    overlap: float = 1.0  # weight of parameter-gradient collectives it was searched with
    forced: tuple[str, ...] = ()  # parameters forced to shards for the program to fit

    @property
    def fits(self) -> bool:
        """Whether every device holds what the program keeps (always, unless memory=False)."""
        return self.capacity is None or bool(np.all(self.memory <= self.capacity * (1 + 1e-9)))


def stage_problem(model: AtenGraph, layers: Sequence[str], devices: Devices, micro_batches: int, loss: bool,
                  name: str, profile: ModelProfile | None = None, grad_dtype: str | None = None) -> Problem:
    """The problem of one pipeline stage's program (a composed plan): the stage's aten sub-graph
    (`plait.graph.aten_stage.stage_subgraph`) on its devices, its parameter-gradient collectives
    weighed 1/m (the program runs m times an iteration, its gradients are reduced once:
    `Problem.overlap`), its outputs free only whole, or batch-sharded at the `loss`
    (`plait.graph.aten_stage.free_outputs`)."""
    from plait.graph.aten_stage import free_outputs, stage_subgraph

    sub = stage_subgraph(model, layers, name=name)
    return Problem.build(sub, devices, overlap=1.0 / micro_batches, outputs_free=free_outputs(sub, loss=loss),
                         profile=profile, grad_dtype=grad_dtype)


@dataclass
class ProgramStage:
    """One stage whose work an SPMD program spreads over its devices: its graph at its micro-batch
    on its devices, its program and ratios. An SPMD plan is one such stage; a composed plan a
    pipeline of them."""

    problem: Problem  # the stage's AtenGraph (`plait.graph.aten_stage.stage_subgraph`) on its Devices
    program: Program
    ratios: np.ndarray  # one vector, or one row per segment
    of_op: dict[str, int] | None = None  # segment of each op (`plait.cost.program.Segments`)
    of_dim: dict[tuple[str, int], int] | None = None
    name: str = ""
    # the inputs received from the previous stage whose gradients go back (None: the floating
    # inputs of every stage but the first -- a model's own floating inputs would need naming)
    grad_inputs: tuple[str, ...] | None = None
    # the devices as priced for the run (None: `problem.devices`; a program searched under HAP's
    # flat model is simulated on the real links)
    devices: Devices | None = None
    # a multiplier of every op's work per device: data parallelism written as the graph of one
    # device's batch run whole on every device, device ``i`` holding ``device_scale[i]`` times it
    device_scale: np.ndarray | None = None
    # a hierarchical program's nodes x GPUs (`plait.spmd.mesh`): collectives of group "node" run in
    # every node at once, "rail" ones across nodes (the simulator's `GroupPricer`)
    mesh: Mesh | None = None

    @property
    def devs(self) -> Devices:
        return self.devices or self.problem.devices

    @property
    def ids(self) -> list[int]:
        d = self.devs
        return list(d.ids) if d.ids else list(range(d.n))
