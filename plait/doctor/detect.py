"""The doctor's detectors: plain functions over one `RunRecords`, each returning `Finding`s.

After C4D (Dong et al., HPCA'25, §4): collective communication is periodic and the same on
every rank, so a fault shows as one rank or one rank pair that deviates from its peers and
from its own history. Every threshold is a ratio (to the rank's own steps, to its peers, to
the run's median step time), never seconds tuned to one machine.

* `calls_not_joined` / `mismatches` -- Flight Recorder's matching, on enter lines: a call
  (group, sequence number) that some members entered and one member passed by (it entered a
  later call of that group, or a call of a later step) is a skipped collective (a
  communication hang with a known culprit); members that entered it with a different op or
  size are a mismatch.
* `dead_ranks` -- a rank's process ended (exit record: signal or error of its own, not a
  peer's) before the job stalled; live, a heartbeat whose process is gone.
* `hangs` -- no progress (no call ended, no heartbeat progress of a rank at work) for
  `stall_steps` median steps, once a step has completed: the earliest call still waited on
  names the members that never entered it; one waiting elsewhere is a communication hang,
  one outside any call (or whose heartbeat stopped: SIGSTOP) a non-communication hang.
* `slow_ranks` -- per step, a rank's local work (time between its calls: compute, never
  waiting) against min(its own steady level, its same-stage peers' level) -- C4D's
  non-communication slow.
* `slow_links` -- per step, each rank pair's link-probe transfer time (the facade's probes:
  `plait.runtime.comm.Comm.probe_links`, the fastest of a step's exchanges per pair (before
  and after the step's work), each timed from the later of the two arrivals) against min(its own level, the level of pairs of its kind) -- one cell of the
  rank x rank matrix (C4D's communication slow). Against its own level, the pair's level is
  first raised by how much both of its ranks' local work rose that step: CPU contention slows
  compute and transfers alike, a slow link only the link (the only reference a lone pair has).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

from plait.doctor.folder import RunRecords, pid_alive
from plait.ir.diagnosis import Finding

# Ops whose payload legitimately differs between ranks (pickled objects, uneven gathers).
_SIZE_FREE = ("all_gather_object", "gather_object", "broadcast_object", "barrier", "gather")
PROBE_KEY = "probe"
# Heartbeat phases that may legitimately take longer than steps (plait.runtime.launch.STARTUP_PHASES).
_LONG_PHASES = ("start", "init", "build", "resume", "checkpoint")


@dataclass(frozen=True)
class Thresholds:
    """Frozen before the injection suite's final run (bench/doctor.py); all relative."""

    slow_rank_ratio: float = 1.3
    """A step's local work must be this many times the rank's reference to count as slow."""
    slow_link_ratio: float = 1.35
    """A probe's transfer time must be this many times the pair's reference to count as slow."""
    min_excess_of_step: float = 0.03
    """...and exceed the reference by this fraction of the run's median step time (slow rank)."""
    min_hits: int = 3
    """Slow steps needed before a rank is named (a slow rank stays slow, or slow every k-th step)."""
    min_hit_fraction: float = 0.75
    """Of the slow steps the pattern predicts from the first one on (every step, or every k-th where
    k is the hits' median spacing), at least this fraction must be slow: noise is not periodic."""
    link_min_hits: int = 3
    """Slow probes needed before a link is named."""
    link_min_hit_fraction: float = 0.75
    """The same for a link's probes."""
    lone_link_min_hits: int = 4
    """A lone pair (2 ranks: no peers' rate of noise) is named only after this many slow probes in
    an unbroken run: a slow link stays slow, while a loaded machine's latency spikes break off (a
    clean 2-rank run under a busy CI machine read slow at steps 4, 6 and 7 of 8: three of the four
    probes from the first, the peers' test's fraction, and a slow link was named)."""
    stall_steps: float = 4.0
    """No call ended for this many median step times: the job is stalled (a hang)."""
    stall_floor_s: float = 1.0
    """...and for at least this long (the heartbeat period is 0.2 s)."""
    hb_stale_s: float = 1.0
    """A heartbeat this much older than the freshest one: the process stopped (SIGSTOP)."""
    rank_min_excess_s: float = 0.005
    """A slow step's local work must also exceed its reference by this many seconds: a finding
    needs an effect, not only a ratio."""
    link_min_excess_s: float = 0.002
    """A slow probe must exceed its reference by this many seconds (same for a node's uplink)."""
    probe_latency_s: float = 0.0005
    """The probe floor: no probe time below latency + bytes / `probe_floor_bw` is judged by a ratio
    (a same-node probe of a fraction of a millisecond is noise, whatever its ratio)."""
    probe_floor_bw: float = 10e9
    """Bytes per second of the fastest link the floor allows for (a probe's size sets its floor)."""
    link_noise_alpha: float = 1e-3
    """A link's slow probes must be this improbable as chance (divided among the pairs judged):
    the binomial tail of its slow probes among those its pattern expects, at the rate at which
    its peers' probes read as slow (a loaded machine's latency spikes hit every pair). Three
    spikes in four probes of one of 6 pairs are likely where 1 probe in 18 spikes (a clean tp=4
    --recover run named such a pair live); three slow probes in three on a quiet run are not.
    A lone pair (2 ranks) has no peers' rate: its own scatter sets its margin instead."""
    contention_cores: float = 0.5
    """A host is contended at a step where the CPU that *other* processes took on it (the host's
    busy CPU less the job's ranks' own, `host_contention`) rose this many cores above its steady
    level: its ranks' link probes of that step are not judged (a busy loop beside a rank slowed
    its probes 5x with no link at fault, while its sleep-padded compute did not move)."""
    contention_probe_s: float = 0.010
    """...unless a probe of a contended step exceeds `slow_link_ratio` x its pair's level (every
    step's probe counts for the level: contention only slows one) by more than this many seconds:
    then it is judged (a 30 ms link delay under a bursty 2-process busy loop was dropped with its
    contended steps and went unnamed, 2 of 8 runs). Contention delays a probe by the time its
    process waits to run: busy loops beside the ranks added at most 3.6 ms to clean probes here
    (0.4-0.6 ms each); the allowance is ~3x that."""


@dataclass
class _Entry:
    op: str
    bytes: int
    t: float
    t_end: float | None
    step: int | None
    key: str | None


def _members(run: RunRecords, rank: int, group: str) -> tuple[int, ...]:
    if group.startswith("p2p "):
        a, _, b = group[4:].partition("->")
        return tuple(sorted((int(a), int(b))))
    ranks = run.ranks[rank].groups.get(group)
    if ranks is None and group == "world":
        ranks = list(range(run.world))
    return tuple(sorted(ranks)) if ranks is not None else (rank,)


