"""Smoke test of bench/hap.py's core: one tiny case, every column simulated, memory checked."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "hap.py"


@pytest.fixture(scope="module")
def hap():
    spec = importlib.util.spec_from_file_location("bench_hap", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_hap"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_one_tiny_case(hap) -> None:
    cluster, dtype = hap.quick_clusters()[1]  # one A100 and one T4 in a node
    label, spec_text, per_gpu = hap.QUICK_MODELS[0]  # a small VGG
    batch = per_gpu[1] * len(cluster.devices)
    case = hap.run_case(cluster, cluster.name, label, spec_text, batch, dtype, max_states=2000)
    row = case.row
    for key in ("even_ms", "prop_ms", "hap_ms", "plait_ms", "bound_ms"):
        assert row[key] > 0
    assert row["bound_ms"] < min(row["even_ms"], row["plait_ms"])  # nothing beats perfect balance
    assert row["prop_ms"] < row["even_ms"]  # the T4 holds back even shares of a compute-bound model
    assert row["fits"]["plait"] and row["fits"]["even"]
    assert row["best_ms"] == min(row["plait_ms"], row["prop_ms"])  # plait's pick across families
    assert row["speedup_even"] == pytest.approx(row["even_ms"] / row["best_ms"])
    assert row["hap_flag"] in ("padded", "grouped")
    assert row["plait_states"] > 0 and row["hap_states"] > 0
    table = hap.table([row])
    assert label in table and "bound" in table
    s = hap.summary([row])
    assert s["cases"] == 1 and s["hap_plans_over_memory"] in (0, 1)


def test_ddp_baseline_is_ddp(hap) -> None:
    """DDP: every device runs the whole graph of its own samples (integer shares), and the only
    collectives are the parameters' gradient all-reduces."""
    import numpy as np

    from plait.cost.spmd import Devices
    from plait.graph.zoo import load_model

    cluster, dtype = hap.quick_clusters()[1]
    spec = load_model(hap.QUICK_MODELS[0][1])
    devices = Devices.from_cluster(cluster, dtype)
    problem, syn, scale = hap.ddp(spec, 30, devices, np.array([2.0, 1.0]), dtype)
    assert list(scale * 15) == [20, 10]  # 30 samples 2:1, the graph captured at 15
    assert {(c.op, c.phase) for _, c in syn.program.comms} == {("all_reduce", "bwd")}
    assert {c.tensor for _, c in syn.program.comms} == set(problem.graph.params)
    assert not any(s.splits_work for s in syn.program.strategies.values())
    assert syn.memory[0] > syn.memory[1]  # more samples, more activations


def test_dp_floor_is_the_gradients_crossing_the_nics_and_ddp_does_not_beat_it(hap) -> None:
    """`dp_floor` on two nodes of two GPUs (one 10.4 Gb/s NIC each): at least every gradient byte
    through a NIC once each way (ring-optimal ``2 (k-1)/k S / B`` with k = 2 nodes), and DDP
    simulated on the same cluster is not faster; 0 on one node."""
    import numpy as np

    from plait.cost.spmd import Devices
    from plait.graph.zoo import load_model
    from plait.sim.api import simulate_spmd

    (two_nodes, dtype), (one_node, _) = hap.quick_clusters()
    spec = load_model(hap.QUICK_MODELS[0][1])
    devices = Devices.from_cluster(two_nodes, dtype)
    local, syn, scale = hap.ddp(spec, 32, devices, np.ones(devices.n), dtype)
    nbytes = hap.param_bytes(spec, dtype)
    assert nbytes == 4 * sum(local.graph.tensors[t].numel for t in local.graph.params)  # no tied weights here
    floor = hap.dp_floor(nbytes, two_nodes)
    assert floor >= nbytes / (10.4e9 / 8) * (1 - 1e-9)
    ddp_s = simulate_spmd(local, syn, two_nodes, batch=32, device_scale=scale).iteration_time_s
    assert floor <= ddp_s
    assert hap.dp_floor(nbytes, one_node) == 0.0
