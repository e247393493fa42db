"""Lowering of a composed plan -- a pipeline whose stages run SPMD programs -- into the one engine.

Composition of families (issue 17 item 1): each stage of a linear or graph pipeline runs a
HAP-style SPMD program of its layers on its devices (`Plan.stages[i].spmd`, synthesized at the
stage's micro-batch by `plait.spmd`). The pipeline schedule is the one of `plait.schedule`
(1F1B for a chain, graph 1F1B for a DAG, or GPipe) and each of its actions becomes tasks of
the one `TaskGraph` that `plait.sim.engine` runs:

* ``fwd`` / ``bwd`` of a stage on a micro-batch: the program's ops on every rank of the stage
  (one representative per class of equal kind and ratios, `plait.sim.spmd_lower.rank_classes`),
  each at its ratio (`spmd_lower.op_seconds`: work from `plait.cost.compute` through
  `plait.spmd.cost`), and the program's collectives on the stage's own stream, priced on the
  stage's device group (`spmd_lower._comm_task`: `plait.cost.collectives` on the group's links,
  run as a flow over the ring's link resources) -- exactly as `lower_spmd` lowers a whole
  program, with the same dependencies (a forward collective after its producer and before its
  reader, an activation-gradient collective after its reader's backward and before its
  producer's). A rank's tasks are chained in schedule order (one compute stream per GPU);
* a stage's boundary collectives, which a whole-model program's search leaves out
  (`boundary_comms`): outputs left sharded are gathered whole, received values' gradients made
  whole -- what the runtime's per-rank programs run (`plait.runtime.compose_worker`);
* parameter-gradient collectives are not issued per micro-batch: gradients accumulate, and
  during the stage's last backward they are all-reduced in buckets of `bucket_bytes` as their
  readers' backward ends (DDP's ``no_sync`` then one overlapped reduction), then each rank steps
  its optimizer
  (`plait.cost.compute.optimizer_time` over the parameters it holds, `spmd_lower.params_held`);
  a parameter two stages read (tied embeddings) is made whole on each stage's first rank (an
  all-gather where the stage stores it sharded), all-reduced between those two ranks, and
  broadcast in each stage, as the runtime sums it (`plait.runtime.compose_worker`);
* ``send`` / ``recv``: a stage's program ends with its outputs whole on every rank (the search
  gathers what the next stage reads), so ``k = min(senders, receivers)`` rank pairs each carry
  ``1/k`` of the message (Megatron's scatter/gather over tensor ranks; bytes per sample from the
  one stage graph, `plait.ir.stage_graph`, in the plan's dtype) over their routes, and an
  all-gather inside the receiving group makes it whole there (priced by
  `plait.cost.collectives`). Gradients go back the same way.

Every micro-batch has the stage's micro-batch size (the composed family cuts the batch evenly).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plait.cost.collectives import choose_algorithm, collective_time, latency_steps
from plait.cost.compute import ComputeModel, optimizer_time
from plait.cost.program import Problem, Program
from plait.graph.aten_stage import batch_loss_output
from plait.ir.program import PARTIAL, Comm, shard_dim
from plait.schedule import PipelineGraph, Schedule
from plait.schedule import build as build_schedule
from plait.sim.engine import TaskGraph
from plait.sim.spmd_lower import (
    SpmdLoweringError,
    _comm_task,
    _ring_flow,
    op_seconds,
    params_held,
    rank_classes,
)
from plait.sim.topology import ClusterView


@dataclass
class StageProgram:
    """One stage of a composed plan: its graph at the micro-batch on its devices, and its program."""

    problem: Problem  # the stage's AtenGraph (`plait.graph.aten_stage.stage_subgraph`) on its Devices
    program: Program
    ratios: np.ndarray  # one vector, or one row per segment
    of_op: dict[str, int] | None = None  # segment of each op (`plait.cost.program.Segments`)
    of_dim: dict[tuple[str, int], int] | None = None
    name: str = ""
    # the inputs received from the previous stage whose gradients go back (None: the floating
    # inputs of every stage but the first -- a model's own floating inputs would need naming)
    grad_inputs: tuple[str, ...] | None = None

    @property
    def ids(self) -> list[int]:
        d = self.problem.devices
        return list(d.ids) if d.ids else list(range(d.n))


@dataclass
class ComposeLowered:
    graph: TaskGraph
    schedule: Schedule
    reps: list[list[int]]  # per stage, the representative ranks (indices into the stage's devices)


@dataclass
class _Stage:
    """The lowering state of one stage: per-op seconds, classes, collectives, stream heads."""

    index: int
    prog: StageProgram
    fwd: np.ndarray
    bwd: np.ndarray
    kern_f: np.ndarray
    kern_b: np.ndarray
    reps: list[int]
    fwd_comms: dict[int, list[tuple[Comm, int | None]]]  # reader op -> (collective, producer op)
    act_grads: list[tuple[int, Comm]]  # activation-gradient collectives, reader op last first
    param_grads: list[tuple[int, Comm]]
    producer: dict[str, int]
    last: list[int] = field(default_factory=list)  # last compute task per representative
    host: list[int] = field(default_factory=list)  # last host task per representative
    stream: int = -1  # last collective on the stage's stream
    after_fwd: dict[int, list[int]] = field(default_factory=dict)  # micro-batch -> output gathers
    end: list[int] = field(default_factory=list)  # what the optimizer step waits for

    @property
    def ids(self) -> list[int]:
        return self.prog.ids


def boundary_comms(prog: StageProgram, index: int, loss: bool = False) -> list[tuple[str, Comm]]:
    """The collectives a stage's program adds at its boundary, which a whole-model program's search
    does not count (`plait.cost.program.step`: only partial outputs are reduced, inputs need no
    gradient): each output the program leaves sharded is gathered whole after its producer (what
    the next stage or the loss reads), and each value received from the previous stage -- an input
    of a later stage that is floating (`StageProgram.grad_inputs`) -- has its gradient made whole
    once per kind of reader (placement, sharded compute), after the first such reader's backward:
    what `plait.runtime.spmd_program.RankProgram` runs. The `loss` stage computes the loss on the
    batch shards of an output sharded on the batch (`plait.graph.aten_stage.batch_loss_output`): that
    output is not gathered. (op name, collective) pairs, as `Program.comms`."""
    from plait.ir.program import REPLICATED, conversion, grad_placement

    graph, strategies = prog.problem.graph, prog.program.strategies
    out: list[tuple[str, Comm]] = []
    placed: dict[str, tuple[str, str]] = {}  # tensor -> (producer op, placement)
    for op in graph.ops:
        for t, p in zip(op.outputs, strategies[op.name].outputs):
            placed[t] = (op.name, p)
    by_shard = batch_loss_output(graph, strategies) if loss else None  # the loss on batch shards: no gather
    for t in graph.outputs:
        if t == by_shard:
            continue
        name, p = placed[t]
        if shard_dim(p) is not None:
            out += [(name, c) for c in conversion(p, REPLICATED, t, graph.tensors[t].nbytes, "fwd") or ()]
    if prog.grad_inputs is not None:
        wants = set(prog.grad_inputs)
    else:
        wants = {t for t in graph.inputs if index > 0 and graph.tensors[t].dtype.startswith(("float", "bfloat"))}
    seen: set[tuple[str, str, bool]] = set()
    for op in graph.ops:
        s = strategies[op.name]
        for t, q in zip(op.inputs, s.inputs):
            key = (t, q, s.sharded and q == REPLICATED)
            if t not in wants or key in seen:
                continue
            seen.add(key)
            back = conversion(grad_placement(q, s.sharded), REPLICATED, t, graph.tensors[t].nbytes, "bwd")
            out += [(op.name, c) for c in back or ()]
    return [(n, dataclasses.replace(c, algorithm=c.algorithm or ("padded" if c.op != "all_reduce" else None)))
            for n, c in out]


def _own_comms(prog: StageProgram, bound: list[tuple[str, Comm]]) -> list[tuple[str, Comm]]:
    """The program's collectives less the output gathers that its search already priced at its end
    (`plait.cost.program.Problem.outputs_free`) and that `boundary_comms` issues after the producer."""
    last = prog.problem.graph.ops[-1].name
    gathered = {(c.tensor, c.op) for _, c in bound if c.phase == "fwd"}
    return [(n, c) for n, c in prog.program.comms
            if not (n == last and c.phase == "fwd" and (c.tensor, c.op) in gathered)]


def _stage(index: int, prog: StageProgram, model: ComputeModel | None, loss: bool = False) -> _Stage:
    problem, program = prog.problem, prog.program
    graph = problem.graph
    missing = [op.name for op in graph.ops if op.name not in program.strategies]
    if missing:
        raise SpmdLoweringError(f"stage {index}: program has no strategy for op {missing[0]}")
    fwd, bwd, kern_f, kern_b, share = op_seconds(problem, program, prog.ratios, prog.of_op, None, model)
    reps = [g[0] for g in rank_classes(problem.devices, share)]
    index_of = {op.name: k for k, op in enumerate(graph.ops)}
    producer = {t: index_of[m.producer] for t, m in graph.tensors.items() if m.producer in index_of}
    fwd_comms: dict[int, list[tuple[Comm, int | None]]] = defaultdict(list)
    act, par = [], []
    bound = boundary_comms(prog, index, loss)
    for name, c in [*_own_comms(prog, bound), *bound]:
        k = index_of[name]
        if c.phase == "fwd":
            fwd_comms[k].append((c, producer.get(c.tensor)))
        elif graph.tensors[c.tensor].role == "param" and c.op == "all_reduce":
            par.append((k, c))
        else:
            act.append((k, c))
    act.sort(key=lambda kc: -kc[0])
    par.sort(key=lambda kc: -kc[0])
    return _Stage(index, prog, fwd, bwd, kern_f, kern_b, reps, fwd_comms, act, par, producer,
                  last=[-1] * len(reps), host=[-1] * len(reps))


class _Lowering:
    def __init__(self, stages: list[StageProgram], view: ClusterView, model: ComputeModel | None,
                 bucket_bytes: float | None, sinks: set[int] | None = None) -> None:
        self.view, self.model, self.bucket_bytes = view, model, bucket_bytes
        self.tg = TaskGraph()
        self.st = [_stage(s, p, model, loss=s in (sinks or ())) for s, p in enumerate(stages)]
        self.host_comm_s = model.host_comm_s if model is not None else 0.0

    # ------------------------------------------------------------ one stage's compute
    def _launch(self, st: _Stage, j: int, name: str, seconds: float) -> list[int]:
        if self.model is None:
            return []
        i = st.ids[st.reps[j]]
        deps = [st.host[j]] if st.host[j] >= 0 else []
        st.host[j] = self.tg.add(f"launch {name}", "host", f"dev{i}/host", seconds, deps, device=i)
        return [st.host[j]]

    def _comm(self, st: _Stage, c: Comm, phase: str, deps: list[int], mb: int | None) -> int:
        p = st.prog
        tid = _comm_task(self.tg, c, phase, p.problem.devices, st.ids, self.view, p.ratios, p.of_dim,
                         deps + ([st.stream] if st.stream >= 0 else []), self.host_comm_s,
                         stream=f"stage{st.index}/comm")
        self.tg.stage[tid], self.tg.micro_batch[tid] = st.index, mb
        st.stream = tid
        return tid

    def _compute(self, st: _Stage, j: int, k: int, phase: str, mb: int, deps: list[int], host_s: float) -> int:
        op = st.prog.problem.graph.ops[k]
        i = st.ids[st.reps[j]]
        deps = deps + ([st.last[j]] if st.last[j] >= 0 else [])
        deps += self._launch(st, j, f"{phase} {op.name}", host_s)
        secs = st.fwd[k, st.reps[j]] if phase == "fwd" else st.bwd[k, st.reps[j]]
        st.last[j] = self.tg.add(f"{phase} {op.name}", "forward" if phase == "fwd" else "backward",
                                 f"dev{i}/compute", float(secs), deps, device=i, stage=st.index, micro_batch=mb)
        return st.last[j]

    def forward(self, st: _Stage, mb: int, entry: list[int], first: bool, loss: bool) -> list[int]:
        """The program's forward on micro-batch `mb`; returns what its outputs' readers wait for."""
        graph = st.prog.problem.graph
        n_ops, m = len(graph.ops), self.model
        F: list[list[int]] = [[-1] * n_ops for _ in st.reps]
        after: list[int] = []
        for k in range(n_ops):
            extra = list(entry) if k == 0 else []
            later = []
            for c, p in st.fwd_comms.get(k, []):
                if p is not None and p >= k:  # the loss / next stage reading partial outputs of op k
                    later.append(c)
                    continue
                deps = [F[j][p] for j in range(len(st.reps))] if p is not None else list(entry)
                extra.append(self._comm(st, c, "fwd", deps, mb))
            for j in range(len(st.reps)):
                host = 0.0
                if m is not None:
                    host = m.host_fwd_s * st.kern_f[k] + (m.batch_host_s if first and k == 0 else 0.0) \
                        + (m.loss_host_s if loss and k == n_ops - 1 else 0.0)
                F[j][k] = self._compute(st, j, k, "fwd", mb, extra, host)
            for c in later:
                after.append(self._comm(st, c, "fwd", [F[j][k] for j in range(len(st.reps))], mb))
        st.after_fwd[mb] = after
        return [F[j][n_ops - 1] for j in range(len(st.reps))] + after

    def backward(self, st: _Stage, mb: int, entry: list[int], last: bool) -> list[int]:
        """The program's backward on micro-batch `mb` (activation-gradient collectives inside); on
        the stage's `last` micro-batch its parameter gradients are reduced in buckets as they are
        ready (DDP: accumulation, then the reduction overlapping the last backward)."""
        graph = st.prog.problem.graph
        n_ops = len(graph.ops)
        extra_b: dict[int, list[int]] = defaultdict(list)
        pending = list(st.act_grads)
        params = list(st.param_grads) if last else []
        bucket: list[tuple[int, Comm]] = []
        B: list[list[int]] = [[-1] * n_ops for _ in st.reps]
        for k in range(n_ops - 1, -1, -1):
            deps = list(entry) + st.after_fwd.pop(mb, []) if k == n_ops - 1 else []
            deps += extra_b.get(k, [])
            host = self.model.host_bwd_s * st.kern_b[k] if self.model is not None else 0.0
            for j in range(len(st.reps)):
                B[j][k] = self._compute(st, j, k, "bwd", mb, deps, host)
            while params and params[0][0] >= k:
                bucket.append(params.pop(0))
                if self.bucket_bytes is None or sum(c.nbytes for _, c in bucket) >= self.bucket_bytes:
                    st.end.append(self._flush(st, bucket, B))
                    bucket = []
            while pending and pending[0][0] >= k:
                kk, c = pending.pop(0)
                tid = self._comm(st, c, "bwd", [B[j][kk] for j in range(len(st.reps))], mb)
                p = st.producer.get(c.tensor)
                if p is not None and p < k:
                    extra_b[p].append(tid)
                elif p is not None:
                    raise SpmdLoweringError(f"stage {st.index}: gradient of {c.tensor} needed by op "
                                            f"{graph.ops[p].name} before it is reduced")
        if bucket:
            st.end.append(self._flush(st, bucket, B))
        return [B[j][0] for j in range(len(st.reps))]

    def _flush(self, st: _Stage, bucket: list[tuple[int, Comm]], B: list[list[int]]) -> int:
        """One all-reduce of a bucket's gradients, after the backward of every op that reads them."""
        deps = [B[j][k] for k, _ in bucket for j in range(len(st.reps))]
        c = bucket[0][1] if len(bucket) == 1 else dataclasses.replace(
            bucket[0][1], tensor=f"bucket of {len(bucket)} gradients", nbytes=sum(b.nbytes for _, b in bucket),
            algorithm=None)
        return self._comm(st, c, "bwd", deps, None)

    def step(self, st: _Stage, extra: list[int]) -> None:
        p = st.prog
        held = params_held(p.problem, p.program, p.ratios, p.of_dim)
        devices = p.problem.devices
        for j, r in enumerate(st.reps):
            i = st.ids[r]
            kind = devices.kinds[r] if devices.kinds else self.view.kinds[i]
            host = self.model.step_host_s if self.model is not None else 0.0
            self.tg.add("optimizer step", "optimizer", f"dev{i}/compute", optimizer_time(float(held[r]), kind) + host,
                        [st.last[j]] + st.end + extra, device=i, stage=st.index, args={"params": float(held[r])})

    # ------------------------------------------------------------ between stages
    def group_collective(self, op: str, nbytes: float, ids: list[int], deps: list[int], name: str,
                         stage: int, mb: int | None, category: str) -> int:
        """One collective of `nbytes` on the devices `ids` (`plait.cost.collectives` on their links)."""
        links = self.view.group(ids)
        algo = choose_algorithm(op, nbytes, links)
        total = collective_time(op, nbytes, links, algo)
        lat = latency_steps(op, links.n, algo) * links.ring_latency
        if algo in ("hierarchical", "measured"):
            lat = min(lat, total)
        flow = _ring_flow(self.tg, self.view, ids, max(0.0, total - lat))
        return self.tg.add(name, category, f"stage{stage}/comm", lat + self.host_comm_s, deps, flow=flow,
                           device=ids[0], stage=stage, micro_batch=mb,
                           args={"bytes": nbytes, "op": op, "algorithm": algo, "ranks": len(ids), "cls": category,
                                 "copies": 1})

    def transfer(self, src: _Stage, dst: _Stage, nbytes: float, deps: list[int], name: str, mb: int) -> int:
        """`nbytes` from every rank of `src` (each holds them whole) to every rank of `dst`: k pairs
        carry 1/k each, then an all-gather inside `dst` (when it has more than one rank)."""
        a, b = src.ids, dst.ids
        lat, loads = pair_loads(self.view, a, b, nbytes)
        load: dict[int, float] = defaultdict(float)
        for key, (cap, x) in loads.items():
            load[self.tg.add_resource(key, cap)] += x
        flow = [(r, x, 1.0) for r, x in load.items()] if nbytes > 0 else None
        p2p = self.model.p2p_host_s if self.model is not None else 0.0
        tid = self.tg.add(name, "comm_pp", f"link s{src.index}->s{dst.index}", lat + p2p, deps, flow=flow,
                          device=a[0], stage=src.index, micro_batch=mb,
                          args={"bytes": nbytes, "src": a[0], "dst": b[0], "cls": "pp", "op": "send_recv",
                                "ranks": 2, "copies": min(len(a), len(b))})
        if len(b) > 1:
            tid = self.group_collective("all_gather", nbytes, b, [tid], f"gather {name}", dst.index, mb, "comm_pp")
        return tid


