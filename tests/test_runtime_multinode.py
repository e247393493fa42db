"""Multi-node launch on real hosts: two `plait run` processes on localhost meet through torchrun's
c10d rendezvous (no namespaces: the path real nodes take) and train equal to one process.

One node runs in this process (`plait.runtime.api.run` or `plait.cli.main`), the other as a
`python -m plait.cli run` subprocess; each starts its own torchrun agent with as many workers
as the cluster file puts plan ranks on it (2 on 'alpha', 1 on 'beta')."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from plait.cli import main as cli_main
from plait.net.ports import free_port
from plait.runtime.api import FaultsConfig, LaunchConfig, RecordsConfig, reference_run, run
from plait.runtime.launch import RunFailure
from plait.runtime.multinode import HostMismatch, Rendezvous

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
TINY = "gpt:layers=4,hidden=16,heads=4,seq=8,vocab=32,dropout=0,attn_dropout=0"
STEPS = 2
CLUSTER = """\
name: two-hosts
nodes:
  - {name: alpha, gpus: {kind: a100-80gb, count: 2}}
  - {name: beta, gpus: {kind: a100-80gb, count: 1}}
"""


@pytest.fixture
def cluster(tmp_path: Path) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    return str(path)


@contextmanager
def other_node(args: list[str], env: dict[str, str] | None = None, timeout: float = 120.0
               ) -> Iterator[dict[str, object]]:
    """`plait run ARGS` as a separate process (the other node); yields, then collects its output."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "plait.cli", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=full_env, text=True)
    out: dict[str, object] = {}
    try:
        yield out
    finally:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        out.update(code=proc.returncode, stdout=stdout, stderr=stderr)


def _node_args(cluster: str, plan: str, endpoint: str, run_id: str, run_dir: Path, *extra: str) -> list[str]:
    return ["--model", TINY, "--cluster", cluster, "--plan", plan, "--steps", str(STEPS), "--timeout", "60",
            "--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--run-dir", str(run_dir), *extra]


@pytest.mark.slow  # suite time (2026-12-08): the other multi-node runs here stay
def test_two_hosts_2_and_1_workers_matched_by_node_name_train_like_one_process(cluster: str, tmp_path: Path) -> None:
    plan = "pp=3,micro_batch=2,global_batch=8,dtype=fp32"
    endpoint = f"127.0.0.1:{free_port()}"
    with other_node(_node_args(cluster, plan, endpoint, "t1", tmp_path / "beta", "--node-name", "beta")) as beta:
        rdzv = Rendezvous(nnodes=2, endpoint=endpoint, run_id="t1", node_name="alpha")
        result = run(TINY, cluster, plan, steps=STEPS, launch=LaunchConfig(timeout=60, rendezvous=rdzv),
                     records=RecordsConfig(run_dir=tmp_path / "alpha"))
    assert beta["code"] == 0, beta["stderr"]
    assert "this node ran plan ranks [2]" in str(beta["stdout"])
    assert result.losses == pytest.approx(reference_run(TINY, plan, STEPS)[0], rel=1e-5)
    assert result.network["mode"] == "hosts" and result.network["matched_by"] == "node name"
    assert [(r.rank, r.host) for r in result.ranks] == [(0, "alpha"), (1, "alpha"), (2, "beta")]
    assert any("worker count" in n for n in result.notes)  # CPU hosts: what was checked


@pytest.mark.slow  # ~6 s on 2 cores; the two-host run above covers the same launch path
def test_slurm_environment_needs_no_flags(cluster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    plan = "dp=3,micro_batch=1,global_batch=8,dp_shares=0.375:0.375:0.25,dtype=fp32"  # 3/3/2 samples
    port = free_port()
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
             "SLURM_JOB_NODELIST": "localhost,localhost", "MASTER_PORT": str(port)}
    common = ["--model", TINY, "--cluster", cluster, "--plan", plan, "--steps", str(STEPS), "--timeout", "60"]
    with other_node([*common, "--run-dir", str(tmp_path / "beta")], env={**slurm, "SLURMD_NODENAME": "beta",
                                                                          "SLURM_NODEID": "1"}) as beta:
        for key, value in {**slurm, "SLURMD_NODENAME": "alpha", "SLURM_NODEID": "0"}.items():
            monkeypatch.setenv(key, value)
        code = cli_main(["run", *common, "--run-dir", str(tmp_path / "alpha"), "--json"])
    assert code == 0 and beta["code"] == 0, beta["stderr"]
    out = json.loads(capsys.readouterr().out)
    assert out["network"]["launch"] == "slurm" and out["network"]["run_id"] == "slurm-4242.0"
    assert out["network"]["endpoint"] == f"localhost:{port}"
    assert out["losses"] == pytest.approx(reference_run(TINY, plan, STEPS)[0], rel=1e-5)
    assert [r["samples_per_step"] for r in out["ranks"]] == [3, 3, 2]