def _instances(run: RunRecords) -> dict[tuple[str, tuple[int, ...], int], dict[int, _Entry]]:
    """(group, members, seq) -> rank -> what the rank entered (and when it ended, if it did).
    A point-to-point link's entries are keyed by op too (send at the source, recv at the sink)."""
    out: dict[tuple[str, tuple[int, ...], int], dict[int, _Entry]] = defaultdict(dict)
    for r, rr in run.ranks.items():
        for e in rr.enters:
            out[(e.group, _members(run, r, e.group), e.seq)][r] = _Entry(e.op, e.bytes, e.t, None, e.step, e.key)
        for c in rr.records:
            k = (c.group, _members(run, r, c.group), c.seq)
            prev = out[k].get(r)
            out[k][r] = _Entry(c.op, c.bytes, prev.t if prev else c.t_enqueue, c.t_end, c.step, c.key)
    return out


def step_time(run: RunRecords) -> float:
    """The run's median step time: per step, first call entered to last call ended, over ranks."""
    lo: dict[int, float] = {}
    hi: dict[int, float] = {}
    for rr in run.ranks.values():
        for c in rr.records:
            if c.step is not None:
                lo[c.step] = min(lo.get(c.step, c.t_enqueue), c.t_enqueue)
                hi[c.step] = max(hi.get(c.step, c.t_end), c.t_end)
    spans = [hi[s] - lo[s] for s in sorted(lo) if s + 1 in lo]  # complete steps (the next one began)
    if not spans:
        spans = [hi[s] - lo[s] for s in lo]
    return statistics.median(spans) if spans else 0.0


def _finding(kind: str, ranks: tuple[int, ...], first: float, detected: float, run: RunRecords,
             step: int | None = None, collective: str | None = None, **evidence: Any) -> Finding:
    nodes = tuple(dict.fromkeys(str(run.ranks[r].info.get("host")) for r in ranks
                                if r in run.ranks and run.ranks[r].info.get("host") is not None))
    return Finding(kind=kind, ranks=tuple(sorted(ranks)), first_seen_s=round(first, 6), step=step,
                   collective=collective, evidence=evidence, nodes=nodes, detected_s=round(detected, 6))


# ---------------------------------------------------------------------------------- matching
def _past(run: RunRecords, rank: int, group: str, members: tuple[int, ...], seq: int, step: int | None,
          entered: float | None = None) -> float | None:
    """When `rank` entered a call after (group, seq) in program order: a later seq of the same
    group, any call of a later step, or a link probe of the same step entered after the call was
    first `entered` -- the step's own probes before its work end at a barrier of every rank, so
    a probe of the step begun after a peer entered one of the step's calls is its after-work
    probe. None: it has not (it is behind, stuck or dead)."""
    rr = run.ranks.get(rank)
    if rr is None:
        return None
    times = [e.t for e in rr.enters if (
        (e.group == group and _members(run, rank, e.group) == members and e.seq > seq)
        or (step is not None and e.step is not None and e.step > step)
        or (entered is not None and e.key == PROBE_KEY and e.step == step and e.t > entered))]
    times += [c.t_enqueue for c in rr.records if (
        (c.group == group and _members(run, rank, c.group) == members and c.seq > seq)
        or (step is not None and c.step is not None and c.step > step))]
    return min(times) if times else None


def calls_not_joined(run: RunRecords) -> list[Finding]:
    """Members that passed by a call their peers entered: the skipped collective (comm hang)."""
    out: dict[int, Finding] = {}
    for (group, members, seq), entries in sorted(_instances(run).items(), key=lambda kv: min(
            e.t for e in kv[1].values())):
        if len(members) < 2:
            continue
        first = min(e.t for e in entries.values())
        step = min((e.step for e in entries.values() if e.step is not None), default=None)
        for m in members:
            if m in entries or m in out or m not in run.ranks:
                continue
            # A probe's peer busy with the round's other probes has not passed it by: for a probe,
            # only a later seq or a later step is past it (probe rounds are not skipped calls).
            # Nor for a barrier: the probe rounds end at one, which peers done with their probes
            # enter while a rank still exchanges its last ones (an injected skip is never a barrier).
            probe = any(e.key == PROBE_KEY or e.op == "barrier" for e in entries.values())
            t_past = _past(run, m, group, members, seq, step, None if probe else first)
            if t_past is None:
                continue
            waited = {r: round((e.t_end if e.t_end is not None else run.t_obs) - e.t, 6) for r, e in entries.items()}
            out[m] = _finding("comm_hang", (m,), first, max(first, t_past), run, step=step,
                              collective=f"{next(iter(entries.values())).op} {group} seq {seq}",
                              reason=f"rank {m} never entered this call, which ranks {sorted(entries)} entered, "
                                     f"and went on to later calls", entered=sorted(entries), waited_s=waited,
                              ended=[r for r, e in entries.items() if e.t_end is not None])
    return list(out.values())


def mismatches(run: RunRecords) -> list[Finding]:
    """Members that entered one call (group, seq) with a different op or size."""
    out: list[Finding] = []
    seen: set[int] = set()
    history: dict[tuple[int, str], list[tuple[str, int]]] = defaultdict(list)
    for (group, _, seq), entries in sorted(_instances(run).items(), key=lambda kv: kv[0][2]):
        p2p = group.startswith("p2p ")
        sig = {r: (("p2p" if p2p else e.op), -1 if e.op in _SIZE_FREE else e.bytes) for r, e in entries.items()}
        if len(set(sig.values())) > 1:
            counts: dict[tuple[str, int], int] = defaultdict(int)
            for s in sig.values():
                counts[s] += 1
            top = max(counts.values())
            odd = [r for r, s in sig.items() if counts[s] < top]
            if not odd:  # a tie (two ranks): the one whose call is new to its own history of this group
                odd = [r for r, s in sig.items() if s not in history[(r, group)]]
                if len(odd) == len(sig):
                    odd = []
            culprits = tuple(r for r in odd if r not in seen)
            if culprits or not odd:
                first = min(e.t for e in entries.values())
                step = min((e.step for e in entries.values() if e.step is not None), default=None)
                out.append(_finding("mismatch", culprits, first, max(e.t for e in entries.values()), run, step=step,
                                    collective=f"{group} seq {seq}",
                                    entered={str(r): {"op": e.op, "bytes": e.bytes, "key": e.key}
                                             for r, e in sorted(entries.items())}))
                seen.update(culprits)
                if not culprits:
                    break
        for r, s in sig.items():
            history[(r, group)].append(s)
    return out


