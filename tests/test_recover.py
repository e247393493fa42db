"""The recovery loop (plait.recover): which node a diagnosis isolates, the cluster left, and the
loop itself on real torchrun workers -- a killed rank, a live diagnosis of a slow link, a repaired
node joining back -- resuming from resharded checkpoints with the loss curve continuing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from plait.cluster import load_cluster
from plait.ir.diagnosis import Diagnosis, Finding
from plait.ir.plan import Plan
from plait.recover import (
    RecoveryConfig,
    RecoveryError,
    launcher_diagnosis,
    nodes_to_isolate,
    recover,
    remaining_cluster,
)
from plait.runtime import checkpoint as ckpt
from plait.runtime.api import (
    CheckpointConfig,
    FaultsConfig,
    LaunchConfig,
    RecordsConfig,
    RunFailure,
    read_step_records,
    reference_run,
    run,
)

TINY = "gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64,dropout=0,attn_dropout=0"
# 2 nodes x 2 GPUs (A100 node, V100 node) on loopback: no root needed.
EMU = "emulated-mixed:namespaces=false"
MIXED = "mixed-a100-v100:a100_nodes=2,v100_nodes=2,gpus_per_node=1"  # 4 nodes of one GPU each


def _fault(kind: str, rank: int, step: int) -> FaultsConfig:
    """A rank killed (kill) or hung (hang) at a step (`plait.runtime.inject`)."""
    return FaultsConfig(inject=f"{kind}:rank={rank},step={step}")


def _diag(*findings: Finding) -> Diagnosis:
    return Diagnosis(run_dir="r", findings=list(findings), world_size=4)


def _f(kind: str, *ranks: int) -> Finding:
    return Finding(kind=kind, ranks=tuple(ranks), first_seen_s=1.0)


# ---------------------------------------------------------------------------------- isolation rules
def test_culprit_ranks_map_to_their_nodes_through_device_order() -> None:
    cluster = load_cluster(MIXED)
    plan = Plan.load("dp=4,micro_batch=1,global_batch=4")
    assert nodes_to_isolate(_diag(_f("dead_rank", 1)), plan, cluster).nodes == [cluster.nodes[1].name]
    # device_order moves rank 1 onto device 3 (the second V100 node).
    moved = Plan.from_dict({**plan.to_dict(), "device_order": [0, 3, 2, 1]})
    iso = nodes_to_isolate(_diag(_f("noncomm_hang", 1), _f("slow_rank", 1)), moved, cluster)
    assert iso.nodes == [cluster.nodes[3].name] and "noncomm_hang of rank 1" in iso.reasons[iso.nodes[0]]
    with pytest.raises(RecoveryError, match=r"ranks \[7\], outside the plan's 4 ranks"):
        nodes_to_isolate(_diag(_f("dead_rank", 7)), plan, cluster)


def test_a_slow_rank_is_reported_never_isolated() -> None:
    from plait.recover.detect import actionable

    cluster = load_cluster(MIXED)
    plan = Plan.load("dp=4,micro_batch=1,global_batch=4")
    assert not actionable(_diag(_f("slow_rank", 2))) and nodes_to_isolate(_diag(_f("slow_rank", 2)), plan, cluster).nodes == []
    # beside a dead rank, only the dead rank's node goes
    iso = nodes_to_isolate(_diag(_f("dead_rank", 1), _f("slow_rank", 2)), plan, cluster)
    assert iso.nodes == [cluster.nodes[1].name]


def _watch(tmp_path: Path, **config: object) -> object:
    from plait.recover.loop import _Watch

    (tmp_path / "phase-0" / "hb").mkdir(parents=True)
    return _Watch(tmp_path / "phase-0", tmp_path, tmp_path / "ck", [], lambda d: _diag(), RecoveryConfig(**config),
                  0, {})


def _poll(w: object, d: Diagnosis) -> str | None:
    """One live poll of the watch, `detect_every` (2 s) after the previous one."""
    w.clock = getattr(w, "clock", 0.0) + w.config.detect_every  # type: ignore[attr-defined]
    return w._judge(d, now=w.clock)  # type: ignore[attr-defined]


def test_live_finding_is_acted_on_only_once_it_persisted_k_polls(tmp_path: Path) -> None:
    w = _watch(tmp_path, persist=2)
    hang, none = _diag(_f("noncomm_hang", 1)), _diag()
    # a stall that resolved (stopped, then resumed) between polls: never acted on, no restart loop
    assert [_poll(w, d) for d in (hang, none, hang, none, none)] == [None] * 5 and w.diagnosis is None
    assert _poll(w, hang) is None
    assert "noncomm_hang of ranks [1]" in _poll(w, hang) and w.diagnosis.findings[0].ranks == (1,)


def test_a_slow_link_is_acted_on_only_while_its_newest_probe_is_slow(tmp_path: Path) -> None:
    # A burst of load slowed probes 10-12 of a healthy link and passed (probes 13, 14 fast): the
    # doctor keeps the finding in its history, but it is not ongoing -- never acted on, however
    # many polls name it (a clean 30-step --recover run was shrunk on such a finding). A link slow
    # up to its newest probe is acted on after K=2 polls.
    w = _watch(tmp_path, persist=2)

    def link(slow: list[int], newest: int) -> Diagnosis:
        ev = {"slow_steps": slow, "transfer_s": {str(s): 0.01 if s in slow else 0.006 for s in range(1, newest + 1)}}
        return _diag(Finding(kind="slow_link", ranks=(1, 3), first_seen_s=1.0, evidence=ev))
    assert [_poll(w, link([10, 11, 12], n)) for n in (13, 14, 15, 16)] == [None] * 4 and w.diagnosis is None
    assert _poll(w, link([10, 11, 12, 13, 14, 15, 16, 17], 17)) is None
    assert "slow_link of ranks [1, 3]" in _poll(w, link([10, 11, 12, 13, 14, 15, 16, 17, 18], 18))


def test_slow_rank_is_reported_once_and_never_stops_the_job(tmp_path: Path) -> None:
    w = _watch(tmp_path, persist=2)
    assert [_poll(w, _diag(_f("slow_rank", 2))) for _ in range(4)] == [None] * 4
    assert [a["action"] for a in w.actions] == ["report"] and w.actions[0]["findings"][0]["ranks"] == [2]


def test_advise_mode_records_what_it_would_do_and_does_nothing(tmp_path: Path) -> None:
    w = _watch(tmp_path, persist=2, advise=True)
    cluster = load_cluster(MIXED)
    plan = Plan.load("dp=4,micro_batch=1,global_batch=4")
    w.isolate = lambda d: nodes_to_isolate(d, plan, cluster).to_dict()
    assert [_poll(w, _diag(_f("dead_rank", 3))) for _ in range(3)] == [None] * 3 and w.diagnosis is None
    (advice,) = w.actions
    assert advice["action"] == "isolate" and advice["done"] is False and advice["nodes"] == [cluster.nodes[3].name]
    assert advice["findings"][0]["kind"] == "dead_rank"


def test_slow_link_isolates_one_end_by_the_documented_rule() -> None:
    cluster = load_cluster(MIXED)  # nodes 0, 1: A100; nodes 2, 3: V100
    names = [n.name for n in cluster.nodes]
    plan = Plan.load("dp=4,micro_batch=1,global_batch=4")
    # 1. an end whose node is isolated anyway
    iso = nodes_to_isolate(_diag(_f("dead_rank", 0), _f("slow_link", 0, 2)), plan, cluster)
    assert iso.nodes == [names[0]]
    # 2. the end shared by more slow links (a bad NIC)
    iso = nodes_to_isolate(_diag(_f("slow_link", 0, 1), _f("slow_link", 1, 2)), plan, cluster)
    assert iso.nodes[0] == names[1] and "end of 2 slow links" in iso.reasons[names[1]]
    # 3. the end with less compute (V100 < A100), whichever rank is higher
    iso = nodes_to_isolate(_diag(_f("slow_link", 2, 1)), plan, cluster)
    assert iso.nodes == [names[2]] and "less compute" in iso.reasons[names[2]]
    # 4. equal compute: the higher rank
    iso = nodes_to_isolate(_diag(_f("slow_link", 0, 1)), plan, cluster)
    assert iso.nodes == [names[1]] and "higher rank" in iso.reasons[names[1]]
    # both ends on one node: that node
    two = load_cluster("mixed-a100-v100:a100_nodes=1,v100_nodes=1,gpus_per_node=2")
    iso = nodes_to_isolate(_diag(_f("slow_link", 0, 1)), plan, two)
    assert iso.nodes == [two.nodes[0].name] and "one node" in iso.reasons[two.nodes[0].name]


def test_remaining_cluster_keeps_emulated_slowdowns_and_refuses_removing_everything() -> None:
    from plait.runtime.emulate import compute_slowdown

    cluster = load_cluster(EMU)
    v100 = next(d.id for d in cluster.devices if d.kind.name.startswith("v100"))
    before = compute_slowdown(cluster, v100, "fp32")
    assert before > 1.0
    left = remaining_cluster(cluster, ["a100-node"], "fp32")
    assert [n.name for n in left.nodes] == ["v100-node"] and len(left.devices) == 2
    # the fast node is gone, the V100s still run at the V100's emulated speed
    assert compute_slowdown(left, 0, "fp32") == pytest.approx(before)
    with pytest.raises(RecoveryError, match="would remove every node; nothing is left to train on"):
        remaining_cluster(cluster, ["a100-node", "v100-node"])
    with pytest.raises(RecoveryError, match=r"no node named 'gpu-9'.*its nodes: a100-node, v100-node"):
        remaining_cluster(cluster, ["gpu-9"])
    with pytest.raises(RecoveryError, match="would remove every node"):  # through the loop's own mapping
        diag = _diag(_f("dead_rank", 0), _f("dead_rank", 3))
        plan = Plan.load("dp=4,micro_batch=1,global_batch=4")
        remaining_cluster(cluster, nodes_to_isolate(diag, plan, cluster).nodes)


def test_launcher_failures_become_findings() -> None:
    died = RunFailure("rank 1 died", rank=1, host="a100-node", kind="died")
    died.detected_at = 105.0
    d = launcher_diagnosis(died, "run", 4, started=100.0)
    assert [(f.kind, f.ranks, f.first_seen_s, f.nodes) for f in d.findings] == \
        [("dead_rank", (1,), 5.0, ("a100-node",))]
    assert launcher_diagnosis(RunFailure("x", rank=2, kind="hang"), "run", 4, 0.0).findings[0].kind == "noncomm_hang"
    # a Python error in a rank is a bug, not hardware: nothing to isolate
    assert launcher_diagnosis(RunFailure("x", rank=2, kind="failed"), "run", 4, 0.0).healthy


def test_bad_recovery_arguments_fail_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(RecoveryError, match="checkpoint_every"):
        recover(TINY, EMU, "dp=2,micro_batch=2,global_batch=8", 4, run_dir=tmp_path,
                config=RecoveryConfig(checkpoint_every=0))
    with pytest.raises(RecoveryError, match="needs a cluster"):
        recover(TINY, None, "dp=2,micro_batch=2,global_batch=8", 4, run_dir=tmp_path)
    with pytest.raises(RecoveryError, match="rejoin: no node named 'nope'"):
        recover(TINY, EMU, "dp=2,micro_batch=2,global_batch=8", 4, run_dir=tmp_path,
                config=RecoveryConfig(rejoin_at={"nope": 1}))
    # what the loop sets itself: a runtime config that sets it is refused, naming the field
    for field, given in (("checkpoint_every", {"checkpoint": CheckpointConfig(dir=tmp_path, every=2)}),
                         ("return_params", {"records": RecordsConfig(return_params=True)}),
                         ("step_records", {"records": RecordsConfig(step_records=True)}),
                         ("run_dir", {"records": RecordsConfig(run_dir=tmp_path)})):
        with pytest.raises(RecoveryError, match=f"{field}: set by the recovery loop, not by its caller"):
            recover(TINY, EMU, "dp=2,micro_batch=2,global_batch=8", 4, run_dir=tmp_path, **given)


# ---------------------------------------------------------------------------------- the loop, for real
@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """4 ranks (dp=2 x tp=2) on 2 emulated nodes; rank 1 killed at step 5; checkpoints every 2."""
    d = tmp_path_factory.mktemp("killed")
    res = recover(TINY, EMU, "dp=2,tp=2,micro_batch=2,global_batch=16,dtype=fp32", 8, run_dir=d / "run",
                  config=RecoveryConfig(checkpoint_every=2, live=False), faults=_fault("kill", 1, 5),
                  checkpoint=CheckpointConfig(keep=None), launch=LaunchConfig(timeout=60))
    return {"res": res, "dir": d}


@pytest.mark.distributed
def test_killed_rank_is_isolated_and_training_continues_from_the_checkpoint(killed: dict) -> None:
    res = killed["res"]
    first, second = res.phases
    assert first.ended.startswith("failed: rank 1 (host a100-node") and first.isolation["nodes"] == ["a100-node"]
    assert json.loads((Path(first.run_dir) / "diagnosis.json").read_text())["findings"][0]["kind"] == "dead_rank"
    assert second.nodes == ["v100-node"] and second.world_size == 2 and second.ended == "finished"
    assert Plan.load(second.plan).global_batch == 16
    assert second.start_step == 4 and sorted(second.losses) == [4, 5, 6, 7]
    (t,) = res.transitions
    assert t.resumed_from == 4 and t.lost_steps == 1 and 0 < t.detect_to_train_s < 60
    # Each phase's plan, cluster and the whole record are in the run folder.
    saved = json.loads((Path(res.run_dir) / "recovery.json").read_text())
    assert saved["format_version"] == 1 and len(saved["phases"]) == 2
    assert Plan.load(Path(second.run_dir) / "plan.json").world_size == 2
    # The curve continues: the same samples per step as one process (global batch kept).
    ref, _ = reference_run(TINY, "dp=1,micro_batch=16,global_batch=16,dtype=fp32", 8)
    assert list(res.losses) == list(range(8))
    assert torch.allclose(torch.tensor(list(res.losses.values())), torch.tensor(ref), rtol=1e-4)


@pytest.mark.distributed
def test_resumed_losses_equal_a_clean_run_from_the_same_checkpoint(killed: dict, tmp_path: Path) -> None:
    res = killed["res"]
    second = res.phases[1]
    ck = tmp_path / "ck"
    ck.mkdir()
    shutil.copytree(ckpt.step_dir(Path(res.run_dir) / "checkpoints", 4), ckpt.step_dir(ck, 4))
    clean = run(TINY, str(Path(second.run_dir) / "cluster.yaml"), Path(second.run_dir) / "plan.json", steps=8,
                checkpoint=CheckpointConfig(dir=ck, resume=True), launch=LaunchConfig(timeout=60))
    assert clean.steps == [4, 5, 6, 7]
    assert clean.losses == [second.losses[s] for s in clean.steps]  # exactly


@pytest.mark.distributed
@pytest.mark.parametrize("plan", ["tp=2,micro_batch=8,global_batch=16,dtype=fp32",
                                  pytest.param("pp=2,micro_batch=4,global_batch=16,dtype=fp32",
                                               marks=pytest.mark.slow)])
def test_resharding_onto_fewer_ranks_is_exact(killed: dict, plan: str, tmp_path: Path) -> None:
    """The checkpoint written by 4 ranks (dp=2 x tp=2) loads into a 2-rank plan of the cluster
    left with every parameter equal to the checkpoint's."""
    res = killed["res"]
    second = res.phases[1]
    ck = tmp_path / "ck"
    ck.mkdir()
    shutil.copytree(ckpt.step_dir(Path(res.run_dir) / "checkpoints", 4), ckpt.step_dir(ck, 4))
    loaded = run(TINY, str(Path(second.run_dir) / "cluster.yaml"), plan, steps=4,
                 checkpoint=CheckpointConfig(dir=ck, resume=True), launch=LaunchConfig(timeout=60),
                 records=RecordsConfig(return_params=True))
    assert loaded.steps == [] and loaded.params
    state = ckpt.load_consolidated(ckpt.step_dir(ck, 4))
    want, tied = state["model"], state["train"]["tied"]  # a tied copy (the last stage's head) -> its name
    assert {tied.get(n, n) for n in loaded.params} == set(want)
    for name, value in loaded.params.items():
        assert torch.equal(value, want[tied.get(name, name)]), name


