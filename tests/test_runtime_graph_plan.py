"""The DAG executor runs plans made by GraphPipe's partitioner with the numbers of one process (issue 13).

Small MMT and DLRM, planned by `plait.planners.graph_search.search_graph` for 4 GPUs with one GPU per
stage, and a wider MMT whose plan gives its stages different data-parallel degrees, trained 2
steps with SGD on gloo ranks: losses and parameters within 1e-6 of a single-process run of the
same model (fp32)."""

from __future__ import annotations

import pytest
import torch

from plait.planners.graph_search import search_graph
from plait.runtime import supports
from plait.runtime.api import LaunchConfig, RecordsConfig, TrainingConfig, reference_run, run
from plait.search import GraphOptions, SearchOptions

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # about 30 s each on 2 shared cores

SGD = {"name": "sgd"}
MODELS = {
    "mmt": "mmt:branches=2,layers=2,hidden=16,heads=2,seq=4,in_dim=8,dropout=0,attn_dropout=0",
    "dlrm": "dlrm:dense_branches=2,dense_layers=2,hidden=32,dense_in=12,sparse_branches=2,rows=100,emb_dim=8,"
            "bag=5,top_layers=2",
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_partitioner_plan_runs_equal_to_one_process(name: str) -> None:
    model = MODELS[name]
    res = search_graph(model, "a100-80g:nodes=1,gpus_per_node=4",
                       SearchOptions(global_batch=8, dtype="fp32", supports=supports), None,
                       GraphOptions(runnable=True, max_dp=1))
    # The best stage DAG among the partitioner's plans (a fan-in: a real one). For a model this small
    # one GPU may beat any pipeline, each pipeline message costing its host time (the analytic score
    # and the simulator agree on DLRM here), so the DAG need not be the best plan.
    dags = [c.plan for c in res.top if len(c.plan.stages) >= 3 and any(
        sum(1 for a, b in c.plan.stage_edges if b == s) >= 2 for s in range(len(c.plan.stages)))]
    assert dags, [str(c.plan) for c in res.top]
    plan = dags[0]
    assert supports(plan) == (True, "")
    training = TrainingConfig(optimizer=SGD, lr=0.5)
    ref_losses, ref_params = reference_run(model, plan, 2, training=training)
    result = run(model, None, plan, steps=2, training=training,
                 launch=LaunchConfig(timeout=120), records=RecordsConfig(return_params=True))
    assert result.losses == pytest.approx(ref_losses, rel=0, abs=1e-6)
    assert result.params is not None
    for key, value in result.params.items():
        torch.testing.assert_close(value, ref_params[key], rtol=0, atol=1e-6, msg=key)


def test_partitioner_plan_with_data_parallel_stages_runs_equal_to_one_process() -> None:
    # Wide enough that the partitioner gives a branch stage several replicas: the first candidate whose
    # stages differ in data-parallel degree (one branch on 2 replicas at micro-batches of 32; the other
    # branch and the head on 3 at 22, 21, 21, run per input: its branch before the first stage's output
    # arrives) runs with its micro-batches dealt to the replicas, clipping on.
    model = "mmt:branches=2,layers=2,hidden=256,heads=4,seq=64,in_dim=8,dropout=0,attn_dropout=0"
    res = search_graph(model, "a100-80gb:nodes=1,gpus_per_node=5",
                       SearchOptions(global_batch=64, top=12, dtype="fp32", supports=supports), None,
                       GraphOptions(runnable=True, candidates=12))
    mixed = [c.plan for c in res.top if c.plan.stage_edges and len({s.dp for s in c.plan.stages}) > 1]
    assert mixed, [str(c.plan) for c in res.top]
    plan = mixed[0]
    assert max(s.dp for s in plan.stages) > 1
    assert any(s.segments for s in plan.stages)  # a stage that runs per input, on several replicas
    assert supports(plan) == (True, "")
    training = TrainingConfig(optimizer=SGD, lr=0.5, clip_grad=0.05)
    ref_losses, ref_params = reference_run(model, plan, 2, training=training)
    result = run(model, None, plan, steps=2, training=training, launch=LaunchConfig(timeout=300),
                 records=RecordsConfig(return_params=True))
    assert len(result.ranks) == sum(s.dp for s in plan.stages)
    assert result.losses == pytest.approx(ref_losses, rel=0, abs=1e-6)
    assert result.params is not None
    for key, value in result.params.items():
        torch.testing.assert_close(value, ref_params[key], rtol=0, atol=1e-6, msg=key)
