"""The doctor's injection suite: precision, recall, attribution and detection time per fault class,
beside the open baselines' logic on the same records, and what recording costs on clean runs.

    python bench/doctor.py                    # 20 runs per class + 20 clean (+ 20 with recording off)
    python bench/doctor.py --quick            # 1 run per class, a smoke test (~4 min)
    python bench/doctor.py --per-class 5      # as many as fit
    python bench/doctor.py --replay DIR       # analyse the kept run folders again (seconds)
    python bench/doctor.py --only uplink,stop_resume,hog --per-class 3   # some classes only
    python bench/doctor.py --json             # one JSON object: {"rows": [...], "summary": {...}}

Each run is `plait run` on a 4-node emulated cluster (one rank per node, each node in its own
network namespace with `tc`-shaped links where root, else loopback), a tiny GPT, 12 steps, with
**sleep-padded compute** (`--compute-sleep`: a forward span lasts >= 20 ms, a backward >= 40 ms,
so a slowed rank is not lost in CPU contention when 4 ranks share 2 cores) and one `--inject`
fault drawn at random: the class, the rank or rank pair, the onset step, the factor (1.5-4x),
the plan shape (DP, TP, PP, and the hybrids pp x dp and pp x tp that fit 4 ranks) and the seed.

| class        | injected as                                        | truth              |
|--------------|----------------------------------------------------|--------------------|
| comm_hang    | `skip:rank=R,step=S` (passes a collective by)      | rank R             |
| noncomm_hang | `stop:` (SIGSTOP) or `hang:` (loops outside comm)  | rank R             |
| slow_rank    | `slow:rank=R,factor=F,from=S[,every=K]`            | rank R             |
| slow_link    | `link:ranks=A-B,factor=F` or `delay=D` `[,from=S]` | pair (A, B)        |
| mismatch     | `mismatch:rank=R,step=S` (another size)            | rank R             |
| dead_rank    | `kill:rank=R,step=S` (SIGKILL)                     | rank R             |
| clean        | nothing                                            | no finding at all  |

**Set matching** (issue 32): every finding is scored against every injected fault -- a fault is
found when a finding of its class names its ranks (a missed second fault is a false negative), a
finding matching no injected fault of its class is a false positive -- post hoc and live (the
records as they stood at ~40 moments, `plait.doctor.folder.as_of`, diagnosed live; any live
finding before the onset is listed). Extra classes: `two_faults` (a slow rank from the onset and
a rank killed >= 4 steps later, data parallel); the damaged-file check cuts a copy of every run's
rank-0 records at 70 % (mid-line) and lists any finding it adds. Issue 32's further classes:

| class        | injected as                                        | truth                          |
|--------------|----------------------------------------------------|--------------------------------|
| uplink       | `uplink:node=N,factor=F or delay=D,from=S` on the 4-node cluster or a 2-node one (2 ranks each) | slow_link on every pair crossing node N (and `node_uplink` naming it) |
| stop_resume  | `stop:rank=R,step=S,for=D` (SIGSTOP, SIGCONT D = 2-5 s later) | noncomm_hang of R (a past stall) |
| hog          | `hog:rank=R,from=S` (a busy loop on rank R's CPUs) | nothing; slow_rank of R allowed |

The scenario table scores each injected scenario (the case's class) by set matching: its faults
found, missed, and findings matching none (a `hog` run's slow_rank of the hogged rank is allowed:
the rank really is slowed, though sleep-padded compute mostly hides it). `--load` runs the whole
suite beside a CPU hog (a busy loop on each core), the issue's loaded condition. The clean
`--recover` runs and the live doctor's repeated clean runs: bench/doctor_clean.py.

The first table's verdict is the doctor's first (most severe) finding. Per class: precision and recall of
that verdict, attribution accuracy (right rank / right pair among the runs it named the class),
and onset -> detection time: from the start of the injected step (the records' first call of
that step) to the moment the records held enough evidence (`Finding.detected_s`: what `plait
doctor --live` polling would see). Thresholds (`plait.doctor.detect.Thresholds`) were frozen
before the final run, whose seeds (`--seed`, default 1000) were never used to tune them.

Baselines, on the same records (their logic, re-implemented; neither tool reads plait's records):

* **Flight Recorder** (PyTorch's NCCL flight recorder and its `fr_trace` analyser): matches each
  collective's entries across ranks by sequence id; reports mismatched entries (op / size) and,
  for the first collective not completed everywhere, the ranks missing from it. It names a hang
  and a rank but cannot tell a rank stopped in compute from one waiting elsewhere, and sees no
  slowness.
* **Straggler detector** (nvidia-resiliency-ext `straggler.Detector`): per-rank section timing
  scores -- relative (the fastest rank's median / this rank's) and individual (this rank's best
  window / its latest) -- with stragglers below 0.75 of either. It sees slow ranks, not links,
  hangs or mismatches, and assumes every rank does the same work (pipeline stages differ).

Recording overhead: every clean case is run again with recording off (`--no-comm-records`, which
also drops the link probes), interleaved in the same bench run; the table gives the median
relative difference of the median iteration time (the probes run between steps, outside it)
and of the wall time per step (probes included).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plait.doctor import Thresholds, diagnose_records, read_run  # noqa: E402
from plait.doctor.detect import local_work  # noqa: E402
from plait.doctor.folder import RunRecords, as_of  # noqa: E402

CLASSES = ("comm_hang", "noncomm_hang", "slow_rank", "slow_link", "mismatch", "dead_rank")
EXTRA = ("two_faults", "uplink", "stop_resume", "hog")  # scored by the classes of their faults (set matching)
MODEL = "gpt:layers=4,hidden=16,heads=4,seq=8,vocab=32,dropout=0,attn_dropout=0"
SHAPES = {"DP": "dp=4", "TP": "tp=4", "PP": "pp=4", "PPxDP": "pp=2,dp=2", "PPxTP": "pp=2,tp=2"}
STEPS = 12
COMPUTE_SLEEP = 0.02
TIMEOUT = 6.0  # the launcher stops a hung run after this; the doctor needs ~1 s of silence
CLUSTER = """name: doctor-bench-4
gpu_kinds:
  g: {flops: {fp32: 20 TFLOPS}, memory: 16 GiB, memory_bandwidth: 700 GB/s}
