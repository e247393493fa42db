"""Every training dtype (fp32, TF32, fp16, bf16) is reachable from `plait plan --dtype` for every
planner family, on a GPU kind whose default is another one (issue 37: the 3D family planned fp16
on V100 clusters and could not be asked for fp32 or TF32)."""

from __future__ import annotations

import json

import pytest

from plait.cli import main

DTYPES = ("fp32", "tf32", "bf16", "fp16")
GPT = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128"
V100 = "v100-16gb:nodes=1,gpus_per_node=2"
BERT = "bert:layers=1,hidden=32,heads=4,seq=8,vocab=64,dropout=0,attn_dropout=0"
MIXED = "emulated-mixed:gpus_per_node=2"


def _plan(capsys, *argv: str) -> dict:
    assert main(["plan", "--json", "--no-progress", "--top", "1", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_v100_defaults_to_fp16(capsys) -> None:
    res = _plan(capsys, "--family", "3d", "--model", GPT, "--cluster", V100, "--global-batch", "4")
    assert res["top"][0]["plan"]["dtype"] == "fp16"


@pytest.mark.parametrize("dtype", DTYPES)
def test_3d_and_graph_families_plan_the_dtype_asked(capsys, dtype: str) -> None:
    for family in ("3d", "graph"):
        res = _plan(capsys, "--family", family, "--model", GPT, "--cluster", V100, "--global-batch", "4",
                    "--dtype", dtype)
        assert all(c["plan"]["dtype"] == dtype for c in res["top"]), family


def test_3d_time_follows_the_dtype(capsys) -> None:
    """On a V100 fp32 runs on CUDA cores (15.7 TFLOP/s), fp16 on tensor cores (125): the fp32 plan
    is predicted slower -- the dtype reaches the cost model, not only the plan's label."""
    big = "gpt:layers=4,hidden=1024,heads=16,seq=512,vocab=1024"
    t = {d: _plan(capsys, "--family", "3d", "--model", big, "--cluster", V100, "--global-batch", "8",
                  "--dtype", d)["top"][0]["iteration_time_s"] for d in ("fp32", "fp16")}
    assert t["fp32"] > 2 * t["fp16"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_spmd_family_plans_the_dtype_asked(capsys, dtype: str) -> None:
    res = _plan(capsys, "--family", "spmd", "--model", BERT, "--cluster", MIXED, "--global-batch", "8",
                "--dtype", dtype)
    assert res["dtype"] == dtype


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=[] if d == "bf16" else pytest.mark.slow) for d in DTYPES])
def test_compose_family_plans_the_dtype_asked(capsys, dtype: str) -> None:
    res = _plan(capsys, "--family", "compose", "--model", BERT, "--cluster", MIXED, "--global-batch", "8",
                "--dtype", dtype)
    assert all(c["plan"]["dtype"] == dtype for c in res["top"])


def test_16bit_plans_are_checked_as_the_engine_keeps_them(capsys) -> None:
    """`--precision amp` (the default) checks a 16-bit plan's memory as plait's engines train it
    (fp32 parameters, ops under autocast: the model captured so), `megatron` as Megatron-LM and
    DeepSpeed keep it; each is the simulator's figure for that plan at that precision."""
    from plait.sim.api import simulate

    args = ("--family", "3d", "--model", GPT, "--cluster", V100, "--global-batch", "4",
            "--space", "dp=2 tp=1 pp=1 mb=2 zero=0 recompute=none")
    amp = _plan(capsys, *args)["top"][0]
    meg = _plan(capsys, *args, "--precision", "megatron")["top"][0]
    assert amp["plan_str"] == meg["plan_str"] and "dtype=fp16" in amp["plan_str"]
    for row, precision in ((amp, "amp"), (meg, "megatron")):
        assert row["memory_peak_bytes"] == simulate(GPT, V100, row["plan_str"], precision=precision).memory_peak_bytes
    assert amp["memory_peak_bytes"] != meg["memory_peak_bytes"]


def test_precision_follows_the_export() -> None:
    """Without `--precision`: Megatron-LM's and DeepSpeed's exports keep the model in the plan's
    dtype; plait's engines and torchtitan's FSDP2 train under autocast."""
    from argparse import Namespace

    from plait.commands.training_args import precision_of

    assert [precision_of(Namespace(precision=None, export=e)) for e in (None, "megatron", "deepspeed", "torchtitan")] \
        == ["amp", "megatron", "megatron", "amp"]
    assert precision_of(Namespace(precision="amp", export="megatron")) == "amp"
