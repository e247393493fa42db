"""ZeRO-3 (Rajbhandari et al. 2020, P_os+g+p): parameters, gradients and optimizer state sharded over
the data-parallel group, written with module hooks (FSDP1's flat-parameter design, Zhao et al. 2023).

Units: every layer of the stage (`partition.layer_modules`: embedding, each transformer block,
head) is one unit; a parameter used by several layers (the tied embedding / LM head) or by none
belongs to the *root* unit. Each unit's parameters are laid out in one flat buffer of
ceil(numel / dp) * dp elements; rank d keeps only slice d of it (`shard`, the fp32 master the
optimizer updates). The parameters themselves are views into the flat buffer, whose storage is
resized to 0 while the unit is not in use (the autograd graph keeps referring to the same storage,
so re-gathering into it before the backward makes the saved weights valid again).

Per micro-batch, for each unit in forward order: all-gather before its forward, free after it.
In the backward (pre-backward hook on the unit's outputs): all-gather again, and once the last of
its parameter gradients has been accumulated, reduce-scatter the flat gradient (SUM: the loss of
each micro-batch is already scaled by n_j / B, so the sum over micro-batches and replicas is the
sample-weighted mean gradient for uneven dp_shares too) and add rank d's slice to its shard
gradient; the full gradient and the gathered parameters are freed at once. The root unit is
gathered once per step and reduce-scattered after the last micro-batch (FSDP's root behaviour:
the tied embedding is needed by the first and the last layer of every micro-batch).

Uneven dp_shares give replicas different numbers of micro-batches, but every collective needs
every replica: a replica with fewer micro-batches pads with *ghost rounds* that issue exactly the
collective sequence of one micro-batch (gathers discarded, zero gradients reduce-scattered). The
sequence of a real micro-batch is recorded and checked against that order, so a model whose
backward reduces in another order fails loudly instead of deadlocking. The simulator's names are
used for the spans: "comm_zero" for the per-layer all-gathers and reduce-scatters
(`plait.sim.lowering.tensor_parallel._zero3_collective`, one per unit and pass as here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.runtime.amp import DynamicLossScaler
from plait.runtime.clip import GradClipper
from plait.runtime.comm import Group
from plait.runtime.data_parallel import _flat_grads, _scatter_back
from plait.runtime.recorder import Recorder
from plait.runtime.sharded_state import Segment


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, list | tuple):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


class _Unit:
    """One layer's parameters as a flat buffer sharded over the data-parallel group."""

    def __init__(self, index: int, name: str, params: list[nn.Parameter], size: int, rank: int,
                 sp_ids: set[int]) -> None:
        self.index = index
        self.name = name or "root"
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.shard = -(-self.numel // size)
        self.padded = self.shard * size
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise RuntimeError(f"ZeRO-3 unit {self.name}: parameters of mixed dtypes/devices {dtypes} {devices}")
        self.dtype, self.device = dtypes.pop(), devices.pop()
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            flat = torch.cat([flat, flat.new_zeros(self.padded - self.numel)])
        self.shard_param = nn.Parameter(flat[rank * self.shard:(rank + 1) * self.shard].clone())
        self.full = flat  # the parameters become views of it; its storage is freed while unused
        offset = 0
        for p in params:
            p.data = self.full[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.sp_params = [p for p in params if id(p) in sp_ids]
        self.gathered = True
        self.pending = False  # gathered for a backward whose gradients are not reduced yet
        self.count = 0  # parameter gradients accumulated in the current backward
        self.expected = sum(p.requires_grad for p in params)

    @property
    def nbytes(self) -> int:
        return self.padded * self.full.element_size()

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.gathered = False


class Zero3Step:
    """ZeRO-3 over `group` for the units of `module`; the optimizer steps on the shards only.

    Call `begin_step()` before the step's first forward, `ghost_rounds(n)` after the step's
    micro-batches when this replica ran n fewer than the largest one, then `step()`."""

    def __init__(self, module: nn.Module, layers: list[tuple[str, nn.Module]],
                 make_opt: Callable[[list[Any]], torch.optim.Optimizer], group: Group | None, size: int, rank: int,
                 rec: Recorder, scaler: DynamicLossScaler | None = None, tp_group: Group | None = None,
                 sp_params: list[nn.Parameter] | None = None, reduce_dtype: torch.dtype | None = None) -> None:
        self.reduce_dtype = reduce_dtype  # the gradients' reduce-scatter dtype (None: fp32)
        self.group, self.size, self.rank, self.rec, self.scaler = group, size, rank, rec, scaler
        self.tp_group = tp_group
        sp_ids = {id(p) for p in sp_params or []}
        users: dict[int, int] = {}
        per_layer: list[tuple[str, nn.Module, list[nn.Parameter]]] = []
        for name, mod in layers:
            ps = [p for p in mod.parameters() if p.requires_grad]
            per_layer.append((name, mod, ps))
            for p in ps:
                users[id(p)] = users.get(id(p), 0) + 1
        self.units: list[_Unit] = []
        for name, mod, ps in per_layer:
            own = [p for p in ps if users[id(p)] == 1]
            if not own:
                continue
            unit = _Unit(len(self.units), name, own, size, rank, sp_ids)
            self.units.append(unit)
            mod.register_forward_pre_hook(lambda m, a, u=unit: self._pre_forward(u))
            mod.register_forward_hook(lambda m, a, out, u=unit: self._post_forward(u, out))
            for p in own:
                p.register_post_accumulate_grad_hook(lambda p, u=unit: self._grad_ready(u))
        root = [p for p in module.parameters() if p.requires_grad and users.get(id(p), 0) != 1]
        self.root = _Unit(len(self.units), "root", root, size, rank, sp_ids) if root else None
        for u in self.all_units:
            u.free()
        self.optimizer = make_opt([u.shard_param for u in self.all_units])
        self.clip: GradClipper | None = None  # global gradient-norm clipping (plait.runtime.clip)
        self._callback_queued = False
        self.sequence: list[tuple[str, int]] = []  # the per-micro-batch collectives of this step
        self.expected_round = [("ag", u.index) for u in self.units] + \
            [x for u in reversed(self.units) for x in (("ag", u.index), ("rs", u.index))]

    @property
    def all_units(self) -> list[_Unit]:
        return self.units + ([self.root] if self.root is not None else [])

    # ------------------------------------------------------------------ collectives
    def _gather(self, u: _Unit, record: bool = True, span: bool = True) -> None:
        u.full.untyped_storage().resize_(u.nbytes)
        with torch.no_grad():
            if self.size > 1:  # span=False: outside the measured steps (recorded, no Timeline span)
                assert self.group is not None
                self.group.all_gather_into(u.full, u.shard_param.detach(), f"allgather zero params {u.name}",
                                           "comm_zero", span=span)
            else:
                u.full.copy_(u.shard_param.detach())
        u.gathered = True
        if record:
            self.sequence.append(("ag", u.index))

    def _reduce_scatter(self, u: _Unit, flat: torch.Tensor | None = None, record: bool = True) -> None:
        """Sum the unit's flat gradient over the group, keep this rank's slice, free the full gradient."""
        with torch.no_grad():
            if flat is None:
                if u.sp_params and self.tp_group is not None:
                    # Sequence-parallel LayerNorms/biases saw 1/tp of the tokens: sum over the tensor group
                    # first (Korthikanti et al. 2022, §4.2.2), per layer since the gradient leaves now.
                    sp = _flat_grads(u.sp_params)
                    self.tp_group.all_reduce(sp, f"allreduce tp sp-grads {u.name}", "comm_tp")
                    _scatter_back(sp, u.sp_params, "grad")
                flat = _flat_grads(u.params, u.padded)
            out = flat.new_empty(u.shard)
            if self.size > 1:
                assert self.group is not None
                self.group.reduce_scatter(out, flat, f"reducescatter zero grads {u.name}", "comm_zero",
                                          dtype=self.reduce_dtype)
            else:
                out.copy_(flat)
            g = u.shard_param.grad
            if g is None:
                u.shard_param.grad = out
            else:
                g.add_(out)
        for p in u.params:
            p.grad = None
        u.pending = False
        u.free()
        if record:
            self.sequence.append(("rs", u.index))

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, u: _Unit) -> None:
        if not u.gathered:
            self._gather(u)

    def _post_forward(self, u: _Unit, out: Any) -> None:
        tensors = _tensors(out) if torch.is_grad_enabled() else []
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads, u=u: self._pre_backward(u),
                                                          mode="any")
        if not u.pending:  # not when a recomputation inside the backward re-enters the layer
            u.free()

    def _pre_backward(self, u: _Unit) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._callback_queued = True
        # Layers after u whose gradients are complete but not yet reduced (a parameter without a
        # gradient): reduce them now, so the order of collectives is the same on every rank.
        for v in reversed(self.units[u.index + 1:]):
            if v.pending:
                self._reduce_scatter(v)
        if not u.gathered:
            self._gather(u)
        u.pending = True
        u.count = 0

    def _grad_ready(self, u: _Unit) -> None:
        if not u.pending:
            return
        u.count += 1
        if u.count == u.expected:
            self._reduce_scatter(u)

    def _end_backward(self) -> None:
        self._callback_queued = False
        for v in reversed(self.units):
            if v.pending:
                self._reduce_scatter(v)

    # ------------------------------------------------------------------ step
    def begin_step(self) -> None:
        self.sequence = []
        if self.root is not None and not self.root.gathered:
            self._gather(self.root, record=False)

    def ghost_rounds(self, n: int, real: int) -> None:
        """Join `n` micro-batches' collectives of the replicas that run more micro-batches than this
        one (`real`): the same gathers and reduce-scatters, with zero gradients."""
        if n <= 0 or self.size == 1:
            return
        if real and self.sequence != self.expected_round * real:
            raise RuntimeError("ZeRO-3: a micro-batch's collectives ran in the order "
                               f"{self.sequence[:len(self.expected_round)]}, not the per-layer order "
                               f"{self.expected_round}; uneven dp_shares cannot be padded for this model")
        for _ in range(n):
            for u in self.units:
                self._gather(u, record=False)
                u.free()
            for u in reversed(self.units):
                self._gather(u, record=False)
                self._reduce_scatter(u, torch.zeros(u.padded, dtype=u.dtype, device=u.device), record=False)

    def step(self) -> bool:
        """Reduce the root's gradients, (unscale and check,) update the shards; False when skipped."""
        self._end_backward()
        if self.root is not None:
            if not self.root.gathered:
                self._gather(self.root, record=False)
            self._reduce_scatter(self.root, record=False)
        shards = [u.shard_param for u in self.all_units]
        grads = [p.grad for p in shards if p.grad is not None]
        if self.scaler is not None and self.scaler.unscale_and_check(grads):
            self.optimizer.zero_grad(set_to_none=True)
            return False
        if self.clip is not None:  # disjoint shards of every unit
            self.clip.clip_flat([(u.shard_param.grad, self.clip.flat_weights(
                u.params, u.padded, self.rank * u.shard, (self.rank + 1) * u.shard))
                for u in self.all_units if u.shard_param.grad is not None])
        with self.rec.compute("optimizer", "optimizer", shard=sum(p.numel() for p in shards)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def gather_all(self) -> None:
        """Materialise every parameter (collective over the group), e.g. to return them after training."""
        for u in self.all_units:
            if not u.gathered:
                self._gather(u, record=False, span=False)

    def resident_param_bytes(self) -> int:
        """Bytes of parameter storage this rank holds now: the shards plus whatever is gathered."""
        return sum(u.shard_param.numel() * u.shard_param.element_size()
                   + u.full.untyped_storage().nbytes() for u in self.all_units)

    def param_segments(self) -> list[Segment]:
        """Where the parameters live (for checkpoints): rank d's slice of each unit's flat buffer."""
        return [Segment(u.shard_param, u.params, self.rank * u.shard) for u in self.all_units]

    def optimizer_segments(self) -> list[Segment]:
        """The optimizer steps the same shards."""
        return self.param_segments()
