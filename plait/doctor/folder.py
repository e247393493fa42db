"""Read a run folder for the doctor: every rank's records, heartbeat, exit and status, on one clock.

What is read (all optional but `comm/`; the record format is in docs/doctor.md):

* `comm/rankN.jsonl` -- the streamed records (`plait.ir.comm`), read leniently: a corrupt or
  cut line becomes a warning naming the file and line, and the rest is used;
* `hb/rankN.json` -- the rank's last heartbeat (`plait.runtime.recorder.Heartbeat`); the file's
  modification time is when it was last written (a stopped rank stops writing it);
* `exit/rankN.json` and `status/rankN.json` -- how the rank's process ended, if it did;
* `config.json` -- the run's plan and rank layout (host, node, pipeline/data/tensor coordinates);
* `stopped.json` -- the launcher's record that it stopped every rank (`plait.ir.comm.STOP_RECORD`:
  a hang it found, or its watcher's verdict), written before its first kill;
* `pause/rankN.jsonl` -- the runtime's pause markers (`plait.runtime.recorder.Heartbeat`: a
  checkpoint write, a restart's checkpoint load, an evaluation, a wait for the data loader),
  begin and end in Unix time: a wait they cover is a pause on purpose, not a stall nor work.

Times: a records header with `perf_at_open` and `wall_at_open` maps its `perf_counter` times to
Unix time; without them the times are taken as they are (a hand-written folder: any clock the
ranks share). Everything is then shifted to seconds from the run's first call (`t0`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from plait.ir.comm import (
    STOP_RECORD,
    STOP_RECORD_VERSION,
    CommEnter,
    CommRecord,
    CommRecordError,
    HostSample,
    read_comm_records,
)
from plait.ir.diagnosis import DiagnosisError


@dataclass
class RankRun:
    """One rank's view of the run, times in seconds from the run's `t0`."""

    rank: int
    records: list[CommRecord] = field(default_factory=list)
    enters: list[CommEnter] = field(default_factory=list)
    groups: dict[str, list[int]] = field(default_factory=dict)
    heartbeat: dict[str, Any] | None = None
    hb_written: float | None = None  # when the heartbeat file was last written (run clock)
    exit: dict[str, Any] | None = None
    status: dict[str, Any] | None = None
    info: dict[str, Any] = field(default_factory=dict)  # config.json's rank entry (host, node, ...)
    coords: tuple[int, int, int] | None = None  # (pp, dp, tp) from the plan, when known
    damaged: list[str] = field(default_factory=list)  # its records file's cut or unreadable lines
    hosts: list[HostSample] = field(default_factory=list)  # CPU counters at each probe round (run clock)
    host: str | None = None  # the records header's host name
    pauses: list[tuple[str, Any, float, float | None]] = field(default_factory=list)
    """Marked pauses (what, step, begin, end or None while it lasts), run clock."""

    @property
    def done(self) -> bool:
        """The rank ended normally (status ok, or its heartbeat says done)."""
        return (self.status or {}).get("state") == "ok" or (self.heartbeat or {}).get("phase") == "done"


class Stop(NamedTuple):
    """The launcher's stop of the whole job (`plait.ir.comm.STOP_RECORD`)."""

    t: float  # run clock
    kind: str  # "hang": no progress for the launcher's timeout; "stopped": its watcher asked
    reason: str


@dataclass
class RunRecords:
    run_dir: str
    world: int
    ranks: dict[int, RankRun]
    t0_wall: float  # Unix time (or the files' own clock) of the run's first call
    t_obs: float  # end of what the folder shows (run clock): last record, heartbeat or exit
    warnings: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    wall_clock: bool = False  # record times were mapped to Unix time (heartbeat and exit times compare)
    stopped: Stop | None = None
    """When and why the launcher stopped every rank (`STOP_RECORD`), if it did."""

    def node_of(self, rank: int) -> Any:
        return self.ranks[rank].info.get("node", self.ranks[rank].info.get("host")) if rank in self.ranks else None


def _read_json(path: Path, warnings: list[str]) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        warnings.append(f"{path}: not readable JSON ({type(exc).__name__}); ignored")
        return None
    if not isinstance(data, dict):
        warnings.append(f"{path}: expected a JSON object; ignored")
        return None
    return data


def _coords(plan: dict[str, Any] | None, rank: int) -> tuple[int, int, int] | None:
    if not plan:
        return None
    tp, dp = int(plan.get("tp", 1) or 1), int(plan.get("dp", 1) or 1)
    return rank // (tp * dp), (rank // tp) % dp, rank % tp


