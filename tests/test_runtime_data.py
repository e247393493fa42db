"""The user's data (`--data file.py:factory`): a byte-level text dataset made by the test.

The sample stream is drawn by position with seeded per-epoch permutations, independent of the
plan; at dp=2 with uneven shares the tiny GPT sees the same samples and losses as one process,
and after a resume under another plan (pp=2) it continues with the next samples. The loss per
step lands in `losses.csv` beside the run's records.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from plait.runtime import data as user_data
from plait.runtime.api import (
    CheckpointConfig,
    LaunchConfig,
    RecordsConfig,
    TrainingConfig,
    reference_run,
    run,
)
from plait.runtime.lr import LRSchedule, LRScheduleError
from plait.runtime.metrics import read_scalars, tensorboard_available

TINY = "gpt:layers=2,hidden=16,heads=4,seq=8,vocab=256,dropout=0,attn_dropout=0"
FACTORY = '''
import torch
from pathlib import Path

SEQ = 8


class Bytes(torch.utils.data.Dataset):
    """Windows of SEQ+1 bytes of a text file: inputs the first SEQ, targets the next ones."""

    def __init__(self, path):
        self.data = torch.tensor(list(Path(path).read_bytes()), dtype=torch.int64)

    def __len__(self):
        return (len(self.data) - 1) // SEQ

    def __getitem__(self, i):
        w = self.data[i * SEQ:i * SEQ + SEQ + 1]
        return (w[:-1],), w[1:]


def make():
    return Bytes(Path(__file__).with_name("text.txt"))
'''


@pytest.fixture(scope="module")
def data_spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("data")
    words = ["plait", "plans", "and", "runs", "training", "on", "mixed", "clusters", "of", "GPUs."]
    text = " ".join(words[(i * 7) % len(words)] for i in range(300))
    (d / "text.txt").write_text(text)
    (d / "bytes_data.py").write_text(FACTORY)
    return f"{d / 'bytes_data.py'}:make"


def test_sample_order_is_a_seeded_permutation_per_epoch(data_spec: str) -> None:
    dataset, collate = user_data.load_data(data_spec)
    n = len(dataset)
    order = user_data.SampleOrder(n, seed=3)
    first = [order(i) for i in range(n)]
    second = [order(n + i) for i in range(n)]
    assert sorted(first) == sorted(second) == list(range(n)) and first != second
    assert first == [user_data.SampleOrder(n, seed=3)(i) for i in range(n)]  # depends on the seed only
    assert first != [user_data.SampleOrder(n, seed=4)(i) for i in range(n)]
    # Micro-batches fetched by a DataLoader worker are the positions' samples, batched along dim 0.
    got = list(user_data.batches(dataset, collate, order, [(5, 3), (8, 2)], workers=1))
    want = [user_data.samples(dataset, collate, order, 5, 3), user_data.samples(dataset, collate, order, 8, 2)]
    assert [tuple(b[0][0].shape) for b in got] == [(3, 8), (2, 8)]
    for (gi, gt), (wi, wt) in zip(got, want, strict=True):
        assert torch.equal(gi[0], wi[0]) and torch.equal(gt, wt)


def test_bad_data_specs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(user_data.DataSpecError, match="expected file.py:factory"):
        user_data.load_data("nofactory")
    (tmp_path / "d.py").write_text("def make():\n    return 3\n")
    with pytest.raises(user_data.DataSpecError, match="map-style Dataset"):
        user_data.load_data(f"{tmp_path / 'd.py'}:make")


def test_lr_schedule_follows_megatron() -> None:
    cos = LRSchedule(lr=1e-3, min_lr=1e-4, warmup=2, decay_style="cosine", decay_iters=6)
    assert [cos.at(s, 10) for s in (0, 1, 2)] == [0.0, 5e-4, 1e-3]  # linear warm-up from 0
    assert cos.at(4, 10) == pytest.approx(1e-4 + 0.5 * (math.cos(math.pi * 0.5) + 1) * 9e-4)
    assert cos.at(6, 10) == pytest.approx(1e-4) and cos.at(9, 10) == 1e-4
    lin = LRSchedule(lr=1e-3, min_lr=0.0, decay_style="linear")  # decays over the run's steps
    assert [lin.at(s, 4) for s in range(5)] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0])
    with pytest.raises(LRScheduleError, match="--min-lr"):
        LRSchedule(lr=1e-4, min_lr=1e-3)
    with pytest.raises(LRScheduleError, match="--lr-decay-style"):
        LRSchedule(lr=1e-3, decay_style="step")


# Warm-up, cosine decay to min-lr and weight decay: the schedule depends on the step alone, so the
# resumed run continues it (decay_iters is given: the first run stops at 2 of the 4 steps).
TRAIN = dict(lr=2e-3, min_lr=2e-4, lr_warmup_iters=1, lr_decay_style="cosine", lr_decay_iters=4,
             weight_decay=0.01, data_seed=1)


@pytest.mark.distributed
@pytest.mark.slow  # suite time (2026-12-08): tests/test_torch_pipeline.py's uneven shares stay
def test_uneven_dp_sees_one_process_samples_and_resumes_under_another_plan(data_spec: str, tmp_path: Path) -> None:
    train = TrainingConfig(data=data_spec, **TRAIN)
    ref, _ = reference_run(TINY, "dp=1,micro_batch=8,global_batch=8", 4, training=train)
    root = tmp_path / "ck"
    first = run(TINY, None, "dp=2,dp_shares=0.75:0.25,micro_batch=2,global_batch=8,dtype=fp32", steps=2,
                training=train, checkpoint=CheckpointConfig(dir=root, every=2),
                launch=LaunchConfig(timeout=120), records=RecordsConfig(run_dir=tmp_path / "run"))
    assert [r.samples_per_step for r in first.ranks] == [6, 2]
    for got, want in zip(first.losses, ref[:2], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    lines = (tmp_path / "run" / "losses.csv").read_text().splitlines()
    assert lines[0] == "step,loss" and [float(x.split(",")[1]) for x in lines[1:]] == first.losses
    if tensorboard_available():  # the same steps as TensorBoard scalars (plait.runtime.metrics)
        assert [v for _, v in read_scalars(tmp_path / "run" / "tensorboard", "train/loss")] == \
            pytest.approx(first.losses, rel=1e-6)
    resumed = run(TINY, None, "pp=2,micro_batch=2,global_batch=8,dtype=fp32", steps=4,
                  training=train, checkpoint=CheckpointConfig(dir=root, resume=True),
                  launch=LaunchConfig(timeout=120))
    assert resumed.steps == [2, 3]
    for got, want in zip(resumed.losses, ref[2:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
