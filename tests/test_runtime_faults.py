"""Faults, checkpoints and the CLI, with real torchrun workers.

* a straight 4-step run through `plait run` (two torchrun agents on loopback, --json, --trace,
  a checkpoint at step 4);
* SIGKILL of rank 1 while it writes the step-4 checkpoint: the run stops naming rank 1 and its
  host, the complete step-2 checkpoint survives and the half-written step-4 one is ignored;
  `--resume` then finishes steps 2-3 bit for bit like the straight run;
* a rank that hangs: `plait run` stops within --timeout, naming it, as one error line;
* an emulated heterogeneous cluster: the slower kind's compute spans are stretched (loopback;
  with network namespaces too when running as root).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from plait.cli import main as cli_main
from plait.doctor import diagnose
from plait.runtime import checkpoint as ckpt
from plait.runtime.api import (
    CheckpointConfig,
    FaultsConfig,
    LaunchConfig,
    RecordsConfig,
    RunFailure,
    run,
)

pytestmark = pytest.mark.distributed

TINY = "gpt:layers=4,hidden=16,heads=4,seq=8,vocab=32,dropout=0,attn_dropout=0"
PLAN = "dp=2,micro_batch=2,global_batch=8,dtype=fp32"
EMU_YAML = """
name: emu2
gpu_kinds:
  fast: {{flops: {{fp32: 20 TFLOPS}}, memory: 16 GiB, memory_bandwidth: 700 GB/s}}
  slow: {{flops: {{fp32: 10 TFLOPS}}, memory: 16 GiB, memory_bandwidth: 300 GB/s}}
nodes:
  - {{name: fastnode, gpus: {{kind: fast, count: 1}}, intra: {{type: pcie, bandwidth: 16 GB/s}}}}
  - {{name: slownode, gpus: {{kind: slow, count: 1}}, intra: {{type: pcie, bandwidth: 16 GB/s}}}}
fabric: {{type: ethernet, bandwidth: 10 Gb/s, latency: 50 us}}
emulation: {{enabled: true, namespaces: {namespaces}, bandwidth_scale: 0.1, slowdown: {{slow: 3.0}}}}
"""


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """4 steps through the CLI; the checkpoint after step 4 holds every rank's final state."""
    d = tmp_path_factory.mktemp("straight")
    trace = d / "trace.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli_main(["run", "--model", TINY, "--plan", PLAN, "--steps", "4", "--json", "--trace", str(trace),
                         "--nprocs-per-node", "1", "--checkpoint-dir", str(d / "ck"), "--checkpoint-every", "4",
                         "--timeout", "120"])
    assert code == 0
    return {"result": json.loads(buf.getvalue()), "trace": trace, "ck": d / "ck"}


