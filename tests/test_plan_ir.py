"""Plan IR: string form, JSON round-trip, validation errors, derived quantities."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.ir.plan import Plan, PlanError, StageSpec

EXAMPLE = "dp=2,tp=2,pp=2,micro_batch=4,global_batch=64,recompute=selective,zero=1,schedule=1f1b"


def test_short_form_parses_and_prints_back():
    plan = Plan.parse(EXAMPLE)
    assert (plan.dp, plan.tp, plan.pp, plan.micro_batch, plan.global_batch) == (2, 2, 2, 4, 64)
    assert plan.recompute == "selective" and plan.zero == 1 and plan.schedule == "1f1b"
    assert str(plan) == EXAMPLE
    assert plan.num_micro_batches == 8
    assert plan.world_size == 8


def test_megatron_rank_order_is_tp_fastest_then_dp_then_pp():
    plan = Plan(dp=2, tp=2, pp=2, micro_batch=1, global_batch=2)
    assert [plan.rank(0, 0, t) for t in range(2)] == [0, 1]
    assert plan.rank(0, 1, 0) == 2
    assert plan.rank(1, 0, 0) == 4
    stages = plan.stage_specs(["a", "b", "c", "d", "e"])
    assert [s.layers for s in stages] == [["a", "b", "c"], ["d", "e"]]
    assert stages[1].devices == [4, 5, 6, 7]


def test_device_order_places_ranks():
    plan = Plan(dp=2, pp=2, micro_batch=1, global_batch=2, device_order=[3, 2, 1, 0])
    assert plan.stage_specs(["a", "b"])[0].devices == [3, 2]


def test_interleaved_chunks_go_round_robin_to_devices():
    plan = Plan(pp=2, micro_batch=1, global_batch=4, schedule="interleaved", virtual_stages=2)
    stages = plan.stage_specs([f"l{i}" for i in range(8)])
    assert stages[0].layers == ["l0", "l1", "l4", "l5"]
    assert stages[1].layers == ["l2", "l3", "l6", "l7"]


def test_uneven_shares_round_to_the_global_batch():
    plan = Plan(dp=3, micro_batch=1, global_batch=10, dp_shares=[0.5, 0.3, 0.2])
    assert plan.samples_per_replica() == [5, 3, 2]
    plan = Plan(dp=3, micro_batch=1, global_batch=7, dp_shares=[1 / 3, 1 / 3, 1 / 3])
    counts = plan.samples_per_replica()
    assert sum(counts) == 7 and max(counts) - min(counts) <= 1


@pytest.mark.parametrize(
    "text, field",
    [
        ("dp=0", "dp"),
        ("dp=2,micro_batch=3,global_batch=8", "global_batch"),
        ("recompute=sometimes", "recompute"),
        ("schedule=zigzag", "schedule"),
        ("zero=4", "zero"),
        ("dp=two", "dp"),
        ("frobnicate=1", "frobnicate"),
        ("pp=2,layer_split=1:2:3", "layer_split"),
        ("dp=2,dp_shares=0.9:0.9", "dp_shares"),
        ("collective.dp=psychic", "collective"),
        ("dp=2,global_batch=2,device_order=0:0", "device_order"),
        ("dp2", "dp2"),
    ],
)
def test_bad_plans_name_the_field(text, field):
    with pytest.raises(PlanError, match=field):
        Plan.parse(text)


def test_json_round_trip_with_a_stage_dag():
    plan = Plan(
        micro_batch=2,
        global_batch=8,
        stages=[
            StageSpec("branch_a", layers=["a0", "a1"], devices=[0]),
            StageSpec("branch_b", layers=["b0"], devices=[1], micro_batch=4),
            StageSpec("merge", layers=["head"], devices=[2, 3], dp=2, dp_shares=[0.75, 0.25]),
        ],
        stage_edges=[(0, 2), (1, 2)],
        collectives={"dp": "grouped"},
    )
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.world_size == 4
    assert again.stage_graph_edges() == [(0, 2), (1, 2)]


def test_load_accepts_file_string_and_object(tmp_path):
    plan = Plan.parse(EXAMPLE)
    path = tmp_path / "p.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert Plan.load(EXAMPLE) == plan
    assert Plan.load(plan) is plan
    with pytest.raises(PlanError, match="not found"):
        Plan.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="bad.json"):
        Plan.load(bad)


plans = st.builds(
    lambda dp, tp, pp, mb, k, rc, zero, sched: Plan(
        dp=dp, tp=tp, pp=pp, micro_batch=mb, global_batch=dp * mb * k * pp, recompute=rc, zero=zero,
        schedule=sched,
    ),
    st.integers(1, 16), st.integers(1, 8), st.integers(1, 8), st.integers(1, 8), st.integers(1, 8),
    st.sampled_from(["none", "selective", "full"]), st.sampled_from([0, 1, 2, 3]),
    st.sampled_from(["1f1b", "gpipe"]),
)


@settings(max_examples=60, deadline=None)
@given(plans)
def test_round_trips_are_lossless(plan):
    assert Plan.parse(str(plan)) == plan
    assert Plan.from_json(plan.to_json()) == plan


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=40))
def test_garbage_strings_raise_plan_error_only(text):
    try:
        Plan.parse(text)
    except PlanError:
        pass


def test_megatron_split_puts_embedding_and_head_beside_the_blocks():
    styles = ["embedding"] + ["transformer"] * 24 + ["head"]
    plan = Plan(pp=4, micro_batch=1, global_batch=4)
    assert plan.layers_per_stage(26, styles) == [7, 6, 6, 7]
    assert plan.layers_per_stage(26) == [7, 7, 6, 6]  # without styles: even by count
    names = [f"l{i}" for i in range(26)]
    stages = plan.stage_specs(names, styles)
    assert stages[0].layers[:2] == ["l0", "l1"] and stages[-1].layers[-1] == "l25"
    # Explicit splits win; models without a transformer body fall back to even counts.
    assert Plan(pp=2, micro_batch=1, global_batch=2, layer_split=[20, 6]).layers_per_stage(26, styles) == [20, 6]
    assert plan.layers_per_stage(8, ["none"] * 8) == [2, 2, 2, 2]


def test_every_plan_form_is_a_stage_graph_of_typed_programs():
    """Issue 27: a 3D plan's stages run the Megatron form, a whole-model SPMD plan is one stage
    running its program on every rank with the whole batch."""
    from plait.ir.program import SpmdProgram, Strategy, TensorParallel

    grid = Plan(dp=2, tp=2, pp=2, micro_batch=1, global_batch=4)
    stages = grid.stage_specs(["a", "b", "c", "d"])
    assert [st.program for st in stages] == [TensorParallel(dp=2, tp=2)] * 2
    assert [len(st.devices) for st in stages] == [4, 4] and stages[0].layers == ["a", "b"]
    program = SpmdProgram({"mm": Strategy(("S0", "R"), ("S0",), True)}, [0.25, 0.75])
    spmd = Plan(micro_batch=8, global_batch=8, spmd=program, device_order=[3, 1])
    (one,) = spmd.stage_specs(["a", "b"])
    assert one.program is program and one.devices == [3, 1] and one.micro_batch == 8
    assert one.layers == ["a", "b"] and one.dp == one.tp == 1 and one.spmd is program
