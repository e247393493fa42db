"""Composition of families (issue 17 item 1): pipeline stages that run SPMD programs."""

from __future__ import annotations

import json

import pytest

from plait.ir.plan import Plan, PlanError, StageSpec

PROGRAM = {"version": 1, "ratios": [0.6, 0.4], "strategies": {"linear": [["S0", "R"], ["S0"], True]}}


def _plan(**stage0) -> Plan:
    first = {"name": "s0", "layers": ["l0"], "devices": [0, 1], "spmd": PROGRAM, **stage0}
    return Plan(pp=2, micro_batch=2, global_batch=8,
                stages=[StageSpec(**first), StageSpec("s1", ["l1"], [2])], stage_edges=[(0, 1)])


def test_stage_program_round_trips_and_old_stages_are_written_as_before():
    plan = _plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.stages[0].spmd == PROGRAM
    written = json.loads(plan.to_json())["stages"]
    assert "spmd" in written[0] and "spmd" not in written[1]  # a plain stage: the old layout
    assert "spmd_stages=2" in str(plan)


def test_old_stage_plan_still_loads():
    old = {"format_version": 1, "dp": 1, "tp": 1, "pp": 2, "micro_batch": 2, "global_batch": 8,
           "stages": [{"name": "a", "layers": ["l0"], "devices": [0], "dp": 1, "tp": 1},
                      {"name": "b", "layers": ["l1"], "devices": [1], "dp": 1, "tp": 1}],
           "stage_edges": [[0, 1]]}
    plan = Plan.from_dict(old)
    assert all(st.spmd is None for st in plan.stages)


@pytest.mark.parametrize("change, message", [
    ({"devices": [0, 1, 3]}, "2 ratios for the stage's 3 devices"),
    ({"dp": 2}, "needs dp=tp=1"),
    ({"spmd": {**PROGRAM, "version": 9}}, "newer than this plait reads"),
    ({"spmd": {**PROGRAM, "strategies": {"linear": [["Q"], ["S0"], True]}}}, "stages[0].spmd'.strategies.linear"),
])
def test_bad_stage_program_is_refused_naming_the_field(change, message):
    with pytest.raises(PlanError, match="stages\\[0\\]") as info:
        _plan(**change)
    assert message in str(info.value)


def test_runtime_refuses_a_stage_program_with_the_reason():
    from plait.runtime import supports

    ok, why = supports(_plan())
    assert not ok and "stages[0].spmd" in why and "does not yet run" in why
