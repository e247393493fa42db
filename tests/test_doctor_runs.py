"""Each fault class injected into a real 2-rank run (`plait run --inject`, torchrun workers, gloo on
loopback, sleep-padded compute) and named by the doctor with its culprit; a killed rank's records
up to its death are read. The injection suite with every class x plan shape: bench/doctor.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plait.doctor import diagnose
from plait.ir.comm import read_run_comm_records
from plait.runtime.api import FaultsConfig, LaunchConfig, RecordsConfig, RunFailure, run

pytestmark = pytest.mark.distributed

TINY = "gpt:layers=2,hidden=16,heads=4,seq=8,vocab=32,dropout=0,attn_dropout=0"
PLAN = "dp=2,micro_batch=1,global_batch=2,dtype=fp32"


def _run(tmp_path: Path, spec: str, steps: int = 8, fails: bool = False, cluster: Any = None,
         plan: str = PLAN) -> Path:
    kwargs = dict(steps=steps, launch=LaunchConfig(timeout=5.0),
                  records=RecordsConfig(run_dir=tmp_path, probe_bytes=1 << 18, probe_every=1),
                  faults=FaultsConfig(inject=spec, compute_sleep=0.04))
    if fails:
        with pytest.raises(RunFailure):
            run(TINY, cluster, plan, **kwargs)
    else:
        run(TINY, cluster, plan, **kwargs)
    return tmp_path


@pytest.mark.parametrize(("spec", "fails", "kind", "ranks", "step"), [
    ("slow:rank=1,factor=3,from=3", False, "slow_rank", (1,), 3),
    ("link:ranks=0-1,delay=30ms,from=3", False, "slow_link", (0, 1), 3),
    ("skip:rank=0,step=3", True, "comm_hang", (0,), 3),
    ("stop:rank=1,step=3", True, "noncomm_hang", (1,), 3),
    ("mismatch:rank=1,step=3", True, "mismatch", (1,), 3),
])
def test_injected_class_is_named(tmp_path: Path, spec: str, fails: bool, kind: str, ranks: tuple[int, ...],
                                 step: int) -> None:
    d = diagnose(_run(tmp_path, spec, fails=fails))
    assert d.findings, spec
    f = d.findings[0]
    assert (f.kind, f.ranks) == (kind, ranks), d.findings
    # Every class names the exact step. A slow link is named from its probes, which are split
    # before and after the step's work: under load, one descheduling used to cover a step's three
    # back-to-back repeats and name the onset one probe early (issue 15).
    assert f.step == step, d.findings
    assert f.detected_s is not None and f.detected_s >= f.first_seen_s


def test_killed_rank_records_survive_and_name_it(tmp_path: Path) -> None:
    d = diagnose(_run(tmp_path, "kill:rank=1,step=3", fails=True))
    assert [(f.kind, f.ranks) for f in d.findings][:1] == [("dead_rank", (1,))]
    assert d.findings[0].evidence["ended"] == "SIGKILL"
    killed = read_run_comm_records(tmp_path / "comm")[1]
    # Killed before step 3's barrier: its calls of steps 0-2 were written as they ended, and read.
    assert sorted({r.step for r in killed.records if r.step is not None}) == [0, 1, 2]


def test_clean_run_is_healthy(tmp_path: Path) -> None:
    assert diagnose(_run(tmp_path, "")).healthy


def test_stop_and_resume_is_a_past_stall_of_that_rank(tmp_path: Path) -> None:
    # SIGSTOP at step 3, SIGCONT 2 s later (a helper process): the run goes on, and the doctor names
    # the stall after the fact -- class, rank, step and how long.
    d = diagnose(_run(tmp_path, "stop:rank=1,step=3,for=2s"))
    f = d.findings[0]
    assert (f.kind, f.ranks, f.step) == ("noncomm_hang", (1,), 3), d.findings
    assert f.evidence["resumed"] is True and f.evidence["stalled_s"] >= 1.5


def test_node_uplink_names_every_crossing_link_and_the_node(tmp_path: Path) -> None:
    # 3 ranks on 2 nodes (0, 1 on n0; 2 on n1); node n1's uplink 30 ms later from step 3: both pairs
    # crossing it slowed together (each against its own history; the pair inside n0 did not slow).
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("""name: two-nodes
gpu_kinds:
  g: {flops: {fp32: 20 TFLOPS}, memory: 16 GiB, memory_bandwidth: 700 GB/s}
nodes:
  - {name: n0, gpus: {kind: g, count: 2}, intra: {type: pcie, bandwidth: 16 GB/s}}
  - {name: n1, gpus: {kind: g, count: 1}, intra: {type: pcie, bandwidth: 16 GB/s}}
fabric: {type: ethernet, bandwidth: 10 Gb/s, latency: 50 us}
""")
    d = diagnose(_run(tmp_path / "run", "uplink:node=1,delay=30ms,from=3", cluster=str(cluster),
                      plan="dp=3,micro_batch=1,global_batch=3,dtype=fp32"))
    links = [f for f in d.findings if f.kind == "slow_link"]
    assert {f.ranks for f in links} == {(0, 2), (1, 2)} and len(d.findings) == 2, d.findings
    assert {f.evidence.get("node_uplink") for f in links} == {"n0<->n1"} and {f.step for f in links} == {3}


def test_cpu_hog_beside_a_rank_raises_no_alarm_elsewhere(tmp_path: Path) -> None:
    # A busy loop sharing rank 1's CPUs from step 2: under sleep-padded compute the job barely slows;
    # whatever the doctor says, it names no other rank and no link.
    d = diagnose(_run(tmp_path, "hog:rank=1,from=2"))
    assert all((f.kind, f.ranks) == ("slow_rank", (1,)) for f in d.findings), d.findings