def pair_loads(view: ClusterView, a: list[int], b: list[int], nbytes: float) -> tuple[float, dict[tuple, tuple[float, float]]]:
    """A message of `nbytes` from group `a` (every rank holds it whole) to group `b`: ``k = min(|a|,
    |b|)`` rank pairs carry ``1/k`` each over their routes. (latency, {link resource: (capacity,
    bytes)})."""
    k = min(len(a), len(b))
    loads: dict[tuple, tuple[float, float]] = {}
    lat = 0.0
    for s, d in zip(a[:k], b[:k]):
        lat = max(lat, view.pair(s, d)[1])
        for key, cap, part in view.route(s, d):
            old = loads.get(key, (cap, 0.0))[1]
            loads[key] = (cap, old + nbytes / k * part)
    return lat, loads


def transfer_seconds(view: ClusterView, a: list[int], b: list[int], nbytes: float) -> float:
    """The time of `pair_loads`' message alone on the links (its busiest link, plus latency), the
    pipeline message the simulator lowers (`_Lowering.transfer`) without the all-gather after it."""
    lat, loads = pair_loads(view, a, b, nbytes)
    return lat + max((x / cap for cap, x in loads.values() if cap > 0), default=0.0)


def _pipeline(n: int, edges: list[tuple[int, int]], micro_batches: int, micro_batch: int, name: str) -> Schedule:
    chain = sorted(edges) == [(s, s + 1) for s in range(n - 1)]
    if chain:
        graph = PipelineGraph.chain(n, micro_batches, 1, micro_batch)
        return build_schedule(name if name in ("gpipe", "eager_1f1b") else "1f1b", graph)
    graph = PipelineGraph.dag([[micro_batch] * micro_batches for _ in range(n)], edges)
    return build_schedule("gpipe" if name == "gpipe" else "graph_1f1b", graph)


