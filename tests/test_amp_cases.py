"""The AMP bench's translation of AMP's trials into plait plans (bench/amp_cases.py)."""

import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import amp_cases  # noqa: E402


def test_partition_maps_pipe_specs_to_plait_layers():
    # one stage: every plait layer (embedding, 24 blocks, head)
    assert amp_cases.partition_to_split([0, 30]) == [26]
    # [0, 14, 30]: specs 0-13 hold the embedding and blocks 0-11; the rest blocks 12-23 and the head
    assert amp_cases.partition_to_split([0, 14, 30]) == [13, 13]
    # a stage of only the transpose spec holds no plait layer
    assert amp_cases.partition_to_split([0, 1, 2, 30]) is None
    assert sum(amp_cases.partition_to_split([0, 5, 9, 12, 15, 18, 21, 24, 30])) == 26


def test_every_trial_is_read_and_expressible_trials_are_valid_plans():
    trials = yaml.safe_load((amp_cases.DATA / "amp_trials.yaml").read_text())
    assert len(trials["homogeneous"]) == 52 and len(trials["het_cluster"]) == 53
    for t in trials["homogeneous"] + trials["het_cluster"]:
        assert t["dp"] * t["tp"] * t["pp"] == 16
        p = amp_cases.trial_plan(t)
        if p is not None:
            assert p.world_size == 16 and p.global_batch == 32 and p.grad_bucket_mb == 0