# ---------------------------------------------------------------------------------- death, hangs
def _death(run: RunRecords, r: int, live: bool) -> float | None:
    """When rank `r`'s process ended of its own fault (signal other than SIGTERM, or its own error);
    a signal from outside after the launcher recorded its stop of the job (`RunRecords.stopped`) is
    that stop."""
    rr = run.ranks[r]
    status = rr.status or {}
    if status.get("state") == "terminated" or status.get("peer_error"):
        return None
    ex = rr.exit or {}
    t = ex.get("time")
    if run.stopped is not None and ex.get("signal") in ("SIGKILL", "SIGTERM") and isinstance(t, int | float) \
            and t - run.t0_wall >= run.stopped.t:
        return None  # killed in the launcher's stop of the whole job (its hang or watch verdict)
    own_error = status.get("state") == "error"
    if ex and (ex.get("signal") not in (None, "SIGTERM") or (ex.get("exitcode") or 0) > 0 and own_error):
        return t - run.t0_wall if isinstance(t, int | float) and run.wall_clock else \
            max((c.t_end for c in rr.records), default=0.0)
    if own_error:
        t = status.get("time")
        return t - run.t0_wall if isinstance(t, int | float) and run.wall_clock else \
            max((c.t_end for c in rr.records), default=0.0)
    hb = rr.heartbeat or {}
    if live and not rr.done and hb.get("pid") and not pid_alive(hb["pid"]) and not ex:
        return rr.hb_written if rr.hb_written is not None else run.t_obs
    return None


def _progress_end(run: RunRecords) -> float:
    """The last progress the folder shows: the last call that ended or, where the records are on
    the heartbeats' (Unix) clock, the last progress a heartbeat reported from a rank at work (not
    blocked in a call, not ended): a rank that computes alone -- a 1-rank run, a long pipeline
    stage -- ends no call for a while and is not stalled (the launcher's rule too)."""
    end = max((c.t_end for rr in run.ranks.values() for c in rr.records), default=0.0)
    if run.wall_clock:
        for rr in run.ranks.values():
            hb = rr.heartbeat or {}
            t = hb.get("progress")
            if isinstance(t, int | float) and not rr.done and not hb.get("waiting") and hb.get("phase") != "error":
                end = max(end, min(float(t) - run.t0_wall, run.t_obs))
    # The end of a marked pause (a checkpoint written) is progress: silence is counted from it.
    return max([end] + [e for rr in run.ranks.values() for *_, e in rr.pauses if e is not None and e <= run.t_obs])


def _paused(run: RunRecords, a: float, b: float) -> float:
    """Seconds of [a, b] covered by some rank's marked pause (the union over ranks)."""
    spans = sorted((max(a, p[2]), min(b, p[3] if p[3] is not None else b)) for rr in run.ranks.values()
                   for p in rr.pauses)
    total, reach = 0.0, a
    for lo, hi in spans:
        lo = max(lo, reach)
        if hi > lo:
            total += hi - lo
            reach = hi
    return total


def stall(run: RunRecords, th: Thresholds) -> tuple[float, float] | None:
    """(last progress, stall threshold) when the job stalled: no progress (`_progress_end`) for
    the threshold while some rank had not finished; None otherwise. The threshold is the doctor's
    own (`stall_steps` steps), or the silence up to the launcher's recorded stop for a hang when that
    came first (`RunRecords.stopped`)."""
    if all(rr.done for rr in run.ranks.values()) and len(run.ranks) >= run.world:
        return None
    if any((rr.heartbeat or {}).get("phase") in _LONG_PHASES for rr in run.ranks.values() if not rr.done):
        return None  # a rank is starting up or writing a checkpoint: silence there is not a step's
    if any(e is None for rr in run.ranks.values() if not rr.done for *_, e in rr.pauses):
        return None  # a marked pause still going (the runtime's own marker, plait.runtime.recorder)
    end = _progress_end(run)
    # The launcher found no progress for its timeout (the user's) and stopped the job: the stall
    # lasted to the stop, and its cause is what the records hold -- also where that came before the
    # doctor's own limit (steps of 2.2 s on a loaded machine made it 8.8 s, beside a 6 s timeout)
    # or before a step had completed to measure one by.
    by_launcher = run.stopped.t - end if run.stopped is not None and run.stopped.kind == "hang" \
        and run.stopped.t >= end + th.stall_floor_s else None
    steps = {c.step for rr in run.ranks.values() for c in rr.records if c.step is not None}
    if not any(s + 1 in steps for s in steps):  # no step completed yet (the first one warms up)
        limit = by_launcher  # no step length to judge silence by: only the launcher's verdict
    else:
        limit = min(max(th.stall_floor_s, th.stall_steps * step_time(run)), by_launcher or float("inf"))
    return (end, limit) if limit is not None and run.t_obs - end >= limit else None


def _longest_silence(run: RunRecords, start: int) -> float | None:
    """The median over steps (after `start`) of a step's longest silence: the longest gap between two
    consecutive call ends (any rank) that ends in it. A step of many calls (tensor parallelism's
    collectives) is silent far less than a step long (clean runs of the injection suite: 0.03-0.25 s
    in steps of 0.2-1.4 s)."""
    ends = sorted((c.t_end, c.step) for rr in run.ranks.values() for c in rr.records if c.step is not None)
    longest: dict[int, float] = {}
    for (a, _), (b, sb) in zip(ends, ends[1:]):
        if sb > start:
            longest[sb] = max(longest.get(sb, 0.0), b - a)
    return statistics.median(longest.values()) if longest else None


def past_stalls(run: RunRecords, th: Thresholds) -> list[Finding]:
    """Stalls the run went on after: no call ended anywhere for `stall_steps` times a step's usual
    longest silence (`_longest_silence`; at most a median step) and `stall_floor_s`, then training
    resumed (a 2.2 s stop of a rank went unnamed in tensor-parallel runs of 1.1 s steps, whose
    silences are 0.04 s: a limit of four steps is for a stall in progress, `stall`). The rank held elsewhere is the one that entered its
    next call last (its peers entered theirs and waited for it): a `noncomm_hang` with
    `evidence["resumed"]`, its duration and step. The first step (start-up) is not judged. A wait
    that the runtime's pause markers (`RankRun.pauses`: a checkpoint write, a restart's load, an
    evaluation) cover down to less than the limit is a pause on purpose, not a stall; without
    markers (older folders), a wait no rank spent inside a call is read as one too."""
    med = step_time(run)
    if med <= 0:
        return []
    first = {r: min((c.step for c in rr.records if c.step is not None), default=None) for r, rr in run.ranks.items()}
    start = max((s for s in first.values() if s is not None), default=0)
    limit = max(th.stall_floor_s, th.stall_steps * min(med, _longest_silence(run, start) or med))
    ends = sorted(c.t_end for rr in run.ranks.values() for c in rr.records if c.step is not None and c.step > start)
    out = []
    for a, b in zip(ends, ends[1:]):
        if b - a < limit or b - a - _paused(run, a, b) < limit:
            continue  # short, or a marked pause (a checkpoint write, an evaluation) covers the wait
        # Each rank's next call after its own last call that ended by `a`: a peer entered its next
        # call (and waited there) right after; the held rank only once it was let go.
        last = {r: max((c.t_end for c in rr.records if c.t_end <= a), default=None) for r, rr in run.ranks.items()}
        nxt = {r: min(((c.t_enqueue, c.step) for c in rr.records if c.t_enqueue >= last[r]), default=None)
               for r, rr in run.ranks.items() if last[r] is not None}
        nxt = {r: v for r, v in nxt.items() if v is not None}
        if not nxt:
            continue
        r = max(nxt, key=lambda k: nxt[k][0])  # type: ignore[index]
        t_in, step = nxt[r]  # type: ignore[misc]
        if min(v[0] for v in nxt.values()) > a + (b - a) / 2:
            continue  # nobody waited in a call: every rank paused together (a checkpoint, evaluation)
        out.append(_finding("noncomm_hang", (r,), a, a + limit, run, step=step, resumed=True,
                            stalled_s=round(b - a, 3), expected_step_s=round(med, 6),
                            reason=f"no call ended for {b - a:.2f} s ({(b - a) / med:.0f} median steps); rank {r} "
                                   f"entered its next call last, {t_in - a:.2f} s after, and the run went on"))
    return out


