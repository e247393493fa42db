"""A plan's data parallelism on torch's own modules (issue 29), composed as torchtitan's
`parallelize` does: one small function per parallelism over the plan's named DeviceMesh
(dims "pp", "dp", "tp", Megatron's rank order: tensor fastest, then data, then pipeline).

* `apply_ddp`: DDP over the mesh's "dp" dim, buckets of the plan's `grad_bucket_mb`;
* `apply_tp`: DTensor tensor parallelism (`parallelize_module`, colwise / rowwise) over "tp", with
  Megatron's sequence parallelism in torch's styles (`SequenceParallel` norms, `PrepareModuleInput`
  all-gathers before the column linears, `RowwiseParallel(output_layouts=Shard)` reduce-scatters);
* `apply_fsdp`: FSDP2 `fully_shard` for ZeRO-1/2/3 -- parameters resharded after forward only at
  ZeRO-3 (torchtitan's mapping: ZeRO-1/2 keep them gathered until backward; FSDP2 always shards
  gradients and optimizer states), `MixedPrecisionPolicy` from the plan's `dtype` and
  `grad_reduce_dtype`; also each pipeline stage's module over that stage's replicas; applied on
  top of `apply_tp` (torchtitan's FSDP + TP) a DTensor-TP parameter becomes a 2D DTensor
  ((Shard(0) or `_StridedShard(0)`) over "dp", its TP cut over "tp");
* `apply_replicate`: plain data parallelism (ZeRO-0) over DTensor-TP parameters, where DDP fails
  (torch 2.13: "aten.cat.default: got mixed torch.Tensor and DTensor" in its bucket rebuild): torch's
  FSDP2-based `replicate` (`torch.distributed._composable.replicate_with_fsdp`), whose units
  all-reduce their whole gradients over "dp" as DDP's buckets do -- on the mesh's recorded "dp" dim
  (`build_mesh`), so each unit's all-reduce is a record;
* `apply_pp`: pipeline stages on `torch.distributed.pipelining` over "pp" -- each of the rank's
  model pieces (the plan's layer split, `layout.split_model`) a `PipelineStage`, run in the order
  of plait's schedule for the plan's (gpipe, 1f1b, interleaved: `plait.schedule`'s action lists)
  with every message through the communication facade (`torch_schedule.ActionSchedule`);
* `replica_loss_weight`: uneven data-parallel shares. DDP and FSDP2 average gradients over the
  replicas, so replica d scales its mean loss by n_d * dp / B (n_d its samples, B the global batch):
  the average of the scaled gradients is the gradient of the global batch's mean loss, as one
  process computes it.

The torch engine (`plait.runtime.torch_worker`) composes them for the plans
`plait.runtime.layout.torch_runs` names; the other plans run on plait's own executors.
"""

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from plait.ir.plan import Plan
from plait.runtime.amp import reduce_dtype
from plait.runtime.comm import Comm, DeviceMesh, Group, RecordedAllGather, RecordedReduceScatter

if TYPE_CHECKING:  # torch's pipelining takes ~0.6 s to import: `apply_pp` imports it where it runs
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

MESH_DIMS = ("pp", "dp", "tp")
_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_mesh(plan: Plan, comm: Comm, device_type: str = "cpu") -> DeviceMesh:
    """The plan's 3D grid as a named DeviceMesh, built by the communication facade (`Comm.build_mesh`:
    its dims are the named, recorded groups "pp", "dp", "tp"); its "tp" dim records every call DTensor
    makes on it (`recorded_pg.RecordedProcessGroup`), and so does its "dp" dim where `replicate` reduces
    the gradients (`replicates`: its all-reduces are torch's own calls on the mesh's group; FSDP2's
    and DDP's go through the facade's hooks on the plain group instead)."""
    recorded = ("tp", "dp") if replicates(plan) else ("tp",)
    comm.build_mesh(device_type, dict(zip(MESH_DIMS, (plan.pp, plan.dp, plan.tp), strict=True)), recorded=recorded)
    return comm.mesh


def replicates(plan: Plan) -> bool:
    """Whether the torch engine's data parallelism of `plan` is `apply_replicate` (ZeRO-0 over
    DTensor-TP parameters: the whole model's, or each pipeline stage's over its replicas) rather
    than DDP or FSDP2."""
    return plan.dp > 1 and plan.tp > 1 and plan.zero == 0


def replica_loss_weight(plan: Plan, replica: int) -> float:
    """What replica `replica` scales its mean loss by so that the replicas' averaged gradients are
    those of the global batch's mean loss (1.0 for even shares)."""
    return plan.samples_per_replica()[replica] * plan.dp / plan.global_batch


