"""Fault injection for `plait run --inject SPEC`: a small language, several faults per run.

    SPEC   = CLAUSE { ";" CLAUSE }
    CLAUSE = KIND ":" FIELD { "," FIELD }        FIELD = NAME "=" VALUE

| kind       | fields                                   | what the rank does                                      |
|------------|------------------------------------------|---------------------------------------------------------|
| `kill`     | rank, step [, at=step\\|checkpoint]        | SIGKILL itself at the step's start (or in its checkpoint) |
| `stop`     | rank, step [, for]                       | SIGSTOP itself: the process (and its heartbeat) freezes; with `for` a helper sends SIGCONT after that long (stop-and-resume) |
| `hang`     | rank, step                               | loops forever outside communication, heartbeat alive    |
| `error`    | rank, step [, at=step\\|checkpoint]        | raises an exception (the rank fails)                    |
| `skip`     | rank, step                               | passes by its first collective of the step (comm hang)  |
| `mismatch` | rank, step                               | enters its first collective of the step with another size |
| `slow`     | rank, factor [, from] [, every] [, until]| its compute takes `factor` x as long from step `from` on (every `every`-th step: intermittent) |
| `link`     | ranks=a-b, factor and/or delay [, from]  | the link a<->b is `factor` x slower / `delay` later     |
| `uplink`   | node, factor and/or delay [, from]       | every link between a rank of node `node` and a rank of another node (a bad NIC or uplink) |
| `hog`      | rank [, from] [, procs]                  | starts `procs` (1) busy-loop processes beside the rank, on its CPUs and in its cgroup |
| `inf`      | rank, step                               | one gradient element becomes inf (fp16 overflow tests)  |

Values: ranks, nodes and steps are integers >= 0, `factor` a number >= 1, `delay` and `for` a time
with a unit (`5ms`, `200us`, `0.01s`). Example: ``kill:rank=2,step=3; link:ranks=0-1,factor=3,from=2``.

An `uplink` names a node of the cluster (its index in the cluster file, as `config.json`'s
`ranks[].node`): once the rank layout is known (`Injection.on_nodes`) it becomes one `link` fault per
rank pair crossing that node's boundary, each carrying `uplink=node`. A `hog` co-locates load with
a rank: the busy loops inherit the rank's CPU affinity and cgroup (its CPU quota where `cpu_share`
set one), so what they take is taken from that rank; they end with the rank.

A link fault is shaped by `tc` on the emulated cluster's links where it can be (root, network
namespaces, the two ranks on different nodes, from step 0; a delay needs sch_netem), else inside
the communication facade (`plait.runtime.comm.LinkFault`); the run's output says which.

Parsing and per-rank queries; the runtime's workers, recorder and facade act on them (`fire`,
`poison`: what a worker does at a process or inf fault).
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from plait.errors import PlaitError

KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # kind -> (required fields, optional fields)
    "kill": (("rank", "step"), ("at",)),
    "stop": (("rank", "step"), ("for",)),
    "hang": (("rank", "step"), ()),
    "error": (("rank", "step"), ("at",)),
    "skip": (("rank", "step"), ()),
    "mismatch": (("rank", "step"), ()),
    "slow": (("rank", "factor"), ("from", "every", "until")),
    "link": (("ranks",), ("factor", "delay", "from")),
    "uplink": (("node",), ("factor", "delay", "from")),
    "hog": (("rank",), ("from", "procs")),
    "inf": (("rank", "step"), ()),
}
_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


class InjectError(PlaitError, ValueError):
    """A --inject spec that cannot be read: names the clause and field."""


@dataclass(frozen=True)
class Fault:
    """One clause of a spec."""

    kind: str
    rank: int
    """The rank it acts on (a link: its first end; an uplink before `Injection.on_nodes`: -1)."""
    step: int = 0
    """The step it fires at (slow, link: the first step it applies to -- `from`)."""
    peer: int | None = None
    """A link's other end."""
    factor: float = 1.0
    delay_s: float = 0.0
    every: int | None = None
    """slow: only every `every`-th step from `step` on (intermittent)."""
    until: int | None = None
    """slow: last step it applies to (inclusive)."""
    at: str = "step"
    """kill, error: at the step's start ("step") or inside its checkpoint write ("checkpoint")."""
    duration_s: float | None = None
    """stop: seconds until SIGCONT (None: stopped for good)."""
    uplink: int | None = None
    """uplink: the node whose links crossing its boundary are slowed (a link from one: that node)."""
    procs: int = 1
    """hog: busy-loop processes started beside the rank."""

    def active(self, step: int | None) -> bool:
        """Whether a slow or link fault applies at `step` (None: outside training -> only from step 0)."""
        if step is None:
            return self.step == 0 and self.kind == "link"
        if step < self.step or (self.until is not None and step > self.until):
            return False
        return self.every is None or (step - self.step) % self.every == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        if self.kind in ("link", "uplink"):
            what = " and ".join(x for x in (f"{self.factor:g}x slower" if self.factor > 1 else "",
                                            f"+{self.delay_s * 1e3:g} ms" if self.delay_s else "") if x)
            if self.kind == "uplink":
                return f"uplink of node {self.uplink} {what} from step {self.step}"
            via = f" (node {self.uplink}'s uplink)" if self.uplink is not None else ""
            return f"link {self.rank}-{self.peer}{via} {what} from step {self.step}"
        if self.kind == "hog":
            return f"{self.procs} busy loop(s) beside rank {self.rank} from step {self.step}"
        if self.kind == "stop" and self.duration_s is not None:
            return f"stop rank {self.rank} at step {self.step} for {self.duration_s:g} s, then resume"
        if self.kind == "slow":
            when = f"every {self.every} steps from step {self.step}" if self.every else f"from step {self.step}"
            return f"rank {self.rank} compute {self.factor:g}x slower {when}"
        where = " in its checkpoint" if self.at == "checkpoint" else ""
        return f"{self.kind} rank {self.rank} at step {self.step}{where}"


