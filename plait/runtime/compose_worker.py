"""One rank of a composed plan: a linear pipeline whose stages each run an SPMD program.

Composition of families (issue 17 item 1; the plan is `Plan.stages[i].spmd`, planned by
`plait.search.compose_family` and simulated by `plait.sim.lowering.pipeline`). Ranks are the stages'
devices, stage-major (`Plan.device_of`). Each rank of stage ``s``:

* captures the model's `AtenGraph` at the plan's micro-batch and cuts stage ``s``'s sub-graph
  (`plait.graph.aten_stage.stage_subgraph`, the ops of its layers) and runs the stage's program on it
  with `plait.runtime.spmd_program.RankProgram` over the stage's own process group (every
  placement change a collective of the communication facade, inside autograd);
* runs the pipeline schedule of `plait.schedule` (1F1B for the chain, or GPipe) action by action,
  every rank of a stage the same list: ``fwd`` runs the program on one micro-batch, ``bwd`` back-
  propagates it (the sink: its loss, scaled by n_j / B, computed redundantly on every rank of the
  last stage as a whole-model SPMD run does);
* sends a boundary value as the simulator prices it (`plait.sim.lowering.pipeline`, "send / recv"): the stage's
  program ends with its outputs whole on every rank, so ``k = min(senders, receivers)`` rank pairs
  (sender stage rank j -> receiver stage rank j, j < k) each carry 1/k of the flattened value, and
  an uneven all-gather in the receiving stage makes it whole there. A boundary value's gradient
  arrives whole on every rank of the receiving stage (its program's conversions sum it to ``R``)
  and goes back the same way;
* a parameter's data-parallel gradient all-reduce (P -> R) is deferred: gradients accumulate over
  the step's micro-batches and are all-reduced once, in buckets of `GRAD_BUCKET_BYTES` in reverse op
  order (`RankProgram.flush_param_grads`), as the simulator reduces them; the program's other
  gradient collectives run inside each micro-batch's backward, as the simulator has them;
* after the step's backward passes, parameters two stages read (tied embeddings) have their
  gradients summed between the stages: whole on each holder stage's first rank (gathered in its
  stage when sharded), all-reduced between those first ranks, broadcast in each stage; every rank
  keeps its shard of the sum (the simulator prices the same three collectives). The optimizer then steps each rank's shards.

With `clip_grad` the optimizer step clips the global gradient norm over every stage's shards (each
logical parameter once, `_clipper`). Only adjacent stages exchange values (a value read two stages
later is refused at setup), every micro-batch has the plan's micro-batch size, and programs run in
the plan's precision (fp32 master leaves, ops autocast to bf16 / fp16, boundary values and their
gradients sent in it; fp16 scales the loss dynamically, the found-inf flag agreed over every rank).
Checkpoints (`plait.runtime.spmd_state.ProgramCheckpoints`) hold each rank's shards as chunks
of the logical parameters and optimizer state, a tied parameter written by its first holder stage,
so a composed run resumes under the same plan or any other (DCP reshards).
"""

from __future__ import annotations

import os
import resource
import socket
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait.graph.aten_capture import capture_on_meta
from plait.graph.aten_stage import batch_loss_output, shared_params, stage_subgraph
from plait.ir.aten_graph import AtenGraph
from plait.ir.plan import Plan
from plait.ir.program import shard_dim
from plait.runtime.amp import LOW_PRECISION, autocast_for, reduce_dtype
from plait.runtime.clip import GradClipper
from plait.runtime.comm import P2P, Comm, CommLog, Group
from plait.runtime.data_parallel import make_optimizer
from plait.runtime.partition import RuntimeSetupError, build_seeded, load_model_spec, make_samples
from plait.runtime.rank_config import RankConfig
from plait.runtime.recorder import Heartbeat, Recorder
from plait.runtime.results import comm_records_path, common_origin, write_result
from plait.runtime.sharded_state import aliases_of
from plait.runtime.spmd_program import RankProgram, Spans, compile_program, whole_parameters
from plait.runtime.spmd_state import (
    ProgramCheckpoints,
    SpmdStep,
    checkpoint_layout,
    clip_weights,
    persistent_buffers,
)
from plait.runtime.worker_config import WorkerConfig
from plait.schedule import Action, PipelineGraph, Schedule
from plait.schedule import build as build_schedule

