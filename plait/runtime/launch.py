"""Start torchrun agents for a run and watch them until they finish, fail or hang.

One agent per (emulated) node: inside the node's network namespace when the cluster is
emulated with namespaces (`ip netns exec NS python -m torch.distributed.run --nnodes=N
--node-rank=k ...`), otherwise a single agent on loopback (or one per `nprocs_per_node`
ranks, which exercises the same multi-node rendezvous without root).

The launcher never waits blindly:

* an agent that exits non-zero means a worker failed; the others are stopped and the
  cause is named from torchrun's failure records (signal / exit code) and the workers'
  own status files (a Python error, or "my peer went away");
* a worker that makes no progress for `timeout` seconds while *not* blocked in a
  collective is hung; ranks blocked in collectives are only waiting for it. All workers
  are then killed (each worker is its own process group, torchrun starts them with a new
  session) together with the agents;
* collectives themselves time out after the process group's timeout (slightly longer
  than `timeout`), a backstop should the launcher itself be gone.

On real hosts (`rdzv`: one `plait run` per node, c10d rendezvous, `plait.runtime.multinode`)
each node's launcher runs one agent and watches the ranks that agent started, through the
node's own run folder (heartbeats, status and exit records are local files): a dead or hung
rank is named, with its host, by the launcher of its node within `timeout`; it then stops
its workers, and the ranks on the other nodes lose their peer at once (gloo/NCCL connection
closed) and their launchers report that. Should a whole node vanish, the ranks elsewhere
wait in collectives; their launcher stops them after `timeout` plus a grace period and says
that a rank on another node stopped answering.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.errors import PlaitError
from plait.ir.comm import STOP_RECORD, STOP_RECORD_VERSION
from plait.net.ports import free_port
from plait.runtime.multinode import HOSTS_ERROR, NODE_FILE, HostMismatch, Rendezvous, write_json

# Phases before training (imports, rendezvous, model build) and checkpoint writes may legitimately
# take longer than one step: they get the startup allowance instead of `timeout`.
STARTUP_PHASES = ("start", "init", "build", "resume", "checkpoint")
# torchrun's static rendezvous found its store's port taken (TCPStore: EADDRINUSE) before any worker
# started: the run starts again on another port, at most this many times.
PORT_RETRIES = 3


class RunFailure(PlaitError, RuntimeError):
    """A run that stopped because a rank died, failed or hung. `rank` and `host` name it; `kind` is
    died | failed | hang | terminated, peer (multi-node: this node's ranks lost a rank elsewhere), or
    stopped (the launcher's `watch` asked it to stop)."""

    def __init__(self, message: str, rank: int | None = None, host: str | None = None, kind: str = "failed",
                 run_dir: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.host = host
        self.kind = kind
        self.run_dir = run_dir
        self.detected_at: float | None = None  # wall time the launcher (or its watch) first saw it


@dataclass
class AgentSpec:
    """One torchrun agent: the plan ranks it starts (its local ranks, in order) and where."""

    node: int
    host: str
    ranks: list[int]
    namespace: str | None = None
    ip: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)  # per-node settings, e.g. NCCL_HOSTID of its namespace


@dataclass
class _Agent:
    spec: AgentSpec
    proc: subprocess.Popen[bytes]
    log: Path
    failures: Path
    exit_code: int | None = None


@dataclass
class Launcher:
    config_path: Path
    run_dir: Path
    agents: list[AgentSpec]
    rank_info: list[dict[str, Any]]
    timeout: float
    startup_timeout: float
    env: dict[str, str] = field(default_factory=dict)
    start_method: str = "fork"  # torchrun --start-method: fork workers from the agent (no re-import)
    poll: float = 0.1
    rdzv: Rendezvous | None = None  # real hosts: this node's one agent joins a c10d rendezvous
    # Called every `watch_every` s while the job runs: a message stops every rank and raises RunFailure
    # (kind "stopped") with it -- how a driver above the runtime (plait.recover) stops a live job.
    watch: Callable[[], str | None] | None = None
    watch_every: float = 0.5
    _running: list[_Agent] = field(default_factory=list)
    _joined: set[int] = field(default_factory=set)  # ranks moved into their cpu cgroup (`_join_cgroups`)
    port: int = 0  # the static rendezvous's store port of the current start (0: c10d rendezvous)
    restarts: int = 0  # starts again because the store's port was taken (`_port_taken`)

    # ------------------------------------------------------------------ start
    def _torchrun_args(self, k: int, port: int) -> list[str]:
        spec = self.agents[k]
        if self.rdzv is not None:
            # torchrun's own c10d rendezvous: nodes are numbered as they join, so no --node-rank; the
            # agents' local world sizes may differ (torchrun assigns RANK by their cumulative sum).
            return [f"--nnodes={self.rdzv.nnodes}", f"--nproc-per-node={len(spec.ranks)}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={self.rdzv.endpoint}", f"--rdzv-id={self.rdzv.run_id}",
                    f"--rdzv-conf=join_timeout={int(self.startup_timeout)}",
                    "--max-restarts=0", "--monitor-interval=0.1", f"--start-method={self.start_method}",
                    "-m", "plait.runtime.entry", str(self.config_path)]
        return [f"--nnodes={len(self.agents)}", f"--node-rank={k}", f"--nproc-per-node={len(spec.ranks)}",
                "--rdzv-backend=static", f"--master-addr={self.agents[0].ip}", f"--master-port={port}",
                "--max-restarts=0", "--monitor-interval=0.1", f"--start-method={self.start_method}",
                "-m", "plait.runtime.entry", str(self.config_path)]

    def start(self, note: str = "") -> None:
        """Start every agent; `note` (if any) goes into agent 0's log below its command line."""
        self.port = port = 0 if self.rdzv is not None else \
            free_port() if self.agents[0].namespace is None else 29400 + os.getpid() % 1000
        env = {**os.environ, **self.env}
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("PYTHONUNBUFFERED", "1")
        for k, spec in enumerate(self.agents):
            log = self.run_dir / f"agent{k}.log"
            failures = self.run_dir / f"agent{k}.failures.json"
            cmd = [sys.executable, "-m", "plait.runtime.agent", str(failures), *self._torchrun_args(k, port)]
            if spec.namespace is not None:
                cmd = ["ip", "netns", "exec", spec.namespace, *cmd]
            with open(log, "wb") as fh:
                fh.write(("# " + " ".join(cmd) + "\n").encode())  # the torchrun command line, for reruns by hand
                if note and k == 0:
                    fh.write(f"# {note}\n".encode())
                fh.flush()
                proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**env, **spec.env},
                                        cwd=os.getcwd(),
                                        start_new_session=True)
            self._running.append(_Agent(spec, proc, log, failures))

    # ------------------------------------------------------------------ watch
    def wait(self) -> None:
        """Return when every agent exited 0; raise RunFailure (after stopping everything) otherwise."""
        started = time.time()
        watched = started
        try:
            while True:
                codes = [a.proc.poll() for a in self._running]
                for a, c in zip(self._running, codes):
                    a.exit_code = c
                if all(c == 0 for c in codes):
                    return
                if any(c not in (None, 0) for c in codes) and self._port_taken():
                    self._restart()
                    started = time.time()
                    continue
                if any(c not in (None, 0) for c in codes):
                    seen = time.time()
                    self._drain(grace=5.0)
                    failure = self._diagnose_exit()
                    failure.detected_at = seen  # type: ignore[attr-defined]
                    raise failure
                self._join_cgroups()
                hung = self._find_hang(started)
                if hung is not None:
                    hung.detected_at = time.time()
                    self.stop(str(hung), hung.kind)
                    raise hung
                if self.watch is not None and time.time() - watched >= self.watch_every:
                    watched = time.time()
                    reason = self.watch()
                    if reason:
                        self.stop(reason, "stopped")
                        stopped = RunFailure(f"{reason}; stopped all ranks", kind="stopped",
                                             run_dir=str(self.run_dir))
                        stopped.detected_at = watched
                        raise stopped
                time.sleep(self.poll)
        except KeyboardInterrupt:
            self.stop()
            raise

    def _port_taken(self) -> bool:
        """Agent 0's store could not listen on its port (another process bound it between
        `free_port` and torchrun) and no worker has started: nothing ran, so the run can start again."""
        if self.rdzv is not None or self.agents[0].namespace is not None or self.restarts >= PORT_RETRIES:
            return False
        if self._running[0].proc.poll() in (None, 0) or self._heartbeats():
            return False
        return "EADDRINUSE" in _tail(self._running[0].log, 4000)

    def _restart(self) -> None:
        """Stop the agents, keep their logs beside the new ones, and start again on a new port."""
        self.stop()
        self.restarts += 1
        for a in self._running:
            a.log.replace(a.log.with_name(f"{a.log.stem}.port{self.port}.log"))
            a.failures.unlink(missing_ok=True)
        taken = self.port
        self._running.clear()
        self._joined.clear()
        self.start(note=f"started again: port {taken} was taken before the store bound it "
                        f"(agent logs of that start: *.port{taken}.log)")

    def _drain(self, grace: float) -> None:
        """After one agent failed: let torchrun stop its workers, then kill what is left."""
        deadline = time.time() + grace
        while time.time() < deadline and any(a.proc.poll() is None for a in self._running):
            time.sleep(self.poll)
        self.stop()

    def stop(self, reason: str = "", kind: str = "stopped") -> None:
        """Kill every worker (its own process group) and every agent of this run. With a `reason`
        (a hang found: `kind` "hang"; the watcher's verdict: "stopped") the stop is recorded first
        (`STOP_RECORD`), so the doctor reads the workers' SIGKILLs that follow as the job's stop, not
        as deaths, and a hang as lasting up to the stop."""
        if reason:
            _write_stop(self.run_dir, reason, kind)
        for info in self._heartbeats().values():
            pid = info.get("pid")
            if pid:
                _kill(int(pid), signal.SIGKILL)
        for a in self._running:
            if a.proc.poll() is None:
                _killpg(a.proc.pid, signal.SIGTERM)
        deadline = time.time() + 3.0
        while time.time() < deadline and any(a.proc.poll() is None for a in self._running):
            time.sleep(0.05)
        for a in self._running:
            if a.proc.poll() is None:
                _killpg(a.proc.pid, signal.SIGKILL)
                a.proc.wait()
            a.exit_code = a.proc.returncode
        for info in self._heartbeats().values():  # workers started after the first sweep
            pid = info.get("pid")
            if pid:
                _kill(int(pid), signal.SIGKILL)

    def _join_cgroups(self) -> None:
        """Workers of an emulated node run in its network namespace, where `ip netns exec` has
        mounted a fresh /sys without the cgroup filesystems, so their own `join_from_env` finds
        no group: move each into its rank's cpu (and cpuset) cgroup from here, once, by the pid
        its first heartbeat names. Without it such ranks ran unpinned at the default weight --
        slower than the profilers pinned in those groups whenever the machine is busy."""
        from plait.runtime.cpu_share import ENV, join_rank

        name = self.env.get(ENV) or os.environ.get(ENV)
        if not name or all(a.spec.namespace is None for a in self._running):
            return
        for rank, info in self._heartbeats().items():
            pid = info.get("pid")
            if rank not in self._joined and pid and _alive(pid):
                join_rank(name, rank, int(pid))
                self._joined.add(rank)

    # ------------------------------------------------------------------ state files
    def _heartbeats(self) -> dict[int, dict[str, Any]]:
        return _read_dir(self.run_dir / "hb")

    def _statuses(self) -> dict[int, dict[str, Any]]:
        return _read_dir(self.run_dir / "status")

    def _failures(self) -> dict[int, dict[str, Any]]:
        """How workers ended: torchrun's failure records, overridden by the exit records the forked
        entry point writes (torchrun's multiprocessing context reports only one failure)."""
        out: dict[int, dict[str, Any]] = {}
        for a in self._running:
            if a.failures.exists():
                try:
                    records = json.loads(a.failures.read_text())["failures"]
                except (OSError, ValueError, KeyError):
                    continue
                ranks = (self._local_ranks() or []) if self.rdzv is not None else a.spec.ranks
                for rec in records.values():
                    local = int(rec["local_rank"])
                    if 0 <= local < len(ranks):
                        out[ranks[local]] = rec
        for r, rec in _read_dir(self.run_dir / "exit").items():
            if rec.get("exitcode"):
                out[r] = {**rec, "timestamp": rec.get("time", 0)}
        return out

    def _where(self, rank: int) -> str:
        info = self.rank_info[rank]
        if self.rdzv is not None and rank in (self._local_ranks() or []):
            node = info["host"] if info["host"] == self.rdzv.node_name else \
                f"{self.rdzv.node_name} as cluster node '{info['host']}'"
            return f"rank {rank} (host {node}, device {info['device']})"
        return f"rank {rank} (host {info['host']}, device {info['device']})"

    # ------------------------------------------------------------------ diagnosis
    def _find_hang(self, started: float) -> RunFailure | None:
        now = time.time()
        if self.rdzv is not None:
            return self._find_node_hang(started, now)
        hbs = self._heartbeats()
        statuses = self._statuses()
        world = len(self.rank_info)
        missing = [r for r in range(world) if r not in hbs]
        if missing and now - started > self.startup_timeout:
            r = missing[0]
            return RunFailure(f"{self._where(r)} did not start within {self.startup_timeout:.0f} s "
                              f"(no heartbeat; log: {self._log_of(r)}); stopped all ranks",
                              rank=r, host=self.rank_info[r]["host"], kind="hang", run_dir=str(self.run_dir))
        active = {r: h for r, h in hbs.items() if h.get("phase") not in ("done", "error") and r not in statuses}
        if not active:
            return None
        stale = {r: now - float(h.get("progress", now)) for r, h in active.items()}

        def limit(h: dict[str, Any]) -> float:
            return self.startup_timeout if h.get("phase") in STARTUP_PHASES else self.timeout

        culprits = [r for r, h in active.items() if not h.get("waiting") and stale[r] > limit(h)]
        if not culprits and len(active) == world and all(h.get("waiting") for h in active.values()) \
                and min(stale.values()) > self.timeout:
            # Everyone waits on a collective and nobody moves: a mismatched collective or a lost message.
            names = ", ".join(f"{r} on '{h['waiting']}'" for r, h in sorted(active.items()))
            return RunFailure(f"all ranks waited in collectives for more than {self.timeout:.0f} s without "
                              f"progress (ranks {names}); stopped all ranks", kind="hang",
                              run_dir=str(self.run_dir))
        if not culprits:
            return None
        culprits.sort(key=lambda r: stale[r], reverse=True)
        r = culprits[0]
        h = active[r]
        waiting = sorted(q for q, hq in active.items() if hq.get("waiting"))
        others = ""
        if waiting:
            who = f"rank {waiting[0]} was" if len(waiting) == 1 else f"ranks {', '.join(map(str, waiting))} were"
            others = f"; {who} waiting for it in collectives"
        more = f" (also stalled: ranks {', '.join(map(str, culprits[1:]))})" if len(culprits) > 1 else ""
        where = f"at step {h.get('step')}" if h.get("phase") in ("train", "checkpoint") else f"during {h.get('phase')}"
        return RunFailure(f"{self._where(r)} hung {where}: no progress for "
                          f"{stale[r]:.1f} s{others}{more}; stopped all ranks",
                          rank=r, host=self.rank_info[r]["host"], kind="hang", run_dir=str(self.run_dir))

    def _local_ranks(self) -> list[int] | None:
        """Real hosts: the plan ranks this node runs, once its workers mapped them (None before)."""
        try:
            return [int(r) for r in json.loads((self.run_dir / NODE_FILE).read_text())["ranks"]]
        except (OSError, ValueError, KeyError):
            return None

    def _other_hosts(self) -> str:
        """The other nodes of a multi-node run and their plan ranks, from this node's mapping record."""
        try:
            hosts = json.loads((self.run_dir / NODE_FILE).read_text())["hosts"]
        except (OSError, ValueError, KeyError):
            return "unknown hosts"
        assert self.rdzv is not None
        return ", ".join(f"{h['hostname']} '{h['name']}' with ranks {h['ranks']}" for h in hosts
                         if h["name"] != self.rdzv.node_name) or "none"

    def _find_node_hang(self, started: float, now: float) -> RunFailure | None:
        """Real hosts: watch the ranks of this node; a stuck rank of another node shows as every
        local rank waiting in collectives."""
        assert self.rdzv is not None
        local = self._local_ranks()
        expected = len(self.agents[0].ranks)
        hbs = self._heartbeats()
        if local is not None:
            hbs = {r: h for r, h in hbs.items() if r in local}
        if len(hbs) < expected:
            # After the agent's own rendezvous timeout (join_timeout = startup_timeout), which names the cause.
            if now - started > max(2 * self.startup_timeout, self.startup_timeout + 60.0):
                return RunFailure(f"host {self.rdzv.node_name}: {len(hbs)} of {expected} workers started within "
                                  f"{self.startup_timeout:.0f} s (rendezvous at {self.rdzv.endpoint} with "
                                  f"{self.rdzv.nnodes} nodes; log: {self._running[0].log}); stopped this node",
                                  host=self.rdzv.node_name, kind="hang", run_dir=str(self.run_dir))
            return None
        statuses = self._statuses()
        active = {r: h for r, h in hbs.items() if h.get("phase") not in ("done", "error") and r not in statuses}
        if not active:
            return None
        stale = {r: now - float(h.get("progress", now)) for r, h in active.items()}
        limit = {r: self.startup_timeout if h.get("phase") in STARTUP_PHASES else self.timeout
                 for r, h in active.items()}
        culprits = sorted((r for r, h in active.items() if not h.get("waiting") and stale[r] > limit[r]),
                          key=lambda r: stale[r], reverse=True)
        if culprits:
            r, h = culprits[0], active[culprits[0]]
            where = f"at step {h.get('step')}" if h.get("phase") in ("train", "checkpoint") else \
                f"during {h.get('phase')}"
            return RunFailure(f"{self._where(r)} hung {where}: no progress for {stale[r]:.1f} s; stopped the ranks "
                              f"of this node", rank=r, host=self.rdzv.node_name, kind="hang",
                              run_dir=str(self.run_dir))
        # The launcher of the node holding a hung rank stops it after `timeout`; its peers here then
        # fail at once. Waiting past that (plus a grace) means that node or its launcher is gone.
        grace = self.timeout + min(30.0, self.timeout)
        if len(active) == expected and all(h.get("waiting") for h in active.values()) and min(stale.values()) > grace:
            names = ", ".join(f"{r} on '{h['waiting']}'" for r, h in sorted(active.items()))
            return RunFailure(f"host {self.rdzv.node_name}: every rank of this node waited in collectives for more "
                              f"than {grace:.0f} s (ranks {names}): a rank on another node stopped answering; "
                              f"see that node's output; stopped the ranks of this node", kind="hang",
                              host=self.rdzv.node_name, run_dir=str(self.run_dir))
        return None

    def _log_of(self, rank: int) -> str:
        if self.rdzv is not None:
            return str(self._running[0].log)
        for a in self._running:
            if rank in a.spec.ranks:
                return str(a.log)
        return str(self.run_dir)

    def _diagnose_exit(self) -> PlaitError:
        hosts = self.run_dir / HOSTS_ERROR
        if hosts.exists():  # the hosts that joined do not match the cluster file (multinode.check_hosts)
            try:
                return HostMismatch(json.loads(hosts.read_text())["error"])
            except (OSError, ValueError, KeyError):
                pass
        hbs, statuses, failures = self._heartbeats(), self._statuses(), self._failures()
        candidates: list[tuple[int, float, int, str, str]] = []  # (priority, time, rank, kind, text)
        for r in range(len(self.rank_info)):
            st, fail, hb = statuses.get(r), failures.get(r), hbs.get(r, {})
            step = (st or {}).get("step", hb.get("step"))
            phase = (st or {}).get("phase", hb.get("phase", "start"))
            at = f" at step {step}" if step is not None and step >= 0 else f" during {phase}"
            if phase == "checkpoint":
                at += " while writing a checkpoint"
            if st is not None and st.get("state") == "ok":
                continue
            if st is not None and st.get("state") == "error":
                peer = bool(st.get("peer_error"))
                candidates.append((3 if peer else 1, float(st.get("time", 0)), r, "failed",
                                   f"failed{at}: {st.get('error', '?')}"))
            elif st is not None and st.get("state") == "terminated":
                candidates.append((4, float(st.get("time", 0)), r, "terminated", f"was stopped{at}"))
            elif fail is not None and int(fail.get("exitcode", 1)) != 0:
                code = int(fail.get("exitcode", 1))
                how = f"killed by {fail.get('signal')}" if code < 0 else f"exited with code {code}"
                candidates.append((0, float(fail.get("timestamp", 0)), r, "died", f"died{at} ({how})"))
            elif hb and not _alive(hb.get("pid")):
                candidates.append((2, float(hb.get("progress", 0)), r, "died", f"died{at} (process gone)"))
        if not candidates and self.rdzv is not None:
            text = _tail(self._running[0].log)
            for name, what in (("RendezvousTimeoutError", "timed out"), ("RendezvousConnectionError", "lost its store"),
                               ("RendezvousClosedError", "was closed")):
                if name in text:
                    return RunFailure(f"host {self.rdzv.node_name}: the rendezvous of {self.rdzv.nnodes} nodes at "
                                      f"{self.rdzv.endpoint} (id {self.rdzv.run_id}) {what} before training: check "
                                      f"that every node runs the same command and reaches the endpoint; log: "
                                      f"{self._running[0].log}", host=self.rdzv.node_name, kind="failed",
                                      run_dir=str(self.run_dir))
        if not candidates:
            codes = [a.exit_code for a in self._running]
            return RunFailure(f"torchrun exited with codes {codes} before the workers reported; "
                              f"see {self._running[0].log}", kind="failed", run_dir=str(self.run_dir))
        candidates.sort()
        prio, _, r, kind, text = candidates[0]
        others = sorted({c[2] for c in candidates[1:]})
        tail = f"; stopped the other ranks ({', '.join(map(str, others))})" if others else ""
        if self.rdzv is not None and prio == 3:  # every local rank only lost its peer: the cause is elsewhere
            return RunFailure(f"host {self.rdzv.node_name}: its ranks lost a peer on another node "
                              f"({self._other_hosts()}), whose `plait run` names the failed rank; here "
                              f"{self._where(r)} {text}{tail}; log: {self._log_of(r)}", rank=r,
                              host=self.rdzv.node_name, kind="peer", run_dir=str(self.run_dir))
        return RunFailure(f"{self._where(r)} {text}{tail}; log: {self._log_of(r)}", rank=r,
                          host=self.rank_info[r]["host"], kind=kind, run_dir=str(self.run_dir))


# ---------------------------------------------------------------------------------- helpers
def _tail(path: Path, size: int = 20000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, path.stat().st_size - size))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def _read_dir(path: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return out
    for f in path.glob("rank*.json"):
        try:
            out[int(f.stem[4:])] = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
    return out


def _alive(pid: Any) -> bool:
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_stop(run_dir: Path, reason: str, kind: str) -> None:
    """The stop record (`STOP_RECORD`), written whole before any kill."""
    try:
        write_json(run_dir / STOP_RECORD, {"format_version": STOP_RECORD_VERSION, "time": time.time(),
                                           "kind": kind, "reason": reason})
    except OSError:  # a folder gone or read-only: the stop itself must still happen
        pass


def _kill(pid: int, sig: int) -> None:
    """Signal a worker: its process group when it leads one (spawned by torchrun with a new
    session), else the process itself (forked from the agent, in the agent's group)."""
    _killpg(pid, sig)
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
