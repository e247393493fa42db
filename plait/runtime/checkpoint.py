"""Crash-safe, plan-independent checkpoints in torch.distributed.checkpoint (DCP) format.

Layout of one checkpoint (`DIR/step-00000004/`):

* DCP's files: `.metadata` (which chunk of which tensor lies where) and `__<rank>_0.distcp`
  (the chunks a rank wrote). The state is `{"model": {name: tensor}, "optim": {name: {state:
  tensor}}, "train": {...}, "rank_state": {"<rank>": bytes}}`: every parameter and its optimizer
  state under the single-process model's parameter name, each rank contributing its slice
  (`plait.runtime.sharded_state`), so DCP reshards it on load for any other plan of the model;
* `manifest.json`: `format_version` and the sha256 and size of every file above (DCP has no
  checksums): a damaged or missing file is named and the previous good checkpoint is used;
* `COMPLETE`: the run's metadata (model, plan, optimizer, seeds, step, format_version) and the
  manifest's own sha256, written last.

Atomicity: every rank writes into `DIR/.step-00000004.tmp/` (DCP fsyncs its files), rank 0 then
writes the manifest and the marker there (each to a temporary name, fsync'ed, renamed) and
renames the whole directory to `step-00000004`. A checkpoint is therefore complete or absent; a
worker killed at any moment leaves at most a `.tmp` directory, which is ignored and pruned.

`train` holds the step, the fp16 loss scaler's state (the same on every rank) and the plan that
wrote the checkpoint; `rank_state` each rank's RNG states (torch/python/numpy, CUDA, and the
sequence-parallel dropout stream). Per-rank RNG streams cannot carry over to another rank
layout: under the same plan every rank restores its own (a resume is bit for bit); under another
plan the streams start afresh from the run's seed, the step and the rank's coordinates
(`reseed_streams`), so dropout masks differ from the uninterrupted run while parameters, optimizer
state, the step and the loss scale carry over exactly.

A checkpoint in plait's former per-rank pickle format (`rankN.pt`, no `format_version`) is
refused with a message saying so. `torch.distributed.checkpoint.format_utils.dcp_to_torch_save`
turns a checkpoint into one plain `torch.save` file (see README, "Checkpoints").
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from plait.errors import PlaitError
from plait.runtime.sharded_state import RankLayout

MARKER = "COMPLETE"
MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # 1: per-rank pickles (rankN.pt); 2: torch.distributed.checkpoint + manifest
COMPAT_FIELDS = ("model", "optimizer", "seed", "data_seed")


class CheckpointError(PlaitError, ValueError):
    """A checkpoint that cannot be used for this run; the message names the directory and why."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f".step-{step:08d}.tmp"


# ---------------------------------------------------------------------------------- files
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


def _write_json(path: Path, data: dict[str, Any]) -> None:
    raw = json.dumps(data, indent=1).encode()
    atomic_write_bytes(path, lambda f: f.write(raw))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def hash_files(folder: Path, prefix: str) -> dict[str, dict[str, Any]]:
    """sha256 and size of the files in `folder` whose names start with `prefix`."""
    return {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in sorted(folder.iterdir()) if p.is_file() and p.name.startswith(prefix)}


# ---------------------------------------------------------------------------------- RNG and objects
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


def reseed_streams(seed: int, step: int, coords: tuple[int, int, int]) -> int:
    """Fresh RNG streams for a rank resumed under another plan: a seed from the run's seed, the step
    and the rank's (pp, dp, tp) coordinates, so the resumed run is deterministic too."""
    p, d, t = coords
    s = (seed * 1_000_003 + step * 7919 + p * 1009 + d * 101 + t) % (2**31 - 1)
    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s)
    return s