# The buckets of the parameter-gradient all-reduce: `plait.sim.lowering.spmd.lower_compose`'s
# `bucket_bytes` default, which the composed family simulates with.
GRAD_BUCKET_BYTES = 25e6


def stage_ranks(plan: Plan) -> list[list[int]]:
    """The process ranks of each stage: its devices, stage-major (`Plan.device_of`)."""
    out, first = [], 0
    for spec in plan.stages:
        out.append(list(range(first, first + len(spec.devices))))
        first += len(spec.devices)
    return out


def composed_schedule(plan: Plan, name: str) -> Schedule:
    """The plan's pipeline schedule over its chain of stages (`plait.schedule`; the simulator's
    `plait.sim.lowering.spmd._pipeline` builds the same one)."""
    n, m = len(plan.stages), plan.global_batch // plan.micro_batch
    graph = PipelineGraph.chain(n, m, 1, plan.micro_batch)
    return build_schedule(name if name in ("gpipe", "eager_1f1b") else "1f1b", graph)


def boundary_values(graph: AtenGraph, subs: list[AtenGraph]) -> list[list[str]]:
    """Per stage s < last: the values stage s sends to stage s + 1 (stage s + 1's inputs that are
    not model inputs). Raises RuntimeSetupError when a value skips a stage or the last stage does
    not make the model's outputs."""
    out = []
    for s in range(len(subs) - 1):
        cross = [t for t in subs[s + 1].inputs if t not in graph.inputs]
        made = set(subs[s].outputs)
        skip = [t for t in cross if t not in made] + [t for t in subs[s].outputs if t not in cross]
        if skip:
            raise RuntimeSetupError(f"composed plan: value {skip[0]!r} crosses more than one stage boundary "
                                    f"(stage {s} -> a later stage than {s + 1}); the runtime passes values "
                                    "between adjacent stages only")
        out.append(cross)
    if list(subs[-1].outputs) != list(graph.outputs):
        raise RuntimeSetupError(f"composed plan: the last stage makes {subs[-1].outputs}, not the model's "
                                f"outputs {graph.outputs}")
    return out


def _pieces(x: torch.Tensor, k: int) -> list[torch.Tensor]:
    """`x` flattened and cut into k near-equal pieces (one per rank pair)."""
    return [p.contiguous() for p in torch.tensor_split(x.reshape(-1), k)]


