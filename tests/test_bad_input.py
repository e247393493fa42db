"""Issue 12's "bad input and surprises" list: each item is a test here (fast, in-process).

Every case must end in exit code 2 with one line naming the file or field and the reason,
before any work (simulation, training) is done."""

from __future__ import annotations

import pytest

from plait.cli import main
from plait.ir.plan import Plan, PlanError

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


@pytest.mark.parametrize("argv", [
    ["profile", "--from-result", "{bad}"],
    ["simulate", "--model", "{bad}", "--cluster", CLUSTER, "--plan", "dp=1"],  # an OpGraph JSON
])
def test_other_input_files_that_are_not_utf8(argv: list[str], tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe{}")
    _fails([a.replace("{bad}", str(bad)) for a in argv], capsys, str(bad))


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


def test_simulate_rejects_tp_that_does_not_divide_the_heads_as_run_does(capsys) -> None:
    plan = "tp=3,micro_batch=1,global_batch=1"
    _fails(["simulate", "--model", MODEL, "--cluster", CLUSTER, "--plan", plan], capsys,
           "plan field 'tp'", "tp=3 does not divide the 4 attention heads")
    # `plait run` rejects it with the same message, before any worker starts
    _fails(["run", "--model", MODEL, "--plan", plan], capsys, "tp=3 does not divide the 4 attention heads")


def test_sequence_parallel_needs_seq_divisible_by_tp(capsys) -> None:
    model = "gpt:layers=2,hidden=64,heads=4,seq=30,vocab=128"
    for cmd in ("simulate", "run"):
        _fails([cmd, "--model", model, "--cluster", CLUSTER, "--plan",
                "tp=4,sequence_parallel=true,micro_batch=1,global_batch=1"], capsys,
               "plan field 'sequence_parallel'", "sequence length 30")


def test_gqa_kv_heads_checked() -> None:
    from plait.ir.plan import check_plan_for_model

    cfg = {"heads": 8, "kv_heads": 2, "ffn": 256, "seq": 32}
    check_plan_for_model(Plan(tp=2), cfg)
    with pytest.raises(PlanError, match="2 key/value heads"):
        check_plan_for_model(Plan(tp=4), cfg)
    check_plan_for_model(Plan(tp=3, tp_ratios=[0.5, 0.25, 0.25]), {"heads": 4})  # uneven heads: allowed
    with pytest.raises(PlanError, match="tp_ratios"):
        check_plan_for_model(Plan(tp=8, tp_ratios=[0.125] * 8), {"heads": 4})


def test_simulated_plan_that_runs_out_of_memory_exits_nonzero(capsys) -> None:
    rc = main(["simulate", "--model", "gpt:size=13b", "--cluster", CLUSTER, "--plan",
               "dp=1,micro_batch=1,global_batch=1", "--json"])
    captured = capsys.readouterr()
    assert rc == 1
    assert '"fits_memory": false' in captured.out  # the prediction is still printed
    assert "does not fit on GPU 0 (a100-80g" in captured.err and "over by" in captured.err


# ---------------------------------------------------------------------------------- plait run arguments
TINY = "gpt:layers=1,hidden=16,heads=2,seq=8,vocab=32"


def test_resume_without_a_checkpoint_is_an_error(tmp_path, capsys) -> None:
    _fails(["run", "--model", TINY, "--plan", "dp=1", "--resume", "--checkpoint-dir", str(tmp_path)], capsys,
           "--resume: no complete checkpoint in", str(tmp_path))
    (tmp_path / "step-00000002").mkdir()  # half-written: no completion marker
    _fails(["run", "--model", TINY, "--plan", "dp=1", "--resume", "--checkpoint-dir", str(tmp_path)], capsys,
           "no complete checkpoint")
    _fails(["run", "--model", TINY, "--plan", "dp=1", "--resume", "--checkpoint-dir", str(tmp_path / "nope")],
           capsys, "does not exist")


def test_checkpoint_every_needs_a_directory(capsys) -> None:
    _fails(["run", "--model", TINY, "--plan", "dp=1", "--checkpoint-every", "2"], capsys,
           "--checkpoint-every: needs --checkpoint-dir")
    _fails(["run", "--model", TINY, "--plan", "dp=1", "--checkpoint-every", "0", "--checkpoint-dir", "x"], capsys,
           "--checkpoint-every: must be >= 1")


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_timeout_must_be_positive(value: str, capsys) -> None:
    _fails(["run", "--model", TINY, "--plan", "dp=1", "--timeout", value], capsys, "--timeout: must be > 0 seconds")


def test_runtime_api_rejects_a_zero_timeout() -> None:
    from plait.runtime.api import LaunchConfig, run
    from plait.runtime.partition import RuntimeSetupError

    with pytest.raises(RuntimeSetupError, match="timeout: must be > 0"):
        run(TINY, None, "dp=1", steps=1, launch=LaunchConfig(timeout=0))


@pytest.mark.parametrize("argv", [
    ["simulate", "--model", MODEL, "--cluster", CLUSTER, "--plan", "dp=1", "--trace", "{missing}/t.json"],
    ["simulate", "--model", MODEL, "--cluster", CLUSTER, "--plan", "dp=1", "--gantt", "{missing}/g.png"],
    ["run", "--model", TINY, "--plan", "dp=1", "--trace", "{missing}/t.json"],
    ["plan", "--model", MODEL, "--cluster", CLUSTER, "--out", "{missing}/plan.json"],
    ["profile", "--nprocs", "2", "--out", "{missing}/c.yaml"],
    ["profile", "--nprocs", "2", "--result", "{missing}/r.json"],
])
def test_output_paths_are_checked_before_the_work(argv: list[str], tmp_path, capsys) -> None:
    import time

    missing = tmp_path / "no" / "such"
    argv = [a.replace("{missing}", str(missing)) for a in argv]
    t0 = time.perf_counter()
    _fails(argv, capsys, f"folder {missing} does not exist")
    assert time.perf_counter() - t0 < 5  # nothing was planned, simulated, profiled or trained


def test_output_path_that_is_a_folder(tmp_path, capsys) -> None:
    _fails(["simulate", "--model", MODEL, "--cluster", CLUSTER, "--plan", "dp=1", "--trace", str(tmp_path)], capsys,
           "--trace", "is a folder; give a file name")


def test_more_ranks_than_cpus_warns_before_starting(monkeypatch, capsys) -> None:
    import argparse

    from plait.commands import run_cmd

    monkeypatch.setattr(run_cmd.os, "cpu_count", lambda: 2)
    parser = argparse.ArgumentParser()
    run_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["run", "--model", TINY, "--plan", "dp=64,global_batch=64"])
    run_cmd._check_args(args)
    err = capsys.readouterr().err
    assert "warning: the plan has 64 ranks and this machine 2 CPUs" in err