def encode_object(obj: Any) -> bytes:
    """A Python object as an opaque blob (stored as one DCP bytes entry, not traversed)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def decode_object(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=False)


# ---------------------------------------------------------------------------------- collectives
# Besides DCP's own, this module's collectives go through the runtime's communication facade
# (`plait.runtime.comm.Comm`), recorded like every other call.


# ---------------------------------------------------------------------------------- save
def save(root: Path, step: int, state: dict[str, Any], meta: dict[str, Any], rank: int, world: int,
         comm: Any, keep: int | None = None, before_publish: Callable[[], None] | None = None) -> Path:
    """Collective: write checkpoint `step` (steps completed) of every rank's `state` under `root`.
    `before_publish` is a test hook called after this rank's files are written."""
    tmp, final = tmp_dir(root, step), step_dir(root, step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died while writing this step
        tmp.mkdir()
    comm.barrier("checkpoint barrier")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)))
    if before_publish is not None:
        before_publish()
    hashes = comm.gather_object(hash_files(tmp, f"__{rank}_"), 0, name="checkpoint hashes")
    if rank == 0:
        assert hashes is not None
        files: dict[str, dict[str, Any]] = {}
        for h in hashes:
            files.update(h)
        files.update(hash_files(tmp, ".metadata"))
        publish(root, step, files, meta, keep)
    comm.barrier("checkpoint barrier")
    return final


def publish(root: Path, step: int, files: dict[str, dict[str, Any]], meta: dict[str, Any],
            keep: int | None) -> None:
    """Rank 0, after every rank wrote: manifest, marker, rename the directory, prune older ones."""
    tmp, final = tmp_dir(root, step), step_dir(root, step)
    _write_json(tmp / MANIFEST, {"format_version": FORMAT_VERSION, "files": files})
    _write_json(tmp / MARKER, {**meta, "step": step, "format_version": FORMAT_VERSION,
                               "manifest_sha256": sha256_file(tmp / MANIFEST)})
    if final.exists():  # an earlier, damaged checkpoint of this step (a resume fell back past it)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    prune(root, step, keep)


def prune(root: Path, step: int, keep: int | None) -> None:
    """Keep the newest `keep` complete checkpoints up to `step`; drop leftovers of dead writers."""
    if keep:
        complete = sorted(s for s, _ in list_checkpoints(root) if s <= step)
        for old in complete[:-keep]:
            shutil.rmtree(step_dir(root, old), ignore_errors=True)
    for p in list(root.glob(".step-*.tmp")) + list(root.glob("step-*")):
        s = _step_of(p)
        if s is not None and s < step and not (p / MARKER).exists():
            shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------- find and check
