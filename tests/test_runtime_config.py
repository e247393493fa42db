"""`plait.runtime.config`: `run`'s five configs document every field and refuse bad values with
the error naming the field, before any worker process starts."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest

import plait.runtime.api as api
import plait.runtime.config as config
from plait.errors import PlaitError
from plait.runtime.api import run
from plait.runtime.config import (
    CheckpointConfig,
    FaultsConfig,
    LaunchConfig,
    RecordsConfig,
    TrainingConfig,
)
from plait.runtime.data import DataSpecError
from plait.runtime.inject import InjectError
from plait.runtime.lr import LRSchedule, LRScheduleError
from plait.runtime.partition import RuntimeSetupError

TINY = "gpt:layers=2,hidden=16,heads=4,seq=8,vocab=32"
CONFIGS = (TrainingConfig, CheckpointConfig, LaunchConfig, RecordsConfig, FaultsConfig)


def _field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right after the field in the class body (its doc line)."""
    tree = ast.parse(Path(inspect.getsourcefile(config)).read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
    docs = {}
    for stmt, after in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[stmt.target.id] = after.value.value.strip()
    return docs


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_has_a_doc_line(cls: type) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    docs = _field_docs(cls)
    assert [n for n in names if not docs.get(n)] == []
    assert cls.__doc__ and cls.__dataclass_params__.frozen


def test_run_takes_the_configs_not_flat_keywords() -> None:
    params = inspect.signature(run).parameters
    assert [p for p in params if params[p].kind is inspect.Parameter.KEYWORD_ONLY] == \
        ["training", "checkpoint", "launch", "records", "faults", "watch"]
    with pytest.raises(TypeError):
        run(TINY, None, "dp=1", steps=1, timeout=10)  # the old flat keyword is gone
    with pytest.raises(dataclasses.FrozenInstanceError):
        LaunchConfig().timeout = 1  # type: ignore[misc]


BAD: list[tuple[type, dict[str, Any], type, str]] = [
    (TrainingConfig, {"dtype": "fp8"}, RuntimeSetupError, "dtype: must be fp32, tf32, bf16 or fp16, got 'fp8'"),
    (TrainingConfig, {"clip_grad": 0.0}, RuntimeSetupError, "clip_grad: must be > 0, got 0.0"),
    (TrainingConfig, {"data": "d.py:make", "data_workers": -1}, DataSpecError, "data_workers must be >= 0, got -1"),
    (TrainingConfig, {"lr_decay_style": "step"}, LRScheduleError, "--lr-decay-style: must be one of"),
    (TrainingConfig, {"lr": 1e-4, "min_lr": 1e-3}, LRScheduleError, "--min-lr: 0.001 is above --lr"),
    (CheckpointConfig, {"dir": "ck", "every": -1}, RuntimeSetupError, "checkpoint_every must be >= 0, got -1"),
    (CheckpointConfig, {"every": 2}, RuntimeSetupError, "need a checkpoint directory \\(--checkpoint-dir\\)"),
    (CheckpointConfig, {"resume": True}, RuntimeSetupError, "need a checkpoint directory"),
    (LaunchConfig, {"timeout": 0}, RuntimeSetupError, "timeout: must be > 0 seconds"),
    (LaunchConfig, {"timeout": float("nan")}, RuntimeSetupError, "timeout: must be > 0 seconds"),
    (LaunchConfig, {"device": "tpu"}, RuntimeSetupError, "device: must be auto, cpu or cuda, got 'tpu'"),
    (LaunchConfig, {"start_method": "exec"}, RuntimeSetupError, "start_method: must be fork, spawn or forkserver"),
    (LaunchConfig, {"emulate_dtype": "int8"}, RuntimeSetupError, "emulate_dtype: must be fp32, tf32, bf16 or fp16"),
    (LaunchConfig, {"nprocs_per_node": -2}, RuntimeSetupError, "--nprocs-per-node must be >= 1, got -2"),
    (RecordsConfig, {"comm_records": "sometimes"}, RuntimeSetupError,
     "comm_records: must be True, False or 'alternate', got 'sometimes'"),
    (RecordsConfig, {"probe_every": -1}, RuntimeSetupError, "probe_every and probe_bytes must be >= 0"),
    (RecordsConfig, {"probe_bytes": -1}, RuntimeSetupError, "probe_every and probe_bytes must be >= 0"),
    (RecordsConfig, {"trace": "/nonexistent-plait-dir/t.json"}, PlaitError, "trace .*folder .* does not exist"),
    (FaultsConfig, {"inject": "explode:rank=1"}, InjectError, "--inject clause 'explode:rank=1'"),
    (FaultsConfig, {"comm_faults": "{"}, PlaitError, "comm_faults: not JSON"),
    (FaultsConfig, {"comm_faults": {"slow_link": [0]}}, PlaitError, "comm_faults"),
    (FaultsConfig, {"compute_sleep": -1.0}, RuntimeSetupError, "compute_sleep: must be >= 0 seconds, got -1.0"),
]


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to start the workers fails the test."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("run() started workers for a bad configuration")

    monkeypatch.setattr(api, "Launcher", refuse)
    monkeypatch.setattr(api, "_prepare_run_dir", refuse)


@pytest.mark.parametrize(("cls", "kwargs", "error", "match"), BAD,
                         ids=[f"{c.__name__}-{next(iter(k))}" for c, k, _, _ in BAD])
def test_bad_values_raise_the_named_error_when_built(cls: type, kwargs: dict[str, Any], error: type,
                                                      match: str) -> None:
    with pytest.raises(error, match=match):
        cls(**kwargs)
    with pytest.raises(error, match=match):  # and `dataclasses.replace` checks again
        dataclasses.replace(cls(), **kwargs)


@pytest.mark.usefixtures("no_launch")
def test_what_needs_the_plan_fails_in_run_before_any_process(tmp_path: Path) -> None:
    plan = "dp=2,micro_batch=1,global_batch=2,dtype=fp32"
    with pytest.raises(InjectError, match="rank 5 is outside the plan's 2 ranks"):
        run(TINY, None, plan, steps=1, faults=FaultsConfig(inject="kill:rank=5,step=1"))
    with pytest.raises(RuntimeSetupError, match="comm_faults: field 'slow_link' \\[0, 3\\] names a rank outside"):
        run(TINY, None, plan, steps=1, faults=FaultsConfig(comm_faults={"slow_link": [0, 3], "delay_s": 0.1}))
    with pytest.raises(RuntimeSetupError, match="--resume: checkpoint directory .* does not exist"):
        run(TINY, None, plan, steps=1, checkpoint=CheckpointConfig(dir=tmp_path / "none", resume=True))
    with pytest.raises(RuntimeSetupError, match="steps must be >= 1"):
        run(TINY, None, plan, steps=0)
    with pytest.raises(RuntimeSetupError, match="heads"):  # the model check, as `plait simulate`'s
        run("gpt:layers=2,hidden=16,heads=4,seq=8,vocab=32", None, "tp=3,micro_batch=1,global_batch=1", steps=1)


def test_the_reference_shares_the_training_config() -> None:
    t = TrainingConfig(optimizer="sgd", lr=0.5, lr_warmup_iters=1, lr_decay_style="linear", clip_grad=1.0)
    assert t.optimizer_config() == {"name": "sgd", "lr": 0.5, "weight_decay": 0.0}
    assert TrainingConfig(optimizer={"name": "sgd", "momentum": 0.9}).optimizer_config() == \
        {"lr": 1e-3, "weight_decay": 0.0, "name": "sgd", "momentum": 0.9}
    assert t.lr_schedule() == LRSchedule(lr=0.5, min_lr=0.0, warmup=1, decay_style="linear", decay_iters=None)
    assert TrainingConfig().lr_schedule() is None
    assert "training" in inspect.signature(api.reference_run).parameters


def test_cpu_ranks_on_a_gpu_machine_see_no_gpu() -> None:
    """CPU ranks fork; on a machine with GPUs they get the GPUs hidden (a CPU rank that touched
    CUDA there failed with "initialization error"); CUDA ranks spawn; a caller's choice stays."""
    launch = config.LaunchConfig()
    env: dict[str, str] = {}
    assert api.rank_start_method(launch, use_cuda=False, cuda_present=False, env=env) == "fork" and env == {}
    assert api.rank_start_method(launch, use_cuda=False, cuda_present=True, env=env) == "fork"
    assert env == {"CUDA_VISIBLE_DEVICES": ""}
    mine = {"CUDA_VISIBLE_DEVICES": "3"}
    api.rank_start_method(launch, use_cuda=False, cuda_present=True, env=mine)
    assert mine == {"CUDA_VISIBLE_DEVICES": "3"}
    cuda_env: dict[str, str] = {}
    assert api.rank_start_method(launch, use_cuda=True, cuda_present=True, env=cuda_env) == "spawn"
    assert cuda_env == {}
    assert api.rank_start_method(config.LaunchConfig(start_method="forkserver"), False, True, {}) == "forkserver"
