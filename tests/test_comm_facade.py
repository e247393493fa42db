"""The communication facade (plait.runtime.comm) without workers: every runtime call site goes
through it (a source scan), link faults are parsed and applied, and each call leaves one record
(a one-rank gloo group in this process)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from plait.errors import PlaitError
from plait.ir.comm import read_comm_records
from plait.runtime.comm import Comm, CommLog, LinkFault, parse_link_faults
from plait.runtime.recorder import Recorder

RUNTIME = Path(__file__).resolve().parents[1] / "plait" / "runtime"

# A call into torch.distributed that moves data or makes groups; only the facade may make one.
_CALLS = (r"all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*|send|recv|isend|irecv|batch_isend_irecv"
          r"|barrier|monitored_barrier|all_to_all\w*|gather\w*|scatter\w*|reduce|new_group|new_subgroups\w*"
          r"|P2POp|init_process_group|destroy_process_group|init_device_mesh|DeviceMesh")
_DIRECT = re.compile(rf"\b(?:dist|torch\.distributed)\s*\.\s*(?:{_CALLS})\b")
_IMPORTED = re.compile(rf"from\s+torch\.distributed(?:\.\w+)*\s+import\s+[^\n]*\b(?:{_CALLS})\b")


def direct_calls(source: str) -> list[str]:
    """Lines of `source` that call torch.distributed's communication directly."""
    return [line.strip() for line in source.splitlines()
            if (_DIRECT.search(line) or _IMPORTED.search(line)) and not line.lstrip().startswith("#")]


def test_the_scan_finds_direct_calls() -> None:
    """The scan below would catch each form a call site could take."""
    for bad in ("dist.all_reduce(x, group=g)", "torch.distributed.barrier()", "ops = [dist.P2POp(dist.isend, t, 1)]",
                "f = dist.reduce_scatter_tensor", "g = dist.new_group([0, 1])",
                "from torch.distributed import all_gather_into_tensor", "dist.gather_object(o, out, dst=0)",
                "from torch.distributed.device_mesh import init_device_mesh"):
        assert direct_calls(bad), bad
    for fine in ("dist.is_initialized()", "group.all_reduce(flat, 'x')", "comm.barrier('step barrier')",
                 "# dist.all_reduce in a comment", "isinstance(exc, getattr(dist, 'DistError', ()))"):
        assert not direct_calls(fine), fine


def test_every_runtime_call_goes_through_the_facade() -> None:
    # recorded_pg is the facade's c10d backend: the groups DTensor's collectives reach (through torch)
    # are made there, by Comm.build_mesh only
    offenders = {p.name: direct_calls(p.read_text()) for p in sorted(RUNTIME.glob("*.py"))
                 if p.name not in ("comm.py", "recorded_pg.py")}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"torch.distributed called outside plait/runtime/comm.py: {offenders}"
    assert direct_calls((RUNTIME / "comm.py").read_text())  # the facade itself does call it


# ---------------------------------------------------------------------------------- link faults
def test_link_faults_parse_and_name_bad_fields() -> None:
    faults = parse_link_faults('[{"slow_link": [0, 2], "delay_s": 0.5}, {"slow_link": [1, 3], "factor": 3}]')
    assert faults == (LinkFault(0, 2, 0.5, 1.0), LinkFault(1, 3, 0.0, 3.0))
    assert parse_link_faults(faults[0].to_dict()) == faults[:1]
    assert parse_link_faults(None) == parse_link_faults("") == ()
    assert faults[0].applies(frozenset({0, 1, 2})) and not faults[0].applies(frozenset({0, 1}))
    for spec, message in [("{", "not JSON"), ('{"slow_link": [1, 1]}', "'slow_link' must be two different ranks"),
                          ('{"slow_link": [0]}', "'slow_link' must be two different ranks"),
                          ('{"slow_link": [0, 1], "delay_s": -1}', "'delay_s' must be a number of seconds >= 0"),
                          ('{"slow_link": [0, 1], "factor": 0.5}', "'factor' must be a number >= 1"),
                          ('{"slow_link": [0, 1], "delay": 1}', "unknown field"), ("[3]", "must be an object")]:
        with pytest.raises(PlaitError, match=message):
            parse_link_faults(spec, "PLAIT_COMM_FAULTS")


