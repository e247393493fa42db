"""Plan files written by an earlier plait load with today's one plan form, or are refused in one line
naming the field.

tests/data/plans_format1/ holds one plan file of each form as commit 3f3ba62 wrote them (before the
SPMD program was typed, `plait.ir.program.SpmdProgram`; README.txt there says how): the 3D form
with every refinement, a graph pipeline, an SPMD program and a pipeline of SPMD stages (composed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.ir.plan import Plan, PlanError, StageSpec
from plait.ir.program import SpmdProgram, Strategy

OLD = Path(__file__).parent / "data" / "plans_format1"
FORMS = ("threed", "graph", "spmd", "composed")

# The model and cluster each file was planned for (README.txt).
THREED = ("gpt:layers=8,hidden=64,heads=2,seq=16,vocab=128", "emulated-mixed")
GRAPH = ("mmt:branches=2,layers=2,hidden=64,heads=4,seq=16,in_dim=16,dropout=0,attn_dropout=0",
         "a100-80g:nodes=1,gpus_per_node=4")
SPMD = ("bert:layers=1,hidden=32,heads=4,seq=8,vocab=64,dropout=0,attn_dropout=0", "emulated-mixed:gpus_per_node=1")
COMPOSED = ("gpt:layers=1,hidden=64,heads=2,seq=16,vocab=128", "a100-80g:nodes=2,gpus_per_node=2")


def _raw(form: str) -> dict:
    return json.loads((OLD / f"{form}.json").read_text())


@pytest.mark.parametrize("form", FORMS)
def test_an_old_plan_file_loads_and_round_trips(form):
    path = OLD / f"{form}.json"
    plan = Plan.load(str(path))
    assert Plan.from_json(plan.to_json()) == plan
    again = json.loads(plan.to_json())  # written again in format 2: each stage's program typed
    old = _raw(form)
    assert again["format_version"] == 2 and {k: v for k, v in again.items() if k not in ("format_version", "stages")} \
        == {k: v for k, v in old.items() if k not in ("format_version", "stages")}
    for new, was in zip(again["stages"], old["stages"]):
        kept = {k: v for k, v in was.items() if k not in ("dp", "tp", "dp_shares", "tp_ratios", "spmd")}
        assert {k: v for k, v in new.items() if k != "program"} == kept
        program = new["program"]
        if "spmd" in was:
            assert program == {"kind": "spmd", **was["spmd"]}
        else:
            assert program == {"kind": "tensor_parallel", "dp": was["dp"], "tp": was["tp"],
                               **{k: was[k] for k in ("dp_shares", "tp_ratios") if was.get(k) is not None}}
    assert Plan.load(path) == plan  # a Path as well as a string


def test_the_3d_form_keeps_its_refinements():
    p = Plan.load(str(OLD / "threed.json"))
    assert (p.dp, p.tp, p.pp, p.world_size) == (2, 1, 2, 4)
    assert p.layer_split == [6, 4] and p.dp_shares == [0.625, 0.375] and p.device_order == [0, 2, 1, 3]
    assert p.collectives == {"dp": "ring"} and p.dtype == "fp16" and p.samples_per_replica() == [10, 6]
    assert not p.stages and p.spmd is None
    assert [s.devices for s in p.stage_specs()] == [[0, 2], [1, 3]]


def test_the_graph_form_keeps_its_stage_dag():
    p = Plan.load(str(OLD / "graph.json"))
    assert p.world_size == 2 and len(p.stages) == 2 and p.stage_edges == [(0, 1)]
    assert all(isinstance(s, StageSpec) and s.spmd is None for s in p.stages)
    assert p.stages[1].segments == [3, 1] and p.stages[1].segment_layers()[1] == ["head"]
    assert sorted(d for s in p.stages for d in s.devices) == [0, 1]


def test_the_spmd_form_is_read_as_a_typed_program():
    p = Plan.load(str(OLD / "spmd.json"))
    prog = p.spmd
    assert isinstance(prog, SpmdProgram) and p.world_size == prog.world == 2
    assert (p.dp, p.tp, p.pp) == (1, 1, 1) and not p.stages
    raw = _raw("spmd")["spmd"]
    assert set(prog.strategies) == set(raw["strategies"]) and len(prog.strategies) == 36
    assert all(isinstance(s, Strategy) and isinstance(s.inputs, tuple) for s in prog.strategies.values())
    assert prog.ratio_array().shape == (1, 2) and prog.ratio_array().sum() == pytest.approx(1.0)
    assert prog.model == raw["model"] and prog.predicted_s == raw["predicted_s"]


def test_the_composed_form_holds_a_typed_program_per_stage():
    p = Plan.load(str(OLD / "composed.json"))
    assert p.world_size == 4 and p.pp == 2 and len(p.stages) == 2 and p.stage_edges == [(0, 1)]
    for st, raw in zip(p.stages, _raw("composed")["stages"]):
        assert isinstance(st.spmd, SpmdProgram) and st.spmd.world == len(st.devices) == 2
        assert set(st.spmd.strategies) == set(raw["spmd"]["strategies"])
        assert st.spmd.model == COMPOSED[0]
    assert "spmd_stages=2+2" in str(p)


def test_a_file_from_before_format_version_is_read_as_version_1(tmp_path):
    for form in FORMS:
        data = _raw(form)
        del data["format_version"]
        path = tmp_path / f"{form}.json"
        path.write_text(json.dumps(data))
        assert Plan.load(str(path)) == Plan.load(str(OLD / f"{form}.json"))


# ---------------------------------------------------------------- refused in one line
def _refusal(tmp_path, data: dict) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as info:
        Plan.load(str(path))
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path))  # one line, naming the file
    return message


def test_a_newer_format_version_is_refused(tmp_path):
    for form in FORMS:
        msg = _refusal(tmp_path, {**_raw(form), "format_version": 3})
        assert "format_version 3 is newer than this plait reads" in msg and "upgrade plait" in msg
    msg = _refusal(tmp_path, {**_raw("threed"), "format_version": "1"})
    assert "format_version: expected a positive integer" in msg


def _composed_with(stage: int, **program) -> dict:
    data = _raw("composed")
    data["stages"][stage]["spmd"].update(program)
    return data


def test_a_bad_field_in_a_stage_program_is_refused_naming_it(tmp_path):
    data = _raw("composed")
    op = next(iter(data["stages"][1]["spmd"]["strategies"]))
    cases = [
        (_composed_with(1, strategies={op: [["X"], ["R"], False]}), f"'stages[1].spmd'.strategies.{op}: must be"),
        (_composed_with(0, ratios=[[0.7, 0.7]]), "'stages[0].spmd'.ratios: values must be >= 0 and sum to 1"),
        (_composed_with(1, ratios=[1.0]), "'stages[1].spmd'.ratios: 1 ratios for the stage's 2 devices"),
        (_composed_with(0, version=2), "'stages[0].spmd'.version: 2 is newer than this plait reads"),
        (_composed_with(1, strategy={}), "'stages[1].spmd': unknown field(s) ['strategy']"),
        (_composed_with(0, homes={"w": "P"}), "'stages[0].spmd'.homes: must map parameter names"),
    ]
    for bad, field in cases:
        assert field in _refusal(tmp_path, bad)


def test_a_bad_field_in_the_plan_program_is_refused_naming_it(tmp_path):
    data = _raw("spmd")
    data["spmd"]["collectives"] = {"x": "ring"}
    assert "'spmd'.collectives: must map tensor names to 'padded' or 'grouped'" in _refusal(tmp_path, data)
    data = _raw("spmd")
    del data["spmd"]["strategies"]
    assert "'spmd': needs ['strategies']" in _refusal(tmp_path, data)
    data = {**_raw("spmd"), "zero": 1}
    assert "plan field 'spmd': an SPMD program is the whole plan" in _refusal(tmp_path, data)


# ---------------------------------------------------------------- the simulator takes them
@pytest.mark.parametrize("form, model, cluster", [("threed", *THREED), ("graph", *GRAPH), ("spmd", *SPMD)])
def test_the_simulator_accepts_old_plans(form, model, cluster):
    from plait.sim.api import simulate

    res = simulate(model, cluster, str(OLD / f"{form}.json"))
    assert res.iteration_time_s > 0 and res.memory is not None and res.memory.fits


def test_simulate_takes_the_old_composed_plan():
    """`simulate()` takes every plan form (issue 27): the old composed file's stage programs are
    replayed on the model (`plait.sim.replay.composed_stages`)."""
    from plait.sim.api import simulate

    res = simulate(*COMPOSED, str(OLD / "composed.json"))
    assert res.iteration_time_s > 0 and res.world_size == 4 and res.fits_memory is True
