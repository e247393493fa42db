"""The recovery loop: isolate what the diagnosis names, re-plan for the cluster left, reshard the
last checkpoint onto the new plan, train on (C4D, HPCA'25 §5, extended: C4 restarts the *same*
plan on spare nodes; here the planner re-plans for the smaller, possibly uneven cluster).

    result = recover("gpt:layers=4,hidden=64,heads=4,seq=32,vocab=256", "emulated-mixed",
                     "dp=4,micro_batch=2,global_batch=16,dtype=fp32", steps=20, run_dir="runs/r1",
                     config=RecoveryConfig(checkpoint_every=2), faults=FaultsConfig(inject="kill:rank=1,step=5"))
    result.phases[-1].plan, result.transitions[0].detect_to_train_s

One job is a sequence of *phases*, each one `plait.runtime.api.run` of one plan on one cluster
(`RUN_DIR/phase-N/`). A phase ends when

* the launcher stops it (a rank died, or hung past the heartbeat timeout), or the live
  diagnosis (`detect`, polled through the launcher's `watch`) names a culprit: the loop maps the
  culprit ranks to nodes (`plait.recover.isolate`), removes them from the cluster, asks the
  search driver (`plait.search.search_plans`, timed by the simulator of the cluster left) for the fastest plan of the same model and global batch on
  what is left, and starts the next phase from the last complete checkpoint
  (`torch.distributed.checkpoint` reshards it onto the new plan: `plait.runtime.checkpoint`);
* a node the loop isolated is declared repaired (a line with its name in `RUN_DIR/rejoin`, or
  `RecoveryConfig.rejoin_at`): at the next complete checkpoint the loop stops the job and grows
  it the same way (re-plan on the larger cluster, reshard, resume);
* training reached `steps`.

The data order is the run's global sample stream (`plait.runtime.data`: step s takes samples
[s*B, (s+1)*B) whatever the plan), and the global batch B is kept, so the steps after the
checkpoint see the same samples as an uninterrupted run: nothing beyond the last checkpoint is
lost and the loss curve continues. Faults injected for the first phase (`FaultsConfig.inject` and
`comm_faults`) stand for the hardware that gets isolated; later phases run without them.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait.cluster import load_cluster
from plait.cluster.loader import save_cluster
from plait.cluster.spec import Cluster, ClusterSource
from plait.doctor.live import DoctorConfig, Persistence
from plait.ir.diagnosis import REPORT_ONLY, Diagnosis, Finding
from plait.ir.formats import stamp
from plait.ir.plan import Plan, PlanSource
from plait.planners.options import ThreeDOptions
from plait.recover.detect import Detect, actionable, call_detect, default_detect, launcher_diagnosis
from plait.recover.isolate import Isolation, RecoveryError, nodes_to_isolate, remaining_cluster
from plait.runtime import checkpoint as ckpt
from plait.runtime.api import RunFailure, RunResult, rank_layout, read_step_records, run
from plait.runtime.config import (
    CheckpointConfig,
    FaultsConfig,
    LaunchConfig,
    RecordsConfig,
    TrainingConfig,
)

if TYPE_CHECKING:  # torch and the zoo load where a model is built
    from plait.graph.resolve import ModelSource
    from plait.graph.zoo.registry import ModelSpec

REJOIN_FILE = "rejoin"
# Launcher failures passed on to the user: a Python error in a rank (a bug recurs on any plan) and a
# run stopped from outside (a signal).
PASSED_ON = ("failed", "terminated")


@dataclass
class RecoveryConfig:
    """How the recovery loop behaves."""

    checkpoint_every: int = 2
    """Steps between checkpoints: the most training a fault can cost."""
    max_recoveries: int = 3
    """Shrinks allowed before the loop gives up (a fault that follows the job is not hardware)."""
    live: bool = True
    """Ask `detect` during each phase too (slow ranks and links never stop a job by themselves)."""
    detect_every: float = 2.0
    """Seconds between live diagnoses."""
    rejoin_at: dict[str, int] = field(default_factory=dict)
    """Scripted repairs: node name -> the step from which it is declared back (as if a line with
    its name were written to RUN_DIR/rejoin then)."""
    top: int = 1
    """Plans the search driver returns (the fastest is used)."""
    search: ThreeDOptions = field(default_factory=ThreeDOptions)
    """The 3D family's options of each re-plan (`plait.planners.options.ThreeDOptions`: finalists,
    placement, ...); without a `space`, the old plan's dtype is kept."""
    persist: int | None = None
    """K: a live finding is acted on (or, for a slow rank, reported) only once K consecutive live
    diagnoses (`detect_every` apart) have named it (same class, same ranks) -- the doctor's live
    persistence (`plait.doctor.live.DoctorConfig`). None: derived from `detect_every` and the
    15 s detection goal (3 at 2 s polls). The doctor itself already needs >= 3 slow probes or
    steps (`Thresholds.min_hits`, `link_min_hits`) and a stall of >= 4 median steps; K adds that
    the evidence still stands K polls later, so a stall that resolved (a rank stopped, then
    resumed) or one noisy poll never stops the job nor reports a rank. A slowness finding counts
    toward an action only while it is ongoing -- its last slow probe or step is the newest one
    (`ongoing`): a burst of load that slowed three probes and passed stays in the doctor's
    history, but is no longer slow."""
    advise: bool = False
    """Report what would be done (`RecoveryResult.actions`, done=False) without doing it: live
    findings never stop the job, and a failed phase is passed on instead of isolated."""


