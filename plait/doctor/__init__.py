"""The doctor: reads a run's per-rank communication records and heartbeats (live or finished)
and names what is wrong (`plait.ir.diagnosis`): hangs, slow ranks, slow links, mismatches.
Sits beside `plait.measure`: it reads what the runtime wrote and never drives the runtime.

    from plait.doctor import diagnose
    d = diagnose("runs/job1")            # a finished (or killed) run's folder
    d = diagnose("runs/job1", live=True)  # a running job: "now" is the end of the evidence
    for f in d.findings: print(f.kind, f.ranks, f.first_seen_s, f.evidence)
    watch = Persistence(DoctorConfig(poll_s=2.0))      # left on: report only what persisted
    d = watch.update(diagnose("runs/job1", live=True), now=time.time())

The detectors and their thresholds: `plait.doctor.detect`; live persistence (a finding must hold
over K consecutive polls before it is reported): `plait.doctor.live`; the record format:
docs/doctor.md.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from plait.doctor.detect import (
    Thresholds,
    calls_not_joined,
    contention_notes,
    dead_ranks,
    hangs,
    link_matrix,
    mismatches,
    past_stalls,
    slow_links,
    slow_ranks,
)
from plait.doctor.folder import RunRecords, read_run
from plait.doctor.live import DoctorConfig, Persistence
from plait.ir.diagnosis import Diagnosis, Finding

__all__ = ["DoctorConfig", "Persistence", "Thresholds", "diagnose", "diagnose_records", "read_run", "link_matrix"]

# Most severe first: a wrong or skipped call and a dead rank explain the hangs and errors after them.
_ORDER = ("mismatch", "comm_hang", "dead_rank", "noncomm_hang", "slow_rank", "slow_link")


_STALLS = ("comm_hang", "noncomm_hang", "dead_rank", "mismatch")


def diagnose_records(run: RunRecords, *, live: bool = False, thresholds: Thresholds | None = None) -> Diagnosis:
    """Every detector over already-read records (`read_run`). Independent faults are all reported:
    slowness is judged on the steps whole before a stall's onset (the steps after it are cut
    short), so a slow rank beside a dead one is named too. Each finding's `evidence["explains"]`
    says which symptom it accounts for."""
    th = thresholds or Thresholds()
    found: list[Finding] = []
    found += mismatches(run)
    found += calls_not_joined(run)
    found = _with_deaths(found, dead_ranks(run, th, live))
    if not found:  # a stall after a mismatch, a skipped call or a dead rank is their consequence
        found += hangs(run, th, live)
    if not found:  # a stall the run went on after (a rank stopped, then resumed)
        found += past_stalls(run, th)
    onset = min((f.first_seen_s for f in found if f.kind in _STALLS and not f.evidence.get("resumed")), default=None)
    whole = min(onset, run.t_obs) if live and onset is not None else run.t_obs if live else onset
    found += slow_ranks(run, th, before=whole)  # live: a rank's step in progress is not whole
    found += slow_links(run, th, before=onset, work_before=whole)
    found = [_explained(f, onset) for f in found]
    found, lowered = _confidence(run, found)
    found.sort(key=lambda f: (_ORDER.index(f.kind), f.first_seen_s))
    return Diagnosis(run_dir=run.run_dir, findings=found, world_size=run.world,
                     warnings=list(run.warnings) + lowered + contention_notes(run, th))


# Findings that rest on a rank's communication records: a cut or damaged file's missing lines read
# as a call never entered (a skip, a mismatch) or as a step's work cut short or stretched (a slow
# rank or link on the bench's cut copies), so none naming that rank is evidence enough. A dead
# rank rests on its exit record and heartbeat, not on those lines.
_RECORDS_ONLY = ("comm_hang", "mismatch", "noncomm_hang", "slow_rank", "slow_link")



def _library_ending(ended: object) -> bool:
    """Whether a dead rank's ending (`dead_rank` evidence "ended": its signal, its own error, or
    "process gone" when only a vanished pid says so) is one a collective library gives a process on
    a call it cannot complete: an abort (gloo's failed enforce is SIGABRT), a memory fault of its own
    (SIGSEGV, SIGBUS: a message of another size copied into a buffer -- a DTensor rank of the injection
    suite ended so after a peer's mismatched call) or an error raised in the rank -- not a signal from
    outside (SIGKILL, SIGTERM, ...) nor an unknown end."""
    text = str(ended or "")
    return text in ("SIGABRT", "SIGSEGV", "SIGBUS") or not (text.startswith("SIG") or text in ("", "process gone"))


def _confidence(run: RunRecords, found: list[Finding]) -> tuple[list[Finding], list[str]]:
    """Lower the confidence of what rests on a damaged records file (cut or unreadable lines):
    a finding naming that rank (or naming none, every member waiting), or a hang beside it whose
    stall began after that rank's readable lines end, that rests on its records becomes a warning
    that says so, not a finding; so does a rank the collective library ended
    (an abort or an error, not a signal from outside) beside any damaged file, as the lost lines may
    hold the mismatched call it answered; a rank killed from outside keeps `evidence["confidence"] =
    "low"` and the file's damage."""
    damaged = {r: rr.damaged for r, rr in run.ranks.items() if rr.damaged}
    if not damaged:
        return found, []
    kept, lowered = [], []
    for f in found:
        on = [r for r in (f.ranks or tuple(damaged)) if r in damaged]
        if not on and f.kind in ("comm_hang", "noncomm_hang"):
            # who holds a stalled call is read off every member's enter lines: a culprit named beside
            # a damaged member (of the stalled call, or waiting) whose readable lines end before the
            # stall rests on that member's lost lines too (issue 32, seed 9700: rank 0's file cut at
            # 70 % hid its skip, and rank 1 was named); a last line cut as a rank was killed leaves
            # its entry into the stall readable
            seen = {int(r) for r in (*f.evidence.get("members", []), *f.evidence.get("waited_s", {}),
                                     *f.evidence.get("entered", []))}
            on = sorted(r for r in seen if r in damaged and _last_seen(run, r) < f.first_seen_s)
        if f.kind == "dead_rank" and _library_ending(f.evidence.get("ended")):
            # a process the collective library ended (an abort, an error) may answer a mismatched
            # call the damaged lines held (`_with_deaths`): not reported as a fault of its own
            lowered.append(f"low confidence, not reported: dead_rank of ranks {list(f.ranks)} (ended: "
                           f"{f.evidence.get('ended')}) may follow a call lost with the damaged records of "
                           f"rank(s) {sorted(damaged)}: " + "; ".join(damaged[r][0] for r in sorted(damaged)))
            continue
        if not on:
            kept.append(f)
        elif f.kind in _RECORDS_ONLY:
            lowered.append(f"low confidence, not reported: {f.kind} of ranks {list(f.ranks)} "
                           f"({f.collective or ''}) rests on the damaged records of rank(s) {on}: "
                           + "; ".join(damaged[r][0] for r in on))
        else:
            kept.append(replace(f, evidence={**f.evidence, "confidence": "low",
                                             "damaged": {str(r): damaged[r] for r in on}}))
    return kept, lowered



def _last_seen(run: RunRecords, r: int) -> float:
    """The last time rank `r`'s readable records show (a call's end or an enter line)."""
    rr = run.ranks[r]
    return max([c.t_end for c in rr.records] + [e.t for e in rr.enters], default=0.0)


def _with_deaths(found: list[Finding], deaths: list[Finding]) -> list[Finding]:
    """`found` and the dead ranks a mismatched call among them does not explain. A collective
    library answers a call whose members disagree on its size by ending processes: gloo aborts the
    rank that receives the wrong size (SIGABRT: "Received data size doesn't match expected size")
    and its peers then fail on the closed connections -- deaths at or after the mismatch are its
    consequences, not faults (seen on the doctor's injection suite once torch's modules ran the
    plans, issue 32). A rank killed from outside (SIGKILL, SIGTERM, ...) stays a dead rank of its
    own. The first mismatch names the deaths it explains (`evidence["caused_deaths"]`)."""
    mismatched = [f for f in found if f.kind == "mismatch"]
    if not mismatched:
        return found + deaths
    first = min(mismatched, key=lambda f: f.first_seen_s)
    caused = [d for d in deaths if d.first_seen_s >= first.first_seen_s and _library_ending(d.evidence.get("ended"))]
    if caused:
        found = [replace(f, evidence={**f.evidence, "caused_deaths": sorted(r for d in caused for r in d.ranks)})
                 if f is first else f for f in found]
    return found + [d for d in deaths if d not in caused]


def _explained(f: Finding, onset: float | None) -> Finding:
    """The symptom a finding accounts for, in words (the report's "which explains what")."""
    if f.kind in _STALLS:
        why = f"the job's stall from {f.first_seen_s:.3f} s (peers' waits in the calls after it)"
    elif f.kind == "slow_rank":
        why = f"its peers' waits for it in steps {f.evidence.get('slow_steps')} (slow steps, not a stall)"
    else:
        why = f"slow transfers between ranks {f.ranks[0]} and {f.ranks[1]} in steps {f.evidence.get('slow_steps')}"
    ev = {**f.evidence, "explains": why}
    if f.kind not in _STALLS and onset is not None:
        ev["judged_before_s"] = onset  # an independent fault: found on the steps before the stall
    return replace(f, evidence=ev)


def diagnose(run_dir: str | Path, *, live: bool = False, thresholds: Thresholds | None = None) -> Diagnosis:
    """Read `run_dir` (a run folder with `comm/rankN.jsonl`, heartbeats, exit records) and name
    what is wrong. `live`: the run is still going -- silence up to now counts (a hang shows
    before the launcher's timeout) and a heartbeat whose process is gone is a dead rank.
    A corrupt or cut record line is skipped and named in `Diagnosis.warnings`."""
    return diagnose_records(read_run(run_dir, live=live), live=live, thresholds=thresholds)
