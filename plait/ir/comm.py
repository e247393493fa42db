"""Communication records: one line per collective or point-to-point message of one rank.

The runtime's communication facade (`plait.runtime.comm`) appends a record to a per-rank
JSON Lines file *as each call completes* (the file is line-buffered), so the records of a
rank that hangs or is killed stay on disk up to its last finished call. A file is:

* line 1, the header: ``{"format_version": 1, "kind": "plait.comm_records", "rank": r, ...}``
  (clock, host, process id; the times below are seconds of that clock);
* ``{"type": "group", "group": name, "ranks": [...]}`` once per process group the rank is in;
* ``{"type": "call", ...}``: one `CommRecord` per collective, and per tensor of a point-to-point
  batch (group ``"p2p a->b"``: sender a, receiver b).

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

FORMAT_VERSION = 1
FILE_KIND = "plait.comm_records"


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


@dataclass
class CommRecordFile:
    """The contents of one rank's records file."""

    path: str
    header: dict[str, Any]
    groups: dict[str, list[int]] = field(default_factory=dict)
    records: list[CommRecord] = field(default_factory=list)
    truncated: bool = False  # the last line was cut short (the rank died while writing it)

    @property
    def rank(self) -> int:
        return int(self.header["rank"])


def header_line(rank: int, **extra: Any) -> str:
    """The first line of a records file."""
    return json.dumps({"format_version": FORMAT_VERSION, "kind": FILE_KIND, "rank": rank, **extra})


def group_line(name: str, ranks: list[int]) -> str:
    return json.dumps({"type": "group", "group": name, "ranks": list(ranks)})


def _check_header(path: Path, header: Any) -> dict[str, Any]:
    if not isinstance(header, dict) or header.get("kind") != FILE_KIND:
        raise CommRecordError(f"{path}: line 1 is not a {FILE_KIND} header")
    version = header.get("format_version")
    if version != FORMAT_VERSION:
        raise CommRecordError(f"{path}: field 'format_version' is {version!r}; this plait reads comm records "
                              f"of format_version {FORMAT_VERSION} only (written by a different plait version)")
    if not isinstance(header.get("rank"), int):
        raise CommRecordError(f"{path}: header field 'rank' must be an integer, got {header.get('rank')!r}")
    return header


def read_comm_records(path: str | Path) -> CommRecordFile:
    """Read one rank's records file. A last line without its newline (the rank was killed while
    writing it) is dropped and flagged `truncated`; a corrupt line elsewhere, an unknown
    `format_version` or a missing header raise `CommRecordError` naming the file and line."""
    p = Path(path)
    try:
        text = p.read_text()
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
    for i, line in enumerate(complete[1:], start=2):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            raise CommRecordError(f"{p}: line {i} is not JSON") from None
        kind = data.get("type") if isinstance(data, dict) else None
        if kind == "group":
            out.groups[str(data["group"])] = [int(r) for r in data["ranks"]]
        elif kind == "call":
            try:
                out.records.append(CommRecord.from_dict(data))
            except CommRecordError as exc:
                raise CommRecordError(f"{p}: line {i}: {exc}") from None
        else:
            raise CommRecordError(f"{p}: line {i}: field 'type' must be 'call' or 'group', got {kind!r}")
    return out


def read_run_comm_records(folder: str | Path) -> dict[int, CommRecordFile]:
    """Every rank's records file of a run folder's `comm/` directory, by rank."""
    files = sorted(Path(folder).glob("rank*.jsonl"))
    out = {}
    for f in files:
        rf = read_comm_records(f)
        out[rf.rank] = rf
    return out