@dataclass
class Phase:
    """One run of one plan on one cluster."""

    index: int
    plan: str
    cluster: str
    nodes: list[str]
    excluded: list[str]
    world_size: int
    predicted_step_s: float
    """The simulator's iteration time for this plan on this phase's cluster (the planner's figure)."""
    run_dir: str
    start_step: int = 0
    measured_step_s: float | None = None
    """Median measured iteration time of the phase's steps after its first."""
    losses: dict[int, float] = field(default_factory=dict)
    iteration_times: dict[int, float] = field(default_factory=dict)
    ended: str = "running"
    """finished | failed: <launcher's message> | diagnosed: <what> | rejoin: <node>."""
    diagnosis: dict[str, Any] | None = None
    isolation: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["losses"] = {str(k): v for k, v in self.losses.items()}
        d["iteration_times"] = {str(k): v for k, v in self.iteration_times.items()}
        return d


@dataclass
class Transition:
    """From the end of one phase to training on the next: where the time went."""

    after_phase: int
    reason: str
    """isolate | rejoin."""
    nodes: list[str]
    """Nodes removed (isolate) or added back (rejoin)."""
    resumed_from: int
    """Checkpoint step the next phase starts from (0: no checkpoint yet, from the start)."""
    lost_steps: int
    """Steps that had run past that checkpoint and are run again."""
    detect_to_stopped_s: float
    plan_s: float
    stopped_to_train_s: float
    detect_to_train_s: float
    """From the moment the fault was detected to the first step of the next phase starting."""


@dataclass
class RecoveryResult:
    model: str
    steps: int
    phases: list[Phase]
    transitions: list[Transition]
    run_dir: str
    actions: list[dict[str, Any]] = field(default_factory=list)
    """Every action (isolate) or report (a slow rank, advice) with its evidence: the findings it
    rests on, the nodes and why, whether it was done (`advise`: never)."""

    @property
    def losses(self) -> dict[int, float]:
        """The loss curve: per step, the loss of the phase that last ran it (a step re-run after a
        checkpoint is reported from its re-run)."""
        out: dict[int, float] = {}
        for p in self.phases:
            out.update(p.losses)
        return dict(sorted(out.items()))

    def to_dict(self) -> dict[str, Any]:
        return stamp("recovery", {
            "model": self.model, "steps": self.steps, "run_dir": self.run_dir,
            "phases": [p.to_dict() for p in self.phases],
            "transitions": [dataclasses.asdict(t) for t in self.transitions],
            "actions": list(self.actions),
            "losses": {str(k): v for k, v in self.losses.items()}})


