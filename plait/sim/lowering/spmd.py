"""An op-level (SPMD) stage program lowered to engine tasks: one stage of a plan whose work is
spread over its devices op by op (HAP's programs, `plait.spmd`; one strategy per aten op, its
collectives with their chosen algorithms, per-device ratios).

`SpmdStage` emits, on the stage's representative ranks, what one micro-batch's forward and
backward and the optimizer step run; `plait.sim.lowering.pipeline` drives it from the schedule's
action lists (an SPMD plan is one stage, a composed plan a chain or DAG of them):

* **compute**, per rank, on its compute stream in program order: the forward of every op, then
  the backward of every op in reverse. An op's forward on device ``i`` takes ``r_i w_i / 3`` when
  its strategy splits the work (``r_i`` the ratio of the op's segment), ``w_i / 3`` when it runs
  redundantly; backward twice that (``w_i`` from `plait.cost.spmd.op_work`, i.e.
  `plait.cost.compute.op_time` of the device's kind); with a compute model, each kernel's fixed
  GPU time and a host task that launches it (as the tensor-parallel stages charge them);
* **collectives**: one task joining all ranks, on the group's communication stream in issue order
  (`plait.sim.lowering.collectives.comm_task`). A forward collective waits for its producer's
  forward on every rank and blocks its reader's forward (one reading the op's own partial output
  -- the loss, the next stage -- runs after it and blocks the backward); a gradient collective
  waits for its reader's backward on every rank (and for that tensor's collective on another
  group before it) and blocks the producer's backward. Parameter-gradient all-reduces are issued
  only in the stage's last backward (DDP's ``no_sync`` accumulation, then one overlapped
  reduction), packed in backward order into buckets of at least `bucket_bytes` (one open bucket
  per group and per sharded-or-not; PyTorch DDP's buckets, Shi et al. 2018's WFBP);
* a pipeline stage's **boundary collectives**, which a whole-model program's search leaves out
  (`boundary_comms`): outputs left sharded are gathered whole, received values' gradients made
  whole -- what the runtime's per-rank programs run (`plait.runtime.compose_worker`);
* the **optimizer step** per rank (`plait.cost.compute.optimizer_time` over the parameters it
  holds: replicated ones whole, sharded ones at its ratio) after its backward and every gradient
  collective of its parameters.

Ranks with the same GPU kind and ratios compute identically: one representative per such class
is simulated (its collectives still span every device's links).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from plait.cost.compute import ComputeModel, optimizer_time
from plait.cost.program import Problem, Program, ProgramStage, stored_placements
from plait.cost.spmd import BACKWARD_FACTOR, VIEWS, Devices
from plait.graph.aten_stage import batch_loss_output
from plait.ir.program import PARTIAL, REPLICATED, Comm, Mesh, conversion, grad_placement, shard_dim
from plait.net.view import ClusterView, pair_loads
from plait.schedule import PipelineGraph, Schedule
from plait.schedule import build as build_schedule
from plait.sim.engine import TaskGraph
from plait.sim.lowering.collectives import (
    GroupPricer,
    SpmdLoweringError,
    comm_task,
    group_collective,
)
from plait.sim.lowering.pipeline import PipelineDriver, compute_program


def op_ratios(problem: Problem, program: Program, ratios: np.ndarray,
              of_op: dict[str, int] | None) -> np.ndarray:
    """(ops, devices): each op's share of its work per device (1 where it runs redundantly)."""
    r = np.atleast_2d(np.asarray(ratios, dtype=float))
    out = np.ones((len(problem.graph.ops), problem.devices.n))
    for k, op in enumerate(problem.graph.ops):
        if program.strategies[op.name].splits_work:
            out[k] = r[(of_op or {}).get(op.name, 0) if r.shape[0] > 1 else 0]
    return out


