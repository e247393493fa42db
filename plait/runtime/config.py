"""The settings of `plait.runtime.api.run`, grouped as torchtitan groups a job's: five frozen
dataclasses, one docstring per field, each checking its own fields when it is built.

    run(model, cluster, plan, steps,
        training=TrainingConfig(dtype="fp32", optimizer="sgd", lr=0.1, clip_grad=1.0),
        checkpoint=CheckpointConfig(dir="ck", every=2),
        launch=LaunchConfig(timeout=60, device="cpu"),
        records=RecordsConfig(run_dir="run", step_records=True),
        faults=FaultsConfig(inject="kill:rank=1,step=3"))

A bad value raises the error `run` always raised for it (naming the field) when the config is
built, so before any work; the checks that need the plan (ranks named by faults, an SPMD
program's limits) are `run`'s, before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.errors import check_output_path
from plait.runtime.partition import RuntimeSetupError

__all__ = ["CheckpointConfig", "FaultsConfig", "LaunchConfig", "RecordsConfig", "TrainingConfig"]

DTYPES = ("fp32", "tf32", "bf16", "fp16")
START_METHODS = ("fork", "spawn", "forkserver")


@dataclass(frozen=True)
class TrainingConfig:
    """What is trained and how: numerics, optimizer, learning-rate schedule, data."""

    dtype: str | None = None
    """Overrides the plan's dtype (fp32, tf32, bf16, fp16), e.g. "fp32" on CPU, where bf16 autocast
    is slow. None: the plan's. fp16 scales the loss dynamically (`plait.runtime.amp`)."""
    optimizer: str | dict[str, Any] = "adamw"
    """Optimizer name (`plait.runtime.data_parallel.make_optimizer`) or a dict of its settings."""
    lr: float = 1e-3
    """Peak learning rate (Megatron-LM's --lr)."""
    weight_decay: float = 0.0
    """Decoupled weight decay of the optimizer."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (Megatron-LM's --min-lr)."""
    lr_warmup_iters: int = 0
    """Steps of linear warm-up from 0 to `lr` (`plait.runtime.lr`)."""
    lr_decay_style: str = "constant"
    """constant, linear or cosine decay from `lr` to `min_lr` after the warm-up."""
    lr_decay_iters: int | None = None
    """Steps over which the rate decays; None: the run's `steps`."""
    clip_grad: float | None = None
    """Clips the global gradient norm (over every shard of every form) to this value
    (`plait.runtime.clip`, Megatron's --clip-grad); None: no clipping."""
    seed: int = 0
    """Seed of the initial weights (the same on every rank and in `reference_run`)."""
    data_seed: int = 0
    """Seed of the synthetic samples, or of the sample order of `data`."""
    data: str | None = None
    """The user's dataset, `file.py:factory` (`plait.runtime.data`); None: the model's seeded
    synthetic samples."""
    data_workers: int = 1
    """DataLoader worker processes per rank that fetch `data`."""

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise RuntimeSetupError(f"dtype: must be fp32, tf32, bf16 or fp16, got {self.dtype!r}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise RuntimeSetupError(f"clip_grad: must be > 0, got {self.clip_grad}")
        if self.data is not None and self.data_workers < 0:
            from plait.runtime.data import DataSpecError

            raise DataSpecError(f"data_workers must be >= 0, got {self.data_workers}")
        self.lr_schedule()  # LRScheduleError naming the flag

    def optimizer_config(self) -> dict[str, Any]:
        """The workers' optimizer settings: a name, or the user's dict, with `lr` and `weight_decay`."""
        if isinstance(self.optimizer, str):
            return {"name": self.optimizer, "lr": self.lr, "weight_decay": self.weight_decay}
        return {"lr": self.lr, "weight_decay": self.weight_decay, **self.optimizer}

    def lr_schedule(self) -> Any:
        """The Megatron-style schedule (`plait.runtime.lr.LRSchedule`), or None for a constant rate
        (the optimizer's own)."""
        from plait.runtime.lr import LRSchedule

        sched = LRSchedule(lr=self.lr, min_lr=self.min_lr, warmup=self.lr_warmup_iters,
                           decay_style=self.lr_decay_style, decay_iters=self.lr_decay_iters)
        return None if (self.lr_warmup_iters == 0 and self.lr_decay_style == "constant") else sched


@dataclass(frozen=True)
class CheckpointConfig:
    """Distributed checkpoints (`plait.runtime.checkpoint`): where, how often, resuming."""

    dir: str | Path | None = None
    """Checkpoint directory; None: no checkpoints (and no resuming)."""
    every: int = 0
    """Steps between checkpoints; 0: none during the run."""
    resume: bool = False
    """Resume from the newest complete checkpoint in `dir` (a damaged newest one is named and the
    previous good one used); an error when there is none."""
    keep: int | None = 2
    """Checkpoints kept (the oldest deleted); None: all."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise RuntimeSetupError(f"checkpoint_every must be >= 0, got {self.every}")
        if (self.every or self.resume) and self.dir is None:
            raise RuntimeSetupError("checkpointing and --resume need a checkpoint directory (--checkpoint-dir)")


@dataclass(frozen=True)
class LaunchConfig:
    """How the workers start and are watched: torchrun, devices, emulation, multi-node."""

    timeout: float = 300.0
    """Seconds a rank may make no progress before the run is stopped (a hang)."""
    startup_timeout: float | None = None
    """Seconds the workers may take to start and meet; None: max(120, `timeout`)."""
    nprocs_per_node: int | None = None
    """Loopback runs: one torchrun agent per this many ranks (runs the multi-agent rendezvous
    without network namespaces); None: one agent for all."""
    device: str = "auto"
    """auto (NCCL on GPUs when there is one per rank, else gloo on CPU), cpu or cuda."""
    start_method: str | None = None
    """torchrun's: "fork" (CPU default: workers inherit the agent's imports), "spawn" (GPU
    default: CUDA must not be initialised before a fork) or "forkserver"."""
    env: dict[str, str] | None = None
    """Extra environment of the workers (e.g. PLAIT_LOSS_SCALE="init=1024,growth_interval=100")."""
    emulate: bool = True
    """Emulate the cluster file's `emulation` section: compute slowdown per GPU kind
    (`plait.runtime.emulate`) and, as root, links shaped in network namespaces (`plait.runtime.netns`)."""
    emulate_dtype: str | None = None
    """The dtype whose peak FLOP/s ratios set the emulated slowdown of slower kinds (e.g. the
    plan's fp16 while the CPU ranks compute fp32); None: the training dtype."""
    rendezvous: Any = None
    """A `plait.runtime.multinode.Rendezvous`: this node's share of a multi-node run on real hosts;
    every node calls `run` with the same plan and cluster."""
    step_barrier: bool = True
    """A barrier at each step's start, so step times are comparable across ranks."""
    engine: str = "auto"
    """auto (the engine `plait.runtime.engine_for` names: torch's modules where they run the plan
    with their records), plait (plait's own executors, e.g. to compare the two:
    bench/torch_engine.py) or torch (as auto: since DTensor's collectives are recorded, every plan
    torch's modules run, they run by default). `plait run --engine`."""

    def __post_init__(self) -> None:
        if not self.timeout > 0:  # also rejects NaN
            raise RuntimeSetupError(f"timeout: must be > 0 seconds (how long a rank may make no progress before "
                                    f"the run is stopped), got {self.timeout}")
        if self.engine not in ("auto", "plait", "torch"):
            raise RuntimeSetupError(f"engine: must be auto, plait or torch, got {self.engine!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise RuntimeSetupError(f"device: must be auto, cpu or cuda, got {self.device!r}")
        if self.start_method is not None and self.start_method not in START_METHODS:
            raise RuntimeSetupError(f"start_method: must be fork, spawn or forkserver, got {self.start_method!r}")
        if self.emulate_dtype is not None and self.emulate_dtype not in DTYPES:
            raise RuntimeSetupError(f"emulate_dtype: must be fp32, tf32, bf16 or fp16, got {self.emulate_dtype!r}")
        if self.nprocs_per_node is not None and self.nprocs_per_node < 0:
            raise RuntimeSetupError(f"--nprocs-per-node must be >= 1, got {self.nprocs_per_node}")

    def startup(self) -> float:
        """Seconds the workers may take to start and meet."""
        return self.startup_timeout if self.startup_timeout is not None else max(120.0, self.timeout)


@dataclass(frozen=True)
class RecordsConfig:
    """What the run keeps and measures beyond the losses: run folder, trace, records, probes."""

    run_dir: str | Path | None = None
    """Run folder (config, logs, records, `losses.csv`); None: a temporary one, deleted after a
    successful run (kept, and named, when the run fails)."""
    trace: str | Path | None = None
    """Write the measured timeline here as a Chrome trace."""
    comm_records: bool | str = True
    """Stream every collective and point-to-point call of each rank to `RUN_DIR/comm/rankN.jsonl`
    (`RunResult.comm_dir`); "alternate": on and off in alternate steps (`bench/recorder_overhead.py`)."""
    step_records: bool = False
    """Stream each step's bounds and loss as it ends (`RUN_DIR/steps/rankN.jsonl`, read by
    `read_step_records`), so a run that dies keeps them."""
    probe_every: int = 10
    """Time every rank pair's link every this many steps (the doctor's rank x rank matrix; 0: never;
    only with `comm_records`)."""
    probe_bytes: int = 1 << 18
    """Bytes per probe exchange."""
    return_params: bool = False
    """Return the full (unsharded) trained parameters in `RunResult.params`."""
    spmd_calibrate: bool = False
    """SPMD plans: time the ranks' all-gathers first, and the whole program on every rank side by side
    before and after the steps (`RunResult.spmd["calibration"]`; `plait.runtime.spmd_worker`)."""

    def __post_init__(self) -> None:
        if self.comm_records not in (True, False, "alternate"):
            raise RuntimeSetupError(f"comm_records: must be True, False or 'alternate', got {self.comm_records!r}")
        if self.probe_every < 0 or self.probe_bytes < 0:
            raise RuntimeSetupError(f"probe_every and probe_bytes must be >= 0, got {self.probe_every}, "
                                    f"{self.probe_bytes}")
        check_output_path(self.trace, "trace")


@dataclass(frozen=True)
class FaultsConfig:
    """Faults and perturbations put in on purpose (fault-injection experiments, the doctor's suite)."""

    inject: Any = None
    """Faults to inject (`plait.runtime.inject`), e.g. "kill:rank=2,step=3; slow:rank=1,factor=2,from=2",
    or an `Injection`."""
    comm_faults: Any = None
    """Links slowed between ranks by the communication facade (`plait.runtime.comm.LinkFault`):
    {"slow_link": [a, b], "delay_s": x, "factor": f}, a list of them, or their JSON."""
    compute_sleep: float = 0.0
    """Pad each forward span to at least this many seconds (backward twice) by sleeping, so ranks'
    timings do not depend on how many share a core."""

    def __post_init__(self) -> None:
        self.link_faults()  # a bad fault fails here, not in every worker
        self.injection()
        if not self.compute_sleep >= 0:
            raise RuntimeSetupError(f"compute_sleep: must be >= 0 seconds, got {self.compute_sleep}")

    def injection(self) -> Any:
        """The parsed `inject` (`plait.runtime.inject.Injection`)."""
        from plait.runtime.inject import Injection

        return self.inject if isinstance(self.inject, Injection) else Injection.parse(self.inject)

    def link_faults(self) -> tuple[Any, ...]:
        """The parsed `comm_faults` (`plait.runtime.comm.LinkFault`s)."""
        from plait.runtime.comm import parse_link_faults

        return parse_link_faults(self.comm_faults, "comm_faults")

    def check_world(self, world: int) -> None:
        """Every rank the faults name must be one of the plan's `world` ranks."""
        self.injection().check_world(world)
        for f in self.link_faults():
            if max(f.a, f.b) >= world:
                raise RuntimeSetupError(f"comm_faults: field 'slow_link' {[f.a, f.b]} names a rank outside the "
                                        f"plan's {world} ranks")
