"""`bench/gpu_check.py`'s engine-path rows (issue 30 item 4), held without a GPU: the cases it
runs on CUDA reach every engine `plait.runtime.engine_for` names (several GPUs) and each one-rank
form (one GPU), and the simulator prices every one of them (the rows' predicted step and memory)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_gpu_check", Path(__file__).parents[1] / "bench" / "gpu_check.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_gpu_check"] = bench
_spec.loader.exec_module(bench)

TINY = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128"


@pytest.mark.parametrize("gpus, engines", [
    (4, {"torch", "pipeline", "spmd", "compose"}),
    (2, {"torch", "pipeline", "spmd", "compose"}),
    (1, {"torch", "pipeline", "spmd"}),
])
def test_engine_cases_reach_every_engine_and_are_priced(gpus: int, engines: set[str]) -> None:
    from plait.cluster import load_cluster
    from plait.runtime import ENGINES, engine_for
    from plait.sim.api import simulate

    cluster = load_cluster(f"h100-80gb:nodes=1,gpus_per_node={gpus}")
    cases = bench.engine_cases(TINY, cluster, gpus, 8, "bf16")
    assert len({label for label, *_ in cases}) == len(cases)
    named = set()
    for label, plan, engine, dtype in cases:
        verdict = engine_for(plan, {"engine": engine, "dtype": dtype})
        assert verdict.ok, (label, verdict.reason)
        named.add(verdict.engine)
        sim = simulate(TINY, cluster, plan)
        assert sim.iteration_time_s > 0 and sim.memory_peak_bytes and max(sim.memory_peak_bytes) > 0, label
    assert named == engines and engines <= set(ENGINES)
    if gpus > 1:  # torch's modules by default; plait's own TP and PP executors asked for by engine=plait
        assert {e for _, _, e, _ in cases} == {"auto", "plait"}
        torch_forms = {label for label, plan, e, d in cases if engine_for(plan, {"engine": e, "dtype": d}).engine == "torch"}
        assert {"DDP", "FSDP2 (ZeRO-3)", "DTensor TP", "pipelining 1F1B"} <= torch_forms