nodes:
  - {name: n0, gpus: {kind: g, count: 1}, intra: {type: pcie, bandwidth: 16 GB/s}}
  - {name: n1, gpus: {kind: g, count: 1}, intra: {type: pcie, bandwidth: 16 GB/s}}
  - {name: n2, gpus: {kind: g, count: 1}, intra: {type: pcie, bandwidth: 16 GB/s}}
  - {name: n3, gpus: {kind: g, count: 1}, intra: {type: pcie, bandwidth: 16 GB/s}}
fabric: {type: ethernet, bandwidth: 1 Gb/s, latency: 50 us}
emulation: {enabled: true, namespaces: true, bandwidth_scale: 0.4}
"""
CLUSTER2 = """name: doctor-bench-2x2
gpu_kinds:
  g: {flops: {fp32: 20 TFLOPS}, memory: 16 GiB, memory_bandwidth: 700 GB/s}
nodes:
  - {name: n0, gpus: {kind: g, count: 2}, intra: {type: pcie, bandwidth: 16 GB/s}}
  - {name: n1, gpus: {kind: g, count: 2}, intra: {type: pcie, bandwidth: 16 GB/s}}
fabric: {type: ethernet, bandwidth: 1 Gb/s, latency: 50 us}
emulation: {enabled: true, namespaces: true, bandwidth_scale: 0.4}
"""


@dataclass
class Case:
    id: str
    cls: str  # one of CLASSES or "clean"
    shape: str
    plan: str
    spec: str
    truth: list[int]  # culprit rank, or the link's pair
    onset: int  # the step the fault starts at
    seed: int
    recording: bool = True
    faults: list[list[Any]] | None = None  # every injected fault: [class, ranks]; None: [[cls, truth]]
    cluster: int = 4  # nodes of the emulated cluster: 4 (one rank each) or 2 (two ranks each)
    timeout: float = 6.0  # the launcher's --timeout (a stop-and-resume outlasts the default)
    node: int | None = None  # uplink: the node whose crossing links are slowed


# ---------------------------------------------------------------------------------- the cases
def make_cases(per_class: int, clean: int, seed: int, steps: int = STEPS) -> list[Case]:
    """Random cases: for each class `per_class` runs, and `clean` clean runs (each also run with
    recording off for the overhead). Everything is drawn from one RNG seeded with `seed`."""
    rng = random.Random(seed)
    shapes = list(SHAPES)
    out: list[Case] = []
    # The classes added later draw after the older ones: a seed's older cases stay as they were.
    for cls in (*CLASSES, "two_faults", "clean", *EXTRA[1:]):
        for i in range(per_class if cls != "clean" else clean):
            shape = shapes[(i + rng.randrange(len(shapes))) % len(shapes)]
            plan = f"{SHAPES[shape]},micro_batch=1,global_batch=4,dtype=fp32"
            r = rng.randrange(4)
            # Slowness needs 3 slow steps after its onset (every 3rd step: steps s, s+3, s+6).
            onset = rng.randint(3, 5) if cls in ("slow_rank", "slow_link") else rng.randint(3, steps - 4)
            factor = round(rng.uniform(1.5, 4.0), 2)
            s = rng.randrange(1 << 16)
            truth = [r]
            if cls == "comm_hang":
                spec = f"skip:rank={r},step={onset}"
            elif cls == "noncomm_hang":
                spec = f"{rng.choice(('stop', 'hang'))}:rank={r},step={onset}"
            elif cls == "slow_rank":
                every = rng.choice((None, None, 2, 3))
                spec = f"slow:rank={r},factor={factor},from={onset}" + (f",every={every}" if every else "")
            elif cls == "slow_link":
                a, b = sorted(rng.sample(range(4), 2))
                truth = [a, b]
                if rng.random() < 0.25:
                    onset = 0  # from the start: shaped by tc on the emulated link where root
                how = f"delay={rng.choice((5, 10, 20))}ms" if rng.random() < 0.25 else f"factor={factor}"
                spec = f"link:ranks={a}-{b},{how}" + (f",from={onset}" if onset else "")
            elif cls == "mismatch":
                spec = f"mismatch:rank={r},step={onset}"
            elif cls == "dead_rank":
                spec = f"kill:rank={r},step={onset}"
            elif cls == "two_faults":  # a dead rank and an independent slow rank (data parallel: peers)
                plan = "dp=4,micro_batch=1,global_batch=4,dtype=fp32"
                shape, other = "DP", rng.choice([x for x in range(4) if x != r])
                onset = rng.randint(3, 5)
                kill = rng.randint(onset + 4, steps - 1)
                spec = f"slow:rank={other},factor={factor},from={onset};kill:rank={r},step={kill}"
                truth = [other]
                out.append(Case(f"{cls}-{i:02d}", cls, shape, plan, spec, truth, onset, s,
                                faults=[["slow_rank", [other]], ["dead_rank", [r]]]))
                continue
            elif cls == "uplink":  # a node's links slowed together: 4 nodes x 1 rank or 2 nodes x 2 ranks
                nodes = rng.choice((4, 2))
                node = rng.randrange(nodes)
                onset = rng.randint(3, 5)
                how = f"delay={rng.choice((5, 10, 20))}ms" if rng.random() < 0.25 else f"factor={factor}"
                out.append(Case(f"{cls}-{i:02d}", cls, shape, plan, f"uplink:node={node},{how},from={onset}", [],
                                onset, s, cluster=nodes, node=node))
                continue
            elif cls == "stop_resume":
                stalled = round(rng.uniform(2.0, 5.0), 1)
                out.append(Case(f"{cls}-{i:02d}", cls, shape, plan, f"stop:rank={r},step={onset},for={stalled}s",
                                truth, onset, s, faults=[["noncomm_hang", [r]]], timeout=TIMEOUT + stalled))
                continue
            elif cls == "hog":
                out.append(Case(f"{cls}-{i:02d}", cls, shape, plan, f"hog:rank={r},from={onset}", truth, onset, s,
                                faults=[]))
                continue
            else:
                spec, truth, onset = "", [], 0
            out.append(Case(f"{cls}-{i:02d}", cls, shape, plan, spec, truth, onset, s))
            if cls == "clean":
                out.append(Case(f"clean-off-{i:02d}", "clean", shape, plan, "", [], 0, s, recording=False))
    return out


def run_case(case: Case, root: Path, steps: int = STEPS) -> dict[str, Any]:
    """One `plait run` (a subprocess); the folder keeps records, heartbeats and case.json."""
    d = root / case.id
    d.mkdir(parents=True, exist_ok=True)
    cluster = root / ("cluster.yaml" if case.cluster == 4 else "cluster2.yaml")
    if not cluster.exists():
        cluster.write_text(CLUSTER if case.cluster == 4 else CLUSTER2)
    cmd = [sys.executable, "-m", "plait.cli", "run", "--model", MODEL, "--cluster", str(cluster),
           "--plan", case.plan, "--steps", str(steps), "--run-dir", str(d), "--compute-sleep", str(COMPUTE_SLEEP),
           "--timeout", str(case.timeout), "--seed", str(case.seed % 1000), "--data-seed", str(case.seed), "--json",
           "--probe-every", "1"]
    if case.spec:
        cmd += ["--inject", case.spec]
    if not case.recording:
        cmd += ["--no-comm-records"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    out: dict[str, Any] = {"case": asdict(case), "rc": proc.returncode, "wall_s": time.time() - t0,
                           "stderr": proc.stderr[-3000:]}
    if proc.returncode == 0:
        try:
            res = json.loads(proc.stdout)
            out["iteration_times"] = res["iteration_times"]
            out["run_wall_s"] = res["network"].get("wall_seconds")
            out["notes"] = res.get("notes", [])
        except (json.JSONDecodeError, KeyError):
            pass
    (d / "case.json").write_text(json.dumps(out, indent=1))
    return out


# ---------------------------------------------------------------------------------- baselines
def flight_recorder(run: RunRecords) -> list[dict[str, Any]]:
    """Flight Recorder's analyser, on the same entries: per (group, seq), entries of every member
    rank; a mismatch of op or size, or the first collective some member never completed, with the
    members missing from it (entered nowhere). No timing: it cannot see slowness."""
    from plait.doctor.detect import _instances

    out = []
    for (group, members, seq), entries in sorted(_instances(run).items(), key=lambda kv: min(
            e.t for e in kv[1].values())):
        if len(members) < 2 or any(e.op.endswith("_object") for e in entries.values()):
            continue
        sigs = {("p2p" if group.startswith("p2p ") else e.op, e.bytes) for e in entries.values()}
        if len(sigs) > 1:
            return [{"kind": "mismatch", "ranks": [], "collective": f"{group} seq {seq}"}]
        done = [r for r, e in entries.items() if e.t_end is not None]
        if len(done) < len(members):
            missing = [m for m in members if m not in entries]
            if not missing and done:
                continue  # finished on some ranks: a record of the rest may just be late
            if all(rr.done for rr in run.ranks.values()):
                continue
            out.append({"kind": "hang", "ranks": missing, "collective": f"{group} seq {seq}"})
            break
    return out


def straggler_detector(run: RunRecords, threshold: float = 0.75) -> list[dict[str, Any]]:
    """nvidia-resiliency-ext's straggler scores over per-rank section times (here: local work per
    step, the compute between calls): relative = fastest rank's median / this rank's median;
    individual = this rank's best 3-step window / its last 3-step window."""
    work = {r: [v[0] for s, v in sorted(w.items()) if min(w) < s < max(w)] for r, w in local_work(run).items()}
    med = {r: statistics.median(v) for r, v in work.items() if v}
    if not med:
        return []
    best = min(med.values())
    out = []
    for r, v in work.items():
        if not v:
            continue
        rel = best / med[r] if med[r] > 0 else 1.0
        windows = [statistics.median(v[i:i + 3]) for i in range(max(1, len(v) - 2))]
        ind = min(windows) / windows[-1] if windows[-1] > 0 else 1.0
        if rel < threshold or ind < threshold:
            out.append({"kind": "slow_rank", "ranks": [r], "relative": round(rel, 3), "individual": round(ind, 3)})
    return sorted(out, key=lambda f: min(f["relative"], f["individual"]))