# ---------------------------------------------------------------------------------- the watch
class _Watch:
    """The launcher's `watch` for one phase: live diagnosis and rejoin requests."""

    def __init__(self, phase_dir: Path, root: Path, ck_dir: Path, excluded: list[str], detect: Detect,
                 config: RecoveryConfig, start: int, rejoin_at: dict[str, int]) -> None:
        self.phase_dir, self.root, self.ck_dir = phase_dir, root, ck_dir
        self.excluded, self.detect, self.config = excluded, detect, config
        self.diagnosis: Diagnosis | None = None
        self.what = ""  # what the live diagnosis named
        self.rejoin: list[str] = []
        self.rejoin_after: int | None = None  # the newest checkpoint when the request was seen
        self.last_detect = time.time()
        self.notes: list[str] = []
        self.start = start
        self.rejoin_at = rejoin_at  # scripted repairs not yet acted on
        if self._requests():  # declared back before this phase started: its first checkpoint grows it
            self.rejoin_after = start
        doctor = DoctorConfig(poll_s=config.detect_every, persist_polls=config.persist)
        self.persist = doctor.polls()
        self.to_report = Persistence(doctor)  # every finding naming ranks: slow ranks are reported
        self.to_act = Persistence(doctor)  # ongoing ones only: what may stop the job
        self.reported: set[tuple[str, tuple[int, ...]]] = set()
        self.actions: list[dict[str, Any]] = []  # reports and advice (the loop adds what it did)
        self.isolate: Any = None  # diagnosis -> Isolation for advice (set by the loop)

    def _step(self) -> int:
        steps = []
        for f in (self.phase_dir / "hb").glob("rank*.json"):
            try:
                steps.append(int(json.loads(f.read_text()).get("step") or 0))
            except (OSError, ValueError, TypeError):
                continue
        return max(self.start, min(steps, default=0))

    def _requests(self) -> list[str]:
        step = self._step()
        path = self.root / REJOIN_FILE
        for node, at in self.rejoin_at.items():
            if node in self.excluded and step >= at:
                names = path.read_text().split() if path.exists() else []
                if node not in names:
                    with open(path, "a") as fh:
                        fh.write(node + "\n")
        names = path.read_text().split() if path.exists() else []
        return [n for n in dict.fromkeys(names) if n in self.excluded]

    def __call__(self) -> str | None:
        wanted = self._requests()
        if wanted:
            latest = ckpt.latest_checkpoint(self.ck_dir)
            newest = latest[0] if latest else 0
            if self.rejoin_after is None:
                self.rejoin_after = newest
            if newest > self.rejoin_after:
                self.rejoin = wanted
                return f"node {', '.join(wanted)} declared back: growing the job at checkpoint {newest}"
        if self.config.live and time.time() - self.last_detect >= self.config.detect_every:
            self.last_detect = time.time()
            try:
                found = call_detect(self.detect, self.phase_dir, live=True)
            except Exception as exc:  # a live diagnosis must never take the job down
                self.notes.append(f"live diagnosis failed: {type(exc).__name__}: {exc}")
                return None
            return self._judge(found)
        return None

    def _judge(self, found: Diagnosis, now: float | None = None) -> str | None:
        """Act on the findings that persisted `persist` polls; report slow ranks that did; advise only."""
        now = time.time() if now is None else now
        named = [f for f in found.findings if f.ranks and not f.evidence.get("resumed")]  # resolved stalls: none
        reported = self.to_report.update(dataclasses.replace(found, findings=named), now).findings
        acted = self.to_act.update(dataclasses.replace(found, findings=[f for f in named if ongoing(f)]), now).findings
        for f in reported:
            if f.kind in REPORT_ONLY and (f.kind, f.ranks) not in self.reported:
                self.reported.add((f.kind, f.ranks))
                self.actions.append({"action": "report", "done": True, "at": now,
                                     "why": f"a slow but healthy rank is reported, never dropped (named in "
                                            f"{self.persist} consecutive live diagnoses)",
                                     "findings": [f.to_dict()]})
        lasting = [f for f in acted if f.kind not in REPORT_ONLY]
        if not lasting:
            return None
        kept = Diagnosis(run_dir=found.run_dir, findings=lasting, world_size=found.world_size,
                         warnings=found.warnings)
        if self.config.advise:
            new = [f for f in lasting if (f.kind, f.ranks) not in self.reported]
            if new:
                self.reported |= {(f.kind, f.ranks) for f in new}
                advice: dict[str, Any] = {"action": "isolate", "done": False, "at": now,
                                          "why": f"named in {self.persist} consecutive live diagnoses",
                                          "findings": [f.to_dict() for f in new]}
                if self.isolate is not None:
                    try:
                        advice.update(self.isolate(kept))
                    except Exception as exc:  # advice must never take the job down
                        advice["error"] = f"{type(exc).__name__}: {exc}"
                self.actions.append(advice)
            return None
        self.diagnosis = kept
        self.what = "; ".join(f"{f.kind} of ranks {list(f.ranks)}" for f in lasting)
        return f"the live diagnosis names {self.what} ({self.persist} polls in a row)"