def dead_ranks(run: RunRecords, th: Thresholds, live: bool = False) -> list[Finding]:
    st = stall(run, th)
    out = []
    for r in sorted(run.ranks):
        t = _death(run, r, live)
        if t is None or (st is not None and t > st[0] + st[1]):
            continue  # ended after the job had stalled: the launcher stopped it, not a cause
        rr = run.ranks[r]
        last = rr.records[-1] if rr.records else None
        how = (rr.exit or {}).get("signal") or (rr.status or {}).get("error") or "process gone"
        out.append(_finding("dead_rank", (r,), t, t, run, step=(rr.heartbeat or {}).get("step", last.step if last else None),
                            ended=how, last_call=(f"{last.op} {last.group} seq {last.seq}" if last else None),
                            last_call_end_s=round(last.t_end, 6) if last else None))
    return out


def _pending(run: RunRecords, r: int) -> list[Any]:
    rr = run.ranks[r]
    done = {(c.group, c.seq, c.op) for c in rr.records}
    return [e for e in rr.enters if (e.group, e.seq, e.op) not in done]


def hangs(run: RunRecords, th: Thresholds, live: bool = False) -> list[Finding]:
    """A stalled job: who the earliest call still waited on is waiting for, and where that rank is."""
    st = stall(run, th)
    if st is None:
        return []
    end, limit = st
    detected = end + limit
    deaths = {r: _death(run, r, live) for r in run.ranks}
    dead = {r for r, t in deaths.items() if t is not None and t <= end + limit}  # later: the launcher's kill
    fresh = max((rr.hb_written for rr in run.ranks.values() if rr.hb_written is not None), default=None)
    stopped = {r for r, rr in run.ranks.items() if fresh is not None and rr.hb_written is not None
               and fresh - rr.hb_written > th.hb_stale_s and not rr.done}
    pend = {r: _pending(run, r) for r in run.ranks}
    waiting = [(e, r) for r, es in pend.items() for e in es]
    if not waiting:  # nobody inside a call: the ranks outside are stuck (or the file has no enter lines)
        culprits = tuple(r for r, rr in run.ranks.items() if not rr.done and r not in dead
                         and not (rr.heartbeat or {}).get("waiting"))
        return [_finding("noncomm_hang", culprits, end, detected, run, stalled_for_s=round(run.t_obs - end, 3),
                         reason="no call ended and no rank is inside a call")] if culprits else []
    # A rank waiting in a link probe waits on a peer held elsewhere: the training calls tell who holds
    # it (a rank that skipped a collective reaches its after-step probe before a slow peer enters
    # the collective it skipped); probes are the evidence only when nothing else is waited on.
    e0, r0 = min([er for er in waiting if er[0].key != PROBE_KEY] or waiting, key=lambda er: er[0].t)
    members = _members(run, r0, e0.group)
    entered = {r for r, es in pend.items() for e in es if e.group == e0.group and e.seq == e0.seq
               and _members(run, r, e.group) == members}
    entered |= {r for r in members if r in run.ranks and any(c.group == e0.group and c.seq == e0.seq
                                                             for c in run.ranks[r].records)}
    missing = [m for m in members if m not in entered and m not in dead]
    coll = f"{e0.op} {e0.group} seq {e0.seq}"
    waited = {r: round(run.t_obs - min(e.t for e in es), 3) for r, es in pend.items() if es}
    if not missing:
        return [_finding("comm_hang", (), e0.t, detected, run, step=e0.step, collective=coll, waited_s=waited,
                         members=sorted(members),
                         reason="every member entered the call and none finished it (a link or NIC)")]
    out = []
    for m in missing:
        where = pend.get(m) or []
        in_comm = bool((run.ranks[m].heartbeat or {}).get("waiting")) if m in run.ranks else False
        if m in stopped or not (where or in_comm):
            why = "its heartbeat stopped (process stopped)" if m in stopped else \
                f"it is outside any call ({(run.ranks[m].heartbeat or {}).get('phase', 'unknown phase')})"
            out.append(_finding("noncomm_hang", (m,), end, detected, run, step=e0.step, collective=coll,
                                waited_s=waited, members=sorted(members),
                                reason=f"rank {m} never entered {coll}: {why}"))
        else:
            inside = f"{where[0].op} {where[0].group} seq {where[0].seq}" if where else \
                f"'{(run.ranks[m].heartbeat or {}).get('waiting')}'"
            out.append(_finding("comm_hang", (m,), end, detected, run, step=e0.step, collective=coll,
                                waited_s=waited, members=sorted(members),
                                reason=f"rank {m} never entered {coll}; it waits in {inside}"))
    return out


# ---------------------------------------------------------------------------------- slowness
def _steady(values: dict[int, float]) -> float | None:
    """A series' steady level: the smallest mean of two consecutive steps (robust to one fast or
    slow step; needs two clean steps in a row)."""
    steps = sorted(values)
    pairs = [(values[a] + values[b]) / 2 for a, b in zip(steps, steps[1:]) if b == a + 1]
    if pairs:
        return min(pairs)
    return min(values.values()) if values else None


def local_work(run: RunRecords) -> dict[int, dict[int, tuple[float, float, float]]]:
    """rank -> step -> (seconds of local work, step start, time the step's last call was entered).

    The work between two calls belongs to the step of the call before it (the optimizer step after
    a step's last collective is that step's work), or of the call after it when the one before
    belongs to no step (start-up): the same attribution whether or not the step ends with calls
    of its own (the link probes of a probed step)."""
    out: dict[int, dict[int, tuple[float, float, float]]] = {}
    for r, rr in run.ranks.items():
        calls = sorted({(c.t_enqueue, c.t_end, c.step) for c in rr.records}, key=lambda c: c[0])
        per: dict[int, list[float]] = {}
        prev_end, prev_step = None, None
        for t_enq, t_end, step in calls:
            if step is not None:
                w = per.setdefault(step, [0.0, t_enq, t_enq])
                w[1], w[2] = min(w[1], t_enq), max(w[2], t_enq)
            owner = prev_step if prev_step is not None else step
            if owner is not None and prev_end is not None:
                # A marked pause (a checkpoint write) between the calls is not the step's work.
                gap = max(0.0, t_enq - prev_end) - _in_pauses(rr.pauses, prev_end, t_enq)
                per.setdefault(owner, [0.0, t_enq, t_enq])[0] += max(0.0, gap)
            prev_end = t_end if prev_end is None else max(prev_end, t_end)
            prev_step = step
        out[r] = {s: (v[0], v[1], v[2]) for s, v in per.items()}
    return out


