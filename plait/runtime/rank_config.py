"""What every worker (`plait.runtime.worker`, `plait.runtime.spmd_worker`,
`plait.runtime.compose_worker`, `plait.runtime.torch_worker`) reads from the run's typed config
(`plait.runtime.worker_config.WorkerConfig`) before anything else: its plan, its rank's place and
the run folder. The worker entry (`plait.runtime.entry`) reads the config to choose the engine;
what the workers write the same way is `plait.runtime.results`."""

from __future__ import annotations

from pathlib import Path

from plait.runtime.recorder import Heartbeat
from plait.runtime.worker_config import WorkerConfig


class RankConfig:
    def __init__(self, config: WorkerConfig, rank: int, heartbeat: Heartbeat) -> None:
        self.config = config
        self.rank = rank
        self.hb = heartbeat
        self.plan = config.plan
        self.world = self.plan.world_size
        self.info = config.ranks[rank]  # host, device, ... as the launcher placed it
        self.run_dir = Path(config.run_dir)

    @property
    def gpu(self) -> int:
        """This rank's GPU on its machine: the cluster file's local index on real hosts, else the
        plan rank (every agent of the run on this machine: emulated nodes share it)."""
        return self.info.local_device if self.info.local_device is not None else self.rank
