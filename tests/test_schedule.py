"""Schedules as data (plait.schedule): hand-checked action lists and deadlock-freedom properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.schedule import (
    Action,
    PipelineGraph,
    ScheduleError,
    build,
    execute,
    gpipe,
    graph_1f1b,
    interleaved_1f1b,
    one_f_one_b,
)


def _compute(schedule, stage):
    return [f"{a.op[0].upper()}{a.chunk}.{a.micro_batch}" for a in schedule.compute(stage)]


# ---------------------------------------------------------------- hand-checked lists
def test_1f1b_pp2_m4_full_action_list():
    s = one_f_one_b(PipelineGraph.chain(2, 4))
    assert s.lines(0) == [
        "fwd s0 c0 mb0", "send_fwd s0 c0 mb0 -> s1 c0 mb0",
        "fwd s0 c0 mb1", "send_fwd s0 c0 mb1 -> s1 c0 mb1",
        "recv_bwd s0 c0 mb0 <- s1 c0 mb0", "bwd s0 c0 mb0",
        "fwd s0 c0 mb2", "send_fwd s0 c0 mb2 -> s1 c0 mb2",
        "recv_bwd s0 c0 mb1 <- s1 c0 mb1", "bwd s0 c0 mb1",
        "fwd s0 c0 mb3", "send_fwd s0 c0 mb3 -> s1 c0 mb3",
        "recv_bwd s0 c0 mb2 <- s1 c0 mb2", "bwd s0 c0 mb2",
        "recv_bwd s0 c0 mb3 <- s1 c0 mb3", "bwd s0 c0 mb3",
    ]
    assert s.lines(1)[:4] == ["recv_fwd s1 c0 mb0 <- s0 c0 mb0", "fwd s1 c0 mb0", "bwd s1 c0 mb0",
                              "send_bwd s1 c0 mb0 -> s0 c0 mb0"]


def test_1f1b_pp4_m8_warmup_is_pp_minus_p_minus_1():
    s = one_f_one_b(PipelineGraph.chain(4, 8))
    assert _compute(s, 0)[:5] == ["F0.0", "F0.1", "F0.2", "F0.3", "B0.0"]
    assert _compute(s, 2) == ["F0.0", "F0.1", "B0.0", "F0.2", "B0.1", "F0.3", "B0.2", "F0.4", "B0.3",
                              "F0.5", "B0.4", "F0.6", "B0.5", "F0.7", "B0.6", "B0.7"]
    assert _compute(s, 3) == [x for i in range(8) for x in (f"F0.{i}", f"B0.{i}")]


def test_gpipe_pp2_m4_all_forwards_then_backwards_latest_first():
    s = gpipe(PipelineGraph.chain(2, 4))
    assert _compute(s, 0) == ["F0.0", "F0.1", "F0.2", "F0.3", "B0.3", "B0.2", "B0.1", "B0.0"]
    assert [a.key for a in s.of(1)[:3]] == ["recv_fwd s1 c0 mb0", "fwd s1 c0 mb0", "recv_fwd s1 c0 mb1"]


def test_interleaved_pp2_m4_v2_matches_megatron_order():
    # Megatron: warm-up (pp-p-1)*2 + (v-1)*pp units; unit k = chunk (k % 4) // 2 of micro-batch 2*(k//4) + k%2.
    s = interleaved_1f1b(PipelineGraph.chain(2, 4, virtual_stages=2))
    assert _compute(s, 0) == ["F0.0", "F0.1", "F1.0", "F1.1", "F0.2", "B1.0", "F0.3", "B1.1",
                              "F1.2", "B0.0", "F1.3", "B0.1", "B1.2", "B1.3", "B0.2", "B0.3"]
    assert _compute(s, 1) == ["F0.0", "F0.1", "F1.0", "B1.0", "F1.1", "B1.1", "F0.2", "B0.0",
                              "F0.3", "B0.1", "F1.2", "B1.2", "F1.3", "B1.3", "B0.2", "B0.3"]
    # Chunk 1 of rank 0 (virtual stage 2) receives from chunk 0 of rank 1 (virtual stage 1).
    assert "recv_fwd s0 c1 mb0 <- s1 c0 mb0" in s.lines(0)


def test_graph_1f1b_diamond_warmup_counts_longest_path():
    g = PipelineGraph.dag([[1] * 4] * 4, [(0, 1), (0, 2), (1, 3), (2, 3), (0, 3)])
    s = graph_1f1b(g)
    assert g.depth() == {0: 2, 1: 1, 2: 1, 3: 0}
    assert _compute(s, 0)[:3] == ["F0.0", "F0.1", "F0.2"]
    assert _compute(s, 1)[:3] == ["F0.0", "F0.1", "B0.0"]
    # The fan-out stage sends each forward to all three successors, in node order.
    assert s.lines(0)[1:4] == ["send_fwd s0 c0 mb0 -> s1 c0 mb0", "send_fwd s0 c0 mb0 -> s2 c0 mb0",
                               "send_fwd s0 c0 mb0 -> s3 c0 mb0"]
    # The fan-in stage receives from all of them before its forward.
    assert s.lines(3)[:4] == ["recv_fwd s3 c0 mb0 <- s0 c0 mb0", "recv_fwd s3 c0 mb0 <- s1 c0 mb0",
                              "recv_fwd s3 c0 mb0 <- s2 c0 mb0", "fwd s3 c0 mb0"]


def test_differing_micro_batch_sizes_split_and_concatenate():
    # Stage 0 runs micro-batches of 2, stage 1 of 1 (4 samples): one producer mb feeds two consumer mbs.
    g = PipelineGraph.dag([[2, 2], [1, 1, 1, 1]], [(0, 1)])
    s = build("1f1b", g)
    sends = [a for a in s.of(0) if a.op == "send_fwd"]
    assert [(a.micro_batch, a.peer[2], a.samples) for a in sends] == [(0, 0, (0, 1)), (0, 1, (1, 2)),
                                                                      (1, 2, (2, 3)), (1, 3, (3, 4))]
    execute(s)
    execute(s, rendezvous=True)


def test_event_keys_follow_the_shared_scheme():
    assert Action("fwd", 1, 0, 3).key == "fwd s1 c0 mb3"
    assert Action("recv_bwd", 0, 1, 2, (1, 1, 2)).key == "recv_bwd s0 c1 mb2"


# ---------------------------------------------------------------- bad input
def test_bad_graphs_name_the_field():
    with pytest.raises(ScheduleError, match="cycle"):
        PipelineGraph.dag([[1], [1]], [(0, 1), (1, 0)])
    with pytest.raises(ScheduleError, match="samples"):
        PipelineGraph.dag([[1, 1], [1]], [(0, 1)])
    with pytest.raises(ScheduleError, match="'pp'"):
        PipelineGraph.chain(0, 4)
    with pytest.raises(ScheduleError, match="multiple of pp"):
        interleaved_1f1b(PipelineGraph.chain(2, 3, virtual_stages=2))
    with pytest.raises(ScheduleError, match="not a chain"):
        one_f_one_b(PipelineGraph.dag([[1]] * 3, [(0, 1), (0, 2)]))
    with pytest.raises(ScheduleError, match="schedule"):
        build("zigzag", PipelineGraph.chain(2, 2))


def test_checker_catches_a_broken_schedule():
    s = one_f_one_b(PipelineGraph.chain(2, 2))
    # Drop rank 1's first receive: its forward now runs without its input.
    broken = type(s)(s.name, s.graph, (s.actions[0], s.actions[1][1:]))
    with pytest.raises(ScheduleError, match="before its input"):
        execute(broken)
    # Swap two receives of rank 0: FIFO order between the ranks is broken.
    acts = list(s.actions[0])
    i, j = [k for k, a in enumerate(acts) if a.op == "recv_bwd"]
    acts[i], acts[j] = acts[j], acts[i]
    acts[i + 1], acts[j + 1] = acts[j + 1], acts[i + 1]
    with pytest.raises(ScheduleError):
        execute(type(s)(s.name, s.graph, (tuple(acts), s.actions[1])))


# ---------------------------------------------------------------- properties
@settings(max_examples=60, deadline=None)
@given(pp=st.integers(1, 5), m=st.integers(1, 9), name=st.sampled_from(["gpipe", "1f1b"]))
def test_chain_schedules_are_deadlock_free(pp, m, name):
    s = build(name, PipelineGraph.chain(pp, m))
    trace = execute(s)
    assert sum(a.is_compute for a in trace) == 2 * pp * m
    execute(s, rendezvous=True)  # also under Megatron's blocking batched p2p


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(2, 4), groups=st.integers(1, 3), v=st.integers(2, 3))
def test_interleaved_is_deadlock_free(pp, groups, v):
    s = build("interleaved", PipelineGraph.chain(pp, pp * groups, virtual_stages=v))
    assert sum(a.is_compute for a in execute(s)) == 2 * pp * v * pp * groups


@st.composite
def _dags(draw):
    n = draw(st.integers(1, 6))
    edges = [(a, b) for b in range(n) for a in range(b) if draw(st.booleans())]
    total = draw(st.integers(1, 8))
    sizes = []
    for _ in range(n):
        mb = draw(st.integers(1, total))
        sizes.append([min(mb, total - s) for s in range(0, total, mb)])
    return PipelineGraph.dag(sizes, edges)


@settings(max_examples=120, deadline=None)
@given(graph=_dags(), name=st.sampled_from(["gpipe", "graph_1f1b"]))
def test_dag_schedules_are_deadlock_free(graph, name):
    s = build(name, graph)
    trace = execute(s)
    assert sum(a.is_compute for a in trace) == 2 * sum(n.micro_batches for n in graph.nodes)
    assert len([a for a in trace if a.op.startswith("send")]) == len([a for a in trace if a.op.startswith("recv")])


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(1, 5), m=st.integers(1, 9))
def test_graph_1f1b_on_a_chain_is_1f1b(pp, m):
    g = PipelineGraph.chain(pp, m)
    assert graph_1f1b(g).actions == one_f_one_b(g).actions
