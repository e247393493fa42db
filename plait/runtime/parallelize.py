"""A plan's data parallelism on torch's own modules (issue 29), composed as torchtitan's
`parallelize` does: one small function per parallelism over the plan's named DeviceMesh
(dims "pp", "dp", "tp", Megatron's rank order: tensor fastest, then data, then pipeline).

* `apply_ddp`: DDP over the mesh's "dp" dim, buckets of the plan's `grad_bucket_mb`;
* `apply_tp`: DTensor tensor parallelism (`parallelize_module`, colwise / rowwise) over "tp";
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

from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
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
    gradient-reduction dtype for the run's compute dtype `dtype` (`amp.reduce_dtype`)."""
    ddp = DistributedDataParallel(model, process_group=mesh["dp"].get_group(), bucket_cap_mb=plan.grad_bucket_mb)
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


def apply_tp(model: nn.Module, mesh: DeviceMesh, layers: Iterable[tuple[str, nn.Module]]) -> list[str]:
    """Tensor parallelism with DTensor over the "tp" dim, Megatron's layout in torch's styles: in each
    of `layers` (qualified name, module: the transformer layers, `tensor_parallel.is_tensor_parallel_layer`)
    the linears the model marks `plait_tp="column"` are `ColwiseParallel` (output features sharded;
    a QKV projection's features are ordered by head, so each rank holds whole heads) and those marked
    "row" `RowwiseParallel` (input features sharded, outputs all-reduced). Local outputs
    (`use_local_output`), so the layer's own code between them (head reshapes, activations) runs on
    this rank's shard unchanged. Returns the parallelised linears' names."""
    styles: dict[str, ParallelStyle] = {}
    for name, layer in layers:
        for sub, m in layer.named_modules():
            kind = getattr(m, "plait_tp", None)
            if isinstance(m, nn.Linear) and kind in ("column", "row"):
                styles[f"{name}.{sub}"] = ColwiseParallel() if kind == "column" else RowwiseParallel()
    # every rank built the same seeded model: each takes its own shard, no scatter from rank 0
    parallelize_module(model, mesh["tp"], styles, src_data_rank=None)
    return sorted(styles)


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
