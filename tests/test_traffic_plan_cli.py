"""`plait plan --traffic-plan`: the best plan's flows planned onto fabric paths (issue 16, C4P),
stored in the plan file, simulated with ECMP's paths and with the planned ones."""

from __future__ import annotations

import dataclasses
import json

import pytest

from plait.cli import main
from plait.cluster.loader import parse_yaml_text
from plait.ir.plan import Plan

MODEL = "gpt:layers=2,hidden=256,heads=4,seq=64,vocab=128"
FABRIC = """
name: tiny-fabric
node_groups:
  - {name: n, count: 4, gpus: {kind: h100, count: 2}}
fabric:
  type: ethernet
  bandwidth: 100 Gb/s
  nics: 2
  ports: 2
  channels: 2
  ecmp: {seed: SEED}
  switches:
    rails: true
    leaves: {count: 2, uplink: {oversubscription: 1, links: 2}}
    spines: 2
"""


def test_traffic_plan_fills_flow_paths_and_simulates_both(tmp_path, capsys) -> None:
    cluster = tmp_path / "fabric.yaml"
    cluster.write_text(FABRIC.replace("SEED", "0"))
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", MODEL, "--cluster", str(cluster), "--global-batch", "8", "--top", "1",
               "--json", "--traffic-plan", "--out", str(out), "--finalists", "2", "--no-placement"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    t = res["traffic_plan"]
    assert t["flows"] > 0 and t["planned_iteration_s"] <= t["ecmp_iteration_s"] * (1 + 1e-9)
    assert t["bottleneck_ideal_s"] <= t["bottleneck_planned_s"] * (1 + 1e-9) <= t["bottleneck_ecmp_s"] * (1 + 1e-9)
    plan = Plan.load(str(out))
    assert plan.flow_paths is not None and plan.flow_paths["paths"]
    assert all(len(item) == 4 for item in plan.flow_paths["paths"])  # whole flows: no shares
    # the settings a deployment applies, beside the plan: they parse, one source port per flow
    from plait.net.deploy import check_settings

    settings = check_settings(json.loads((tmp_path / "plan.traffic.json").read_text()))
    assert len(settings["source_ports"]) == len(plan.flow_paths["paths"]) == t["flows"]
    # The saved plan carries the paths: `plait simulate` predicts the planned iteration.
    assert main(["simulate", "--model", MODEL, "--cluster", str(cluster), "--plan", str(out), "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["iteration_time_s"] == pytest.approx(t["planned_iteration_s"], rel=1e-9)


def test_traffic_plan_needs_a_fabric_and_says_so_before_searching(capsys) -> None:
    rc = main(["plan", "--model", MODEL, "--cluster", "h100:nodes=2", "--traffic-plan", "--no-progress"])
    assert rc != 0
    err = capsys.readouterr().err
    assert "--traffic-plan" in err and "no switched fabric" in err and "candidates" not in err


def test_planned_paths_change_the_simulated_iteration() -> None:
    """ECMP's collisions slow the simulated iteration for some seeds; the planned paths never lose."""
    from plait.commands.traffic_plan import traffic_plan

    plan = Plan(dp=4, tp=2, micro_batch=1, global_batch=8, device_order=[0, 1, 4, 5, 2, 3, 6, 7])
    seen = []
    for seed in range(6):
        c = parse_yaml_text(FABRIC.replace("SEED", str(seed)), "fabric.yaml")
        t = traffic_plan(MODEL, c, plan)
        assert t.report is not None and t.plan.flow_paths is not None
        assert t.planned_iteration_s <= t.ecmp_iteration_s * (1 + 1e-9)
        seen.append(t.ecmp_iteration_s / t.planned_iteration_s)
    assert max(seen) > 1.05
    assert dataclasses.replace(t.plan, flow_paths=None) == plan