def _in_pauses(pauses: list[tuple[str, Any, float, float | None]], a: float, b: float) -> float:
    """Seconds of [a, b] inside one rank's own marked pauses (they do not overlap each other)."""
    return sum(max(0.0, min(b, e if e is not None else b) - max(a, lo)) for _, _, lo, e in pauses)


def _flags(series: dict[Any, dict[int, float]], peers: dict[Any, list[Any]], ratio: float, floor: float,
           min_hits: int, fraction: float, scale: dict[Any, dict[int, float]] | None = None,
           periodic: bool = True, alpha: float | None = None,
           levels: dict[Any, float | None] | None = None,
           lone_run: int | None = None,
           reference: dict[Any, dict[int, float]] | None = None) -> dict[Any, tuple[list[int], float, int]]:
    """Who is slow: item -> (its slow steps, its reference), for items with enough slow steps.

    A step is slow when the item exceeds `ratio` x its own steady level *and* `ratio` x the
    median of its peers at that same step (a machine-wide hiccup slows the peers too); an item
    slow from its first step on (its own level already `ratio` x its peers') is judged against
    its peers alone. Without peers, its own history alone, and a step must also exceed it by three
    median absolute deviations of the series (a lone item cannot tell noise from its peers').
    `scale`: item -> step -> factor (>= 1) by which the item's own level is expected to have risen
    that step for a reason other than a fault of its own (the ranks' compute rose: contention).
    `alpha`: an item with peers is named only if its slow steps are improbable as chance -- the
    binomial tail (`_chance`) at its peers' pooled rate of slow steps (half a slow step added)
    below `alpha` / the number of items judged (Bonferroni: every pair is tested; a 4-rank run
    has 6); None: not tested. Returns item -> (slow steps, reference, how many of the slow steps
    it took to name it). `levels`: item -> its steady level where the series holds steps that
    must not set it (`slow_links`' contended steps). `lone_run`: an item without peers is named only
    for an unbroken run of this many slow steps (of its series' steps), from the run's first.
    `reference`: item -> step -> value its peers are compared with where their series lack the
    step (`slow_links`' contended steps: upper bounds of the link's time)."""
    own = {k: (levels or {}).get(k) or _steady(dict(ser)) for k, ser in series.items()}
    found = {k: _hits(k, series, peers, own, ratio, floor, scale, reference) for k in series}
    out = {}
    for k, ser in series.items():
        hits = found[k]
        if hits is None:
            continue
        ps = [p for p in peers.get(k, []) if own.get(p)]
        peer_level = statistics.median(own[p] for p in ps) if ps else None  # type: ignore[type-var]
        ref = peer_level if _always_slow(k, series, ps, own[k], peer_level, ratio) else own[k]  # type: ignore[arg-type]
        if lone_run is not None and not ps:
            run = _unbroken_run(sorted(ser), set(hits), lone_run)
            if run:
                out[k] = (run, ref, lone_run)  # type: ignore[assignment]
            continue
        # A leading hit further from the next than the hits are from each other is noise before
        # the onset (a fault that began stays periodic: every step, or every k-th).
        while len(hits) > min_hits and hits[1] - hits[0] > statistics.median(
                b - a for a, b in zip(hits[1:], hits[2:])):
            hits = hits[1:]
        if len(hits) < min_hits:
            continue
        # The pattern: every k-th step from the first hit, k the hits' median spacing. Only hits on
        # it count (scattered noise has a median spacing too, but does not fall on its grid).
        period = max(1, round(statistics.median(b - a for a, b in zip(hits, hits[1:])))) if periodic else 1
        on = [s for s in hits if (s - hits[0]) % period == 0]
        expected = sum(1 for s in ser if s >= hits[0] and (s - hits[0]) % period == 0)
        if len(on) >= min_hits and len(on) >= fraction * expected:
            named = min_hits  # the hits it took: min_hits, or more where chance must be ruled out
            if alpha is not None and ps:
                # the peers' pooled rate of slow steps, half a hit and a step added (never 0)
                rate = (sum(len(found[p] or ()) for p in ps) + 0.5) / (sum(len(series[p]) for p in ps) + 1)
                grid = [s for s in sorted(ser) if s >= hits[0] and (s - hits[0]) % period == 0]
                named = next((m for m in range(min_hits, len(on) + 1) if _chance(
                    m, grid.index(on[m - 1]) + 1, rate) <= alpha / len(series)), 0)
                if not named or _chance(len(on), expected, rate) > alpha / len(series):
                    continue  # as many slow probes as its peers' noise makes likely among this many items
            out[k] = (on, ref, named)  # type: ignore[assignment]
    return out


def _always_slow(k: Any, series: dict[Any, dict[int, float]], ps: list[Any], own: float, peer_level: float | None,
                 ratio: float) -> bool:
    """An item slow against its peers from its first step on: its own level `ratio` x its peers', or
    its median `ratio` x the median of its peers' medians (a link 2x its peers from step 0 read fast
    at two consecutive probes, its own level came from those two and it went unnamed; medians against
    medians, as a median stands above a level of the two fastest steps)."""
    if peer_level is None:
        return False
    if own >= ratio * peer_level:
        return True
    peer_median = statistics.median(statistics.median(series[q].values()) for q in ps)
    return statistics.median(series[k].values()) >= ratio * peer_median


def _unbroken_run(steps: list[int], slow: set[int], length: int) -> list[int]:
    """The first run of at least `length` consecutive `steps` that are all in `slow`, to its end
    ([] if none)."""
    run: list[int] = []
    for s in steps:
        if s in slow:
            run.append(s)
        elif len(run) >= length:
            break
        else:
            run = []
    return run if len(run) >= length else []


