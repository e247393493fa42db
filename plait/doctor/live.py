"""The doctor left on: which live findings have *persisted* long enough to be reported.

A live diagnosis (`diagnose(..., live=True)`) reads the records as they stand at one poll; a
noisy moment (three latency spikes of a loaded machine in four probes, a read that raced a rank's
end) can name something one poll and not the next. Post hoc the doctor judges the whole stream;
live, a finding is reported only once it has been named at `DoctorConfig.polls()` consecutive
polls spanning at least `DoctorConfig.seconds()` -- a finding missing at one poll starts over.

    watch = Persistence(DoctorConfig(poll_s=2.0))
    while running:
        d = watch.update(diagnose(run_dir, live=True), now=time.time())  # only what persisted
        ...; time.sleep(2.0)

The threshold is derived from the poll interval and the detection goal: the detectors need part
of the goal to gather their evidence (`evidence_s`: >= 3 slow steps or probes, a stall of 4
median steps), the rest is the persistence budget, spent in whole polls. Used by `plait doctor
--live`, `plait run --recover` (`plait.recover.loop`) and the benches' live replays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from plait.ir.diagnosis import Diagnosis, Finding

Key = tuple[str, tuple[int, ...]]


@dataclass(frozen=True)
class DoctorConfig:
    """How the live doctor turns polls into reported findings."""

    poll_s: float = 2.0
    """Seconds between live diagnoses (`plait run --recover`: `RecoveryConfig.detect_every`;
    `plait doctor --live`: `--interval`)."""
    detect_goal_s: float = 15.0
    """Onset-to-report time live findings must keep at p90 (Mycroft, SOSP'25: 15 s for 90 % of
    its cases; issue 32's goal)."""
    evidence_s: float = 7.5
    """The part of `detect_goal_s` left to the detectors to gather their evidence (onset to
    `Finding.detected_s`; bench/doctor.py measured a p90 of 4.1 s on its smoke suite, so half the
    goal leaves room for steps twice as long); the rest is spent on persistence."""
    persist_polls: int | None = None
    """K: consecutive polls that must name a finding (same class, same ranks) before it is
    reported. None: derived, max(2, floor((detect_goal_s - evidence_s) / poll_s)) -- 3 at 2 s
    polls, so a report comes at most K polls (6 s) after the evidence. 1: no persistence."""
    persist_s: float | None = None
    """...and the seconds those polls must span, first naming to now (a poller faster than
    `poll_s` must not shorten it). None: (K - 1) polls less half a poll of timing jitter."""

    def polls(self) -> int:
        if self.persist_polls is not None:
            return max(1, int(self.persist_polls))
        return max(2, math.floor((self.detect_goal_s - self.evidence_s) / self.poll_s))

    def seconds(self) -> float:
        if self.persist_s is not None:
            return max(0.0, self.persist_s)
        return max(0.0, (self.polls() - 1.5) * self.poll_s)


def key(f: Finding) -> Key:
    return (f.kind, f.ranks)


class Persistence:
    """Streaks of findings over consecutive polls; `update` keeps the ones that persisted."""

    def __init__(self, config: DoctorConfig | None = None) -> None:
        self.config = config or DoctorConfig()
        self.k, self.span = self.config.polls(), self.config.seconds()
        self.since: dict[Key, tuple[int, float]] = {}
        """Finding -> (consecutive polls that named it, when the first of them was)."""

    def update(self, diag: Diagnosis, now: float) -> Diagnosis:
        """Count this poll (`now`: any clock the caller keeps, seconds) and return `diag` with
        only the findings named at >= K consecutive polls spanning >= `seconds()`; the others
        are listed in its warnings as not yet persistent."""
        keys = {key(f) for f in diag.findings}
        self.since = {k: (self.since[k][0] + 1, self.since[k][1]) if k in self.since else (1, now) for k in keys}
        kept = [f for f in diag.findings if self.persisted(key(f), now)]
        waiting = [f"not yet persistent, not reported: {f.kind} of ranks {list(f.ranks)} "
                   f"({self.since[key(f)][0]} of {self.k} polls)" for f in diag.findings if f not in kept]
        return replace(diag, findings=kept, warnings=list(diag.warnings) + waiting)

    def persisted(self, k: Key, now: float) -> bool:
        n, first = self.since.get(k, (0, now))
        return n >= self.k and now - first >= self.span - 1e-9