# ~8 s; the other multi-host runs stay in make test
@pytest.mark.slow
def test_host_that_does_not_match_the_cluster_file_is_named(cluster: str, tmp_path: Path) -> None:
    # Names not in the cluster file: nodes in rendezvous order, one worker each; the first cluster
    # node needs two. Every node stops before training with the same message.
    plan = "pp=3,micro_batch=2,global_batch=8,dtype=fp32"
    endpoint = f"127.0.0.1:{free_port()}"
    with other_node(_node_args(cluster, plan, endpoint, "t3", tmp_path / "x2", "--node-name", "x2",
                               "--nproc-per-node", "1")) as x2:
        with pytest.raises(HostMismatch) as info:
            rdzv = Rendezvous(nnodes=2, endpoint=endpoint, run_id="t3", node_name="x1", nproc=1)
            run(TINY, cluster, plan, steps=STEPS, launch=LaunchConfig(timeout=60, rendezvous=rdzv),
                records=RecordsConfig(run_dir=tmp_path / "x1"))
    message = str(info.value)
    assert "GPU count" in message and "cluster node 'alpha'" in message and "started 1 worker" in message
    assert "host " in message and ("node name 'x1'" in message or "node name 'x2'" in message)
    assert x2["code"] == 2 and message in str(x2["stderr"])
    assert not list((tmp_path / "x1" / "x1" / "hb").glob("rank*.json"))  # no worker got as far as training


# ~13 s (waits out the heartbeat timeout); the single-host hang test in test_runtime_faults stays in make test
@pytest.mark.slow
def test_hung_rank_is_named_with_its_host_within_the_timeout(cluster: str, tmp_path: Path) -> None:
    plan = "pp=3,micro_batch=2,global_batch=8,dtype=fp32"
    endpoint = f"127.0.0.1:{free_port()}"
    fault, timeout = "hang:rank=2,step=0", 4.0
    args = _node_args(cluster, plan, endpoint, "t4", tmp_path / "beta", "--node-name", "beta", "--inject", fault)
    args[args.index("--timeout") + 1] = str(timeout)
    with other_node(args) as beta:
        with pytest.raises(RunFailure) as info:
            rdzv = Rendezvous(nnodes=2, endpoint=endpoint, run_id="t4", node_name="alpha")
            run(TINY, cluster, plan, steps=STEPS, launch=LaunchConfig(timeout=timeout, rendezvous=rdzv),
                records=RecordsConfig(run_dir=tmp_path / "alpha"), faults=FaultsConfig(inject=fault))
    # beta watches its own rank: it names it, with its host, once it made no progress for `timeout`
    assert beta["code"] == 2
    found = re.search(r"rank 2 \(host beta, device 2\) hung at step 0: no progress for ([0-9.]+) s", str(beta["stderr"]))
    assert found is not None, beta["stderr"]
    assert timeout <= float(found.group(1)) < timeout + 5.0
    # alpha's ranks only lost their peer: alpha says so and points at the other node
    assert info.value.host == "alpha" and info.value.kind == "peer"
    assert "host alpha: its ranks lost a peer on another node (" in str(info.value)
    assert "'beta' with ranks [2]), whose `plait run` names the failed rank" in str(info.value)


def test_a_node_that_never_joins_ends_the_rendezvous_with_its_cause(cluster: str, tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(RunFailure) as info:
        rdzv = Rendezvous(nnodes=2, endpoint=endpoint, run_id="t5", node_name="alpha")
        run(TINY, cluster, "pp=3,micro_batch=2,global_batch=8,dtype=fp32", steps=STEPS,
            launch=LaunchConfig(timeout=60, startup_timeout=2, rendezvous=rdzv), records=RecordsConfig(run_dir=tmp_path))
    assert f"host alpha: the rendezvous of 2 nodes at {endpoint} (id t5) timed out before training" in str(info.value)
