"""Measured collective bus bandwidth (nccl-tests' vocabulary) in the cluster model: the YAML
section, the nccl-tests reader, and the one cost path the planner and the simulator share."""

from __future__ import annotations

import math
import re
import textwrap

import pytest

from plait.cluster import load_cluster
from plait.cluster.loader import dump_cluster, parse_yaml_text
from plait.cluster.nccl_tests import parse_nccl_tests
from plait.cluster.spec import ClusterError, MeasuredCollective
from plait.cluster.topology import bandwidth_matrix, latency_matrix
from plait.cost.collectives import (
    choose_algorithm,
    collective_time,
    group_links,
    measured_tables,
    measured_time,
)
from plait.cost.traffic import Message

NODE = "{name: n%d, gpus: {kind: a100-80gb, count: 4}}"
YAML = textwrap.dedent("""
    name: measured
    nodes:
      - %s
    collectives:
      - {op: all_reduce, nodes: 1, ranks: 4, source: "test sweep",
         busbw: {1 MiB: 20 GB/s, 16 MiB: 80 GB/s, 256 MiB: 160 GB/s}}
""") % (NODE % 0)

NCCL_OUT = textwrap.dedent("""\
    # Collective test starting: all_reduce_perf
    # nThread 1 nGpus 1 minBytes 1048576 maxBytes 268435456 step: 16(factor) warmup iters: 5 iters: 20
    #
    # Using devices
    #  Rank  0 Group  0 Pid  11 on    node-a device  0 [0x07] NVIDIA A100-SXM4-80GB
    #  Rank  1 Group  0 Pid  12 on    node-a device  1 [0x0b] NVIDIA A100-SXM4-80GB
    #  Rank  2 Group  0 Pid  13 on    node-b device  0 [0x07] NVIDIA A100-SXM4-80GB
    #  Rank  3 Group  0 Pid  14 on    node-b device  1 [0x0b] NVIDIA A100-SXM4-80GB
    #
    #                                                              out-of-place                       in-place
    #       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
    #        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
         1048576        262144     float     sum      -1    104.9   10.00   15.00      0    104.0   10.08   15.12      0
        16777216       4194304     float     sum      -1    559.2   30.00   45.00      0    558.0   30.07   45.10      0
       268435456      67108864     float     sum      -1   5965.2   45.00   67.50      0   5960.1   45.04   67.56      0
    # Out of bounds values : 0 OK
    # Avg bus bandwidth    : 42.5
    """)


def test_yaml_round_trip_and_errors_name_the_field() -> None:
    c = parse_yaml_text(YAML, "m.yaml")
    (m,) = c.collectives
    assert (m.op, m.nodes, m.ranks, m.source) == ("all_reduce", 1, 4, "test sweep")
    assert m.sizes == (2**20, 2**24, 2**28) and m.busbw == (20e9, 80e9, 160e9)
    assert parse_yaml_text(dump_cluster(c)) == c
    good = "{op: all_reduce, nodes: 1, ranks: 4, busbw: {1 MiB: 20 GB/s}}"
    for bad, where in [("{op: allreduce, ranks: 4, busbw: {1 MiB: 1 GB/s}}", "collectives[0].op: unknown collective"),
                       ("{op: all_reduce, ranks: 1, busbw: {1 MiB: 1 GB/s}}", "collectives[0].ranks: must be between 2"),
                       ("{op: all_reduce, nodes: 3, ranks: 4, busbw: {1 MiB: 1 GB/s}}",
                        "collectives[0].nodes: must be between 1 and 1"),
                       ("{op: all_reduce, ranks: 4, busbw: {}}", "collectives[0].busbw: expected a mapping"),
                       ("{op: all_reduce, ranks: 4, busbw: {1 MiB: fast}}", "collectives[0].busbw.1 MiB:"),
                       ("{op: all_reduce, ranks: 4}", "collectives[0].busbw: required field is missing")]:
        text = f"name: m\nnodes: [{NODE % 0}]\ncollectives:\n  - {good}\n  - {bad}\n"
        with pytest.raises(ClusterError, match=re.escape(f"m.yaml: {where}".replace("[0]", "[1]"))):
            parse_yaml_text(text, "m.yaml")


def test_nccl_tests_output_is_read_by_column_name() -> None:
    m = parse_nccl_tests(NCCL_OUT, "ar.txt")
    assert (m.op, m.ranks, m.nodes) == ("all_reduce", 4, 2)
    assert m.sizes == (1048576.0, 16777216.0, 268435456.0)
    assert m.busbw == pytest.approx((15e9, 45e9, 67.5e9))  # out-of-place busbw, GB/s = 1e9 B/s
    with pytest.raises(ClusterError, match="ar.txt: cannot tell which collective"):
        parse_nccl_tests(NCCL_OUT.replace("# Collective test starting: all_reduce_perf\n", ""), "ar.txt")
    assert parse_nccl_tests(NCCL_OUT.replace("# Collective test starting: all_reduce_perf\n", ""),
                            op="all_gather").op == "all_gather"
    with pytest.raises(ClusterError, match="2 or more ranks"):
        parse_nccl_tests("# Collective test starting: all_reduce_perf\n", "x")
    with pytest.raises(ClusterError, match="no nccl-tests header"):
        parse_nccl_tests("\n".join(NCCL_OUT.splitlines()[:9]), "x")


