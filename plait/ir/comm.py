"""Communication records: one line per collective or point-to-point message of one rank.

The runtime's communication facade (`plait.runtime.comm`) appends a record to a per-rank
JSON Lines file *as each call completes* (the file is line-buffered), so the records of a
rank that hangs or is killed stay on disk up to its last finished call. A file is:

* line 1, the header: ``{"format_version": 3, "kind": "plait.comm_records", "rank": r, ...}``
  (clock, host, process id; the times below are seconds of that clock);
* ``{"type": "group", "group": name, "ranks": [...]}`` once per process group the rank is in;
* ``{"type": "enter", ...}``: one `CommEnter` when the rank *enters* a call (C4D's enter
  timestamp), written before the call is handed to torch.distributed: a call that never ends
  (a hang) still shows who entered it and who did not (format_version 2; version 1 files have
  no enter lines and are read as they are);
* ``{"type": "call", ...}``: one `CommRecord` per collective, and per tensor of a point-to-point
  batch (group ``"p2p a->b"``: sender a, receiver b);
* ``{"type": "host", ...}``: one `HostSample` at each round of link probes (format_version 3):
  the CPU seconds this process and its whole host had used, so the doctor can tell a link from
  other processes taking the host's CPU (a probe slows under contention as under a slow link).

The full field list, for writing a run folder by hand, is in docs/doctor.md.

Sequence numbers count calls per group on each rank, so the n-th all-reduce of group "dp"
carries the same `seq` on every rank of that group; for a point-to-point link they count the
tensors sent over it, so the n-th send of a->b matches the n-th receive at b. `key` is the
event key shared by simulator and runtime: ``"send_fwd s0 c0 mb1"`` for pipeline messages,
``f"{op} {group}"`` for collectives (with `seq` making it unique).

Pure data: nothing here imports torch or the runtime.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from plait.errors import PlaitError

FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # 1: no enter lines (plait before the doctor); 2: no host lines; read as they are
FILE_KIND = "plait.comm_records"
STOP_RECORD = "stopped.json"
"""The launcher's record, in the run folder, that it stopped every rank: ``{"format_version": 1,
"time": unix seconds, "kind": "hang" | "stopped", "reason": text}`` -- "hang": no progress for its
timeout (the user's `--timeout`); "stopped": its watcher asked (`plait run --recover`'s doctor) --
written *before* the first kill. A rank that ends at or after it by a signal from outside (SIGKILL,
SIGTERM) was stopped with the job, not dead of a fault of its own."""
STOP_RECORD_VERSION = 1  # a newer one is not read (the doctor warns and reads the kills as before)


class CommRecordError(PlaitError):
    """A records file that cannot be read: unknown format, missing header, a corrupt line."""


@dataclass(frozen=True)
class CommRecord:
    """One finished communication call of one rank (times: seconds of the header's clock)."""

    rank: int
    group: str  # "dp", "tp", "pp", "world", an explicit group's name, or "p2p a->b"
    op: str  # all_reduce | all_gather | reduce_scatter | broadcast | reduce | all_to_all | barrier | gather | send | recv
    bytes: int  # payload this rank hands to / receives from the call (tensor numel x element size)
    seq: int  # per-group sequence number on this rank (0, 1, ...)
    t_enqueue: float  # the caller asked for the call
    t_start: float  # the call was handed to torch.distributed (after any injected delay)
    t_end: float  # the call returned (waited on)
    key: str | None = None  # event key of the shared scheme, e.g. "send_fwd s0 c0 mb1"
    name: str | None = None  # the runtime Timeline span it belongs to
    peer: int | None = None  # point-to-point: the other rank
    step: int | None = None  # training step when the call ran (None: setup / teardown)
    injected_s: float = 0.0  # delay added on purpose by a link fault (plait.runtime.comm)

    @property
    def duration(self) -> float:
        """Seconds from the request to the return, what the caller waited."""
        return self.t_end - self.t_enqueue

    def to_line(self) -> str:
        # vars(), not asdict(): no deep copy of flat fields, on the path of every call
        return json.dumps({"type": "call", **vars(self)}, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CommRecord:
        names = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.name in _REQUIRED and f.name not in data]
        if missing:
            raise CommRecordError(f"comm record: missing field(s) {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in names})


_REQUIRED = ("rank", "group", "op", "bytes", "seq", "t_enqueue", "t_start", "t_end")


@dataclass(frozen=True)
class CommEnter:
    """A rank entered a call (written before the call starts): the same `group`/`seq` numbering
    as `CommRecord`, so an enter without its record is a call that had not ended."""

    rank: int
    group: str
    op: str
    bytes: int
    seq: int
    t: float  # the caller asked for the call (= the record's t_enqueue)
    key: str | None = None
    peer: int | None = None
    step: int | None = None

    def to_line(self) -> str:
        return json.dumps({"type": "enter", **vars(self)}, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CommEnter:
        names = {f.name for f in fields(cls)}
        missing = [n for n in ("rank", "group", "op", "bytes", "seq", "t") if n not in data]
        if missing:
            raise CommRecordError(f"comm enter: missing field(s) {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class HostSample:
    """CPU counters of one rank's process and host at one moment (taken before each round of
    link probes): differences of two samples give the CPU that *other* processes took on the
    host meanwhile."""

    rank: int
    t: float  # when (seconds of the header's clock)
    cpu_s: float  # CPU seconds this process (all its threads) had used
    host_busy_s: float  # CPU seconds the whole host had used, all CPUs (Linux /proc/stat: not idle, not iowait)
    host_cpus: int  # CPUs the host has
    step: int | None = None

    def to_line(self) -> str:
        return json.dumps({"type": "host", **vars(self)}, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HostSample:
        names = {f.name for f in fields(cls)}
        missing = [n for n in ("rank", "t", "cpu_s", "host_busy_s", "host_cpus") if n not in data]
        if missing:
            raise CommRecordError(f"host sample: missing field(s) {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class CommRecordFile:
    """The contents of one rank's records file."""

    path: str
    header: dict[str, Any]
    groups: dict[str, list[int]] = field(default_factory=dict)
    records: list[CommRecord] = field(default_factory=list)
    truncated: bool = False  # the last line was cut short (the rank died while writing it)
    enters: list[CommEnter] = field(default_factory=list)  # format_version 2: calls as they were entered
    hosts: list[HostSample] = field(default_factory=list)  # format_version 3: CPU counters at each probe round
    warnings: list[str] = field(default_factory=list)  # lines skipped by a lenient read (file and line)

    @property
    def rank(self) -> int:
        return int(self.header["rank"])


def header_line(rank: int, **extra: Any) -> str:
    """The first line of a records file."""
    return json.dumps({"format_version": FORMAT_VERSION, "kind": FILE_KIND, "rank": rank, **extra})


def group_line(name: str, ranks: list[int]) -> str:
    """A group line: `name`'s member ranks (global ranks, group order)."""
    return json.dumps({"type": "group", "group": name, "ranks": list(ranks)})


def _check_header(path: Path, header: Any) -> dict[str, Any]:
    if not isinstance(header, dict) or header.get("kind") != FILE_KIND:
        raise CommRecordError(f"{path}: line 1 is not a {FILE_KIND} header")
    version = header.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        newer = isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION
        why = "written by a newer plait: upgrade plait to read it" if newer else \
            "not a version any plait wrote"
        raise CommRecordError(f"{path}: field 'format_version' is {version!r}; this plait reads comm records "
                              f"of format_version {', '.join(map(str, READABLE_VERSIONS))} ({why})")
    if not isinstance(header.get("rank"), int):
        raise CommRecordError(f"{path}: header field 'rank' must be an integer, got {header.get('rank')!r}")
    return header


def read_comm_records(path: str | Path, *, lenient: bool = False) -> CommRecordFile:
    """Read one rank's records file. A last line without its newline (the rank was killed while
    writing it) is dropped and flagged `truncated`; an unknown `format_version` or a missing
    header raise `CommRecordError` naming the file. A corrupt line elsewhere raises too, unless
    `lenient`: then it is skipped and named (file and line) in `warnings` (the doctor reads
    what it can of a damaged run)."""
    p = Path(path)
    try:
        text = p.read_text(errors="replace")
    except OSError as exc:
        raise CommRecordError(f"{p}: cannot read comm records ({exc.strerror or exc})") from None
    lines = text.split("\n")
    complete, tail = lines[:-1], lines[-1]  # text after the last newline was never finished
    if not complete:
        raise CommRecordError(f"{p}: no header line (empty or cut before the first newline)")
    try:
        header = json.loads(complete[0])
    except json.JSONDecodeError:
        raise CommRecordError(f"{p}: line 1 is not JSON (expected a {FILE_KIND} header)") from None
    out = CommRecordFile(path=str(p), header=_check_header(p, header), truncated=bool(tail))
    version = header["format_version"]
    for i, line in enumerate(complete[1:], start=2):
        if not line.strip():
            continue
        try:
            _read_line(out, p, i, line, version)
        except CommRecordError as exc:
            if not lenient:
                raise
            out.warnings.append(f"{exc}; skipped")
    if tail and lenient:
        out.warnings.append(f"{p}: line {len(complete) + 1} was cut short (the rank ended while writing it); skipped")
    return out


def _read_line(out: CommRecordFile, p: Path, i: int, line: str, version: int) -> None:
    try:
        data = json.loads(line)
    except json.JSONDecodeError:
        raise CommRecordError(f"{p}: line {i} is not JSON") from None
    kind = data.get("type") if isinstance(data, dict) else None
    try:
        if kind == "group":
            out.groups[str(data["group"])] = [int(r) for r in data["ranks"]]
        elif kind == "call":
            out.records.append(CommRecord.from_dict(data))
        elif kind == "enter" and version >= 2:
            out.enters.append(CommEnter.from_dict(data))
        elif kind == "host" and version >= 3:
            out.hosts.append(HostSample.from_dict(data))
        else:
            allowed = ("'call', 'enter', 'host' or 'group'" if version >= 3 else
                       "'call', 'enter' or 'group'" if version >= 2 else "'call' or 'group'")
            raise CommRecordError(f"field 'type' must be {allowed}, got {kind!r}")
    except CommRecordError as exc:
        raise CommRecordError(f"{p}: line {i}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise CommRecordError(f"{p}: line {i}: bad {kind} line ({type(exc).__name__}: {exc})") from None


def read_run_comm_records(folder: str | Path, *, lenient: bool = False) -> dict[int, CommRecordFile]:
    """Every rank's records file of a run folder's `comm/` directory, by rank."""
    files = sorted(Path(folder).glob("rank*.jsonl"))
    out = {}
    for f in files:
        rf = read_comm_records(f, lenient=lenient)
        out[rf.rank] = rf
    return out
