"""Issue 16 item 4: two emulated parallel links (network namespaces, root only): flows pinned
to their planned links move an all-reduce step's bytes faster than hashed ones, as the
flow model predicts. Skipped cleanly where namespaces cannot be made."""

from __future__ import annotations

import pytest

from plait.net.twolink import available, hashed_links, measure
from plait.sim.engine import TaskGraph, simulate

OK, WHY = available()


def _engine_prediction(links: list[int], ways: int, nbytes: float, rate: float) -> float:
    g = TaskGraph()
    half = len(links) // ways
    for i, k in enumerate(links):
        r = g.add_resource(("link", k, i // half), rate)  # each direction of a link on its own
        g.add(f"flow{i}", "comm", f"f{i}", flow=[(r, nbytes, 1.0)])
    return simulate(g).makespan


def test_hashing_of_two_flows_collides_for_some_seeds() -> None:
    sports = [40000, 40007]
    spreads = [len(set(hashed_links(sports, s))) for s in range(200)]
    assert 1 in spreads and 2 in spreads  # about half the seeds put both on one link


@pytest.mark.skipif(not OK, reason=WHY)
@pytest.mark.parametrize("both_ways", [False, True])
def test_planned_links_beat_hashed_links_as_predicted(both_ways: bool) -> None:
    rate, nbytes = 4e6, 2_000_000
    r = measure(rate=rate, nbytes=nbytes, both_ways=both_ways)
    planned, hashed = r["planned"], r["hashed"]
    ways = 2 if both_ways else 1
    assert planned.ways == hashed.ways == ways
    assert planned.links == [0, 1] * ways and len(set(hashed.links[:2])) == 1
    # One way the measurement is within a few % of the model; both ways TCP's ACKs queue
    # behind the other direction's data in the shaped links (a slower slow start, a fixed
    # ~0.3 s more), and on a loaded machine the Python senders lag: looser.
    assert planned.busbw > (1.5 if not both_ways else 1.3) * hashed.busbw
    for step in (planned, hashed):
        predicted = _engine_prediction(step.links, ways, nbytes, rate)
        assert predicted == pytest.approx(step.predicted)
        assert predicted * 0.9 <= step.seconds <= predicted * (1.3 if not both_ways else 2.0)
