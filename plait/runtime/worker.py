"""The pipeline engine: one rank of a 3D-grid or stage-graph plan. Run by the worker entry
(`plait.runtime.entry`, which torchrun starts) for every plan that is neither an SPMD program
nor a composed one.

The path of one batch, in order:

1. every rank builds the full model from the same seed (so it equals the single-process
   reference), cuts out its pipeline nodes (`layout.split_model`: a stage, the chunks of an
   interleaved rank, or a stage of a stage graph), shards the
   stage's transformer layers over its tensor group (`tensor_parallel`), and moves the
   stage to its device;
2. each step, the rank's data-parallel replica takes its slice of the global batch
   (`partition.replica_micro_batches`; samples seeded by global index), and the stage runs
   the plan's schedule (`plait.schedule` action lists) over the micro-batches
   (`executor.PipelineExecutor`, which sends to and receives from any peer stage);
3. gradients of stage-shared (tied) parameters are summed across stages, gradients of the
   sequence-parallel LayerNorms and biases across the tensor group, then all are reduced
   across data-parallel replicas, and the optimizer steps (`data_parallel`: plain, or ZeRO-1/2;
   `zero3`: parameters sharded too, gathered per layer by hooks, gradients reduce-scattered per layer);
   under fp16 the loss was scaled and the step unscales, or skips it job-wide on inf/nan
   (`amp`);
4. every K steps each rank writes its checkpoint file (`checkpoint`);
5. at the end rank 0 gathers losses, measured spans and (optionally) the full parameters
   into `result.json` / `params.pt` in the run directory, which the launcher reads
   (`results.write_result`, shared with the SPMD and composed engines).

Rank numbering is Megatron's (tp fastest, then dp, then pp) -- a stage graph's ranks are its
(stage, replica) pairs, stage-major, each stage with its own data-parallel group
(`layout.pipeline_layout`) -- so the process group rank
is the plan rank whatever rank torchrun gave the process; the config maps
(torchrun agent, local rank) to the plan rank.
"""

from __future__ import annotations

import json
import os
import random
import resource
import socket
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from plait.ir.plan import Plan
from plait.runtime import checkpoint as ckpt
from plait.runtime.amp import (
    LOW_PRECISION,
    SCALE_ENV,
    DynamicLossScaler,
    autocast_for,
    reduce_dtype,
)
from plait.runtime.clip import GradClipper
from plait.runtime.comm import (
    PROBE_BEFORE,
    PROBE_REPEAT,
    Comm,
    CommLog,
    Group,
)
from plait.runtime.data_parallel import (
    DataParallelStep,
    Zero1Step,
    _flat_grads,
    _scatter_back,
    make_optimizer,
    sync_tied_grads,
)
from plait.runtime.executor import PipelineExecutor
from plait.runtime.inject import PROCESS_FAULTS, fire, poison
from plait.runtime.layout import (
    PipelineLayout,
    merge_modules,
    node_micro_batches,
    owned_micro_batches,
    peer_rank,
    pipeline_layout,
    rank_actions,
    split_model,
    step_schedule,
    with_node_edges,
)
from plait.runtime.parallelize import apply_ac
from plait.runtime.partition import (
    MicroBatch,
    build_seeded,
    layer_modules,
    load_model_spec,
    make_samples,
    replica_micro_batches,
    stage_micro_batches,
)
from plait.runtime.rank_config import RankConfig
from plait.runtime.recorder import Heartbeat, Recorder
from plait.runtime.results import comm_records_path, common_origin, write_result
from plait.runtime.rng_stream import RngStream
from plait.runtime.sharded_state import RankLayout, aliases_of
from plait.runtime.tensor_parallel import (
    ShardInfo,
    TPContext,
    apply_sequence_parallel,
    apply_tensor_parallel,
    head_local_params,
    is_tensor_parallel_layer,
    sequence_parallel_params,
)
from plait.runtime.worker_config import WorkerConfig
from plait.runtime.zero3 import Zero3Step