def apply_ddp(model: nn.Module, mesh: DeviceMesh, plan: Plan, group: "Group | None" = None,
              dtype: str | None = None) -> DistributedDataParallel:
    """DDP over the "dp" dim with the plan's gradient bucket size; with `group` (the facade's "dp"
    group) its buckets are all-reduced through it (`recorded_allreduce_hook`), in the plan's
    gradient-reduction dtype for the run's compute dtype `dtype` (`amp.reduce_dtype`). The gradients
    are views into the buckets (`gradient_as_bucket_view`): one copy of them, not DDP's default two,
    as the memory model counts them (`plait.cost.memory`: one in-flight bucket beside the gradients)."""
    ddp = DistributedDataParallel(model, process_group=mesh["dp"].get_group(), bucket_cap_mb=plan.grad_bucket_mb,
                                  gradient_as_bucket_view=True)
    if group is not None:
        ddp.register_comm_hook((group, reduce_dtype(plan, dtype)), recorded_allreduce_hook)
    return ddp


def recorded_allreduce_hook(state: "tuple[Group, torch.dtype | None]", bucket: dist.GradBucket
                            ) -> torch.futures.Future[torch.Tensor]:
    """DDP's all-reduce of one gradient bucket (the mean over the replicas, as DDP's default hook)
    through the facade: started as the bucket fills and returned as a future, so DDP overlaps it
    with the rest of the backward as with its own hook; recorded in comm/rankN.jsonl with t_end at
    its completion, slowed by link faults (`Group.all_reduce_async`). `state`: (the facade group, the
    wire dtype or None); with a wire dtype the bucket crosses the wire in it, divided before the sum as torch's `fp16_compress_hook` / `bf16_compress_hook`
    do (so an fp16 sum does not overflow where the mean would not)."""
    group, dtype = state
    flat = bucket.buffer()
    size = group.size
    wire = flat if dtype is None or dtype == flat.dtype else flat.to(dtype).div_(size)
    fut = group.all_reduce_async(wire, f"allreduce dp bucket{bucket.index()}", "comm_dp")

    def mean(f: torch.futures.Future[Any]) -> torch.Tensor:
        f.value()  # a failed all-reduce raises into DDP (an injected skip completes with None)
        return flat.div_(size) if wire is flat else flat.copy_(wire)

    return fut.then(mean)


def mixed_precision(plan: Plan, dtype: str | None = None) -> MixedPrecisionPolicy:
    """FSDP2's policy: parameters gathered and computed in `dtype` (the run's; default the plan's),
    gradients reduced in the plan's gradient-reduction dtype for it (`amp.reduce_dtype`: the plan's
    `grad_reduce_dtype`, else Megatron-LM's default -- fp16 for fp16, fp32 otherwise)."""
    return MixedPrecisionPolicy(param_dtype=_DTYPES[dtype or plan.dtype],
                                reduce_dtype=reduce_dtype(plan, dtype) or torch.float32)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, plan: Plan, blocks: Iterable[nn.Module],
               group: "Group | None" = None, dtype: str | None = None, root: str = "root",
               names: dict[int, str] | None = None) -> nn.Module:
    """FSDP2 over the "dp" dim: each block a unit of its own (its parameters gathered and its
    gradients reduce-scattered together), then the root for what the blocks leave. With `group`
    (the facade's "dp" group) every unit's all-gathers and reduce-scatters go through it
    (`comm.RecordedAllGather`, `comm.RecordedReduceScatter`: recorded, slowed by link faults; a
    block by its name in `model` or `names` (id of the block -> name), the root as `root`). A pipeline stage's module is sharded over
    its stage's replicas the same way (the mesh's "dp" dim holds the ranks of this rank's stage)."""
    kwargs = {"mesh": mesh["dp"], "reshard_after_forward": plan.zero >= 3, "mp_policy": mixed_precision(plan, dtype)}
    names = names or {id(m): n for n, m in model.named_modules()}
    units = []
    for block in blocks:
        fully_shard(block, **kwargs)
        units.append((names[id(block)], block))
    fully_shard(model, **kwargs)
    units.append((root, model))
    if group is not None:
        for name, unit in units:
            unit.set_custom_all_gather(RecordedAllGather(group, name))  # type: ignore[operator]
            unit.set_custom_reduce_scatter(RecordedReduceScatter(group, name))  # type: ignore[operator]
    return model


