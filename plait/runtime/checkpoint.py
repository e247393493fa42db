"""Crash-safe checkpoints: one file per rank, a COMPLETE marker written last.

Layout: `DIR/step-00000004/rank0.pt ... rankN.pt` and `DIR/step-00000004/COMPLETE`
(JSON metadata). Each file is written to a temporary name, fsync'ed, renamed, and the
directory fsync'ed, so a file either exists whole or not at all; the marker is written
(the same way) by rank 0 only after a barrier, so a checkpoint is either complete or
ignored. A worker killed with SIGKILL at any moment therefore never damages a checkpoint
that was already complete, and `latest_checkpoint` skips a half-written one.
Each rank file holds its model shard (under ZeRO-3 `model` is None: the rank's flat parameter
shards, which are the parameters, are in `optim["shards"]`), optimizer (shard) state, the step, all RNG states
(with the per-rank dropout stream of sequence-parallel layers, `sp_rng`) and, under fp16,
the dynamic loss scaler's scale and growth counter (`amp`), so `--resume` continues bit for
bit -- a resumed fp16 run uses the scale the interrupted run would have used.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait.errors import PlaitError

MARKER = "COMPLETE"


class CheckpointError(PlaitError, ValueError):
    """A checkpoint that cannot be used for this run; the message names the directory and why."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, writer: Callable[[Any], None]) -> None:
    """Write via `writer(fileobj)` to a temp name, fsync, rename over `path`, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        writer(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_rank(root: Path, step: int, rank: int, state: dict[str, Any],
              before_rename: Callable[[], None] | None = None) -> Path:
    """Write this rank's file of checkpoint `step` (steps completed). `before_rename` is a test
    hook called after the temporary file is written and before it is renamed."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"rank{rank}.pt"
    for stale in d.glob(f".{path.name}.tmp-*"):  # left by a process killed while writing
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if before_rename is not None:
        before_rename()
    os.replace(tmp, path)
    _fsync_dir(d)
    return path


def mark_complete(root: Path, step: int, meta: dict[str, Any], keep: int | None = None) -> None:
    """Rank 0, after every rank saved: publish the checkpoint, then prune older ones."""
    d = step_dir(root, step)
    world = int(meta["world_size"])
    missing = [r for r in range(world) if not (d / f"rank{r}.pt").exists()]
    if missing:
        raise CheckpointError(f"checkpoint {d}: ranks {missing} did not write their files")
    data = json.dumps({**meta, "step": step}, indent=1).encode()
    atomic_write_bytes(d / MARKER, lambda f: f.write(data))
    _fsync_dir(root)
    if keep:
        complete = sorted(s for s, _ in list_checkpoints(root) if s <= step)
        for old in complete[:-keep]:
            shutil.rmtree(step_dir(root, old), ignore_errors=True)
        for p in root.glob("step-*"):  # leftovers of runs that died while writing
            s = _step_of(p)
            if s is not None and s < step and not (p / MARKER).exists():
                shutil.rmtree(p, ignore_errors=True)


def _step_of(path: Path) -> int | None:
    try:
        return int(path.name.split("-", 1)[1])
    except (IndexError, ValueError):
        return None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.exists():
        return []
    out = []
    for p in root.glob("step-*"):
        s = _step_of(p)
        if s is not None and (p / MARKER).exists():
            out.append((s, p))
    return sorted(out)


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / MARKER).read_text())


def check_compatible(path: Path, expected: dict[str, Any]) -> dict[str, Any]:
    """Raise CheckpointError when the checkpoint was written by a different model/plan/optimizer."""
    meta = read_meta(path)
    for key in ("model", "plan", "world_size", "optimizer", "seed", "data_seed"):
        if key in expected and meta.get(key) != expected[key]:
            raise CheckpointError(
                f"checkpoint {path}: field '{key}' is {meta.get(key)!r} but this run has {expected[key]!r}; "
                f"resume needs the same model, plan, optimizer and seeds")
    return meta


def load_rank(path: Path, rank: int, device: torch.device | str = "cpu") -> dict[str, Any]:
    f = path / f"rank{rank}.pt"
    if not f.exists():
        raise CheckpointError(f"checkpoint {path}: file rank{rank}.pt is missing")
    return torch.load(f, map_location=device, weights_only=False)
