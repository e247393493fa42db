"""The Python API mirrors the CLI: plait.inspect / simulate / plan / run take the same string forms."""

from __future__ import annotations

import plait

MODEL = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"
CLUSTER = "a100-80g:nodes=1,gpus_per_node=2"


def test_plan_is_a_plain_function_beside_the_planner_packages():
    import plait.planners.threed as threed
    import plait.search as search

    assert plait.plan is plait.api.plan and callable(plait.plan) and callable(threed.search_3d)
    result = plait.plan(MODEL, CLUSTER, global_batch=4, top=2)
    assert result.top and isinstance(result.top[0].plan, plait.Plan)
    assert callable(search.search_plans)


def test_inspect_and_simulate_take_string_forms():
    graph = plait.inspect(MODEL, batch=2)
    assert graph.param_count > 0 and len(graph.layers) == 4
    sim = plait.simulate(MODEL, CLUSTER, "dp=2,micro_batch=1,global_batch=4")
    assert sim.iteration_time_s > 0 and sim.fits_memory
    assert len(sim.memory_peak_bytes) == 2
