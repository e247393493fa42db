"""Pipeline execution of one stage on torch.distributed point-to-point ops.

Schedules (Narayanan et al. 2021, §2.2):

* **GPipe** -- all forwards, then all backwards;
* **1F1B** (PipeDream-Flush) -- stage p runs min(pp - p - 1, m) warm-up forwards, then
  alternates one forward and one backward, then drains; at most pp - p micro-batches
  are in flight, so activation memory is bounded by the depth, not by m.

The communication pattern is Megatron-LM's `forward_backward_pipelining_without_interleaving`:
a forward send and the backward receive of the steady state (and the backward send and
next forward receive) are posted together with `batch_isend_irecv` and waited together,
which is deadlock-free for this schedule on both gloo and NCCL.

A stage may send several values across a cut (e.g. hidden states and an attention mask),
tensors or shape-derived Python constants. The first time a micro-batch size crosses a
cut, the sender first sends a fixed-size header that describes them (shapes, dtypes,
whether they need gradients, the constants); both sides cache it, so later micro-batches
send only the tensors.

Gradient accumulation: micro-batch j's loss is scaled by n_j / B (its share of the global
batch B), so summing gradients over micro-batches and data-parallel replicas gives the
gradient of the global-batch mean loss, for uneven replica shares too. Under fp16 the last
stage back-propagates `loss * loss_scale` (`plait.runtime.amp`); the gradients that cross the
cuts are then scaled too, and the optimizer step unscales them all.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from plait.runtime.comm import P2P, Comm
from plait.runtime.partition import MicroBatch
from plait.runtime.recorder import Recorder

HEADER_BYTES = 1 << 14

Meta = list[tuple[str, Any, Any, bool]]  # ("t", shape, dtype, requires_grad) | ("c", value, None, False)


def _encode_header(meta: Meta, device: torch.device) -> torch.Tensor:
    payload = pickle.dumps(meta)
    if len(payload) + 8 > HEADER_BYTES:
        raise RuntimeError(f"pipeline header of {len(payload)} bytes exceeds {HEADER_BYTES}")
    buf = bytearray(HEADER_BYTES)
    buf[:8] = len(payload).to_bytes(8, "little")
    buf[8:8 + len(payload)] = payload
    return torch.frombuffer(buf, dtype=torch.uint8).clone().to(device)


def _decode_header(buf: torch.Tensor) -> Meta:
    raw = bytes(buf.cpu().numpy().tobytes())
    n = int.from_bytes(raw[:8], "little")
    return pickle.loads(raw[8:8 + n])


class StageRunner:
    """Runs the forward and backward of one pipeline stage for a sequence of micro-batches."""

    def __init__(self, module: nn.Module, stage: int, num_stages: int, prev_rank: int | None,
                 next_rank: int | None, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                 global_batch: int, device: torch.device, recorder: Recorder,
                 autocast: Callable[[], AbstractContextManager[Any]] | None = None,
                 comm: Comm | None = None) -> None:
        self.module = module
        self.comm = comm  # point-to-point messages go through the facade (records, link faults)
        self.stage = stage
        self.num_stages = num_stages
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.loss_fn = loss_fn
        self.global_batch = global_batch
        self.device = device
        self.rec = recorder
        self.autocast = autocast or nullcontext
        self.send_meta: dict[int, Meta] = {}  # micro-batch size -> what crosses the next cut
        self.recv_meta: dict[int, Meta] = {}  # micro-batch size -> what crosses the previous cut
        self.saved: dict[int, tuple[list[torch.Tensor], Any, torch.Tensor | None]] = {}
        self.loss_sum: torch.Tensor = torch.zeros((), device=device)
        self.loss_scale = 1.0  # set per step by the worker's fp16 loss scaler
        self._data: Callable[[MicroBatch], tuple[tuple[Any, ...], torch.Tensor]] | None = None
        self._mbs: list[MicroBatch] = []

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    # ------------------------------------------------------------------ p2p
    def _key(self, kind: str, peer: int, mb: int | None) -> str:
        """The shared event key: a message to / from the next stage is forward, else backward."""
        direction = "fwd" if (peer == self.next_rank) == (kind == "send") else "bwd"
        return f"{kind}_{direction} s{self.stage} c0 mb{mb}"

    def _p2p(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
             name: str, mb: int | None, recv_mb: int | None = None) -> None:
        if not sends and not recvs:
            return
        assert self.comm is not None, "a pipeline stage needs the communication facade"
        recv_mb = mb if recv_mb is None else recv_mb
        ops = [P2P("send", t, peer, self._key("send", peer, mb)) for t, peer in sends]
        ops += [P2P("recv", t, peer, self._key("recv", peer, recv_mb)) for t, peer in recvs]
        self.comm.p2p(ops, name, "comm_pp", micro_batch=mb)

    def _fwd_send_list(self, mb: MicroBatch, outs: tuple[Any, ...]) -> list[tuple[torch.Tensor, int]]:
        assert self.next_rank is not None
        sends: list[tuple[torch.Tensor, int]] = []
        if mb.size not in self.send_meta:
            meta: Meta = []
            for v in outs:
                if isinstance(v, torch.Tensor):
                    meta.append(("t", tuple(v.shape), v.dtype, bool(v.requires_grad)))
                else:
                    meta.append(("c", v, None, False))
            self.send_meta[mb.size] = meta
            sends.append((_encode_header(meta, self.device), self.next_rank))
        sends += [(v.detach().contiguous(), self.next_rank) for v in outs if isinstance(v, torch.Tensor)]
        return sends

    def _fwd_recv_buffers(self, meta: Meta) -> list[torch.Tensor]:
        return [torch.empty(shape, dtype=dtype, device=self.device) for kind, shape, dtype, _ in meta if kind == "t"]

    def _assemble_inputs(self, meta: Meta, bufs: list[torch.Tensor]) -> list[Any]:
        it = iter(bufs)
        values: list[Any] = []
        for kind, value, _, rg in meta:
            if kind == "t":
                t = next(it)
                if rg:
                    t.requires_grad_(True)
                values.append(t)
            else:
                values.append(value)
        return values

    def _bwd_grad_buffers(self, mb: MicroBatch) -> list[torch.Tensor]:
        meta = self.send_meta[mb.size]
        return [torch.empty(shape, dtype=dtype, device=self.device) for kind, shape, dtype, rg in meta
                if kind == "t" and rg]

    def _exchange(self, sends: list[tuple[torch.Tensor, int]], recv_fwd: MicroBatch | None,
                  recv_bwd: MicroBatch | None, name: str, mb: int | None) -> tuple[list[Any] | None, list[torch.Tensor] | None]:
        """Post `sends` with the receive of a forward input and/or a backward gradient; wait all."""
        recvs: list[tuple[torch.Tensor, int]] = []
        recv_from = recv_bwd if recv_bwd is not None else recv_fwd
        recv_mb = recv_from.index if recv_from is not None else None  # the received message's micro-batch
        grads = None
        if recv_bwd is not None:
            assert self.next_rank is not None
            grads = self._bwd_grad_buffers(recv_bwd)
            recvs += [(g, self.next_rank) for g in grads]
        inputs = None
        if recv_fwd is not None:
            assert self.prev_rank is not None
            meta = self.recv_meta.get(recv_fwd.size)
            if meta is None:  # first micro-batch of this size: learn what crosses the cut
                header = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
                self._p2p(sends, recvs + [(header, self.prev_rank)], name, mb, recv_mb)
                sends, recvs = [], []
                meta = self.recv_meta[recv_fwd.size] = _decode_header(header)
            bufs = self._fwd_recv_buffers(meta)
            recvs += [(b, self.prev_rank) for b in bufs]
            self._p2p(sends, recvs, name, mb, recv_mb)
            inputs = self._assemble_inputs(meta, bufs)
        else:
            self._p2p(sends, recvs, name, mb, recv_mb)
        return inputs, grads

    # ------------------------------------------------------------------ compute
    def forward(self, mb: MicroBatch, received: list[Any] | None) -> tuple[Any, ...]:
        assert self._data is not None
        with self.rec.compute(f"fwd stage{self.stage} mb{mb.index}", "forward", micro_batch=mb.index,
                              samples=mb.size):
            if self.first:
                inputs, target = self._data(mb)
                args: list[Any] = list(inputs)
                grad_inputs: list[torch.Tensor] = []
            else:
                args = received or []
                grad_inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
                target = self._data(mb)[1] if self.last else None
            with self.autocast():
                out = self.module(*args)
                loss = None
                if self.last:
                    loss = self.loss_fn(out, target) * (mb.size / self.global_batch)
            if loss is not None:
                self.loss_sum += loss.detach().float()
            self.saved[mb.index] = (grad_inputs, out, loss)
        return out if not self.last else ()

    def backward(self, mb: MicroBatch, grads: list[torch.Tensor] | None) -> list[torch.Tensor]:
        grad_inputs, out, loss = self.saved.pop(mb.index)
        with self.rec.compute(f"bwd stage{self.stage} mb{mb.index}", "backward", micro_batch=mb.index,
                              samples=mb.size):
            if self.last:
                assert loss is not None
                (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()
            else:
                outs = [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
                if outs:
                    torch.autograd.backward(outs, grads)
            result = [x.grad if x.grad is not None else torch.zeros_like(x) for x in grad_inputs]
        return result

    # ------------------------------------------------------------------ comm steps
    def recv_forward(self, mb: MicroBatch) -> list[Any] | None:
        if self.first:
            return None
        return self._exchange([], mb, None, f"recv fwd stage{self.stage - 1}->{self.stage}", mb.index)[0]

    def send_forward(self, mb: MicroBatch, outs: tuple[Any, ...]) -> None:
        if self.last:
            return
        self._exchange(self._fwd_send_list(mb, outs), None, None,
                       f"send fwd stage{self.stage}->{self.stage + 1}", mb.index)

    def send_forward_recv_backward(self, mb: MicroBatch, outs: tuple[Any, ...], mb_b: MicroBatch
                                   ) -> list[torch.Tensor] | None:
        if self.last:
            return None
        return self._exchange(self._fwd_send_list(mb, outs), None, mb_b,
                              f"send fwd/recv bwd stage{self.stage}<->{self.stage + 1}", mb.index)[1]

    def recv_backward(self, mb: MicroBatch) -> list[torch.Tensor] | None:
        if self.last:
            return None
        return self._exchange([], None, mb, f"recv bwd stage{self.stage + 1}->{self.stage}", mb.index)[1]

    def send_backward(self, mb: MicroBatch, grads: list[torch.Tensor]) -> None:
        if self.first:
            return
        assert self.prev_rank is not None
        self._exchange([(g.contiguous(), self.prev_rank) for g in grads], None, None,
                       f"send bwd stage{self.stage}->{self.stage - 1}", mb.index)

    def send_backward_recv_forward(self, mb: MicroBatch, grads: list[torch.Tensor], mb_f: MicroBatch
                                   ) -> list[Any] | None:
        if self.first:
            return None
        assert self.prev_rank is not None
        return self._exchange([(g.contiguous(), self.prev_rank) for g in grads], mb_f, None,
                              f"send bwd/recv fwd stage{self.stage}<->{self.stage - 1}", mb.index)[0]

    # ------------------------------------------------------------------ schedules
    def run(self, schedule: str, micro_batches: list[MicroBatch],
            data: Callable[[MicroBatch], tuple[tuple[Any, ...], torch.Tensor]]) -> None:
        """Forward and backward of every micro-batch of one step, gradients accumulated."""
        self._data = data
        self._mbs = micro_batches
        if schedule == "gpipe":
            self._gpipe(micro_batches)
        elif schedule == "1f1b":
            self._one_f_one_b(micro_batches)
        else:
            raise ValueError(f"unknown pipeline schedule {schedule!r}")
        assert not self.saved

    def _gpipe(self, mbs: list[MicroBatch]) -> None:
        for mb in mbs:
            x = self.recv_forward(mb)
            self.send_forward(mb, self.forward(mb, x))
        for mb in mbs:
            g = self.recv_backward(mb)
            self.send_backward(mb, self.backward(mb, g))

    def _one_f_one_b(self, mbs: list[MicroBatch]) -> None:
        m = len(mbs)
        warmup = min(self.num_stages - self.stage - 1, m)
        remaining = m - warmup
        for i in range(warmup):
            x = self.recv_forward(mbs[i])
            self.send_forward(mbs[i], self.forward(mbs[i], x))
        x = self.recv_forward(mbs[warmup]) if remaining > 0 else None
        for j in range(remaining):
            f_mb, b_mb = mbs[warmup + j], mbs[j]
            out = self.forward(f_mb, x)
            g = self.send_forward_recv_backward(f_mb, out, b_mb)
            gx = self.backward(b_mb, g)
            if j == remaining - 1:
                self.send_backward(b_mb, gx)
            else:
                x = self.send_backward_recv_forward(b_mb, gx, mbs[warmup + j + 1])
        for j in range(remaining, m):
            g = self.recv_backward(mbs[j])
            self.send_backward(mbs[j], self.backward(mbs[j], g))
