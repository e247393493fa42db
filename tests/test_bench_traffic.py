"""Smoke test of bench/traffic.py's core (`run_plan`) on a 16-GPU fabric: ECMP seeds, planned
paths, the LP bound, a failed spine cable re-planned (the whole bench runs minutes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rich.console import Console

from plait.cluster.loader import parse_yaml_text
from plait.graph.gpt_closed_form import gpt_opgraph
from plait.ir.plan import Plan

BENCH = Path(__file__).resolve().parents[1] / "bench" / "traffic.py"
CLUSTER = """
name: tiny
node_groups:
  - {name: n, count: 8, gpus: {kind: h100, count: 2}}
fabric:
  type: ethernet
  bandwidth: 400 Gb/s
  nics: 2
  ports: 2
  channels: 2
  ecmp: {seed: 0}
  switches:
    rails: true
    leaves: {count: 2, uplink: {oversubscription: 1, links: 2}}
    spines: 2
"""


def test_run_plan_on_a_tiny_fabric() -> None:
    spec = importlib.util.spec_from_file_location("bench_traffic", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    base = parse_yaml_text(CLUSTER, "tiny.yaml")
    order = [d for n in (0, 4, 1, 5, 2, 6, 3, 7) for d in (2 * n, 2 * n + 1)]  # every hop crosses leaves
    plan = Plan(dp=8, tp=2, micro_batch=1, global_batch=8, device_order=order)
    graph = gpt_opgraph({"layers": 2, "hidden": 512, "heads": 8, "seq": 128, "vocab": 1000}, "bf16")
    row = bench.run_plan("dp", plan, graph, base, 3, Console(quiet=True))
    assert row["flows"] == 2 * 8 * 2 and row["seeds"] == 3
    assert row["achieved_over_ideal_planned"] >= 0.999
    assert row["planned_iter_s"] <= row["ecmp_iter_median_s"] * (1 + 1e-9)
    fail = row["failure"]
    assert fail["flows_moved"] > 0 and 0 < fail["kept_network"] <= 1 + 1e-9
    assert row["T_whole_bound_s"] <= row["T_planned_s"] * (1 + 1e-9)
    assert row["planned_fractional_iter_s"] <= row["ecmp_iter_median_s"] * (1 + 1e-9)
    assert row["sim_cpu_s_per_iteration_max"] > 0
    assert 0 < row["achieved_over_ideal_sprayed"] <= 1 + 1e-9  # sprayed: at most the LP bound
    assert row["T_sprayed_s"] >= row["T_ideal_s"] * (1 - 1e-9)
    assert 0 < fail["kept_network_sprayed"] <= 1 + 1e-9


def test_published_ecmp_cases_rebuild_the_tolly_fabric() -> None:
    """bench/ecmp_published.py on its smallest case (64 GPUs, 8 servers, 4 leaves, 2 spines): the
    published figures beside the model's, and more hashed flows lose less to ECMP."""
    spec = importlib.util.spec_from_file_location("bench_ecmp_published", BENCH.parent / "ecmp_published.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.case_tolly(5)
    assert [r["published"] for r in rows] == [0.1043, 0.1129, 0.1732, 0.2276]
    for r in rows:
        assert r["flows"] == 8 * 8 * 2  # one ring crossing per node and NIC, 2 channels, 1 QP
        assert r["model"]["min"] >= -1e-9 and r["planned_over_ideal"] >= 0.999
    sens = {(x["channels_per_nic"], x["qps_per_connection"]): x for x in bench.tolly_sensitivity(5)}
    few, many = sens[(2, 1)], sens[(4, 4)]
    assert many["flows"] == 8 * few["flows"]
    assert many["ecmp_achieved_over_ideal"]["median"] >= few["ecmp_achieved_over_ideal"]["median"]