def lower_compose(stages: list[StageProgram], edges: list[tuple[int, int]],
                  bytes_per_sample: dict[tuple[int, int], float], micro_batches: int, micro_batch: int,
                  view: ClusterView, *, schedule: str = "1f1b", bucket_bytes: float | None = 25e6,
                  model: ComputeModel | None = None, tied: list[tuple[int, int, float]] = ()) -> ComposeLowered:
    """The task graph of one iteration of a pipeline of SPMD stages (module docstring).

    `bytes_per_sample[(a, b)]`: what crosses edge a -> b per sample, in the plan's dtype.
    `tied`: (stage a, stage b, gradient bytes) of parameters both stages hold.
    `model`: the compute model's fixed costs (None: the work alone, for hand-computed checks)."""
    sinks = {s for s in range(len(stages))} - {a for a, _ in edges}
    low = _Lowering(stages, view, model, bucket_bytes, sinks)
    sched = _pipeline(len(stages), edges, micro_batches, micro_batch, schedule)
    sent: dict[tuple, int] = {}
    inbox: dict[int, list[int]] = defaultdict(list)
    pos = [0] * len(stages)
    exits: dict[tuple[str, int, int], list[int]] = {}
    last_bwd = {s: max(i for i, a in enumerate(sched.of(s)) if a.op == "bwd") for s in range(len(stages))}
    while any(pos[s] < len(sched.of(s)) for s in range(len(stages))):
        progressed = False
        for s, st in enumerate(low.st):
            acts = sched.of(s)
            while pos[s] < len(acts):
                a = acts[pos[s]]
                if a.op in ("recv_fwd", "recv_bwd"):
                    kind = a.op[5:]
                    key = (kind, a.peer[0], a.peer[2], s, a.micro_batch)
                    if key not in sent:
                        break
                    inbox[s].append(sent[key])
                elif a.op in ("send_fwd", "send_bwd"):
                    kind = a.op[5:]
                    peer = low.st[a.peer[0]]
                    edge = (s, peer.index) if kind == "fwd" else (peer.index, s)
                    lo, hi = a.samples
                    nbytes = bytes_per_sample.get(edge, 0.0) * (hi - lo)
                    sent[(kind, s, a.micro_batch, peer.index, a.peer[2])] = low.transfer(
                        st, peer, nbytes, exits[(kind, s, a.micro_batch)],
                        f"{a.op} s{s} mb{a.micro_batch} -> s{peer.index}", a.micro_batch)
                elif a.op == "fwd":
                    exits[("fwd", s, a.micro_batch)] = low.forward(
                        st, a.micro_batch, inbox.pop(s, []), first=not any(b == s for _, b in edges) and
                        a.micro_batch == 0, loss=s in sinks)
                else:
                    exits[("bwd", s, a.micro_batch)] = low.backward(st, a.micro_batch, inbox.pop(s, []),
                                                                    last=pos[s] == last_bwd[s])
                pos[s] += 1
                progressed = True
        if not progressed:
            raise SpmdLoweringError("composed pipeline: the schedule's receives cannot be matched (deadlock)")
    ties: dict[int, list[int]] = defaultdict(list)
    for a, b, nbytes in tied:
        # as the runtime (`plait.runtime.compose_worker`): whole on each stage's first rank (an
        # all-gather in a stage that stores it sharded), all-reduced between the two first ranks
        # after both stages' backward, beside their buckets, then broadcast in each stage
        deps = low.st[a].last + low.st[b].last
        for s in (a, b):
            st = low.st[s]
            if len(st.ids) > 1 and _tied_sharded(st.prog, low.st[b if s == a else a].prog, nbytes):
                deps.append(low.group_collective("all_gather", nbytes, st.ids, st.last,
                                                 f"gather tied gradients s{s}", s, None, "comm_dp"))
        ids = [low.st[a].ids[0], low.st[b].ids[0]]
        tid = low.group_collective("all_reduce", nbytes, ids, deps, f"all_reduce tied gradients s{a}+s{b}", a,
                                   None, "comm_dp")
        for s in (a, b):
            st = low.st[s]
            ties[s].append(tid if len(st.ids) == 1 else low.group_collective(
                "broadcast", nbytes, st.ids, [tid], f"broadcast tied gradients s{s}", s, None, "comm_dp"))
    for st in low.st:
        low.step(st, ties.get(st.index, []))
    return ComposeLowered(low.tg, sched, [st.reps for st in low.st])


