"""Following the inputs from `plait plan` to the simulator (issue 31): the cluster's preset is built
once, its topology matrices computed once and one device model made, which every family (3D, graph,
SPMD, composed) and the simulator read; the model's spec string is parsed once, into the one
ModelSpec every family is handed."""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any

import pytest

import plait.cluster as plait_cluster
import plait.cluster.topology as topology
from plait.cli import main
from plait.cost.devices import DeviceModel
from plait.graph.zoo import ModelSpec
from plait.search import FAMILIES


def test_plait_plan_resolves_the_cluster_and_the_model_once_for_every_family(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    counts: collections.Counter[str] = collections.Counter()

    def counted(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(plait_cluster, "build_preset", counted("preset", plait_cluster.build_preset))
    monkeypatch.setattr(topology, "_node_level", counted("matrices", topology._node_level))
    monkeypatch.setattr(DeviceModel, "facts_of", staticmethod(counted("device model", DeviceModel.facts_of)))
    models: dict[str, Any] = {}  # family -> the model it was handed
    for name, family in list(FAMILIES.items()):
        def search(model: Any, *args: Any, _name: str = name, _search: Any = family.search) -> Any:
            models[_name] = model
            return _search(model, *args)
        monkeypatch.setitem(FAMILIES, name, dataclasses.replace(family, search=search))
    # one process (--jobs 1): the composed family's stage programs are synthesized here, where counted
    main(["plan", "--model", "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=256", "--cluster",
          "mixed-a100-v100:a100_nodes=1,v100_nodes=1", "--family", "all", "--jobs", "1", "--json"])
    families = json.loads(capsys.readouterr().out)["families"]
    # every family proposed and simulated plans on it
    assert set(families) == {"3d", "graph", "spmd", "compose"}
    assert all(f["best_time_s"] > 0 and f["simulated"] >= 1 for f in families.values())
    assert counts == {"preset": 1, "matrices": 1, "device model": 1}
    # the spec string was parsed once, by the driver: every family got that one ModelSpec
    specs = list(models.values())
    assert len(models) == 4 and isinstance(specs[0], ModelSpec) and all(m is specs[0] for m in specs)
