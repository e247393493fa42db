"""format_version: every file format plait writes carries it; old files migrate, newer ones are refused."""

from __future__ import annotations

import json

import pytest

from plait.cluster import load_cluster
from plait.cluster.loader import cluster_to_dict, dump_cluster, parse_yaml_text
from plait.cluster.spec import ClusterError
from plait.errors import PlaitError
from plait.ir.formats import FORMAT_VERSIONS, MIGRATIONS, check_version, stamp
from plait.ir.opgraph import OpGraph
from plait.ir.plan import Plan, PlanError
from plait.ir.timeline import Timeline, TimelineEvent


def test_every_writer_stamps_its_current_version() -> None:
    plan = Plan(dp=2, micro_batch=1, global_batch=2)
    assert plan.to_dict()["format_version"] == FORMAT_VERSIONS["plan"]
    assert json.loads(plan.to_json())["format_version"] == FORMAT_VERSIONS["plan"]
    cluster = load_cluster("a100-80g:nodes=1,gpus_per_node=2")
    assert cluster_to_dict(cluster)["format_version"] == FORMAT_VERSIONS["cluster"]
    tl = Timeline(events=[TimelineEvent("fwd", "compute", "dev0", 0.0, 1.0, 0)])
    assert tl.to_dict()["format_version"] == FORMAT_VERSIONS["timeline"]
    graph = OpGraph(model="m", ops={}, layers=[], layer_edges=[])
    assert graph.to_dict()["format_version"] == FORMAT_VERSIONS["opgraph"]


def test_round_trips_and_unversioned_files_are_read_as_version_one() -> None:
    plan = Plan(dp=2, tp=2, micro_batch=2, global_batch=8, layer_split=[3, 1], pp=2)
    assert Plan.from_json(plan.to_json()) == plan
    legacy = plan.to_dict()
    del legacy["format_version"]
    assert Plan.from_dict(legacy) == plan
    cluster = load_cluster("mixed-a100-v100:a100_nodes=1,v100_nodes=1")
    assert parse_yaml_text(dump_cluster(cluster)) == cluster
    text = dump_cluster(cluster).replace(f"format_version: {FORMAT_VERSIONS['cluster']}\n", "")
    assert "format_version" not in text and parse_yaml_text(text) == cluster
    tl = Timeline(events=[TimelineEvent("fwd s0 c0 mb0", "compute", "dev0", 0.0, 1.0, 0)], source="measured")
    again = Timeline.from_dict(tl.to_dict())
    assert again.events == tl.events and again.source == "measured"


@pytest.mark.parametrize("bad", [FORMAT_VERSIONS["plan"] + 1, 0, -1, "1", 1.5, True])
def test_newer_or_malformed_versions_are_refused_naming_the_file(bad: object) -> None:
    data = {**Plan().to_dict(), "format_version": bad}
    with pytest.raises(PlanError, match=r"plan\.json: format_version") as err:
        Plan.from_dict(data, source="plan.json")
    if bad == FORMAT_VERSIONS["plan"] + 1:
        assert "newer" in str(err.value) and "upgrade" in str(err.value)


def test_cluster_yaml_with_a_newer_version_names_the_file(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(dump_cluster(load_cluster("a100-80g:nodes=1")).replace(
        f"format_version: {FORMAT_VERSIONS['cluster']}", "format_version: 99"))
    with pytest.raises(ClusterError, match=r"c\.yaml: format_version 99 is newer"):
        load_cluster(str(path))


def test_migrations_run_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(FORMAT_VERSIONS, "plan", 3)
    monkeypatch.setitem(MIGRATIONS, ("plan", 1), lambda d: {**d, "a": d["a"] + 1})
    monkeypatch.setitem(MIGRATIONS, ("plan", 2), lambda d: {**d, "a": d["a"] * 10})
    assert check_version("plan", {"format_version": 1, "a": 1}, "f") == {"a": 20}
    assert check_version("plan", {"format_version": 3, "a": 1}, "f") == {"a": 1}
    monkeypatch.delitem(MIGRATIONS, ("plan", 1))
    with pytest.raises(PlaitError, match="can no longer be read"):
        check_version("plan", {"format_version": 1, "a": 1}, "f")
    assert stamp("plan", {"a": 1}) == {"format_version": 3, "a": 1}


def test_every_plan_field_has_a_json_type_check() -> None:
    """A Plan field the JSON reader does not know would make every saved plan unreadable."""
    import dataclasses

    from plait.ir.plan import _PLAN_TYPES, _STAGE_TYPES, StageSpec

    assert {f.name for f in dataclasses.fields(Plan)} == set(_PLAN_TYPES)
    assert {f.name for f in dataclasses.fields(StageSpec)} == set(_STAGE_TYPES)
    plan = Plan(dp=2, micro_batch=1, global_batch=2, grad_reduce_dtype="fp32")
    assert Plan.from_json(plan.to_json()) == plan