def op_seconds(problem: Problem, program: Program, ratios: np.ndarray, of_op: dict[str, int] | None,
               device_scale: np.ndarray | None = None, model: ComputeModel | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(forward, backward) seconds per (op, device), the kernels each op launches forward and
    backward, and each op's share of its work per device (`op_ratios` x `device_scale`).

    The compute model's fixed costs, as the tensor-parallel stages charge them (plait.cost.compute):
    each kernel's GPU time besides its work -- one forward kernel per op that is not a view, two
    backward kernels for ops with FLOPs (input and weight gradients), one otherwise -- not where
    the op's time is measured (the model profile's, `plait.cost.spmd.measured_work`)."""
    graph = problem.graph
    share = op_ratios(problem, program, ratios, of_op)  # (ops, n)
    if device_scale is not None:
        share = share * np.asarray(device_scale, dtype=float)[None, :]
    fwd = np.stack(problem.work) * share / BACKWARD_FACTOR  # (ops, n) seconds
    bwd = fwd * (BACKWARD_FACTOR - 1.0)
    kern_f = np.array([0.0 if op.kind in VIEWS else 1.0 for op in graph.ops])
    kern_b = np.array([0.0 if op.kind in VIEWS else (2.0 if op.flops > 0 else 1.0) for op in graph.ops])
    if model is not None:  # a measured op's time (`Problem.measured`) holds its kernels' fixed cost
        modelled = 1.0 if problem.measured is None else (~problem.measured).astype(float)
        fwd = fwd + model.kernel_gpu_s * kern_f[:, None] * modelled
        bwd = bwd + model.kernel_gpu_s * kern_b[:, None] * modelled
    return fwd, bwd, kern_f, kern_b, share


def rank_classes(devices: Devices, share: np.ndarray) -> list[list[int]]:
    """Ranks that compute identically (same kind, same share of every op), first one first."""
    classes: dict[tuple, list[int]] = defaultdict(list)
    for i in range(devices.n):
        kind = devices.kinds[i].name if devices.kinds else ""
        classes[(kind, tuple(np.round(share[:, i], 12)))].append(i)
    return list(classes.values())


def params_held(problem: Problem, program: Program, ratios: np.ndarray,
                of_dim: dict[tuple[str, int], int] | None) -> np.ndarray:
    """Parameters each device stores (and steps): a replicated one whole, a sharded one at the
    ratio of its segment -- where `stored_placements` says, as `plait.cost.memory.memory_model`."""
    r = np.atleast_2d(np.asarray(ratios, dtype=float))
    held = np.zeros(problem.devices.n)
    for t, q in stored_placements(problem.graph, program).items():
        numel = problem.graph.tensors[t].numel
        d = shard_dim(q)
        if d is None:
            held += numel
        else:
            held += numel * r[(of_dim or {}).get((t, d), 0) if r.shape[0] > 1 else 0]
    return held


def boundary_comms(prog: ProgramStage, index: int, loss: bool = False) -> list[tuple[str, Comm]]:
    """The collectives a stage's program adds at its boundary, which a whole-model program's search
    does not count (`plait.cost.program.step`: only partial outputs are reduced, inputs need no
    gradient): each output the program leaves sharded is gathered whole after its producer (what
    the next stage or the loss reads), and each value received from the previous stage -- an input
    of a later stage that is floating (`ProgramStage.grad_inputs`) -- has its gradient made whole
    once per kind of reader (placement, sharded compute), after the first such reader's backward:
    what `plait.runtime.spmd_program.RankProgram` runs. The `loss` stage computes the loss on the
    batch shards of an output sharded on the batch (`plait.graph.aten_stage.batch_loss_output`): that
    output is not gathered. (op name, collective) pairs, as `Program.comms`."""
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


def _own_comms(prog: ProgramStage, bound: list[tuple[str, Comm]]) -> list[tuple[str, Comm]]:
    """The program's collectives less the output gathers that its search already priced at its end
    (`plait.cost.program.Problem.outputs_free`) and that `boundary_comms` issues after the producer."""
    last = prog.problem.graph.ops[-1].name
    gathered = {(c.tensor, c.op) for _, c in bound if c.phase == "fwd"}
    return [(n, c) for n, c in prog.program.comms
            if not (n == last and c.phase == "fwd" and (c.tensor, c.op) in gathered)]


def tied_sharded(prog: ProgramStage, other: ProgramStage, nbytes: float) -> bool:
    """Whether `prog` stores a parameter it shares with `other` (its gradient of `nbytes`,
    `Problem.grad_nbytes`) sharded: a parameter
    is stored where its first reader reads it, whole when that is a partial sum (the runtime's
    `spmd_program.compile_program`)."""
    graph, theirs = prog.problem.graph, other.problem.graph.tensors
    grads = prog.problem.grad_nbytes
    shared = {t for t, m in graph.tensors.items() if m.role == "param" and t in theirs and grads[t] == nbytes}
    seen: set[str] = set()
    for op in graph.ops:
        for t, q in zip(op.inputs, prog.program.strategies[op.name].inputs):
            if t in shared and t not in seen:
                seen.add(t)
                if q != PARTIAL and shard_dim(q) is not None:
                    return True
    return False


@dataclass
class _Issue:
    """Gradient collectives issued as one task (a DDP bucket, or one collective), in issue order."""

    members: list[tuple[int, Comm]]  # (reader op, collective), reader op last first
    param: bool  # parameter-gradient all-reduces: issued in the stage's last backward only


def _backward_issues(graph, comms: list[tuple[int, Comm]], bucket_bytes: float | None) -> list[_Issue]:
    """The gradient collectives in issue order: by reader op, last first; parameter-gradient
    all-reduces packed into buckets of at least `bucket_bytes` (one open bucket per group and per
    sharded-or-not), a bucket issued where it fills, the open ones after every other."""
    out: list[_Issue] = []
    buckets: dict[tuple, list[tuple[int, Comm]]] = {}
    filled: dict[tuple, float] = defaultdict(float)
    for k, c in sorted(comms, key=lambda kc: -kc[0]):
        is_param = graph.tensors[c.tensor].role == "param" and c.op == "all_reduce"
        if bucket_bytes is not None and is_param:
            key = (c.group, c.dim is None)
            buckets.setdefault(key, []).append((k, c))
            filled[key] += c.nbytes
            if filled[key] >= bucket_bytes:
                out.append(_Issue(buckets.pop(key), True))
                filled[key] = 0.0
            continue
        out.append(_Issue([(k, c)], is_param))
    out.extend(_Issue(b, True) for b in buckets.values())
    return out


@dataclass
class SpmdStage:
    """The lowering of one SPMD stage into `tg`: its per-op seconds, rank classes and collectives,
    and the heads of its streams as the driver emits its actions."""

    index: int
    prog: ProgramStage
    tg: TaskGraph
    view: ClusterView
    model: ComputeModel | None  # the compute model's fixed costs (None: the work alone)
    host_comm_s: float  # host time of issuing one collective
    comm_stream: str  # label of the stage's (world group's) communication stream
    bucket_bytes: float | None = 25e6
    boundary: bool = True  # a pipeline stage: add `boundary_comms` (not for a whole-model program)
    loss: bool = False  # the stage computes the loss (a sink of the pipeline)
    fwd: np.ndarray = field(init=False)
    bwd: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        p = self.prog
        graph = p.problem.graph
        missing = [op.name for op in graph.ops if op.name not in p.program.strategies]
        if missing:
            raise SpmdLoweringError(f"stage {self.index}: program has no strategy for op {missing[0]} "
                                    f"({len(missing)} ops missing)")
        bad = [i for i in self.ids if not 0 <= i < self.view.num_devices]
        if bad:
            raise SpmdLoweringError(f"program devices {bad[:3]} are not in cluster {self.view.name!r} "
                                    f"({self.view.num_devices} devices)")
        self.fwd, self.bwd, self.kern_f, self.kern_b, share = op_seconds(
            p.problem, p.program, p.ratios, p.of_op, p.device_scale, self.model)
        self.classes = rank_classes(p.devs, share)
        self.reps = [g[0] for g in self.classes]
        index_of = {op.name: k for k, op in enumerate(graph.ops)}
        self.producer = {t: index_of[m.producer] for t, m in graph.tensors.items() if m.producer in index_of}
        comms = p.program.comms
        if self.boundary:
            bound = boundary_comms(p, self.index, self.loss)
            comms = [*_own_comms(p, bound), *bound]
        self.fwd_comms: dict[int, list[tuple[Comm, int | None]]] = defaultdict(list)  # reader -> (c, producer)
        grads = []
        for name, c in comms:
            k = index_of[name]
            if c.phase == "fwd":
                self.fwd_comms[k].append((c, self.producer.get(c.tensor)))
            else:
                grads.append((k, c))
        self.issues = _backward_issues(graph, grads, self.bucket_bytes)
        self.pricer = GroupPricer(p.problem, p.devs, self.view, p.ratios, p.of_dim, p.device_scale, p.mesh) \
            if p.mesh is not None else None
        n = len(self.reps)
        self.last = [-1] * n  # last compute task per representative
        self.host = [-1] * n  # last host task per representative
        self.streams: dict[str, int] = {}  # group -> last collective on its stream
        self.after_fwd: dict[int, list[int]] = {}  # micro-batch -> collectives after its forward
        self.end: list[int] = []  # what the optimizer step waits for

    @property
    def ids(self) -> list[int]:
        return self.prog.ids

    # ------------------------------------------------------------ tasks
    def _launch(self, j: int, name: str, seconds: float) -> list[int]:
        """The host task that dispatches a kernel of representative `j` (none without a compute model)."""
        if self.model is None:
            return []
        i = self.ids[self.reps[j]]
        deps = [self.host[j]] if self.host[j] >= 0 else []
        self.host[j] = self.tg.add(f"launch {name}", "host", f"dev{i}/host", seconds, deps, device=i)
        return [self.host[j]]

    def _comm(self, c: Comm, phase: str, deps: list[int], mb: int | None) -> int:
        p = self.prog
        last = self.streams.get(c.group, -1)
        tid = comm_task(self.tg, c, phase, p.devs, self.ids, self.view, p.ratios, p.of_dim,
                        deps + ([last] if last >= 0 else []), self.host_comm_s, self.pricer,
                        stream=self.comm_stream)
        self.tg.stage[tid], self.tg.micro_batch[tid] = self.index, mb
        self.streams[c.group] = tid
        return tid

    def _compute(self, j: int, k: int, phase: str, mb: int, deps: list[int], host_s: float) -> int:
        op = self.prog.problem.graph.ops[k]
        i = self.ids[self.reps[j]]
        deps = deps + ([self.last[j]] if self.last[j] >= 0 else [])
        deps += self._launch(j, f"{phase} {op.name}", host_s)
        secs = self.fwd[k, self.reps[j]] if phase == "fwd" else self.bwd[k, self.reps[j]]
        self.last[j] = self.tg.add(f"{phase} {op.name}", "forward" if phase == "fwd" else "backward",
                                   f"dev{i}/compute", float(secs), deps, device=i, stage=self.index,
                                   micro_batch=mb)
        return self.last[j]

    def forward(self, mb: int, first: bool) -> tuple[list[int], list[int]]:
        """The program's forward on micro-batch `mb`; `first`: the iteration's first forward of a
        source stage (the batch's host work). Returns (the tasks that read what the stage receives:
        its first op on every rank and the collectives of received values; the driver makes them
        wait for the transfers), (what its outputs' readers wait for)."""
        graph = self.prog.problem.graph
        n_ops, m, reps = len(graph.ops), self.model, range(len(self.reps))
        F: list[list[int]] = [[-1] * n_ops for _ in reps]
        after: list[int] = []
        entries: list[int] = []
        for k in range(n_ops):
            extra: list[int] = []
            later = []
            for c, p in self.fwd_comms.get(k, []):
                if p is not None and p >= k:  # the loss / next stage reading partial outputs of op k
                    later.append(c)
                    continue
                deps = [F[j][p] for j in reps] if p is not None else []
                extra.append(self._comm(c, "fwd", deps, mb))
                if p is None:
                    entries.append(extra[-1])
            host = 0.0
            if m is not None:
                host = m.host_fwd_s * self.kern_f[k] + (m.batch_host_s if first and k == 0 else 0.0) \
                    + (m.loss_host_s if self.loss and k == n_ops - 1 else 0.0)
            for j in reps:
                F[j][k] = self._compute(j, k, "fwd", mb, extra, host)
            if k == 0:
                entries += [F[j][0] for j in reps]
            for c in later:
                after.append(self._comm(c, "fwd", [F[j][k] for j in reps], mb))
        self.after_fwd[mb] = after
        return entries, [F[j][n_ops - 1] for j in reps] + after

    def backward(self, mb: int, last: bool) -> tuple[list[int], list[int]]:
        """The program's backward on micro-batch `mb`, its gradient collectives issued as their
        readers' backward ends; on the stage's `last` micro-batch the parameter-gradient
        all-reduces too. Returns (its last op's backward on every rank: what waits for the
        gradients received), (what the gradients sent back wait for)."""
        graph = self.prog.problem.graph
        n_ops, reps = len(graph.ops), range(len(self.reps))
        extra_b: dict[int, list[int]] = defaultdict(list)
        pending = deque(i for i in self.issues if last or not i.param)
        made: dict[str, int] = {}  # tensor -> the last gradient collective issued for it
        B: list[list[int]] = [[-1] * n_ops for _ in reps]
        for k in range(n_ops - 1, -1, -1):
            deps = self.after_fwd.pop(mb, []) if k == n_ops - 1 else []
            deps += extra_b.get(k, [])
            host = self.model.host_bwd_s * self.kern_b[k] if self.model is not None else 0.0
            for j in reps:
                B[j][k] = self._compute(j, k, "bwd", mb, deps, host)
            # issue, in order, every collective whose readers' backward is done
            while pending and min(kk for kk, _ in pending[0].members) >= k:
                issue = pending.popleft()
                members = issue.members
                deps = [B[j][kk] for kk, _ in members for j in reps]
                c = members[0][1]
                if len(members) > 1:  # a bucket: one all-reduce of all its gradients
                    c = dataclasses.replace(c, tensor=f"bucket of {len(members)} gradients",
                                            nbytes=sum(x.nbytes for _, x in members), algorithm=None)
                # a gradient's collective on another group (a rail's all-reduce of what the node's
                # reduce-scatter or all-reduce made) starts once that one has ended
                deps += [made[x.tensor] for _, x in members if x.tensor in made]
                tid = self._comm(c, "bwd", deps, None if issue.param else mb)
                made.update((x.tensor, tid) for _, x in members)
                for _, x in members:
                    p = self.producer.get(x.tensor)
                    if p is not None and p < k:
                        extra_b[p].append(tid)
                    elif p is None and graph.tensors[x.tensor].role == "param":
                        self.end.append(tid)
                    elif p is not None:
                        raise SpmdLoweringError(f"stage {self.index}: gradient of {x.tensor} needed by op "
                                                f"{graph.ops[p].name} before it is reduced")
        return [B[j][n_ops - 1] for j in reps], [B[j][0] for j in reps]

    def step(self, extra: list[int]) -> None:
        """Each representative's optimizer step over the parameters it holds, after its backward,
        its gradient collectives and `extra` (tied gradients)."""
        p = self.prog
        held = params_held(p.problem, p.program, p.ratios, p.of_dim)
        devices = p.devs
        for j, r in enumerate(self.reps):
            i = self.ids[r]
            kind = devices.kinds[r] if devices.kinds else self.view.kinds[i]
            host = self.model.step_host_s if self.model is not None else 0.0
            self.tg.add("optimizer step", "optimizer", f"dev{i}/compute",
                        optimizer_time(float(held[r]), kind) + host,
                        [self.last[j]] + self.end + extra, device=i, stage=self.index,
                        args={"params": float(held[r])})



# ---------------------------------------------------------------- plans of SPMD stages
@dataclass
class ProgramLowered:
    graph: TaskGraph
    schedule: Schedule
    reps: list[list[int]]  # per stage, the representative ranks (indices into the stage's devices)
    classes: list[list[list[int]]]  # per stage, the ranks each representative stands for


@dataclass
class _StageWorker:
    """The one replica of an SPMD stage, as the pipeline driver walks it."""

    wid: int
    stage: int
    chunks: list[int]
    units: list[tuple[int, int]]  # (first sample, size) per micro-batch


def _pipeline(n: int, edges: list[tuple[int, int]], micro_batches: int, micro_batch: int, name: str) -> Schedule:
    chain = sorted(edges) == [(s, s + 1) for s in range(n - 1)]
    if chain:
        graph = PipelineGraph.chain(n, micro_batches, 1, micro_batch)
        return build_schedule(name if name in ("gpipe", "eager_1f1b") else "1f1b", graph)
    graph = PipelineGraph.dag([[micro_batch] * micro_batches for _ in range(n)], edges)
    return build_schedule("gpipe" if name == "gpipe" else "graph_1f1b", graph)


class _ProgramLowerer(PipelineDriver):
    """The SPMD emitter on the one pipeline driver (`plait.sim.lowering.pipeline`): one worker per
    stage (an SPMD program spans all of a stage's devices), eager sends (the runtime's per-rank
    programs post their sends as soon as a value exists, `plait.runtime.compose_worker`)."""

    rendezvous = False
    blocking = False

    def __init__(self, stages: list[SpmdStage], sched: Schedule, bytes_per_sample: dict[tuple[int, int], float],
                 micro_batches: int, micro_batch: int, view: ClusterView, model: ComputeModel | None,
                 host_comm_s: float, sources: set[int], tied: Sequence[tuple[int, int, float]]) -> None:
        self.st, self.tg, self.view, self.model = stages, stages[0].tg if stages else TaskGraph(), view, model
        self.bytes_per_sample, self.host_comm_s, self.sources, self.tied = bytes_per_sample, host_comm_s, sources, tied
        units = [(m * micro_batch, micro_batch) for m in range(micro_batches)]
        self.workers = [_StageWorker(s, s, [s], units) for s in range(len(stages))]
        self.programs = {s: compute_program(sched.compute(s), [s]) for s in range(len(stages))}

    def emit_worker(self, w: _StageWorker) -> None:
        stage, program = self.st[w.stage], self.programs[w.wid]
        last_bwd = max((i for i, (k, _, _) in enumerate(program) if k == "B"), default=-1)
        firsts, lasts = [], []
        for idx, (k, _c, i) in enumerate(program):
            if k == "F":
                entries, exits = stage.forward(i, first=w.stage in self.sources and i == 0)
            else:
                entries, exits = stage.backward(i, last=idx == last_bwd)
            firsts.append(entries)
            lasts.append(exits)
        self.item_first[w.wid], self.item_last[w.wid] = firsts, lasts

    def message_bytes(self, edge: tuple[int, int], samples: int, src: _StageWorker) -> float:
        """What crosses `edge` per sample (`plait.ir.stage_graph`, in the plan's dtype), whole: a
        stage's program ends with its outputs whole on every rank."""
        return self.bytes_per_sample.get(edge, 0.0) * samples

    def send(self, src: _StageWorker, dst: _StageWorker, c_src: int, c_dst: int, u_src: int, u_dst: int,
             nbytes: float, deps: list[int], forward: bool) -> int:
        """`nbytes` from every rank of `src` (each holds them whole) to every rank of `dst`: k pairs
        carry 1/k each, then an all-gather inside `dst` (when it has more than one rank)."""
        a, b = self.st[src.stage], self.st[dst.stage]
        name = f"{'send_fwd' if forward else 'send_bwd'} s{a.index} mb{u_src} -> s{b.index}"
        lat, loads = pair_loads(self.view, a.ids, b.ids, nbytes)
        load: dict[int, float] = defaultdict(float)
        for key, (cap, x) in loads.items():
            load[self.tg.add_resource(key, cap)] += x
        flow = [(r, x, 1.0) for r, x in load.items()] if nbytes > 0 else None
        p2p = self.model.p2p_host_s if self.model is not None else 0.0
        tid = self.tg.add(name, "comm_pp", f"link s{a.index}->s{b.index}", lat + p2p, deps, flow=flow,
                          device=a.ids[0], stage=a.index, micro_batch=u_src,
                          args={"bytes": nbytes, "src": a.ids[0], "dst": b.ids[0], "cls": "pp",
                                "op": "send_recv", "ranks": 2, "copies": min(len(a.ids), len(b.ids))})
        if len(b.ids) > 1:
            tid = group_collective(self.tg, self.view, "all_gather", nbytes, b.ids, [tid], f"gather {name}",
                                   f"stage{b.index}/comm", self.host_comm_s, stage=b.index, mb=u_src,
                                   category="comm_pp")
        return tid

    def finish(self, workers: list[_StageWorker]) -> None:
        ties = self._tied()
        for stage in self.st:
            stage.step(ties.get(stage.index, []))

    def _tied(self) -> dict[int, list[int]]:
        """Tied parameters' gradients, as the runtime (`plait.runtime.compose_worker`) sums them:
        whole on each stage's first rank (an all-gather in a stage that stores it sharded),
        all-reduced between the two first ranks after both stages' backward, then broadcast in
        each stage. Per stage, what its optimizer step waits for."""
        st, ties = self.st, defaultdict(list)

        def coll(op: str, nbytes: float, ids: list[int], deps: list[int], name: str, s: int) -> int:
            return group_collective(self.tg, self.view, op, nbytes, ids, deps, name, f"stage{s}/comm",
                                    self.host_comm_s, stage=s, category="comm_dp")

        for a, b, nbytes in self.tied:
            deps = st[a].last + st[b].last
            for s in (a, b):
                if len(st[s].ids) > 1 and tied_sharded(st[s].prog, st[b if s == a else a].prog, nbytes):
                    deps.append(coll("all_gather", nbytes, st[s].ids, st[s].last, f"gather tied gradients s{s}", s))
            tid = coll("all_reduce", nbytes, [st[a].ids[0], st[b].ids[0]], deps,
                       f"all_reduce tied gradients s{a}+s{b}", a)
            for s in (a, b):
                ties[s].append(tid if len(st[s].ids) == 1 else coll(
                    "broadcast", nbytes, st[s].ids, [tid], f"broadcast tied gradients s{s}", s))
        return ties


def lower_compose(stages: list[ProgramStage], edges: list[tuple[int, int]],
                  bytes_per_sample: dict[tuple[int, int], float], micro_batches: int, micro_batch: int,
                  view: ClusterView, *, schedule: str = "1f1b", bucket_bytes: float | None = 25e6,
                  model: ComputeModel | None = None, tied: Sequence[tuple[int, int, float]] = (),
                  host_comm_s: float | None = None, boundary: bool = True) -> ProgramLowered:
    """The task graph of one iteration of a pipeline of SPMD stages: the pipeline schedule (1F1B
    for a chain, graph 1F1B for a DAG, or GPipe; one stage: a forward and a backward) walked by the
    one driver (`plait.sim.lowering.pipeline`), each stage's actions emitted by its `SpmdStage`.
    Every micro-batch has the stage's micro-batch size (the composed family cuts the batch evenly).

    `bytes_per_sample[(a, b)]`: what crosses edge a -> b per sample, in the plan's dtype: the
    sending stage holds it whole on every rank, ``k = min(senders, receivers)`` rank pairs each
    carry ``1/k`` (`plait.net.view.pair_loads`) and an all-gather in the receiving
    group makes it whole there; gradients go back the same way.
    `tied`: (stage a, stage b, gradient bytes) of parameters both stages hold.
    `model`: the compute model's fixed costs (None: the work alone, for hand-computed checks).
    `host_comm_s`: host time per collective (default the model's). `boundary`: add each stage's
    boundary collectives (False: a whole-model program, whose search priced its ends)."""
    tg = TaskGraph()
    if host_comm_s is None:
        host_comm_s = model.host_comm_s if model is not None else 0.0
    n = len(stages)
    sinks = set(range(n)) - {a for a, _ in edges}
    sources = set(range(n)) - {b for _, b in edges}
    whole = n == 1 and not boundary
    st = [SpmdStage(s, p, tg, view, model, host_comm_s, "world/comm" if whole else f"stage{s}/comm",
                    bucket_bytes=bucket_bytes, boundary=boundary, loss=s in sinks)
          for s, p in enumerate(stages)]
    sched = _pipeline(n, edges, micro_batches, micro_batch, schedule)
    driver = _ProgramLowerer(st, sched, bytes_per_sample, micro_batches, micro_batch, view, model, host_comm_s,
                             sources, list(tied))
    driver.drive(driver.workers, list(edges))
    return ProgramLowered(tg, sched, [x.reps for x in st], [x.classes for x in st])


def lower_spmd(problem: Problem, program: Program, ratios: np.ndarray, view: ClusterView, *,
               devices: Devices | None = None, of_op: dict[str, int] | None = None,
               of_dim: dict[tuple[str, int], int] | None = None, bucket_bytes: float | None = None,
               host_comm_s: float = 0.0, device_scale: np.ndarray | None = None,
               mesh: Mesh | None = None, model: ComputeModel | None = None) -> ProgramLowered:
    """The task graph of one training iteration of a whole-model SPMD `program` at `ratios` (one
    vector, or one row per segment with `of_op` / `of_dim` from `plait.cost.program.Segments`) on
    `view`: the one-stage pipeline, one micro-batch (`ProgramStage` says what `devices`,
    `device_scale` and `mesh` are)."""
    prog = ProgramStage(problem, program, np.asarray(ratios, dtype=float), of_op, of_dim, devices=devices,
                        device_scale=device_scale, mesh=mesh)
    return lower_compose([prog], [], {}, 1, 1, view, bucket_bytes=bucket_bytes, model=model,
                         host_comm_s=host_comm_s, boundary=False)
