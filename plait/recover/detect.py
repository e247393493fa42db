"""What the recovery loop knows is wrong: the doctor's diagnosis, else the launcher's.

`detect(run_dir) -> Diagnosis` is the loop's one input about faults. The default
(`default_detect`) is the doctor's `plait.doctor.diagnose` when this plait has it, which reads the
run folder's communication records and heartbeats (slow ranks and links included). Without it,
or when it names no culprit, the loop falls back on what the launcher itself saw when it stopped
the job (`launcher_diagnosis`): a rank that died (torchrun's exit records: signal, exit code) or a
rank that made no progress for the heartbeat timeout while not waiting in a collective (a hang).
A rank that raised a Python error is not a hardware fault the loop can route around: a bug
recurs on any plan, so that failure is passed on to the user.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plait.ir.diagnosis import REPORT_ONLY, Diagnosis, Finding
from plait.runtime.launch import RunFailure

Detect = Callable[..., Diagnosis]  # detect(run_dir[, live=bool]) -> Diagnosis


def default_detect(run_dir: str | Path, live: bool = False) -> Diagnosis:
    """The doctor's diagnosis of `run_dir` when `plait.doctor.diagnose` exists, else an empty one
    (the launcher's failure then decides). `live`: the run is still going."""
    try:
        from plait.doctor import diagnose  # type: ignore[attr-defined]
    except ImportError:
        return Diagnosis(run_dir=str(run_dir))
    return diagnose(run_dir, live=live)


def call_detect(detect: Detect, run_dir: str | Path, live: bool) -> Diagnosis:
    """`detect(run_dir, live=live)` when it takes `live` (as the doctor's does), else `detect(run_dir)`."""
    try:
        takes_live = "live" in inspect.signature(detect).parameters
    except (TypeError, ValueError):
        takes_live = False
    return detect(run_dir, live=live) if takes_live else detect(run_dir)  # type: ignore[call-arg]


def launcher_diagnosis(failure: RunFailure, run_dir: str | Path, world: int, started: float,
                       layout: list[dict[str, Any]] | None = None) -> Diagnosis:
    """The findings the launcher's failure carries: `died` -> a dead rank, `hang` of a named rank
    -> a non-communication hang (its peers were waiting for it in collectives). `started` is the
    wall time the job started (for `first_seen_s`)."""
    seen = failure.detected_at if failure.detected_at is not None else time.time()
    kinds = {"died": "dead_rank", "hang": "noncomm_hang"}
    findings = []
    if failure.kind in kinds and failure.rank is not None:
        host = (layout[failure.rank]["host"],) if layout else ((failure.host,) if failure.host else ())
        findings.append(Finding(kind=kinds[failure.kind], ranks=(failure.rank,), first_seen_s=seen - started,
                                evidence={"source": "launcher", "message": str(failure)}, nodes=host))
    return Diagnosis(run_dir=str(run_dir), findings=findings, world_size=world)


def actionable(diagnosis: Diagnosis) -> bool:
    """True when the diagnosis names a rank (or a link's ranks) to isolate; a slow rank alone is
    reported, never isolated (`REPORT_ONLY`)."""
    return any(f.ranks for f in diagnosis.findings if f.kind not in REPORT_ONLY and not f.evidence.get("resumed"))
