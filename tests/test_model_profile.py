"""Model profiles (plait.ir.profile): round trip, merge of two machines, interpolation, refusals."""

from __future__ import annotations

import pytest
import yaml

from plait.ir.profile import (
    KindProfile,
    LayerCurve,
    ModelProfile,
    ProfileError,
    load_profile,
    merge_profiles,
    profile_to_dict,
    save_profile,
)

LAYERS = ["embed", "block0", "block1", "head"]


def _profile(kind: str, date: str, fwd: float) -> ModelProfile:
    curve = LayerCurve((1, 4), (fwd, 3 * fwd), (2 * fwd, 6 * fwd), (1e6, 3e6))
    return ModelProfile("gpt:layers=2", tuple(LAYERS), "fp16", "plait",
                        {kind: KindProfile({"block0": {1: curve}}, 0.01, {"date": date, "source": "measured"})})


def test_round_trip(tmp_path):
    prof = _profile("a100-80gb", "2026-12-05", 0.002)
    path = tmp_path / "p.yaml"
    save_profile(prof, path)
    assert yaml.safe_load(path.read_text())["format_version"] == 1
    back = load_profile(path, layers=LAYERS, dtype="fp16", engine="plait")
    assert back == prof


def test_interpolates_between_sizes_never_extrapolates():
    prof = _profile("a100-80gb", "2026-12-05", 0.002)
    fwd, bwd = prof.layer_time("a100-80gb", "block0", 2)
    assert fwd == pytest.approx(0.002 + (0.006 - 0.002) / 3)
    assert bwd == pytest.approx(2 * fwd)
    assert prof.layer_time("a100-80gb", "block0", 8) is None      # beyond the sweep: modelled
    assert prof.layer_time("a100-80gb", "block0", 2, tp=2) is None
    assert prof.layer_time("v100-32gb", "block0", 2) is None
    assert prof.coverage(["a100-80gb", "v100-32gb"]) == "compute measured on a100-80gb, modelled on v100-32gb"


def test_merge_from_two_machines(tmp_path):
    a, b = _profile("a100-80gb", "2026-12-01", 0.002), _profile("v100-32gb", "2026-12-02", 0.005)
    save_profile(a, tmp_path / "a.yaml")
    save_profile(b, tmp_path / "b.yaml")
    merged = merge_profiles(load_profile(tmp_path / "a.yaml"), load_profile(tmp_path / "b.yaml"))
    assert set(merged.kinds) == {"a100-80gb", "v100-32gb"}
    assert merged.layer_time("v100-32gb", "block0", 1) == (0.005, 0.010)
    newer = merge_profiles(merged, _profile("a100-80gb", "2026-12-09", 0.001))
    assert newer.layer_time("a100-80gb", "block0", 1) == (0.001, 0.002)   # the later measurement wins


