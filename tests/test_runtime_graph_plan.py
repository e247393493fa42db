"""The DAG executor runs plans made by GraphPipe's partitioner with the numbers of one process (issue 13).

Small MMT and DLRM, planned by `plait.plan.graph_search.search_graph` for 4 GPUs with one GPU per
stage (what the runtime runs), trained 2 steps with SGD on gloo ranks: losses and parameters
within 1e-6 of a single-process run of the same model (fp32)."""

from __future__ import annotations

import pytest
import torch

from plait.plan.graph_search import search_graph
from plait.runtime import supports
from plait.runtime.api import LaunchConfig, RecordsConfig, TrainingConfig, reference_run, run

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
    res = search_graph(model, "a100-80g:nodes=1,gpus_per_node=4", global_batch=8, max_dp=1, dtype="fp32",
                       supports=supports)
    plan = res.best.plan
    assert len(plan.stages) >= 3 and any(sum(1 for a, b in plan.stage_edges if b == s) >= 2
                                         for s in range(len(plan.stages)))  # a fan-in: a real stage DAG
    assert supports(plan) == (True, "")
    training = TrainingConfig(optimizer=SGD, lr=0.5)
    ref_losses, ref_params = reference_run(model, plan, 2, training=training)
    result = run(model, None, plan, steps=2, training=training,
                 launch=LaunchConfig(timeout=120), records=RecordsConfig(return_params=True))
    assert result.losses == pytest.approx(ref_losses, rel=0, abs=1e-6)
    assert result.params is not None
    for key, value in result.params.items():
        torch.testing.assert_close(value, ref_params[key], rtol=0, atol=1e-6, msg=key)