def _step_of(path: Path) -> int | None:
    try:
        return int(path.name.lstrip(".").split("-", 1)[1].split(".", 1)[0])
    except (IndexError, ValueError):
        return None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root` (any format), oldest first."""
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
    try:
        data = json.loads((path / MARKER).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: file {MARKER} is unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint {path}: file {MARKER} is not a JSON object")
    return data


def is_legacy(path: Path) -> bool:
    """A checkpoint of plait's former format: per-rank pickles `rankN.pt`, no format_version."""
    try:
        meta = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        meta = {}
    return (isinstance(meta, dict) and "format_version" not in meta) and any(path.glob("rank*.pt"))


def legacy_message(path: Path) -> str:
    return (f"checkpoint {path} is in plait's old per-rank format (rank0.pt ... rankN.pt, format_version 1), "
            f"which cannot be resharded; this plait reads format_version {FORMAT_VERSION} "
            "(torch.distributed.checkpoint). Finish that run with the plait that wrote it, or move the "
            "directory away and start without --resume")


def verify(path: Path) -> list[str]:
    """What is wrong with a checkpoint's files, each problem naming the file (empty: all good)."""
    try:
        meta = read_meta(path)
    except CheckpointError as exc:
        return [str(exc)]
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        return [f"{path / MARKER}: format_version {version!r}, this plait reads {FORMAT_VERSION}"]
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        return [f"{manifest_path} is missing"]
    if sha256_file(manifest_path) != meta.get("manifest_sha256"):
        return [f"{manifest_path} is damaged (sha256 differs from the one in {MARKER})"]
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return [f"{manifest_path} is unreadable"]
    problems = []
    for name, want in sorted(files.items()):
        f = path / name
        if not f.exists():
            problems.append(f"{f} is missing")
        elif f.stat().st_size != want["bytes"] or sha256_file(f) != want["sha256"]:
            problems.append(f"{f} is damaged (sha256 differs from the manifest)")
    return problems


def check_compatible(path: Path, expected: dict[str, Any]) -> dict[str, Any]:
    """Raise CheckpointError when the checkpoint was written for another model/optimizer/seeds.
    The plan may differ: the checkpoint is resharded on load."""
    meta = read_meta(path)
    for key in COMPAT_FIELDS:
        if key in expected and meta.get(key) != json.loads(json.dumps(expected[key])):
            raise CheckpointError(
                f"checkpoint {path}: field '{key}' is {meta.get(key)!r} but this run has {expected[key]!r}; "
                f"resume needs the same model, optimizer and seeds (the plan may differ)")
    return meta


def choose_resume(root: Path, expected: dict[str, Any]) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint whose files match their manifest, and warnings about the
    newer ones that did not (each naming the damaged file). None when there is no checkpoint."""
    notes: list[str] = []
    found = list_checkpoints(root)
    for _, path in reversed(found):
        if is_legacy(path):
            raise CheckpointError(legacy_message(path))
        problems = verify(path)
        if problems:
            note = f"checkpoint {path.name} not used: {'; '.join(problems)}"
            warnings.warn(note, stacklevel=2)
            notes.append(note)
            continue
        check_compatible(path, expected)
        if notes:
            notes.append(f"resumed from the previous good checkpoint {path.name}")
        return path, notes
    if notes:
        raise CheckpointError(f"no usable checkpoint under {root}: " + " | ".join(notes))
    return None, notes


# ---------------------------------------------------------------------------------- load
def stored_entries(path: Path) -> dict[tuple[str, ...], Any]:
    """The checkpoint's entries: nested key path -> DCP storage metadata (tensor size and dtype,
    or bytes)."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    mapping = md.planner_data or {}
    return {tuple(mapping.get(k, (k,))): v for k, v in md.state_dict_metadata.items()}


def load(path: Path, state: dict[str, Any]) -> None:
    """Collective: fill `state` (the rank's tensors to load into, views of live ones, and None
    placeholders for objects) from checkpoint `path`."""
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)))
    except Exception as exc:  # DCP wraps every rank's error into one long exception
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise CheckpointError(f"checkpoint {path}: torch.distributed.checkpoint could not load it "
                              f"({type(exc).__name__}: {first[:300]})") from None


def rank_snapshot(layout: RankLayout, train: dict[str, Any], rank: int, rank_state: Any) -> dict[str, Any]:
    """The state dict a rank hands to `save`: its slices of the model and optimizer state (written
    once across replicas), the run-wide `train` record and its own `rank_state` (as a blob)."""
    optim, _ = layout.optim_state(writing=True)
    return {"model": layout.model_state(writing=True), "optim": optim, "train": train,
            "rank_state": {str(rank): encode_object(rank_state)}}


def load_into(path: Path, layout: RankLayout, rank: int) -> tuple[dict[str, Any], Any]:
    """Collective: load checkpoint `path` (written under any plan) into this rank's live parameters
    and optimizer state (optimizer state is created for the entries the checkpoint has). Returns
    the `train` record and this rank's `rank_state` (None when the checkpoint has no such rank)."""
    entries = stored_entries(path)
    names: dict[str, dict[str, tuple[torch.Size, torch.dtype]]] = {}
    for key, md in entries.items():
        if key[0] == "optim" and len(key) == 3 and hasattr(md, "properties"):
            names.setdefault(key[1], {})[key[2]] = (md.size, md.properties.dtype)
    optim, scalars = layout.optim_state(writing=False, names=names)
    state: dict[str, Any] = {"model": layout.model_state(writing=False), "optim": optim, "train": {},
                             "rank_state": {}}
    for key in entries:
        if key[0] == "train":
            _set_nested(state, key, None)
    if ("rank_state", str(rank)) in entries:
        state["rank_state"][str(rank)] = None
    load(path, state)
    for opt_state, name, copies in scalars:  # Adam's step count: one per segment
        opt_state[name] = copies[0]
    blob = state["rank_state"].get(str(rank))
    return state["train"], decode_object(blob) if blob is not None else None


def _set_nested(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def load_consolidated(path: Path) -> dict[str, Any]:
    """The whole checkpoint as one plain nested dict of full tensors, in this process (no process
    group), through torch's own `dcp_to_torch_save`. `rank_state` blobs stay bytes (`decode_object`)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "state.pt"
        dcp_to_torch_save(str(path), str(out))
        return torch.load(out, weights_only=False)