def read_run(run_dir: str | Path, *, live: bool = False) -> RunRecords:
    """Everything the doctor reads from `run_dir` (a run folder, or a folder holding `rankN.jsonl`)."""
    root = Path(run_dir)
    comm = root / "comm" if (root / "comm").is_dir() else root
    files = sorted(comm.glob("rank*.jsonl"))
    if not root.is_dir():
        raise DiagnosisError(f"{root}: no such run folder")
    if not files:
        raise DiagnosisError(f"{root}: no communication records (expected comm/rankN.jsonl; see docs/doctor.md)")
    warnings: list[str] = []
    config = _read_json(root / "config.json", warnings) or {}
    plan = config.get("plan") if isinstance(config.get("plan"), dict) else None
    layout = {int(r["rank"]): r for r in config.get("ranks", []) if isinstance(r, dict) and "rank" in r}
    # How each rank ended, its heartbeat and pause markers are read *before* its records: a live
    # read then never sees a rank done (or a pause ended) whose records it read before they were
    # complete (a rank that finished while the records were being read looked done with its last
    # steps cut short: a false slow_rank of a clean pp=4 run at one poll).
    state = {f: _read_state(root, f.stem[len("rank"):], warnings) for f in files}
    ranks: dict[int, RankRun] = {}
    offsets: dict[int, float] = {}
    world = 0
    for f in files:
        try:
            rf = read_comm_records(f, lenient=True)
        except CommRecordError as exc:  # no header, unknown version: this file is unusable, the rest is not
            if "format_version" in str(exc):
                raise DiagnosisError(str(exc)) from None
            warnings.append(f"{exc}; file skipped")
            continue
        warnings += rf.warnings
        h = rf.header
        off = float(h["wall_at_open"]) - float(h["perf_at_open"]) \
            if isinstance(h.get("wall_at_open"), int | float) and isinstance(h.get("perf_at_open"), int | float) else 0.0
        offsets[rf.rank] = off
        world = max(world, int(h.get("world", 0) or 0))
        ranks[rf.rank] = RankRun(rank=rf.rank, records=rf.records, enters=rf.enters, groups=rf.groups,
                                 info=layout.get(rf.rank, {}), coords=_coords(plan, rf.rank),
                                 damaged=list(rf.warnings), hosts=rf.hosts,
                                 host=str(h["host"]) if h.get("host") is not None else None)
    if not ranks:
        raise DiagnosisError(f"{comm}: no readable records file")
    world = max(world, len(config.get("ranks", [])), max(ranks) + 1)
    starts = [offsets[r] + min([c.t_enqueue for c in rr.records] + [e.t for e in rr.enters])
              for r, rr in ranks.items() if rr.records or rr.enters]
    t0 = min(starts) if starts else 0.0
    t_obs = 0.0
    for r, rr in ranks.items():
        shift = offsets[r] - t0
        rr.records = sorted((replace(c, t_enqueue=c.t_enqueue + shift, t_start=c.t_start + shift,
                                     t_end=c.t_end + shift) for c in rr.records), key=lambda c: c.t_enqueue)
        rr.enters = sorted((replace(e, t=e.t + shift) for e in rr.enters), key=lambda e: e.t)
        rr.hosts = sorted((replace(h, t=h.t + shift) for h in rr.hosts), key=lambda h: h.t)
        t_obs = max([t_obs] + [c.t_end for c in rr.records] + [e.t for e in rr.enters])
    by_rank = {int(f.stem[len("rank"):]): st for f, st in state.items() if f.stem[len("rank"):].isdigit()}
    for r, rr in ranks.items():
        st = by_rank.get(r, {})
        rr.heartbeat, rr.exit, rr.status = st.get("hb"), st.get("exit"), st.get("status")
        if rr.heartbeat is not None and offsets[r] != 0.0 and st.get("hb_mtime") is not None:
            rr.hb_written = st["hb_mtime"] - t0
        rr.pauses = _pauses(st.get("pauses"), t0, warnings)
        if offsets[r] != 0.0:  # wall-clock files are comparable only when the records are too
            for t in ((rr.exit or {}).get("time"), (rr.status or {}).get("time")):
                if isinstance(t, int | float):
                    t_obs = max(t_obs, t - t0)
            if rr.hb_written is not None:
                t_obs = max(t_obs, rr.hb_written)
    wall_clock = any(v != 0.0 for v in offsets.values())
    stopped = _read_stop(root, t0, warnings) if wall_clock else None
    if stopped is not None:
        t_obs = max(t_obs, stopped.t)
    if live:
        t_obs = max(t_obs, time.time() - t0)
    return RunRecords(run_dir=str(root), world=world, ranks=ranks, t0_wall=t0, t_obs=t_obs,
                      warnings=warnings, config=config, wall_clock=wall_clock, stopped=stopped)


