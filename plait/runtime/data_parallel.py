"""Gradient reduction and the optimizer step across data-parallel replicas.

Every replica's loss is already scaled by its share of the global batch (see
`plait.runtime.executor`), so a SUM all-reduce of gradients gives the full-batch
mean gradient even when replicas hold uneven numbers of samples (HAP §4).

* ZeRO-0: gradients are all-reduced after the backward in flat buckets of the plan's
  `grad_bucket_mb` (25 MiB by default, DDP's; 0: one bucket), and every
  replica runs the full optimizer.
* ZeRO-1 (Rajbhandari et al. 2020, P_os): parameters of the rank are flattened and cut
  into dp equal shards; gradients are reduce-scattered so rank d gets the summed
  gradient of shard d, it keeps optimizer state for that shard only, updates it, and
  the shards are all-gathered back into the parameters. Same bytes on the wire as an
  all-reduce, optimizer memory / dp. zero >= 2 runs the same step and frees the full
  gradients right after the reduce-scatter (so they do not live across steps).
* ZeRO-3 (parameters sharded too, gathered per layer) is `plait.runtime.zero3.Zero3Step`.

With fp16 a `DynamicLossScaler` unscales the *reduced* gradients (under ZeRO: this rank's
shard) and agrees on inf/nan with every rank of the job before the optimizer; on overflow
the whole job skips the update (`step()` returns False) and, under ZeRO, the parameter
all-gather too, since no shard changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.runtime.amp import DynamicLossScaler
from plait.runtime.clip import GradClipper
from plait.runtime.comm import Group
from plait.runtime.recorder import Recorder
from plait.runtime.sharded_state import Segment


def make_optimizer(params: list[torch.Tensor], cfg: dict[str, Any]) -> torch.optim.Optimizer:
    """The optimizer named in `cfg` ({"name": "adamw"|"adam"|"sgd", "lr", "weight_decay", ...})."""
    name = cfg.get("name", "adamw").lower()
    lr = float(cfg.get("lr", 1e-3))
    wd = float(cfg.get("weight_decay", 0.0))
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd, betas=tuple(cfg.get("betas", (0.9, 0.999))),
                                 eps=float(cfg.get("eps", 1e-8)), foreach=False)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=wd, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=wd, momentum=float(cfg.get("momentum", 0.0)),
                               foreach=False)
    raise ValueError(f"optimizer: unknown name {name!r}; use adamw, adam or sgd")


def _flat_grads(params: list[nn.Parameter], pad_to: int | None = None) -> torch.Tensor:
    parts = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
             for p in params]
    flat = torch.cat(parts) if parts else torch.zeros(0)
    if pad_to is not None and pad_to > flat.numel():
        flat = torch.cat([flat, flat.new_zeros(pad_to - flat.numel())])
    return flat


def _scatter_back(flat: torch.Tensor, params: list[nn.Parameter], attr: str) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        chunk = flat[offset:offset + n].view_as(p)
        if attr == "grad":
            if p.grad is None:
                p.grad = chunk.clone()
            else:
                p.grad.copy_(chunk)
        else:
            p.data.copy_(chunk)
        offset += n


def sync_tied_grads(tied: list[tuple[list[nn.Parameter], Group]], dtype: torch.dtype | None = None) -> None:
    """Sum the gradients of parameters shared by several pipeline stages (tied embeddings):
    each stage holds a copy and they must take the same step (Megatron's embedding group), in the
    gradient-reduction dtype `dtype` (None: fp32)."""
    for params, group in tied:
        flat = _flat_grads(params)
        group.all_reduce(flat, "allreduce tied", "comm_dp", dtype=dtype)
        _scatter_back(flat, params, "grad")


class DataParallelStep:
    """Gradient all-reduce (ZeRO-0) + the full optimizer on every replica; the gradients cross the
    wire in `reduce_dtype` (`amp.reduce_dtype`; None: fp32)."""

    def __init__(self, params: list[nn.Parameter], make_opt: Callable[[list[Any]], torch.optim.Optimizer],
                 group: Group | None, size: int, rec: Recorder, bucket_bytes: int = 25 << 20,
                 scaler: DynamicLossScaler | None = None, reduce_dtype: torch.dtype | None = None) -> None:
        self.params = params
        self.reduce_dtype = reduce_dtype
        self.scaler = scaler
        self.group = group
        self.size = size
        self.rec = rec
        self.optimizer = make_opt(params)
        self.clip: GradClipper | None = None  # global gradient-norm clipping (plait.runtime.clip)
        self.buckets: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        size_bytes = 0
        for p in reversed(params):  # backward produces the last layers' gradients first
            current.append(p)
            size_bytes += p.numel() * p.element_size()
            if bucket_bytes and size_bytes >= bucket_bytes:  # 0: one bucket of everything
                self.buckets.append(current)
                current, size_bytes = [], 0
        if current:
            self.buckets.append(current)

    def reduce(self) -> None:
        if self.size == 1:
            return
        assert self.group is not None
        for i, bucket in enumerate(self.buckets):
            flat = _flat_grads(bucket)
            self.group.all_reduce(flat, f"allreduce dp bucket{i}", "comm_dp", dtype=self.reduce_dtype)
            _scatter_back(flat, bucket, "grad")

    def step(self) -> bool:
        """Reduce, (unscale and check,) update; False when the update was skipped for inf/nan."""
        self.reduce()
        if self.scaler is not None:
            grads = [p.grad for p in self.params if p.grad is not None]
            if self.scaler.unscale_and_check(grads):
                self.optimizer.zero_grad(set_to_none=True)
                return False
        if self.clip is not None:  # replicas hold identical reduced gradients: each counts 1/dp
            self.clip.clip_params(self.params, self.size)
        with self.rec.compute("optimizer", "optimizer"):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def param_segments(self) -> list[Segment]:
        """Where the parameters live (for checkpoints): each one whole."""
        return [Segment(p, [p], 0) for p in self.params]

    def optimizer_segments(self) -> list[Segment]:
        """The tensors the optimizer steps, as parameter ranges: the parameters themselves."""
        return self.param_segments()


class Zero1Step:
    """ZeRO-1: reduce-scatter gradients (in `reduce_dtype`, None: fp32), optimizer on this rank's
    shard, all-gather parameters."""

    def __init__(self, params: list[nn.Parameter], make_opt: Callable[[list[Any]], torch.optim.Optimizer],
                 group: Group | None, size: int, rank: int, rec: Recorder, free_grads: bool = False,
                 scaler: DynamicLossScaler | None = None, reduce_dtype: torch.dtype | None = None) -> None:
        self.params = params
        self.reduce_dtype = reduce_dtype
        self.scaler = scaler
        self.group = group
        self.size = size
        self.rank = rank
        self.rec = rec
        self.free_grads = free_grads
        total = sum(p.numel() for p in params)
        self.shard = -(-total // size) if total else 0
        self.padded = self.shard * size
        device = params[0].device if params else torch.device("cpu")
        dtype = params[0].dtype if params else torch.float32
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)
            flat = torch.cat([flat, flat.new_zeros(self.padded - total)]).to(device=device, dtype=dtype)
        self.master = nn.Parameter(flat[rank * self.shard:(rank + 1) * self.shard].clone())
        self.optimizer = make_opt([self.master])
        self.clip: GradClipper | None = None  # global gradient-norm clipping (plait.runtime.clip)

    def step(self) -> bool:
        """Reduce-scatter, (unscale and check,) update the shard, all-gather; False when skipped."""
        flat = _flat_grads(self.params, self.padded)
        grad_shard = flat.new_empty(self.shard)
        if self.size > 1:
            assert self.group is not None
            self.group.reduce_scatter(grad_shard, flat, "reducescatter dp grads", "comm_dp", dtype=self.reduce_dtype)
        else:
            grad_shard.copy_(flat)
        if self.free_grads:
            for p in self.params:
                p.grad = None
        if self.scaler is not None and self.scaler.unscale_and_check([grad_shard]):
            for p in self.params:  # every rank skips: no shard changed, nothing to all-gather
                p.grad = None
            return False
        if self.clip is not None:  # disjoint shards
            lo = self.rank * self.shard
            self.clip.clip_flat([(grad_shard, self.clip.flat_weights(self.params, self.padded, lo, lo + self.shard))])
        self.master.grad = grad_shard
        with self.rec.compute("optimizer", "optimizer", shard=self.shard):
            self.optimizer.step()
        self.master.grad = None
        full = flat.new_empty(self.padded)
        if self.size > 1:
            assert self.group is not None
            self.group.all_gather_into(full, self.master.detach(), "allgather zero params", "comm_zero")
        else:
            full.copy_(self.master.detach())
        with torch.no_grad():
            _scatter_back(full, self.params, "data")
        for p in self.params:
            p.grad = None
        return True

    def param_segments(self) -> list[Segment]:
        """Where the parameters live (for checkpoints): each one whole, on every replica."""
        return [Segment(p, [p], 0) for p in self.params]

    def optimizer_segments(self) -> list[Segment]:
        """The optimizer steps this rank's slice [rank*shard, (rank+1)*shard) of the flat parameters."""
        return [Segment(self.master, self.params, self.rank * self.shard)]

    def sync_master_from_params(self) -> None:
        """After the parameters were loaded: the master shard is this rank's slice of them (after
        every step it equals it bit for bit: the parameters are the all-gather of the masters)."""
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in self.params]) if self.params else self.master.new_zeros(0)
            piece = flat[self.rank * self.shard:(self.rank + 1) * self.shard]
            self.master.zero_()
            self.master[:piece.numel()].copy_(piece)
