"""torch's pipeline stages run by plait's schedules (issue 29): `ActionSchedule` is a
`torch.distributed.pipelining` schedule whose order is one of plait's per-rank action lists
(`plait.schedule`: GPipe, 1F1B, interleaved 1F1B -- the orders the simulator prices and
`plait.schedule.check` proves deadlock-free) and whose messages go through the runtime's
communication facade (`plait.runtime.comm.Comm.p2p`), so every send and receive is a record in
`comm/rankN.jsonl` and injected link faults slow it, as on plait's own executor.

torch's `PipelineStage` keeps what it does well: the stage's module, its receive buffers and
their shapes (its metadata inference on the first step), the forward and backward of one
micro-batch (DDP's no_sync up to a stage's last backward), the loss on the last stage. torch's
own schedules post their sends and receives with `batch_isend_irecv` themselves, past the facade;
here a run of consecutive send/recv actions of plait's list is posted as one batch through
`Comm.p2p` (the tensors of `PipelineStage.get_*_ops`), its receives waited there, its sends at the
end of the run when the schedule is blocking (1F1B, GPipe: Megatron's blocking p2p, as the
simulator models it) or else at the end of the step -- the executor's semantics
(`plait.runtime.executor.PipelineExecutor._exchange`).

torch's one-time setup on the first step (its warm-up vote and shape inference between
neighbouring stages) still uses torch's own p2p: it carries metadata once, before any
micro-batch, and is not a step's traffic.

Micro-batches of several sizes (a replica's uneven share that the micro-batch does not divide):
torch's stages size every receive buffer by the first micro-batch; `set_actions` takes the step's
sizes and each received value's batch dimension (`partition.Stage.batch_dims`), and the buffers
of a micro-batch of another size are re-made to it; `step` cuts the inputs and targets by the
sizes (torch's own cuts them evenly).

torch's pipelining takes ~0.6 s to import: `action_schedule_type` builds the class on first use.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from plait.runtime.comm import P2P, Comm
from plait.schedule import Action

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

_OPS = {"send_fwd": "get_fwd_send_ops", "recv_fwd": "get_fwd_recv_ops",
        "send_bwd": "get_bwd_send_ops", "recv_bwd": "get_bwd_recv_ops"}


@functools.cache
def action_schedule_type() -> type[PipelineScheduleMulti]:
    """The `ActionSchedule` class (module docstring), built on first use."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    class ActionSchedule(PipelineScheduleMulti):
        """torch's stages of this rank run in the order of `actions` (this rank's action list of
        one step; set per step by `set_actions`), each stage the node `stage_of(pipeline rank,
        chunk)` of plait's layout; messages through `comm` (module docstring)."""

        def __init__(self, stages: list[Any], n_microbatches: int, *, loss_fn: Callable[..., Any],
                     comm: Comm, stage_of: Callable[[int, int], int], blocking: bool) -> None:
            super().__init__(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
            self.comm = comm
            self.stage_of = stage_of
            self.blocking = blocking
            self.actions: tuple[Action, ...] = ()
            self.micro_batch = 0  # the micro-batch whose forward runs now (a loss function may read it)
            self.sizes: list[int] = []
            self.batch_dims: dict[int, tuple[list[int], list[int]]] = {}

        def set_actions(self, actions: Sequence[Action], sizes: Sequence[int] = (),
                        batch_dims: dict[int, tuple[list[int], list[int]]] | None = None) -> None:
            """This step's action list; `sizes`, each micro-batch's samples, and `batch_dims`, per
            stage index the batch dimension of each value it receives and of each it sends (whose
            gradients come back), where the sizes differ (module docstring)."""
            _check_actions(actions, self._n_microbatches, self.stage_of)
            self.actions = tuple(actions)
            self.sizes = list(sizes)
            self.batch_dims = batch_dims or {}

        def step(self, *args: Any, target: Any = None, losses: list[Any] | None = None,
                 return_outputs: bool = True, **kwargs: Any) -> Any:
            if len(set(self.sizes)) <= 1:
                return super().step(*args, target=target, losses=losses, return_outputs=return_outputs, **kwargs)
            # as PipelineScheduleMulti.step, the batch cut into micro-batches of `sizes` along dim 0
            for stage in self._stages:
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            pieces = list(zip([sum(self.sizes[:i]) for i in range(len(self.sizes))], self.sizes, strict=True))
            arg_mbs = [tuple(_cut(a, lo, n) for a in args) for lo, n in pieces]
            kwarg_mbs = [{k: _cut(v, lo, n) for k, v in kwargs.items()} for lo, n in pieces]
            targets = None if target is None else [_cut(target, lo, n) for lo, n in pieces]
            self._step_microbatches(arg_mbs, kwarg_mbs, targets, losses, return_outputs)
            return None

        def _step_microbatches(self, arg_mbs: list[Any] | None = None, kwarg_mbs: list[Any] | None = None,
                               target_mbs: list[Any] | None = None, losses: list[Any] | None = None,
                               return_outputs: bool = True, loss_kwargs: dict[str, Any] | None = None) -> None:
            arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
            self._initialize_stages(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None,
                                    loss_kwargs)
            if len(set(self.sizes)) > 1:
                for st in self._stages:
                    _fit_buffers(st, self.sizes, self.batch_dims.get(st.stage_index, ([], [])))
            stages = {st.stage_index: st for st in self._stages}
            backwards: Counter[int] = Counter()
            pending: list[Any] = []
            acts = self.actions
            k = 0
            while k < len(acts):
                a = acts[k]
                if a.is_compute:
                    stage = stages[self.stage_of(a.stage, a.chunk)]
                    mb = a.micro_batch
                    if a.op == "fwd":
                        self.micro_batch = mb
                        out = stage.forward_one_chunk(mb, arg_mbs[mb], kwarg_mbs[mb],
                                                      save_forward_output=return_outputs)
                        self._maybe_compute_loss(stage, out, target_mbs, mb, loss_kwargs)
                    else:
                        backwards[stage.stage_index] += 1
                        last = backwards[stage.stage_index] == self._n_microbatches
                        # DDP under the stage (FSDP2 at ZeRO-1/2: torch_worker's stage) reduces its gradients in
                        # the stage's last backward
                        stage.backward_one_chunk(mb, loss=self._maybe_get_loss(stage, mb), full_backward=True,
                                                 last_backward=last)
                    k += 1
                    continue
                j = k
                while j < len(acts) and not acts[j].is_compute:
                    j += 1
                pending += self._exchange(acts[k:j], stages)
                if self.blocking:
                    self.comm.wait(pending)
                    pending = []
                k = j
            self.comm.wait(pending)
            self._update_losses(self._stages, losses)

        def _exchange(self, group: Sequence[Action], stages: dict[int, Any]) -> list[Any]:
            """One run of send/recv actions as one batch through the facade, sends first (each
            tensor keyed by its action); the receives are waited, the sends' works returned."""
            sends: list[P2P] = []
            recvs: list[P2P] = []
            for a in group:
                stage = stages[self.stage_of(a.stage, a.chunk)]
                for op in getattr(stage, _OPS[a.op])(a.micro_batch):
                    one = P2P.of_torch(op, a.key)
                    (sends if one.kind == "send" else recvs).append(one)
            lead = group[0]
            return self.comm.p2p(sends + recvs, lead.key, "comm_pp", lead.micro_batch, chunk=lead.chunk,
                                 wait_sends=False, peer=str(lead.peer), batch=[str(x) for x in group],
                                 sent=sum(o.tensor.numel() * o.tensor.element_size() for o in sends))

    return ActionSchedule


def _check_actions(actions: Sequence[Action], micro_batches: int, stage_of: Callable[[int, int], int]) -> None:
    """Every stage of the list runs the forward and the backward of each micro-batch once."""
    computes = [a for a in actions if a.is_compute]
    for op in ("fwd", "bwd"):
        for index in {stage_of(a.stage, a.chunk) for a in computes}:
            mbs = sorted(a.micro_batch for a in computes if a.op == op and stage_of(a.stage, a.chunk) == index)
            if mbs != list(range(micro_batches)):
                raise ValueError(f"stage {index}: the action list runs {op} of micro-batches {mbs}, "
                                 f"the schedule has {micro_batches}")


def _cut(value: Any, lo: int, n: int) -> Any:
    """Samples [lo, lo + n) of a batch value (dim 0, `partition.make_samples`); constants whole."""
    return value.narrow(0, lo, n) if isinstance(value, torch.Tensor) and value.dim() > 0 else value


def _fit_buffers(stage: Any, sizes: list[int], dims: tuple[list[int], list[int]]) -> None:
    """A stage's receive buffers of each micro-batch sized to it along each value's batch dimension
    (`dims`: of the values it receives, of those it sends -- their gradients come back); torch made
    them all for the first micro-batch's size."""
    dims_in, dims_out = dims
    for i, n in enumerate(sizes):
        received = [x for x in stage.args_recv_info[i] if not x.is_root_arg]
        for info, d in zip(received, dims_in, strict=True):
            _fit(info, d, n)
        if stage.has_backward and not stage.is_last:
            for info, d in zip(stage.grad_recv_info[i], dims_out, strict=True):
                _fit(info, d, n)


def _fit(info: Any, dim: int, size: int) -> None:
    """A receive buffer (`_RecvInfo.buffer`) re-made with `size` along `dim` where it differs."""
    buf = info.buffer
    if buf is not None and buf.shape[dim] != size:
        shape = list(buf.shape)
        shape[dim] = size
        info.buffer = torch.empty(shape, dtype=buf.dtype, device=buf.device)