# ---------------------------------------------------------------------------------- worker
class Worker(RankConfig):
    def __init__(self, config: WorkerConfig, rank: int, heartbeat: Heartbeat) -> None:
        super().__init__(config, rank, heartbeat)  # plan, world, info, run_dir
        plan = self.plan
        self.layout = pipeline_layout(plan)
        if self.layout.graph_plan:  # (stage, replica), each stage its own data-parallel degree
            self.p, self.d = self.layout.coords(rank)
            self.t = 0
            self.dp_size = self.layout.replicas(self.p)
        else:
            self.t = rank % plan.tp
            self.d = (rank // plan.tp) % plan.dp
            self.p = rank // (plan.tp * plan.dp)
            self.dp_size = plan.dp
        self.injection = config.faults.inject
        self.cuda = config.cuda

    # ------------------------------------------------------------------ setup
    def _init_dist(self) -> None:
        self.hb.progress("init")
        if self.cuda:
            # Every agent of a run lives on this machine (emulated nodes share it), so the plan rank,
            # not torchrun's per-agent LOCAL_RANK, picks a distinct GPU (NCCL needs one GPU per rank).
            # On real multi-node hosts the cluster file's local GPU index of the rank (`local_device`).
            torch.cuda.set_device(self.gpu % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        # Every call of this rank goes through one facade: Timeline spans, the streamed records file
        # (RUN_DIR/comm/rankN.jsonl) and the link faults of tests.
        config = self.config
        log = CommLog(comm_records_path(self.run_dir, self.rank), self.rank, self.world) \
            if config.records.comm_records else None
        self.comm = Comm(self.rank, self.world, rec=self.rec, log=log, faults=config.faults.link_faults(),
                         injection=self.injection, probe_bytes=config.records.probe_bytes)
        self.comm.init_process_group(config.backend, timeout_s=config.collective_timeout)
        plan = self.plan
        if self.layout.graph_plan:
            # A stage graph's stages have their own data-parallel degrees: explicit groups, one per
            # stage over its replicas ("dp"), and each rank its own tensor group (tp=1, `supports`).
            self.comm.new_groups("dp", [list(r) for r in self.layout.stage_ranks])
            self.comm.new_groups("tp", [[r] for r in range(self.world)])
        else:
            # The plan's ranks are a regular pp x dp x tp grid (Megatron's order, as `Plan.rank`): one mesh.
            self.comm.build_mesh(self.device.type, {"pp": self.layout.num_stages, "dp": plan.dp, "tp": plan.tp})
        self.dp_group: Group = self.comm.group("dp")
        self.tp_group: Group = self.comm.group("tp")

    def _build(self) -> None:
        self.hb.progress("build")
        plan = self.plan
        self.spec = load_model_spec(self.config.model)
        seed = self.config.seed
        model = build_seeded(self.spec, seed)
        # Which layers are tensor parallel, in execution order over the whole model: a sequence-parallel
        # region spans consecutive ones, across pipeline cuts too.
        order = [(n, is_tensor_parallel_layer(m)) for n, m in layer_modules(model)]
        lay = self.layout
        stages = split_model(model, plan, lay, self.spec)
        self.layout = lay = with_node_edges(lay, stages)  # segments of stages that run per input
        self.chunks = {c: stages[lay.node_of(self.p, c)] for c in range(lay.chunks_of(self.p))}
        self.stage_layers = [name for st in self.chunks.values() for name in st.layers]
        # Parameters used by several pipeline ranks (tied embeddings) -> one all-reduce group per owner set.
        owners: dict[int, list[int]] = {}
        for s in stages:
            for prm in s.module.parameters():
                rank_stage = lay.place(s.index)[0]
                if rank_stage not in owners.setdefault(id(prm), []):
                    owners[id(prm)].append(rank_stage)
        tied_sets = sorted({tuple(sorted(v)) for v in owners.values() if len(v) > 1})
        self.copies = {k: len(v) for k, v in owners.items()}  # pipeline ranks holding each parameter
        # Checkpoints name parameters as the single-process model does (a tied group by its first
        # name) and write a tied parameter from its first pipeline rank only (`sharded_state`).
        self.param_aliases = aliases_of(model)
        self._owners = owners
        self.tied: list[tuple[list[nn.Parameter], Group]] = []
        mine = list(dict.fromkeys(prm for st in self.chunks.values() for prm in st.module.parameters()))
        for owner_set in tied_sets:
            g = self.comm.new_groups("tied s" + "-".join(map(str, owner_set)), _tied_rank_sets(plan, lay, owner_set))
            if g is not None:
                self.tied.append(([prm for prm in mine if tuple(sorted(owners[id(prm)])) == owner_set], g))
        # Megatron tensor parallelism on this stage's transformer layers.
        self.shard_infos: dict[str, ShardInfo] = {}
        layers = {n: m for st in self.chunks.values()
                  for n, m in layer_modules(st.module if lay.num_nodes > 1 else model)}
        self.sp = bool(plan.sequence_parallel) and plan.tp > 1
        tp_layers = {n: m for n, m in layers.items() if is_tensor_parallel_layer(m)}
        seq_dim = next((int(getattr(m, "plait_seq_dim", 0)) for m in tp_layers.values()), 0)
        tp_ctx = TPContext(self.tp_group, plan.tp, self.t, sequence_parallel=self.sp, seq_dim=seq_dim)
        self.sp_params: list[nn.Parameter] = []
        if plan.tp > 1:
            for name, layer in tp_layers.items():
                infos = apply_tensor_parallel(layer, tp_ctx, plan.tp_ratios, prefix=name + ".")
                self.shard_infos.update(infos)
                if self.sp:
                    i = [n for n, _ in order].index(name)
                    apply_sequence_parallel(layer, tp_ctx, enter=not (i > 0 and order[i - 1][1]),
                                            leave=not (i + 1 < len(order) and order[i + 1][1]))
                    self.sp_params += sequence_parallel_params(layer, infos, prefix=name + ".")
                else:  # whole parameters that see this rank's heads only (Qwen3's q_norm, k_norm)
                    self.sp_params += head_local_params(layer, infos, prefix=name + ".")
        self._apply_recompute(layers)
        for st in self.chunks.values():
            st.module.to(self.device)
        # One module over this rank's chunks (after tensor parallelism replaced their parameters).
        self.stage_module: nn.Module = merge_modules([st.module for st in self.chunks.values()])
        self.from_earlier_stage = {n for n, prm in self.stage_module.named_parameters()
                                   if min(self._owners.get(id(prm), [self.p])) < self.p}
        self.params = [prm for prm in self.stage_module.parameters() if prm.requires_grad]
        self.param_count = sum(prm.numel() for prm in self.params)
        del model, stages
        # Dropout streams: the same on the tensor ranks of a replica (replicated regions must agree).
        stream_seed = seed + 1 + 1000 * self.p + self.d
        torch.manual_seed(stream_seed)
        random.seed(stream_seed)
        np.random.seed(stream_seed % (2**32))
        # Sequence-parallel layers hold different tokens on each tensor rank: their dropout draws from
        # a stream of their own per rank (Megatron forks its model-parallel RNG around such blocks).
        self.sp_rng: RngStream | None = None
        if self.sp:
            self.sp_rng = RngStream(stream_seed + 7919 * (self.t + 1), self.cuda)
            for layer in tp_layers.values():
                layer.register_forward_pre_hook(self.sp_rng.enter)
                layer.register_forward_hook(self.sp_rng.leave)

    def _apply_recompute(self, layers: dict[str, nn.Module]) -> None:
        apply_ac(layers.values(), self.plan.recompute)  # the policy both engines share

    def _autocast(self) -> Any:
        if self.config.dtype not in LOW_PRECISION:
            return torch.autocast(self.device.type, enabled=False)
        return autocast_for(self.config.dtype, self.device.type)

    # ------------------------------------------------------------------ run
    def run(self) -> None:
        config, plan = self.config, self.plan
        # The recorder exists before the model so that tensor-parallel collectives can report to it.
        self.rec = self._make_recorder()
        self._init_dist()
        self._build()
        if self.cuda and config.dtype == "tf32":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        low = self._make_optimizer()
        runner = self._make_executor()
        start = self._maybe_resume()
        steps, ck = config.steps, config.checkpoint
        self.comm.barrier("startup barrier")
        self.rec.set_origin()
        origin_info = common_origin(self.rec, self.comm)
        losses: list[torch.Tensor] = []
        step_bounds: list[tuple[int, float, float]] = []
        self.scales: list[float] = []  # the loss scale each step's backward used
        # One stage under ZeRO-3: forward and backward of each micro-batch in turn (1F1B with pp=1, the
        # same arithmetic as GPipe), so a layer's gathered parameters live for one micro-batch only.
        schedule = "1f1b" if self.zero3 is not None else plan.schedule
        for step in range(start, steps):
            t0, t1 = self._train_step(runner, step, schedule, low)
            step_bounds.append((step, t0, t1))
            losses.append(runner.loss_sum.detach().clone())
            if config.records.step_records:
                self._record_step(step, t0, t1,
                                  runner.loss_sum if self.p == self.layout.sink[0] and self.t == 0 else None)
            if ck is not None and ck.every and (step + 1) % ck.every == 0:
                self._save_checkpoint(step + 1, Path(ck.dir))
        self.rec.step = None  # the calls of the end (results, barriers) belong to no step
        self._finish(losses, step_bounds, start, steps, origin_info)

    def _make_recorder(self) -> Recorder:
        """The rank's span recorder (a `slow` fault injected into it stretches its compute)."""
        slow = any(f.kind == "slow" and f.rank == self.rank for f in self.injection.faults)
        return Recorder(self.info.device, self.p, self.rank, cuda=self.cuda, slowdown=self.info.slowdown,
                        heartbeat=self.hb,
                        inject_factor=partial(self.injection.compute_factor, self.rank) if slow else None,
                        compute_floor_s=self.config.faults.compute_sleep)

    def _make_optimizer(self) -> torch.dtype | None:
        """The loss scaler and the data-parallel optimizer step (plain, ZeRO-1/2 or ZeRO-3, clipped
        when the run asks); returns the plan's gradient-reduction dtype (None: fp32)."""
        config, plan = self.config, self.plan
        make_opt = partial(make_optimizer, cfg=config.optimizer)
        # Only fp16 needs loss scaling: bf16 has the exponent range of fp32.
        self.scaler = DynamicLossScaler.from_string(os.environ.get(SCALE_ENV)) if config.dtype == "fp16" else None
        if self.scaler is not None:  # every rank of the job skips or steps together
            self.scaler.group = self.comm.world_group
        self.zero3: Zero3Step | None = None
        low = reduce_dtype(plan, config.dtype)  # the plan's gradient-reduction dtype (Plan.grad_dtype)
        if plan.zero >= 3 and self.dp_size > 1:
            # Parameters sharded too (api refuses pp > 1 with zero=3): per-layer gather / reduce-scatter.
            self.zero3 = Zero3Step(self.stage_module, layer_modules(self.stage_module), make_opt, self.dp_group,
                                   self.dp_size, self.d, self.rec, scaler=self.scaler, tp_group=self.tp_group,
                                   sp_params=self.sp_params, reduce_dtype=low)
            self.opt = self.zero3
        elif plan.zero >= 1:
            self.opt = Zero1Step(self.params, make_opt, self.dp_group, self.dp_size, self.d, self.rec,
                                 free_grads=plan.zero >= 2, scaler=self.scaler, reduce_dtype=low)
        else:
            self.opt = DataParallelStep(self.params, make_opt, self.dp_group, self.dp_size, self.rec,
                                        bucket_bytes=plan.grad_bucket_bytes, scaler=self.scaler, reduce_dtype=low)
        if config.clip_grad:
            self.opt.clip = GradClipper(config.clip_grad, self._copy_weights(), group=self.comm.world_group)
        return low

    def _make_executor(self) -> PipelineExecutor:
        """The executor of this rank's pipeline actions (sends to and receives from any peer stage)."""
        plan, lay = self.plan, self.layout
        return PipelineExecutor(self.chunks, self.p, lay.node_of, peer_rank(plan, lay, self.d, self.t),
                                lay.sink, self.spec.loss, plan.global_batch, self.device, self.rec, self.comm,
                                autocast=self._autocast,
                                # Megatron's blocking p2p where the simulator models it (sim/lowering/tensor_parallel.py).
                                blocking=not plan.stages and plan.schedule in ("1f1b", "gpipe")
                                and plan.virtual_stages == 1,
                                per_input=bool(lay.places))  # a stage's segments (StageSpec.segments)

    def _train_step(self, runner: PipelineExecutor, step: int, schedule: str, low: torch.dtype | None
                    ) -> tuple[float, float]:
        """One step: this rank's actions of the schedule over its micro-batches, the gradient
        reductions and the optimizer step; returns the step's bounds."""
        plan, lay = self.plan, self.layout
        self.hb.progress("train", step)
        node_mbs = node_micro_batches(plan, lay, step, self.d)
        chunk_mbs = {c: node_mbs[lay.node_of(self.p, c)] for c in self.chunks}
        # a graph stage's lists hold all its replicas' micro-batches; this replica reads its own
        mine = {c: owned_micro_batches(lay, lay.node_of(self.p, c), self.d, m) for c, m in chunk_mbs.items()}
        mbs = mine[0]
        data = self._step_data(mine)
        sched = step_schedule(plan, lay, node_mbs, schedule)
        self.rec.step = step  # the step barrier's comm record belongs to this step, not the last one
        probed = self._before_step(step)
        t0 = self.rec.begin_step(step)
        runner.loss_sum = torch.zeros((), device=self.device)
        if self.scaler is not None:
            runner.loss_scale = self.scaler.scale
            self.scales.append(self.scaler.scale)
        if self.zero3 is not None:
            self.zero3.begin_step()
        runner.run(rank_actions(sched, lay, self.p, self.d), chunk_mbs,
                   lambda c, mb, data=data: data[(c, mb.index)])
        if self.zero3 is not None:  # join the collectives of replicas with more micro-batches
            most = max(len(replica_micro_batches(plan, step, d)) for d in range(plan.dp))
            self.zero3.ghost_rounds(most - len(mbs), len(mbs))
        self._reduce_grads(step, low)
        self._set_lr(step)
        self.opt.step()
        if self.scaler is not None:
            self.scaler.update(step)
        t1 = self.rec.end_step()
        if probed:  # the step's last exchanges, outside its time
            self.comm.probe_links(PROBE_REPEAT - PROBE_BEFORE)
        return t0, t1

    def _before_step(self, step: int) -> bool:
        """What precedes the step's measured time: injected faults, the records' on/off switch, the
        step barrier and the link probe; returns whether the links were probed this step."""
        config = self.config
        fault = self.injection.at(self.rank, step, "step", PROCESS_FAULTS)
        if fault is not None:
            fire(fault)
        if config.records.comm_records == "alternate":
            # bench/recorder_overhead.py: records on and off in adjacent steps, the order alternating
            # pair by pair (on/off, off/on, ...) so a drifting machine biases neither side.
            self.comm.recording = (step // 2 + step) % 2 == 0
        if config.step_barrier:
            self.comm.barrier("step barrier")
        probe_every = config.records.probe_every
        if probe_every and step % probe_every == 0:
            # Each rank pair's link, timed (the doctor's matrix) while no rank computes, then a
            # barrier: the ranks' different probe end times do not enter the measured iteration.
            self.comm.probe_links(PROBE_BEFORE)
            self.comm.barrier("probe barrier")
            return True
        return False

    def _reduce_grads(self, step: int, low: torch.dtype | None) -> None:
        """Gradients summed where several ranks computed parts of them: tied parameters across
        stages, sequence-parallel ones across the tensor group (an injected inf first, if any)."""
        if self.injection.at(self.rank, step, "step", ("inf",)) is not None:
            poison(prm.grad for prm in self.params)
        if self.tied:
            sync_tied_grads(self.tied, low)
            if self.layout.graph_plan and self.d > 0:  # the owner stages' replicas summed in one group
                for prms, _ in self.tied:  # (`_tied_rank_sets`): replica 0 alone carries the sum
                    for prm in prms:        # into the stage's data-parallel reduction
                        if prm.grad is not None:
                            prm.grad.zero_()
        if self.sp_params and self.zero3 is None:  # ZeRO-3 sums them per layer before reducing
            self._sync_sp_grads()

    def _record_step(self, step: int, t0: float, t1: float, loss_sum: torch.Tensor | None) -> None:
        """`RUN_DIR/steps/rankN.jsonl`, one line as each step ends (so a run that dies keeps them): the
        step's bounds on the ranks' common clock, the wall time of its end, the process's CPU seconds
        so far (`time.process_time`, all threads), the main thread's alone (`time.thread_time`: the
        rest is the communication backend's and the heartbeat's threads) and, on the loss-holding
        rank of each replica, the replica's share of the global-batch loss (the shares sum to it)."""
        rec: dict[str, Any] = {"step": step, "t0": t0, "t1": t1, "wall": time.time(), "cpu": time.process_time(),
                               "main_cpu": time.thread_time()}
        if loss_sum is not None:
            rec.update(dp=self.d, loss_share=float(loss_sum))
        with open(self.run_dir / "steps" / f"rank{self.rank}.jsonl", "a") as fh:
            fh.write(json.dumps(rec) + "\n")

    def _copy_weights(self) -> dict[int, float]:
        """Per parameter, 1 / the number of model-parallel ranks holding a copy of it (for the global
        gradient norm, `plait.runtime.clip`): tied parameters live on several pipeline ranks,
        parameters not sharded by tensor parallelism on every tensor rank."""
        out: dict[int, float] = {}
        for name, prm in self.stage_module.named_parameters():
            w = 1.0 / self.copies.get(id(prm), 1)
            if self.plan.tp > 1 and name not in self.shard_infos:
                w /= self.plan.tp
            out[id(prm)] = w
        return out

    def _sync_sp_grads(self) -> None:
        """Sum the gradients of sequence-parallel LayerNorms and biases over the tensor group: each
        rank computed them on its 1/tp of the tokens (Korthikanti et al. 2022, §4.2.2); without
        sequence parallelism, of the whole parameters that see this rank's heads only."""
        flat = _flat_grads(self.sp_params)
        self.tp_group.all_reduce(flat, "allreduce tp sp-grads", "comm_tp")
        _scatter_back(flat, self.sp_params, "grad")

    def _set_lr(self, step: int) -> None:
        """The schedule's learning rate for this step's update (`plait.runtime.lr`, Megatron's flags)."""
        sched = self.config.lr_schedule
        if sched is None:
            return
        lr = sched.at(step, self.config.steps)
        for group in self.opt.optimizer.param_groups:
            group["lr"] = lr

    def _needed(self, chunk_mbs: dict[int, list[MicroBatch]]) -> list[tuple[int, MicroBatch]]:
        """(chunk, micro-batch) pairs whose samples this rank reads: chunks that read model inputs
        or compute the loss, in one fixed order (the user-data loader fetches in this order)."""
        sink = self.layout.sink
        return [(c, mb) for c, mbs in sorted(chunk_mbs.items())
                if self.chunks[c].data_inputs is None or self.chunks[c].data_inputs or (self.p, c) == sink
                for mb in mbs]

    def _step_data(self, chunk_mbs: dict[int, list[MicroBatch]]
                   ) -> dict[tuple[int, int], tuple[tuple[Any, ...], torch.Tensor]]:
        """Samples of the micro-batches of the chunks that read model inputs or compute the loss:
        stream positions shifted by `sample_base` (a resume continues with the sample after the
        checkpoint's last, whatever the plans' global batches)."""
        seed = self.config.data_seed
        base = getattr(self, "sample_base", 0)
        needed = self._needed(chunk_mbs)
        if self.config.data is None:
            return {(c, mb.index): make_samples(self.spec, base + mb.first, mb.size, seed, self.device)
                    for c, mb in needed}
        if getattr(self, "_data_iter", None) is None:
            self._data_iter = self._open_data(base, seed)
        out = {}
        for c, mb in needed:
            with self.hb.pause():  # a wait for the loader is not the step's work (plait.runtime.recorder)
                inputs, target = next(self._data_iter)
            out[(c, mb.index)] = (tuple(x.to(self.device) if isinstance(x, torch.Tensor) else x for x in inputs),
                                  target.to(self.device))
        return out

    def _open_data(self, base: int, seed: int) -> Any:
        """A DataLoader over every micro-batch this rank reads from now to the last step, in the
        order `_step_data` asks for them, its workers fetching ahead (`plait.runtime.data`)."""
        from plait.runtime import data as user_data

        data = self.config.data
        assert data is not None  # `_step_data` opens it for the user's data only
        dataset, collate = user_data.load_data(data.spec)
        order = user_data.SampleOrder(len(dataset), seed)
        start = getattr(self, "start_step", 0)
        lay = self.layout
        ranges = []
        for step in range(start, self.config.steps):
            node_mbs = node_micro_batches(self.plan, lay, step, self.d)
            chunk_mbs = {c: node_mbs[lay.node_of(self.p, c)] for c in self.chunks}
            ranges += [(base + mb.first, mb.size) for _, mb in self._needed(chunk_mbs)]
        return user_data.batches(dataset, collate, order, ranges, data.workers)

    def _meta(self) -> dict[str, Any]:
        config = self.config
        return {"model": config.model, "plan": str(self.plan), "world_size": self.world,
                "optimizer": config.optimizer, "seed": config.seed, "data_seed": config.data_seed}

    def _ckpt_layout(self) -> RankLayout:
        return RankLayout(self.stage_module, self.opt, self.shard_infos, self.t, self.param_aliases,
                          self.from_earlier_stage)

    def _maybe_resume(self) -> int:
        """Load the chosen checkpoint, written under this plan or any other: parameters and optimizer
        state resharded by DCP; the step and loss scale; RNG streams when the rank layout is the same
        (else fresh streams from seed, step and rank coordinates: `checkpoint.reseed_streams`)."""
        self.start_step, self.sample_base = 0, 0
        ck = self.config.checkpoint
        if ck is None or not ck.resume or not ck.resume_from:  # the launcher chose it (None: none to resume)
            return 0
        path = Path(ck.resume_from)
        self.hb.progress("resume")
        train, rank_state = ckpt.load_into(path, self._ckpt_layout(), self.rank)
        if isinstance(self.opt, Zero1Step):
            self.opt.sync_master_from_params()
        step = int(train["step"])
        # The position in the sample stream: the next step starts at the checkpoint's samples_seen.
        self.start_step = step
        self.sample_base = int(train.get("samples_seen", step * self.plan.global_batch)) - step * self.plan.global_batch
        if self.scaler is not None and train.get("amp"):
            self.scaler.load_state_dict(json.loads(train["amp"]))
        if rank_state is not None and train.get("plan") == str(self.plan) and train.get("world_size") == self.world:
            ckpt.set_rng_state(rank_state["rng"])
            if self.sp_rng is not None and rank_state.get("sp_rng") is not None:
                self.sp_rng.load_state_dict(rank_state["sp_rng"])
        else:
            s = ckpt.reseed_streams(self.config.seed, step, (self.p, self.d, self.t))
            if self.sp_rng is not None:
                self.sp_rng.load_state_dict(RngStream(s + 7919 * (self.t + 1), self.cuda).state_dict())
        return step

    def _save_checkpoint(self, step: int, root: Path) -> None:
        """Collective: this rank's slices of every parameter and optimizer state, named as in the
        single-process model, plus step, loss scaler and RNG states, as one DCP checkpoint."""
        self.hb.progress("checkpoint")
        ck = self.config.checkpoint
        assert ck is not None  # the run saves checkpoints
        samples_seen = getattr(self, "sample_base", 0) + step * self.plan.global_batch
        train = {"step": step, "samples_seen": samples_seen, "plan": str(self.plan), "world_size": self.world,
                 "format_version": ckpt.FORMAT_VERSION,
                 "amp": json.dumps(self.scaler.state_dict()) if self.scaler is not None else None,
                 "tied": {a: c for a, c in self.param_aliases.items() if a != c},
                 "lr_schedule": self.config.schedule_record()}
        mine = {"rng": ckpt.rng_state(), "sp_rng": self.sp_rng.state_dict() if self.sp_rng is not None else None,
                "coords": [self.p, self.d, self.t]}
        state = ckpt.rank_snapshot(self._ckpt_layout(), train, self.rank, mine)
        hook = None
        fault = self.injection.at(self.rank, step - 1, "checkpoint", PROCESS_FAULTS)
        if fault is not None:
            hook = partial(fire, fault)
        with self.rec.waiting("checkpoint"):
            ckpt.save(root, step, state, self._meta(), self.rank, self.world, self.comm,
                      keep=ck.keep, before_publish=hook)
        self.hb.progress("train")

    # ------------------------------------------------------------------ results
    def _samples_per_step(self) -> int:
        """Samples this rank's replica runs per step (a graph stage's: the micro-batches dealt to it)."""
        if self.layout.graph_plan:
            return sum(mb.size for mb in stage_micro_batches(self.plan, 0, self.p, self.d))
        return self.plan.samples_per_replica()[self.d]

    def _finish(self, losses: list[torch.Tensor], bounds: list[tuple[int, float, float]], start: int,
                steps: int, origin: dict[str, Any]) -> None:
        plan = self.plan
        self.hb.progress("gather")
        loss_vec = torch.stack(losses) if losses else torch.zeros(0, device=self.device)
        if self.p == self.layout.sink[0] and self.dp_size > 1 and loss_vec.numel():
            self.dp_group.all_reduce(loss_vec, "allreduce dp losses", "comm_dp", span=False)
        # Parameter bytes held between steps: the whole stage, or under ZeRO-3 the shards (~1/dp).
        param_bytes = self.zero3.resident_param_bytes() if self.zero3 is not None else \
            sum(prm.numel() * prm.element_size() for prm in self.params)
        params = None
        return_params = self.config.records.return_params
        if self.zero3 is not None and return_params:
            self.zero3.gather_all()  # collective over the replicas
        if return_params and self.d == 0:
            # every name this stage reads a tensor under (T5's decoder embedding is its LM head too)
            params = {n: prm.detach().cpu().clone()
                      for n, prm in self.stage_module.named_parameters(remove_duplicate=False)}
        if self.cuda:
            peak = int(torch.cuda.max_memory_allocated())
            mem_kind = "cuda_max_allocated"
        else:
            peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
            mem_kind = "max_rss"
        mine = {
            "rank": self.rank, "pp": self.p, "dp": self.d, "tp": self.t, "device": self.info.device,
            "host": self.info.host, "node": self.info.node, "kind": self.info.kind,
            "slowdown": self.rec.slowdown, "pid": os.getpid(), "hostname": socket.gethostname(),
            "layers": self.stage_layers, "params": self.param_count, "param_bytes": param_bytes,
            "peak_memory_bytes": peak,
            "memory_kind": mem_kind, "samples_per_step": self._samples_per_step(),
            "events": [asdict(e) for e in self.rec.events],
            "step_bounds": bounds,
            "losses": loss_vec.cpu().tolist() if self.p == self.layout.sink[0] else None,
            "params_state": params, "shard_infos": {k: asdict(v) for k, v in self.shard_infos.items()},
            "param_aliases": self.param_aliases if params is not None else None,
            "clock": origin,
            "amp": {"scales": self.scales, "skipped": [s for s in self.scaler.skipped if s >= start],
                    "final_scale": self.scaler.scale} if self.scaler is not None else None,
        }
        gathered = self.comm.gather_object(mine, dst=0, name="gather results")
        if self.rank == 0:
            assert gathered is not None
            write_result(self.run_dir, plan, gathered, start, steps, return_params)
        self.comm.barrier("final barrier")
        self.comm.close()


def _tied_rank_sets(plan: Plan, layout: PipelineLayout, owner_set: tuple[int, ...]) -> list[list[int]]:
    """Groups that sum a tied parameter's gradients over the pipeline ranks holding it. On the grid,
    one per (replica, tensor rank) (Megatron's embedding group). In a stage graph the owner stages
    may differ in data-parallel degree, so one group over all their replicas sums every partial
    gradient; the worker then keeps the sum on replica 0 only, so each stage's data-parallel
    reduction gives every replica the whole gradient once."""
    if layout.graph_plan:
        return [[layout.rank_of(s, r) for s in owner_set for r in range(layout.replicas(s))]]
    return [[plan.rank(s, d, t) for s in owner_set] for d in range(plan.dp) for t in range(plan.tp)]