def _hits(k: Any, series: dict[Any, dict[int, float]], peers: dict[Any, list[Any]], own: dict[Any, float | None],
          ratio: float, floor: float, scale: dict[Any, dict[int, float]] | None,
          reference: dict[Any, dict[int, float]] | None = None) -> list[int] | None:
    """The steps at which item `k` is slow (`_flags`' test), None when it has no level."""
    ser = series[k]
    if own[k] is None or own[k] <= 0:  # type: ignore[operator]
        return None
    ps = [p for p in peers.get(k, []) if own.get(p)]
    peer_level = statistics.median(own[p] for p in ps) if ps else None  # type: ignore[type-var]
    always_slow = _always_slow(k, series, ps, own[k], peer_level, ratio)  # type: ignore[arg-type]
    margin = floor
    if not ps:  # its own history alone: a step must also stand out of the series' own scatter
        mid = statistics.median(ser.values())
        margin = max(floor, 3.0 * statistics.median(abs(v - mid) for v in ser.values()))
    hits = []
    for s, v in sorted(ser.items()):
        ref = reference or {}
        now = [series[p][s] if s in series[p] else ref[p][s] for p in ps if s in series[p] or s in ref.get(p, {})]
        if ps and not now:
            continue
        peer_now = statistics.median(now) if now else None
        level = own[k] * (scale or {}).get(k, {}).get(s, 1.0)  # type: ignore[operator]
        slow_own = always_slow or (v >= ratio * level and v - level >= margin)
        slow_peer = peer_now is None or (v >= ratio * peer_now and v - peer_now >= floor)
        if slow_own and slow_peer:
            hits.append(s)
    return hits


def _chance(hits: int, n: int, p: float) -> float:
    """P(at least `hits` of `n` independent steps slow) at a per-step rate `p`: the binomial tail."""
    return sum(math.comb(n, i) * p ** i * (1.0 - p) ** (n - i) for i in range(hits, n + 1))


def _whole_before(work: dict[int, tuple[float, float, float]], before: float | None) -> set[int]:
    """Steps whose work ended before `before` (a stall's onset): a step's work runs to the next
    step's first call, so a step is whole once the next one began before the onset."""
    if before is None:
        return set(work)
    return {s for s in work if s + 1 in work and work[s + 1][1] <= before}


def work_series(run: RunRecords, work: dict[int, dict[int, tuple[float, float, float]]],
                before: float | None) -> dict[int, dict[int, float]]:
    """rank -> step -> local work of the steps whole before `before` (live: the end of the
    evidence, a step in progress is not whole), the first (warm-up) step left out."""
    # The end of training's calls carry no step: a rank that ended normally has its last step whole.
    whole = {r: _whole_before(w, before if before is None or before < run.t_obs or not run.ranks[r].done else None)
             for r, w in work.items()}
    return {r: {s: v[0] for s, v in w.items() if s > min(w) and s in whole[r]} for r, w in work.items() if w}


def slow_ranks(run: RunRecords, th: Thresholds, before: float | None = None) -> list[Finding]:
    """`before`: judge only steps whole before this time (a stall's onset: the steps after it are
    cut short, and a slow rank found before it is a fault of its own beside the stall)."""
    work = local_work(run)
    series = work_series(run, work, before)
    stage = {r: (rr.coords[0] if rr.coords else 0) for r, rr in run.ranks.items()}
    peers = {r: [p for p in series if p != r and stage[p] == stage[r]] for r in series}
    floor = max(th.min_excess_of_step * step_time(run), th.rank_min_excess_s)
    flagged = _flags(series, peers, th.slow_rank_ratio, floor, th.min_hits, th.min_hit_fraction)
    out = []
    for r, (hits, ref, named) in flagged.items():
        ratios = [series[r][s] / ref for s in hits]
        first = work[r][hits[0]][1]
        detected = work[r][hits[named - 1]][2]
        out.append(_finding("slow_rank", (r,), first, detected, run, step=hits[0],
                            slow_steps=hits, ratio=round(statistics.median(ratios), 3),
                            local_work_s={str(s): round(series[r][s], 6) for s in sorted(series[r])},
                            reference_s=round(ref, 6),
                            peers_local_work_s={str(p): round(statistics.median(series[p].values()), 6)
                                                for p in peers[r] if series[p]}))
    return sorted(out, key=lambda f: -f.evidence["ratio"])


def probe_floor(run: RunRecords, th: Thresholds) -> float:
    """Seconds below which a probe's time is not judged: the link's latency plus its size at the
    fastest bandwidth allowed for (`Thresholds.probe_latency_s`, `probe_floor_bw`)."""
    size = max((c.bytes for rr in run.ranks.values() for c in rr.records if c.key == PROBE_KEY), default=0)
    return th.probe_latency_s + size / th.probe_floor_bw


def probe_times(run: RunRecords) -> dict[tuple[int, int], dict[int, tuple[float, float, float]]]:
    """(a, b) -> step -> (transfer seconds, start, end) of the pair's fastest probe exchange that
    step; an exchange's transfer runs from the later of the two arrivals to the later end."""
    sides: dict[tuple[tuple[int, int], int], dict[int, set[tuple[float, float]]]] = defaultdict(
        lambda: defaultdict(set))
    for r, rr in run.ranks.items():
        for c in rr.records:
            if c.key == PROBE_KEY and c.peer is not None and c.step is not None:
                sides[((min(r, c.peer), max(r, c.peer)), c.step)][r].add((c.t_enqueue, c.t_end))
    out: dict[tuple[int, int], dict[int, tuple[float, float, float]]] = defaultdict(dict)
    for (pair, step), both in sides.items():
        if len(both) != 2:
            continue
        a, b = (sorted(both[r]) for r in pair)  # the n-th exchange of a with b is b's n-th with a
        best = None
        for (sa, ea), (sb, eb) in zip(a, b):
            start, end = max(sa, sb), max(ea, eb)
            if best is None or end - start < best[0]:
                best = (max(0.0, end - start), start, end)
        if best is not None:
            out[pair][step] = best
    return out


def link_matrix(run: RunRecords) -> list[list[float | None]]:
    """Median probe transfer time (seconds) per rank pair: the rank x rank matrix (symmetric)."""
    n = run.world
    m: list[list[float | None]] = [[None] * n for _ in range(n)]
    for (a, b), ser in probe_times(run).items():
        if a < n and b < n and ser:
            m[a][b] = m[b][a] = statistics.median(v[0] for v in ser.values())
    return m


def _host_of(run: RunRecords, rank: int) -> Any:
    """The machine a rank ran on, whose CPU counters it read: its records header's host name,
    else config.json's node or host (emulated nodes on one machine share its counters)."""
    host = run.ranks[rank].host
    return host if host is not None else run.node_of(rank)


def foreign_cpu(run: RunRecords) -> dict[Any, dict[int, float]]:
    """host -> step -> cores that processes other than the job's ranks took on the host over the
    step's probed stretch (from the step's first probe round to its last; ranks without CPU
    counters -- format_version < 3, or not Linux -- give none): the host's busy CPU rate, as its
    ranks saw it (median), less the sum of those ranks' own CPU rates."""
    windows: dict[tuple[Any, int], list[tuple[float, float]]] = defaultdict(list)
    for r, rr in run.ranks.items():
        by_step: dict[int, list[Any]] = defaultdict(list)
        for h in rr.hosts:
            if h.step is not None:
                by_step[h.step].append(h)
        for s, hs in by_step.items():
            a, b = hs[0], hs[-1]
            dt = b.t - a.t
            if dt > 0:
                windows[(_host_of(run, r), s)].append(((b.host_busy_s - a.host_busy_s) / dt, (b.cpu_s - a.cpu_s) / dt))
    on_host: dict[Any, int] = defaultdict(int)
    for r in run.ranks:
        on_host[_host_of(run, r)] += 1
    out: dict[Any, dict[int, float]] = defaultdict(dict)
    for (host, s), rates in windows.items():
        if len(rates) == on_host[host]:  # every rank of the host sampled the step: its own CPU is known
            out[host][s] = statistics.median(b for b, _ in rates) - sum(c for _, c in rates)
    return dict(out)


