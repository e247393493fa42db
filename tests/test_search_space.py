"""`plait plan --space`: the parser (hand cases and a fuzz test) and the restricted search (every
plan it returns lies in the space, and it finds the best plan of the space that the full search
ranks)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.api import plan
from plait.cli import main
from plait.ir.plan import Plan
from plait.search.space import FIELDS, SpaceError, describe, parse_space

MODEL = "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=256"
CLUSTER = "mixed-a100-v100:a100_nodes=1,v100_nodes=1,gpus_per_node=2"


def test_fields_become_the_search_space() -> None:
    s = parse_space("tp=2,1 pp=1;mb=4,2,2 recompute=full,none zero=1 schedule=gpipe sp=off layouts=off dp=4")
    assert (s.tp, s.pp, s.micro_batch) == ([1, 2], [1], [2, 4])
    assert s.recompute == ("none", "full") and s.zero == (1,) and s.schedules == ("gpipe",)
    assert s.sequence_parallel == (False,) and s.layouts is False and s.hetero is True
    assert s.allow is not None and s.allow(Plan(dp=4, global_batch=4)) and not s.allow(Plan(dp=2, global_batch=2))
    assert "dp=[4]" in describe(s) and "tp=[1, 2]" in describe(s)
    assert describe(parse_space("")) == "every value"


@pytest.mark.parametrize("text, message", [
    ("tp=0", "field 'tp': '0' is not a positive integer"),
    ("pp=two", "field 'pp': 'two' is not a positive integer"),
    ("recompute=some", "field 'recompute': 'some' is not one of none, selective, full"),
    ("zero=4", "field 'zero': '4' is not one of 0, 1, 2, 3"),
    ("schedule=zb", "field 'schedule': 'zb' is not one of 1f1b, gpipe, interleaved"),
    ("sp=maybe", "field 'sp': 'maybe' is not on or off"),
    ("hetero=on,off", "field 'hetero': give on or off, not both"),
    ("tp=1 tp=2", "field 'tp': given twice"),
    ("width=3", "unknown field 'width'"),
    ("tp", "'tp' is not FIELD=V1,V2"),
    ("mb=", "field 'mb': no values"),
])
def test_bad_specs_name_the_field(text: str, message: str) -> None:
    with pytest.raises(SpaceError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_space(text)


_token = st.one_of(st.sampled_from(FIELDS), st.text(alphabet="abcdxyz_", min_size=1, max_size=6))
_value = st.one_of(st.integers(-3, 70).map(str), st.sampled_from(["none", "full", "on", "off", "1f1b", "x", ""]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_token, st.lists(_value, max_size=4), st.sampled_from([" ", ";", "  "])), max_size=6))
def test_parser_fuzz_only_space_or_space_error(items) -> None:
    text = "".join(f"{f}={','.join(vs)}{sep}" for f, vs, sep in items)
    try:
        s = parse_space(text)
    except SpaceError as exc:
        assert "--space" in str(exc)
        return
    for f in ("tp", "pp", "micro_batch"):
        v = getattr(s, f)
        assert v is None or (v and all(isinstance(x, int) and x >= 1 for x in v))


def test_restricted_search_stays_in_the_space_and_finds_its_best() -> None:
    space = parse_space("tp=1 pp=1,2 mb=1,2 zero=0 recompute=none")
    restricted = plan(MODEL, CLUSTER, global_batch=16, top=50, space=space, finalists=None, placement=False)
    assert restricted.top
    for c in restricted.top:
        p = c.plan
        assert p.tp == 1 and p.pp in (1, 2) and p.micro_batch in (1, 2) and p.zero == 0 and p.recompute == "none"
    # Brute force: the full search's simulated plans that lie in the space; none beats the pick.
    full = plan(MODEL, CLUSTER, global_batch=16, top=400, finalists=None, placement=False)
    inside = [c for c in full.top if c.plan.tp == 1 and c.plan.pp in (1, 2) and c.plan.micro_batch in (1, 2)
              and c.plan.zero == 0 and c.plan.recompute == "none"]
    assert inside
    assert restricted.best.time_s <= min(c.time_s for c in inside) * (1 + 1e-9)


def test_cli_space(capsys) -> None:
    assert main(["plan", "--model", MODEL, "--cluster", CLUSTER, "--global-batch", "16", "--no-progress",
                 "--space", "tp=1;pp=1;mb=2"]) == 0
    out = capsys.readouterr().out
    assert "--space: the 3D family only" in out and "mb=[2]" in out
    assert main(["plan", "--space", "tp=1", "--family", "graph"]) == 2
    assert "--family graph does not take it" in capsys.readouterr().err