@pytest.mark.distributed
@pytest.mark.slow
def test_live_slow_link_diagnosis_isolates_an_end_and_the_node_rejoins(tmp_path: Path) -> None:
    """A detect that names a slow link once phase 0 passed step 3 (as the doctor would from the
    comm records): the loop stops the live job, isolates the V100 end (less compute), and grows
    back onto it at the next checkpoint once it is declared repaired."""

    def detect(run_dir: str | Path) -> Diagnosis:
        steps = read_step_records(run_dir, 4).losses if Path(run_dir).name == "phase-0" else {}
        found = [Finding("slow_link", (1, 2), 1.0)] if max(steps, default=-1) >= 3 else []
        return Diagnosis(run_dir=str(run_dir), findings=found, world_size=4)

    res = recover(TINY, EMU, "dp=4,micro_batch=2,global_batch=16,dtype=fp32", 80, run_dir=tmp_path,
                  config=RecoveryConfig(checkpoint_every=4, detect_every=0.2, persist=2, rejoin_at={"v100-node": 0}),
                  detect=detect, launch=LaunchConfig(timeout=60))
    p0, p1, p2 = res.phases
    assert p0.ended.startswith("diagnosed: slow_link of ranks [1, 2]")
    assert p0.isolation["nodes"] == ["v100-node"] and "less compute" in p0.isolation["reasons"]["v100-node"]
    assert p1.nodes == ["a100-node"] and p1.ended == "rejoin: v100-node"
    assert p2.nodes == ["a100-node", "v100-node"] and p2.world_size == 4 and p2.ended == "finished"
    assert [t.reason for t in res.transitions] == ["isolate", "rejoin"]
    assert p2.start_step % 4 == 0 and p2.start_step > p1.start_step
    assert list(res.losses) == list(range(80))


