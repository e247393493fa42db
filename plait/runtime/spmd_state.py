"""Gradient clipping and checkpoints of an SPMD program's rank (`plait.runtime.spmd_worker`).

A rank of a per-rank SPMD program (`plait.runtime.spmd_program.RankProgram`) keeps one leaf per
parameter: either its rows ``[first, first + n)`` along one dimension (``S<d>``, at the program's
integer shard sizes) or the whole tensor (``R``; tied parameters too). After backward every leaf's
gradient is complete: a sharded leaf's rows are this rank's alone, a replicated leaf's gradient is
the same on every rank (redundant ops compute it whole, sharded readers all-reduce it).

* Clipping (`clip_weights`, `plait.runtime.clip.GradClipper`): the global norm counts each
  logical parameter once -- sharded rows with weight 1 (the shards tile the tensor, so their
  squares sum to the whole), replicated leaves with weight 1/world (one all-reduce over the job
  sums ``world`` identical copies) --, as `torch.nn.utils.clip_grad_norm_` on one device.
* Checkpoints (`checkpoint_layout`, `ProgramCheckpoints` for the SPMD and composed workers): the leaves as rectangles of the *logical* (unsharded)
  parameters, under the single-process model's parameter names, through the DCP checkpoint code
  (`plait.runtime.checkpoint`, `plait.runtime.sharded_state`): a sharded leaf is one chunk along
  its dimension (a `ShardInfo` with one block and the program's sizes), a replicated one is written
  by rank 0. DCP reshards on load, so a resume at other ratios, another program or a pipeline plan
  of the model reads the same parameters and optimizer state.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.ir.program import shard_dim
from plait.runtime import checkpoint as ckpt
from plait.runtime.amp import SCALE_ENV, DynamicLossScaler
from plait.runtime.clip import GradClipper
from plait.runtime.sharded_state import RankLayout, Segment
from plait.runtime.tensor_parallel import ShardInfo
from plait.runtime.worker_config import WorkerConfig

if TYPE_CHECKING:
    from plait.ir.plan import Plan


class SpmdStep:
    """One rank's optimizer over its leaves, each leaf one checkpoint segment (the interface of
    `plait.runtime.data_parallel.DataParallelStep` that checkpoints and clipping read)."""

    def __init__(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        self.params = params
        self.optimizer = optimizer
        self.clip: GradClipper | None = None
        # fp16: the loss was scaled before backward; gradients are unscaled here and the step is
        # skipped on every rank when any rank's has an inf/nan (`plait.runtime.amp`)
        self.scaler: DynamicLossScaler | None = None

    def step(self) -> bool:
        """Unscale (fp16), clip (the global norm over every rank's shards) and step, then drop the
        gradients; False when the job skipped the step (an overflow somewhere)."""
        if self.scaler is not None and self.scaler.unscale_and_check(
                [p.grad for p in self.params if p.grad is not None]):
            self.optimizer.zero_grad(set_to_none=True)
            return False
        if self.clip is not None:
            self.clip.clip_params(self.params, 1)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def param_segments(self) -> list[Segment]:
        return [Segment(p, [p], 0) for p in self.params]

    def optimizer_segments(self) -> list[Segment]:
        return self.param_segments()


def clip_weights(runner: Any, world: int) -> dict[int, float]:
    """id(leaf) -> the weight of its squared gradient elements in the global norm: 1 for a shard,
    1/world for a leaf every rank holds whole (see module docstring)."""
    return {id(leaf): 1.0 if shard_dim(runner.param_placement[path]) is not None else 1.0 / world
            for path, leaf in runner.params.items()}


def make_clipper(runner: Any, world: int, max_norm: float, group: Any) -> GradClipper:
    return GradClipper(max_norm, clip_weights(runner, world), group=group)


class _Leaves:
    """What `RankLayout` reads of a module: the rank's leaves under their checkpoint names, and the
    model's persistent buffers (whole on every rank)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], buffers: dict[str, torch.Tensor]) -> None:
        self.named = named
        self.buffers = buffers

    def named_parameters(self, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self.named)

    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        return dict(self.buffers)


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's persistent buffers by name (views of the live ones: a load writes into them)."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {n: b.detach() for n, b in model.state_dict(keep_vars=True).items()
            if n not in params and isinstance(b, torch.Tensor)}


