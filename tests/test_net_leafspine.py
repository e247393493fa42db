"""The namespace leaf/spine where the kernel hashes (plait.net.leafspine; root only, skipped
cleanly without): policy routes put the planned flows evenly on the spines, the kernel's L4 hash
places every flow on some spine, and each step is near the flow model's prediction."""

from __future__ import annotations

import pytest

from plait.net import leafspine
from plait.net.maxmin import max_min_rates

OK, WHY = leafspine.available()


@pytest.mark.skipif(not OK, reason=WHY)
def test_planned_and_hashed_flows_on_a_namespace_leaf_spine() -> None:
    rate, nbytes, flows = 4e6, 1_000_000, 8
    steps = leafspine.measure(spines=4, flows=flows, rate=rate, nbytes=nbytes, seeds=(7,))
    planned, hashed = steps
    assert planned.flows_per_spine == [2, 2, 2, 2]  # the policy routes were obeyed
    assert sum(hashed.flows_per_spine) == flows
    for st in steps:
        assert sum(st.uplink_bytes) >= flows * nbytes  # payload plus headers
        rates = max_min_rates([rate] * 4, [[(s, 1.0)] for s in st.spines])
        predicted = nbytes / min(rates)
        # loose: a busy 2-core machine delays the senders; bench/traffic.py reports the error
        assert predicted * 0.9 <= st.seconds <= predicted * 1.6
