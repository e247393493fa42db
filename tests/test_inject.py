"""The --inject spec language (plait.runtime.inject): every kind, several per run, clear errors
naming the clause and field; the facade's link probes pair every rank once."""

from __future__ import annotations

import pytest

from plait.cli import main as cli_main
from plait.runtime.comm import _circle_partner
from plait.runtime.inject import Fault, InjectError, Injection


def test_every_kind_parses_and_several_combine() -> None:
    inj = Injection.parse("kill:rank=2,step=3; stop:rank=1,step=2; skip:rank=0,step=2; mismatch:rank=1,step=2;"
                          " slow:rank=3,factor=2.5,from=2,every=3; link:ranks=1-0,factor=3;"
                          " link:ranks=2-3,delay=5ms,from=2; hang:rank=0,step=1; error:rank=1,step=4,at=checkpoint;"
                          " inf:rank=0,step=0")
    kinds = [f.kind for f in inj.faults]
    assert kinds == ["kill", "stop", "skip", "mismatch", "slow", "link", "link", "hang", "error", "inf"]
    assert inj.faults[5] == Fault("link", 0, 0, peer=1, factor=3.0)
    assert inj.faults[6] == Fault("link", 2, 2, peer=3, delay_s=0.005)
    assert inj.at(2, 3, "step", ("kill",)) == Fault("kill", 2, 3)
    assert inj.at(1, 4, "checkpoint", ("error",)).at == "checkpoint"
    assert Injection.from_list(inj.to_list()) == inj
    inj.check_world(4)


def test_slow_factor_by_step_and_intermittent() -> None:
    inj = Injection.parse("slow:rank=3,factor=2.5,from=2,every=3; slow:rank=1,factor=2,from=1,until=2")
    assert [inj.compute_factor(3, s) for s in range(9)] == [1, 1, 2.5, 1, 1, 2.5, 1, 1, 2.5]
    assert [inj.compute_factor(1, s) for s in range(4)] == [1, 2, 2, 1]
    assert inj.compute_factor(0, 5) == 1.0 and inj.compute_factor(3, None) == 1.0


@pytest.mark.parametrize(("spec", "message"), [
    ("explode:rank=1,step=2", "clause 'explode:rank=1,step=2': must start with a kind"),
    ("kill rank=1", "must start with a kind and ':'"),
    ("kill:rank=1", "missing field\\(s\\) step for kill"),
    ("kill:rank=x,step=2", "field 'rank' must be an integer >= 0, got 'x'"),
    ("kill:rank=1,step=2,color=red", "unknown field 'color' for kill"),
    ("kill:rank=1,rank=2,step=2", "field 'rank' given twice"),
    ("slow:rank=1,factor=0.5", "field 'factor' must be a number >= 1"),
    ("slow:rank=1,factor=2,every=0", "field 'every' must be >= 1"),
    ("slow:rank=1,factor=2,from=4,until=2", "field 'until' \\(2\\) is before 'from' \\(4\\)"),
    ("link:ranks=1-1,factor=2", "field 'ranks' must be two different ranks"),
    ("link:ranks=0-1", "a link needs 'factor'"),
    ("link:ranks=0-1,delay=5", "field 'delay' must be a time with a unit"),
    ("kill:rank=1,step=2,at=lunch", "field 'at' must be step or checkpoint"),
    ("kill:rank=1,step", "'step' is not NAME=VALUE"),
])
def test_bad_specs_name_the_clause_and_field(spec: str, message: str) -> None:
    with pytest.raises(InjectError, match=message):
        Injection.parse(f"slow:rank=0,factor=2; {spec}")


def test_ranks_outside_the_plan_are_refused_before_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InjectError, match="link 1-5 3x slower from step 0: rank 5 is outside the plan's 4 ranks"):
        Injection.parse("link:ranks=1-5,factor=3").check_world(4)
    code = cli_main(["run", "--model", "gpt:layers=2,hidden=16,heads=4,seq=8,vocab=32", "--plan", "dp=2,global_batch=2",
                     "--inject", "kill:rank=2,step=1"])
    assert code == 2 and "kill rank 2 at step 1: rank 2 is outside the plan's 2 ranks" in capsys.readouterr().err


@pytest.mark.parametrize("m", [2, 4, 6, 8])
def test_probe_rounds_meet_every_pair_once(m: int) -> None:
    pairs = set()
    for rnd in range(m - 1):
        partner = [_circle_partner(r, rnd, m) for r in range(m)]
        assert all(partner[partner[r]] == r != partner[r] for r in range(m))
        pairs |= {tuple(sorted((r, partner[r]))) for r in range(m)}
    assert len(pairs) == m * (m - 1) // 2


def test_uplink_becomes_every_crossing_link_and_stop_resume_and_hog_parse() -> None:
    inj = Injection.parse("uplink:node=1,factor=3,from=2; stop:rank=0,step=4,for=2.5s; hog:rank=3,from=1,procs=2")
    assert [f.kind for f in inj.faults] == ["uplink", "stop", "hog"]
    assert inj.faults[1].duration_s == 2.5 and inj.faults[2] == Fault("hog", 3, 1, procs=2)
    assert inj.at(3, 1, "step", ("hog",)) == inj.faults[2]
    assert not inj.links()  # an uplink is links only once the layout says which ranks cross it
    laid = inj.on_nodes([0, 0, 1, 1])  # ranks 0, 1 on node 0; 2, 3 on node 1
    pairs = [(f.rank, f.peer) for f in laid.links()]
    assert pairs == [(0, 2), (0, 3), (1, 2), (1, 3)]
    assert all(f.factor == 3.0 and f.step == 2 and f.uplink == 1 for f in laid.links())
    assert "node 1's uplink" in laid.links()[0].describe()
    assert Injection.from_list(laid.to_list()) == laid
    four = Injection.parse("uplink:node=2,delay=5ms").on_nodes([0, 1, 2, 3])
    assert [(f.rank, f.peer) for f in four.links()] == [(0, 2), (1, 2), (2, 3)]
    with pytest.raises(InjectError, match="the plan's ranks are on nodes \\[0, 1\\], not node 5"):
        Injection.parse("uplink:node=5,factor=2").on_nodes([0, 0, 1, 1])
    with pytest.raises(InjectError, match="no rank of another node"):
        Injection.parse("uplink:node=0,factor=2").on_nodes([0, 0])
    for spec, message in [("uplink:node=1", "an uplink needs 'factor'"),
                          ("stop:rank=0,step=1,for=2", "field 'for' must be a time with a unit"),
                          ("hog:rank=0,procs=0", "field 'procs' must be >= 1")]:
        with pytest.raises(InjectError, match=message):
            Injection.parse(spec)
