"""Peak memory of a real training step, measured: the figure `plait.cost.memory` is checked
against (tests/test_memory.py, bench/memory_error.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from plait.cost.memory import OPTIMIZERS, MemoryEstimateError


@dataclass
class MeasuredPeak:
    """Peak of a real training step measured by PyTorch's MemTracker, by MemTracker's categories."""

    peak_bytes: int
    by_category: dict[str, int]


def measure_step_peak(
    module: Any,
    inputs: tuple,
    target: Any,
    loss_fn: Any,
    *,
    optimizer: str = "adam",
    micro_batches: int = 1,
    checkpoint: list[Any] | None = None,
    warmup_steps: int = 1,
    autocast: str | None = None,
) -> MeasuredPeak:
    """Peak bytes of one steady-state training step of `module` on its (CPU) device:
    `micro_batches` forward/loss/backward passes on equal slices of the batch (gradient
    accumulation), the optimizer step and ``zero_grad(set_to_none=True)``.

    `checkpoint` lists submodules whose forward runs under
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (full recompute).

    `autocast` ("bf16" or "fp16"): each forward and loss under ``torch.autocast`` in that dtype
    with fp32 parameters, gradients and optimizer state -- how plait's engines run a bf16 / fp16
    plan (`plait.runtime.amp.autocast_for`); backward outside it, as torch's recipe has it.

    Uses ``torch.distributed._tools.mem_tracker.MemTracker``, a TorchDispatchMode that
    follows every storage an op creates and frees (weak references), so the peak is
    exact on CPU, where there is no caching allocator. The warm-up step(s) run outside
    the tracker so Adam's lazily created state exists, as in every step after the first;
    the module and optimizer are registered with ``track_external``; each micro-batch is
    copied in when its turn comes, as a data loader would hand it over.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    opt = _make_optimizer(module, optimizer)
    # Slice outside the tracker: a view made under MemTracker would make it count the
    # whole batch's storage. Inside, each micro-batch is copied in when its turn comes,
    # as a data loader hands it over, so only the micro-batch in use is resident.
    pieces = _micro_batches(inputs, target, micro_batches)
    low = _autocast_dtype(autocast)
    with _recomputed(checkpoint or []):
        module.train()
        for _ in range(warmup_steps):
            _train_step(module, loss_fn, opt, pieces, low=low)
        tracker = MemTracker()
        tracker.track_external(module, opt)
        with tracker:
            _train_step(module, loss_fn, opt, pieces, tracker, low=low)
    snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    cats = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
    return MeasuredPeak(peak_bytes=int(snap["Total"]), by_category=cats)


def _make_optimizer(module: Any, optimizer: str) -> Any:
    """The step's optimizer (one of `OPTIMIZERS`) over `module`'s parameters."""
    import torch

    base = optimizer.split("-")[0]
    if base in ("adam", "adamw"):
        cls = torch.optim.AdamW if base == "adamw" else torch.optim.Adam
        kwargs = {"foreach": True} if optimizer.endswith("foreach") else {}
        return cls(module.parameters(), lr=1e-4, **kwargs)
    if base == "sgd":
        return torch.optim.SGD(module.parameters(), lr=1e-4, momentum=0.9 if "momentum" in optimizer else 0.0)
    raise MemoryEstimateError(f"optimizer: unknown {optimizer!r}; use one of {OPTIMIZERS}")


def _micro_batches(inputs: tuple, target: Any, micro_batches: int) -> list[tuple[tuple, Any]]:
    """(inputs, target) of each of `micro_batches` equal slices of the batch (views)."""
    import torch

    batch = int(target.shape[0])
    if micro_batches < 1 or batch % micro_batches:
        raise MemoryEstimateError(f"micro_batches: {micro_batches} does not divide the batch of {batch}")
    mb = batch // micro_batches

    def piece(x: Any, i: int) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch:
            return x[i * mb:(i + 1) * mb]
        return x

    return [(tuple(piece(x, i) for x in inputs), piece(target, i)) for i in range(micro_batches)]


def _load(x: Any) -> Any:
    """A micro-batch tensor copied in, as a data loader hands it over."""
    import torch

    return x.clone() if isinstance(x, torch.Tensor) else x


def _autocast_dtype(autocast: str | None) -> Any:
    """The torch dtype `measure_step_peak(autocast=...)` names, None for none."""
    import torch

    dtypes = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if autocast not in dtypes:
        raise MemoryEstimateError(f"autocast: unknown {autocast!r}; use bf16, fp16 or None")
    return dtypes[autocast]


def _train_step(module: Any, loss_fn: Any, opt: Any, pieces: list[tuple[tuple, Any]], tracker: Any = None,
                low: Any = None) -> None:
    """One training step: forward/loss/backward of each micro-batch (forward and loss autocast to
    `low` if given), the optimizer step, zero_grad."""
    from contextlib import nullcontext

    import torch

    micro_batches = len(pieces)
    # The usual loop: `out` and `loss` stay referenced until reassigned, so the outputs
    # of the last micro-batch are alive through the optimizer step.
    for i in range(micro_batches):
        if tracker is not None and i:
            tracker.reset_mod_stats()  # MemTracker refuses a second root forward otherwise
        x = tuple(_load(t) for t in pieces[i][0])
        y = _load(pieces[i][1])
        with torch.autocast(_device_of(module), dtype=low) if low is not None else nullcontext():
            out = module(*x)
            loss = loss_fn(out, y) / micro_batches
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@contextmanager
def _recomputed(subs: list[Any]) -> Iterator[None]:
    """Inside the block, each of `subs` runs its forward under non-reentrant checkpoint (full
    recompute); their own forwards are restored after."""
    import functools

    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    saved_forwards = []
    for sub in subs:
        saved_forwards.append((sub, sub.__dict__.get("forward")))
        sub.forward = functools.partial(torch_checkpoint, sub.forward, use_reentrant=False)
    try:
        yield
    finally:
        for sub, fwd in saved_forwards:
            if fwd is None:
                del sub.forward
            else:
                sub.forward = fwd


def _device_of(module: Any) -> str:
    """The device type of `module`'s parameters (cpu when it has none)."""
    return next((p.device.type for p in module.parameters()), "cpu")
