"""`plait profile`: schedules, nccl-tests conventions, and a real 2-worker run whose YAML loads."""

from __future__ import annotations

import itertools
import textwrap

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from plait.cluster.topology import bandwidth_matrix, latency_matrix
from plait.measure.cluster_profile import (
    KiB,
    MiB,
    ProfileError,
    ProfileResult,
    bus_factor,
    default_sizes,
    parse_size,
    round_robin_rounds,
    split_by_nic,
)


@given(st.integers(min_value=2, max_value=33))
def test_round_robin_is_a_tournament(n: int) -> None:
    rounds = round_robin_rounds(n)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)
    seen = []
    for pairs in rounds:
        ranks = [r for p in pairs for r in p]
        assert len(ranks) == len(set(ranks))  # a matching
        assert len(pairs) == n // 2  # perfect (one rank rests when n is odd)
        seen += pairs
    assert sorted(seen) == list(itertools.combinations(range(n), 2))


@given(st.integers(min_value=2, max_value=16), st.integers(min_value=1, max_value=4))
def test_split_by_nic_keeps_each_node_on_one_link(n: int, per_node: int) -> None:
    node_of = [r // per_node for r in range(n)]
    for pairs in round_robin_rounds(n):
        subs = split_by_nic(pairs, node_of)
        assert sorted(p for s in subs for p in s) == sorted(pairs)
        for s in subs:
            cross = [(node_of[a], node_of[b]) for a, b in s if node_of[a] != node_of[b]]
            nodes = [x for p in cross for x in p]
            assert len(nodes) == len(set(nodes))


def test_sizes_and_bus_factors() -> None:
    sizes = default_sizes()
    assert sizes[0] == KiB and sizes[-1] == 256 * MiB and len(sizes) == 19
    assert default_sizes(4 * KiB) == [1024, 2048, 4096]
    assert [parse_size(s) for s in ("4096", "64K", "256M", "1G", "2MiB")] == [4096, 65536, 256 * MiB, 1024 * MiB,
                                                                              2 * MiB]
    with pytest.raises(ProfileError, match="byte count"):
        parse_size("lots")
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather", 4) == 0.75
    assert bus_factor("all_reduce", 1) == 1.0


def _fake_result(world: int, node_of: list[int], slowdowns: list[float]) -> ProfileResult:
    p2p = {}
    for a in range(world):
        for b in range(world):
            if a != b:
                same = node_of[a] == node_of[b]
                p2p[f"{a}-{b}"] = {"bandwidth": 1e9 if same else 2e7 + 1e6 * (a + b), "latency": 5e-5 if same else 8e-5}
    return ProfileResult(
        world=world, backend="gloo", device_type="cpu", node_of=node_of, p2p=p2p,
        collectives={"all_reduce": [{"bytes": 1024, "time_s": 1e-3, "algbw": 1.024e6, "busbw": 1.5e6}],
                     "all_gather": [{"bytes": 1024, "time_s": 1e-3, "algbw": 1.024e6, "busbw": 0.75e6}]},
        matmul=[{"fp32": 1e10 / s, "bf16": 4e10 / s, "by_size": {}} for s in slowdowns],
        memory_bandwidth=[5e9] * world, memory_bytes=[2**33] * world, slowdowns=slowdowns,
        rounds=[[list(r)] for r in round_robin_rounds(world)])


def test_result_to_cluster_keeps_layout_and_rewrites_emulation(tmp_path) -> None:
    from plait.cluster import load_cluster
    from plait.measure.cluster_profile import result_to_yaml

    base_file = tmp_path / "emu.yaml"
    base_file.write_text(textwrap.dedent("""
        name: emu
        nodes:
          - {name: fast, gpus: {kind: a100-80gb, count: 2}, nic: {bandwidth: 200 Gb/s, count: 2}}
          - {name: slow, gpus: {kind: t4, count: 2}, nic: {bandwidth: 100 Gb/s, count: 1}}
        emulation: {bandwidth_scale: 0.002}
    """))
    base = load_cluster(str(base_file))
    result = _fake_result(4, [0, 0, 1, 1], [1.0, 1.0, 2.5, 2.5])
    data = result_to_yaml(result, base)
    out = tmp_path / "measured.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    c = load_cluster(str(out))
    assert c.name == "emu-measured" and [n.name for n in c.nodes] == ["fast", "slow"]
    assert [n.nics for n in c.nodes] == [2, 1]
    assert sorted(c.kinds) == ["measured-a100-80gb", "measured-t4"]
    assert c.kinds["measured-t4"].flops("fp32") == pytest.approx(1e10 / 2.5)
    assert c.kinds["measured-a100-80gb"].flops("bf16") == pytest.approx(4e10)
    assert c.emulation.bandwidth_scale == 1.0
    assert c.emulation.slowdown == {"measured-a100-80gb": 1.0, "measured-t4": 2.5}
    bw, lat = bandwidth_matrix(c), latency_matrix(c)
    assert bw[0, 3] == pytest.approx(2e7 + 3e6) and bw[3, 0] == bw[0, 3]  # mean of both directions
    assert bw[0, 1] == pytest.approx(1e9) and lat[1, 2] == pytest.approx(8e-5)
    assert c.nodes[0].nic.bandwidth == pytest.approx(2.3e7)  # median of node 0's cross pairs
    with pytest.raises(ProfileError, match="4 devices but the profile ran 2"):
        result_to_yaml(_fake_result(2, [0, 1], [1.0, 1.0]), base)


def test_profile_two_local_workers_writes_loadable_yaml(tmp_path) -> None:
    from plait.cli import main
    from plait.cluster import load_cluster

    out, raw = tmp_path / "local.yaml", tmp_path / "raw.json"
    code = main(["profile", "--nprocs", "2", "--out", str(out), "--result", str(raw), "--max-size", "16K",
                 "--p2p-size", "64K", "--matmul-sizes", "64,128", "--min-time", "0.005", "--timeout", "120"])
    assert code == 0
    result = ProfileResult.from_json(raw.read_text())
    assert result.world == 2 and result.backend == "gloo" and set(result.p2p) == {"0-1", "1-0"}
    assert [r["bytes"] for r in result.collectives["all_reduce"]] == [1024, 2048, 4096, 8192, 16384]
    for rows in result.collectives.values():
        for row in rows:
            assert row["time_s"] > 0 and row["algbw"] == pytest.approx(row["bytes"] / row["time_s"])
    assert len(result.op_overhead) == 2 and all(f > 0 and b > 0 for f, b in result.op_overhead)
    ar = result.collectives["all_reduce"][-1]
    assert ar["busbw"] == pytest.approx(ar["algbw"] * 2 * (2 - 1) / 2)
    c = load_cluster(str(out))
    assert c.num_devices == 2 and list(c.kinds) == ["measured-cpu"]
    assert c.kinds["measured-cpu"].flops("fp32") == pytest.approx(
        (result.matmul[0]["fp32"] + result.matmul[1]["fp32"]) / 2)
    mean_bw = (result.p2p["0-1"]["bandwidth"] + result.p2p["1-0"]["bandwidth"]) / 2
    assert bandwidth_matrix(c)[0, 1] == pytest.approx(mean_bw)
    # The saved result converts again without measuring.
    again = tmp_path / "again.yaml"
    assert main(["profile", "--from-result", str(raw), "--out", str(again)]) == 0
    assert bandwidth_matrix(load_cluster(str(again)))[0, 1] == pytest.approx(mean_bw)


# ~9 s; the two-worker profile test stays in make test
@pytest.mark.slow
def test_profile_inside_emulated_namespaces_measures_the_shaped_link(tmp_path) -> None:
    from plait.commands.profile_cmd import profile
    from plait.runtime.netns import list_namespaces, namespaces_possible

    ok, why = namespaces_possible()
    if not ok:
        pytest.skip(why)
    base = tmp_path / "emu.yaml"
    base.write_text(textwrap.dedent("""
        name: emu2
        nodes:
          - {name: a, gpus: {kind: a100-80gb, count: 1}, nic: {bandwidth: 100 Gb/s}}
          - {name: b, gpus: {kind: t4, count: 1}, nic: {bandwidth: 100 Gb/s}}
        emulation: {bandwidth_scale: 0.002}
    """))  # 12.5 GB/s * 0.002 = 25 MB/s between the nodes
    result, data = profile(str(base), sizes=[4096, 65536], p2p_bytes=2 * MiB, matmul_sizes=[128], min_time=0.005,
                           slowdown_dtype="fp32", timeout_s=120, prefix="plaittestprof")
    assert not [ns for ns in list_namespaces() if ns.startswith("plaittestprof-")]  # removed afterwards
    for key in ("0-1", "1-0"):
        assert result.p2p[key]["bandwidth"] == pytest.approx(25e6, rel=0.25)
    assert result.slowdowns == pytest.approx([1.0, 19.5 / 8.1])
    assert data["emulation"]["slowdown"]["measured-t4"] == pytest.approx(19.5 / 8.1)
