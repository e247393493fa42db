"""What every worker (`plait.runtime.worker`, `plait.runtime.spmd_worker`,
`plait.runtime.compose_worker`) reads from the run's config before anything else: its plan, its
rank's entry and the run folder. The worker entry (`plait.runtime.entry`) reads it to choose the
engine; what the workers write the same way is `plait.runtime.results`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plait.ir.plan import Plan
from plait.runtime.recorder import Heartbeat


class RankConfig:
    def __init__(self, cfg: dict[str, Any], rank: int, heartbeat: Heartbeat) -> None:
        self.cfg = cfg
        self.rank = rank
        self.hb = heartbeat
        self.plan = Plan.from_dict(cfg["plan"])
        self.world = self.plan.world_size
        self.info = cfg["ranks"][rank]  # host, device, ... as the launcher wrote it
        self.run_dir = Path(cfg["run_dir"])
