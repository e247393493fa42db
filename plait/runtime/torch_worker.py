"""The torch engine (issue 29): one rank of a data-parallel or ZeRO-1/2/3 plan (pp = tp = 1) run on
torch's own modules -- DDP, or FSDP2 `fully_shard` for ZeRO -- composed by `parallelize` over the
plan's named DeviceMesh; a chain pipeline plan on `torch.distributed.pipelining`
(`parallelize.apply_pp`, `_build_pipeline`: the rank's stages of the plan's layer split, DDP over
each stage's replicas (torch's `replicate` at tp > 1) or, at ZeRO-1/2/3, FSDP2 over them (below), plait's schedule order with every
message through the communication facade (`torch_schedule.ActionSchedule`), the tied embedding's
gradients summed across stages, clipping global over the job); and a tensor-parallel plan (even
shards; fp32 / tf32 or bf16 / fp16 in every composition: `layout.torch_runs`) on DTensor
(`parallelize.apply_tp`: colwise / rowwise linears in the transformer layers; in every composition with
`sequence_parallel` Megatron's sequence parallelism in torch's styles -- `SequenceParallel` layer
norms, whose `Partial` gradients are summed over tp once a step (`_sum_partial_grads`; with dp > 1
FSDP2's / replicate's own reduction sums them), an
all-gather before each column region and a reduce-scatter after each row linear, the sequence cut
where a run of layers begins and gathered where it ends, the layers' dropout from a stream per
tensor rank as on plait's own engine), every collective DTensor issues recorded through the
facade: the mesh's "tp" dim is a `recorded_pg.RecordedProcessGroup`. With dp > 1 the replicas of
the DTensor-TP model are composed as torchtitan does: at ZeRO-1/2/3 FSDP2 over the mesh's "dp" dim
(`parallelize.apply_fsdp` on the TP model: 2D parameters, ZeRO's semantics and ghost micro-batches
as below); at ZeRO-0 torch's FSDP2-based `replicate` (`parallelize.apply_replicate`: DDP fails on
DTensor parameters), each unit all-reducing its gradients in the last micro-batch's backward on the
mesh's "dp" dim, itself a `RecordedProcessGroup` then; clipping over DTensor parameters takes the
global norm of the local shards, each element weighted by 1 / its copies (`_copies`). A chain pipeline with tp > 1
cuts each stage's transformer layers the same way, as torchtitan composes PP and TP: the values
between stages are plain tensors replicated over tp (with sequence parallelism this tensor rank's
part of the sequence: a region runs on across the cut, as on plait's own engine and in Megatron),
so tensor rank t of a stage exchanges with
tensor rank t of its neighbours in the same replica (torch's stage resolves its peers in the mesh's
"pp" group), the tied embedding is summed per (replica, tensor rank), and clipping counts a tp shard
once and a parameter replicated over tp (norms, row-parallel biases, the embedding) 1/tp. With
dp > 1 too (the full 3D composition) each stage's DTensor-TP modules are data-parallel over the
stage's replicas as at pp = 1: FSDP2 at ZeRO-1/2/3 (below: 2D parameters), torch's `replicate` at
ZeRO-0 (each unit all-reducing in the stage's last backward on the recorded "dp" dim). Every rank writes and resumes checkpoints in
the one DCP format (`_save_checkpoint`): whole parameters, or a DTensor's shard (FSDP2's, DTensor's,
FSDP2's over DTensor's: one box over both mesh dims) at its place in the whole tensor.

ZeRO with pipelines (as torchtitan runs FSDP with PP): each stage's module is sharded over the
stage's replicas (the mesh's "dp" dim), a unit per transformer layer that shares no parameter with
another layer (`fsdp_units` of the whole model) and the stage's root for the rest (the embedding,
or the LM head tied to it: its gradient shards summed across the stages, `_sync_tied_shards`). The
stages' backwards run FSDP2's own hooks (`_spanned_stage_type`, not torch's stage, which defers
FSDP2's reduction to a REDUCE_GRAD action its PipelineScheduleMulti does not run): ZeRO-3 gathers
a unit in every micro-batch's forward and backward and reduce-scatters every micro-batch (so a
replica with fewer micro-batches runs ghosts -- one sample, loss weight 0, "ghost" spans -- through its
pipeline up to the most another runs: `_with_ghosts`); ZeRO-1/2 keep the
parameters gathered and the gradients whole from the step's first forward to the stage's last
backward, which reduce-scatters once -- the same collectives on every replica whatever its
micro-batch count. torch's shape inference on the first step runs each stage's forward (the last
stage's backward too) once more: its gathers are in step 0's records.
`plait.runtime.layout.engine_for` says which plans it runs; the others stay on plait's own
executors (`plait.runtime.worker`).

The path of one step, as the pipeline engine's, so both give the same losses, records and results:

1. every rank builds the whole model from the same seed, checkpoints its layers' activations as
   the plan's `recompute` names (`parallelize.apply_ac`), and wraps it in DDP (buckets of the
   plan's `grad_bucket_mb`, all-reduced through the communication facade by DDP's comm hook, so
   each bucket is a record in `comm/rankN.jsonl`) or FSDP2 (one unit per layer that shares no
   parameter with another layer -- a tied embedding and LM head stay in the root unit);
2. its replica runs its share of the global batch (`partition.replica_micro_batches`: uneven
   shares included) one micro-batch after the other, forward then backward, accumulating
   gradients: DDP's `no_sync` holds its all-reduce back to the last micro-batch; FSDP2
   reduce-scatters each micro-batch's gradients into the shards (ZeRO-3 keeps no whole gradient
   between micro-batches, as the memory model counts it). Micro-batch j's loss is scaled by n_j * dp / B: DDP and FSDP2
   average over the replicas, so the average is the gradient of the global batch's mean loss
   (`parallelize.replica_loss_weight`, per micro-batch);
3. under FSDP2 every micro-batch gathers the parameters again (ZeRO-3: a layer's gathered
   parameters live for one micro-batch) and reduce-scatters its gradients, so a replica with fewer micro-batches than another runs
   *ghost* micro-batches (one sample, loss weight 0) to join the gathers of the others in the
   same order; DDP reduces once per step, so it needs none;
4. the optimizer steps (global-norm clipping and the learning-rate schedule as the pipeline
   engine's), and the step's bounds, spans and records are kept as there
   (`results.write_result` writes rank 0's `result.json`).

bf16 / fp16 (issue 29): fp32 master parameters and optimizer state; the forward and the loss run
under `amp.autocast_for` (torch's autocast lists, as every engine and the reference); FSDP2 also
gathers its parameters in the run's dtype and reduce-scatters gradients in the plan's
`grad_reduce_dtype` (`parallelize.mixed_precision`). fp16 scales the loss with plait's
`amp.DynamicLossScaler`, its found-inf flag agreed over every rank, so all ranks skip or step
together (the pipeline engine's scaler: the same schedule, the same `result.json` fields). Under
DTensor's tensor parallelism the same: its collectives run in the dtype autocast gives the values
they carry (the row linears' outputs in the low dtype; the layer norms' outputs and gradients fp32;
with dp > 1 FSDP2's / replicate's MixedPrecisionPolicy casts each unit's inputs to the low dtype, so
the column linears' input gradients cross tp in it too).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import resource
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from plait.ir.opgraph import TP_ALONE_ROLES
from plait.runtime import checkpoint as ckpt
from plait.runtime.amp import SCALE_ENV, DynamicLossScaler, autocast_for, reduce_dtype
from plait.runtime.clip import GradClipper
from plait.runtime.comm import (
    PROBE_BEFORE,
    PROBE_REPEAT,
    Comm,
    CommLog,
    Group,
)
from plait.runtime.data_parallel import make_optimizer, sync_tied_grads
from plait.runtime.inject import PROCESS_FAULTS, fire, poison
from plait.runtime.layout import (
    merge_modules,
    node_micro_batches,
    pipeline_layout,
    rank_actions,
    split_model,
    step_schedule,
)
from plait.runtime.parallelize import (
    apply_ac,
    apply_ddp,
    apply_fsdp,
    apply_pp,
    apply_replicate,
    apply_tp,
    build_mesh,
    replicates,
    seq_dim_of,
)
from plait.runtime.partition import (
    MicroBatch,
    RuntimeSetupError,
    Stage,
    build_seeded,
    layer_modules,
    load_model_spec,
    make_samples,
    replica_micro_batches,
)
from plait.runtime.rank_config import RankConfig
from plait.runtime.recorder import Heartbeat, Recorder
from plait.runtime.results import comm_records_path, common_origin, write_result
from plait.runtime.rng_stream import RngStream
from plait.runtime.sharded_state import Box, RankLayout, Segment, aliases_of, dtensor_cuts
from plait.runtime.tensor_parallel import head_local_params, is_tensor_parallel_layer
from plait.runtime.worker_config import WorkerConfig
from plait.schedule import event_key

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The layers (`partition.layer_modules`) that become FSDP2 units of their own: those that share
    no parameter with another layer (FSDP2 shards a parameter in one unit only; tied ones go to the
    root unit)."""
    layers = [m for name, m in layer_modules(model) if name]
    owners: dict[int, int] = {}
    for m in layers:
        for prm in m.parameters():
            owners[id(prm)] = owners.get(id(prm), 0) + 1
    return [m for m in layers if all(owners[id(prm)] == 1 for prm in m.parameters())]