def _int(clause: str, name: str, value: str) -> int:
    if not re.fullmatch(r"\d+", value):
        raise InjectError(f"--inject clause '{clause}': field '{name}' must be an integer >= 0, got {value!r}")
    return int(value)


def _factor(clause: str, value: str) -> float:
    try:
        f = float(value)
    except ValueError:
        f = float("nan")
    if not f >= 1.0 or f == float("inf"):
        raise InjectError(f"--inject clause '{clause}': field 'factor' must be a number >= 1 (how many times "
                          f"slower), got {value!r}")
    return f


def _delay(clause: str, value: str, name: str = "delay") -> float:
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(s|ms|us)", value)
    if not m:
        raise InjectError(f"--inject clause '{clause}': field '{name}' must be a time with a unit "
                          f"(5ms, 200us, 0.01s), got {value!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _clause(text: str) -> Fault:
    text = text.strip()
    kind, sep, rest = text.partition(":")
    kind = kind.strip().lower()
    if not sep or kind not in KINDS:
        raise InjectError(f"--inject clause '{text}': must start with a kind and ':' -- one of "
                          f"{', '.join(KINDS)} (e.g. kill:rank=2,step=3)")
    required, optional = KINDS[kind]
    fields: dict[str, str] = {}
    for item in (x.strip() for x in rest.split(",")):
        if not item:
            continue
        name, eq, value = item.partition("=")
        name, value = name.strip().lower(), value.strip()
        if not eq or not value:
            raise InjectError(f"--inject clause '{text}': '{item}' is not NAME=VALUE")
        if name not in required + optional:
            raise InjectError(f"--inject clause '{text}': unknown field '{name}' for {kind} "
                              f"(fields: {', '.join(required + optional)})")
        if name in fields:
            raise InjectError(f"--inject clause '{text}': field '{name}' given twice")
        fields[name] = value
    missing = [f for f in required if f not in fields]
    if missing:
        raise InjectError(f"--inject clause '{text}': missing field(s) {', '.join(missing)} for {kind}")
    clause = text.strip()
    if kind == "link":
        m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", fields["ranks"])
        if not m or m.group(1) == m.group(2):
            raise InjectError(f"--inject clause '{clause}': field 'ranks' must be two different ranks a-b "
                              f"(e.g. 0-1), got {fields['ranks']!r}")
        if "factor" not in fields and "delay" not in fields:
            raise InjectError(f"--inject clause '{clause}': a link needs 'factor' (e.g. 3) and/or 'delay' (e.g. 5ms)")
        a, b = sorted((int(m.group(1)), int(m.group(2))))
        return Fault("link", a, _int(clause, "from", fields.get("from", "0")), peer=b,
                     factor=_factor(clause, fields["factor"]) if "factor" in fields else 1.0,
                     delay_s=_delay(clause, fields["delay"]) if "delay" in fields else 0.0)
    if kind == "uplink":
        if "factor" not in fields and "delay" not in fields:
            raise InjectError(f"--inject clause '{clause}': an uplink needs 'factor' (e.g. 3) and/or 'delay' (e.g. 5ms)")
        return Fault("uplink", -1, _int(clause, "from", fields.get("from", "0")),
                     factor=_factor(clause, fields["factor"]) if "factor" in fields else 1.0,
                     delay_s=_delay(clause, fields["delay"]) if "delay" in fields else 0.0,
                     uplink=_int(clause, "node", fields["node"]))
    rank = _int(clause, "rank", fields["rank"])
    if kind == "hog":
        procs = _int(clause, "procs", fields.get("procs", "1"))
        if procs < 1:
            raise InjectError(f"--inject clause '{clause}': field 'procs' must be >= 1")
        return Fault("hog", rank, _int(clause, "from", fields.get("from", "0")), procs=procs)
    if kind == "slow":
        every = _int(clause, "every", fields["every"]) if "every" in fields else None
        if every == 0:
            raise InjectError(f"--inject clause '{clause}': field 'every' must be >= 1")
        start = _int(clause, "from", fields.get("from", "0"))
        until = _int(clause, "until", fields["until"]) if "until" in fields else None
        if until is not None and until < start:
            raise InjectError(f"--inject clause '{clause}': field 'until' ({until}) is before 'from' ({start})")
        return Fault("slow", rank, start, factor=_factor(clause, fields["factor"]), every=every, until=until)
    at = fields.get("at", "step")
    if at not in ("step", "checkpoint"):
        raise InjectError(f"--inject clause '{clause}': field 'at' must be step or checkpoint, got {at!r}")
    duration = _delay(clause, fields["for"], "for") if "for" in fields else None
    if duration is not None and duration <= 0:
        raise InjectError(f"--inject clause '{clause}': field 'for' must be > 0")
    return Fault(kind, rank, _int(clause, "step", fields["step"]), at=at, duration_s=duration)


@dataclass(frozen=True)
class Injection:
    """Every fault of one run (empty: none)."""

    faults: tuple[Fault, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.faults)

    @classmethod
    def parse(cls, spec: str | None) -> Injection:
        if spec is None or not str(spec).strip():
            return cls()
        return cls(tuple(_clause(c) for c in str(spec).split(";") if c.strip()))

    def check_world(self, world: int) -> None:
        """Every rank named must exist in the plan."""
        for f in self.faults:
            for r in (f.rank, f.peer):
                if r is not None and r >= world:
                    raise InjectError(f"--inject: {f.describe()}: rank {r} is outside the plan's {world} ranks")

    def on_nodes(self, node_of: list[int]) -> Injection:
        """Each `uplink` clause as one `link` fault per rank pair crossing its node's boundary
        (`node_of[r]`: rank r's node, `config.json`'s `ranks[].node`); the rest as they are."""
        out: list[Fault] = []
        nodes = sorted(set(node_of))
        for f in self.faults:
            if f.kind != "uplink":
                out.append(f)
                continue
            if f.uplink not in nodes:
                raise InjectError(f"--inject: {f.describe()}: the plan's ranks are on nodes {nodes}, not node {f.uplink}")
            pairs = [(a, b) for a in range(len(node_of)) for b in range(a + 1, len(node_of))
                     if (node_of[a] == f.uplink) != (node_of[b] == f.uplink)]
            if not pairs:
                raise InjectError(f"--inject: {f.describe()}: no rank of another node to cross it to")
            out += [Fault("link", a, f.step, peer=b, factor=f.factor, delay_s=f.delay_s, uplink=f.uplink)
                    for a, b in pairs]
        return Injection(tuple(out))

    def to_list(self) -> list[dict[str, Any]]:
        return [f.to_dict() for f in self.faults]

    @classmethod
    def from_list(cls, items: list[dict[str, Any]] | None) -> Injection:
        return cls(tuple(Fault(**d) for d in items or []))

    # ---------------------------------------------------------------- per-rank queries
    def at(self, rank: int, step: int, where: str, kinds: tuple[str, ...]) -> Fault | None:
        """The fault of one of `kinds` that fires on `rank` at `step` (`where`: step or checkpoint)."""
        return next((f for f in self.faults if f.kind in kinds and f.rank == rank and f.step == step
                     and f.at == where), None)

    def compute_factor(self, rank: int, step: int | None) -> float:
        """How many times slower `rank`'s compute is at `step` (slow faults multiply)."""
        out = 1.0
        for f in self.faults:
            if f.kind == "slow" and f.rank == rank and f.active(step):
                out *= f.factor
        return out

    def links(self) -> tuple[Fault, ...]:
        """The link faults (an `uplink` counts once `on_nodes` has made it links)."""
        return tuple(f for f in self.faults if f.kind == "link")

    def describe(self) -> list[str]:
        return [f.describe() for f in self.faults]


# ---------------------------------------------------------------------------------- acting them out
PROCESS_FAULTS = ("kill", "stop", "hang", "error", "hog")  # the kinds `fire` acts out


def fire(fault: Fault) -> None:
    """Act out a process fault of `--inject` on this rank."""
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "stop":  # the whole process freezes, heartbeat thread included (a stuck node)
        if fault.duration_s is not None:  # stop-and-resume: a helper outside the process sends SIGCONT
            subprocess.Popen(["/bin/sh", "-c", f"sleep {fault.duration_s:.3f}; kill -CONT {os.getpid()}"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        return  # SIGCONT: the rank carries on
    if fault.kind == "hog":
        start_hogs(fault.procs)
        return
    if fault.kind == "hang":
        while True:  # never reports progress again, not waiting on any collective
            time.sleep(3600)
    raise RuntimeError(f"injected fault on rank {fault.rank} at step {fault.step}")


# A busy loop that ends when its parent (the rank) does: it polls its parent pid between bursts.
_HOG = "import os, sys\np = int(sys.argv[1])\nwhile os.getppid() == p:\n    for _ in range(200000):\n        pass\n"
_hogs: list[subprocess.Popen[bytes]] = []


def start_hogs(n: int) -> None:
    """`hog`: `n` busy-loop processes beside this rank. A child inherits the rank's CPU affinity and
    cgroup, so the CPU they take is the rank's own; they end with the rank (even a SIGKILLed one)."""
    for _ in range(n):
        _hogs.append(subprocess.Popen([sys.executable, "-c", _HOG, str(os.getpid())], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    if len(_hogs) == n:
        atexit.register(lambda: [h.kill() for h in _hogs])


def poison(grads: Iterable[Any]) -> None:
    """inf: set the first element of this rank's first gradient (of `grads`, None for a parameter
    without one) to +inf (an fp16 overflow)."""
    for grad in grads:
        if grad is not None and grad.numel():
            grad.view(-1)[0] = float("inf")
            return