# ---------------------------------------------------------------------------------- analysis
def onset_time(run: RunRecords, step: int) -> float:
    """When the injected step began: the first call any rank entered in it."""
    times = [c.t_enqueue for rr in run.ranks.values() for c in rr.records if c.step is not None and c.step >= step]
    times += [e.t for rr in run.ranks.values() for e in rr.enters if e.step is not None and e.step >= step]
    return min(times) if times else 0.0


def analyse_case(d: Path, th: Thresholds) -> dict[str, Any] | None:
    meta = json.loads((d / "case.json").read_text())
    case = meta["case"]
    row: dict[str, Any] = {"id": case["id"], "cls": case["cls"], "shape": case["shape"], "spec": case["spec"],
                           "truth": case["truth"], "recording": case["recording"], "rc": meta["rc"],
                           "wall_s": round(meta["wall_s"], 2)}
    if meta.get("iteration_times"):
        its = meta["iteration_times"][1:]
        row["iteration_s"] = statistics.median(its)
        row["run_wall_s"] = meta.get("run_wall_s")
    if not case["recording"]:
        return row
    t = time.perf_counter()
    try:
        run = read_run(d)
    except Exception as exc:  # a run that never got going: no records
        row.update(verdict="error", error=str(exc)[:300])
        return row
    diag = diagnose_records(run, thresholds=th)
    row["analyse_s"] = round(time.perf_counter() - t, 4)
    row["faults"] = truths(case, run)
    row["tolerated"] = [["slow_rank", case["truth"]]] if case["cls"] == "hog" else []
    row["found"] = [[f.kind, list(f.ranks)] for f in diag.findings]
    row.update(live_replay(run, th, onset_time(run, case["onset"]) if case["cls"] != "clean" else None))
    row["damaged_found"] = damaged_findings(d, th)
    if case["cls"] == "uplink":  # the node named: every crossing pair's finding carries it
        want = {f"n{case['node']}"} if len({rr.info.get("node") for rr in run.ranks.values()}) > 2 else {"n0<->n1"}
        ups = {f.evidence.get("node_uplink") for f in diag.findings if f.kind == "slow_link"}
        row["uplink_named"] = ups == want
    first = diag.findings[0] if diag.findings else None
    row["verdict"] = first.kind if first else "healthy"
    row["culprit"] = list(first.ranks) if first else []
    row["findings"] = [f"{f.kind}{list(f.ranks)}" for f in diag.findings]
    row["warnings"] = len(diag.warnings)
    if first is not None and first.detected_s is not None and case["cls"] != "clean":
        row["detect_s"] = round(first.detected_s - onset_time(run, case["onset"]), 3)
    fr = flight_recorder(run)
    row["fr"] = fr[0]["kind"] if fr else "healthy"
    row["fr_culprit"] = fr[0]["ranks"] if fr else []
    sd = straggler_detector(run)
    row["sd"] = sd[0]["kind"] if sd else "healthy"
    row["sd_culprit"] = sd[0]["ranks"] if sd else []
    return row


