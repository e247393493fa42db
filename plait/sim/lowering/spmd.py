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
from dataclasses import dataclass, field

import numpy as np

from plait.cost.compute import ComputeModel, optimizer_time
from plait.cost.program import Problem, Program, stored_placements
from plait.cost.spmd import BACKWARD_FACTOR, VIEWS, Devices
from plait.graph.aten_stage import batch_loss_output
from plait.ir.program import PARTIAL, REPLICATED, Comm, Mesh, conversion, grad_placement, shard_dim
from plait.sim.engine import TaskGraph
from plait.sim.lowering.collectives import GroupPricer, SpmdLoweringError, comm_task
from plait.sim.topology import ClusterView


@dataclass
class StageProgram:
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
    # every node at once, "rail" ones across nodes (`plait.sim.lowering.collectives.GroupPricer`)
    mesh: Mesh | None = None

    @property
    def devs(self) -> Devices:
        return self.devices or self.problem.devices

    @property
    def ids(self) -> list[int]:
        d = self.devs
        return list(d.ids) if d.ids else list(range(d.n))


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


def tied_sharded(prog: StageProgram, other: StageProgram, nbytes: float) -> bool:
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
    prog: StageProgram
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

    def forward(self, mb: int, entry: list[int], first: bool) -> list[int]:
        """The program's forward on micro-batch `mb` after `entry` (what it received); `first`: the
        iteration's first forward of a source stage (the batch's host work). Returns what its
        outputs' readers wait for."""
        graph = self.prog.problem.graph
        n_ops, m, reps = len(graph.ops), self.model, range(len(self.reps))
        F: list[list[int]] = [[-1] * n_ops for _ in reps]
        after: list[int] = []
        for k in range(n_ops):
            extra = list(entry) if k == 0 else []
            later = []
            for c, p in self.fwd_comms.get(k, []):
                if p is not None and p >= k:  # the loss / next stage reading partial outputs of op k
                    later.append(c)
                    continue
                deps = [F[j][p] for j in reps] if p is not None else list(entry)
                extra.append(self._comm(c, "fwd", deps, mb))
            host = 0.0
            if m is not None:
                host = m.host_fwd_s * self.kern_f[k] + (m.batch_host_s if first and k == 0 else 0.0) \
                    + (m.loss_host_s if self.loss and k == n_ops - 1 else 0.0)
            for j in reps:
                F[j][k] = self._compute(j, k, "fwd", mb, extra, host)
            for c in later:
                after.append(self._comm(c, "fwd", [F[j][k] for j in reps], mb))
        self.after_fwd[mb] = after
        return [F[j][n_ops - 1] for j in reps] + after

    def backward(self, mb: int, entry: list[int], last: bool) -> list[int]:
        """The program's backward on micro-batch `mb` after `entry` (the gradients received), its
        gradient collectives issued as their readers' backward ends; on the stage's `last`
        micro-batch the parameter-gradient all-reduces too."""
        graph = self.prog.problem.graph
        n_ops, reps = len(graph.ops), range(len(self.reps))
        extra_b: dict[int, list[int]] = defaultdict(list)
        pending = deque(i for i in self.issues if last or not i.param)
        made: dict[str, int] = {}  # tensor -> the last gradient collective issued for it
        B: list[list[int]] = [[-1] * n_ops for _ in reps]
        for k in range(n_ops - 1, -1, -1):
            deps = list(entry) + self.after_fwd.pop(mb, []) if k == n_ops - 1 else []
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
        return [B[j][0] for j in reps]

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

