"""CPU shares per rank (`plait.runtime.cpu_share`): cgroup v1 cpu groups, root only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from plait.runtime import cpu_share
from plait.runtime.cpu_share import CpuShareError, ProcessCgroup, RankCgroups

OK, WHY = cpu_share.available()
needs_cgroups = pytest.mark.skipif(not OK, reason=WHY or "cgroups available")


@pytest.mark.parametrize("kwargs, text", [({"world": 0}, "world"), ({"world": 1, "cpus": 0}, "cpus"),
                                          ({"world": 1, "shares": 1}, "shares"),
                                          ({"world": 1, "period_us": 10}, "period")])
def test_bad_values_are_refused(kwargs: dict, text: str) -> None:
    with pytest.raises(CpuShareError, match=text):
        RankCgroups(**kwargs)


def test_missing_controller_is_a_clean_no_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with RankCgroups(2, cpus=1.0, root=tmp_path) as groups:
        assert not groups.active and groups.env() == {}
        assert "no cgroup v1 cpu controller" in groups.describe() or "root" in groups.describe()
    monkeypatch.delenv(cpu_share.ENV, raising=False)
    assert cpu_share.join_from_env(0) is False  # not asked for
    monkeypatch.setenv(cpu_share.ENV, str(tmp_path / "gone"))
    assert cpu_share.join_from_env(0) is False  # the launcher's groups are already removed


@needs_cgroups
def test_rank_groups_are_made_shaped_and_removed() -> None:
    with RankCgroups(2, cpus=0.5, shares=2048, period_us=20_000) as groups:
        assert groups.active
        base = groups.base
        assert base.name.startswith(f"plait-{os.getpid()}-")
        assert (base / "rank1" / "cpu.cfs_quota_us").read_text().strip() == "10000"
        assert (base / "rank1" / "cpu.cfs_period_us").read_text().strip() == "20000"
        assert (base / "rank0" / "cpu.shares").read_text().strip() == "2048"
        assert groups.env() == {cpu_share.ENV: base.name}
    assert not base.exists()


@needs_cgroups
@pytest.mark.skipif(not (cpu_share.CPUSET_ROOT / "cpuset.cpus").exists(), reason="no cpuset controller")
# ~13 s under load (a process joined to a real cpuset)
@pytest.mark.slow
def test_cpuset_confines_a_joined_process() -> None:
    import subprocess
    import sys

    last = str((os.cpu_count() or 1) - 1)
    with RankCgroups(2, cpus=1.0, cpuset=["0", last]) as groups:
        assert groups.active
        assert (cpu_share.CPUSET_ROOT / groups.name / "rank0" / "cpuset.cpus").read_text().strip() == "0"
        code = ("import os, sys; from plait.runtime.cpu_share import join_from_env; "
                "print(join_from_env(int(sys.argv[1])), sorted(os.sched_getaffinity(0)))")
        env = {**os.environ, **groups.env(), "PYTHONPATH": str(Path(cpu_share.__file__).resolve().parents[2])}
        for rank, cpu in ((0, "0"), (1, last)):
            out = subprocess.run([sys.executable, "-c", code, str(rank)], env=env, capture_output=True, text=True,
                                 check=True).stdout.split()
            assert out == ["True", f"[{cpu}]"]
    assert not (cpu_share.CPUSET_ROOT / groups.name).exists()


def test_pinned_deals_cpus_round_robin() -> None:
    assert cpu_share.pinned(3, cpus=2) == ["0", "1", "0"]
    with pytest.raises(CpuShareError, match="2 CPU sets for 3 ranks"):
        RankCgroups(3, cpuset=["0", "1"])
    with pytest.raises(CpuShareError, match="cpuset"):
        RankCgroups(1, cpuset="zero")


@needs_cgroups
def test_process_group_holds_this_process_and_lets_it_go() -> None:
    def cpu_line() -> str:
        return next(line for line in Path("/proc/self/cgroup").read_text().splitlines() if ":cpu:" in line)

    before = cpu_line()
    with ProcessCgroup(cpus=1.0) as pc:
        assert pc.active
        assert "plait-" in cpu_line()
    assert cpu_line() == before


@needs_cgroups
def test_launcher_moves_a_namespaced_worker_into_its_rank_group(tmp_path: Path) -> None:
    """A worker in an emulated node's network namespace cannot see the cgroup filesystem
    (`ip netns exec` mounts a fresh /sys), so the launcher moves it by the pid of its heartbeat;
    on the code before, such ranks ran outside their groups (unpinned, default weight)."""
    import json
    import subprocess

    from plait.runtime.launch import AgentSpec, Launcher, _Agent

    with RankCgroups(2, shares=4096) as groups:
        assert groups.active
        proc = subprocess.Popen(["sleep", "30"])
        try:
            (tmp_path / "hb").mkdir()
            (tmp_path / "hb" / "rank1.json").write_text(json.dumps({"rank": 1, "pid": proc.pid}))
            spec = AgentSpec(node=1, host="n1", ranks=[1], namespace="plait-ns-n1")
            launcher = Launcher(tmp_path / "config.json", tmp_path, [spec], [], 60.0, 60.0, env=groups.env())
            launcher._running.append(_Agent(spec, proc, tmp_path / "agent.log", tmp_path / "f.json"))
            launcher._join_cgroups()
            mine = Path(f"/proc/{proc.pid}/cgroup").read_text()
            assert f"/{groups.name}/rank1" in mine and launcher._joined == {1}
        finally:
            proc.kill()
            proc.wait()


def test_a_worker_pinned_to_one_cpu_runs_one_thread():
    """A rank joined to a one-CPU cpuset (`plait run --predict`) must not keep more OpenMP threads
    than CPUs: two threads on one core spin-wait on each other (`make demo` ran 25x slower)."""
    import os

    import torch

    from plait.runtime.entry import fit_threads_to_cpus

    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        os.sched_setaffinity(0, {min(cpus)})
        torch.set_num_threads(2)
        assert fit_threads_to_cpus() == 1 and torch.get_num_threads() == 1
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))
        assert fit_threads_to_cpus() == len(cpus)  # never more than it had
    finally:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)
