"""Honest compute slowdown of emulated GPU kinds."""

from __future__ import annotations

from typing import Any

import pytest

from plait.cluster.spec import Device, EmulationSpec, GPUKind
from plait.runtime.emulate import (
    EmulationError,
    compute_slowdown,
    extra_time,
    slowdowns,
)

# Datasheet dense peaks (NVIDIA A100 and V100 datasheets): V100 has no bf16 unit.
A100 = GPUKind("a100-80g", {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}, 80 * 2**30, 2.0e12)
V100 = GPUKind("v100-32g", {"fp32": 15.7e12, "fp16": 125e12}, 32 * 2**30, 0.9e12)


class KindsCluster:
    def __init__(self, kinds: list[GPUKind], emulation: EmulationSpec | None = None) -> None:
        self.name, self.source = "mixed", "<test>"
        self.devices = [Device(i, i // 2, i % 2, k) for i, k in enumerate(kinds)]
        self.emulation = emulation


def test_datasheet_ratio_default_bf16() -> None:
    c = KindsCluster([A100, A100, V100, V100])
    assert compute_slowdown(c, 0) == 1.0
    # bf16 on a V100 runs at its fp32 rate (no bf16 unit): 312 / 15.7.
    assert compute_slowdown(c, 2) == pytest.approx(312e12 / 15.7e12)
    assert compute_slowdown(c, 3, "fp16") == pytest.approx(312 / 125)
    assert compute_slowdown(c, 3, "fp32") == pytest.approx(19.5 / 15.7)
    assert slowdowns(c, "fp16") == pytest.approx([1, 1, 2.496, 2.496])


def test_homogeneous_is_one_and_explicit_factors_win() -> None:
    assert slowdowns(KindsCluster([V100, V100])) == [1.0, 1.0]
    c = KindsCluster([A100, V100], EmulationSpec(slowdown={"v100-32g": 3.0}))
    assert compute_slowdown(c, 1) == 3.0 and compute_slowdown(c, 0) == 1.0
    off = KindsCluster([A100, V100], EmulationSpec(enabled=False))
    assert compute_slowdown(off, 1) == 1.0


def test_bad_inputs_name_the_field() -> None:
    c = KindsCluster([A100, V100], EmulationSpec(slowdown={"v100-32g": 0.5}))
    with pytest.raises(EmulationError, match="emulation.slowdown.v100-32g"):
        compute_slowdown(c, 1)
    with pytest.raises(EmulationError, match="no device 7"):
        compute_slowdown(c, 7)
    with pytest.raises(EmulationError):
        extra_time(1.0, 0.9)


def test_extra_time_stretches_the_span() -> None:
    assert extra_time(0.01, 3.0) == pytest.approx(0.02)
    assert extra_time(0.01, 1.0) == 0.0
    assert extra_time(-1.0, 2.0) == 0.0


def test_a_compute_span_records_its_cpu_seconds_apart_from_the_stretch() -> None:
    """`Recorder.compute` stores the span's thread CPU seconds (`cpu_s`): a span that sleeps half its
    time and spins the other half has cpu_s about the spin. With one intra-op thread (a CPU rank of
    `plait run`) the sleep is a wait, not compute -- as DDP's backward waiting at its end for the
    gradient all-reduces -- so the work (`compute_s`) is the spin and only it is stretched (factor
    2); with more threads the span's wall less its calls is the work, as before."""
    import time

    import torch

    from plait.runtime.recorder import Recorder

    def span(rec: Recorder) -> Any:
        with rec.compute("forward", "forward"):
            time.sleep(0.05)
            end = time.thread_time() + 0.05
            while time.thread_time() < end:
                pass
        return rec.events[-1]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ev = span(Recorder(0, 0, 0, slowdown=2.0))
        assert 0.05 <= ev.args["cpu_s"] < 0.08
        assert ev.args["compute_s"] <= ev.args["cpu_s"] < 0.1   # the sleep is not work
        assert ev.duration >= 0.05 + 2 * ev.args["compute_s"] - 1e-3  # the sleep once, the spin twice
        torch.set_num_threads(2)
        ev = span(Recorder(0, 0, 0, slowdown=2.0))
        assert ev.args["compute_s"] >= 0.1 and ev.duration >= 2 * ev.args["compute_s"] - 1e-3
    finally:
        torch.set_num_threads(before)
