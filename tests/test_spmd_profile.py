"""Issue 28: an SPMD program's op costs read the model profile's measured layer times (each op of a
profiled layer scaled by the layer's measured over modelled time, so it keeps its share of the
layer), the analytic model elsewhere, and the plan says which."""

from __future__ import annotations

import numpy as np
import pytest

from plait.cluster import load_cluster
from plait.cost.program import Problem, Synthesis, evaluate
from plait.cost.spmd import Devices
from plait.ir.profile import KindProfile, LayerCurve, ModelProfile, model_signature, save_profile
from plait.planners.threed import load_graph
from plait.sim.replay import capture, model_spec

MODEL = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"
CLUSTER = """
name: pair
nodes:
  - {name: a, gpus: {kind: a100-80gb, count: %d}}
model_profiles: [p.yaml]
"""


def _setup(tmp_path, n: int, times: dict[str, float], batch: int = 4):
    """A cluster of `n` A100s whose profile has `times[layer]` forward seconds at every size of
    1..8 samples (backward twice that), and the model's aten graph at `batch`."""
    _, opgraph = load_graph(MODEL, "fp32")
    layers = {name: {1: LayerCurve((1, 8), (t, t), (2 * t, 2 * t))} for name, t in times.items()}
    prof = ModelProfile(model_signature(opgraph), tuple(ly.name for ly in opgraph.layers), "fp32", "plait",
                        {"a100-80gb": KindProfile(layers, None, {"date": "2026-12-05", "source": "measured"})})
    save_profile(prof, tmp_path / "p.yaml")
    (tmp_path / "c.yaml").write_text(CLUSTER % n)
    cluster = load_cluster(str(tmp_path / "c.yaml"))
    return cluster, cluster.model_profiles[0], capture(model_spec(MODEL, "test"), batch, "fp32")


def test_op_work_reads_measured_layer_times_and_keeps_each_ops_share(tmp_path):
    cluster, prof, graph = _setup(tmp_path, 2, {"layers.0": 0.010, "layers.1": 0.030})
    devices = Devices.from_cluster(cluster, "fp32")
    plain = Problem.build(graph, devices)
    got = Problem.build(graph, devices, profile=prof)
    b = graph.batch / devices.n   # each device's work: 2 of the 4 samples
    for layer, t in (("layers.0", 0.010), ("layers.1", 0.030)):
        ks = [k for k, op in enumerate(graph.ops) if op.layer == layer]
        # the layer's work on each device at 2 samples is the measured forward + backward
        assert np.sum([got.work[k] for k in ks], axis=0) * b / graph.batch == pytest.approx([3 * t, 3 * t])
        assert got.measured[ks].all()
        # each op keeps its share of the layer's modelled work
        w_plain = np.array([plain.work[k][0] for k in ks])
        w_got = np.array([got.work[k][0] for k in ks])
        assert w_got == pytest.approx(w_plain * (w_got.sum() / w_plain.sum()))
    for k, op in enumerate(graph.ops):   # layers the profile lacks: modelled, unchanged
        if op.layer in ("embed", "head"):
            assert got.work[k] == pytest.approx(plain.work[k]) and not got.measured[k].any()
    assert got.costs.startswith("compute partly measured on a100-80gb (2 of 4 layers)")
    assert plain.costs == "compute modelled per aten op" and plain.measured is None


def test_simulated_spmd_step_is_the_measured_compute(tmp_path):
    """One device, no collectives, no fixed costs: the step is the sum of the ops' work plus the
    optimizer; a profile of every layer makes the compute the measured sum exactly."""
    from plait.sim.api import simulate_spmd

    times = {"embed": 0.002, "layers.0": 0.010, "layers.1": 0.030, "head": 0.004}
    cluster, prof, graph = _setup(tmp_path, 1, times)
    devices = Devices.from_cluster(cluster, "fp32")
    res = {}
    for name, p in (("plain", None), ("measured", prof)):
        problem = Problem.build(graph, devices, profile=p)
        program = evaluate(problem, [0] * len(graph.ops), np.array([1.0]))   # one device: one way
        syn = Synthesis(program, np.array([1.0]), program.cost, None)
        res[name] = simulate_spmd(problem, syn, cluster, bucket_bytes=None, batch=4, fixed_costs=False)
        modelled = sum(float(w[0]) for w in problem.work)
    plain_compute = sum(float(w[0]) for w in Problem.build(graph, devices).work)
    # at 4 samples on one device: 3 t per layer (forward t, backward 2 t)
    assert modelled == pytest.approx(3 * sum(times.values()))
    assert res["measured"].iteration_time_s - res["plain"].iteration_time_s == \
        pytest.approx(3 * sum(times.values()) - plain_compute, rel=1e-6)


def test_a_plan_with_an_spmd_program_says_what_was_measured(tmp_path):
    from plait.sim.api import simulate
    from plait.spmd.program_plan import program_plan
    from plait.spmd.ratios import synthesize

    cluster, prof, graph = _setup(tmp_path, 2, {n: 0.02 for n in ("embed", "layers.0", "layers.1", "head")})
    problem = Problem.build(graph, Devices.from_cluster(cluster, "fp32"))
    syn = synthesize(problem, max_states=2000)
    ratios = syn.segment_ratios if syn.segment_ratios is not None else syn.ratios
    plan = program_plan(syn.program.strategies, ratios, 4, model=MODEL)
    got = simulate(MODEL, cluster, plan)
    assert got.costs.startswith("compute measured on a100-80gb (profile ")
    # 4 layers of 0.06 s forward + backward at 2 samples: the slower device computes at least
    # half of the 4 samples' 0.48 s (all of it where every op ran redundantly)
    assert 0.24 * 0.99 <= got.iteration_time_s < 0.48 * 1.5
