"""The workers' config: what `plait.runtime.api.run` tells every rank, as one frozen dataclass
(`WorkerConfig`, a docstring per field) with typed parts (rank places, checkpoints, data, records,
faults, the multi-node share).

The launcher writes it to `RUN_DIR/config.json` (`write_worker_config`); each rank reads it back
(`read_worker_config`, `plait.runtime.entry`), and so does the launcher when it assembles the
result; `plait report` and the doctor read it from old run folders too. The flat form every
plait wrote before format_version 1 (no `format_version`; each setting a top-level key) is migrated
(`_from_flat`); a file of another `format_version` is refused, and an unknown or a missing key is
an error naming the file and the key.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

from plait.errors import PlaitError
from plait.ir.formats import FORMAT_VERSIONS
from plait.ir.plan import Plan
from plait.runtime.comm import FAULTS_ENV, LinkFault, parse_link_faults
from plait.runtime.inject import Injection
from plait.runtime.lr import LRSchedule
from plait.runtime.multinode import HostNode

__all__ = ["AgentRanks", "CheckpointSettings", "DataSettings", "FaultSettings", "MultinodeSettings", "RankPlace",
           "RecordSettings", "WorkerConfig", "WorkerConfigError", "read_worker_config", "write_worker_config"]

FORMAT = "worker"  # its key in plait.ir.formats.FORMAT_VERSIONS


class WorkerConfigError(PlaitError, ValueError):
    """A worker config file this plait cannot read; the message names the file and the key."""


@dataclass(frozen=True)
class RankPlace:
    """Where one plan rank runs (`plait.runtime.api.rank_layout`)."""

    rank: int
    """The plan rank."""
    device: int
    """Its device id in the cluster (`Plan.device_of`)."""
    node: int
    """Its node's index in the cluster file (0 without a cluster)."""
    host: str
    """Its node's name in the cluster file (this machine's hostname without one)."""
    kind: str | None
    """The device's GPU kind in the cluster file; None without a cluster."""
    slowdown: float
    """Compute slowdown emulating that kind (`plait.runtime.emulate`); 1.0: none."""
    local_device: int | None = None
    """Real hosts: the rank's GPU index on its host (the cluster file's local index); None: the
    plan rank picks the GPU (every rank on this machine)."""


@dataclass(frozen=True)
class AgentRanks:
    """One torchrun agent and the plan ranks of its workers, by local rank."""

    node: int
    """The agent's index (its node, when each emulated node has one)."""
    ranks: tuple[int, ...]
    """Plan rank of each of its workers (LOCAL_RANK order)."""


@dataclass(frozen=True)
class CheckpointSettings:
    """Distributed checkpoints (`plait.runtime.checkpoint`)."""

    dir: str
    """The checkpoint directory (absolute)."""
    every: int
    """Steps between checkpoints; 0: none during the run."""
    resume: bool
    """Resume from `resume_from`."""
    resume_from: str | None
    """The checkpoint the launcher chose to resume from; None: start at step 0."""
    keep: int | None
    """Checkpoints kept (the oldest deleted); None: all."""


@dataclass(frozen=True)
class DataSettings:
    """The user's dataset (`plait.runtime.data`)."""

    spec: str
    """`file.py:factory`, the file's path absolute."""
    workers: int
    """DataLoader worker processes per rank."""


@dataclass(frozen=True)
class RecordSettings:
    """What the ranks record beyond their spans (`plait.runtime.config.RecordsConfig`)."""

    comm_records: bool | str
    """Stream every communication call to `RUN_DIR/comm/rankN.jsonl`; "alternate": on and off in
    alternate steps."""
    step_records: bool
    """Stream each step's bounds and loss to `RUN_DIR/steps/rankN.jsonl`."""
    probe_every: int
    """Time every rank pair's link every this many steps; 0: never."""
    probe_bytes: int
    """Bytes per probe exchange."""
    return_params: bool
    """Rank 0 writes the full trained parameters to `RUN_DIR/params.pt`."""
    spmd_calibrate: bool
    """SPMD plans: time the links and the whole program before and after the steps."""


@dataclass(frozen=True)
class FaultSettings:
    """Faults put in on purpose (`plait.runtime.config.FaultsConfig`)."""

    inject: Injection
    """Injected faults (`plait.runtime.inject`), node uplinks already turned into rank pairs."""
    comm_faults: tuple[LinkFault, ...]
    """Links the communication facade slows (those tc does not shape)."""
    compute_sleep: float
    """Pad each forward span to at least this many seconds (backward twice); 0: no padding."""

    def link_faults(self) -> tuple[LinkFault, ...]:
        """The slowed links: `PLAIT_COMM_FAULTS` when set (tests set it for every rank), else `comm_faults`."""
        env = os.environ.get(FAULTS_ENV)
        return parse_link_faults(env) if env else self.comm_faults


