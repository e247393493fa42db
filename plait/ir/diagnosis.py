"""What the doctor found in a run: `Finding`s and the `Diagnosis` that holds them.

Shared by the doctor (which writes them), the recovery driver (which isolates the culprits) and
the report (which shows them), so it lives in the neutral IR. Classes after C4D (HPCA'25, §4):
a hang or a slowdown, each either in communication or outside it; plus a mismatched collective
and a rank that died. A slow link is C4D's "communication slow" pinned to one rank pair.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from plait.errors import PlaitError
from plait.ir.formats import check_version, stamp

FINDING_KINDS = (
    "comm_hang",     # every rank waits in one collective that one rank never joins (it is alive)
    "noncomm_hang",  # a rank stopped outside communication (stopped, stuck in compute); peers wait
    "slow_rank",     # one rank is slow outside communication: its peers wait for it every step
    "slow_link",     # transfers between one rank pair are slow: one cell of the rank x rank matrix
    "mismatch",      # ranks entered different collectives (op, size or order) at one sequence number
    "dead_rank",     # a rank's process ended (killed, crashed) while the job ran
)


# Findings the recovery loop reports and never isolates: a slow rank still trains (dropping it would
# shrink a healthy job; its batch share is the planner's to rebalance).
REPORT_ONLY = ("slow_rank",)


class DiagnosisError(PlaitError, ValueError):
    """A diagnosis file or finding that cannot be read."""


@dataclass(frozen=True)
class Finding:
    kind: str
    """One of FINDING_KINDS."""
    ranks: tuple[int, ...]
    """The culprit: one rank, or the two ranks of a slow link (smaller first)."""
    first_seen_s: float
    """Seconds from the run's start to the first record that showed it."""
    step: int | None = None
    """The training step where it was first seen, when known."""
    collective: str | None = None
    """The collective (op and group) the evidence comes from, when one."""
    evidence: dict[str, Any] = field(default_factory=dict)
    """What the doctor measured: waiting times, ratios to peers, the matrix cell, ..."""
    nodes: tuple[str, ...] = ()
    """Names of the nodes that host the culprit ranks, when the run folder says."""
    detected_s: float | None = None
    """Seconds from the run's start to when the records held enough evidence to name it (the
    doctor watching live would have named it then); `first_seen_s` is when the fault began."""

    def __post_init__(self) -> None:
        if self.kind not in FINDING_KINDS:
            raise DiagnosisError(f"finding kind {self.kind!r}: must be one of {FINDING_KINDS}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ranks"], d["nodes"] = list(self.ranks), list(self.nodes)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        return cls(**{**d, "ranks": tuple(d.get("ranks", ())), "nodes": tuple(d.get("nodes", ()))})


@dataclass
class Diagnosis:
    run_dir: str
    """The run folder the records came from."""
    findings: list[Finding] = field(default_factory=list)
    """What is wrong, most severe first; empty for a healthy run."""
    world_size: int = 0
    warnings: list[str] = field(default_factory=list)
    """Records that could not be read (file and line), and what was skipped."""

    @property
    def healthy(self) -> bool:
        return not self.findings

    def culprit_ranks(self) -> set[int]:
        """Ranks to isolate: every rank named by a finding other than a slow link's pair (a link
        is isolated by dropping one of its ends, which the recovery driver decides) and a slow
        rank's (a slow but healthy rank is reported, never dropped: `REPORT_ONLY`)."""
        return {r for f in self.findings if f.kind not in ("slow_link", *REPORT_ONLY) for r in f.ranks}

    def to_dict(self) -> dict[str, Any]:
        return stamp("diagnosis", {"run_dir": self.run_dir, "world_size": self.world_size,
                                   "findings": [f.to_dict() for f in self.findings],
                                   "warnings": list(self.warnings)})

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "diagnosis") -> Diagnosis:
        d = check_version("diagnosis", data, source, DiagnosisError)
        return cls(run_dir=d.get("run_dir", ""), world_size=int(d.get("world_size", 0)),
                   findings=[Finding.from_dict(f) for f in d.get("findings", [])],
                   warnings=list(d.get("warnings", [])))
