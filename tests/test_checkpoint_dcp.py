"""Checkpoints in torch.distributed.checkpoint format, in one process: the geometry that maps plait's
runtime forms (tensor-parallel fused slices, ZeRO flat shards) to rectangles of the global
tensors, and the files (manifest, damaged-file fallback, old-format refusal, atomic publish)."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from plait.runtime import checkpoint as ckpt
from plait.runtime.sharded_state import (
    ChunkedTensor,
    flat_range_boxes,
    param_layout,
    segment_chunks,
)
from plait.runtime.tensor_parallel import ShardInfo


def _covered(shape: tuple[int, ...], boxes: list) -> torch.Tensor:
    count = torch.zeros(shape, dtype=torch.int64)
    for off, sizes in boxes:
        view = count
        for d, (o, s) in enumerate(zip(off, sizes, strict=True)):
            view = view.narrow(d, o, s)
        view += 1
    return count


def test_flat_range_boxes_tile_the_range_in_flat_order() -> None:
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        n = torch.Size(shape).numel()
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        boxes = flat_range_boxes(shape, a, b)
        want = torch.zeros(n, dtype=torch.int64)
        want[a:b] = 1
        assert torch.equal(_covered(shape, boxes).view(-1), want), (shape, a, b)
        # Each box is a contiguous run of the flat buffer, and they follow each other.
        pos = a
        for off, sizes in boxes:
            start = sum(o * torch.Size(shape[d + 1:]).numel() for d, o in enumerate(off))
            assert start == pos
            pos += torch.Size(sizes).numel()
        assert pos == b
    assert flat_range_boxes((), 0, 1) == [((), ())]


def test_tp_slices_and_zero_flat_shards_map_back_to_the_full_parameters() -> None:
    """Fused QKV (3 blocks) cut 3:1 over tp=2, a row-parallel weight, a replicated bias; each tp rank's
    parameters flattened together and cut into dp=3 ZeRO shards with padding: the chunks of all
    (tp, dp) ranks cover every element of every global tensor exactly once, with its value."""
    torch.manual_seed(0)
    qkv, proj, ln = torch.randn(3 * 8, 5), torch.randn(5, 8), torch.randn(5)
    infos = {"qkv": ShardInfo(0, 3, (6, 2)), "proj": ShardInfo(1, 1, (6, 2)), "ln": None}
    full = {"qkv": qkv, "proj": proj, "ln": ln}
    seen = {k: torch.zeros_like(v) for k, v in full.items()}
    hits = {k: torch.zeros_like(v, dtype=torch.int64) for k, v in full.items()}
    dp = 3
    for t in range(2):
        local = {k: (infos[k].take(v, t) if infos[k] else v.clone()) for k, v in full.items()}
        layouts = [param_layout(k, local[k], infos[k], t, writer=infos[k] is not None or t == 0) for k in full]
        flat = torch.cat([local[k].reshape(-1) for k in full])
        shard = -(-flat.numel() // dp)
        flat = torch.cat([flat, flat.new_zeros(shard * dp - flat.numel())])
        for d in range(dp):
            by_key = segment_chunks(flat[d * shard:(d + 1) * shard], d * shard, layouts)
            for key, chunks in by_key.items():
                if not next(m.writer for m in layouts if m.key == key):
                    continue
                for off, data in chunks:
                    view, count = seen[key], hits[key]
                    for dim, (o, s) in enumerate(zip(off, data.shape, strict=True)):
                        view, count = view.narrow(dim, o, s), count.narrow(dim, o, s)
                    view.copy_(data)
                    count += 1
    for key, value in full.items():
        assert torch.equal(seen[key], value), key
        assert bool((hits[key] == 1).all()), key


def _save_single(root: Path, step: int, value: float, keep: int | None = None) -> Path:
    """A one-process DCP checkpoint published the way rank 0 publishes one."""
    tmp = ckpt.tmp_dir(root, step)
    tmp.mkdir(parents=True)
    w = torch.full((4, 3), value)
    state = {"model": {"w": ChunkedTensor((4, 3), [((0, 0), w[:2]), ((2, 0), w[2:])])},
             "train": {"step": step}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)))
    meta = {"model": "m", "plan": "dp=2", "world_size": 2, "optimizer": {"name": "adamw"}, "seed": 0,
            "data_seed": 0}
    ckpt.publish(root, step, ckpt.hash_files(tmp, ""), meta, keep)
    return ckpt.step_dir(root, step)


EXPECTED = {"model": "m", "optimizer": {"name": "adamw"}, "seed": 0, "data_seed": 0}


def test_publish_is_atomic_and_a_damaged_file_is_named_and_skipped(tmp_path: Path) -> None:
    for step in (2, 4):
        _save_single(tmp_path, step, float(step))
    ckpt.tmp_dir(tmp_path, 6).mkdir()  # a writer that died: never listed
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 4]
    newest = ckpt.step_dir(tmp_path, 4)
    files = json.loads((newest / ckpt.MANIFEST).read_text())
    assert files["format_version"] == ckpt.FORMAT_VERSION and ".metadata" in files["files"]
    assert ckpt.read_meta(newest)["format_version"] == ckpt.FORMAT_VERSION
    assert ckpt.choose_resume(tmp_path, EXPECTED) == (newest, [])
    assert ckpt.load_consolidated(newest)["model"]["w"].eq(4.0).all()

    data = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match=data.name):
        path, notes = ckpt.choose_resume(tmp_path, EXPECTED)
    assert path == ckpt.step_dir(tmp_path, 2)
    assert f"{data} is damaged" in notes[0] and "step-00000002" in notes[-1]

    (ckpt.step_dir(tmp_path, 2) / ".metadata").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ckpt.CheckpointError, match=r"no usable checkpoint.*\.metadata is missing"):
            ckpt.choose_resume(tmp_path, EXPECTED)


def test_incompatible_and_old_format_checkpoints_are_refused_clearly(tmp_path: Path) -> None:
    _save_single(tmp_path, 2, 1.0)
    with pytest.raises(ckpt.CheckpointError, match="field 'model' is 'm' but this run has 'other'"):
        ckpt.choose_resume(tmp_path, {**EXPECTED, "model": "other"})
    old = ckpt.step_dir(tmp_path, 4)  # plait's former layout: rankN.pt and a marker without format_version
    old.mkdir()
    torch.save({"model": {}}, old / "rank0.pt")
    (old / ckpt.MARKER).write_text(json.dumps({"model": "m", "step": 4}))
    with pytest.raises(ckpt.CheckpointError, match=r"old per-rank format \(rank0.pt .*format_version 1\)"):
        ckpt.choose_resume(tmp_path, EXPECTED)


def test_prune_keeps_the_newest_and_drops_dead_writers(tmp_path: Path) -> None:
    _save_single(tmp_path, 2, 1.0)
    ckpt.tmp_dir(tmp_path, 3).mkdir()
    _save_single(tmp_path, 4, 1.0)
    _save_single(tmp_path, 6, 1.0, keep=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 6]
    assert not ckpt.tmp_dir(tmp_path, 3).exists()


def test_cli_resume_from_an_old_format_checkpoint_is_one_error_line(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from plait.cli import main as cli_main

    old = ckpt.step_dir(tmp_path, 2)
    old.mkdir()
    for r in range(2):
        torch.save({"model": {}}, old / f"rank{r}.pt")
    (old / ckpt.MARKER).write_text(json.dumps({"model": "gpt", "step": 2, "world_size": 2}))
    code = cli_main(["run", "--model", "gpt:layers=1,hidden=8,heads=2,seq=4,vocab=16", "--plan", "dp=2,global_batch=4",
                     "--steps", "3", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1", "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0]
    assert "old per-rank format" in err[0] and str(old) in err[0]


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 4)
        self.frozen = torch.nn.Linear(4, 2)
        self.frozen.requires_grad_(False)
        self.register_buffer("count", torch.zeros(2))


def _adam(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.1, foreach=False)


def test_rank_state_round_trips_from_plain_to_flat_zero_layout(tmp_path: Path) -> None:
    """Saved from per-parameter AdamW (ZeRO-0), loaded into a flat ZeRO-1 master: parameters (the
    frozen ones and buffers too), Adam's moments and step land in the right places."""
    from plait.runtime.data_parallel import DataParallelStep, Zero1Step
    from plait.runtime.sharded_state import RankLayout

    torch.manual_seed(0)
    src = _Net()
    src.count += 3
    trained = [p for p in src.parameters() if p.requires_grad]
    plain = DataParallelStep(trained, _adam, None, 1, None)  # type: ignore[arg-type]
    for _ in range(2):
        for p in trained:
            p.grad = torch.randn_like(p)
        plain.optimizer.step()
    dcp.save(ckpt.rank_snapshot(RankLayout(src, plain, {}, 0, {}, set()), {"step": 2}, 0, {"rng": None}),
             storage_writer=dcp.FileSystemWriter(str(tmp_path)))

    torch.manual_seed(1)
    dst = _Net()
    flat = Zero1Step([p for p in dst.parameters() if p.requires_grad], _adam, None, 1, 0, None)  # type: ignore[arg-type]
    train, rank_state = ckpt.load_into(tmp_path, RankLayout(dst, flat, {}, 0, {}, set()), 0)
    assert train == {"step": 2} and rank_state == {"rng": None}
    flat.sync_master_from_params()
    for (n, want), got in zip(src.state_dict().items(), dst.state_dict().values(), strict=True):
        assert torch.equal(got, want), n
    state = flat.optimizer.state[flat.master]
    for key in ("exp_avg", "exp_avg_sq"):
        want = torch.cat([plain.optimizer.state[p][key].reshape(-1) for p in trained])
        assert torch.equal(state[key], want), key
    assert float(state["step"]) == 2.0
    assert torch.equal(flat.master.detach(), torch.cat([p.detach().reshape(-1) for p in trained]))