def truths(case: dict[str, Any], run: RunRecords) -> list[list[Any]]:
    """Every injected fault of a case as [class, ranks]; an uplink's: every pair crossing its node
    (from the run's own rank layout, config.json)."""
    if case.get("cls") == "uplink":
        node = {r: rr.info.get("node") for r, rr in run.ranks.items()}
        return [["slow_link", [a, b]] for a in sorted(node) for b in sorted(node)
                if a < b and (node[a] == case["node"]) != (node[b] == case["node"])]
    if case.get("faults") is not None:
        return case["faults"]
    return [[case["cls"], case["truth"]]] if case["cls"] != "clean" else []


def live_replay(run: RunRecords, th: Thresholds, onset: float | None) -> dict[str, Any]:
    """The records as they stood at each step's start (and at the end), diagnosed live: what a
    polling `plait doctor --live` would have named, and whether it named anything before the onset."""
    times = sorted({c.t_enqueue for rr in run.ranks.values() for c in rr.records if c.step is not None})
    marks = sorted({times[i] for i in range(0, len(times), max(1, len(times) // 40))} | {run.t_obs})
    early: list[list[Any]] = []
    last: list[list[Any]] = []
    for t in marks:
        last = [[f.kind, list(f.ranks)] for f in diagnose_records(as_of(run, t), live=True, thresholds=th).findings]
        if last and (onset is None or t < onset):
            early += [x for x in last if x not in early]
    return {"live_found": last, "live_early": early}


def damaged_findings(d: Path, th: Thresholds) -> list[list[Any]]:
    """The damaged-file class: a copy of the folder with rank 0's records cut at 70 % (mid-line);
    what the doctor names on it beyond the intact folder's findings is a false finding."""
    src = d / "comm" / "rank0.jsonl"
    if not src.exists():
        return []
    with tempfile.TemporaryDirectory() as tmp:
        cut = Path(tmp) / d.name
        shutil.copytree(d, cut)
        data = src.read_bytes()
        (cut / "comm" / "rank0.jsonl").write_bytes(data[: int(len(data) * 0.7)])
        try:
            return [[f.kind, list(f.ranks)] for f in diagnose_records(read_run(cut), thresholds=th).findings]
        except Exception as exc:  # noqa: BLE001 -- an unreadable copy is itself the answer
            return [["error", str(exc)[:80]]]


def set_scores(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Set matching per class: each injected fault is a true positive when a finding of its class
    names its ranks (a missed second fault is a false negative); each finding matching no injected
    fault of its class (kind and ranks) is a false positive."""
    out = {}
    for cls in CLASSES:
        tp = fn = fp = 0
        for r in rows:
            found = [(k, tuple(x)) for k, x in r.get(key, [])]
            truths = [(k, tuple(x)) for k, x in r.get("faults", [])]
            tp += sum(1 for t in truths if t[0] == cls and t in found)
            fn += sum(1 for t in truths if t[0] == cls and t not in found)
            ok = truths + [(k, tuple(x)) for k, x in r.get("tolerated", [])]
            fp += sum(1 for f in found if f[0] == cls and f not in ok)
        out[cls] = {"faults": tp + fn, "precision": _pct(tp, tp + fp), "recall": _pct(tp, tp + fn)}
    return out


def scenario_scores(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Per injected scenario (the case's class): its faults found and missed, and the findings
    that match none of its faults (nor a tolerated one) -- a clean or hog run's false alarms."""
    out = {}
    for cls in (*CLASSES, *EXTRA, "clean"):
        mine = [r for r in rows if r["cls"] == cls and "faults" in r]
        tp = fn = fp = 0
        wrong = []
        for r in mine:
            found = [(k, tuple(x)) for k, x in r.get(key, [])]
            truths = [(k, tuple(x)) for k, x in r["faults"]]
            ok = truths + [(k, tuple(x)) for k, x in r.get("tolerated", [])]
            tp += sum(1 for t in truths if t in found)
            fn += sum(1 for t in truths if t not in found)
            extra = [f for f in found if f not in ok]
            fp += len(extra)
            if extra or any(t not in found for t in truths):
                wrong.append(f"{r['id']} ({r['spec'] or 'clean'} on {r['shape']}): {r.get(key)}")
        if mine:
            out[cls] = {"runs": len(mine), "faults": tp + fn, "found": tp, "missed": fn, "false": fp,
                        "precision": _pct(tp, tp + fp), "recall": _pct(tp, tp + fn), "wrong": wrong}
    return out


def _pct(a: int, b: int) -> float | None:
    return round(100.0 * a / b, 1) if b else None


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    judged = [r for r in rows if r["recording"] and "verdict" in r]
    per: dict[str, Any] = {}
    for cls in CLASSES:
        mine = [r for r in judged if r["cls"] == cls]
        tp = [r for r in mine if r["verdict"] == cls]
        fp = [r for r in judged if r["cls"] != cls and r["cls"] not in EXTRA and r["verdict"] == cls]
        right = [r for r in tp if sorted(r["culprit"]) == sorted(r["truth"])]
        det = sorted(r["detect_s"] for r in tp if r.get("detect_s") is not None)
        fr_kind = "mismatch" if cls == "mismatch" else "hang"
        fr_seen = [r for r in mine if r["fr"] == fr_kind]
        fr_right = [r for r in fr_seen if sorted(r["fr_culprit"]) == sorted(r["truth"])]
        sd_seen = [r for r in mine if r["sd"] == "slow_rank"]
        sd_right = [r for r in sd_seen if sorted(r["sd_culprit"]) == sorted(r["truth"])]
        per[cls] = {"runs": len(mine), "precision": _pct(len(tp), len(tp) + len(fp)),
                    "recall": _pct(len(tp), len(mine)), "attribution": _pct(len(right), len(tp)),
                    "detect_median_s": round(statistics.median(det), 3) if det else None,
                    "detect_worst_s": round(det[-1], 3) if det else None,
                    "detect_p90_s": round(det[min(len(det) - 1, int(0.9 * len(det)))], 3) if det else None,
                    "flight_recorder": {"flagged": _pct(len(fr_seen), len(mine)),
                                        "right_rank": _pct(len(fr_right), len(mine)), "as": fr_kind},
                    "straggler": {"flagged": _pct(len(sd_seen), len(mine)),
                                  "right_rank": _pct(len(sd_right), len(mine)), "as": "slow_rank"},
                    "missed": [f"{r['id']} ({r['spec']} on {r['shape']}): {r['verdict']} {r['culprit']}"
                               for r in mine if r["verdict"] != cls or sorted(r["culprit"]) != sorted(r["truth"])]}
    clean = [r for r in judged if r["cls"] == "clean"]
    alarms = [r for r in clean if r["verdict"] != "healthy"]
    fr_alarms = [r for r in clean if r["fr"] != "healthy"]
    sd_alarms = [r for r in clean if r["sd"] != "healthy"]
    pairs = []
    by_id = {r["id"]: r for r in rows}
    for r in clean:
        off = by_id.get(r["id"].replace("clean-", "clean-off-"))
        if off and r.get("iteration_s") and off.get("iteration_s"):
            steps = STEPS
            pairs.append({"iteration": (r["iteration_s"] - off["iteration_s"]) / off["iteration_s"],
                          "wall": ((r["run_wall_s"] or 0) - (off["run_wall_s"] or 0)) / steps})
    overhead = {"pairs": len(pairs),
                "iteration_median_pct": round(100 * statistics.median(p["iteration"] for p in pairs), 2)
                if pairs else None,
                "wall_per_step_median_ms": round(1e3 * statistics.median(p["wall"] for p in pairs), 1)
                if pairs else None}
    analyse = [r["analyse_s"] for r in judged if "analyse_s" in r]
    # Every injected run's detection time (its first finding's), for the p90 goal (Mycroft: 15 s).
    every = sorted(r["detect_s"] for r in judged if r.get("detect_s") is not None and r["verdict"] != "healthy")
    def key(x: list[Any]) -> tuple[str, str]:
        return x[0], str(x[1])
    damaged = [r for r in judged if {key(x) for x in r.get("damaged_found", [])} - {key(y) for y in r.get("found", [])}]
    up = [r for r in judged if r["cls"] == "uplink" and "uplink_named" in r]
    return {"per_class": per, "set_post_hoc": set_scores(judged, "found"), "set_live": set_scores(judged, "live_found"),
            "scenario_post_hoc": scenario_scores(judged, "found"), "scenario_live": scenario_scores(judged, "live_found"),
            "uplink_node_named": {"runs": len(up), "named": sum(1 for r in up if r["uplink_named"])},
            "live_before_onset": [f"{r['id']}: {r['live_early']}" for r in judged if r.get("live_early")],
            "damaged": {"runs": len(judged), "extra_findings": len(damaged),
                        "which": [f"{r['id']}: {r['damaged_found']}" for r in damaged]}, "clean": {"runs": len(clean), "false_alarms": len(alarms),
                                        "alarms": [f"{r['id']}: {r['findings']}" for r in alarms],
                                        "flight_recorder_false_alarms": len(fr_alarms),
                                        "straggler_false_alarms": len(sd_alarms)},
            "overhead": overhead, "runs": len(rows),
            "replay_s_per_run_median": round(statistics.median(analyse), 4) if analyse else None,
            "detect_all": {"runs": len(every), "p90_s": round(every[min(len(every) - 1, int(0.9 * len(every)))], 3)
                           if every else None, "max_s": every[-1] if every else None},
            "thresholds": asdict(Thresholds())}


def print_table(summary: dict[str, Any]) -> None:
    def f(x: Any) -> str:
        return "-" if x is None else f"{x}"
    print(f"{'class':<13} {'runs':>4} {'prec%':>6} {'recall%':>7} {'attrib%':>7} {'det med s':>9} {'det max s':>9}"
          f" | {'FlightRec seen/right%':>21} | {'Straggler seen/right%':>21}")
    for cls, m in summary["per_class"].items():
        fr, sd = m["flight_recorder"], m["straggler"]
        print(f"{cls:<13} {m['runs']:>4} {f(m['precision']):>6} {f(m['recall']):>7} {f(m['attribution']):>7} "
              f"{f(m['detect_median_s']):>9} {f(m['detect_worst_s']):>9} | "
              f"{f(fr['flagged']) + '/' + f(fr['right_rank']) + ' as ' + fr['as']:>21} | "
              f"{f(sd['flagged']) + '/' + f(sd['right_rank']):>21}")
    c = summary["clean"]
    print(f"clean runs {c['runs']}: false alarms doctor {c['false_alarms']}, Flight Recorder "
          f"{c['flight_recorder_false_alarms']}, straggler detector {c['straggler_false_alarms']}")
    for a in c["alarms"]:
        print(f"  alarm {a}")
    o = summary["overhead"]
    print(f"recording overhead on {o['pairs']} clean pairs (same plan, recording off, same bench run): "
          f"iteration time {f(o['iteration_median_pct'])} % (median), wall per step "
          f"{f(o['wall_per_step_median_ms'])} ms (median; link probes included)")
    print(f"replay: {f(summary['replay_s_per_run_median'])} s per run (median)")
    da = summary["detect_all"]
    print(f"onset -> detection over every injected run's first finding: p90 {f(da['p90_s'])} s, max {f(da['max_s'])} s "
          f"({da['runs']} runs; goal p90 <= 15 s)")
    print(f"{'set matching':<13} {'faults':>6} {'post prec%':>10} {'post rec%':>9} {'live prec%':>10} {'live rec%':>9}")
    for cls in CLASSES:
        a, b = summary["set_post_hoc"][cls], summary["set_live"][cls]
        print(f"{cls:<13} {a['faults']:>6} {f(a['precision']):>10} {f(a['recall']):>9} {f(b['precision']):>10} "
              f"{f(b['recall']):>9}")
    print(f"{'scenario':<13} {'runs':>4} {'faults':>6} {'post found/missed/false':>23} {'live found/missed/false':>23}")
    for cls, a in summary["scenario_post_hoc"].items():
        b = summary["scenario_live"].get(cls, {})
        print(f"{cls:<13} {a['runs']:>4} {a['faults']:>6} {a['found']:>11}/{a['missed']}/{a['false']:<7} "
              f"{b.get('found', '-'):>11}/{b.get('missed', '-')}/{b.get('false', '-')}")
    for cls, a in summary["scenario_post_hoc"].items():
        for w in a["wrong"]:
            print(f"  {cls} post hoc wrong: {w}")
    for cls, a in summary["scenario_live"].items():
        for w in a["wrong"]:
            print(f"  {cls} live wrong: {w}")
    u = summary["uplink_node_named"]
    print(f"uplink runs whose findings name the node: {u['named']} of {u['runs']}")
    print(f"live findings before the onset: {len(summary['live_before_onset'])} runs "
          + "; ".join(summary["live_before_onset"]))
    dm = summary["damaged"]
    print(f"damaged file (rank 0's records cut at 70 %): {dm['extra_findings']} of {dm['runs']} runs gained a "
          f"finding " + "; ".join(dm["which"]))
    for cls, m in summary["per_class"].items():
        for miss in m["missed"]:
            print(f"  {cls} missed/misattributed: {miss}")


def cpu_hog() -> list[subprocess.Popen[bytes]]:
    """The issue's loaded machine: a busy loop on each core (ended by the caller)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 run per class and 1 clean pair")
    ap.add_argument("--per-class", type=int, default=20)
    ap.add_argument("--clean", type=int, default=None, help="clean runs (default: --per-class)")
    ap.add_argument("--seed", type=int, default=1000, help="case seed (thresholds were tuned on seeds < 1000)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once")
    ap.add_argument("--out", default=None, help="where the run folders are kept (default: a new temp dir)")
    ap.add_argument("--replay", metavar="DIR", default=None, help="analyse the run folders in DIR again")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--load", action="store_true", help="run beside a CPU hog: a busy loop on each core")
    ap.add_argument("--only", default=None, metavar="CLASSES", help="comma-separated classes to run (e.g. "
                    "uplink,stop_resume,hog,clean); the cases are drawn as for all, then filtered")
    args = ap.parse_args(argv)
    th = Thresholds()
    t0 = time.time()
    if args.replay:
        root = Path(args.replay)
    else:
        per = 1 if args.quick else args.per_class
        clean = 1 if args.quick else (args.clean if args.clean is not None else per)
        root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="plait-doctor-bench-"))
        root.mkdir(parents=True, exist_ok=True)
        cases = make_cases(per, clean, args.seed)
        if args.only:
            keep = {c.strip() for c in args.only.split(",")}
            cases = [c for c in cases if c.cls in keep]
        # Interleave classes so a drifting machine touches every class alike.
        order = sorted(cases, key=lambda c: (int(c.id.rsplit("-", 1)[1]), c.id))
        print(f"running {len(order)} runs into {root} ({args.jobs} at a time)"
              + (", beside a busy loop on each core" if args.load else ""), file=sys.stderr)
        hogs = cpu_hog() if args.load else []
        try:
            with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
                for i, res in enumerate(pool.map(lambda c: run_case(c, root), order)):
                    print(f"  [{i + 1}/{len(order)}] {res['case']['id']} rc={res['rc']} {res['wall_s']:.0f} s",
                          file=sys.stderr)
        finally:
            for h in hogs:
                h.kill()
    rows = [r for d in sorted(p for p in root.iterdir() if (p / "case.json").exists())
            if (r := analyse_case(d, th)) is not None]
    summary = summarise(rows)
    summary["wall_s"] = round(time.time() - t0, 1)
    summary["dir"] = str(root)
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1, default=str))
    else:
        print_table(summary)
        print(f"run folders: {root} (replay: python bench/doctor.py --replay {root}); wall {summary['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
