"""Kill a rank, recover: how long from detection to training again, and is the new plan as fast
as predicted?

    python bench/recovery.py            # 4 ranks on emulated-mixed (2 nodes x 2), kill rank 1 -> 2 ranks
    python bench/recovery.py --quick    # fewer steps, no pinned re-run of the new plan
    python bench/recovery.py --json     # one JSON object: {"rows": [...], "summary": {...}}

One `plait.recover.recover` run: a 4-rank plan on the emulated cluster, rank `--kill-rank` killed
(SIGKILL) at step `--kill-step`, checkpoints every `--checkpoint-every` steps. The launcher names
the dead rank, the loop isolates its node, re-plans the same model and global batch on the node
left (2 ranks) and resumes from the last checkpoint, resharded.

Rows:

* **phase N**: its plan and nodes; the simulator's iteration time on the phase's cluster (the
  cluster file's GPUs, what the planner ranks by); the prediction *for this machine*
  (`plait.measure.machine.LocalMachine` calibrated on the phase's cluster: measured links,
  gloo's cost, layer times profiled side by side, then the same simulator); and the median of
  the phase's measured steps after its first;
* **new plan, pinned re-run xN** (`--rounds`, default 3, none with --quick): the recovered plan
  run again by LocalMachine itself, with the layer profiles bracketing each run -- the protocol
  of `bench/sim_vs_real.py`; the round with the median error is shown;
* **recovery**: detection (the launcher's) -> job stopped -> re-planned -> first step of the new
  phase started;
* **baseline, same run**: a plain `plait run --resume` of the recovered plan from a copy of the
  same checkpoint, from the call to its first step: the restart cost any resume pays. Recovery's
  own overhead is the difference.

By default every phase's ranks, the baseline's and LocalMachine's run the same way: rank r in a
cpu cgroup on CPU r mod CPUs with a high `cpu.shares` (`plait.runtime.cpu_share`), freed memory
kept (`plait.measure.machine.MALLOC_ENV`) -- the conditions the prediction for this machine
assumes; `--no-pin` runs the phases as plain `plait run --recover` does (on a shared machine
their steps then take what other processes leave).

Goals (issue 15): detection to training again < 60 s; the new plan's measured step within 10 %
of its prediction where the machine has a CPU per rank (here 2 CPUs: the phase after recovery,
2 ranks; the 4-rank phase before it time-shares the CPUs and is reported, not judged).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=256,dropout=0,attn_dropout=0"
PLAN = "dp=4,micro_batch=2,global_batch=16,dtype=fp32"
CLUSTER = "emulated-mixed"
DETECT_GOAL_S = 60.0
PREDICT_GOAL = 0.10


def machine_prediction(cluster_yaml: Path, model: str, plan: str, rerun_steps: int, rounds: int) -> dict[str, Any]:
    """LocalMachine on one phase's cluster: the prediction for this machine, and (rounds > 0) pinned
    re-runs of the plan, each with the layer profiles bracketing it (the median round is kept)."""
    from plait.ir.plan import Plan
    from plait.measure.machine import LocalMachine

    out: dict[str, Any] = {}
    t0 = time.time()
    # calibrated for the plan's ranks: the plan re-planned on the nodes left may leave GPUs idle
    with LocalMachine(str(cluster_yaml), model, ranks=Plan.load(plan).world_size) as m:
        out["calibration_s"] = time.time() - t0
        out["predicted_s"] = m.predict(plan).iteration_s
        out["notes"] = list(m.notes)
        runs = [m.measure_and_predict(plan, steps=rerun_steps).summary() for _ in range(rounds)]
        if runs:
            runs.sort(key=lambda r: abs(r["error"]))
            out["rerun"] = {**runs[len(runs) // 2], "rounds": len(runs),
                            "errors": [r["error"] for r in runs]}
    return out


def first_step_wall(run_dir: Path, world: int) -> float | None:
    from plait.runtime.api import read_step_records

    started = read_step_records(run_dir, world).started_wall
    return started[min(started)] if started else None


def baseline_resume(res: Any, work: Path, env: dict[str, str]) -> dict[str, Any]:
    """Plain resume of the recovered plan from a copy of the checkpoint it resumed from."""
    from plait.runtime import checkpoint as ckpt
    from plait.runtime.api import CheckpointConfig, LaunchConfig, RecordsConfig, TrainingConfig, run

    t = res.transitions[0]
    after = res.phases[t.after_phase + 1]
    ck = work / "baseline-ck"
    if t.resumed_from:
        shutil.copytree(ckpt.step_dir(Path(res.run_dir) / "checkpoints", t.resumed_from),
                        ckpt.step_dir(ck, t.resumed_from))
    rdir = work / "baseline"
    t0 = time.time()
    out = run(res.model, str(Path(after.run_dir) / "cluster.yaml"), Path(after.run_dir) / "plan.json",
              steps=t.resumed_from + 2, training=TrainingConfig(dtype="fp32"),
              checkpoint=CheckpointConfig(dir=ck, resume=bool(t.resumed_from)),
              launch=LaunchConfig(timeout=120, env=env), records=RecordsConfig(run_dir=rdir, step_records=True))
    first = first_step_wall(rdir, after.world_size)
    return {"call_to_train_s": (first - t0) if first else None, "steps": out.steps}


def measure(model: str, cluster: str, plan: str, steps: int, kill_rank: int, kill_step: int,
            checkpoint_every: int, work: Path, machine: bool, rerun_steps: int,
            say: Any = lambda text: None, pin: bool = False, rounds: int = 0) -> dict[str, Any]:
    """The bench's core: one recovery, the baseline resume and (machine) this machine's predictions.
    `pin`: every phase's ranks (and the baseline's) run as LocalMachine runs them -- rank r in a cpu
    cgroup on CPU r mod CPUs with a high cpu.shares, freed memory kept -- so the measurement is
    taken under the conditions the prediction for this machine assumes (root, cgroup v1)."""
    from contextlib import ExitStack

    from plait.measure.machine import MALLOC_ENV, SHARES
    from plait.runtime.cpu_share import RankCgroups, pinned

    with ExitStack() as stack:
        env: dict[str, str] = {}
        pinning = "off"
        if pin:
            world = 4 * (os.cpu_count() or 1)  # enough groups for any phase
            groups = stack.enter_context(RankCgroups(world, shares=SHARES, cpuset=pinned(world)))
            env = {**groups.env(), **MALLOC_ENV}
            pinning = groups.describe() if groups.active else f"off: {groups.reason}"
        out = _measure(model, cluster, plan, steps, kill_rank, kill_step, checkpoint_every, work, machine,
                       rerun_steps, say, env, rounds)
    out["summary"]["pinning"] = pinning
    return out


def _measure(model: str, cluster: str, plan: str, steps: int, kill_rank: int, kill_step: int,
             checkpoint_every: int, work: Path, machine: bool, rerun_steps: int, say: Any,
             env: dict[str, str], rounds: int) -> dict[str, Any]:
    from plait.recover import RecoveryConfig, recover
    from plait.runtime.api import CheckpointConfig, FaultsConfig, LaunchConfig, TrainingConfig

    t0 = time.time()
    res = recover(model, cluster, plan, steps, run_dir=work / "run", training=TrainingConfig(dtype="fp32"),
                  launch=LaunchConfig(timeout=60, env=env), checkpoint=CheckpointConfig(keep=None),
                  config=RecoveryConfig(checkpoint_every=checkpoint_every, live=False), say=say,
                  faults=FaultsConfig(inject=f"kill:rank={kill_rank},step={kill_step}"))
    say(f"recovery run done in {time.time() - t0:.0f} s")
    if not res.transitions:
        raise SystemExit(f"no recovery happened (phases: {[p.ended for p in res.phases]})")
    base = baseline_resume(res, work, env)
    say(f"baseline resume: {base['call_to_train_s']:.1f} s from call to first step")
    cpus = os.cpu_count() or 1
    rows: list[dict[str, Any]] = []
    for p in res.phases:
        row: dict[str, Any] = {"row": f"phase {p.index}", "plan": p.plan, "nodes": p.nodes, "ranks": p.world_size,
                               "from_step": p.start_step, "steps_measured": len(p.iteration_times),
                               "predicted_cluster_s": p.predicted_step_s, "measured_s": p.measured_step_s,
                               "cpu_per_rank": p.world_size <= cpus, "ended": p.ended.split(":")[0]}
        if machine:
            say(f"phase {p.index}: calibrating this machine on its cluster ({p.world_size} ranks)")
            last = p.index == len(res.phases) - 1
            mp = machine_prediction(Path(p.run_dir) / "cluster.yaml", model, p.plan, rerun_steps,
                                    rounds if last and p.world_size <= cpus else 0)
            row["predicted_machine_s"] = mp["predicted_s"]
            row["calibration_s"] = mp["calibration_s"]
            if p.measured_step_s:
                row["error"] = (mp["predicted_s"] - p.measured_step_s) / p.measured_step_s
            row["notes"] = mp["notes"]
            if "rerun" in mp:
                r = mp["rerun"]
                rows.append(row)
                row = {"row": f"new plan, pinned re-run x{r['rounds']}", "plan": p.plan, "nodes": p.nodes,
                       "ranks": p.world_size, "predicted_machine_s": r["predicted_iteration_s"],
                       "measured_s": r["measured_iteration_s"], "error": r["error"], "round_errors": r["errors"],
                       "cpu_per_rank": p.world_size <= cpus, "profile_drift": r["profile_drift"]}
        rows.append(row)
    for t in res.transitions:
        rows.append({"row": f"recovery after phase {t.after_phase}", "isolated": t.nodes,
                     "resumed_from": t.resumed_from, "lost_steps": t.lost_steps,
                     "detect_to_stopped_s": t.detect_to_stopped_s, "plan_s": t.plan_s,
                     "stopped_to_train_s": t.stopped_to_train_s, "detect_to_train_s": t.detect_to_train_s})
    rows.append({"row": "baseline: plain resume, same run", **base})
    t = res.transitions[0]
    after = [r for r in rows if r["row"].startswith("phase") and r["row"] != "phase 0"][-1]
    rerun = next((r for r in rows if r["row"].startswith("new plan")), None)
    summary = {
        "detect_to_train_s": t.detect_to_train_s, "detect_goal_s": DETECT_GOAL_S,
        "detect_goal_met": t.detect_to_train_s < DETECT_GOAL_S,
        "recovery_overhead_over_resume_s": (t.stopped_to_train_s - base["call_to_train_s"])
        if base["call_to_train_s"] is not None else None,
        "ranks_before": res.phases[0].world_size, "ranks_after": after["ranks"], "cpus": cpus,
        "after_error": after.get("error"), "predict_goal": PREDICT_GOAL,
        "predict_goal_met": abs(after["error"]) <= PREDICT_GOAL if after.get("error") is not None else None,
        "rerun_error": rerun["error"] if rerun else None,
        "losses": {str(k): v for k, v in res.losses.items()},
    }
    return {"rows": rows, "summary": summary}


def _ms(x: Any) -> str:
    return f"{x * 1e3:.2f}" if isinstance(x, int | float) else "-"


def print_table(out: dict[str, Any]) -> None:
    print(f"{'row':<28} {'ranks':>5} {'pred. GPUs ms':>13} {'pred. here ms':>13} {'measured ms':>11} "
          f"{'error':>7}  plan")
    for r in out["rows"]:
        if "ranks" in r:
            err = f"{r['error'] * 100:+.1f}%" if r.get("error") is not None else "-"
            flag = "" if r.get("cpu_per_rank", True) else "  (ranks > CPUs: not judged)"
            print(f"{r['row']:<28} {r['ranks']:>5} {_ms(r.get('predicted_cluster_s')):>13} "
                  f"{_ms(r.get('predicted_machine_s')):>13} {_ms(r.get('measured_s')):>11} {err:>7}  "
                  f"{r['plan']}{flag}")
    for r in out["rows"]:
        if r["row"].startswith("recovery"):
            print(f"{r['row']}: isolated {', '.join(r['isolated'])}; resumed from checkpoint {r['resumed_from']} "
                  f"({r['lost_steps']} steps re-run); detection -> stopped {r['detect_to_stopped_s']:.1f} s, "
                  f"re-plan {r['plan_s']:.1f} s, stopped -> training {r['stopped_to_train_s']:.1f} s; "
                  f"detection -> training again {r['detect_to_train_s']:.1f} s")
        if r["row"].startswith("baseline"):
            v = r["call_to_train_s"]
            print(f"{r['row']}: call -> first step {v:.1f} s" if v is not None else f"{r['row']}: no step ran")
    s = out["summary"]
    print(f"ranks pinned: {s.get('pinning', 'off')}")
    print(f"detection to training again {s['detect_to_train_s']:.1f} s (goal < {s['detect_goal_s']:.0f} s: "
          f"{'met' if s['detect_goal_met'] else 'NOT met'})")
    if s["after_error"] is not None:
        print(f"after recovery ({s['ranks_after']} ranks on {s['cpus']} CPUs): predicted for this machine vs "
              f"measured {s['after_error'] * 100:+.1f}% (goal within {s['predict_goal'] * 100:.0f}%: "
              f"{'met' if s['predict_goal_met'] else 'NOT met'})"
              + (f"; pinned re-runs of the new plan, median round {s['rerun_error'] * 100:+.1f}%"
                 if s.get("rerun_error") is not None else ""))
    if "load_average" in s:
        print(f"load average of this machine during the bench: {s['load_average']} on {s['cpus']} CPUs")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 steps, no pinned re-run of the new plan")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--cluster", default=CLUSTER)
    ap.add_argument("--plan", default=PLAN)
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 24; quick 10)")
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--kill-step", type=int, default=None, help="default: a third of the steps, off a checkpoint")
    ap.add_argument("--checkpoint-every", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=None,
                    help="pinned re-runs of the new plan with bracketing profiles (default 3; quick 0)")
    ap.add_argument("--no-machine", action="store_true", help="skip this machine's predictions (LocalMachine)")
    ap.add_argument("--no-pin", action="store_true",
                    help="run the phases unpinned (default: pinned one rank per CPU, as LocalMachine runs them)")
    ap.add_argument("--workdir", default=None, help="keep the run folders here (default: a temporary folder)")
    args = ap.parse_args(argv)
    steps = args.steps or (10 if args.quick else 24)
    kill = args.kill_step if args.kill_step is not None else max(1, steps // 3) | 1
    if not 0 < kill < steps:
        ap.error(f"--kill-step must be in 1..{steps - 1}")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="plait-bench-recovery-"))
    work.mkdir(parents=True, exist_ok=True)

    def say(text: str) -> None:
        print(f"  {text}", file=sys.stderr, flush=True)

    t0 = time.time()
    out = measure(args.model, args.cluster, args.plan, steps, args.kill_rank, kill, args.checkpoint_every, work,
                  not args.no_machine, 10, say, pin=not args.no_pin,
                  rounds=args.rounds if args.rounds is not None else (0 if args.quick else 3))
    out["summary"]["bench_s"] = time.time() - t0
    out["summary"]["load_average"] = [round(x, 1) for x in os.getloadavg()]  # other work on the machine
    out["config"] = {"model": args.model, "cluster": args.cluster, "plan": args.plan, "steps": steps,
                     "kill_rank": args.kill_rank, "kill_step": kill, "checkpoint_every": args.checkpoint_every,
                     "workdir": str(work)}
    if args.json:
        print(json.dumps(out, indent=1, default=str))
    else:
        print_table(out)
        losses = out["summary"]["losses"]
        print("loss curve: " + " ".join(f"{k}:{v:.4f}" for k, v in losses.items()))
        print(f"bench took {out['summary']['bench_s']:.0f} s; run folders in {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