def ongoing(f: Finding) -> bool:
    """A slowness finding whose newest probe (slow link) or step (slow rank) is still slow; any
    other finding (a stall, a death) as it is. Evidence as `plait.doctor.detect` writes it:
    `slow_steps` and the series `transfer_s` / `local_work_s` keyed by step."""
    steps, series = f.evidence.get("slow_steps"), f.evidence.get("transfer_s") or f.evidence.get("local_work_s")
    if not steps or not isinstance(series, dict) or not series:
        return True
    return max(steps) >= max(int(k) for k in series)


# ---------------------------------------------------------------------------------- planning
def predict_step(model: ModelSource, cluster: Cluster, plan: Plan) -> float:
    """The simulator's iteration time of `plan` on `cluster` (what the search driver ranks by)."""
    from plait.search import load_graph
    from plait.sim.api import PlanSimulator

    _, graph = load_graph(model, plan.dtype, "amp")  # as plait's engines train it
    return float(PlanSimulator(cluster).evaluate(graph, plan)["iteration_time_s"])


def replan(model: ModelSource, cluster: Cluster, old: Plan, config: RecoveryConfig) -> tuple[Plan, float]:
    """The fastest plan of `model` on `cluster` with `old`'s global batch and dtype, and its
    predicted iteration time."""
    from plait.planners.threed import SearchSpace
    from plait.search import SearchError, SearchOptions, search_plans
    from plait.sim.api import PlanSimulator

    own = config.search if config.search.space is not None else \
        dataclasses.replace(config.search, space=SearchSpace(dtype=old.dtype))
    try:
        found = search_plans(model, cluster, simulator=PlanSimulator(cluster),
                             common=SearchOptions(global_batch=old.global_batch, top=config.top), options=[own])
    except SearchError as exc:
        raise RecoveryError(f"re-planning for cluster '{cluster.name}' failed: {exc}") from None
    if not found.top:
        raise RecoveryError(f"no plan of global batch {old.global_batch} fits cluster '{cluster.name}' "
                            f"({len(cluster.devices)} devices left): {found.pruned_reasons}")
    best = found.best
    t = best.iteration_time_s if best.iteration_time_s is not None else best.analytic_s
    return best.plan, float(t)


