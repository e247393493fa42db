"""Streamed communication records of real torchrun workers (plait.runtime.comm -> RUN_DIR/comm/rankN.jsonl).

* dp=2 and tp=2: each rank's file has the ops, groups and bytes the runtime really moves (the
  gradient bucket = every parameter, a tensor-parallel all-reduce = one activation), sequence
  numbers agree across the ranks of each group, and every Timeline comm span has its record;
* a rank killed by SIGKILL at step 3 leaves its records of steps 0-2 on disk;
* a slowed link (0, 1) on a 3-stage pipeline: the messages and collectives over that pair are
  delayed, the link (1, 2) and the tied-embedding group {0, 2} are not, and the losses are the
  single-process reference's.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from plait.ir.comm import CommRecord, CommRecordFile, read_run_comm_records
from plait.runtime.api import (
    FaultsConfig,
    LaunchConfig,
    RecordsConfig,
    RunFailure,
    RunResult,
    reference_run,
    run,
)

pytestmark = pytest.mark.distributed

LAYERS, HIDDEN, SEQ = 2, 16, 8
TINY = f"gpt:layers={LAYERS},hidden={HIDDEN},heads=4,seq={SEQ},vocab=32,dropout=0,attn_dropout=0"


def _files(result: RunResult) -> dict[int, CommRecordFile]:
    assert result.comm_dir is not None
    files = read_run_comm_records(result.comm_dir)
    assert sorted(files) == list(range(len(result.ranks)))
    assert not any(f.truncated for f in files.values())
    return files


def _assert_sequences_agree(files: dict[int, CommRecordFile]) -> None:
    """The n-th call of a group is the same call (op, key, bytes) on every rank of that group (an
    object collective's pickled size is each rank's own)."""
    def calls(f: CommRecordFile, group: str) -> list[tuple[int, str, str | None, int | None]]:
        return [(r.seq, r.op, r.key, None if r.op.endswith("_object") else r.bytes)
                for r in f.records if r.group == group]

    for rank, f in files.items():
        for name, ranks in f.groups.items():
            mine = calls(f, name)
            assert [c[0] for c in mine] == list(range(len(mine))), (rank, name)
            for other in ranks:
                assert calls(files[other], name) == mine, (rank, other, name)


def _assert_spans_have_records(result: RunResult, files: dict[int, CommRecordFile]) -> None:
    """Every measured comm span of a rank is one facade call with the same name and bytes."""
    for rank, f in files.items():
        spans = [(e.name, e.args["bytes"]) for e in result.timeline.events
                 if e.args.get("rank") == rank and e.resource.endswith("/comm")]
        calls: dict[tuple[float, str], int] = defaultdict(int)
        for r in f.records:  # a point-to-point batch is one span and one record per tensor
            calls[(r.t_enqueue, r.name or "")] += r.bytes
        recorded = [(name, nbytes) for (_, name), nbytes in sorted(calls.items())]
        assert spans and all(s in recorded for s in spans), rank


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return run(TINY, None, "dp=2,micro_batch=2,global_batch=8,dtype=fp32", steps=2, launch=LaunchConfig(timeout=120),
               records=RecordsConfig(run_dir=tmp_path_factory.mktemp("dp")))


def test_data_parallel_records(dp_run: RunResult) -> None:
    files = _files(dp_run)
    for rank, f in files.items():
        assert f.groups["dp"] == [0, 1] and f.groups["tp"] == f.groups["pp"] == [rank]
        grads = [r for r in f.records if r.name == "allreduce dp bucket0"]
        # One 25 MB bucket holds every gradient: fp32 bytes of all the rank's parameters, once per step.
        assert [(r.group, r.op, r.bytes, r.step) for r in grads] == \
            [("dp", "all_reduce", 4 * dp_run.ranks[rank].params, s) for s in (0, 1)]
        assert [(r.name, r.step) for r in f.records if r.op == "barrier"] == \
            [("startup barrier", None), ("step barrier", 0), ("probe barrier", 0), ("step barrier", 1),
             ("final barrier", None)]  # the doctor's link probes (every 10th step), between barriers
    _assert_sequences_agree(files)
    _assert_spans_have_records(dp_run, files)


def test_tensor_parallel_records(tmp_path: Path) -> None:
    # plait's own tensor-parallel engine (Megatron's f and g by name); DTensor's records on the torch
    # engine: tests/test_torch_engine.py
    result = run(TINY, None, "tp=2,micro_batch=2,global_batch=4,dtype=fp32", steps=1,
                 launch=LaunchConfig(timeout=120, engine="plait"), records=RecordsConfig(run_dir=tmp_path))
    files = _files(result)
    activation = 2 * SEQ * HIDDEN * 4  # one micro-batch's [s, b, h] fp32 activations
    for f in files.values():
        tp = [r for r in f.records if r.group == "tp"]
        # Megatron's f and g: per layer two row-parallel outputs all-reduced forward, two input
        # gradients all-reduced backward; 2 micro-batches.
        per_name = defaultdict(list)
        for r in tp:
            per_name[r.name].append((r.op, r.bytes))
        assert dict(per_name) == {"allreduce tp g-fwd": [("all_reduce", activation)] * 2 * LAYERS * 2,
                                  "allreduce tp f-bwd": [("all_reduce", activation)] * 2 * LAYERS * 2}
    _assert_sequences_agree(files)
    _assert_spans_have_records(result, files)


# ~10 s; test_doctor_runs.test_killed_rank_records_survive_and_name_it keeps this in make test
@pytest.mark.slow
def test_a_killed_rank_keeps_its_records(tmp_path: Path) -> None:
    with pytest.raises(RunFailure) as info:
        run(TINY, None, "dp=2,micro_batch=2,global_batch=4,dtype=fp32", steps=6, launch=LaunchConfig(timeout=60),
            records=RecordsConfig(run_dir=tmp_path), faults=FaultsConfig(inject="kill:rank=1,step=3"))
    assert info.value.rank == 1 and info.value.kind == "died"
    files = read_run_comm_records(tmp_path / "comm")
    killed = files[1]
    # SIGKILL before step 3's barrier: the gradient all-reduces of steps 0-2 were written as they ended.
    assert [r.step for r in killed.records if r.name == "allreduce dp bucket0"] == [0, 1, 2]
    assert killed.records[-1].step == 2
    assert [r.step for r in files[0].records if r.name == "allreduce dp bucket0"] == [0, 1, 2]


def _pairs(records: list[CommRecord], group: str) -> list[CommRecord]:
    return [r for r in records if r.group == group]


# ~12 s; the doctor's run tests (test_doctor_runs) name a slowed link from the same records
@pytest.mark.slow
def test_a_slowed_link_shows_in_its_records_only(tmp_path: Path) -> None:
    model = "gpt:layers=3,hidden=16,heads=4,seq=8,vocab=32,dropout=0,attn_dropout=0"
    plan = "pp=3,micro_batch=1,global_batch=2,dtype=fp32,schedule=1f1b"
    delay = 0.05
    result = run(model, None, plan, steps=2, launch=LaunchConfig(timeout=120), records=RecordsConfig(run_dir=tmp_path),
                 faults=FaultsConfig(comm_faults={"slow_link": [0, 1], "delay_s": delay}))
    files = _files(result)
    slow, fast = ("p2p 0->1", "p2p 1->0"), ("p2p 1->2", "p2p 2->1")
    for rank, f in files.items():
        for r in f.records:
            inside = r.group in slow or (r.group in f.groups and {0, 1} <= set(f.groups[r.group]))
            assert r.injected_s == (delay if inside else 0.0), (rank, r)
            if inside:
                assert r.duration >= delay
    # Both ends saw the same messages over each link: the n-th send is the n-th receive.
    for link in slow + fast:
        src, dst = (int(x) for x in link.split()[1].split("->"))
        sent = [(r.seq, r.bytes, r.key.split()[-1]) for r in _pairs(files[src].records, link) if r.op == "send"]
        got = [(r.seq, r.bytes, r.key.split()[-1]) for r in _pairs(files[dst].records, link) if r.op == "recv"]
        assert sent and sent == got, link
    assert {r.injected_s for r in files[2].records if r.group == "tied s0-2"} == {0.0}
    _assert_sequences_agree(files)
    ref, _ = reference_run(model, plan, 2)
    assert result.losses == pytest.approx(ref, rel=1e-6, abs=1e-6)