def test_cli_run_reports_json_and_trace(straight: dict) -> None:
    res = straight["result"]
    assert res["steps"] == [0, 1, 2, 3] and len(res["losses"]) == 4 and len(res["iteration_times"]) == 4
    assert res["network"]["mode"] == "loopback" and res["network"]["agents"] == 2  # --nprocs-per-node 1
    assert [r["rank"] for r in res["ranks"]] == [0, 1] and res["backend"] == "gloo"
    trace = json.loads(straight["trace"].read_text())["traceEvents"]
    procs = {e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {"dev0", "dev1"}
    cats = {e["cat"] for e in trace if e["ph"] == "X"}
    assert {"forward", "backward", "optimizer", "comm_dp"} <= cats
    assert [s for s, _ in ckpt.list_checkpoints(straight["ck"])] == [4]


def test_sigkill_keeps_checkpoints_and_resume_is_bit_exact(straight: dict, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    with pytest.raises(RunFailure) as info:
        run(TINY, None, PLAN, steps=4, checkpoint=CheckpointConfig(dir=ck, every=2), launch=LaunchConfig(timeout=60),
            records=RecordsConfig(run_dir=tmp_path / "run"),
            faults=FaultsConfig(inject="kill:rank=1,step=3,at=checkpoint"))
    failure = info.value
    assert failure.rank == 1 and failure.kind == "died"
    assert "rank 1 (host " in str(failure) and "died at step 3 while writing a checkpoint (killed by SIGKILL)" \
        in str(failure)
    assert [s for s, _ in ckpt.list_checkpoints(ck)] == [2]  # the complete one survived
    # The half-written step-4 checkpoint is a temporary directory, never published.
    assert ckpt.tmp_dir(ck, 4).exists() and not ckpt.step_dir(ck, 4).exists()

    resumed = run(TINY, None, PLAN, steps=4, checkpoint=CheckpointConfig(dir=ck, every=2, resume=True),
                  launch=LaunchConfig(timeout=60), records=RecordsConfig(return_params=True))
    assert resumed.steps == [2, 3] and resumed.resumed_from == 2
    assert resumed.losses == straight["result"]["losses"][2:]  # bit for bit, not approximately
    final = ckpt.load_consolidated(ckpt.step_dir(straight["ck"], 4))["model"]
    assert resumed.params is not None and set(final) <= set(resumed.params)
    # Returned parameters carry every name of a tied tensor; the checkpoint holds it once, under its
    # first name (the GPT's LM head is the token embedding).
    assert set(resumed.params) - set(final) == {"head.lm.weight"}
    assert torch.equal(resumed.params["head.lm.weight"], final["embed.tok.weight"])
    for name, value in resumed.params.items():
        assert torch.equal(value, final.get(name, final["embed.tok.weight"])), name
    assert [s for s, _ in ckpt.list_checkpoints(ck)] == [2, 4]


def test_hang_stops_within_timeout_naming_the_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    timeout = 4.0
    code = cli_main(["run", "--model", TINY, "--plan", PLAN, "--steps", "4", "--timeout", str(timeout),
                     "--run-dir", str(tmp_path), "--inject", "hang:rank=1,step=1"])
    stopped = time.time()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("plait run: error: rank 1 (host ") and "hung at step 1" in err[0]
    assert "rank 0 was waiting for it in collectives" in err[0]
    hb = json.loads((tmp_path / "hb" / "rank1.json").read_text())
    # The hung rank's last progress is when the fault fired; the run stopped within the timeout
    # (plus the launcher's 0.1 s poll and the kill).
    assert timeout <= stopped - hb["progress"] < timeout + 5.0
    # The launcher recorded its stop before killing the ranks, so the doctor reads their SIGKILLs as
    # the stop and names the hung rank, not dead ones (issue 32).
    record = json.loads((tmp_path / "stopped.json").read_text())
    assert record["reason"] in err[0]
    exits = [json.loads(p.read_text()) for p in (tmp_path / "exit").glob("rank*.json")]
    assert exits and all(e["time"] >= record["time"] for e in exits)
    assert [(f.kind, f.ranks) for f in diagnose(tmp_path).findings] == [("noncomm_hang", (1,))]


def _emulated(tmp_path: Path, namespaces: bool) -> object:
    path = tmp_path / "cluster.yaml"
    path.write_text(EMU_YAML.format(namespaces="true" if namespaces else "false"))
    return run(TINY, str(path), PLAN, steps=2, launch=LaunchConfig(timeout=120))


def _check_slowdown(result, straight: dict) -> None:
    assert [(r.host, r.kind, r.slowdown) for r in result.ranks] == [("fastnode", "fast", 1.0),
                                                                    ("slownode", "slow", 3.0)]
    slow = [e for e in result.timeline.events if e.device == 1 and e.resource.endswith("compute")]
    fast = [e for e in result.timeline.events if e.device == 0 and e.resource.endswith("compute")]
    assert slow and all("compute_s" not in e.args for e in fast)
    # Each span of the slow kind lasts at least 3x its measured compute (sleep is never short).
    assert all(e.duration >= 3.0 * e.args["compute_s"] - 1e-6 for e in slow)
    assert result.losses == straight["result"]["losses"][:2]  # emulation changes time, not math


def test_emulated_cluster_slows_the_slow_kind(straight: dict, tmp_path: Path) -> None:
    result = _emulated(tmp_path, namespaces=False)
    _check_slowdown(result, straight)
    assert result.network["mode"] == "loopback"


def _namespaces_usable() -> bool:
    from plait.runtime.netns import namespaces_possible

    ok, _ = namespaces_possible()
    if not ok:
        return False
    name = f"plaitrtprobe-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
        return False
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return True


@pytest.mark.root
def test_emulated_cluster_in_network_namespaces(straight: dict, tmp_path: Path) -> None:
    if not _namespaces_usable():
        pytest.skip("network namespaces need root and iproute2")
    from plait.runtime.netns import list_namespaces

    # only this process's namespaces (`plait-<pid>-...`): other jobs on the machine may add their own
    mine = f"plait-{os.getpid()}-"
    before = {n for n in list_namespaces() if n.startswith(mine)}
    result = _emulated(tmp_path, namespaces=True)
    _check_slowdown(result, straight)
    assert result.network["mode"] == "namespaces"
    assert {n for n in list_namespaces() if n.startswith(mine)} == before  # the run's namespaces are gone


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains `text` (zombies excluded)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            found.append(int(proc.name))
    return found


@pytest.mark.slow  # 8-40 s; make test keeps tests/test_cli_signals.py (SIGTERM raised as an interrupt)
def test_sigterm_to_plait_run_stops_its_agents_and_workers(tmp_path: Path) -> None:
    """A scheduler's cancel (SIGTERM to `plait run`) stops every agent and worker it started, as
    Ctrl-C does, instead of leaving them training as orphans."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(["python", "-m", "plait.cli", "run", "--model", TINY, "--plan", PLAN, "--steps", "100000",
                             "--nprocs-per-node", "1", "--run-dir", str(run_dir), "--timeout", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # both ranks training
            try:
                beats = [json.loads(p.read_text()) for p in (run_dir / "hb").glob("rank*.json")]
            except ValueError:  # caught mid-write
                beats = []
            if len(beats) == 2 and all(b.get("phase") == "train" for b in beats):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the run did not start training")
        assert len(_processes_naming(str(run_dir))) >= 3  # the launcher, its agents, their workers
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and "terminated (SIGTERM)" in err, err
    deadline = time.time() + 10
    while _processes_naming(str(run_dir)) and time.time() < deadline:
        time.sleep(0.1)
    assert _processes_naming(str(run_dir)) == []