# ---------------------------------------------------------------------------------- the loop
@dataclass
class _Job:
    """What stays the same over `recover`'s phases: its arguments, folders and record."""

    model: str | ModelSpec  # as `plait.runtime.api.run` takes it
    steps: int
    root: Path
    ck_dir: Path
    config: RecoveryConfig
    detect: Detect
    say: Any
    training: TrainingConfig
    checkpoint: CheckpointConfig
    launch: LaunchConfig
    records: RecordsConfig
    faults: FaultsConfig
    """The first phase's faults: they stand for the hardware that gets isolated."""
    later_faults: FaultsConfig
    rejoin_at: dict[str, int]
    """Scripted repairs not yet acted on."""
    result: RecoveryResult


@dataclass
class _Ended:
    """How one phase's run ended: `failure` is None when it trained to the last step."""

    phase: Phase
    watch: _Watch
    failure: RunFailure | None
    started: float
    stopped: float


def recover(model: str | ModelSpec, cluster: ClusterSource | None, plan: PlanSource, steps: int, *, run_dir: str | Path,
            config: RecoveryConfig | None = None, detect: Detect | None = None, say: Any = None,
            training: TrainingConfig = TrainingConfig(), checkpoint: CheckpointConfig = CheckpointConfig(),
            launch: LaunchConfig = LaunchConfig(), records: RecordsConfig = RecordsConfig(),
            faults: FaultsConfig = FaultsConfig()) -> RecoveryResult:
    """Train `model` for `steps` steps starting with `plan` on `cluster`, isolating faulty nodes
    and re-planning as they appear (module doc). The configs go to every phase's
    `plait.runtime.api.run` (`faults.inject` and `faults.comm_faults` only to the first);
    `checkpoint.dir` defaults to RUN_DIR/checkpoints and its `every` is `config.checkpoint_every`;
    `say(text)` gets progress lines."""
    config = config or RecoveryConfig()
    detect = detect or default_detect
    say = say or (lambda text: None)
    _check_arguments(config, cluster, checkpoint, launch, records)
    original = load_cluster(cluster)
    _check_rejoin(config, original)
    current = Plan.load(plan)
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / REJOIN_FILE).unlink(missing_ok=True)
    job = _Job(model=model, steps=steps, root=root,
               ck_dir=Path(checkpoint.dir) if checkpoint.dir is not None else root / "checkpoints",
               config=config, detect=detect, say=say, training=training, checkpoint=checkpoint, launch=launch,
               records=records, faults=faults,
               later_faults=dataclasses.replace(faults, inject=None, comm_faults=None),  # the hardware left is sound
               rejoin_at=dict(config.rejoin_at),  # each scripted repair happens once
               result=RecoveryResult(model=str(model), steps=steps, phases=[], transitions=[], run_dir=str(root)))
    emulate_dtype = launch.emulate_dtype or training.dtype or current.dtype
    excluded: list[str] = []
    isolations = 0
    cl = original
    predicted = predict_step(model, cl, current)
    pending: dict[str, Any] | None = None  # the transition being timed, until the next phase trains
    while True:
        ended = _run_phase(job, current, cl, excluded, predicted, pending)
        phase, watch, failure = ended.phase, ended.watch, ended.failure
        if failure is None:
            _write(job.result)
            say(f"phase {phase.index}: finished step {steps - 1}")
            return job.result
        detected = failure.detected_at or ended.stopped
        _raise_if_passed_on(job, ended, failure, current, cl)
        if watch.rejoin and failure.kind == "stopped" and watch.diagnosis is None:
            phase.ended = f"rejoin: {', '.join(watch.rejoin)}"
            nodes = _rejoin(list(watch.rejoin), root, job.rejoin_at)
            excluded = [n for n in excluded if n not in nodes]
            reason = "rejoin"
        else:
            iso = _isolate(job, ended, failure, current, cl, isolations)
            isolations += 1
            excluded = excluded + [n for n in iso.nodes if n not in excluded]
            reason, nodes = "isolate", iso.nodes
        t_plan = time.time()
        cl = remaining_cluster(original, excluded, emulate_dtype)
        current, predicted = replan(model, cl, current, config)
        pending = _transition(phase, job.ck_dir, reason, nodes, detected, ended.stopped, time.time() - t_plan)
        _write(job.result)