def _write(tmp_path, mutate):
    data = yaml.safe_load(yaml.safe_dump(profile_to_dict(_profile("a100-80gb", "2026-12-05", 0.002))))
    mutate(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_refusals_name_file_entry_reason(tmp_path):
    path = _write(tmp_path, lambda d: None)
    with pytest.raises(ProfileError, match=r"bad.yaml: model.layers\[2\]: profiled layer block1 differs"):
        load_profile(path, layers=["embed", "block0", "mlp1", "head"])
    with pytest.raises(ProfileError, match=r"bad.yaml: dtype: profiled in fp16, the plan runs bf16"):
        load_profile(path, dtype="bf16")
    with pytest.raises(ProfileError, match=r"bad.yaml: engine: profiled through plait"):
        load_profile(path, engine="deepspeed")
    zero = _write(tmp_path, lambda d: d["kinds"]["a100-80gb"]["layers"]["block0"]["tp1"]["backward"].__setitem__(1, 0))
    with pytest.raises(ProfileError, match=r"kinds.a100-80gb.layers.block0.tp1.backward\[1\] \(micro_batch 4\): "
                                           r"expected a positive time, got 0"):
        load_profile(zero)
    neg = _write(tmp_path, lambda d: d["kinds"]["a100-80gb"].__setitem__("optimizer_step", -1.0))
    with pytest.raises(ProfileError, match=r"kinds.a100-80gb.optimizer_step: expected a positive time"):
        load_profile(neg)
    newer = _write(tmp_path, lambda d: d.__setitem__("format_version", 99))
    with pytest.raises(ProfileError, match=r"bad.yaml: format_version 99 is newer"):
        load_profile(newer)


def test_layer_cost_reads_the_profile_where_measured_and_models_elsewhere():
    from plait.cluster.catalog import GPU_KINDS
    from plait.cost.compute import ComputeModel, layer_cost
    from plait.graph.gpt_closed_form import gpt_opgraph

    graph = gpt_opgraph("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128", "fp16")
    layer = next(ly for ly in graph.layers if ly.tp_style == "transformer")
    names = [ly.name for ly in graph.layers]
    curve = LayerCurve((1, 4), (0.010, 0.040), (0.020, 0.080))
    prof = ModelProfile("gpt", tuple(names), "fp16", "plait", {"a100-80gb": KindProfile({layer.name: {1: curve}})})
    plain, measured = ComputeModel(), ComputeModel(profile=prof)
    a100, v100 = GPU_KINDS["a100-80gb"], GPU_KINDS["v100-32gb"]
    got = layer_cost(layer, graph, 2, a100, "fp16", model=measured)
    assert got.fwd.compute_s == pytest.approx(0.020) and got.bwd.compute_s == pytest.approx(0.040)
    # another kind, or a micro-batch outside the sweep: the analytic model, unchanged
    for kind, mb in ((v100, 2), (a100, 8)):
        assert layer_cost(layer, graph, mb, kind, "fp16", model=measured).fwd.compute_s == \
            pytest.approx(layer_cost(layer, graph, mb, kind, "fp16", model=plain).fwd.compute_s)


def test_amp_importer_on_small_files(tmp_path):
    import numpy as np

    from plait.cost.profile_import import import_amp_known_cost

    # 2 transformer layers: specs embed, transpose, block, block, transpose, norm, head, cast
    np.save(tmp_path / "gpt2_P3_1.npy", np.array([1e-3, 1e-4, 4e-3, 5e-3, 1e-4, 1e-4, 2e-3, 1e-4]))
    np.save(tmp_path / "gpt2_G4_2.npy", np.array([2e-3, 1e-4, 6e-3, 6e-3, 1e-4, 1e-4, 3e-3, 1e-4]))
    prof = import_amp_known_cost(tmp_path, max_micro_batch=8)
    assert prof.layer_names == ("embed", "layers.0", "layers.1", "head")
    assert prof.layer_time("v100-16gb", "layers.1", 1) == pytest.approx((5e-3, 1e-2))
    assert prof.layer_time("v100-16gb", "embed", 4) == pytest.approx((4 * 1.1e-3, 8 * 1.1e-3))
    assert prof.layer_time("t4", "head", 2, tp=2) == pytest.approx((2 * 3.3e-3, 4 * 3.3e-3))
    assert prof.layer_time("t4", "head", 2, tp=1) is None        # not shipped: modelled
    assert prof.layer_time("v100-16gb", "layers.0", 16) is None  # beyond the sweep
    save_profile(prof, tmp_path / "amp.yaml")
    assert load_profile(tmp_path / "amp.yaml") == prof
    np.save(tmp_path / "gpt2_P3_2.npy", np.array([1e-3, 1e-4, 4e-3, 1e-4, 1e-4, 2e-3, 1e-4]))
    with pytest.raises(ProfileError, match=r"gpt2_P3_2.npy: 1 transformer layers, the folder's other files have 2"):
        import_amp_known_cost(tmp_path)


def test_layer_cost_reads_the_profile_under_an_even_tensor_split():
    from plait.cluster.catalog import GPU_KINDS
    from plait.cost.compute import ComputeModel, layer_cost
    from plait.graph.gpt_closed_form import gpt_opgraph

    graph = gpt_opgraph("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128", "fp16")
    layer = next(ly for ly in graph.layers if ly.tp_style == "transformer")
    curve = LayerCurve((1, 4), (0.010, 0.040), (0.020, 0.080))
    prof = ModelProfile("gpt", tuple(ly.name for ly in graph.layers), "fp16", "plait",
                        {"t4": KindProfile({layer.name: {2: curve}})})
    t4 = GPU_KINDS["t4"]
    even = layer_cost(layer, graph, 1, t4, "fp16", tp=2, share=0.5, model=ComputeModel(profile=prof))
    assert even.fwd.compute_s == pytest.approx(0.010)
    assert even.fwd.collectives                      # priced apart: the profile does not include them
    uneven = layer_cost(layer, graph, 1, t4, "fp16", tp=2, share=0.7, model=ComputeModel(profile=prof))
    assert uneven.fwd.compute_s != pytest.approx(0.010)  # an uneven split was not measured: modelled


def test_sailor_importer_on_a_small_file(tmp_path):
    import json

    from plait.cost.profile_import import import_sailor_profiles

    def layers(scale):  # embedding, 2 blocks, head: [forward, backward, update]
        return {"0": [1e-3 * scale, 0.0, 5e-3], "1": [4e-3 * scale, 8e-3 * scale, 5e-3],
                "2": [4e-3 * scale, 8e-3 * scale, 5e-3], "3": [2e-3 * scale, 3e-3 * scale, 5e-3]}

    data = {"OPT-350": {"A100-40": {"1": {"1": layers(1), "2": layers(0.6)}, "4": {"1": layers(3)}},
                        "RTX-2080": {"2": {"1": layers(5)}}},
            "other": {}}
    path = tmp_path / "profiles_tmp.json"
    path.write_text(json.dumps(data))
    prof = import_sailor_profiles(path, "OPT-350")
    assert prof.layer_names == ("embed", "layers.0", "layers.1", "head")
    assert set(prof.kinds) == {"a100-40gb", "rtx-2080"}
    assert prof.layer_time("a100-40gb", "layers.1", 2) == pytest.approx((4e-3 * 5 / 3, 8e-3 * 5 / 3))  # 1..4
    assert prof.layer_time("a100-40gb", "embed", 1) == pytest.approx((1e-3, 1e-6))   # 0.0 -> the floor
    assert prof.layer_time("a100-40gb", "head", 1, tp=2) == pytest.approx((1.2e-3, 1.8e-3))
    assert prof.layer_time("a100-40gb", "head", 4, tp=2) is None                     # tp2 measured at 1 only
    assert prof.layer_time("rtx-2080", "layers.0", 1) is None and prof.collectives_included("rtx-2080")
    save_profile(prof, tmp_path / "sailor.yaml")
    assert load_profile(tmp_path / "sailor.yaml") == prof
    with pytest.raises(ProfileError, match=r"profiles_tmp.json: GPT-3: no such model in the file"):
        import_sailor_profiles(path, "GPT-3")
    data["OPT-350"]["A100-40"]["4"]["1"]["2"][1] = -1.0
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"OPT-350.A100-40.4.1.2: backward: expected a non-negative time"):
        import_sailor_profiles(path, "OPT-350")