def test_measured_time_reads_the_table_backwards_hand_computed() -> None:
    m = MeasuredCollective("all_reduce", 1, 4, (2**20, 2**24, 2**28), (20e9, 80e9, 160e9))
    bus = 2 * 3 / 4
    assert measured_time(m, "all_reduce", 2**24, 4) == pytest.approx(2**24 * bus / 80e9)
    # half-way in log(size) between 16 MiB and 256 MiB: 120 GB/s
    s = 2**26
    assert measured_time(m, "all_reduce", s, 4) == pytest.approx(s * bus / 120e9)
    # below the table: the smallest size's time; above: the last busbw
    assert measured_time(m, "all_reduce", 1024, 4) == pytest.approx(2**20 * bus / 20e9)
    assert measured_time(m, "all_reduce", 2**30, 4) == pytest.approx(2**30 * bus / 160e9)
    # busbw is per the op's bus factor: 8 ranks move 2*7/8 of S over each link
    assert measured_time(m, "all_reduce", 2**24, 8) == pytest.approx(2**24 * 2 * 7 / 8 / 80e9)


def test_planner_and_simulator_take_collective_times_from_the_table() -> None:
    from plait.ir.plan import Plan
    from plait.net.view import ClusterView
    from plait.planners.threed import AnalyticModel
    from plait.sim.api import simulate

    c = parse_yaml_text(YAML, "m.yaml")
    plain = load_cluster("a100-80g:nodes=1,gpus_per_node=4")
    tables = measured_tables(c)
    links = group_links([0, 1, 2, 3], bandwidth_matrix(c), latency_matrix(c), [0] * 4, measured=tables)
    assert choose_algorithm("all_reduce", 2**24, links) == "measured"
    assert choose_algorithm("all_reduce", 2**24, links, "ring") == "ring"  # a pinned algorithm wins
    assert choose_algorithm("all_gather", 2**24, links) == "ring"  # no table for all_gather
    expected = 2**24 * 1.5 / 80e9
    assert collective_time("all_reduce", 2**24, links, "measured") == pytest.approx(expected)
    model = AnalyticModel(_graph(), c)
    msg = Message("grads", "dp", "all_reduce", 2**24, ((0, 1, 2, 3),), 1, 0)
    assert model._message_s(msg, Plan()) == pytest.approx(expected)

    plan = Plan(dp=4, micro_batch=1, global_batch=4, dtype="bf16")
    sim = simulate("gpt:layers=2,hidden=256,heads=4,seq=128,vocab=512", ClusterView.from_cluster(c), plan,
                   memory=False)
    ref = simulate("gpt:layers=2,hidden=256,heads=4,seq=128,vocab=512", ClusterView.from_cluster(plain), plan,
                   memory=False)
    ar = [e for e in sim.timeline.events if e.category.startswith("comm_dp")]
    assert ar and all(e.args.get("algorithm") == "measured" for e in ar if e.args)
    for e in ar:
        nbytes = e.args["bytes"]
        assert e.end - e.start == pytest.approx(measured_time(c.collectives[0], "all_reduce", nbytes, 4)
                                                + _host_comm(), rel=1e-6)
    assert sim.iteration_time_s != pytest.approx(ref.iteration_time_s, rel=1e-6)


def test_a_switched_fabric_ignores_the_table() -> None:
    """Where leaf/spine switches are described, flows on paths decide; the table is not used."""
    import dataclasses

    from plait.cluster.spec import SwitchSpec

    c = parse_yaml_text(YAML, "m.yaml")
    assert measured_tables(c) == tuple(c.collectives)
    fabric = dataclasses.replace(c, switches=[SwitchSpec("l0", "leaf"), SwitchSpec("s0", "spine")])
    assert fabric.collectives and measured_tables(fabric) == ()


def _graph():
    from plait.graph.resolve import resolve_model
    from plait.ir.plan import Plan

    return resolve_model("gpt:layers=2,hidden=256,heads=4,seq=128,vocab=512", Plan(dtype="bf16"))


def _host_comm() -> float:
    from plait.cost.compute import DEFAULT_MODEL

    return DEFAULT_MODEL.host_comm_s


def test_add_nccl_tests_command_writes_a_cluster_that_loads(tmp_path, capsys) -> None:
    from plait.cli import main

    out_file = tmp_path / "ar.txt"
    out_file.write_text(NCCL_OUT)
    target = tmp_path / "with-busbw.yaml"
    assert main(["cluster", "add-nccl-tests", "a100-80g:nodes=2,gpus_per_node=2", str(out_file),
                 "--out", str(target)]) == 0
    assert "all_reduce on 4 ranks / 2 node(s)" in capsys.readouterr().out
    c = load_cluster(str(target))
    assert c.collectives[0].busbw == pytest.approx((15e9, 45e9, 67.5e9))
    assert math.isclose(c.collectives[0].sizes[-1], 268435456)
    rc = main(["cluster", "add-nccl-tests", "a100-80g:nodes=1,gpus_per_node=2", str(out_file),
               "--out", str(tmp_path / "x.yaml")])
    assert rc != 0 and "measured on 4 ranks over 2 nodes" in capsys.readouterr().err
    rc = main(["cluster", "add-nccl-tests", "a100-80g:nodes=2,gpus_per_node=2", str(out_file),
               "--out", str(tmp_path / "missing" / "x.yaml")])
    assert rc != 0 and "does not exist" in capsys.readouterr().err


def test_profile_result_carries_its_sweeps_as_tables() -> None:
    from plait.measure.cluster_profile import result_to_cluster
    from tests.test_profile import _fake_result

    c = result_to_cluster(_fake_result(2, [0, 1], [1.0, 1.0]))
    ops = {m.op: m for m in c.collectives}
    assert set(ops) == {"all_reduce", "all_gather"}
    assert ops["all_reduce"].busbw == (1.5e6,) and ops["all_reduce"].nodes == 2 and ops["all_reduce"].ranks == 2
