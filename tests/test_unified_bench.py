"""Smoke test of bench/unified.py's core on a tiny case (the driver over every family)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import unified  # noqa: E402


def test_tiny_case_reports_every_family_and_the_exhaustive_check():
    case = unified.Case("tiny", "gpt:layers=2,hidden=64,heads=2,seq=16,vocab=128",
                        "a100-80gb:nodes=1,gpus_per_node=4", 8, True)
    row = unified.run_case(case, finalists=2, exhaustive=True)
    from plait.search import FAMILIES

    assert set(row["families"]) <= set(FAMILIES) and "3d" in row["families"]
    assert row["pick_family"] in row["families"]
    best_single = min(f["best_s"] for f in row["families"].values() if f["best_s"] is not None)
    assert row["pick_s"] == best_single  # a pick is some family's best until families compose
    assert row["pick_vs_exhaustive"] >= 1.0 - 1e-9  # exhaustive can only be as good or better
    assert row["memory_margin_bytes"] > 0
