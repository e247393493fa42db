"""Alpha-beta collective costs, bus factors, slowest-link groups and the NCCL-like choice."""

from __future__ import annotations

import math

import numpy as np
import pytest

from plait.cost.collectives import (
    CollectiveError,
    GroupLinks,
    all_to_all_time,
    bus_factor,
    busbw,
    choose_algorithm,
    collective_time,
    flow_bytes_per_link,
    group_links,
    hierarchical_all_reduce_time,
    latency_steps,
    ring_all_gather_time,
    ring_all_reduce_time,
    ring_reduce_scatter_time,
    send_recv_time,
    tree_all_reduce_time,
)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_ring_all_reduce_formula(n: int) -> None:
    M, B, a, g = 256e6, 100e9, 5e-6, 1e-12
    t = ring_all_reduce_time(M, n, B, a, g)
    assert t == pytest.approx(2 * (n - 1) * a + 2 * (n - 1) / n * M / B + (n - 1) / n * M * g, rel=1e-15)
    # nccl-tests: the busbw of a bandwidth-bound ring all-reduce is the link bandwidth.
    assert busbw("all_reduce", M, n, ring_all_reduce_time(M, n, B, 0.0)) == pytest.approx(B)


def test_shi_et_al_numbers() -> None:
    """Shi et al. (2018) used alpha = 7.5 us, gamma = 1 ns/B on 10 GbE."""
    M, n = 100e6, 4
    t = ring_all_reduce_time(M, n, 10e9 / 8, 7.5e-6, 1e-9)
    assert t == pytest.approx(6 * 7.5e-6 + 1.5 * M / 1.25e9 + 0.75 * M * 1e-9)


def test_bus_factors_and_other_ops() -> None:
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_factor("reduce_scatter", 4) == bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("send_recv", 2) == 1.0
    with pytest.raises(CollectiveError):
        bus_factor("all_scatter", 4)
    M, B, a = 64e6, 50e9, 2e-6
    assert ring_reduce_scatter_time(M, 4, B, a) == pytest.approx(3 * a + 0.75 * M / B)
    assert ring_all_gather_time(M, 4, B, a) == pytest.approx(3 * a + 0.75 * M / B)
    assert all_to_all_time(M, 4, B, a) == pytest.approx(3 * a + 0.75 * M / B)
    assert send_recv_time(M, B, a) == pytest.approx(a + M / B)
    assert tree_all_reduce_time(M, 8, B, a) == pytest.approx(2 * 3 * a + 2 * M / B)
    # RS + AG is an all-reduce.
    assert ring_reduce_scatter_time(M, 4, B, a) + ring_all_gather_time(M, 4, B, a) == pytest.approx(
        ring_all_reduce_time(M, 4, B, a))
    assert ring_all_reduce_time(M, 1, B, a) == 0.0


def test_hierarchical_is_rs_ar_ag() -> None:
    M = 1e9
    t = hierarchical_all_reduce_time(M, nodes=4, per_node=8, intra_bw=300e9, intra_alpha=2e-6,
                                     inter_bw=25e9, inter_alpha=5e-6)
    expected = (ring_reduce_scatter_time(M, 8, 300e9, 2e-6) + ring_all_reduce_time(M / 8, 4, 25e9, 5e-6)
                + ring_all_gather_time(M, 8, 300e9, 2e-6))
    assert t == pytest.approx(expected)
    # Cheaper than a flat 32-GPU ring paced by the inter-node link.
    assert t < ring_all_reduce_time(M, 32, 25e9, 5e-6)


def test_group_links_slowest_link_dominates() -> None:
    n = 4
    bw = np.full((n, n), 100e9)
    lat = np.full((n, n), 1e-6)
    bw[2, 3] = bw[3, 2] = 10e9  # one slow pair
    lat[1, 2] = lat[2, 1] = 9e-6
    g = group_links([0, 1, 2, 3], bw, lat, [0, 0, 0, 0])
    assert g.ring_bandwidth == 10e9 and g.ring_latency == 9e-6 and g.nodes == 1 and g.per_node == 4
    # A ring order that avoids the slow pair is faster (Pipette's placement lever).
    g2 = group_links([0, 2, 1, 3], bw, lat, [0, 0, 0, 0])
    assert g2.ring_bandwidth == 100e9
    assert collective_time("all_reduce", 1e9, g2) < collective_time("all_reduce", 1e9, g)