def test_run_flags_ask_for_an_engine_and_a_bad_one_is_refused(capsys) -> None:
    import argparse

    from plait.commands import run_cmd

    parser = argparse.ArgumentParser()
    run_cmd.add_parser(parser.add_subparsers())
    for argv, engine in ((["--plan", "pp=2,global_batch=4", "--engine", "torch"], "torch"), (["--plan", "dp=1"], "auto")):
        args = parser.parse_args(["run", "--model", TINY, *argv])
        run_cmd._check_args(args)  # fills what the flags leave to it, as `plait run` does
        assert run_cmd._configs(args, None)["launch"].engine == engine
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--model", TINY, "--plan", "dp=1", "--engine", "megatron"])
    assert "invalid choice: 'megatron'" in capsys.readouterr().err


def test_checkpoint_dir_alone_checkpoints_the_last_step_and_temp_folders_go(tmp_path, monkeypatch, capsys) -> None:
    """One real (1-rank, 2-step) run: the stated default is printed and honoured, and the run's
    temporary folder is removed at the end."""
    import tempfile

    from plait.runtime.checkpoint import latest_checkpoint

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    ck = tmp_path / "ck"
    assert main(["run", "--model", TINY, "--plan", "dp=1,dtype=fp32", "--steps", "2", "--checkpoint-dir", str(ck),
                 "--timeout", "120", "--json"]) == 0
    err = capsys.readouterr().err
    assert "--checkpoint-dir without --checkpoint-every: one checkpoint after the last step" in err
    found = latest_checkpoint(ck)
    assert found is not None and found[0] == 2
    assert list(scratch.iterdir()) == []  # no plait-run-* left behind


