"""The comm records file format (plait.ir.comm): round trip, truncated last line, refused versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.ir.comm import (
    FORMAT_VERSION,
    CommRecord,
    CommRecordError,
    HostSample,
    group_line,
    header_line,
    read_comm_records,
    read_run_comm_records,
)


def _record(seq: int, **kw: object) -> CommRecord:
    base = {"rank": 1, "group": "dp", "op": "all_reduce", "bytes": 64, "seq": seq, "t_enqueue": 1.0 + seq,
            "t_start": 1.1 + seq, "t_end": 1.5 + seq}
    base.update(kw)
    return CommRecord(**base)  # type: ignore[arg-type]


def _write(path: Path, lines: list[str], tail: str = "") -> Path:
    path.write_text("".join(line + "\n" for line in lines) + tail)
    return path


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    recs = [_record(0, key="all_reduce dp", name="allreduce dp bucket0", step=2),
            _record(1, group="p2p 1->2", op="send", peer=2, key="send_fwd s0 c0 mb1", injected_s=0.25)]
    f = read_comm_records(_write(tmp_path / "rank1.jsonl", [header_line(1, world=4), group_line("dp", [1, 3])]
                                 + [r.to_line() for r in recs]))
    assert f.rank == 1 and f.header["world"] == 4 and f.header["format_version"] == FORMAT_VERSION
    assert f.groups == {"dp": [1, 3]}
    assert f.records == recs and not f.truncated
    assert f.records[0].duration == pytest.approx(0.5)


def test_a_cut_last_line_is_dropped_and_flagged(tmp_path: Path) -> None:
    """A rank killed while writing leaves half a line without its newline: the rest is kept."""
    full = _record(0).to_line()
    f = read_comm_records(_write(tmp_path / "r.jsonl", [header_line(0), full], tail=_record(1).to_line()[:17]))
    assert f.truncated and [r.seq for r in f.records] == [0]


def test_host_samples_are_read_from_version_3_only(tmp_path: Path) -> None:
    sample = HostSample(rank=0, t=1.5, cpu_s=0.25, host_busy_s=1234.5, host_cpus=8, step=3)
    f = read_comm_records(_write(tmp_path / "r.jsonl", [header_line(0), sample.to_line()]))
    assert f.hosts == [sample] and not f.records
    v2 = header_line(0).replace(f'"format_version": {FORMAT_VERSION}', '"format_version": 2')
    with pytest.raises(CommRecordError, match=r"line 2: field 'type' must be 'call', 'enter' or 'group'"):
        read_comm_records(_write(tmp_path / "v2.jsonl", [v2, sample.to_line()]))


def test_unknown_format_version_is_refused_by_name(tmp_path: Path) -> None:
    head = json.loads(header_line(0))
    head["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(CommRecordError, match=r"'format_version' is 4; this plait reads comm records of "
                                              r"format_version 1, 2, 3 \(written by a newer plait"):
        read_comm_records(_write(tmp_path / "r.jsonl", [json.dumps(head)]))


@pytest.mark.parametrize(("lines", "tail", "message"), [
    ([], "", "no header line"),
    ([], '{"format_version": 1', "no header line"),
    (["not json"], "", "line 1 is not JSON"),
    (['{"format_version": 1, "kind": "other", "rank": 0}'], "", "line 1 is not a plait.comm_records header"),
    ([header_line(0).replace('"rank": 0', '"rank": "zero"')], "", "header field 'rank' must be an integer"),
    ([header_line(0), "{oops"], "", "line 2 is not JSON"),
    ([header_line(0), '{"type": "span"}'], "", "line 2: field 'type' must be 'call', 'enter', 'host' or 'group'"),
    ([header_line(0), '{"type": "call", "rank": 0, "group": "dp"}'], "", "line 2: comm record: missing field"),
])
def test_bad_files_name_the_line_and_reason(tmp_path: Path, lines: list[str], tail: str, message: str) -> None:
    with pytest.raises(CommRecordError, match=message):
        read_comm_records(_write(tmp_path / "r.jsonl", lines, tail))


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CommRecordError, match="cannot read comm records"):
        read_comm_records(tmp_path / "nope.jsonl")


def test_run_folder_is_read_by_rank(tmp_path: Path) -> None:
    for r in (1, 0):
        _write(tmp_path / f"rank{r}.jsonl", [header_line(r), _record(0, rank=r).to_line()])
    files = read_run_comm_records(tmp_path)
    assert sorted(files) == [0, 1] and files[1].records[0].rank == 1
