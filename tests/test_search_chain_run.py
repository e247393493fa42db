"""A chain model's graph pipeline offered by the default search trains equal to one process (issue 36).

The driver asks the graph family for chain models beside the 3D family (`plan(graph_chains=)`);
its multi-stage chains -- here a 2-stage pipeline whose stages sit on the two GPU kinds of the
cluster -- must run: trained 2 steps with SGD on 2 gloo ranks in fp32, losses and parameters
within 1e-6 of a single-process run of the same model."""

from __future__ import annotations

import pytest
import torch

from plait.api import plan
from plait.cluster import load_cluster
from plait.runtime import supports
from plait.runtime.api import LaunchConfig, RecordsConfig, TrainingConfig, reference_run, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # a search and a 2-rank run: about a minute

MODEL = "gpt:layers=4,hidden=64,heads=2,seq=16,vocab=128,dropout=0,attn_dropout=0"
CLUSTER = "mixed-a100-v100:a100_nodes=1,v100_nodes=1,gpus_per_node=1"


def test_chain_pipeline_of_the_default_search_runs_equal_to_one_process() -> None:
    res = plan(MODEL, CLUSTER, global_batch=8, top=4, families=["3d", "graph"], runnable=True, dtype="fp32")
    graph = res.families["graph"]
    assert not isinstance(graph, str), graph  # asked for a chain (the driver before issue 36 declined)
    chains = [c for c in graph.top if len(c.plan.stages) >= 2 and not c.unsupported]
    assert chains, [str(c.plan) for c in graph.top]
    p = chains[0].plan  # the best multi-stage plan the graph family offered
    assert not p.stage_edges or all(b == a + 1 for a, b in p.stage_edges)  # a chain of stages
    devices = load_cluster(CLUSTER).devices
    assert len({devices[d].kind.name for st in p.stages for d in st.devices}) == 2  # on both GPU kinds
    assert supports(p) == (True, "") and p.dtype == "fp32"
    training = TrainingConfig(optimizer={"name": "sgd"}, lr=0.5)
    ref_losses, ref_params = reference_run(MODEL, p, 2, training=training)
    result = run(MODEL, None, p, steps=2, training=training, launch=LaunchConfig(timeout=300),
                 records=RecordsConfig(return_params=True))
    assert len(result.ranks) == 2
    assert result.losses == pytest.approx(ref_losses, rel=0, abs=1e-6)
    assert result.params is not None
    for key, value in result.params.items():
        torch.testing.assert_close(value, ref_params[key], rtol=0, atol=1e-6, msg=key)