def _run_phase(job: _Job, plan: Plan, cluster: Cluster, excluded: list[str], predicted: float,
               pending: dict[str, Any] | None) -> _Ended:
    """Start the next phase, run it to its end under the watch and record what it trained, closing
    the `pending` transition at its first step."""
    i = len(job.result.phases)
    phase = _start_phase(i, job.root, job.ck_dir, plan, cluster, excluded, predicted, job.checkpoint.resume or i > 0)
    phase_dir, start = Path(phase.run_dir), phase.start_step
    job.result.phases.append(phase)
    _write(job.result)
    job.say(f"phase {i}: {plan} on {len(cluster.devices)} devices ({', '.join(phase.nodes)}), from step {start}; "
            f"predicted {predicted * 1e3:.2f} ms/step")
    watch = _Watch(phase_dir, job.root, job.ck_dir, excluded, job.detect, job.config, start, job.rejoin_at)
    watch.isolate = lambda d, plan=plan, cl=cluster: nodes_to_isolate(d, plan, cl).to_dict()
    started = time.time()
    failure: RunFailure | None = None
    done: RunResult | None = None
    phase_checkpoint = dataclasses.replace(job.checkpoint, dir=job.ck_dir, every=job.config.checkpoint_every,
                                           resume=start > 0)
    try:
        done = run(job.model, cluster, plan, job.steps, training=job.training, launch=job.launch, watch=watch,
                   checkpoint=phase_checkpoint, faults=job.faults if i == 0 else job.later_faults,
                   records=dataclasses.replace(job.records, run_dir=phase_dir, step_records=True))
        phase.ended = "finished"
    except RunFailure as exc:
        failure = exc
    stopped = time.time()
    job.result.actions += [{**a, "phase": i} for a in watch.actions]
    _collect(phase, plan.world_size, pending, job.result.transitions, done)
    return _Ended(phase=phase, watch=watch, failure=failure, started=started, stopped=stopped)


def _raise_if_passed_on(job: _Job, ended: _Ended, failure: RunFailure, plan: Plan, cluster: Cluster) -> None:
    """Raise the phase's `failure` where the loop does not act on it: under `advise` (after recording
    what it would have done), and for a launcher failure (PASSED_ON) no live diagnosis explains."""
    phase, watch = ended.phase, ended.watch
    if job.config.advise:  # report what would be done, do nothing
        diagnosis = _diagnose(failure, phase, watch, job.detect, plan, cluster, ended.started)
        advice = {"action": "isolate" if actionable(diagnosis) else "none", "done": False, "phase": phase.index,
                  "at": ended.stopped, "why": f"the phase stopped: {failure}",
                  "findings": [f.to_dict() for f in diagnosis.findings]}
        if actionable(diagnosis):
            try:
                advice.update(nodes_to_isolate(diagnosis, plan, cluster).to_dict())
            except RecoveryError as exc:
                advice["error"] = str(exc)
        job.result.actions.append(advice)
        _write(job.result)
        raise failure
    if failure.kind in PASSED_ON and watch.diagnosis is None:
        phase.ended = f"failed: {failure}"
        _write(job.result)
        raise failure


