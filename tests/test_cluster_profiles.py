"""`model_profiles:` in a cluster YAML (issue 28): every compute model built for the cluster
carries the profile of the model planned; bad profiles are refused in one line before any work."""

from __future__ import annotations

import pytest
import yaml

from plait.cluster import load_cluster
from plait.cluster.loader import dump_cluster, parse_yaml_text
from plait.cluster.spec import ClusterError
from plait.ir.profile import (
    KindProfile,
    LayerCurve,
    ModelProfile,
    ProfileError,
    model_signature,
    profile_to_dict,
    save_profile,
)
from plait.planners.types import load_graph

MODEL = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"
CLUSTER = """
name: two
nodes:
  - {name: a, gpus: {kind: a100-80gb, count: 1}}
  - {name: v, gpus: {kind: v100-32gb, count: 1}}
model_profiles: [%s]
"""


def _profile(graph, dtype="fp16", fwd=0.05, kind="a100-80gb") -> ModelProfile:
    curve = LayerCurve((1, 8), (fwd, 8 * fwd), (2 * fwd, 16 * fwd))
    layers = {ly.name: {1: curve} for ly in graph.layers}
    return ModelProfile(model_signature(graph), tuple(ly.name for ly in graph.layers), dtype, "plait",
                        {kind: KindProfile(layers, None, {"date": "2026-12-05", "source": "measured"})})


def _cluster(tmp_path, *profiles: ModelProfile):
    names = []
    for i, prof in enumerate(profiles):
        save_profile(prof, tmp_path / f"p{i}.yaml")
        names.append(f"p{i}.yaml")
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER % ", ".join(names))
    return path


def test_cluster_names_profiles_relative_to_its_file_and_round_trips(tmp_path):
    _, graph = load_graph(MODEL, "fp16")
    path = _cluster(tmp_path, _profile(graph), _profile(graph, kind="v100-32gb", fwd=0.09))
    cluster = load_cluster(str(path))
    assert [set(p.kinds) for p in cluster.model_profiles] == [{"a100-80gb"}, {"v100-32gb"}]
    again = parse_yaml_text(dump_cluster(cluster), "again.yaml")   # absolute paths written back
    assert again == cluster
    from plait.cluster.topology import without_nodes

    assert without_nodes(cluster, [1]).model_profiles == cluster.model_profiles   # a re-plan keeps them


def test_simulate_reads_the_clusters_merged_profile(tmp_path):
    from plait.sim.api import simulate

    _, graph = load_graph(MODEL, "fp16")
    plain = simulate(MODEL, load_cluster(str(_cluster(tmp_path))), "dp=2,micro_batch=2,global_batch=4,dtype=fp16")
    both = _cluster(tmp_path, _profile(graph), _profile(graph, kind="v100-32gb", fwd=0.09))
    got = simulate(MODEL, load_cluster(str(both)), "dp=2,micro_batch=2,global_batch=4,dtype=fp16")
    # every layer measured: on the slower V100 rank 4 layers x (0.09 + 0.18) s per sample x 2 samples
    assert 4 * 0.27 * 2 <= got.iteration_time_s < 4 * 0.27 * 2 * 1.05
    assert plain.iteration_time_s < 0.1 * got.iteration_time_s


def test_bad_profiles_refused_in_one_line_before_any_work(tmp_path):
    _, graph = load_graph(MODEL, "fp16")
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER % "missing.yaml")
    with pytest.raises(ClusterError, match=r"cluster.yaml: model_profiles\[0\]: no such profile file"):
        load_cluster(str(path))
    data = profile_to_dict(_profile(graph))
    data["format_version"] = 99
    (tmp_path / "new.yaml").write_text(yaml.safe_dump(data))
    path.write_text(CLUSTER % "new.yaml")
    with pytest.raises(ProfileError, match=r"new.yaml: format_version 99 is newer"):
        load_cluster(str(path))
    data = profile_to_dict(_profile(graph))
    data["kinds"]["a100-80gb"]["layers"]["layers.0"]["tp1"]["forward"][0] = -1.0
    (tmp_path / "neg.yaml").write_text(yaml.safe_dump(data))
    path.write_text(CLUSTER % "neg.yaml")
    with pytest.raises(ProfileError, match=r"neg.yaml: kinds.a100-80gb.layers.layers.0.tp1.forward\[0\]"):
        load_cluster(str(path))


def test_a_profile_of_another_model_dtype_or_engine_is_refused(tmp_path):
    from plait.sim.api import simulate

    _, other = load_graph("gpt:layers=3,hidden=64,heads=4,seq=32,vocab=128", "fp16")
    plan = "dp=2,micro_batch=2,global_batch=4,dtype=fp16"
    cluster = load_cluster(str(_cluster(tmp_path, _profile(other))))
    with pytest.raises(ProfileError, match=r"p0.yaml: model.layers\[3\]: profiled layer layers.2 differs "
                                           r"from the model's head"):
        simulate(MODEL, cluster, plan)
    _, longer = load_graph("gpt:layers=2,hidden=64,heads=4,seq=64,vocab=128", "fp16")
    cluster = load_cluster(str(_cluster(tmp_path, _profile(longer))))
    with pytest.raises(ProfileError, match=r"p0.yaml: model.signature: profiled 'gpt:layers=4:"):
        simulate(MODEL, cluster, plan)
    _, graph = load_graph(MODEL, "fp16")
    cluster = load_cluster(str(_cluster(tmp_path, _profile(graph, dtype="bf16"))))
    with pytest.raises(ProfileError, match=r"p0.yaml: dtype: profiled in bf16, the plan runs fp16"):
        simulate(MODEL, cluster, plan)