def checkpoint_layout(runner: Any, step: SpmdStep, aliases: dict[str, str], buffers: dict[str, torch.Tensor],
                      rank: int, written_elsewhere: frozenset[str] = frozenset()) -> RankLayout:
    """The rank's leaves and optimizer state as chunks of the logical parameters (module docstring);
    `aliases`: `plait.runtime.sharded_state.aliases_of(model)` (a tied parameter under its first name);
    `rank`: the rank in the program's group (its rank 0 writes the replicated leaves);
    `written_elsewhere`: keys this rank holds but another group writes (a tied parameter every
    holder stage of a composed plan keeps, written by the first)."""
    tensors = runner.param_paths()
    named: list[tuple[str, nn.Parameter]] = []
    infos: dict[str, ShardInfo] = {}
    for path, leaf in runner.params.items():
        key = aliases.get(path, path)
        named.append((key, leaf))
        d = shard_dim(runner.param_placement[path])
        if d is not None:
            infos[key] = ShardInfo(d, 1, tuple(runner.program.sizes[(tensors[path], d)]))
    return RankLayout(_Leaves(named, buffers), step, infos, rank, {}, set(written_elsewhere))  # type: ignore[arg-type]


class ProgramCheckpoints:
    """Save and resume of a rank that runs SPMD programs (`plait.runtime.spmd_worker`,
    `plait.runtime.compose_worker`), through the one DCP checkpoint code (`plait.runtime.checkpoint`):
    its `layout` (`checkpoint_layout`) with the step and the samples seen. Written under any plan and
    read under any: DCP reshards the logical parameters and optimizer state. The programs' random
    ops draw from (seed, step, op, rank) streams (`spmd_program._op_seed`), so nothing else needs
    restoring. The worker provides `config`, `plan`, `rank`, `world`, `comm`, `hb`, `rec` and `layout`."""

    config: WorkerConfig
    plan: Plan
    rank: int
    world: int
    comm: Any  # plait.runtime.comm.Comm
    hb: Any  # plait.runtime.recorder.Heartbeat
    rec: Any  # plait.runtime.recorder.Recorder
    layout: RankLayout
    sample_base = 0  # samples before step 0 of this run's stream (a resume's offset)
    scaler: DynamicLossScaler | None = None  # fp16's loss scaler (`loss_scaling`)

    def loss_scaling(self, group: Any) -> DynamicLossScaler | None:
        """fp16's dynamic loss scaler, its found-inf flag agreed over `group` (every rank of the
        job); None for other dtypes (bf16 has fp32's exponent range)."""
        if self.config.dtype != "fp16":
            return None
        self.scaler = DynamicLossScaler.from_string(os.environ.get(SCALE_ENV))
        self.scaler.group = group
        self.scales: list[float] = []
        return self.scaler

    def amp_record(self, start: int) -> dict[str, Any] | None:
        """The scaler's figures for the result (`plait.runtime.results.write_result`)."""
        if self.scaler is None:
            return None
        return {"scales": self.scales, "skipped": [s for s in self.scaler.skipped if s >= start],
                "final_scale": self.scaler.scale}

    def _meta(self) -> dict[str, Any]:
        config = self.config
        return {"model": config.model, "plan": str(self.plan), "world_size": self.world,
                "optimizer": config.optimizer, "seed": config.seed, "data_seed": config.data_seed}

    def _maybe_resume(self) -> int:
        """Load the launcher's chosen checkpoint (`resume_from`); returns the step to start at and
        sets `sample_base` so the sample stream continues after the checkpoint's last sample."""
        ck = self.config.checkpoint
        if ck is None or not ck.resume or not ck.resume_from:  # the launcher chose it (None: none to resume)
            return 0
        self.hb.progress("resume")
        train, _ = ckpt.load_into(Path(ck.resume_from), self.layout, self.rank)
        if self.scaler is not None and train.get("amp"):
            self.scaler.load_state_dict(json.loads(train["amp"]))
        step = int(train["step"])
        batch = self.plan.global_batch
        self.sample_base = int(train.get("samples_seen", step * batch)) - step * batch
        return step

    def _save_checkpoint(self, step: int, root: Path) -> None:
        """Collective: every rank's chunks of the logical parameters and optimizer state, with the
        step and the samples seen, as one DCP checkpoint."""
        self.hb.progress("checkpoint")
        plan, ck = self.plan, self.config.checkpoint
        assert ck is not None  # the run saves checkpoints
        train = {"step": step, "samples_seen": self.sample_base + step * plan.global_batch,
                 "plan": str(plan), "world_size": self.world, "format_version": ckpt.FORMAT_VERSION,
                 "lr_schedule": self.config.schedule_record(),
                 "amp": json.dumps(self.scaler.state_dict()) if self.scaler is not None else None}
        state = ckpt.rank_snapshot(self.layout, train, self.rank, {"rng": ckpt.rng_state()})
        with self.rec.waiting("checkpoint"):
            ckpt.save(root, step, state, self._meta(), self.rank, self.world, self.comm,
                      keep=ck.keep)
        self.hb.progress("train")
