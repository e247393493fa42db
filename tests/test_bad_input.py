"""Issue 12's "bad input and surprises" list: each item is a test here (fast, in-process).

Every case must end in exit code 2 with one line naming the file or field and the reason,
before any work (simulation, training) is done."""

from __future__ import annotations

import pytest

from plait.cli import main
from plait.plan.ir import Plan, PlanError

MODEL = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"
CLUSTER = "a100-80g:nodes=1"


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], *words: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for w in words:
        assert w in err, err
    return err


@pytest.mark.parametrize("command", ["simulate", "run"])
def test_plan_file_that_is_not_utf8(command: str, tmp_path, capsys) -> None:
    bad = tmp_path / "plan.json"
    bad.write_bytes(b'{"dp": 2, "name": "\xe9t\xe9"}')
    _fails([command, "--model", MODEL, "--cluster", CLUSTER, "--plan", str(bad)], capsys,
           str(bad), "not UTF-8")


def test_plan_string_longer_than_a_file_name_is_a_plan_string() -> None:
    n = 32
    text = f"dp={n},global_batch={n},dp_shares=" + ":".join(["0.03125"] * n)
    assert len(text) > 255  # longer than a file name: must not reach the OS as a path
    plan = Plan.load(text)
    assert plan.dp == 32 and plan.samples_per_replica() == [1] * 32
    with pytest.raises(PlanError, match="dp_shares"):
        Plan.load(text.replace("0.03125", "0.5"))


def test_booleans_parse_strictly() -> None:
    for text, want in (("true", True), ("False", False), ("1", True), ("0", False), ("yes", True), ("no", False)):
        assert Plan.parse(f"tp=2,sequence_parallel={text}").sequence_parallel is want
    with pytest.raises(PlanError, match="sequence_parallel.*'maybe' is not a boolean"):
        Plan.parse("tp=2,sequence_parallel=maybe")


@pytest.mark.parametrize("text", ["", "  ", ",,"])
def test_empty_plan_is_an_error_not_the_defaults(text: str, capsys) -> None:
    _fails(["simulate", "--model", MODEL, "--cluster", CLUSTER, "--plan", text], capsys, "plan string: empty")


def test_plan_field_given_twice_is_an_error() -> None:
    with pytest.raises(PlanError, match="'dp' is given twice"):
        Plan.parse("dp=2,dp=4")


@pytest.mark.parametrize(("data", "words"), [
    ('{"dp": "2"}', ("'dp'", "must be an integer")),
    ('{"sequence_parallel": "maybe"}', ("'sequence_parallel'", "true or false")),
    ('{"dp_shares": [0.5, "x"]}', ("'dp_shares'", "list of numbers")),
    ('{"dp": 2, "global_batch": 2, "dp_shares": [NaN, 1.0]}', ("'dp_shares'",)),
    ('{"stages": [{"name": "s", "devices": [[0]]}]}', ("'stages[0].devices'",)),
    ('[1, 2]', ("must be a JSON object", "a list")),
    ('[' * 3000 + ']' * 3000, ("nested too deeply",)),
])
def test_plan_json_fields_are_type_checked(tmp_path, data: str, words: tuple[str, ...]) -> None:
    path = tmp_path / "p.json"
    path.write_text(data)
    with pytest.raises(PlanError) as exc:
        Plan.load(str(path))
    assert str(path) in str(exc.value)
    for w in words:
        assert w in str(exc.value)


def test_plan_directory_is_an_error(tmp_path) -> None:
    d = tmp_path / "dir.json"
    d.mkdir()
    with pytest.raises(PlanError, match="is a directory"):
        Plan.load(str(d))
