"""Lowering of plans whose stages run SPMD programs -- an SPMD plan (one stage) and a composed
plan (a chain or DAG of them) -- into the one engine's `TaskGraph`.

The pipeline schedule is the one of `plait.schedule` (1F1B for a chain, graph 1F1B for a DAG, or
GPipe; one stage: a forward and a backward) and each of its actions becomes tasks:

* ``fwd`` / ``bwd`` of a stage on a micro-batch: its program's ops and collectives
  (`plait.sim.lowering.spmd.SpmdStage`); its parameter gradients reduced in its last backward,
  then each rank steps its optimizer;
* ``send`` / ``recv``: a stage's program ends with its outputs whole on every rank (the search
  gathers what the next stage reads), so ``k = min(senders, receivers)`` rank pairs each carry
  ``1/k`` of the message over their routes (`plait.sim.lowering.collectives.pair_loads`; bytes per
  sample from the one stage graph, `plait.ir.stage_graph`, in the plan's dtype), and an all-gather
  inside the receiving group makes it whole there. Gradients go back the same way;
* a parameter two stages read (tied embeddings) is made whole on each stage's first rank (an
  all-gather where the stage stores it sharded), all-reduced between those two ranks, and
  broadcast in each stage, as the runtime sums it (`plait.runtime.compose_worker`).

Every micro-batch has the stage's micro-batch size (the composed family cuts the batch evenly).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from plait.cost.compute import ComputeModel
from plait.cost.program import Problem, Program
from plait.cost.spmd import Devices
from plait.ir.program import Mesh
from plait.schedule import PipelineGraph, Schedule
from plait.schedule import build as build_schedule
from plait.sim.engine import TaskGraph
from plait.sim.lowering.collectives import SpmdLoweringError, group_collective, pair_loads
from plait.sim.lowering.spmd import SpmdStage, StageProgram, tied_sharded
from plait.sim.topology import ClusterView


@dataclass
class ProgramLowered:
    graph: TaskGraph
    schedule: Schedule
    reps: list[list[int]]  # per stage, the representative ranks (indices into the stage's devices)
    classes: list[list[list[int]]]  # per stage, the ranks each representative stands for


def _pipeline(n: int, edges: list[tuple[int, int]], micro_batches: int, micro_batch: int, name: str) -> Schedule:
    chain = sorted(edges) == [(s, s + 1) for s in range(n - 1)]
    if chain:
        graph = PipelineGraph.chain(n, micro_batches, 1, micro_batch)
        return build_schedule(name if name in ("gpipe", "eager_1f1b") else "1f1b", graph)
    graph = PipelineGraph.dag([[micro_batch] * micro_batches for _ in range(n)], edges)
    return build_schedule("gpipe" if name == "gpipe" else "graph_1f1b", graph)


def _transfer(tg: TaskGraph, view: ClusterView, src: SpmdStage, dst: SpmdStage, nbytes: float, deps: list[int],
              name: str, mb: int, model: ComputeModel | None, host_comm_s: float) -> int:
    """`nbytes` from every rank of `src` (each holds them whole) to every rank of `dst`: k pairs
    carry 1/k each, then an all-gather inside `dst` (when it has more than one rank)."""
    a, b = src.ids, dst.ids
    lat, loads = pair_loads(view, a, b, nbytes)
    load: dict[int, float] = defaultdict(float)
    for key, (cap, x) in loads.items():
        load[tg.add_resource(key, cap)] += x
    flow = [(r, x, 1.0) for r, x in load.items()] if nbytes > 0 else None
    p2p = model.p2p_host_s if model is not None else 0.0
    tid = tg.add(name, "comm_pp", f"link s{src.index}->s{dst.index}", lat + p2p, deps, flow=flow,
                 device=a[0], stage=src.index, micro_batch=mb,
                 args={"bytes": nbytes, "src": a[0], "dst": b[0], "cls": "pp", "op": "send_recv",
                       "ranks": 2, "copies": min(len(a), len(b))})
    if len(b) > 1:
        tid = group_collective(tg, view, "all_gather", nbytes, b, [tid], f"gather {name}",
                               f"stage{dst.index}/comm", host_comm_s, stage=dst.index, mb=mb, category="comm_pp")
    return tid


def _tied(tg: TaskGraph, view: ClusterView, st: list[SpmdStage], tied: list[tuple[int, int, float]],
          host_comm_s: float) -> dict[int, list[int]]:
    """Tied parameters' gradients, as the runtime (`plait.runtime.compose_worker`) sums them: whole
    on each stage's first rank (an all-gather in a stage that stores it sharded), all-reduced
    between the two first ranks after both stages' backward, then broadcast in each stage.
    Per stage, what its optimizer step waits for."""
    ties: dict[int, list[int]] = defaultdict(list)

    def coll(op: str, nbytes: float, ids: list[int], deps: list[int], name: str, s: int) -> int:
        return group_collective(tg, view, op, nbytes, ids, deps, name, f"stage{s}/comm", host_comm_s, stage=s,
                                category="comm_dp")

    for a, b, nbytes in tied:
        deps = st[a].last + st[b].last
        for s in (a, b):
            if len(st[s].ids) > 1 and tied_sharded(st[s].prog, st[b if s == a else a].prog, nbytes):
                deps.append(coll("all_gather", nbytes, st[s].ids, st[s].last, f"gather tied gradients s{s}", s))
        tid = coll("all_reduce", nbytes, [st[a].ids[0], st[b].ids[0]], deps, f"all_reduce tied gradients s{a}+s{b}", a)
        for s in (a, b):
            ties[s].append(tid if len(st[s].ids) == 1 else coll(
                "broadcast", nbytes, st[s].ids, [tid], f"broadcast tied gradients s{s}", s))
    return ties


def lower_compose(stages: list[StageProgram], edges: list[tuple[int, int]],
                  bytes_per_sample: dict[tuple[int, int], float], micro_batches: int, micro_batch: int,
                  view: ClusterView, *, schedule: str = "1f1b", bucket_bytes: float | None = 25e6,
                  model: ComputeModel | None = None, tied: list[tuple[int, int, float]] = (),
                  host_comm_s: float | None = None, boundary: bool = True) -> ProgramLowered:
    """The task graph of one iteration of a pipeline of SPMD stages (module docstring).

    `bytes_per_sample[(a, b)]`: what crosses edge a -> b per sample, in the plan's dtype.
    `tied`: (stage a, stage b, gradient bytes) of parameters both stages hold.
    `model`: the compute model's fixed costs (None: the work alone, for hand-computed checks).
    `host_comm_s`: host time per collective (default the model's). `boundary`: add each stage's
    boundary collectives (False: a whole-model program, whose search priced its ends)."""
    tg = TaskGraph()
    if host_comm_s is None:
        host_comm_s = model.host_comm_s if model is not None else 0.0
    sinks = set(range(len(stages))) - {a for a, _ in edges}
    whole = len(stages) == 1 and not boundary
    st = [SpmdStage(s, p, tg, view, model, host_comm_s, "world/comm" if whole else f"stage{s}/comm",
                    bucket_bytes=bucket_bytes, boundary=boundary, loss=s in sinks)
          for s, p in enumerate(stages)]
    sched = _pipeline(len(stages), edges, micro_batches, micro_batch, schedule)
    sent: dict[tuple, int] = {}
    inbox: dict[int, list[int]] = defaultdict(list)
    pos = [0] * len(stages)
    exits: dict[tuple[str, int, int], list[int]] = {}
    last_bwd = {s: max(i for i, a in enumerate(sched.of(s)) if a.op == "bwd") for s in range(len(stages))}
    sources = set(range(len(stages))) - {b for _, b in edges}
    while any(pos[s] < len(sched.of(s)) for s in range(len(stages))):
        progressed = False
        for s, stage in enumerate(st):
            acts = sched.of(s)
            while pos[s] < len(acts):
                a = acts[pos[s]]
                if a.op in ("recv_fwd", "recv_bwd"):
                    key = (a.op[5:], a.peer[0], a.peer[2], s, a.micro_batch)
                    if key not in sent:
                        break
                    inbox[s].append(sent[key])
                elif a.op in ("send_fwd", "send_bwd"):
                    kind = a.op[5:]
                    peer = st[a.peer[0]]
                    edge = (s, peer.index) if kind == "fwd" else (peer.index, s)
                    lo, hi = a.samples
                    nbytes = bytes_per_sample.get(edge, 0.0) * (hi - lo)
                    sent[(kind, s, a.micro_batch, peer.index, a.peer[2])] = _transfer(
                        tg, view, stage, peer, nbytes, exits[(kind, s, a.micro_batch)],
                        f"{a.op} s{s} mb{a.micro_batch} -> s{peer.index}", a.micro_batch, model, host_comm_s)
                elif a.op == "fwd":
                    exits[("fwd", s, a.micro_batch)] = stage.forward(
                        a.micro_batch, inbox.pop(s, []), first=s in sources and a.micro_batch == 0)
                else:
                    exits[("bwd", s, a.micro_batch)] = stage.backward(a.micro_batch, inbox.pop(s, []),
                                                                      last=pos[s] == last_bwd[s])
                pos[s] += 1
                progressed = True
        if not progressed:
            raise SpmdLoweringError("composed pipeline: the schedule's receives cannot be matched (deadlock)")
    ties = _tied(tg, view, st, list(tied), host_comm_s)
    for stage in st:
        stage.step(ties.get(stage.index, []))
    return ProgramLowered(tg, sched, [x.reps for x in st], [x.classes for x in st])


def lower_spmd(problem: Problem, program: Program, ratios: np.ndarray, view: ClusterView, *,
               devices: Devices | None = None, of_op: dict[str, int] | None = None,
               of_dim: dict[tuple[str, int], int] | None = None, bucket_bytes: float | None = None,
               host_comm_s: float = 0.0, device_scale: np.ndarray | None = None,
               mesh: Mesh | None = None, model: ComputeModel | None = None) -> ProgramLowered:
    """The task graph of one training iteration of a whole-model SPMD `program` at `ratios` (one
    vector, or one row per segment with `of_op` / `of_dim` from `plait.cost.program.Segments`) on
    `view`: the one-stage pipeline, one micro-batch (`StageProgram` says what `devices`,
    `device_scale` and `mesh` are)."""
    prog = StageProgram(problem, program, np.asarray(ratios, dtype=float), of_op, of_dim, devices=devices,
                        device_scale=device_scale, mesh=mesh)
    return lower_compose([prog], [], {}, 1, 1, view, bucket_bytes=bucket_bytes, model=model,
                         host_comm_s=host_comm_s, boundary=False)