def test_a_plan_row_and_simulate_say_what_was_measured(tmp_path, capsys, monkeypatch):
    from rich.console import Console

    from plait.api import plan
    from plait.cli import main
    from plait.commands.plan_cmd import plan_table

    _, graph = load_graph(MODEL, "fp16")
    path = _cluster(tmp_path, _profile(graph))   # the A100 measured, the V100 not
    result = plan(MODEL, str(path), global_batch=4, top=2, families="3d", space=None)
    row = result.top[0]
    assert row.sim["costs"].startswith("compute measured on a100-80gb, modelled on v100-32gb (profile ")
    table, _ = plan_table(result, None)
    console = Console(width=250, record=True)
    console.print(table)
    assert "measured on a100-80gb, modelled on v100-32gb" in console.export_text()
    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["simulate", "--model", MODEL, "--cluster", str(path), "--plan",
                 "dp=2,micro_batch=2,global_batch=4,dtype=fp16"]) == 0
    assert "compute measured on a100-80gb, modelled on v100-32gb" in capsys.readouterr().out


def test_plait_profile_model_round_trips_and_simulate_uses_it(tmp_path):
    from plait.cli import main
    from plait.ir.profile import load_profile
    from plait.sim.api import simulate

    out = tmp_path / "gpt.yaml"
    assert main(["profile", "--model", MODEL, "--micro-batches", "1,2", "--repeats", "3", "--out", str(out)]) == 0
    _, graph = load_graph(MODEL, "fp32")
    prof = load_profile(out, layers=[ly.name for ly in graph.layers], dtype="fp32", engine="plait")
    assert prof.signature == model_signature(graph)
    # the default emulated cluster: one A100 and one V100 kind, the V100's times its slowdown
    a, v = prof.layer_time("a100-80gb", "layers.0", 2), prof.layer_time("v100-32gb", "layers.0", 2)
    factor = float(prof.kinds["v100-32gb"].meta["slowdown"])
    assert factor > 1 and v == pytest.approx((a[0] * factor, a[1] * factor))
    cluster = tmp_path / "c.yaml"
    cluster.write_text(CLUSTER % "gpt.yaml" + "emulation: {enabled: true}\n")
    res = simulate(MODEL, load_cluster(str(cluster)), "dp=2,micro_batch=2,global_batch=4,dtype=fp32")
    assert res.costs.startswith("compute measured on a100-80gb, v100-32gb")
    each = {n: sum(prof.layer_time("v100-32gb", n, 2)) for n in prof.layer_names}
    # the slower rank's measured layers (the lowering prices equal transformer blocks at one
    # block's time, so at least the cheaper block's twice), plus the step
    blocks = [each[n] for n in prof.layer_names if n.startswith("layers.")]
    assert res.iteration_time_s > each["embed"] + each["head"] + len(blocks) * min(blocks)


def _per_layer_profile(graph, times: list[float], kind: str) -> ModelProfile:
    layers = {ly.name: {1: LayerCurve((1, 8), (t, 8 * t), (2 * t, 16 * t))} for ly, t in zip(graph.layers, times)}
    return ModelProfile(model_signature(graph), tuple(ly.name for ly in graph.layers), "fp16", "plait",
                        {kind: KindProfile(layers, None, {"date": "2026-12-05", "source": "measured"})})


def test_equal_shaped_layers_measured_apart_are_priced_apart(tmp_path):
    """Two equal-shaped transformer blocks with different profiled times: the simulated step and
    the graph planner's stage pre-screen both read each block's own time (before: both blocks were
    priced at the first one's, the cost caches keyed equal shapes together)."""
    from plait.cost.compute import ComputeModel
    from plait.planners.graph_cost import StageCost
    from plait.sim.api import simulate

    _, graph = load_graph(MODEL, "fp16")
    assert [ly.tp_style for ly in graph.layers] == ["embedding", "transformer", "transformer", "head"]
    got = {}
    for slow in (0.05, 0.15):
        times = [0.01, 0.05, slow, 0.01]
        sub = tmp_path / str(slow)
        sub.mkdir()
        cluster = load_cluster(str(_cluster(sub, *(_per_layer_profile(graph, times, k)
                                                   for k in ("a100-80gb", "v100-32gb")))))
        got[slow] = simulate(MODEL, cluster, "dp=2,micro_batch=2,global_batch=4,dtype=fp16").iteration_time_s
        # one micro-batch of 2 per rank: every layer's (fwd + bwd) = 3 t per sample x 2 samples
        assert 6 * sum(times) <= got[slow] < 6 * sum(times) * 1.05
        prof = cluster.model_profiles[0]
        stage = StageCost(graph, cluster, global_batch=4, dtype="fp16", compute=ComputeModel(profile=prof),
                          memory=False)
        assert stage.layer_time(graph.layers[2].name, "a100-80gb", 2) == pytest.approx(6 * slow)
        assert stage.layer_time(graph.layers[1].name, "a100-80gb", 2) == pytest.approx(6 * 0.05)
    assert got[0.15] - got[0.05] == pytest.approx(6 * 0.10, rel=0.05)