def _isolate(job: _Job, ended: _Ended, failure: RunFailure, plan: Plan, cluster: Cluster,
             isolations: int) -> Isolation:
    """The nodes to remove after the phase failed, recorded as an action; a RecoveryError when no
    rank can be blamed or `max_recoveries` isolations were already made."""
    phase, watch = ended.phase, ended.watch
    i = phase.index
    diagnosis = _diagnose(failure, phase, watch, job.detect, plan, cluster, ended.started)
    if not actionable(diagnosis):
        _write(job.result)
        raise RecoveryError(f"phase {i} stopped and no rank can be blamed, so there is nothing to "
                            f"isolate: {failure}") from failure
    iso: Isolation = nodes_to_isolate(diagnosis, plan, cluster)
    phase.isolation = iso.to_dict()
    if isolations >= job.config.max_recoveries:
        _write(job.result)
        raise RecoveryError(f"phase {i}: {failure}; already recovered {job.config.max_recoveries} times "
                            f"(max_recoveries), giving up") from failure
    job.result.actions.append({"action": "isolate", "done": True, "phase": i, "at": ended.stopped,
                               "why": watch.what or str(failure), **iso.to_dict(),
                               "findings": [f.to_dict() for f in diagnosis.findings
                                            if f.kind not in REPORT_ONLY]})
    job.say(f"phase {i} ended: {failure}; isolating {', '.join(f'{n} ({iso.reasons[n]})' for n in iso.nodes)}")
    return iso


def _check_arguments(config: RecoveryConfig, cluster: ClusterSource | None, checkpoint: CheckpointConfig,
                     launch: LaunchConfig, records: RecordsConfig) -> None:
    """`recover`'s arguments, checked before any work: what the loop sets itself must not be given."""
    if config.checkpoint_every < 1:
        raise RecoveryError(f"checkpoint_every: the recovery loop resumes from checkpoints; must be >= 1, "
                            f"got {config.checkpoint_every}")
    if config.max_recoveries < 0:
        raise RecoveryError(f"max_recoveries: must be >= 0, got {config.max_recoveries}")
    if cluster is None:
        raise RecoveryError("recovery needs a cluster (--cluster): this machine alone has no node to isolate")
    for bad, given in (("checkpoint_every", checkpoint.every), ("return_params", records.return_params),
                       ("rendezvous", launch.rendezvous), ("step_records", records.step_records),
                       ("run_dir", records.run_dir)):
        if given:
            raise RecoveryError(f"{bad}: set by the recovery loop, not by its caller")


def _check_rejoin(config: RecoveryConfig, cluster: Cluster) -> None:
    unknown = sorted(set(config.rejoin_at) - {n.name for n in cluster.nodes})
    if unknown:
        raise RecoveryError(f"rejoin: no node named {', '.join(map(repr, unknown))} in cluster "
                            f"'{cluster.name}' (its nodes: {', '.join(n.name for n in cluster.nodes)})")


def _start_phase(i: int, root: Path, ck_dir: Path, plan: Plan, cluster: Cluster, excluded: list[str],
                 predicted: float, resume: bool) -> Phase:
    """Phase `i`'s folder (its plan and cluster written there) and record, starting at the latest
    checkpoint when `resume`."""
    phase_dir = root / f"phase-{i}"
    phase_dir.mkdir(parents=True, exist_ok=True)
    (phase_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=1))
    save_cluster(cluster, phase_dir / "cluster.yaml")
    start = (ckpt.latest_checkpoint(ck_dir) or (0, None))[0] if resume else 0
    return Phase(index=i, plan=str(plan), cluster=cluster.name, nodes=[n.name for n in cluster.nodes],
                 excluded=list(excluded), world_size=plan.world_size, predicted_step_s=predicted,
                 run_dir=str(phase_dir), start_step=start)


def _diagnose(failure: RunFailure, phase: Phase, watch: _Watch, detect: Detect, plan: Plan, cluster: Cluster,
              started: float) -> Diagnosis:
    """What stopped the phase: the doctor's live or post-mortem diagnosis, or what the launcher saw
    itself when the doctor names no rank (or every node); recorded in the phase and its folder."""
    phase_dir = Path(phase.run_dir)
    launcher = launcher_diagnosis(failure, phase_dir, plan.world_size, started, rank_layout(cluster, plan))
    diagnosis = watch.diagnosis or _post_mortem(detect, phase_dir, watch)
    if not actionable(diagnosis) or (actionable(launcher) and _isolates_all(diagnosis, plan, cluster)):
        diagnosis = launcher
    phase.ended = f"diagnosed: {watch.what}" if watch.diagnosis else f"failed: {failure}"
    phase.diagnosis = diagnosis.to_dict()
    (phase_dir / "diagnosis.json").write_text(json.dumps(diagnosis.to_dict(), indent=1))
    return diagnosis