def apply_replicate(model: nn.Module, mesh: DeviceMesh, plan: Plan, blocks: Iterable[nn.Module],
                    dtype: str | None = None) -> nn.Module:
    """Plain data parallelism over the "dp" dim with torch's FSDP2-based `replicate` (torchtitan's
    DDP for DTensor models): every parameter whole on each replica (a DTensor-TP one keeps its tp
    cut: (Replicate() over dp, Shard(d) over tp)), each block a unit whose gradients are all-reduced
    (the mean over the replicas, in the plan's gradient-reduction dtype) as its backward ends, then
    the root for the rest. The all-reduces are torch's own calls on the mesh's "dp" group,
    recorded there (`build_mesh`: a `recorded_pg.RecordedProcessGroup`, one record per unit). As
    FSDP2's, `set_requires_gradient_sync(False)` accumulates micro-batches' gradients locally. A pipeline
    stage's DTensor-TP module is replicated over its stage's replicas the same way (`torch_worker._build_pipeline`)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    kwargs = {"mesh": mesh["dp"], "mp_policy": mixed_precision(plan, dtype)}
    for block in blocks:
        replicate(block, **kwargs)
    replicate(model, **kwargs)
    return model


def seq_dim_of(layers: Iterable[tuple[str, nn.Module]]) -> int:
    """The sequence dimension of the activations between `layers` (the zoo's and Megatron's
    [s, b, h]: 0; a layer may name another with `plait_seq_dim`, as plait's own engine reads it)."""
    return next((int(getattr(m, "plait_seq_dim", 0)) for _, m in layers), 0)


def sequence_parallel_regions(layer: nn.Module) -> list[str]:
    """The submodules of a tensor-parallel layer that its column-parallel linears read their input
    in (each column linear's parent: the zoo's `attn`, `mlp`), by name in `layer`, outermost first.
    Sequence parallelism all-gathers each one's input along the sequence (`apply_tp`)."""
    regions: list[str] = []
    for sub, m in layer.named_modules():
        if isinstance(m, nn.Linear) and getattr(m, "plait_tp", None) == "column":
            parent = sub.rsplit(".", 1)[0] if "." in sub else ""
            if parent not in regions:
                regions.append(parent)
    return regions


def sequence_parallel_norms(layer: nn.Module, regions: Iterable[str]) -> list[str]:
    """The modules of a tensor-parallel layer outside its `regions` that hold parameters (its layer
    norms: `SequenceParallel` runs them on this rank's part of the sequence), by name in `layer`."""
    inside = tuple(f"{r}." for r in regions)
    return [sub for sub, m in layer.named_modules()
            if sub and not sub.startswith(inside) and sub not in regions
            and any(True for _ in m.parameters(recurse=False))]


def apply_tp(model: nn.Module, mesh: DeviceMesh, layers: Iterable[tuple[str, nn.Module]],
             sequence_parallel: bool = False, order: Sequence[str] | None = None,
             region_layers: Iterable[str] | None = None) -> list[str]:
    """Tensor parallelism with DTensor over the "tp" dim, Megatron's layout in torch's styles: in each
    of `layers` (qualified name, module: the transformer layers, `tensor_parallel.is_tensor_parallel_layer`)
    the linears the model marks `plait_tp="column"` are `ColwiseParallel` (output features sharded;
    a QKV projection's features are ordered by head, so each rank holds whole heads) and those marked
    "row" `RowwiseParallel` (input features sharded, outputs all-reduced). Local outputs
    (`use_local_output`), so the layer's own code between them (head reshapes, activations) runs on
    this rank's shard unchanged. Returns the parallelised linears' names.

    `sequence_parallel` (Megatron's, Korthikanti et al. 2022; torchtitan's styles): between the
    tensor-parallel regions each rank holds its part of the sequence (dim `seq_dim_of(layers)`): the
    layer norms are `SequenceParallel` (parameters replicated, run on the shard: their gradients come
    out `Partial`, the caller sums them over "tp"), each region a column linear reads its input in
    (`sequence_parallel_regions`: attention, MLP) all-gathers it (`PrepareModuleInput`, Shard ->
    Replicate; backward reduce-scatter), the row linears reduce-scatter their outputs
    (`RowwiseParallel(output_layouts=Shard)`; backward all-gather), so the residual stream between
    them is this rank's sequence shard. A run of consecutive tensor-parallel layers in `order` (the
    model's layers in execution order; default: `layers` are one run) is one region, as on plait's own
    engine: its first layer takes its part of the replicated input (no communication; backward
    all-gathers), its last all-gathers its output for what follows replicated (the embedding and the
    LM head stay whole on every rank; backward keeps this rank's part). `region_layers`: the
    tensor-parallel layers of the whole model (default: `layers`) -- a pipeline stage's `layers` are
    its own, and a region runs on across the pipeline's cuts, so a stage's boundary values are this
    rank's part of the sequence (as on plait's own engine and in Megatron)."""
    layers = list(layers)
    seq = Shard(seq_dim_of(layers))
    styles: dict[str, ParallelStyle] = {}
    for name, layer in layers:
        for sub, m in layer.named_modules():
            kind = getattr(m, "plait_tp", None)
            if isinstance(m, nn.Linear) and kind == "column":
                styles[f"{name}.{sub}"] = ColwiseParallel()
            elif isinstance(m, nn.Linear) and kind == "row":
                styles[f"{name}.{sub}"] = RowwiseParallel(output_layouts=seq) if sequence_parallel \
                    else RowwiseParallel()
    linears = sorted(styles)
    names = [n for n, _ in layers]
    order = list(order) if order is not None else names
    if sequence_parallel:
        for name, layer in layers:
            regions = sequence_parallel_regions(layer)
            for region in regions:
                styles[f"{name}.{region}"] = PrepareModuleInput(input_layouts=(seq,),
                                                                desired_input_layouts=(Replicate(),))
            for norm in sequence_parallel_norms(layer, regions):
                # local outputs: the residual stream stays plain tensors (a post-LN layer adds its
                # norm's output to a region's)
                styles[f"{name}.{norm}"] = SequenceParallel(sequence_dim=seq.dim, use_local_output=True)
    # every rank built the same seeded model: each takes its own shard, no scatter from rank 0
    parallelize_module(model, mesh["tp"], styles, src_data_rank=None)
    if sequence_parallel:  # the regions' boundaries
        tp_names = set(region_layers) if region_layers is not None else set(names)
        for name, layer in layers:
            k = order.index(name)
            if not (k > 0 and order[k - 1] in tp_names):  # enter: this rank's part of the sequence
                parallelize_module(layer, mesh["tp"], PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(seq,), use_local_output=True))
            if not (k + 1 < len(order) and order[k + 1] in tp_names):  # leave: the whole sequence
                parallelize_module(layer, mesh["tp"], PrepareModuleOutput(
                    output_layouts=(seq,), desired_output_layouts=(Replicate(),), use_local_output=True))
    return linears