def _copies(prm: torch.Tensor, world: int) -> int:
    """How many ranks of a `world`-rank job without pipeline hold each element of `prm`: a plain
    tensor is whole on every rank; a DTensor's shards are disjoint along its Shard (and FSDP2's
    `_StridedShard`) mesh dims and copied along the others, the mesh's replicated dims and the
    ranks off its mesh (a parameter on the "dp" dim only is copied over tp)."""
    placements = getattr(prm, "placements", None)
    if placements is None:
        return world
    mesh = prm.device_mesh  # type: ignore[attr-defined]
    shards = 1
    for i, pl in enumerate(placements):
        if not pl.is_replicate():  # Shard, or FSDP2's _StridedShard over a TP cut (not `is_shard()` in torch)
            shards *= mesh.size(i)
    return world // shards


def _dtensor_layers(module: nn.Module, model: str) -> list[tuple[str, nn.Module]]:
    """The transformer layers of `module` that DTensor's tensor parallelism cuts (`parallelize.apply_tp`);
    refuses a model whose plan cuts modules alone (experts, ...), which only plait's own engine cuts."""
    tp_layers = [(n, m) for n, m in layer_modules(module) if is_tensor_parallel_layer(m)]
    alone = {getattr(m, "plait_tp", None) for _, layer in tp_layers for m in layer.modules()} & set(TP_ALONE_ROLES)
    if alone:
        raise RuntimeSetupError(f"model {model}: its plan cuts {sorted(alone)} modules, which the torch engine's "
                                "DTensor tensor parallelism does not; run it with engine=plait (plait's own engine "
                                "cuts them)")
    return tp_layers


def _tp_sharded(prm: torch.Tensor) -> bool:
    """Whether `prm` is sharded by DTensor's tensor parallelism: a DTensor with a Shard placement on
    the mesh's "tp" dim (not a row-parallel bias, Replicate there; FSDP2's shards are over "dp")."""
    mesh = getattr(prm, "device_mesh", None)
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    return "tp" in names and prm.placements[names.index("tp")].is_shard()  # type: ignore[attr-defined]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t  # type: ignore[no-any-return]