def host_contention(run: RunRecords, th: Thresholds) -> dict[Any, list[int]]:
    """host -> the steps at which other processes took `Thresholds.contention_cores` more of its
    CPU than their steady level (and more than 3 median absolute deviations of the series: the
    host's counters tick at 10 ms, a short step's rate is coarse). Hosts without counters: none."""
    out = {}
    for host, ser in foreign_cpu(run).items():
        level = _steady(ser)
        if level is None or len(ser) < 3:
            continue
        mid = statistics.median(ser.values())
        bar = max(th.contention_cores, 3.0 * statistics.median(abs(v - mid) for v in ser.values()))
        steps = sorted(s for s, v in ser.items() if v - level >= bar)
        if steps:
            out[host] = steps
    return out


def contention_notes(run: RunRecords, th: Thresholds) -> list[str]:
    """What `host_contention` found, in words (the diagnosis' warnings: a reason, not a fault)."""
    ser = foreign_cpu(run)
    notes = []
    for host, steps in host_contention(run, th).items():
        level = _steady(ser[host]) or 0.0
        rise = statistics.median(ser[host][s] for s in steps) - level
        ranks = sorted(r for r in run.ranks if _host_of(run, r) == host)
        notes.append(f"CPU contention on host {host} (ranks {ranks}) at steps {steps}: other processes took "
                     f"{rise:+.2f} cores beyond their steady level; those steps' link probes of these ranks "
                     "are not judged")
    return notes


def compute_rise(run: RunRecords, pairs: list[tuple[int, int]], th: Thresholds,
                 before: float | None = None) -> dict[tuple[int, int], dict[int, float]]:
    """pair -> step -> how many times its own level a pair's probe may be for a reason outside the
    link: the smaller of its two ranks' local-work ratios to their steady levels, where both rose by
    at least `slow_rank_ratio` (contention slows every rank's compute and transfers together; one
    slow rank does not slow a probe, which is timed from the later arrival). 1 elsewhere. `before`:
    the steps whole before it, as `slow_ranks` judges them (live: a step in progress is cut
    short -- its small partial work pulled a rank's steady level down, so every whole step read
    as a rise and a slow link flickered out of the live diagnosis between its probes)."""
    series = work_series(run, local_work(run), before)
    level = {r: _steady(ser) for r, ser in series.items()}
    out: dict[tuple[int, int], dict[int, float]] = {}
    for a, b in pairs:
        if not level.get(a) or not level.get(b):
            continue
        rise = {}
        for s in set(series[a]) & set(series[b]):
            both = min(series[a][s] / level[a], series[b][s] / level[b])  # type: ignore[operator]
            if both >= th.slow_rank_ratio:
                rise[s] = both
        out[(a, b)] = rise
    return out


def slow_links(run: RunRecords, th: Thresholds, before: float | None = None,
               work_before: float | None = None) -> list[Finding]:
    """`before`: judge only probes that ended before this time (a stall's onset); `work_before`:
    the ranks' local work (the contention discount, `compute_rise`) of the steps whole before it."""
    times = probe_times(run)
    # A pair's first probe also sets up its connection (gloo connects lazily): left out.
    floor = probe_floor(run, th)  # a time below the floor is read as the floor: no ratio of noise
    # Steps at which other processes took a rank's host CPU: its probes then are not the link's,
    # unless slower than contention makes them (`contention_probe_s`): those are judged.
    busy = {h: set(steps) for h, steps in host_contention(run, th).items()}
    contended = {r: busy.get(_host_of(run, r), set()) for r in run.ranks}

    def kind(p: tuple[int, int]) -> bool:  # same node or not: intra-node links are faster by design
        return run.node_of(p[0]) == run.node_of(p[1])
    # every probe (contended steps included) and its pair's level: contention only slows a probe, so
    # a contended step is an upper bound on the link's time -- it may set the level (a fault from
    # step 3 with step 2 contended left one clean step before it, and the level came from the slow
    # steps after) and stand as a peer's reference
    alls = {p: {s: max(v[0], floor) for s, v in ser.items() if s > min(ser) and (before is None or v[2] <= before)}
            for p, ser in times.items()}
    level_all = {p: _steady(both) for p, both in alls.items()}

    def untouched(s: int, refs: list[tuple[int, int]]) -> bool:
        """Contention at step s did not slow the probes of `refs` (their median ratio to their
        levels stays under `slow_link_ratio`): at s it slowed no probe, so s is judged."""
        ratios = [alls[q][s] / level_all[q] for q in refs if s in alls[q] and level_all[q]]  # type: ignore[operator]
        return bool(ratios) and statistics.median(ratios) < th.slow_link_ratio

    series, set_level, busy_of = {}, {}, {}
    for p, both in alls.items():
        busy_steps = contended.get(p[0], set()) | contended.get(p[1], set())
        busy_of[p] = busy_steps
        series[p] = {s: v for s, v in both.items() if s not in busy_steps}
        level = level_all[p]
        if level and busy_steps:
            # judged at a contended step: where its peers' probes did not slow (the contention did
            # not reach the probes: a 2.5x link beside another job's processes went unnamed, its
            # peers' probes flat), or where it is slower than contention makes a probe
            refs = [q for q in alls if q != p and kind(q) == kind(p)]
            bar = th.slow_link_ratio * level + th.contention_probe_s
            kept = {s: v for s, v in both.items() if s in busy_steps and (v >= bar or untouched(s, refs))}
            series[p] = dict(sorted({**series[p], **kept}.items()))
            set_level[p] = level  # the kept steps are judged against it, not a level they raised
    series = {p: ser for p, ser in series.items() if ser}
    peers = {p: [q for q in series if q != p and kind(q) == kind(p)] for p in series}
    rise = compute_rise(run, list(series), th, work_before)
    # A slow link stays slow: its probes from the first slow one on (not every k-th: a shared
    # machine's latency spikes, scattered over a long run, fall on some grid by chance).
    flagged = _flags(series, peers, th.slow_link_ratio, th.link_min_excess_s, th.link_min_hits,
                     th.link_min_hit_fraction, scale=rise, periodic=False, alpha=th.link_noise_alpha,
                     levels=set_level, lone_run=th.lone_link_min_hits, reference=alls)
    out = []
    for p, (hits, ref, named) in flagged.items():
        ratios = [series[p][s] / ref for s in hits]
        out.append(_finding("slow_link", p, times[p][hits[0]][1], times[p][hits[named - 1]][2], run,
                            step=hits[0], collective="link probe", slow_steps=hits,
                            ratio=round(statistics.median(ratios), 3), reference_s=round(ref, 6),
                            transfer_s={str(s): round(v, 6) for s, v in sorted(series[p].items())}))
    out = _on_uplink(run, out)
    ups = uplinks(run, th, series, times, rise, {f.ranks for f in out if "node_uplink" in f.evidence}, set_level,
                  contended=(alls, busy_of, untouched))
    # a node's uplink stands for the pairs crossing it: a crossing pair also slower than its peers
    # is one of them (a 2.75x uplink was named as one such pair, and the node went unnamed)
    covered = {f.ranks for f in ups}
    out = [f for f in out if f.ranks not in covered] + ups
    return sorted(out, key=lambda f: -f.evidence["ratio"])