def _tied_sharded(prog: StageProgram, other: StageProgram, nbytes: float) -> bool:
    """Whether `prog` stores a parameter it shares with `other` (of `nbytes`) sharded: a parameter
    is stored where its first reader reads it, whole when that is a partial sum (the runtime's
    `spmd_program.compile_program`)."""
    graph, theirs = prog.problem.graph, other.problem.graph.tensors
    shared = {t for t, m in graph.tensors.items() if m.role == "param" and t in theirs and m.nbytes == nbytes}
    seen: set[str] = set()
    for op in graph.ops:
        for t, q in zip(op.inputs, prog.program.strategies[op.name].inputs):
            if t in shared and t not in seen:
                seen.add(t)
                if q != PARTIAL and shard_dim(q) is not None:
                    return True
    return False


def simulate_compose(stages: list[StageProgram], edges: list[tuple[int, int]],
                     bytes_per_sample: dict[tuple[int, int], float], micro_batches: int, micro_batch: int,
                     cluster: Any, *, schedule: str = "1f1b", bucket_bytes: float | None = 25e6,
                     fixed_costs: bool = True, tied: list[tuple[int, int, float]] = (),
                     memory: list[int] | None = None, name: str = "compose", flops: float = 0.0) -> Any:
    """Predict one iteration of a composed plan with the one engine; a `plait.sim.api.SimResult`.

    `memory`: peak bytes per cluster device (the family's estimate: each stage's program with the
    micro-batches its schedule keeps in flight); `flops`: model FLOPs of the iteration (for TFLOP/s)."""
    import time

    from plait.cost.compute import DEFAULT_MODEL
    from plait.sim.api import SimResult, resolve_cluster, schedule_figures
    from plait.sim.engine import simulate as run_engine

    view = resolve_cluster(cluster)
    t0 = time.perf_counter()
    low = lower_compose(stages, edges, bytes_per_sample, micro_batches, micro_batch, view, schedule=schedule,
                        bucket_bytes=bucket_bytes, model=DEFAULT_MODEL if fixed_costs else None, tied=tied)
    tg = low.graph
    sched = run_engine(tg)
    T = sched.makespan
    busy, by_cat, exposed, critical = schedule_figures(tg, sched, {})
    world = sum(len(p.ids) for p in stages)
    batch = micro_batches * micro_batch
    fits = None
    if memory is not None and view.cluster is not None:
        fits = all(memory[d.id] <= d.kind.memory_bytes for d in view.cluster.devices)
    classes = sum(len(r) for r in low.reps)
    return SimResult(
        iteration_time_s=T, throughput_samples_per_s=batch / T if T > 0 else 0.0,
        tflops_per_gpu=flops / T / world / 1e12 if T > 0 else 0.0,
        hardware_tflops_per_gpu=flops / T / world / 1e12 if T > 0 else 0.0,
        exposed_comm_s=exposed,
        memory_peak_bytes=list(memory) if memory is not None else None, fits_memory=fits,
        critical_path=critical, busy_fraction=busy, world_size=world, num_tasks=len(tg),
        symmetry=(f"one rank simulated per class of equal kind and ratios in each stage: {classes} of {world}"
                  if classes < world else "every rank simulated"),
        granularity="op", sim_wall_s=time.perf_counter() - t0, breakdown=by_cat, plan=name,
        model=stages[0].problem.graph.model if stages else "", cluster=view.name)
