"""Composed plans run (issue 17 item 1): a 2-stage pipeline whose stages each run an SPMD program on
2 gloo ranks at uneven ratios, by 1F1B over 4 micro-batches, equals one process (fp32).

The plan comes from the composed family's own search (`plait.search`, family "compose") on two
2-GPU nodes; its stage ratios are set uneven (0.7:0.3 and 0.3:0.7), so the shards, the uneven
collectives inside each stage and the k = 2 rank pairs that carry each boundary value are all
exercised. The tiny GPT ties its embedding to its head across the two stages."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plait.ir.plan import Plan
from plait.runtime import supports

pytestmark = pytest.mark.distributed

TINY = "gpt:layers=2,hidden=64,heads=2,seq=16,vocab=128,dropout=0,attn_dropout=0"
STEPS = 2


def _composed_plan() -> Plan:
    from test_compose import _two_gpu_cluster

    from plait.search import plan

    best = plan(TINY, _two_gpu_cluster(per_node=2), global_batch=8, top=1, families="compose").best.plan
    stages = []
    for spec, ratios in zip(best.stages, ([0.7, 0.3], [0.3, 0.7])):
        program = dict(spec.spmd)
        program["ratios"] = [ratios for _ in program["ratios"]] if isinstance(program["ratios"][0], list) else ratios
        stages.append(dataclasses.replace(spec, spmd=program))
    return dataclasses.replace(best, stages=stages, dtype="fp32")


def test_composed_plan_runs_equal_to_one_process() -> None:
    from plait.runtime.api import LaunchConfig, RecordsConfig, TrainingConfig, reference_run, run

    plan = _composed_plan()
    assert plan.num_micro_batches == 4 and [len(s.devices) for s in plan.stages] == [2, 2]
    assert supports(plan) == (True, "")
    training = TrainingConfig(optimizer={"name": "sgd"}, lr=0.5)
    ref_losses, ref_params = reference_run(TINY, plan, STEPS, training=training)
    result = run(TINY, None, plan, steps=STEPS, training=training, launch=LaunchConfig(timeout=120),
                 records=RecordsConfig(return_params=True))
    assert result.losses == pytest.approx(ref_losses, rel=0, abs=1e-5)
    assert result.params is not None and set(result.params) <= set(ref_params)
    tied = {"head.lm.weight", "embed.tok.weight"}  # one tensor under two names: one is returned
    assert len(set(ref_params) - set(result.params)) == 1 and set(ref_params) - set(result.params) <= tied
    assert torch.equal(ref_params["head.lm.weight"], ref_params["embed.tok.weight"])
    for name, value in result.params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=0, atol=1e-5, msg=name)


def test_composed_plan_refusals_name_the_field() -> None:
    plan = _composed_plan()
    graph = dataclasses.replace(plan, stage_edges=[])
    ok, why = supports(graph)
    assert not ok and "stage_edges" in why
    ok, why = supports(dataclasses.replace(plan, zero=1))
    assert not ok and "'zero'" in why
