"""Per-step metrics as TensorBoard event files (`plait.runtime.metrics`), read back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from plait.runtime.metrics import read_scalars, tensorboard_available, write_tensorboard


def _result() -> SimpleNamespace:
    rank = SimpleNamespace(rank=0, peak_memory_bytes=3 * 2**30)
    return SimpleNamespace(steps=[2, 3, 4], losses=[2.5, 2.25, 2.0], iteration_times=[0.5, 0.25, 0.2],
                           loss_scales=[1024.0, 1024.0, 2048.0], ranks=[rank, SimpleNamespace(rank=1, peak_memory_bytes=2**30)])


@pytest.mark.skipif(not tensorboard_available(), reason="the optional 'tensorboard' package is not installed")
def test_each_step_written_and_read_back(tmp_path) -> None:
    assert write_tensorboard(tmp_path, _result(), global_batch=8, tokens_per_sample=16) is None
    folder = tmp_path / "tensorboard"
    assert read_scalars(folder, "train/loss") == [(2, 2.5), (3, 2.25), (4, 2.0)]
    assert read_scalars(folder, "train/samples_per_s") == [(2, 16.0), (3, 32.0), (4, pytest.approx(40.0))]
    assert read_scalars(folder, "train/tokens_per_s")[1] == (3, 512.0)
    assert [v for _, v in read_scalars(folder, "train/loss_scale")] == [1024.0, 1024.0, 2048.0]
    assert read_scalars(folder, "memory/peak_gib/rank0") == [(4, 3.0)]
    assert read_scalars(folder, "memory/peak_gib/rank1") == [(4, 1.0)]


def test_without_the_package_a_note_says_so(tmp_path, monkeypatch) -> None:
    import plait.runtime.metrics as metrics

    monkeypatch.setattr(metrics, "tensorboard_available", lambda: False)
    note = metrics.write_tensorboard(tmp_path, _result(), global_batch=8)
    assert note is not None and "tensorboard" in note and "plait[metrics]" in note
    assert not (tmp_path / "tensorboard").exists()