def apply_ac(layers: Iterable[nn.Module], recompute: str) -> list[nn.Module]:
    """Activation checkpointing as the plan's `recompute` names it, with the cost model's meaning
    (`plait.cost.compute.recompute_flops`): "full" re-runs each layer's forward in backward;
    "selective" only the attention core (Korthikanti et al. 2022, sec. 4.2), the modules the zoo
    marks `plait_selective`; "none" nothing. The forward is wrapped in place (torch's non-reentrant
    checkpoint), so parameter names stay as they are. Returns the checkpointed modules."""
    layers = list(layers)
    if recompute == "none":
        return []
    if recompute == "full":
        targets = layers
    else:
        targets = [m for layer in layers for m in layer.modules() if getattr(m, "plait_selective", False)]
    for m in targets:
        m.forward = partial(torch.utils.checkpoint.checkpoint, m.forward, use_reentrant=False)
    return targets


def apply_pp(modules: dict[int, nn.Module], mesh: DeviceMesh, plan: Plan, device: torch.device,
             loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], micro_batches: int, comm: Comm,
             stage_type: "Callable[..., PipelineStage] | None" = None) -> "PipelineScheduleMulti":
    """The rank's pipeline on torch's pipelining over the mesh's "pp" dim: `modules` are its model
    pieces by global stage index (Megatron's interleaved layout, as torch's: stage k on pipeline
    rank k % pp), each wrapped in `stage_type` (`PipelineStage` or a subclass), run over
    `micro_batches` micro-batches per step in the order of plait's schedule for `plan.schedule`
    (`torch_schedule.ActionSchedule`: the caller sets each step's action list), every message
    through the communication facade `comm`.

    `loss_fn` is the loss of one micro-batch as the caller wants it back-propagated (weighted by
    its share of the global batch): torch does not rescale the gradients (`scale_grads=False`), so
    they are the gradients of the global batch's mean loss, as one process computes them."""
    from torch.distributed.pipelining import PipelineStage

    from plait.runtime.torch_schedule import action_schedule_type

    stage_type = stage_type or PipelineStage
    num_stages = plan.pp * plan.virtual_stages
    group = mesh["pp"].get_group()
    stages = [stage_type(m, index, num_stages, device, group=group) for index, m in sorted(modules.items())]
    pp = plan.pp
    # Megatron's blocking p2p for 1F1B and GPipe, as plait's executor and the simulator
    blocking = plan.schedule in ("1f1b", "gpipe") and plan.virtual_stages == 1
    return action_schedule_type()(stages, micro_batches, loss_fn=loss_fn, comm=comm,
                                  stage_of=lambda p, c: c * pp + p, blocking=blocking)