@dataclass(frozen=True)
class MultinodeSettings:
    """Real hosts: this node's share of a multi-node run (`plait.runtime.multinode`)."""

    node_name: str
    """This node's name (--node-name)."""
    nodes: tuple[HostNode, ...]
    """The cluster file's nodes that hold plan ranks, checked against the hosts that join."""
    emulated: bool
    """The cluster file is emulated: the hosts' GPUs are not checked."""
    timeout: float
    """Seconds to wait for every node's facts in the rendezvous store."""


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a rank reads from its run's config."""

    model: str
    """The model spec string (`plait.runtime.partition.load_model_spec`)."""
    plan: Plan
    """The plan every rank runs."""
    steps: int
    """Total steps of the run (counting those before a resumed checkpoint)."""
    seed: int
    """Seed of the initial weights."""
    data_seed: int
    """Seed of the synthetic samples, or of the sample order of `data`."""
    optimizer: dict[str, Any]
    """Optimizer settings (`plait.runtime.data_parallel.make_optimizer`): name, lr, weight_decay and
    the user's own keys."""
    dtype: str
    """The training dtype (fp32, tf32, bf16, fp16)."""
    lr_schedule: LRSchedule | None
    """Megatron-style learning-rate schedule; None: the optimizer's constant rate."""
    clip_grad: float | None
    """Clip the global gradient norm to this; None: no clipping."""
    data: DataSettings | None
    """The user's dataset; None: the model's synthetic samples."""
    backend: str
    """torch.distributed backend: gloo or nccl."""
    device: str
    """cpu or cuda."""
    engine: str
    """auto, plait or torch (`plait.runtime.layout.engine_for`)."""
    collective_timeout: float
    """Seconds a collective may wait before torch.distributed gives up."""
    step_barrier: bool
    """A barrier at each step's start, so step times are comparable across ranks."""
    run_dir: str
    """The run folder (heartbeats, status, records, result)."""
    ranks: tuple[RankPlace, ...]
    """Where each plan rank runs, by plan rank."""
    agents: tuple[AgentRanks, ...]
    """The torchrun agents of this machine, by GROUP_RANK."""
    multinode: MultinodeSettings | None
    """Real hosts: this node's share; None: every rank on this machine."""
    checkpoint: CheckpointSettings | None
    """Checkpoints; None: none (and no resuming)."""
    records: RecordSettings
    """What the ranks record."""
    faults: FaultSettings
    """Faults put in on purpose."""
    format_version: int = FORMAT_VERSIONS[FORMAT]
    """The config format; a file of another version is refused."""

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def schedule_record(self) -> str:
        """The learning-rate schedule as a checkpoint records it: JSON text, "null" for none."""
        return json.dumps(self.lr_schedule.to_dict() if self.lr_schedule is not None else None)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, `format_version` first."""
        out = _encode(self)
        return {"format_version": out.pop("format_version"), **out}

    @classmethod
    def from_dict(cls, data: Any, source: str) -> WorkerConfig:
        """The config of `data` (read from `source`); WorkerConfigError naming `source` and the key."""
        try:
            return cls._from_keys(_keys(cls, _versioned(data, source), source, ""), source)
        except WorkerConfigError:
            raise
        except (PlaitError, TypeError, ValueError) as exc:  # a value its own type refuses (a plan, a fault...)
            text = str(exc)
            raise WorkerConfigError(text if text.startswith(source) else f"{source}: {text}") from None

    @classmethod
    def _from_keys(cls, data: dict[str, Any], source: str) -> WorkerConfig:
        return cls(**{
            **data,
            "plan": Plan.from_dict(data["plan"], f"{source}: plan"),
            "lr_schedule": _optional(LRSchedule, data["lr_schedule"], source, "lr_schedule."),
            "data": _optional(DataSettings, data["data"], source, "data."),
            "ranks": _each(RankPlace, data["ranks"], source, "ranks"),
            "agents": _each(AgentRanks, data["agents"], source, "agents"),
            "multinode": _multinode(data["multinode"], source),
            "checkpoint": _optional(CheckpointSettings, data["checkpoint"], source, "checkpoint."),
            "records": _flat(RecordSettings, data["records"], source, "records."),
            "faults": _faults(data["faults"], source),
        })


def write_worker_config(path: Path, config: WorkerConfig) -> None:
    path.write_text(json.dumps(config.to_dict(), indent=1))


def read_worker_config(path: str | Path) -> WorkerConfig:
    """The config of the file at `path`; WorkerConfigError naming the file when it cannot be read."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise WorkerConfigError(f"{path}: cannot read the worker config ({exc})") from None
    return WorkerConfig.from_dict(data, str(path))


# ---------------------------------------------------------------------------------- JSON
def _encode(value: Any) -> Any:
    """JSON values: the plan, the injection and link faults in their own JSON forms, the other
    dataclasses field by field, tuples as lists."""
    if isinstance(value, Plan | LinkFault):
        return value.to_dict()
    if isinstance(value, Injection):
        return value.to_list()
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple | list):
        return [_encode(v) for v in value]
    return value