@pytest.mark.distributed
def test_live_doctor_diagnosis_drives_recovery_onto_fewer_ranks(tmp_path: Path) -> None:
    """No test detect: the loop's default, the doctor's own `diagnose(phase_dir, live=True)`,
    polled through the launcher's watch. Rank 1 is stopped (SIGSTOP) at step 3 of a 2-rank run on
    two 1-GPU nodes; the doctor names the non-communication hang from the records and heartbeats
    long before the launcher's 60 s heartbeat timeout, the loop isolates rank 1's node and training
    continues on the one rank left from the step-2 checkpoint, the loss curve unbroken."""
    emu1 = "emulated-mixed:namespaces=false,gpus_per_node=1"  # a100-node, v100-node: one rank each
    res = recover(TINY, emu1, "dp=2,micro_batch=4,global_batch=8,dtype=fp32", 5, run_dir=tmp_path,
                  config=RecoveryConfig(checkpoint_every=2, detect_every=0.5), launch=LaunchConfig(timeout=60),
                  faults=_fault("stop", 1, 3))
    p0, p1 = res.phases
    assert p0.ended == "diagnosed: noncomm_hang of ranks [1]"  # the live watch, not the launcher's timeout
    (found,) = [f for f in p0.diagnosis["findings"] if f["ranks"]]
    assert found["kind"] == "noncomm_hang" and "source" not in found["evidence"]  # the doctor's, with its evidence
    assert "rank 1 never entered" in found["evidence"]["reason"] and found["step"] == 3
    assert p0.isolation["nodes"] == ["v100-node"]
    # the launcher recorded the watcher's stop before killing the phase's ranks (issue 32)
    stop = json.loads((Path(p0.run_dir) / "stopped.json").read_text())
    assert stop["kind"] == "stopped" and "noncomm_hang" in stop["reason"]
    assert p1.nodes == ["a100-node"] and p1.world_size == 1 and p1.start_step == 2 and p1.ended == "finished"
    (t,) = res.transitions
    assert t.resumed_from == 2 and 0 < t.detect_to_train_s < 60
    saved = json.loads((tmp_path / "recovery.json").read_text())
    assert [p["world_size"] for p in saved["phases"]] == [2, 1] and list(saved["losses"]) == [str(i) for i in range(5)]
    ref, _ = reference_run(TINY, "dp=1,micro_batch=8,global_batch=8,dtype=fp32", 5)
    assert torch.allclose(torch.tensor(list(res.losses.values())), torch.tensor(ref), rtol=1e-4)