# ---------------------------------------------------------------------------------- user-model contract
def test_readme_custom_model_example_runs_as_written(capsys) -> None:
    import re
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    cmd = re.search(r"`(plait simulate --model examples/models/tiny_mlp\.py:make_model[^`]*)`", readme)
    assert cmd is not None
    argv = shlex.split(cmd.group(1))[1:]
    argv[2] = str(root / argv[2])  # the README runs from the repository root
    assert main(argv) == 0
    assert "iteration time" in capsys.readouterr().out


def test_sample_batch_given_as_a_batch_names_the_contract(tmp_path) -> None:
    from plait.graph.zoo import load_model
    from plait.graph.zoo.registry import ModelSpecError

    path = tmp_path / "m.py"
    path.write_text("import torch\nfrom torch import nn\n\n"
                    "def make():\n    return nn.Linear(4, 2), (torch.zeros(3, 4),), torch.zeros(3, 2)\n\n"
                    "def make2():\n    return nn.Linear(4, 2), torch.zeros(3, 4)\n\n"
                    "def make3():\n    return nn.Linear(4, 2), lambda b: ((torch.zeros(b, 4),), torch.zeros(b, 2)), 5\n")
    for factory, word in (("make", "must be a function, not a sample batch (got tuple)"),
                          ("make2", "must be a function, not a sample batch (got Tensor)"),
                          ("make3", "third item must be a loss function")):
        with pytest.raises(ModelSpecError) as exc:
            load_model(f"{path}:{factory}")
        assert word in str(exc.value), str(exc.value)
    with pytest.raises(ModelSpecError, match=r"sample_batch\(batch, device='cpu', seed=0\)"):
        load_model(f"{path}:make2")


# ---------------------------------------------------------------------------------- plait profile output
def test_profile_prints_the_memory_bandwidth_its_yaml_holds(capsys) -> None:
    """The CPU profile measured a 13.0 GB/s copy rate and a 2.27 GB/s elementwise-kernel rate; the YAML
    holds the latter as the kind's memory_bandwidth, so that is the figure the summary must show."""
    from plait.cluster.loader import parse_cluster
    from plait.commands.profile_cmd import _print_summary
    from plait.measure.cluster_profile import ProfileResult, result_to_yaml

    result = ProfileResult(
        world=2, backend="gloo", device_type="cpu", node_of=[0, 0],
        p2p={"0-1": {"bandwidth": 1e9, "latency": 5e-5}, "1-0": {"bandwidth": 1e9, "latency": 5e-5}},
        collectives={"all_reduce": [{"bytes": 1024, "time_s": 1e-3, "algbw": 1.024e6, "busbw": 1.024e6}],
                     "all_gather": [{"bytes": 1024, "time_s": 1e-3, "algbw": 1.024e6, "busbw": 0.5e6}]},
        matmul=[{"fp32": 1e10, "by_size": {}}] * 2, memory_bandwidth=[13.0e9] * 2, memory_bytes=[2**33] * 2,
        slowdowns=[1.0, 1.0], rounds=[[[(0, 1)]]], stream_bandwidth=[2.27e9, 2.27e9])
    _print_summary(result)
    err = capsys.readouterr().err
    kind = parse_cluster(result_to_yaml(result)).kinds["measured-cpu"]
    assert kind.memory_bandwidth == pytest.approx(2.27e9)
    assert f"{kind.memory_bandwidth / 1e9:.2f}" in err and "memory BW" in err


def test_export_slurm_without_out_fails_before_the_search(capsys, monkeypatch) -> None:
    """`--export slurm` needs the plan file the script runs: said before any search runs."""
    import plait.commands.plan_cmd as plan_cmd

    def no_search(*args, **kwargs):
        raise AssertionError("the search ran before the arguments were checked")

    monkeypatch.setattr(plan_cmd, "search", no_search)
    _fails(["plan", "--model", MODEL, "--cluster", CLUSTER, "--export", "slurm"], capsys,
           "--export slurm", "--out")