class ComposeWorker(ProgramCheckpoints, RankConfig):
    def __init__(self, config: WorkerConfig, rank: int, heartbeat: Heartbeat) -> None:
        super().__init__(config, rank, heartbeat)
        self.ranks = stage_ranks(self.plan)
        self.stage = next(s for s, rs in enumerate(self.ranks) if rank in rs)
        self.local = self.ranks[self.stage].index(rank)

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        config, plan = self.config, self.plan
        self.rec = Recorder(self.info.device, self.stage, self.rank, cuda=False, slowdown=self.info.slowdown,
                            heartbeat=self.hb)
        log = CommLog(comm_records_path(self.run_dir, self.rank), self.rank, self.world) \
            if config.records.comm_records else None
        self.comm = Comm(self.rank, self.world, rec=self.rec, log=log, faults=config.faults.link_faults())
        self.world_group = self.comm.init_process_group(config.backend, timeout_s=config.collective_timeout)
        group = self.comm.new_groups("stage", self.ranks)
        assert group is not None
        self.group: Group = group
        self.hb.progress("build")
        self.spec = load_model_spec(config.model)
        seed = config.seed
        model = build_seeded(self.spec, seed)
        graph = capture_on_meta(self.spec, plan.micro_batch)  # as the planner captured it (meta device)
        self.graph = graph
        layers = [spec.layers for spec in plan.stages]
        subs = [stage_subgraph(graph, lays, name=f"{graph.model} stage {s}") for s, lays in enumerate(layers)]
        self.sub = subs[self.stage]
        self.cross = boundary_values(graph, subs)
        spec_s = plan.stages[self.stage]
        names = [f"gpu {config.ranks[r].device} (stage {self.stage}, rank {r})" for r in self.ranks[self.stage]]
        stage_program = spec_s.spmd
        assert stage_program is not None  # layout.supports: every stage of a composed plan has one
        program = compile_program(self.sub, stage_program.strategies, stage_program.ratio_array(),
                                  len(spec_s.devices), devices=names, collective=stage_program.collectives)
        self.spans = Spans(self.rec)
        self.runner = RankProgram(program, self.local, self.group, self.spans, seed=seed)
        self.runner.defer_param_grads = True  # one all-reduce per step, not per micro-batch
        self.runner.grad_dtype = reduce_dtype(plan, config.dtype)  # ...in the plan's gradient-reduction dtype
        self.leaves = self.runner.load(model)
        self.stepper = SpmdStep(self.leaves, make_optimizer(self.leaves, config.optimizer))
        self.stepper.scaler = self.loss_scaling(self.world_group)
        # boundary values and their gradients cross in the plan's low precision (bf16 / fp16), as
        # the simulator prices the messages; None: as computed
        self.wire = LOW_PRECISION.get(config.dtype)
        self._tied_list = self._tied_groups(graph, layers)
        self.layout = checkpoint_layout(self.runner, self.stepper, aliases_of(model), persistent_buffers(model),
                                        self.local, self._written_elsewhere(graph, layers, aliases_of(model)))
        self.batch_loss = self._batch_loss() if self.stage == len(self.ranks) - 1 else None
        if config.clip_grad:
            self.stepper.clip = self._clipper(config.clip_grad, graph, layers)

    def _batch_loss(self) -> str | None:
        """The model output the last stage keeps in its batch shards (the loss per shard, weighted
        by its rows, as the pipeline weighs micro-batches: n_j / B) instead of gathering it whole:
        the one output, when the program leaves it sharded on dimension 0, the batch
        (`plait.sim.lowering.spmd.boundary_comms` says the same to the simulator)."""
        return batch_loss_output(self.sub, self.runner.program.strategies)

    def _clipper(self, max_norm: float, graph: AtenGraph, layers: list[list[str]]) -> GradClipper:
        """The global gradient norm over every stage's shards, each logical parameter once: in its
        stage a shard weighs 1 and a leaf every rank holds whole 1/ranks (`spmd_state.clip_weights`),
        and a tied parameter (summed, the same in each holder stage) 1/holders more; one all-reduce
        over every rank (`GradClipper`)."""
        weights = clip_weights(self.runner, len(self.ranks[self.stage]))
        holders = {t: sum(any(op.layer in lays and t in op.inputs for op in graph.ops) for lays in layers)
                   for t in shared_params(graph, layers)}
        tensors = self.runner.param_paths()
        for path, leaf in self.runner.params.items():
            weights[id(leaf)] /= holders.get(tensors[path], 1)
        return GradClipper(max_norm, weights, group=self.world_group)

    def _written_elsewhere(self, graph: AtenGraph, layers: list[list[str]], aliases: dict[str, str]) -> frozenset[str]:
        """Checkpoint keys of the tied parameters this stage holds that an earlier stage holds too
        (and writes: every holder keeps the same summed values)."""
        tensors = self.runner.param_paths()
        out = set()
        for t in shared_params(graph, layers):
            holders = [s for s, lays in enumerate(layers) if any(op.layer in lays and t in op.inputs
                                                                  for op in graph.ops)]
            if self.stage in holders and holders[0] != self.stage:
                out |= {aliases.get(p, p) for p, x in tensors.items() if x == t}
        return frozenset(out)

    def _tied_groups(self, graph: AtenGraph, layers: list[list[str]]) -> list[tuple[str, Group | None]]:
        """Per parameter several stages read (tied embeddings) that this rank's stage holds: the graph
        tensor and the group of the holder stages' first ranks (None on the stage's other ranks);
        every rank creates every group in the same order."""
        out = []
        for t in shared_params(graph, layers):
            holders = [s for s, lays in enumerate(layers) if any(op.layer in lays and t in op.inputs
                                                                  for op in graph.ops)]
            g = self.comm.new_groups(f"tied {t}", [[self.ranks[s][0] for s in holders]])
            if self.stage in holders:
                out.append((t, g))
        return out

    def _loss(self, outs: list[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch, weighted by its share of the batch (n_j / B):
        on this rank's rows when the output stays in batch shards (`_batch_loss`)."""
        if self.batch_loss:
            if target.shape[0] != self.plan.micro_batch:
                raise RuntimeSetupError(f"composed plan: the target's dimension 0 has {target.shape[0]} "
                                        f"rows, not the micro-batch's {self.plan.micro_batch}; the loss "
                                        "is computed on the output's batch shards")
            first, rows = self.runner.rows(self.batch_loss, 0)
            return self.spec.loss(outs[0], target.narrow(0, first, rows)) * (rows / self.plan.global_batch)
        return self.spec.loss(outs[0] if len(outs) == 1 else tuple(outs), target) \
            * (self.plan.micro_batch / self.plan.global_batch)

    # ------------------------------------------------------------------ messages
    def _peer_pairs(self, peer: int) -> tuple[int, list[int]]:
        """k = min(senders, receivers) and the peer stage's ranks."""
        return min(len(self.ranks[self.stage]), len(self.ranks[peer])), self.ranks[peer]

    def _send(self, values: list[torch.Tensor], peer: int, a: Action) -> None:
        """Rank pair j < k carries piece j of each value to the peer stage's rank j (sends not waited)."""
        k, peers = self._peer_pairs(peer)
        if self.local >= k:
            return
        if self.wire is not None:
            values = [v.to(self.wire) if v.is_floating_point() else v for v in values]
        ops = [P2P("send", _pieces(v.detach(), k)[self.local], peers[self.local], a.key) for v in values]
        self.pending += self.comm.p2p(ops, a.key, "comm_pp", a.micro_batch, wait_sends=False,
                                      peer=str(a.peer))

    def _recv(self, metas: list[tuple[list[int], torch.dtype]], peer: int, a: Action) -> list[torch.Tensor]:
        """The values whole on every rank of this stage: piece j from the peer stage's rank j
        (j < k), then an uneven all-gather in this stage."""
        k, peers = self._peer_pairs(peer)
        out = []
        bufs = []
        for shape, dtype in metas:
            n = int(np.prod(shape))
            sizes = [p.numel() for p in torch.tensor_split(torch.empty(n, device="meta"), k)]
            sizes += [0] * (len(self.ranks[self.stage]) - k)
            bufs.append((torch.empty(sizes[self.local], dtype=dtype), sizes, shape))
        if self.local < k:
            self.comm.p2p([P2P("recv", b, peers[self.local], a.key) for b, _, _ in bufs], a.key, "comm_pp",
                          a.micro_batch, peer=str(a.peer))
        for b, sizes, shape in bufs:
            # k = receivers: even pieces, one padded all-gather; fewer senders: one broadcast per
            # piece ("grouped"), the message's bytes once, not padded to every rank
            mode = "padded" if k == len(sizes) else "grouped"
            whole = b if len(sizes) == 1 else self.group.all_gather_uneven(b, sizes, 0, f"gather {a.key}",
                                                                           "comm_pp", mode=mode)
            out.append(whole.reshape(shape))
        return out

    def _metas(self, names: list[str], floating_only: bool = False) -> list[tuple[list[int], torch.dtype]]:
        out = []
        for t in names:
            meta = self.graph.tensors[t]
            dtype = getattr(torch, meta.dtype)
            if not floating_only or dtype.is_floating_point:
                out.append((list(meta.shape), self.wire if self.wire is not None and dtype.is_floating_point
                            else dtype))
        return out

    def _floating(self, names: list[str]) -> list[str]:
        return [t for t in names if getattr(torch, self.graph.tensors[t].dtype).is_floating_point]

    # ------------------------------------------------------------------ one step
    def _step(self, actions: tuple[Action, ...], step: int, fetch: Any) -> torch.Tensor:
        """Forward and backward of the step's micro-batches by the schedule; the step's loss (the last stage's)."""
        m = self.plan.global_batch // self.plan.micro_batch
        last = len(self.ranks) - 1
        inbox: dict[int, list[torch.Tensor]] = {}
        grad_inbox: dict[int, list[torch.Tensor]] = {}
        saved: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], Any]] = {}
        grads_out: dict[int, list[torch.Tensor]] = {}
        self.pending: list[Any] = []
        loss_sum = torch.zeros(())
        for a in actions:
            i = a.micro_batch
            if a.op == "fwd":
                inputs, target = fetch(step, i)
                by_name = dict(zip(self.graph.inputs, [x for x in inputs if isinstance(x, torch.Tensor)]))
                leaves = []
                if self.stage > 0:
                    received = dict(zip(self.cross[self.stage - 1], inbox.pop(i)))
                    for t in self._floating(self.cross[self.stage - 1]):
                        received[t].requires_grad_(True)
                        leaves.append(received[t])
                    by_name.update(received)
                self.runner.step = step * m + i
                self.spans.begin(a.key)
                keep = frozenset([self.batch_loss]) if self.batch_loss else frozenset()
                with autocast_for(self.config.dtype):  # fp32 master leaves, ops in the plan's precision
                    outs = self.runner.forward([by_name[t] for t in self.sub.inputs], keep)
                    loss = self._loss(outs, target) if self.stage == last else None
                if loss is not None:
                    loss_sum += loss.detach()
                self.spans.end()
                saved[i] = (leaves, outs, loss)
            elif a.op == "bwd":
                leaves, outs, loss = saved.pop(i)
                self.spans.begin(a.key)
                if loss is not None:
                    scaler = self.stepper.scaler  # fp16: the gradients sent back are scaled too
                    (loss * scaler.scale if scaler is not None else loss).backward()
                else:
                    grads = dict(zip(self._floating(self.cross[self.stage]), grad_inbox.pop(i)))
                    pairs = [(o, grads[t].to(o.dtype)) for t, o in zip(self.sub.outputs, outs)
                             if t in grads and o.requires_grad]
                    if pairs:
                        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                self.spans.end()
                grads_out[i] = [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]
            elif a.op == "send_fwd":
                outs = saved[i][1]
                self._send(outs, self.stage + 1, a)
            elif a.op == "recv_fwd":
                inbox[i] = self._recv(self._metas(self.cross[self.stage - 1]), self.stage - 1, a)
            elif a.op == "send_bwd":
                self._send(grads_out.pop(i), self.stage - 1, a)
            elif a.op == "recv_bwd":
                grad_inbox[i] = self._recv(self._metas(self.cross[self.stage], True), self.stage + 1, a)
            else:
                raise RuntimeSetupError(f"composed plan: action {a.op!r} is not one a chain schedule has")
        self.comm.wait(self.pending)
        assert not saved, "every forward has its backward"
        if self.stage == last and self.batch_loss and self.group.size > 1:  # the shards' losses summed
            self.group.all_reduce(loss_sum, "allreduce loss", "comm_pp")
        return loss_sum

    def _reduce_tied(self) -> None:
        """Sum the gradients of parameters several stages hold: whole on the stage's first rank
        (gathered in the stage when sharded), all-reduced between the holder stages' first ranks
        (the simulator's tied all-reduce), broadcast in the stage; every rank keeps its shard."""
        paths = {t: p for p, t in self.runner.param_paths().items()}
        for t, leaders in self._tied_list:
            path = paths.get(t) or self.graph.tensors[t].param
            leaf = self.runner.params[path]
            tensor = self.runner.param_paths()[path]
            q = self.runner.param_placement[path]
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            d = shard_dim(q)
            whole = g.clone() if d is None else self.group.all_gather_uneven(
                g, self.runner.program.sizes[(tensor, d)], d, f"gather tied {t}", "comm_dp")
            if leaders is not None:
                leaders.all_reduce(whole, f"all_reduce tied {t}", "comm_dp", dtype=self.runner.grad_dtype)
            if self.group.size > 1:
                self.group.broadcast(whole, 0, f"broadcast tied {t}", "comm_dp")
            leaf.grad = self.runner.local_slice(whole, tensor, q).clone()

    # ------------------------------------------------------------------ run
    def run(self) -> None:
        config, plan = self.config, self.plan
        self._setup()
        b, gb, data_seed = plan.micro_batch, plan.global_batch, config.data_seed

        def fetch(step: int, i: int) -> tuple[tuple[Any, ...], torch.Tensor]:
            return make_samples(self.spec, self.sample_base + step * gb + i * b, b, data_seed)

        actions = composed_schedule(plan, plan.schedule).of(self.stage)
        steps, schedule, ck = config.steps, config.lr_schedule, config.checkpoint
        start = self._maybe_resume()
        self.comm.barrier("startup barrier")
        self.rec.set_origin()
        origin = common_origin(self.rec, self.comm)
        losses: list[float] = []
        bounds: list[tuple[int, float, float]] = []
        for step in range(start, steps):
            self.hb.progress("train", step)
            self.rec.step = step
            if config.step_barrier:
                self.comm.barrier("step barrier")
            t0 = self.rec.begin_step(step)
            if self.stepper.scaler is not None:
                self.scales.append(self.stepper.scaler.scale)
            loss = self._step(actions, step, fetch)
            self.runner.flush_param_grads(GRAD_BUCKET_BYTES)
            self._reduce_tied()
            with self.rec.compute("optimizer", "optimizer"):
                if schedule is not None:
                    for g in self.stepper.optimizer.param_groups:
                        g["lr"] = schedule.at(step, steps)
                self.stepper.step()  # unscaled (fp16) and clipped first when the run asks
            if self.stepper.scaler is not None:
                self.stepper.scaler.update(step)
            t1 = self.rec.end_step()
            bounds.append((step, t0, t1))
            losses.append(float(loss))
            if ck is not None and ck.every and (step + 1) % ck.every == 0:
                self._save_checkpoint(step + 1, Path(ck.dir))
        self._finish(losses, bounds, origin, start)

    def _finish(self, losses: list[float], bounds: list[tuple[int, float, float]], origin: Any, start: int) -> None:
        return_params = self.config.records.return_params
        self.hb.progress("gather")
        params = None
        if return_params:
            params = whole_parameters(self.runner, lambda x, sizes, d: self.group.all_gather_uneven(
                x, sizes, d, "gather parameters", "comm_spmd"))
        leaves = self.leaves
        mine = {
            "rank": self.rank, "pp": self.stage, "dp": self.local, "tp": 0, "device": self.info.device,
            "host": self.info.host, "node": self.info.node, "kind": self.info.kind,
            "slowdown": self.rec.slowdown, "pid": os.getpid(), "hostname": socket.gethostname(),
            "layers": list(self.plan.stages[self.stage].layers), "params": sum(p.numel() for p in leaves),
            "param_bytes": sum(p.numel() * p.element_size() for p in leaves),
            "peak_memory_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
            "memory_kind": "max_rss", "samples_per_step": self.plan.global_batch,
            "events": [asdict(e) for e in self.rec.events], "step_bounds": bounds,
            "losses": losses if self.stage == len(self.ranks) - 1 else [],
            "params_state": params if self.local == 0 else None, "shard_infos": {}, "clock": origin, "amp": self.amp_record(start),
            "spmd": {"moves": self.runner.moves},
        }
        gathered = self.comm.gather_object(mine, dst=0, name="gather results")
        if self.rank == 0:
            assert gathered is not None
            write_result(self.run_dir, self.plan, gathered, start, self.config.steps, return_params)
        self.comm.barrier("final barrier")
        self.comm.close()