class _TensorOutputs(nn.Module):
    """A module whose output is returned as a tuple of its tensors (torch's pipeline stages carry
    tensors only: `validate_and_normalize_to_tuple`), flattened with torch's pytree; `restore`
    rebuilds the last forward's output (its non-tensor leaves kept here) for the loss, on the same
    rank, right after that forward."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.inner = module
        self._layout: tuple[Any, list[Any]] | None = None

    def forward(self, *args: Any) -> tuple[torch.Tensor, ...]:
        leaves, spec = tree_flatten(self.inner(*args))
        self._layout = (spec, [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves])
        return tuple(x for x in leaves if isinstance(x, torch.Tensor))

    def restore(self, flat: Any) -> Any:
        assert self._layout is not None, "restore follows a forward"
        spec, leaves = self._layout
        tensors = iter(flat if isinstance(flat, tuple) else (flat,))
        return tree_unflatten([next(tensors) if x is _TENSOR else x for x in leaves], spec)


_TENSOR = object()  # a tensor's place among a flattened output's leaves


class _WholeParams:
    """Where the torch engine keeps parameters and optimizer state, as `sharded_state.RankLayout`
    reads them: each parameter whole; the optimizer steps on `locals` (views of the parameters'
    storage: `TorchWorker._prepare`), so its state is keyed by them."""

    def __init__(self, params: list[nn.Parameter], locals_: list[torch.Tensor], optimizer: Any) -> None:
        self.params, self.locals, self.optimizer = params, locals_, optimizer

    def param_segments(self) -> list[Segment]:
        return [Segment(_local(p), [p], 0) for p in self.params]  # a DTensor's local shard (`dtensor_cuts`)

    def optimizer_segments(self) -> list[Segment]:
        return [Segment(loc, [p], 0) for p, loc in zip(self.params, self.locals, strict=True)]


class TorchWorker(RankConfig):
    def __init__(self, config: WorkerConfig, rank: int, heartbeat: Heartbeat) -> None:
        super().__init__(config, rank, heartbeat)
        plan = self.plan  # Megatron's order: tensor rank fastest, then data, then pipeline
        self.t = rank % plan.tp
        self.d = (rank // plan.tp) % plan.dp
        self.p = rank // (plan.tp * plan.dp)
        self.pipelined = plan.pp > 1
        self.injection = config.faults.inject
        self.cuda = config.cuda
        # ZeRO on FSDP2; a pipeline's stages are sharded over their replicas (none with dp = 1)
        self.fsdp = plan.zero >= 1 and (plan.dp > 1 or not self.pipelined)
        self.replicated = False  # ZeRO-0 over DTensor-TP parameters on torch's replicate (`_build`, `_build_pipeline`)

    # ------------------------------------------------------------------ setup
    def _init_dist(self) -> None:
        self.hb.progress("init")
        if self.cuda:
            torch.cuda.set_device(self.gpu % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        config = self.config
        log = CommLog(comm_records_path(self.run_dir, self.rank), self.rank, self.world) \
            if config.records.comm_records else None
        self.comm = Comm(self.rank, self.world, rec=self.rec, log=log, faults=config.faults.link_faults(),
                         injection=self.injection, probe_bytes=config.records.probe_bytes)
        self.comm.init_process_group(config.backend, timeout_s=config.collective_timeout)
        self.mesh = build_mesh(self.plan, self.comm, self.device.type)
        self.dp_group: Group = self.comm.group("dp")

    def _build(self) -> None:
        self.hb.progress("build")
        config, plan = self.config, self.plan
        self.spec = load_model_spec(config.model)
        seed = config.seed
        model = build_seeded(self.spec, seed)
        self.aliases = aliases_of(model)  # the whole model's: a tied tensor's names across every stage
        self.layers = [name for name, _ in layer_modules(model)]
        self.param_count = sum(prm.numel() for prm in model.parameters() if prm.requires_grad)
        self.head_local: list[nn.Parameter] = []
        self.tied: list[tuple[list[nn.Parameter], Group]] = []
        self.clipper: GradClipper | None = None
        self.from_earlier_stage: set[str] = set()  # tied parameters a pipeline's earlier stage writes
        self.sp = False  # sequence parallelism (DTensor's, `parallelize.apply_tp`)
        self.sp_layers: list[tuple[str, nn.Module]] = []  # this rank's sequence-parallel layers
        self.sp_rng: RngStream | None = None
        if self.pipelined:
            self._build_pipeline(model)
            self._seed_streams(seed)
            if self.sp:
                self._sp_dropout_streams(seed)
            return
        head_local: list[str] = []
        if plan.tp > 1:  # DTensor shards of the transformer layers' linears (under dp: FSDP2 or replicate, below)
            tp_layers = _dtensor_layers(model, config.model)
            self.sp = bool(plan.sequence_parallel)
            self.sp_layers = tp_layers if self.sp else []
            apply_tp(model, self.mesh, tp_layers, sequence_parallel=self.sp,
                     order=[n for n, _ in layer_modules(model)])
            if self.sp:  # DTensor shards the sequence evenly (plait's own engine refuses the same)
                self._check_sequence(tp_layers)
            # whole parameters inside a cut attention see this rank's heads only (Qwen3's q_norm): by
            # name, FSDP2 and replicate put new parameters in their place
            names = {id(prm): n for n, prm in model.named_parameters()}
            head_local = [names[id(prm)] for _, layer in tp_layers for prm in head_local_params(layer, {})]
            self.param_count = sum(_local(prm).numel() for prm in model.parameters() if prm.requires_grad)
        apply_ac([m for _, m in layer_modules(model)], plan.recompute)
        model.to(self.device)
        self.model = model  # the unwrapped module: its parameters (DTensors under FSDP2) by their own names
        # data parallelism over DTensor-TP parameters (torchtitan's composition): FSDP2 at ZeRO-1/2/3,
        # 2D DTensors ((_Strided)Shard(0) over dp, the TP cut over tp); torch's FSDP2-based replicate at
        # ZeRO-0 -- DDP fails on DTensor parameters (its bucket rebuild cats DTensors with tensors)
        self.replicated = replicates(plan)
        if self.fsdp:
            self.runner: nn.Module = apply_fsdp(model, self.mesh, plan, fsdp_units(model), self.dp_group,
                                                dtype=config.dtype)
        elif self.replicated:
            self.runner = apply_replicate(model, self.mesh, plan, fsdp_units(model), dtype=config.dtype)
        elif plan.tp > 1 and plan.dp == 1:
            self.runner = model
        else:
            self.runner = apply_ddp(model, self.mesh, plan, self.dp_group, dtype=config.dtype)
        self.params = [prm for prm in model.parameters() if prm.requires_grad]
        by_name = dict(model.named_parameters())
        self.head_local = [by_name[n] for n in head_local]
        if config.clip_grad and any(hasattr(prm, "placements") for prm in self.params):
            # DTensor parameters (FSDP2's, DTensor-TP's): the global norm over their local shards, each
            # element weighted by 1 / its copies (`_copies`), one all-reduce through the facade
            self.clipper = GradClipper(config.clip_grad, {id(prm): 1.0 / _copies(prm, self.world)
                                                          for prm in self.params}, group=self.comm.world_group)
        self._seed_streams(seed)
        if self.sp:
            self._sp_dropout_streams(seed)

    def _sp_dropout_streams(self, seed: int) -> None:
        """Sequence-parallel layers hold different tokens on each tensor rank: their dropout draws
        from a stream of their own per rank, seeded as the pipeline engine's (Megatron forks its
        model-parallel RNG around such blocks); the replicated embedding and head keep the shared one."""
        self.sp_rng = RngStream(seed + 1 + 1000 * self.p + self.d + 7919 * (self.t + 1), self.cuda)
        for _, layer in self.sp_layers:
            layer.register_forward_pre_hook(self.sp_rng.enter)
            layer.register_forward_hook(self.sp_rng.leave)

    def _check_sequence(self, layers: list[tuple[str, nn.Module]]) -> None:
        """Sequence parallelism cuts the sequence into tp equal parts (DTensor's `Shard` of the
        layers' inputs, as plait's own engine's split): the first layer refuses an input whose sequence
        length tp does not divide, with plait's own engine's message, before DTensor cuts it."""
        dim, tp = seq_dim_of(layers), self.plan.tp

        def check(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if x is not None and x.shape[dim] % tp:
                raise RuntimeSetupError(f"plan field 'sequence_parallel': the sequence length {x.shape[dim]} does not "
                                        f"divide by tp={tp} (sequence parallelism cuts the sequence into tp equal "
                                        "parts)")

        for _, layer in layers[:1]:  # before DTensor's hooks
            layer.register_forward_pre_hook(check, prepend=True)

    def _seed_streams(self, seed: int) -> None:
        """Dropout streams as the pipeline engine's: one per (pipeline rank, replica)."""
        stream_seed = seed + 1 + 1000 * self.p + self.d
        torch.manual_seed(stream_seed)
        random.seed(stream_seed)
        np.random.seed(stream_seed % (2**32))

    def _build_pipeline(self, model: nn.Module) -> None:
        """This rank's pieces of a chain pipeline plan (the plan's layer split, `layout.split_model`),
        each a torch `PipelineStage` run by torch's schedule for the plan's (`parallelize.apply_pp`),
        over its replicas when dp > 1 under DDP (torch's stage holds the all-reduce back to the last
        micro-batch) or, at ZeRO-1/2/3, sharded by FSDP2 (`parallelize.apply_fsdp` over the stage's
        replicas: a unit per transformer layer of the stage that shares no parameter with another
        layer -- `fsdp_units` of the whole model -- and the stage's root for the rest, a tied
        embedding or LM head included; the stage's backwards as `_spanned_stage_type` says); at
        tp > 1 each stage's transformer layers cut by DTensor (`parallelize.apply_tp`) first, then with
        dp > 1 FSDP2 (ZeRO-1/2/3) or, at ZeRO-0, torch's `replicate` (`parallelize.apply_replicate`,
        its units as FSDP2's: DDP takes no DTensor parameters) over the stage's replicas; groups
        that sum tied parameters' gradients across the pipeline ranks that hold them, one per replica
        and tensor rank (the pipeline engine's, Megatron's embedding group)."""
        plan, config = self.plan, self.config
        lay = pipeline_layout(plan)
        # the whole model's layers in execution order and its tensor-parallel ones, before the split:
        # a sequence-parallel region runs on across the pipeline's cuts
        order = [name for name, _ in layer_modules(model)]
        model_tp = [name for name, _ in _dtensor_layers(model, config.model)] if plan.tp > 1 else []
        # ZeRO-0 over DTensor-TP stages: torch's FSDP2-based replicate over each stage's replicas (DDP
        # takes no DTensor parameters), its units as FSDP2's
        self.replicated = replicates(plan)
        units = {id(m) for m in fsdp_units(model)} if self.fsdp or self.replicated else set()
        stages = split_model(model, plan, lay, self.spec)
        mine = {lay.node_of(self.p, c): stages[lay.node_of(self.p, c)] for c in range(lay.chunks)}
        for node, st in mine.items():
            if node > 0 and st.data_inputs:  # torch's stages after the first get their predecessor's values only
                raise RuntimeSetupError(f"model {config.model}: pipeline stage {node} reads the model's inputs "
                                        f"{st.data_inputs} itself, which torch's pipelining does not pass it; "
                                        "run it without engine=torch")
        self.stage_nodes = mine
        self.first, self.last = 0 in mine, lay.num_nodes - 1 in mine
        self.layers = [name for st in mine.values() for name in st.layers]
        self._tie_stages(stages, lay.num_stages)
        before = {node: dict(st.module.named_parameters()) for node, st in mine.items()}
        if plan.tp > 1:  # DTensor inside each stage, as torchtitan's PP x TP (x FSDP2 / replicate over dp, below)
            # with sequence parallelism a stage's boundary values are this tensor rank's part of the
            # sequence, sent to tensor rank t of the next stage (plait's own engine's and Megatron's
            # layout; `apply_tp`'s `region_layers`); its layer norms' gradients come out `Partial`
            self.sp = bool(plan.sequence_parallel)
            for st in mine.values():
                tp_layers = _dtensor_layers(st.module, config.model)
                apply_tp(st.module, self.mesh, tp_layers, sequence_parallel=self.sp, order=order,
                         region_layers=model_tp)
                if self.sp:
                    self.sp_layers += tp_layers
                    if tp_layers and tp_layers[0][0] == model_tp[0]:  # where the sequence is cut
                        self._check_sequence(tp_layers)
                self.head_local += [prm for _, layer in tp_layers for prm in head_local_params(layer, {})]
        apply_ac([m for st in mine.values() for _, m in layer_modules(st.module)], plan.recompute)
        # the rank's pieces before data parallelism shards them (tensor parallelism's shards counted)
        self.param_count = sum(_local(prm).numel() for prm in dict.fromkeys(
            prm for st in mine.values() for prm in st.module.parameters() if prm.requires_grad))
        if (self.fsdp or self.replicated) and len({id(prm) for ps in before.values() for prm in ps.values()}) < \
                sum(len(ps) for ps in before.values()):
            raise RuntimeSetupError(f"model {config.model}: two of pipeline rank {self.p}'s stages share a parameter, "
                                    "which FSDP2 (and replicate) put in one unit only; run it with zero=0"
                                    + (" and tp=1" if self.replicated else ""))
        modules: dict[int, nn.Module] = {}
        for node, st in mine.items():
            st.module.to(self.device)
            # torch's stages exchange values and gradients through buffers laid out as the first
            # ones they see (`empty_strided`: a seq-first view's strides), which gloo refuses
            if node < lay.num_nodes - 1:
                st.module.register_forward_hook(_contiguous_outputs)
            if node > 0:
                st.module.register_forward_pre_hook(_contiguous_input_grads)
            # the last stage's output (a dict of an HF model, say) as the tuple of tensors torch's
            # stages carry, rebuilt for the loss (`_pipeline_loss`); inside DDP, whose no_sync torch's
            # stage finds on the module it holds (and inside FSDP2's root)
            module: nn.Module = st.module if node < lay.num_nodes - 1 else _TensorOutputs(st.module)
            if node == lay.num_nodes - 1:
                self.outputs = module
            blocks = [m for m in st.module.modules() if id(m) in units]
            if self.fsdp:
                modules[node] = apply_fsdp(module, self.mesh, plan, blocks, self.dp_group, dtype=config.dtype,
                                           root=f"stage{node}", names={id(m): n for n, m in st.module.named_modules()})
            elif self.replicated:  # each unit all-reduces over the stage's replicas in the stage's last backward
                modules[node] = apply_replicate(module, self.mesh, plan, blocks, dtype=config.dtype)
            else:
                modules[node] = apply_ddp(module, self.mesh, plan, self.dp_group, dtype=config.dtype) \
                    if plan.dp > 1 else module
        # FSDP2, replicate and DTensor put DTensor parameters in the stages' modules: the tied groups
        # and copy counts follow them
        new = {id(prm): dict(st.module.named_parameters())[name]
               for node, st in mine.items() for name, prm in before[node].items()}
        self.tied = [([new[id(prm)] for prm in prms], group) for prms, group in self.tied]
        self.copies = {id(new[k]): n for k, n in self.copies.items() if k in new}
        self.model = merge_modules([st.module for st in mine.values()])  # parameters under their own names
        self.params = list(dict.fromkeys(prm for prm in self.model.parameters() if prm.requires_grad))
        self.real_mbs = len(replica_micro_batches(plan, 0, self.d))
        mbs = self._with_ghosts(0, replica_micro_batches(plan, 0, self.d))
        self.mb_sizes = [mb.size for mb in mbs]
        # where the sizes differ, torch's receive buffers are sized per micro-batch along each value's
        # batch dimension (`torch_schedule.ActionSchedule.set_actions`)
        self.batch_dims = {node: ([st.batch_dims.get(n, 0) for n in st.input_names] if node > 0 else [],
                                  [st.batch_dims.get(n, 0) for n in st.output_names] if node < lay.num_nodes - 1
                                  else [])
                           for node, st in mine.items()}
        self.lay = lay
        self.schedule = apply_pp(modules, self.mesh, plan, self.device, self._pipeline_loss, len(mbs), self.comm,
                                 stage_type=partial(_spanned_stage_type(), span=self._stage_span,
                                                    sync_every_backward=plan.zero >= 3))
        if config.clip_grad:  # the global norm over every rank, each element once: each tied copy,
            # a parameter replicated over tp (not tp-sharded: norms, embedding, head) once over the tensor
            # ranks, DDP's and replicate's whole copies once over the replicas (FSDP2's shards are disjoint)
            replicas = 1 if self.fsdp else plan.dp
            weights = {id(prm): 1.0 / self.copies.get(id(prm), 1) / (1 if _tp_sharded(prm) else plan.tp) / replicas
                       for prm in self.params}
            self.clipper = GradClipper(config.clip_grad, weights, group=self.comm.world_group)

    def _tie_stages(self, stages: list[Stage], pipeline_ranks: int) -> None:
        """Per set of pipeline ranks holding one parameter (a tied embedding and LM head), a group
        over them per replica; the gradients of this rank's such parameters are summed in it."""
        plan = self.plan
        owners: dict[int, list[int]] = {}
        for st in stages:
            for prm in st.module.parameters():
                holders = owners.setdefault(id(prm), [])
                if st.index % pipeline_ranks not in holders:
                    holders.append(st.index % pipeline_ranks)
        self.copies = {k: len(v) for k, v in owners.items()}
        self.from_earlier_stage = {n for st in self.stage_nodes.values() for n, prm in st.module.named_parameters()
                                   if min(owners[id(prm)]) < self.p}
        mine = list(dict.fromkeys(prm for st in self.stage_nodes.values() for prm in st.module.parameters()))
        for owner_set in sorted({tuple(sorted(v)) for v in owners.values() if len(v) > 1}):
            # one group per (replica, tensor rank): tied tensors are replicated over tp (Megatron's embedding group)
            sets = [[plan.rank(s, d, t) for s in owner_set] for d in range(plan.dp) for t in range(plan.tp)]
            group = self.comm.new_groups("tied s" + "-".join(map(str, owner_set)), sets)
            if group is not None:
                self.tied.append(([prm for prm in mine if tuple(sorted(owners[id(prm)])) == owner_set], group))

    def _pipeline_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The loss torch's schedule back-propagates for one micro-batch: its mean loss weighted by its
        share (n_j * dp / B, n_j its samples -- the target's first dim, `partition.make_samples` --:
        DDP averages over the replicas) and, under fp16, the loss scale."""
        scale = self.scaler.scale if self.scaler is not None else 1.0
        with self._autocast():
            loss: torch.Tensor = self.spec.loss(self.outputs.restore(output), target)
        if self.schedule.micro_batch >= self.real_mbs:  # a ghost (`_with_ghosts`): adds nothing
            return loss * 0.0
        return loss * (len(target) * self.plan.dp / self.plan.global_batch * scale)

    def _with_ghosts(self, step: int, mbs: list[MicroBatch]) -> list[MicroBatch]:
        """The replica's micro-batches of `step`, and under FSDP2 at ZeRO-3 *ghosts* (one sample, the
        replica's first again, loss weight 0) up to the most any replica runs: each micro-batch of a
        stage gathers and reduce-scatters over the stage's replicas, so every replica joins as many
        (the non-pipeline path's and plait's own ZeRO-3's rule)."""
        if not (self.fsdp and self.plan.zero >= 3):
            return mbs
        most = max(len(replica_micro_batches(self.plan, step, d)) for d in range(self.plan.dp))
        return mbs + [MicroBatch(i, mbs[0].first, 1) for i in range(len(mbs), most)]

    def _with_ghost_samples(self, mbs: list[MicroBatch], real: int,
                            data: dict[int, tuple[tuple[Any, ...], torch.Tensor]]
                            ) -> dict[int, tuple[tuple[Any, ...], torch.Tensor]]:
        """`data` and the samples of the ghosts among `mbs` (those after the first `real`): the
        replica's first sample again, made here (`_with_ghosts`)."""
        if len(mbs) == real:
            return data
        return {**data, **{mb.index: make_samples(self.spec, mb.first, 1, self.config.data_seed, self.device)
                           for mb in mbs[real:]}}

    @contextlib.contextmanager
    def _stage_span(self, op: str, stage_index: int, micro_batch: int) -> Iterator[None]:
        """A stage's forward ("fwd") or backward ("bwd") of one micro-batch: a compute span named as
        the pipeline engine names it; the forward, and torch's shape inference ("infer"), under the
        run's autocast."""
        if op == "infer":  # torch's shape inference: under the forward's autocast, not a span
            with self._autocast():
                yield
            return
        p, c = stage_index % self.plan.pp, stage_index // self.plan.pp
        category = "forward" if op == "fwd" else "backward"
        if micro_batch >= self.real_mbs:  # a ghost's spans: calibration and the doctor count real ones only
            op, category = f"ghost {op}", "ghost"
        with self.rec.compute(event_key(op, p, c, micro_batch), category, micro_batch=micro_batch, chunk=c,
                              samples=self.mb_sizes[micro_batch]):
            with self._autocast() if op == "fwd" else contextlib.nullcontext():
                yield

    # ------------------------------------------------------------------ run
    def run(self) -> None:
        self._prepare()
        start = self._maybe_resume()
        steps, ck = self.config.steps, self.config.checkpoint
        self.comm.barrier("startup barrier")
        self.rec.set_origin()
        origin_info = common_origin(self.rec, self.comm)
        losses: list[torch.Tensor] = []
        bounds: list[tuple[int, float, float]] = []
        for step in range(start, steps):
            t0, t1, loss_sum = self._train_step(step)
            bounds.append((step, t0, t1))
            losses.append(loss_sum)
            if self.config.records.step_records:
                self._record_step(step, t0, t1, loss_sum)
            if ck is not None and ck.every and (step + 1) % ck.every == 0:
                self._save_checkpoint(step + 1, Path(ck.dir))
        self.rec.step = None
        self._finish(losses, bounds, start, steps, origin_info)

    def _prepare(self) -> None:
        """The recorder, the process groups, the wrapped model, its optimizer and loss scaler."""
        config = self.config
        slow = any(f.kind == "slow" and f.rank == self.rank for f in self.injection.faults)
        self.rec = Recorder(self.info.device, self.p, self.rank, cuda=self.cuda, slowdown=self.info.slowdown,
                            heartbeat=self.hb,
                            inject_factor=partial(self.injection.compute_factor, self.rank) if slow else None,
                            compute_floor_s=config.faults.compute_sleep)
        self._init_dist()
        self._build()
        if self.cuda and config.dtype == "tf32":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        # The optimizer steps on each parameter's local tensor (a DTensor's shard: a view of its
        # storage): the update is elementwise, so it is the same, without DTensor's dispatch on every
        # op of every parameter (bench/torch_engine.py: that made the optimizer ~10x slower on CPU).
        self.locals = [_local(prm).detach() for prm in self.params]
        self.optimizer = make_optimizer(self.locals, config.optimizer)
        # it clips the local tensors (`_optimizer_step`): FSDP2's shards, DTensor's (`_build`), a
        # pipeline stage's DTensor ones
        self.clip_locals = self.clipper is not None and (self.fsdp or not self.pipelined or self.plan.tp > 1)
        if self.clip_locals:
            self.clipper.weights = {id(loc): self.clipper.weight(prm) for prm, loc in zip(self.params, self.locals,
                                                                                         strict=True)}
        # Only fp16 needs loss scaling: bf16 has the exponent range of fp32.
        self.scaler = DynamicLossScaler.from_string(os.environ.get(SCALE_ENV)) if config.dtype == "fp16" else None
        self.scales: list[float] = []
        if self.scaler is not None:  # every rank of the job skips or steps together
            self.scaler.group = self.comm.world_group

    def _train_step(self, step: int) -> tuple[float, float, torch.Tensor]:
        """One step: faults due now, barriers and link probes around the timed span, the replica's
        micro-batches, the optimizer step. Returns the span's (start, end) and the loss summed."""
        config = self.config
        probe_every = config.records.probe_every
        self.hb.progress("train", step)
        mbs = replica_micro_batches(self.plan, step, self.d)
        # a pipeline's inputs are read by its first stage, its targets by its last
        data = self._step_data(mbs) if not self.pipelined or self.first or self.last else {}
        self.rec.step = step
        fault = self.injection.at(self.rank, step, "step", PROCESS_FAULTS)
        if fault is not None:
            fire(fault)
        if config.records.comm_records == "alternate":  # bench/recorder_overhead.py (as the pipeline engine)
            self.comm.recording = (step // 2 + step) % 2 == 0
        if config.step_barrier:
            self.comm.barrier("step barrier")
        if probe_every and step % probe_every == 0:
            self.comm.probe_links(PROBE_BEFORE)
            self.comm.barrier("probe barrier")
        t0 = self.rec.begin_step(step)
        if self.scaler is not None:
            self.scales.append(self.scaler.scale)
        loss_sum = self._pipeline_accumulate(step, mbs, data) if self.pipelined else self._accumulate(step, mbs, data)
        if self.tied:  # a tied embedding and LM head: the stages' gradients summed (after DDP's mean)
            if self.fsdp or self.replicated:  # DTensors: FSDP2's shards -- replica d of each stage holds the
                # same rows (Shard(0) over dp) --, or replicate's whole local tensors
                _sync_tied_shards(self.tied, reduce_dtype(self.plan, self.config.dtype))
            else:
                sync_tied_grads(self.tied, reduce_dtype(self.plan, self.config.dtype))
        if self.sp:  # SequenceParallel's norms: each rank's gradient is its tokens' part (Partial), summed
            self._sum_partial_grads()
        for prm in self.head_local:  # each rank's gradient is its heads' part: summed
            if prm.grad is not None:
                self.comm.group("tp").all_reduce(_local(prm.grad), "allreduce tp head-local grads", "comm_tp")
        if self.injection.at(self.rank, step, "step", ("inf",)) is not None:
            poison(self._local_grads())
        self._optimizer_step(step)
        t1 = self.rec.end_step()
        if probe_every and step % probe_every == 0:
            self.comm.probe_links(PROBE_REPEAT - PROBE_BEFORE)
        return t0, t1, loss_sum

    def _sum_partial_grads(self) -> None:
        """The gradients DTensor leaves `Partial` over "tp" (the parameters `SequenceParallel` replicates:
        layer norms that saw this rank's part of the sequence) summed in one all-reduce through the
        facade (as plait's own engine's "allreduce tp sp-grads", Megatron's
        `allreduce_sequence_parallel_grads`) and made `Replicate`, as their parameters."""
        from torch.distributed.tensor import DTensor

        parts = [prm for prm in self.params if isinstance(prm.grad, DTensor)
                 and any(pl.is_partial() for pl in prm.grad.placements)]
        if not parts:
            return
        grads = [prm.grad.to_local() for prm in parts]  # type: ignore[union-attr]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.comm.group("tp").all_reduce(flat, "allreduce tp sp-grads", "comm_tp")
        offset = 0
        for prm, g in zip(parts, grads, strict=True):
            summed = flat[offset:offset + g.numel()].view_as(g)
            prm.grad = DTensor.from_local(summed, prm.device_mesh, prm.placements,  # type: ignore[attr-defined]
                                          run_check=False)
            offset += g.numel()

    def _optimizer_step(self, step: int) -> None:
        """Unscale (fp16), set the learning rate, clip, and step on the local tensors."""
        # fp16: unscale this rank's gradients (its shards under FSDP2); an inf anywhere skips the step everywhere
        skip = self.scaler is not None and self.scaler.unscale_and_check(
            [g for g in self._local_grads() if g is not None])
        if self.scaler is not None:
            self.scaler.update(step)
        self._set_lr(step)
        if self.clipper is not None and not skip and self.clip_locals:  # shards; copies weighted by the clipper
            for prm, loc in zip(self.params, self.locals, strict=True):
                loc.grad = _local(prm.grad) if prm.grad is not None else None
            # the weights count every copy (`_copies`; a pipeline's in `_build_pipeline`): replicas=1
            self.clipper.clip_params(self.locals, 1)
        elif self.clipper is not None and not skip:  # a pipeline: each rank holds some of the parameters
            self.clipper.clip_params(self.params, 1)
        elif self.config.clip_grad and not skip:
            torch.nn.utils.clip_grad_norm_(self.params, self.config.clip_grad)
        with self.rec.compute("optimizer", "optimizer"):
            for prm, loc in zip(self.params, self.locals, strict=True):
                loc.grad = _local(prm.grad) if prm.grad is not None else None
            if not skip:
                self.optimizer.step()
        for prm, loc in zip(self.params, self.locals, strict=True):
            prm.grad = loc.grad = None

    def _accumulate(self, step: int, mbs: list[MicroBatch],
                    data: dict[int, tuple[tuple[Any, ...], torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of each of the replica's micro-batches, gradients reduced in the
        last one's backward; under FSDP2 at ZeRO-3, ghost micro-batches up to the most any replica
        runs (each micro-batch gathers and reduce-scatters); at ZeRO-1/2 the parameters stay gathered
        from the first forward to the last backward and the gradients accumulate whole, reduce-scattered
        once in the last backward (plait's own ZeRO-1/2 step reduces once a step too), so every
        replica joins the same collectives whatever its micro-batch count."""
        plan = self.plan
        real = len(mbs)
        mbs = self._with_ghosts(step, mbs)
        data = self._with_ghost_samples(mbs, real, data)
        rounds = len(mbs)
        zero3 = self.fsdp and plan.zero >= 3
        loss_sum = torch.zeros((), device=self.device)
        scale = self.scaler.scale if self.scaler is not None else 1.0  # fp16: the loss scaled, the gradients with it
        for i, mb in enumerate(mbs):
            last = i == rounds - 1
            weight = mb.size * plan.dp / plan.global_batch if i < real else 0.0  # a ghost adds nothing
            inputs, target = data[mb.index]
            # DDP holds its all-reduce back to the last micro-batch; FSDP2 at ZeRO-3 reduce-scatters
            # every micro-batch's gradients into the shards, so that no rank holds whole gradients
            # between them (ZeRO-3's memory, as the memory model counts it); at ZeRO-1/2 it syncs (and
            # reshards) in the last backward only
            sync: Any = contextlib.nullcontext() if last or self.fsdp or plan.tp > 1 \
                else self.runner.no_sync()  # type: ignore[operator]
            if self.replicated:  # replicate all-reduces in the last backward only (DDP's no_sync)
                self.runner.set_requires_gradient_sync(last)  # type: ignore[operator]
            if self.fsdp and not zero3:
                self.runner.set_requires_gradient_sync(last)  # type: ignore[operator]
                self.runner.set_reshard_after_backward(last)  # type: ignore[operator]
            # a ghost's spans are "ghost" ones: calibration and the doctor count real micro-batches only
            fwd, bwd = ("forward", "backward") if weight else ("ghost", "ghost")
            with sync:
                with self.rec.compute(event_key(fwd[:3] if weight else "ghost fwd", 0, 0, i), fwd, micro_batch=i,
                                      chunk=0, samples=mb.size):
                    with self._autocast():
                        loss = self.spec.loss(self.runner(*inputs), target)
                with self.rec.compute(event_key(bwd[:3] if weight else "ghost bwd", 0, 0, i), bwd, micro_batch=i,
                                      chunk=0, samples=mb.size):
                    (loss * (weight * scale)).backward()
            loss_sum += loss.detach().float() * (weight / plan.dp)
        return loss_sum

    def _pipeline_accumulate(self, step: int, mbs: list[MicroBatch],
                             data: dict[int, tuple[tuple[Any, ...], torch.Tensor]]) -> torch.Tensor:
        """One step of the pipeline over the replica's micro-batches in the order of plait's schedule
        (`torch_schedule.ActionSchedule`; gradients accumulated, DDP's all-reduce or FSDP2's ZeRO-1/2
        reduce-scatter in each stage's last backward, ZeRO-3's in every backward): the first stage is
        given the replica's inputs, the last its targets, concatenated;
        the schedule cuts them into the same micro-batches again. Returns the replica's
        share of the global batch's loss (on the last stage)."""
        plan, lay = self.plan, self.lay
        real = len(mbs)
        mbs = self._with_ghosts(step, mbs)
        if real != self.real_mbs or len(mbs) != len(self.mb_sizes):
            raise RuntimeSetupError(f"step {step}: replica {self.d} runs {real} micro-batches ({len(mbs)} with "
                                    f"ghosts), its pipeline was built for {self.real_mbs} ({len(self.mb_sizes)})")
        node_mbs = {n: mbs for n in node_micro_batches(plan, lay, step, self.d)}  # a chain: every node the same
        self.schedule.set_actions(rank_actions(step_schedule(plan, lay, node_mbs, plan.schedule), lay, self.p, self.d),
                                  [mb.size for mb in mbs], self.batch_dims)
        data = self._with_ghost_samples(mbs, real, data)
        args: tuple[Any, ...] = ()
        target = None
        if self.first:
            first = self.stage_nodes[0]
            args = tuple(_cat_samples([_stage_args(first, data[mb.index][0])[k] for mb in mbs])
                         for k in range(len(_stage_args(first, data[mbs[0].index][0]))))
        if self.last:
            target = _cat_samples([data[mb.index][1] for mb in mbs])
        losses: list[torch.Tensor] = []
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        total = torch.stack([loss.detach().float() for loss in losses]).sum() if losses \
            else torch.zeros((), device=self.device)
        return total / (scale * self.plan.dp)

    def _autocast(self) -> Any:
        return autocast_for(self.config.dtype, self.device.type)

    def _local_grads(self) -> list[torch.Tensor | None]:
        """This rank's gradients (the local shards of FSDP2's DTensors), for the inf fault."""
        return [g.to_local() if g is not None and hasattr(g, "to_local") else g for g in (p.grad for p in self.params)]

    def _set_lr(self, step: int) -> None:
        sched = self.config.lr_schedule
        if sched is None:
            return
        lr = sched.at(step, self.config.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _step_data(self, mbs: list[MicroBatch]) -> dict[int, tuple[tuple[Any, ...], torch.Tensor]]:
        """The replica's samples of one step: synthetic by global index, or the user data's stream
        in the pipeline engine's order (`plait.runtime.data`)."""
        seed, data, base = self.config.data_seed, self.config.data, self.sample_base
        if data is None:
            return {mb.index: make_samples(self.spec, base + mb.first, mb.size, seed, self.device) for mb in mbs}
        if getattr(self, "_data_iter", None) is None:
            from plait.runtime import data as user_data

            dataset, collate = user_data.load_data(data.spec)
            order = user_data.SampleOrder(len(dataset), seed)
            ranges = [(base + mb.first, mb.size) for step in range(self.start_step, self.config.steps)
                      for mb in replica_micro_batches(self.plan, step, self.d)]
            self._data_iter = user_data.batches(dataset, collate, order, ranges, data.workers)
        out = {}
        for mb in mbs:
            with self.hb.pause():  # a wait for the loader is not the step's work (plait.runtime.recorder)
                inputs, target = next(self._data_iter)
            out[mb.index] = (tuple(x.to(self.device) if isinstance(x, torch.Tensor) else x for x in inputs),
                             target.to(self.device))
        return out

    def _record_step(self, step: int, t0: float, t1: float, loss_sum: torch.Tensor) -> None:
        """`RUN_DIR/steps/rankN.jsonl` as the pipeline engine writes it: the replica's loss share
        only on the rank that holds the loss (a pipeline's last stage), so each replica has one."""
        rec: dict[str, Any] = {"step": step, "t0": t0, "t1": t1, "wall": time.time(), "cpu": time.process_time(),
                               "main_cpu": time.thread_time()}
        if not self.pipelined or self.last:
            rec.update(dp=self.d, loss_share=float(loss_sum))
        with open(self.run_dir / "steps" / f"rank{self.rank}.jsonl", "a") as fh:
            fh.write(json.dumps(rec) + "\n")

    # ------------------------------------------------------------------ results
    # ------------------------------------------------------------------ checkpoints
    def _ckpt_layout(self) -> RankLayout:
        """This rank's parameters and optimizer state as the one checkpoint code names them
        (`plait.runtime.checkpoint`: the single-process model's names, so a checkpoint written here
        loads under any plan and engine, and one written by plait's own engine loads here). Each
        parameter is whole on the ranks holding it (DDP's replicas, a pipeline's stage); a tied one
        is written by its first stage only; a DTensor parameter (FSDP2's shard over dp, DTensor's over
        tp, FSDP2's over DTensor's: a box over both) writes its local shard at its place in the whole
        tensor (`sharded_state.dtensor_cuts`).
        Parameters replicated over tp (layer norms beside DTensor's linears) are written by tensor
        rank 0."""
        boxes: dict[str, Box] = {}  # FSDP2 over a DTensor-TP parameter: a box over both mesh dims
        cuts, coords = dtensor_cuts(self.model, boxes)
        return RankLayout(self.model, _WholeParams(self.params, self.locals, self.optimizer), cuts, self.t,
                          self.aliases, self.from_earlier_stage, coords, boxes)

    def _meta(self) -> dict[str, Any]:
        config = self.config
        return {"model": config.model, "plan": str(self.plan), "world_size": self.world,
                "optimizer": config.optimizer, "seed": config.seed, "data_seed": config.data_seed}

    def _maybe_resume(self) -> int:
        """Load the launcher's chosen checkpoint (written under this plan or any other, by either
        engine): parameters and optimizer state resharded by DCP, the step, the samples seen, the
        loss scale; the RNG streams under the same plan and world (else fresh ones from the seed, the
        step and the rank's coordinates, `checkpoint.reseed_streams`), as plait's own engine does."""
        self.start_step, self.sample_base = 0, 0
        ck = self.config.checkpoint
        if ck is None or not ck.resume or not ck.resume_from:  # the launcher chose it (None: none to resume)
            return 0
        self.hb.progress("resume")
        train, rank_state = ckpt.load_into(Path(ck.resume_from), self._ckpt_layout(), self.rank)
        step = int(train["step"])
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
            if self.sp_rng is not None:  # as plait's own engine reseeds it
                self.sp_rng.load_state_dict(RngStream(s + 7919 * (self.t + 1), self.cuda).state_dict())
        return step

    def _save_checkpoint(self, step: int, root: Path) -> None:
        """Collective: this rank's parameters and optimizer state under the single-process model's
        names, with the step, samples seen, loss scaler and RNG states, as one DCP checkpoint
        (`plait.runtime.checkpoint`, the format plait's own engine writes)."""
        self.hb.progress("checkpoint")
        ck = self.config.checkpoint
        assert ck is not None  # the run saves checkpoints
        aliases = self.aliases
        train = {"step": step, "samples_seen": self.sample_base + step * self.plan.global_batch,
                 "plan": str(self.plan), "world_size": self.world, "format_version": ckpt.FORMAT_VERSION,
                 "amp": json.dumps(self.scaler.state_dict()) if self.scaler is not None else None,
                 "tied": {a: c for a, c in aliases.items() if a != c},
                 "lr_schedule": self.config.schedule_record()}
        mine = {"rng": ckpt.rng_state(), "sp_rng": self.sp_rng.state_dict() if self.sp_rng is not None else None,
                "coords": [self.p, self.d, self.t]}
        state = ckpt.rank_snapshot(self._ckpt_layout(), train, self.rank, mine)
        hook = None
        fault = self.injection.at(self.rank, step - 1, "checkpoint", PROCESS_FAULTS)
        if fault is not None:
            hook = partial(fire, fault)
        with self.rec.waiting("checkpoint"):
            ckpt.save(root, step, state, self._meta(), self.rank, self.world, self.comm, keep=ck.keep,
                      before_publish=hook)
        self.hb.progress("train")

    def _finish(self, losses: list[torch.Tensor], bounds: list[tuple[int, float, float]], start: int, steps: int,
                origin: dict[str, Any]) -> None:
        self.hb.progress("gather")
        loss_vec = torch.stack(losses) if losses else torch.zeros(0, device=self.device)
        if self.plan.dp > 1 and loss_vec.numel():
            self.dp_group.all_reduce(loss_vec, "allreduce dp losses", "comm_dp", span=False)
        # a pipeline's last stage alone computes the loss (`results.write_result` reads it there)
        losses_out = loss_vec.cpu().tolist() if not self.pipelined or self.last else None
        local = [_local(prm) for prm in self.params]
        param_bytes = sum(t.numel() * t.element_size() for t in local)  # held between steps (FSDP2, TP: shards)
        params = None
        if self.config.records.return_params:
            full = {n: (prm.full_tensor() if hasattr(prm, "full_tensor") else prm).detach().cpu().clone()
                    for n, prm in self.model.named_parameters()}  # FSDP2: gathered, collective
            params = full if self.d == 0 else None
            if params is not None:  # a tied tensor under each of its names (GPT-2's lm_head.weight)
                for name, prm in self.model.named_parameters(remove_duplicate=False):
                    first = next((n for n, p in self.model.named_parameters() if p is prm), None)
                    if name not in params and first in params:
                        params[name] = params[first]
        if self.cuda:
            peak, mem_kind = int(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
        else:
            peak, mem_kind = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "max_rss"
        mine = {
            "rank": self.rank, "pp": self.p, "dp": self.d, "tp": self.t, "device": self.info.device,
            "host": self.info.host, "node": self.info.node, "kind": self.info.kind,
            "slowdown": self.rec.slowdown, "pid": os.getpid(), "hostname": socket.gethostname(),
            "layers": self.layers, "params": self.param_count, "param_bytes": param_bytes,
            "peak_memory_bytes": peak, "memory_kind": mem_kind,
            "samples_per_step": self.plan.samples_per_replica()[self.d],
            "events": [asdict(e) for e in self.rec.events], "step_bounds": bounds,
            "losses": losses_out,
            "params_state": params if self.t == 0 else None, "shard_infos": {}, "clock": origin,
            "param_aliases": getattr(self, "aliases", None) if params is not None else None,
            "amp": {"scales": self.scales, "skipped": [k for k in self.scaler.skipped if k >= start],
                    "final_scale": self.scaler.scale}
            if self.scaler is not None else None, "engine": "torch",
        }
        gathered = self.comm.gather_object(mine, dst=0, name="gather results")
        if self.rank == 0:
            assert gathered is not None
            write_result(self.run_dir, self.plan, gathered, start, steps, self.config.records.return_params)
        self.comm.barrier("final barrier")
        self.comm.close()


def _sync_tied_shards(tied: list[tuple[list[nn.Parameter], Group]], dtype: torch.dtype | None) -> None:
    """`data_parallel.sync_tied_grads` on DTensor gradients' local tensors: FSDP2's shards -- replica d
    of every stage that holds a tied tensor holds the same rows of it (FSDP2 shards dim 0 over the
    stage's replicas, as many on each stage), so summing the local shards over the tied group sums
    the stages' gradients -- or torch's `replicate`'s whole ones (Replicate over dp)."""
    for params, group in tied:
        for prm in params:
            if prm.grad is None:
                prm.grad = torch.zeros_like(prm)
        grads = [_local(prm.grad) for prm in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        group.all_reduce(flat, "allreduce tied", "comm_dp", dtype=dtype)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _stage_args(stage: Stage, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """The model inputs a pipeline stage reads, in its argument order (a *args placeholder takes the rest)."""
    if stage.data_inputs is None:
        return tuple(inputs)
    if stage.varargs:
        return tuple(inputs[k] for k in stage.data_inputs[:-1]) + tuple(inputs[stage.data_inputs[-1]:])
    return tuple(inputs[k] for k in stage.data_inputs)


def _contiguous_outputs(module: nn.Module, args: Any, outputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """A stage's outputs, contiguous (see `_build_pipeline`)."""
    return tuple(o.contiguous() if isinstance(o, torch.Tensor) else o for o in outputs)


def _contiguous_input_grads(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A stage's received values passed through `_ContiguousGrad`: the gradients it sends back are
    contiguous (see `_build_pipeline`)."""
    return tuple(_ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _cat_samples(values: list[Any]) -> Any:
    """Micro-batches' values joined along the batch dim (`partition.make_samples` puts it first);
    constants once."""
    if isinstance(values[0], torch.Tensor) and values[0].dim() > 0:
        return torch.cat(values, dim=0)
    return values[0]


@functools.cache
def _spanned_stage_type() -> Callable[..., PipelineStage]:
    """`PipelineStage` whose forward and backward of each micro-batch run inside a span (`span`:
    (op, stage index, micro-batch) -> context manager), built on first use: torch's pipelining takes
    ~0.6 s to import."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._backward import stage_backward
    from torch.nn.parallel import DistributedDataParallel

    class SpannedStage(PipelineStage):
        def __init__(self, *args: Any, span: Callable[[str, int, int], Any], sync_every_backward: bool = False,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._span = span
            self._sync_every_backward = sync_every_backward

        def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[Any, ...],
                              kwargs: dict[str, Any] | None = None, save_forward_output: bool = True) -> Any:
            with self._span("fwd", self.stage_index, fwd_chunk_id):
                return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

        def _compute_outputs(self, *args: Any, module: nn.Module, **kwargs: Any) -> Any:
            # torch's shape inference on the first step runs the module outside the schedule: as the
            # forward runs (the run's autocast: its outputs' dtypes), and outside DDP's reduction (a
            # forward that syncs with no backward after it breaks DDP's first-step bucket rebuild)
            sync = module.no_sync() if isinstance(module, DistributedDataParallel) else contextlib.nullcontext()
            with sync, self._span("infer", self.stage_index, 0):
                return super()._compute_outputs(*args, module=module, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                               last_backward: bool = False) -> None:
            with self._span("bwd", self.stage_index, bwd_chunk_id):
                super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

        def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict[str, Any],
                                       last_backward: bool = False) -> Any:
            # torch's stage runs an FSDP2 module's backwards without reduction or resharding and
            # leaves both to a REDUCE_GRAD action (`perform_reduce_grad`) that its
            # PipelineScheduleMulti does not run. Here FSDP2's own hooks do them, as in the
            # non-pipeline engine (`TorchWorker._accumulate`): at ZeRO-3 every backward reduce-scatters
            # its gradients and reshards (a layer's gathered parameters live for one micro-batch);
            # at ZeRO-1/2 the gradients accumulate whole and the parameters stay gathered until the
            # stage's last backward (`last_backward`, from `torch_schedule.ActionSchedule`), which
            # reduce-scatters once and reshards, so every replica joins the same collectives.
            if not isinstance(self.submod, FSDPModule):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            if backward_type != "full":
                raise RuntimeSetupError(f"FSDP2 pipeline stages run full backwards only, not {backward_type!r}")
            sync = self._sync_every_backward or last_backward
            self.submod.set_requires_gradient_sync(sync)
            self.submod.set_reshard_after_backward(sync)
            return stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                  bwd_kwargs["input_values"]), None

    return SpannedStage