def _versioned(data: Any, source: str) -> dict[str, Any]:
    """`data` in this plait's worker config format, checked before its keys (another version has
    other keys); the flat form of the plaits before format_version 1 migrated."""
    if not isinstance(data, dict):
        raise WorkerConfigError(f"{source}: a worker config must be a JSON object, got {type(data).__name__}")
    current = FORMAT_VERSIONS[FORMAT]
    if "format_version" not in data:
        return _from_flat(data, source)
    found = data["format_version"]
    if found != current or isinstance(found, bool):
        raise WorkerConfigError(f"{source}: worker config format_version {found!r}, but this plait reads "
                                f"format_version {current} only; the file was written by another plait "
                                "(run it again with this one)")
    return data


# The flat form (plait before worker format_version 1, up to 2026-12-07): the same settings as
# top-level keys, grouped here as format 1 groups them. Keys were added over the releases: an older
# file lacks some, and each then gets the value that meant "off" (or the default) when it was added.
_FLAT_RECORDS = {"comm_records": True, "step_records": False, "probe_every": 0, "probe_bytes": 1 << 18,
                 "return_params": False, "spmd_calibrate": False}
_FLAT_FAULTS = {"inject": None, "comm_faults": None, "compute_sleep": 0.0}
_FLAT_LATER = {"data": None, "lr_schedule": None, "clip_grad": None, "engine": "auto", "step_barrier": True,
               "multinode": None, "checkpoint": None}
_FLAT_RENAMED = {"fault": "inject"}  # its name before the run's settings became dataclasses (2026-11-25)


def _from_flat(data: dict[str, Any], source: str) -> dict[str, Any]:
    """The format-1 object of a flat config (`data` has no `format_version`)."""
    flat = {_FLAT_RENAMED.get(k, k): v for k, v in data.items()}
    top = {f.name for f in fields(WorkerConfig)} - {"records", "faults", "format_version"}
    unknown = [k for k in flat if k not in top | set(_FLAT_RECORDS) | set(_FLAT_FAULTS)]
    if unknown:
        raise WorkerConfigError(f"{source}: no 'format_version', and key '{unknown[0]}' is not one of the "
                                "worker config's flat form (before format_version 1) either")
    out: dict[str, Any] = {**_FLAT_LATER, **{k: v for k, v in flat.items() if k in top}}
    out["records"] = {k: flat.get(k, d) for k, d in _FLAT_RECORDS.items()}
    faults = {k: flat.get(k, d) for k, d in _FLAT_FAULTS.items()}
    out["faults"] = {**faults, "inject": faults["inject"] or [], "comm_faults": faults["comm_faults"] or []}
    out["format_version"] = FORMAT_VERSIONS[FORMAT]
    return out


def _keys(cls: type, data: Any, source: str, where: str) -> dict[str, Any]:
    """`data`, an object with exactly the fields of dataclass `cls` (`where`: the keys' prefix)."""
    if not isinstance(data, dict):
        raise WorkerConfigError(f"{source}: '{where.rstrip('.')}' must be an object, got {type(data).__name__}")
    names = [f.name for f in fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        raise WorkerConfigError(f"{source}: unknown key '{where}{unknown[0]}' (not a field of {cls.__name__})")
    missing = [n for n in names if n not in data]
    if missing:
        raise WorkerConfigError(f"{source}: missing key '{where}{missing[0]}' ({cls.__name__})")
    return data


_T = TypeVar("_T")


def _flat(cls: type[_T], data: Any, source: str, where: str) -> _T:
    """A dataclass of plain fields (JSON lists become its tuples)."""
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in _keys(cls, data, source, where).items()})


def _optional(cls: type[_T], data: Any, source: str, where: str) -> _T | None:
    return None if data is None else _flat(cls, data, source, where)


def _each(cls: type[_T], items: Any, source: str, where: str) -> tuple[_T, ...]:
    if not isinstance(items, list):
        raise WorkerConfigError(f"{source}: '{where}' must be a list, got {type(items).__name__}")
    return tuple(_flat(cls, item, source, f"{where}[{i}].") for i, item in enumerate(items))


def _multinode(data: Any, source: str) -> MultinodeSettings | None:
    if data is None:
        return None
    data = _keys(MultinodeSettings, data, source, "multinode.")
    return MultinodeSettings(**{**data, "nodes": _each(HostNode, data["nodes"], source, "multinode.nodes")})


def _faults(data: Any, source: str) -> FaultSettings:
    data = _keys(FaultSettings, data, source, "faults.")
    return FaultSettings(inject=Injection.from_list(data["inject"]),
                         comm_faults=parse_link_faults(data["comm_faults"], f"{source}: faults.comm_faults"),
                         compute_sleep=float(data["compute_sleep"]))
