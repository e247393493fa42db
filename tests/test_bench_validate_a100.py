"""bench/validate_a100.py's error floor (`--floor`): the monotone linear programme and the
recompute floor of a layer, on hand-made rows."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "validate_a100.py"


@pytest.fixture(scope="module")
def va():
    spec = importlib.util.spec_from_file_location("bench_validate_a100", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_validate_a100"] = module
    spec.loader.exec_module(module)
    return module


def _rows(layer_ms: dict[int, float], rest_ms: float = 3.0) -> list[dict]:
    """pp = 1 rows of h = 1024, tp = 1, exactly c0 + g rest + g L layer (+ 0.1 ms per layer per step)."""
    rows = []
    for mb, layer in layer_ms.items():
        for dp in (1, 2):
            for layers in (12, 16, 20, 24):
                for gb in (8, 16, 32):
                    g = gb // (dp * mb)
                    t = 5.0 + 0.1 * layers + g * rest_ms + g * layers * layer
                    rows.append(dict(index=len(rows), gpus=dp, global_batch=gb, micro_batch=mb, hidden=1024,
                                     heads=16, layers=layers, seq=1024, tp=1, dp=dp, pp=1, measured_s=t / 1e3))
    return rows


def test_monotone_data_has_a_zero_floor(va) -> None:
    floor, cells = va.monotone_floor(_rows({1: 3.0, 2: 3.5}))
    assert floor == pytest.approx(0.0, abs=1e-6)
    c2, v, c1, u = cells[(1024, 1, 2)]
    assert c2 == pytest.approx(3.5e-3) and v == pytest.approx(3.5e-3, rel=1e-6)
    assert c1 == pytest.approx(3.0e-3) and u == pytest.approx(3.0e-3, rel=1e-6)


def test_a_layer_time_that_falls_with_the_micro_batch_leaves_a_floor(va) -> None:
    # micro-batch 2 measured faster per layer than micro-batch 1: no monotone model matches both
    floor, cells = va.monotone_floor(_rows({1: 3.0, 2: 2.5}))
    assert floor > 0.5
    v1, v2 = cells[(1024, 1, 1)][1], cells[(1024, 1, 2)][1]
    assert v1 <= v2 + 1e-12
    u1, u2 = cells[(1024, 1, 1)][3], cells[(1024, 1, 2)][3]
    assert u1 <= u2 + 1e-12


def test_recompute_floor_adds_one_forward(va) -> None:
    none, full = va.recompute_floor(2048, 1, 4)
    # forward ~ 1/3 of forward + backward (backward: two GEMMs per forward GEMM), so full ~ 4/3
    assert 1.25 < full / none < 1.40
    # at the ceilings the GEMM FLOPs alone take 6 x 24 b s h^2 / (0.859 x 312 TFLOP/s) for none
    gemm_only = 3 * (24 * 4 * 1024 * 2048**2 + 4 * 4 * 1024**2 * 2048) / (0.859 * 312e12)
    assert none > gemm_only


def _pipeline_rows(layer_ms: dict[int, float], rest_ms: dict[int, float]) -> list[dict]:
    """h = 1024, tp = 1, micro-batch 1 rows of 1F1B pipelines: (g + pp - 1)(rest + L / pp layer) + a dp term."""
    rows = []
    for pp, layer in layer_ms.items():
        for dp in (1, 2):
            for layers in (12, 16, 20, 24):
                for gb in (8, 16, 32):
                    g = gb // dp
                    t = 5.0 * dp + 0.1 * layers + (g + pp - 1) * (rest_ms[pp] + layers / pp * layer)
                    rows.append(dict(index=len(rows), gpus=dp * pp, global_batch=gb, micro_batch=1, hidden=1024,
                                     heads=16, layers=layers, seq=1024, tp=1, dp=dp, pp=pp, measured_s=t / 1e3))
    return rows


def test_pp_invariance_recovers_each_depths_layer_and_slot_rest(va) -> None:
    inv = va.pp_invariance(_pipeline_rows({1: 3.0, 2: 4.0}, {1: 6.8, 2: 6.3}))
    cell = inv[(1024, 1, 1)]
    assert cell[1][0] == pytest.approx(3.0e-3) and cell[1][1] == pytest.approx(6.8e-3)
    assert cell[2][0] == pytest.approx(4.0e-3) and cell[2][1] == pytest.approx(6.3e-3)  # a recomputing stage: slower
    assert max(v[2] for v in cell.values()) < 1e-9
