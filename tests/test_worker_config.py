"""The workers' typed config (`plait.runtime.worker_config`, issue 31 item 2): written then read back
it is the same object; the flat form of older plaits is migrated; a file of another format_version,
or with a missing or an unknown key, is refused with a message naming the file and the key."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from plait.ir.formats import FORMAT_VERSIONS
from plait.ir.plan import Plan
from plait.runtime.api import load_run
from plait.runtime.comm import LinkFault
from plait.runtime.inject import Injection
from plait.runtime.launch import RunFailure
from plait.runtime.lr import LRSchedule
from plait.runtime.multinode import HostNode
from plait.runtime.worker_config import (
    AgentRanks,
    CheckpointSettings,
    DataSettings,
    FaultSettings,
    MultinodeSettings,
    RankPlace,
    RecordSettings,
    WorkerConfig,
    WorkerConfigError,
    read_worker_config,
    write_worker_config,
)


def _config(run_dir: Path) -> WorkerConfig:
    """A config with every optional part set (checkpoints, data, schedule, real hosts, faults)."""
    plan = Plan(dp=2, pp=2, micro_batch=1, global_batch=4, dtype="fp32")
    ranks = tuple(RankPlace(rank=r, device=r, node=r // 2, host=f"n{r // 2}", kind="a100-80gb", slowdown=1.5,
                            local_device=r % 2) for r in range(4))
    nodes = (HostNode("n0", (0, 1), (0, 1), 2, ("a100-80gb",) * 2, (80 << 30,) * 2),
             HostNode("n1", (2, 3), (0, 1), 2, ("a100-80gb",) * 2, (80 << 30,) * 2))
    return WorkerConfig(
        model="gpt:layers=2,hidden=32,heads=2,seq=16,vocab=64", plan=plan, steps=5, seed=3, data_seed=4,
        optimizer={"name": "sgd", "lr": 0.1, "weight_decay": 0.0, "momentum": 0.9}, dtype="fp32",
        lr_schedule=LRSchedule(lr=0.1, min_lr=0.01, warmup=1, decay_style="cosine", decay_iters=4),
        clip_grad=1.0, data=DataSettings(spec="/abs/data.py:make", workers=2), backend="gloo", device="cpu",
        engine="plait", collective_timeout=450.0, step_barrier=True, run_dir=str(run_dir), ranks=ranks,
        agents=(AgentRanks(0, (0, 1)),),
        multinode=MultinodeSettings(node_name="n0", nodes=nodes, emulated=True, timeout=120.0),
        checkpoint=CheckpointSettings(dir="/abs/ck", every=2, resume=True, resume_from="/abs/ck/step_2", keep=None),
        records=RecordSettings(comm_records="alternate", step_records=True, probe_every=2, probe_bytes=1024,
                               return_params=True, spmd_calibrate=False),
        faults=FaultSettings(inject=Injection.parse("kill:rank=1,step=3; slow:rank=0,factor=2"),
                             comm_faults=(LinkFault(0, 2, delay_s=0.01, factor=2.0, from_step=1),),
                             compute_sleep=0.05))


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


def test_written_then_read_back_is_the_same_config(tmp_path: Path) -> None:
    config = _config(tmp_path)
    path = tmp_path / "config.json"
    write_worker_config(path, config)
    assert read_worker_config(path) == config
    data = json.loads(path.read_text())
    assert next(iter(data)) == "format_version" and data["format_version"] == FORMAT_VERSIONS["worker"]
    # the parts without their optional settings round-trip too
    bare = replace(config, lr_schedule=None, data=None, multinode=None, checkpoint=None, clip_grad=None,
                   faults=FaultSettings(Injection(), (), 0.0))
    write_worker_config(path, bare)
    assert read_worker_config(path) == bare


@pytest.mark.parametrize("version", [FORMAT_VERSIONS["worker"] + 1, 0, "1", True])
def test_another_format_version_is_refused_naming_the_file_and_the_versions(tmp_path: Path, version: object) -> None:
    path = _write(tmp_path, {**_config(tmp_path).to_dict(), "format_version": version})
    with pytest.raises(WorkerConfigError) as err:
        read_worker_config(path)
    text = str(err.value)
    assert text.startswith(f"{path}: worker config format_version {version!r}")
    assert f"this plait reads format_version {FORMAT_VERSIONS['worker']} only" in text


@pytest.mark.parametrize("drop, key", [
    (lambda d: d.pop("steps"), "steps"),
    (lambda d: d["records"].pop("probe_bytes"), "records.probe_bytes"),
    (lambda d: d["ranks"][2].pop("host"), "ranks[2].host"),
    (lambda d: d["multinode"]["nodes"][1].pop("memory"), "multinode.nodes[1].memory"),
    (lambda d: d["faults"].pop("compute_sleep"), "faults.compute_sleep"),
])
def test_a_missing_key_is_refused_naming_the_file_and_the_key(tmp_path: Path, drop, key: str) -> None:
    data = _config(tmp_path).to_dict()
    drop(data)
    path = _write(tmp_path, data)
    with pytest.raises(WorkerConfigError, match="^" + re.escape(f"{path}: missing key '{key}'")):
        read_worker_config(path)


@pytest.mark.parametrize("add, key", [
    (lambda d: d.update(loss_scale="init=1024"), "loss_scale"),
    (lambda d: d["checkpoint"].update(dirs="x"), "checkpoint.dirs"),
    (lambda d: d["agents"][0].update(host="n0"), "agents[0].host"),
    (lambda d: d["lr_schedule"].update(style="cosine"), "lr_schedule.style"),
])
def test_an_unknown_key_is_refused_naming_the_file_and_the_key(tmp_path: Path, add, key: str) -> None:
    data = _config(tmp_path).to_dict()
    add(data)
    path = _write(tmp_path, data)
    with pytest.raises(WorkerConfigError, match="^" + re.escape(f"{path}: unknown key '{key}'")):
        read_worker_config(path)


def test_a_bad_value_inside_names_the_file(tmp_path: Path) -> None:
    data = _config(tmp_path).to_dict()
    data["plan"]["dp"] = "two"
    with pytest.raises(WorkerConfigError, match="^" + re.escape(f"{tmp_path / 'config.json'}: plan")):
        read_worker_config(_write(tmp_path, data))
    with pytest.raises(WorkerConfigError, match="config.json: cannot read the worker config"):
        read_worker_config(tmp_path / "absent" / "config.json")


def test_load_run_refuses_a_config_of_another_plait_naming_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, {**_config(tmp_path).to_dict(), "format_version": 99})
    with pytest.raises(RunFailure, match=re.escape(f"{path}: worker config format_version 99")):
        load_run(tmp_path)


def _flat(config: WorkerConfig) -> dict:
    """`config` as the plaits before worker format_version 1 wrote it: every setting a top-level key."""
    data = config.to_dict()
    data.pop("format_version")
    records, faults = data.pop("records"), data.pop("faults")
    return {**data, **records, **faults, "inject": faults["inject"] or None, "comm_faults": faults["comm_faults"] or None}


def test_the_flat_form_of_older_plaits_is_migrated(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert read_worker_config(_write(tmp_path, _flat(config))) == config
    # a file of before 2026-11-25: 'fault' (now faults.inject), no engine, step_records, probes, data...
    bare = replace(config, lr_schedule=None, data=None, multinode=None, checkpoint=None, clip_grad=None,
                   engine="auto", faults=FaultSettings(Injection(), (), 0.0),
                   records=RecordSettings(True, False, 0, 1 << 18, False, False))
    old = _flat(bare)
    for key in ("engine", "step_records", "probe_every", "probe_bytes", "spmd_calibrate", "multinode",
                "compute_sleep", "data", "inject"):
        old.pop(key)
    old["fault"] = None
    assert read_worker_config(_write(tmp_path, old)) == bare
    old["faults"] = None  # neither form has it
    with pytest.raises(WorkerConfigError, match=re.escape("no 'format_version', and key 'faults' is not one")):
        read_worker_config(_write(tmp_path, old))