def test_run_refuses_a_fault_outside_the_plan() -> None:
    from plait.runtime.api import FaultsConfig, run

    with pytest.raises(PlaitError, match="comm_faults: field 'slow_link' \\[0, 5\\] names a rank outside"):
        run("gpt:layers=2,hidden=16,heads=4,seq=8,vocab=32", None, "dp=2,micro_batch=1,global_batch=2", steps=1,
            faults=FaultsConfig(comm_faults={"slow_link": [0, 5], "delay_s": 1}))


# ---------------------------------------------------------------------------------- one-rank facade
@pytest.fixture()
def one_rank(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A one-rank gloo job in this process (the facade's whole call path, no peers)."""
    import torch.distributed as dist

    rec = Recorder(0, 0, 0)
    comm = Comm(0, 1, rec=rec, log=CommLog(tmp_path / "rank0.jsonl", 0, 1))
    comm.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}")
    yield comm, rec, tmp_path / "rank0.jsonl"
    comm.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_each_call_leaves_one_record_and_one_span(one_rank) -> None:  # type: ignore[no-untyped-def]
    comm, rec, path = one_rank
    world = comm.world_group
    x = torch.ones(10)
    world.all_reduce(x, "allreduce test", "comm_dp")
    out = torch.empty(10)
    world.all_gather_into(out, x, "allgather test", "comm_zero", key="all_gather zero u0")
    world.reduce_scatter(torch.empty(10), out, "rs test", "comm_zero", span=False)
    world.barrier("a barrier")
    rec.begin_step(7)
    assert comm.all_gather_object({"a": 1}) == [{"a": 1}]
    comm.p2p([], "nothing")  # an empty batch is no call
    f = read_comm_records(path)
    assert f.groups == {"world": [0]} and not f.truncated
    assert [(r.op, r.bytes, r.seq, r.key) for r in f.records] == [
        ("all_reduce", 40, 0, "all_reduce world"), ("all_gather", 40, 1, "all_gather zero u0"),
        ("reduce_scatter", 40, 2, "reduce_scatter world"), ("barrier", 0, 3, "barrier world"),
        ("all_gather_object", f.records[4].bytes, 4, "all_gather_object world")]
    assert f.records[4].bytes > 0 and f.records[4].step == 7 and f.records[0].step is None
    assert all(r.t_enqueue <= r.t_start <= r.t_end and r.injected_s == 0 for r in f.records)
    # Timeline spans as before the facade: the spanned collectives only (not span=False, not barriers).
    assert [(e.name, e.category, e.args["bytes"]) for e in rec.events] == [
        ("allreduce test", "comm_dp", 40), ("allgather test", "comm_zero", 40)]


def test_a_slowed_link_delays_and_stretches_its_calls() -> None:
    """The facade's one fault hook: a group or a point-to-point batch over the slowed pair (0, 1)
    waits `delay_s` and is stretched to `factor` x its own time; other pairs are untouched."""
    comm = Comm(0, 3, faults=(LinkFault(0, 1, delay_s=0.05, factor=3.0),))
    on = comm._faults_on([frozenset({0, 1, 2})])
    assert on == comm.faults and comm._faults_on([frozenset({0, 2})]) == ()
    assert comm._faults_on([frozenset({0, 2}), frozenset({0, 1})]) == comm.faults  # a batch to ranks 2 and 1
    t0 = time.perf_counter()
    start, slept = comm._delay(on)
    assert slept == 0.05 and start - t0 >= 0.05
    time.sleep(0.02)
    end, injected = comm._stretch(on, start, slept, "kind")
    assert injected >= 0.05 + 2 * 0.02 and end - start >= 3 * 0.02
    first = (end - start) / 3  # the transfer time of that call, before its stretch
    assert comm._delay(())[1] == 0.0 and comm._stretch((), time.perf_counter(), 0.0, "kind")[1] == 0.0
    # A later call of the same kind that waited long for its peer: only ~2 x the fastest transfer
    # is stretched, not the wait (stretched waits would feed back between the ranks).
    start = time.perf_counter()
    time.sleep(0.3)
    _, injected = comm._stretch(on, start, 0.0, "kind")
    assert 2 * 2 * 0.02 <= injected <= 2 * 2 * first + 0.01 < 2 * 0.3
