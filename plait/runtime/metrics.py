"""Per-step metrics in TensorBoard event files, where users look, beside `losses.csv`.

Written by the launcher from the run's result once the workers are done (one writer, one
file set, however many ranks ran), with torch's `torch.utils.tensorboard.SummaryWriter`. The
`tensorboard` package is an optional extra (``pip install plait[metrics]``): without it nothing
is written and the run's notes say so.

Scalars, by global step: ``train/loss`` (the global batch's mean loss), ``train/step_time_s``
(first rank's start to last rank's end), ``train/samples_per_s`` and, for sequence models,
``train/tokens_per_s``; ``train/loss_scale`` under fp16 dynamic loss scaling; and at the last
step ``memory/peak_gib/rank{r}`` (each rank's peak: CUDA's max allocated, or the process's max
RSS on CPU, as `RankInfo.memory_kind` says).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SUBDIR = "tensorboard"  # in the run folder


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def write_tensorboard(folder: Path, result: Any, global_batch: int, tokens_per_sample: int | None = None
                      ) -> str | None:
    """Write `result`'s per-step metrics (a `plait.runtime.api.RunResult`) as event files under
    ``folder / "tensorboard"``; returns a note when they cannot be written (no `tensorboard`)."""
    if not tensorboard_available():
        return ("per-step metrics not written for TensorBoard: the 'tensorboard' package is not installed "
                "(pip install 'plait[metrics]'); losses.csv has the losses")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(folder / SUBDIR))
    try:
        scales = dict(zip(result.steps, result.loss_scales)) if result.loss_scales else {}
        for step, loss, secs in zip(result.steps, result.losses, result.iteration_times):
            writer.add_scalar("train/loss", loss, step)
            writer.add_scalar("train/step_time_s", secs, step)
            if secs > 0:
                writer.add_scalar("train/samples_per_s", global_batch / secs, step)
                if tokens_per_sample:
                    writer.add_scalar("train/tokens_per_s", global_batch * tokens_per_sample / secs, step)
            if step in scales:
                writer.add_scalar("train/loss_scale", scales[step], step)
        if result.steps:
            for r in result.ranks:
                writer.add_scalar(f"memory/peak_gib/rank{r.rank}", r.peak_memory_bytes / 2**30, result.steps[-1])
    finally:
        writer.close()
    return None


def read_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of one scalar from the event files under `folder` (needs `tensorboard`)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]