@pytest.mark.parametrize("argv, message", [
    (["--rejoin", "a100-node"], "--rejoin: only with --recover"),
    (["--recover"], "--recover: needs --cluster"),
    (["--recover", "--cluster", EMU, "--predict"], "--recover: not with --predict"),
    (["--recover", "--cluster", EMU, "--rejoin", "a100-node@x"], "expected NODE or NODE@STEP"),
])
def test_cli_refuses_bad_recovery_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from plait.cli import main

    code = main(["run", "--model", TINY, "--plan", "dp=2,micro_batch=2,global_batch=8", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.distributed
@pytest.mark.slow
def test_bench_core_on_a_tiny_case(tmp_path: Path) -> None:
    """bench/recovery.py's `measure` without this machine's calibration: one recovery (4 -> 2
    ranks), the baseline resume, the rows and the summary's headline figures."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "recovery.py"
    spec = importlib.util.spec_from_file_location("recovery_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    out = bench.measure(TINY, EMU, "dp=4,micro_batch=2,global_batch=16,dtype=fp32", 5, 1, 3, 2, tmp_path,
                        machine=False, rerun_steps=0)
    rows = {r["row"]: r for r in out["rows"]}
    assert rows["phase 0"]["ranks"] == 4 and rows["phase 1"]["ranks"] == 2 and rows["phase 1"]["from_step"] == 2
    assert rows["recovery after phase 0"]["isolated"] == ["a100-node"]
    assert rows["baseline: plain resume, same run"]["call_to_train_s"] > 0
    s = out["summary"]
    assert 0 < s["detect_to_train_s"] < 60 and s["detect_goal_met"] and list(s["losses"]) == [str(i) for i in range(5)]
    bench.print_table(out)  # the table renders from the same object


@pytest.mark.distributed
@pytest.mark.slow
def test_hung_rank_is_isolated_after_the_heartbeat_timeout(tmp_path: Path) -> None:
    res = recover(TINY, EMU, "dp=4,micro_batch=2,global_batch=16,dtype=fp32", 6, run_dir=tmp_path,
                  config=RecoveryConfig(checkpoint_every=2, live=False), launch=LaunchConfig(timeout=5),
                  faults=_fault("hang", 2, 3))
    p0, p1 = res.phases
    assert "rank 2 (host v100-node" in p0.ended and "hung at step 3" in p0.ended
    assert p0.diagnosis["findings"][0]["kind"] == "noncomm_hang" and p0.isolation["nodes"] == ["v100-node"]
    assert p1.nodes == ["a100-node"] and p1.start_step == 2 and p1.ended == "finished"
    assert list(res.losses) == list(range(6)) and res.transitions[0].detect_to_train_s < 60


@pytest.mark.distributed
@pytest.mark.slow
def test_cli_recover_heals_a_killed_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from plait.cli import main

    inject = ["--inject", _fault("kill", 3, 3).inject]
    code = main(["run", "--model", TINY, "--cluster", EMU, "--plan", "dp=4,micro_batch=2,global_batch=16,dtype=fp32",
                 "--steps", "5", "--checkpoint-every", "2", "--recover", "--run-dir", str(tmp_path), "--json",
                 "--timeout", "60", *inject])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["format_version"] == 1 and list(out["losses"]) == ["0", "1", "2", "3", "4"]
    assert [p["nodes"] for p in out["phases"]] == [["a100-node", "v100-node"], ["a100-node"]]
    assert out["transitions"][0]["resumed_from"] == 2 and (tmp_path / "recovery.json").exists()


def test_a_stall_that_resolved_never_stops_the_job(tmp_path: Path) -> None:
    # live: the hang is named once, then the rank resumed (the doctor now calls it a past stall)
    w = _watch(tmp_path, persist=2)
    resumed = Finding("noncomm_hang", (1,), 1.0, evidence={"resumed": True, "stalled_s": 3.0})
    assert [_poll(w, d) for d in (_diag(_f("noncomm_hang", 1)), _diag(resumed), _diag(resumed))] == [None] * 3
    assert w.diagnosis is None


@pytest.mark.distributed
def test_a_clean_run_under_recover_does_nothing(tmp_path: Path) -> None:
    """`--recover` left on over a healthy 2-rank job, the doctor's live diagnosis polled every
    0.3 s: one phase, finished, no isolation, no action in recovery.json."""
    emu1 = "emulated-mixed:namespaces=false,gpus_per_node=1"
    res = recover(TINY, emu1, "dp=2,micro_batch=4,global_batch=8,dtype=fp32", 8, run_dir=tmp_path,
                  config=RecoveryConfig(checkpoint_every=4, detect_every=0.3), launch=LaunchConfig(timeout=60))
    (p0,) = res.phases
    assert p0.ended == "finished" and p0.isolation is None and not res.transitions
    saved = json.loads((tmp_path / "recovery.json").read_text())
    assert [a for a in saved["actions"] if a["action"] != "report"] == []
    # its checkpoint writes were marked as pauses on purpose (not stalls), on every rank
    from plait.doctor import read_run

    marked = read_run(tmp_path / "phase-0").ranks
    assert all(any(w == "checkpoint" and e is not None and e >= b for w, _, b, e in rr.pauses)
               for rr in marked.values()), {r: rr.pauses for r, rr in marked.items()}
