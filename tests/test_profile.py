"""`plait profile`: schedules, nccl-tests conventions, and a real 2-worker run whose YAML loads."""

from __future__ import annotations

import itertools

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from plait.cluster.profile import (
    KiB,
    MiB,
    ProfileError,
    ProfileResult,
    bus_factor,
    default_sizes,
    parse_size,
    round_robin_rounds,
    split_by_nic,
)


@given(st.integers(min_value=2, max_value=33))
def test_round_robin_is_a_tournament(n: int) -> None:
    rounds = round_robin_rounds(n)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)
    seen = []
    for pairs in rounds:
        ranks = [r for p in pairs for r in p]
        assert len(ranks) == len(set(ranks))  # a matching
        assert len(pairs) == n // 2  # perfect (one rank rests when n is odd)
        seen += pairs
    assert sorted(seen) == list(itertools.combinations(range(n), 2))


@given(st.integers(min_value=2, max_value=16), st.integers(min_value=1, max_value=4))
def test_split_by_nic_keeps_each_node_on_one_link(n: int, per_node: int) -> None:
    node_of = [r // per_node for r in range(n)]
    for pairs in round_robin_rounds(n):
        subs = split_by_nic(pairs, node_of)
        assert sorted(p for s in subs for p in s) == sorted(pairs)
        for s in subs:
            cross = [(node_of[a], node_of[b]) for a, b in s if node_of[a] != node_of[b]]
            nodes = [x for p in cross for x in p]
            assert len(nodes) == len(set(nodes))


def test_sizes_and_bus_factors() -> None:
    sizes = default_sizes()
    assert sizes[0] == KiB and sizes[-1] == 256 * MiB and len(sizes) == 19
    assert default_sizes(4 * KiB) == [1024, 2048, 4096]
    assert [parse_size(s) for s in ("4096", "64K", "256M", "1G", "2MiB")] == [4096, 65536, 256 * MiB, 1024 * MiB,
                                                                              2 * MiB]
    with pytest.raises(ProfileError, match="byte count"):
        parse_size("lots")
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather", 4) == 0.75
    assert bus_factor("all_reduce", 1) == 1.0