def _node_name(run: RunRecords, node: Any) -> str:
    """A node as the report names it: its host name where config.json gives one."""
    hosts = [rr.info.get("host") for rr in run.ranks.values() if run.node_of(rr.rank) == node]
    return str(next((h for h in hosts if h is not None), node))


def _on_uplink(run: RunRecords, found: list[Finding]) -> list[Finding]:
    """Slow links found against their peers that are exactly every pair crossing one node's
    boundary (two pairs or more: one pair is a link, not a node's uplink) are that node's uplink:
    each gets `evidence["node_uplink"]`, as `uplinks` gives a node whose pairs all slowed together."""
    node = {r: run.node_of(r) for r in run.ranks}
    nodes = sorted({n for n in node.values() if n is not None}, key=str)
    slow = {f.ranks for f in found}
    for x in nodes:
        group = {(a, b) for a in run.ranks for b in run.ranks if a < b and (node[a] == x) != (node[b] == x)}
        if len(group) >= 2 and group == slow:
            where = _node_name(run, x) if len(nodes) > 2 else \
                f"{_node_name(run, nodes[0])}<->{_node_name(run, nodes[1])}"
            return [replace(f, evidence={**f.evidence, "node_uplink": where}) for f in found]
    return found


def uplinks(run: RunRecords, th: Thresholds, series: dict[tuple[int, int], dict[int, float]],
            times: dict[tuple[int, int], dict[int, tuple[float, float, float]]],
            rise: dict[tuple[int, int], dict[int, float]], named: set[tuple[int, ...]],
            levels: dict[tuple[int, int], float] | None = None,
            contended: tuple[dict[tuple[int, int], dict[int, float]], dict[tuple[int, int], set[int]], Any] | None = None
            ) -> list[Finding]:
    """A node's uplink slowed: every pair crossing that node's boundary slow against *its own*
    history (absolute evidence: peers of its kind slowed too, so the relative test cannot see it),
    while the same-node pairs did not slow (CPU contention slows those too: `rise` also discounts
    the compute the pair's ranks lost). Named as one slow_link per crossing pair, each with
    `evidence["node_uplink"]` (the node, or the two nodes' link when the cluster has two).

    `levels`: a pair's level where `slow_links` set it from every probe, contended steps included:
    the steps a contended stretch leaves in `series` may all be slow ones (a fault from step 3 under
    contention at steps 0-5 left steps 3-7, and a level of those hid the fault).
    `contended`: (every pair's probes, contended steps included; each pair's contended steps; the
    test that contention at a step slowed none of some pairs' probes): a node's contended step is
    judged where the pairs not crossing its boundary did not slow (two 2.2x uplinks beside another
    job's processes went unnamed, their other pairs' probes flat)."""
    node = {r: run.node_of(r) for r in run.ranks}
    nodes = sorted({n for n in node.values() if n is not None}, key=str)
    if len(nodes) < 2:
        return []
    level = {p: (levels or {}).get(p) or _steady(ser) for p, ser in series.items()}
    intra = [p for p in series if node[p[0]] == node[p[1]] and level[p]]
    out: list[Finding] = []
    seen: set[frozenset[tuple[int, int]]] = set()
    for x in nodes:
        group = [p for p in series if (node[p[0]] == x) != (node[p[1]] == x) and level[p]]
        if not group or frozenset(group) in seen or any(p in named for p in group):
            continue
        seen.add(frozenset(group))
        gs = {p: series[p] for p in group}
        if contended is not None:
            alls, busy_of, untouched = contended
            others = [q for q in alls if q not in group]
            for p in group:
                back = {s: alls[p][s] for s in busy_of.get(p, ()) if s in alls[p] and s not in gs[p]
                        and untouched(s, others)}
                if back:
                    gs[p] = dict(sorted({**gs[p], **back}.items()))
        view = {**series, **gs}  # this node's own: other nodes judge their steps afresh
        steps = sorted(set.intersection(*(set(view[p]) for p in group)))
        hits = []
        for s in steps:
            ratios = [view[p][s] / (level[p] * rise.get(p, {}).get(s, 1.0)) for p in group]  # type: ignore[operator]
            excess = statistics.median(view[p][s] - level[p] for p in group)  # type: ignore[operator]
            # How much the same-node pairs rose (contention), counted only where the rise is an
            # effect (>= link_min_excess_s): a 0.5 -> 1 ms jitter is a 2x ratio of noise.
            ref = statistics.median([view[q][s] / level[q] if view[q][s] - level[q] >= th.link_min_excess_s  # type: ignore[operator]
                                     else 1.0 for q in intra if s in view[q]] or [1.0])
            bar = th.slow_link_ratio * ref
            # Most crossing pairs slow, not every one: on a shared machine one pair's probe of a
            # step can be fast by chance (>= 3 of 4, 2 of 2, ...).
            if statistics.median(ratios) >= bar and sum(x >= bar for x in ratios) >= th.link_min_hit_fraction \
                    * len(ratios) and excess >= th.link_min_excess_s:
                hits.append(s)
        if len(hits) < th.link_min_hits:
            continue
        on = hits  # a node's uplink stays slow too: every probe from the first slow one counts
        expected = sum(1 for s in steps if s >= hits[0])
        if len(on) < th.link_min_hits or len(on) < th.link_min_hit_fraction * expected:
            continue
        where = _node_name(run, x) if len(nodes) > 2 else f"{_node_name(run, nodes[0])}<->{_node_name(run, nodes[1])}"
        for p in group:
            ratio = statistics.median(view[p][s] / level[p] for s in on)  # type: ignore[operator]
            out.append(_finding("slow_link", p, times[p][on[0]][1], times[p][on[th.link_min_hits - 1]][2], run,
                                step=on[0], collective="link probe", slow_steps=on, ratio=round(ratio, 3),
                                reference_s=round(level[p], 6), reference="its own history",  # type: ignore[arg-type]
                                node_uplink=where,
                                transfer_s={str(s): round(v, 6) for s, v in sorted(view[p].items())}))
    return out