def _read_stop(root: Path, t0: float, warnings: list[str]) -> Stop | None:
    """The launcher's stop record on the run clock (None without one, or of a newer format)."""
    stop = _read_json(root / STOP_RECORD, warnings)
    if stop is None or not isinstance(stop.get("time"), int | float):
        return None
    if int(stop.get("format_version", 1) or 1) > STOP_RECORD_VERSION:
        warnings.append(f"{root / STOP_RECORD}: format_version {stop.get('format_version')} is newer than "
                        f"this plait reads ({STOP_RECORD_VERSION}); ignored")
        return None
    return Stop(float(stop["time"]) - t0, str(stop.get("kind", "stopped")), str(stop.get("reason", "")))


PAUSES_KIND = "plait.pauses"  # plait.runtime.recorder writes them; the doctor reads the file alone


def _read_state(root: Path, rank: str, warnings: list[str]) -> dict[str, Any]:
    """One rank's heartbeat (and when it was last written), exit, status and pause-marker lines."""
    hb_path = root / "hb" / f"rank{rank}.json"
    try:
        mtime: float | None = os.stat(hb_path).st_mtime  # before the read: the content is as new or newer
    except OSError:
        mtime = None
    out: dict[str, Any] = {"hb_mtime": mtime, "hb": _read_json(hb_path, warnings),
                           "exit": _read_json(root / "exit" / f"rank{rank}.json", warnings),
                           "status": _read_json(root / "status" / f"rank{rank}.json", warnings)}
    path = root / "pause" / f"rank{rank}.jsonl"
    try:
        out["pauses"] = (path, path.read_text().splitlines())
    except OSError:
        out["pauses"] = None
    return out


def _pauses(read: tuple[Path, list[str]] | None, t0: float,
            warnings: list[str]) -> list[tuple[str, Any, float, float | None]]:
    """A rank's pause markers as (what, step, begin, end) on the run clock; a begin without its
    end is a pause still going (or cut short by the rank's end). Unreadable lines are warned of."""
    if read is None:
        return []
    path, lines = read
    out: list[tuple[str, Any, float, float | None]] = []
    for i, line in enumerate(lines, 1):
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            warnings.append(f"{path}: line {i}: not JSON (cut short?); ignored")
            continue
        if i == 1:
            if not isinstance(d, dict) or d.get("kind") != PAUSES_KIND or d.get("format_version") != 1:
                warnings.append(f"{path}: not a version-1 '{PAUSES_KIND}' file; ignored")
                return []
            continue
        if not isinstance(d, dict) or not isinstance(d.get("what"), str):
            continue
        if isinstance(d.get("begin"), int | float):
            out.append((d["what"], d.get("step"), float(d["begin"]) - t0, None))
        elif isinstance(d.get("end"), int | float):
            for k in range(len(out) - 1, -1, -1):
                if out[k][0] == d["what"] and out[k][3] is None:
                    out[k] = (*out[k][:3], float(d["end"]) - t0)
                    break
    return out


def _read_pauses(path: Path, t0: float, warnings: list[str]) -> list[tuple[str, Any, float, float | None]]:
    """`_pauses` of the file at `path` (none when it cannot be read)."""
    try:
        return _pauses((path, path.read_text().splitlines()), t0, warnings)
    except OSError:
        return []


def as_of(run: RunRecords, t: float) -> RunRecords:
    """The records as they stood at run time `t` (what a live doctor polling then would have read):
    calls that had returned by `t`, enter lines written by `t`, heartbeats, exits and statuses only
    when written by `t`. The replay that checks live findings equal post-hoc ones (tests, bench)."""
    ranks = {}
    for r, rr in run.ranks.items():
        hb_ok = rr.hb_written is not None and rr.hb_written <= t

        def by_t(d: dict[str, Any] | None) -> dict[str, Any] | None:
            when = (d or {}).get("time")
            return d if isinstance(when, int | float) and when - run.t0_wall <= t else None
        ranks[r] = replace(rr, records=[c for c in rr.records if c.t_end <= t],
                           enters=[e for e in rr.enters if e.t <= t],
                           heartbeat=rr.heartbeat if hb_ok else None, hb_written=rr.hb_written if hb_ok else None,
                           pauses=[(w, s, b, e if e is not None and e <= t else None) for w, s, b, e in rr.pauses
                                   if b <= t],
                           exit=by_t(rr.exit), status=by_t(rr.status))
    return replace(run, ranks=ranks, t_obs=t, stopped=run.stopped if run.stopped and run.stopped.t <= t else None)


def pid_alive(pid: Any) -> bool:
    """Live mode: whether a rank's process still exists (this machine only)."""
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True