def _links(n: int, nodes: int) -> GroupLinks:
    per = n // nodes
    return GroupLinks(n, 25e9, 5e-6, nodes, per, 300e9, 2e-6, 25e9, 5e-6)


def test_algorithm_choice_like_nccl() -> None:
    one_node = GroupLinks(8, 300e9, 2e-6, 1, 8, 300e9, 2e-6, math.inf, 0.0)
    assert choose_algorithm("all_reduce", 1e3, one_node) == "ring"
    many = _links(256, 32)
    small = choose_algorithm("all_reduce", 64e3, many)
    large = choose_algorithm("all_reduce", 4e9, many)
    assert small in ("tree", "hierarchical")  # latency-bound: log-depth algorithms
    assert collective_time("all_reduce", 64e3, many, small) < collective_time("all_reduce", 64e3, many, "ring")
    assert collective_time("all_reduce", 4e9, many, large) <= collective_time("all_reduce", 4e9, many, "tree")
    assert choose_algorithm("all_reduce", 64e3, many, pinned="ring") == "ring"
    assert choose_algorithm("reduce_scatter", 64e3, many) == "ring"
    with pytest.raises(CollectiveError):
        choose_algorithm("all_reduce", 1.0, many, pinned="butterfly")


def test_gloo_reduce_scatter_is_an_all_reduce_of_the_whole_input() -> None:
    """ProcessGroupGloo::reduce_scatter_tensor clones the input, all-reduces all of it and keeps
    this rank's slice: 2(n-1) a + 2(n-1)/n S/B, twice a ring reduce-scatter's bytes and steps."""
    n, S, B, a = 4, 8e6, 1e9, 50e-6
    links = GroupLinks(n, B, a, 1, n, B, a, math.inf, 0.0)
    ring = collective_time("reduce_scatter", S, links, "ring")
    gloo = collective_time("reduce_scatter", S, links, "allreduce")
    assert ring == pytest.approx(3 * a + 0.75 * S / B)
    assert gloo == pytest.approx(ring_all_reduce_time(S, n, B, a)) == pytest.approx(6 * a + 1.5 * S / B)
    assert latency_steps("reduce_scatter", n, "allreduce") == 6 and latency_steps("reduce_scatter", n) == 3
    assert flow_bytes_per_link("reduce_scatter", S, n, "allreduce") == pytest.approx(1.5 * S)
    # a library pin for reduce-scatters leaves the other operations to their ring
    assert choose_algorithm("reduce_scatter", S, links, pinned="allreduce") == "allreduce"
    assert choose_algorithm("all_gather", S, links, pinned="allreduce") == "ring"


def test_flow_bytes_per_link() -> None:
    assert flow_bytes_per_link("all_reduce", 8e6, 4) == pytest.approx(1.5 * 8e6)
    assert flow_bytes_per_link("all_reduce", 8e6, 4, "tree") == pytest.approx(2 * 8e6)
    assert flow_bytes_per_link("all_gather", 8e6, 1) == 0.0


def test_all_to_all_across_nodes_shares_the_nics_and_uneven_is_the_largest_shard() -> None:
    """64 ranks on 8 nodes of 8, one NIC each: a node's 8 ranks send 8 * 56/64 S off the node
    through the NIC (not (n-1)/n S as one ring hop would); one node is the ring formula. An uneven
    all-to-all of a whole tensor of S bytes (device i holds s_i of it) moves each rank's own shard:
    the largest one, ``max s_i S``, sets the time (not ``n max s_i S`` as a padded all-gather)."""
    from plait.cost.collectives import uneven_collective_time

    S, a = 16e6, 25e-6
    nic, intra = 1.3e9, 12e9
    links = GroupLinks(64, nic, a, 8, 8, intra, 5e-6, nic, a, 1)
    assert collective_time("all_to_all", S, links) == pytest.approx(63 * a + 8 * 56 / 64 * S / nic)
    one = GroupLinks(8, intra, 5e-6, 1, 8, intra, 5e-6, float("inf"), 0.0)
    assert collective_time("all_to_all", S, one) == pytest.approx(all_to_all_time(S, 8, intra, 5e-6))
    skew = np.array([0.25] + [0.75 / 63] * 63)
    assert uneven_collective_time("all_to_all", S, skew, links) == pytest.approx(
        collective_time("all_to_all", 0.25 * S, links))
    even = np.full(64, 1 / 64)
    assert uneven_collective_time("all_to_all", S, even, links) == pytest.approx(63 * a + 8 * 56 / 64 * S / 64 / nic)