def _transition(phase: Phase, ck_dir: Path, reason: str, nodes: list[str], detected: float, stopped: float,
                plan_s: float) -> dict[str, Any]:
    """The transition out of `phase`, timed until the next phase trains (`_collect`): from which
    checkpoint it resumes and how many trained steps that loses."""
    latest = ckpt.latest_checkpoint(ck_dir)
    ran = max(phase.losses, default=phase.start_step - 1) + 1
    resumed_from = latest[0] if latest else 0
    return {"after_phase": phase.index, "reason": reason, "nodes": list(nodes), "resumed_from": resumed_from,
            "lost_steps": max(0, ran - resumed_from), "detected": detected, "stopped": stopped, "plan_s": plan_s}


def _rejoin(back: list[str], root: Path, rejoin_at: dict[str, int]) -> list[str]:
    """Nodes `back` from repair: their requests consumed, each scripted repair done once."""
    _consume(root, back)
    for n in back:
        rejoin_at.pop(n, None)
    return back


def _isolates_all(diagnosis: Diagnosis, plan: Plan, cluster: Cluster) -> bool:
    try:
        return len(nodes_to_isolate(diagnosis, plan, cluster).nodes) >= len(cluster.nodes)
    except RecoveryError:
        return True


def _post_mortem(detect: Detect, phase_dir: Path, watch: _Watch) -> Diagnosis:
    try:
        return call_detect(detect, phase_dir, live=False)
    except Exception as exc:  # the launcher's own findings still stand
        watch.notes.append(f"diagnosis failed: {type(exc).__name__}: {exc}")
        return Diagnosis(run_dir=str(phase_dir))


def _collect(phase: Phase, world: int, pending: dict[str, Any] | None, transitions: list[Transition],
             done: RunResult | None) -> None:
    """The phase's losses and step times: the run's own report when it finished (`done`), else its
    streamed step records; closes the pending transition at the phase's first step."""
    recs = read_step_records(phase.run_dir, world)
    phase.losses = recs.losses
    phase.iteration_times = recs.iteration_times
    if done is not None:
        phase.losses = dict(zip(done.steps, done.losses, strict=True))
        phase.iteration_times = dict(zip(done.steps, done.iteration_times, strict=True))
    times = [t for _, t in sorted(phase.iteration_times.items())][1:]  # the first step warms up
    phase.measured_step_s = statistics.median(times) if times else None
    if pending is not None and recs.started_wall:
        first = recs.started_wall[min(recs.started_wall)]
        p = pending
        transitions.append(Transition(after_phase=p["after_phase"], reason=p["reason"], nodes=p["nodes"],
                                      resumed_from=p["resumed_from"], lost_steps=p["lost_steps"],
                                      detect_to_stopped_s=p["stopped"] - p["detected"], plan_s=p["plan_s"],
                                      stopped_to_train_s=first - p["stopped"],
                                      detect_to_train_s=first - p["detected"]))


def _consume(root: Path, nodes: list[str]) -> None:
    """Drop handled names from the rejoin file (a node isolated again later needs a new request)."""
    path = root / REJOIN_FILE
    if path.exists():
        left = [n for n in path.read_text().split() if n not in nodes]
        path.write_text("".join(n + "\n" for n in left))


def _write(result: RecoveryResult) -> None:
    path = Path(result.run_dir) / "recovery.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result.to_dict(), indent=1))
    tmp.replace(path)
