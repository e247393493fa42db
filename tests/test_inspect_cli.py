"""`plait inspect` and `plait.graph.inspect`: table, --json, batch scaling, files, errors."""

from __future__ import annotations

import argparse
import json
import textwrap

import pytest
import torch
import torch.nn as nn

from plait.commands import inspect_cmd
from plait.errors import PlaitError
from plait.graph.inspect import InspectError, inspect_model, parse_dtype, summarize

SPEC = "gpt:layers=2,hidden=32,heads=2,seq=16,vocab=64"


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run the inspect subcommand the way plait.cli.main does (errors -> one line, exit 2)."""
    parser = argparse.ArgumentParser(prog="plait")
    inspect_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except PlaitError as exc:
        print(f"plait {args.command}: error: {exc}", file=__import__("sys").stderr)
        code = 2
    out, err = capsys.readouterr()
    return code, out, err


def test_table_lists_layers_and_totals(capsys):
    code, out, _ = _run(["inspect", SPEC, "--batch", "2", "--dtype", "fp16"], capsys)
    assert code == 0
    for name in ("embed", "layers.0", "layers.1", "head", "total", "TransformerBlock"):
        assert name in out
    assert "batch 2, fp16" in out
    assert "is a chain" in out


def test_precision_amp_shows_the_model_as_plaits_engines_train_it(capsys):
    """`--precision amp`: fp32 parameters, the step under CUDA's autocast lists (the graph `plait
    plan` prices by default): the same parameters, the casts as ops of their own; megatron (the
    default) is the whole model in the dtype, as before."""
    _, out, _ = _run(["inspect", SPEC, "--json", "--dtype", "bf16"], capsys)
    _, out_amp, _ = _run(["inspect", SPEC, "--json", "--dtype", "bf16", "--precision", "amp"], capsys)
    low, amp = json.loads(out), json.loads(out_amp)
    assert (low["autocast"], amp["autocast"]) == (None, "bf16")
    assert amp["totals"]["params"] == low["totals"]["params"]
    assert amp["totals"]["ops"] > low["totals"]["ops"]  # every autocast cast is an op
    from plait.graph.resolve import resolve_model
    from plait.ir.plan import Plan

    graph = resolve_model(SPEC, Plan(dtype="bf16"), analytic=False, precision="amp")
    assert amp["totals"]["ops"] == len(graph.ops)  # the graph `plait plan` prices
    code, out_t, _ = _run(["inspect", SPEC, "--dtype", "bf16", "--precision", "amp"], capsys)
    assert code == 0 and "under autocast (amp)" in out_t


def test_json_has_layers_totals_and_scales_with_batch(capsys):
    code, out, _ = _run(["inspect", SPEC, "--json", "--batch", "1"], capsys)
    assert code == 0
    one = json.loads(out)
    _, out4, _ = _run(["inspect", SPEC, "--json", "--batch", "4"], capsys)
    four = json.loads(out4)
    assert [row["name"] for row in one["layers"]] == ["embed", "layers.0", "layers.1", "head"]
    assert one["dtype"] == "bf16" and one["activation_dtype_bytes"] == 2
    from plait.graph.zoo import load_model

    assert one["totals"]["params"] == load_model(SPEC).param_count_formula()
    assert one["totals"]["params"] == sum(row["params"] for row in one["layers"])
    for key in ("fwd_flops", "bwd_flops"):
        assert four["totals"][key] == pytest.approx(4 * one["totals"][key])
        assert one["totals"][key] > 0
    # a few bytes do not grow with the batch (position ids kept by the embedding, the
    # loss's scalars) and are spread over the capture batch (2 for --batch 1, 4 for 4)
    assert four["totals"]["saved_bytes"] == pytest.approx(4 * one["totals"]["saved_bytes"], rel=1e-3)
    assert four["totals"]["params"] == one["totals"]["params"]
    # one forward matmul of layer 0 by hand: QKV is 2·s·h·3h FLOPs per sample
    s, h = 16, 32
    assert one["layers"][1]["fwd_flops"] >= 2 * s * h * 3 * h
    assert one["layer_edges"] == [["embed", "layers.0"], ["layers.0", "layers.1"], ["layers.1", "head"]]


def test_json_equals_python_api(capsys):
    _, out, _ = _run(["inspect", SPEC, "--json", "--batch", "3"], capsys)
    import plait.api

    graph = plait.api.inspect(SPEC, batch=3)
    expected = summarize(graph, 3)
    expected["dtype"] = "bf16"
    assert json.loads(out) == json.loads(json.dumps(expected))


def test_user_file_factory(tmp_path, capsys):
    path = tmp_path / "mymodel.py"
    path.write_text(
        textwrap.dedent(
            """
            import torch, torch.nn as nn

            def factory():
                model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))

                def sample_batch(batch, device="cpu", seed=0):
                    g = torch.Generator().manual_seed(seed)
                    return (torch.randn(batch, 6, generator=g),), torch.randint(0, 3, (batch,), generator=g)

                return model, sample_batch
            """
        )
    )
    code, out, err = _run(["inspect", f"{path}:factory", "--json", "--dtype", "fp32"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert [row["name"] for row in data["layers"]] == ["0", "1", "2"]
    assert data["totals"]["params"] == 6 * 10 + 10 + 10 * 3 + 3
    assert data["layers"][0]["fwd_flops"] == 2 * 6 * 10
    assert data["layers"][2]["bwd_flops"] == 4 * 10 * 3


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["inspect", SPEC, "--dtype", "fp8"], "dtype: unknown value 'fp8'"),
        (["inspect", SPEC, "--batch", "0"], "--batch: must be >= 1"),
        (["inspect", "no_such_model"], "no_such_model"),
        (["inspect", "gpt:hidden=30,heads=4"], "divisible"),
    ],
)
def test_bad_input_is_one_line_error(argv, needle, capsys):
    code, out, err = _run(argv, capsys)
    assert code == 2
    assert needle in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_inspect_nn_module_needs_sample_inputs():
    with pytest.raises(InspectError, match="sample_inputs"):
        inspect_model(nn.Linear(2, 2))
    g = inspect_model(nn.Linear(2, 2), sample_inputs=(torch.randn(4, 2),))
    assert g.param_count == 6 and g.capture_batch == 4


def test_parse_dtype():
    assert parse_dtype("bf16") is torch.bfloat16
    assert parse_dtype("torch.float16") is torch.float16
    with pytest.raises(InspectError):
        parse_dtype("int8")


def test_plait_main_entry_point(capsys):
    """Through the real `plait` entry point (all subcommands registered)."""
    from plait.cli import main

    assert main(["inspect", SPEC, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "gpt"
    assert main(["inspect", SPEC, "--dtype", "int3"]) == 2
    assert "dtype" in capsys.readouterr().err
