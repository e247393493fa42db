"""A fixed CPU share per rank on one machine: Linux cgroup v1 `cpu` controller.

Ranks of an emulated cluster share this machine's cores. Without control the compute
rate of a rank depends on what else runs: other ranks (a pipeline's idle stages free
cores for the busy ones, so a per-device speed measured with every rank busy fits data
parallelism but not pipelines) and other processes. A cgroup per rank fixes it:

* `cpus` sets CFS bandwidth control, ``cpu.cfs_quota_us = cpus * cpu.cfs_period_us``: the
  rank never runs faster than `cpus` cores, whatever is idle -- every emulated "GPU" of
  the same kind then has the same compute rate in every plan;
* `shares` sets ``cpu.shares`` (weight against other groups and processes, default 1024):
  a high weight keeps unrelated work on the machine from taking the rank's cores;
* `cpuset` (the `cpuset` controller, e.g. "0", or one set per rank) confines the ranks to
  those CPUs. One CPU per rank (`pinned`) keeps a rank's threads (gloo's receive loop
  included) on its own CPU; ranks on one shared CPU with a quota that sums to at most one
  take turns instead of running side by side on CPUs that share a physical core (or a VM's
  host core).

`RankCgroups` creates ``plait-<pid>-<n>/rank<r>`` under ``/sys/fs/cgroup/cpu`` (and
``/sys/fs/cgroup/cpuset``) (root only), hands the group name to the workers in
`PLAIT_CPU_CGROUP` (see `env()`), each worker joins its rank's groups first thing
(`join_from_env`, called by `plait.runtime.entry.main`; a worker in an emulated node's network
namespace sees no cgroup filesystem there, and the launcher moves it by its heartbeat's pid,
`join_rank`), and everything is removed on exit. Without root or without the controller it does nothing and says why (`available()`).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plait.errors import PlaitError

log = logging.getLogger("plait.runtime.cpu_share")

ENV = "PLAIT_CPU_CGROUP"
ROOT = Path("/sys/fs/cgroup/cpu")
CPUSET_ROOT = Path("/sys/fs/cgroup/cpuset")
_counter = itertools.count()


class CpuShareError(PlaitError, RuntimeError):
    """A CPU share that cannot be applied (bad value, cgroup write refused)."""


def available(root: Path = ROOT) -> tuple[bool, str]:
    """(True, "") when cgroup v1 cpu groups can be made here; else (False, why not)."""
    if os.geteuid() != 0:
        return False, "not running as root (cgroups need root)"
    if not (root / "cpu.cfs_quota_us").exists() or not (root / "cpu.shares").exists():
        return False, f"no cgroup v1 cpu controller at {root}"
    if not os.access(root, os.W_OK):
        return False, f"{root} is not writable"
    return True, ""


def _write(path: Path, value: Any) -> None:
    try:
        path.write_text(f"{value}\n")
    except OSError as exc:
        raise CpuShareError(f"{path}: cannot write {value!r} ({exc.strerror or exc})") from None


def _remove(group: Path, root: Path) -> None:
    """Move any task left in `group` to the root group, then remove it (children first)."""
    if not group.exists():
        return
    for child in [p for p in group.iterdir() if p.is_dir()]:
        _remove(child, root)
    for _ in range(50):
        try:
            for pid in (group / "cgroup.procs").read_text().split():
                try:
                    _write(root / "cgroup.procs", pid)
                except CpuShareError:
                    pass  # the process ended meanwhile
            group.rmdir()
            return
        except OSError:
            time.sleep(0.02)
    log.warning("could not remove cgroup %s", group)


class RankCgroups:
    """One cpu cgroup per rank under a base group of this process (a context manager).

    `cpus`: CFS quota per rank in cores (None: no cap); `shares`: cpu.shares per rank
    (None: the default 1024); `cpuset`: CPUs the ranks may run on ("0", "0-1"; None: any),
    or one such string per rank (e.g. `pinned(world)`: rank r on CPU r); `period_us`: the
    CFS period (short periods throttle in small slices, so a capped rank's spans stretch
    smoothly rather than in 100 ms steps)."""

    def __init__(self, world: int, cpus: float | None = None, shares: int | None = None, *,
                 cpuset: str | Sequence[str] | None = None, period_us: int = 10_000, root: Path = ROOT,
                 cpuset_root: Path = CPUSET_ROOT, prefix: str = "plait") -> None:
        if world < 1:
            raise CpuShareError(f"world: must be >= 1, got {world}")
        if cpus is not None and not cpus > 0:
            raise CpuShareError(f"cpus per rank: must be > 0, got {cpus}")
        if shares is not None and not 2 <= shares <= 262144:
            raise CpuShareError(f"cpu.shares: must be in 2..262144, got {shares}")
        if not 1000 <= period_us <= 1_000_000:
            raise CpuShareError(f"cfs period: must be 1000..1000000 us, got {period_us}")
        sets = None if cpuset is None else [cpuset] * world if isinstance(cpuset, str) else list(cpuset)
        if sets is not None and len(sets) != world:
            raise CpuShareError(f"cpuset: {len(sets)} CPU sets for {world} ranks")
        for cs in sets or []:
            if not cs or not all(part.strip().replace("-", "").isdigit() for part in cs.split(",")):
                raise CpuShareError(f"cpuset: expected CPU numbers like '0' or '0-1,3', got {cs!r}")
        self.world, self.cpus, self.shares, self.cpuset, self.period_us = world, cpus, shares, sets, period_us
        self.root, self.cpuset_root = root, cpuset_root
        self.name = f"{prefix}-{os.getpid()}-{next(_counter)}"
        self.base = root / self.name
        self.active = False
        self.reason = ""

    def _roots(self) -> list[Path]:
        return [self.root] + ([self.cpuset_root] if self.cpuset is not None else [])

    def __enter__(self) -> RankCgroups:
        ok, why = available(self.root)
        if ok and self.cpuset is not None and not (self.cpuset_root / "cpuset.cpus").exists():
            ok, why = False, f"no cgroup v1 cpuset controller at {self.cpuset_root}"
        if not ok:
            self.reason = why
            log.info("CPU shares not applied: %s", why)
            return self
        try:
            self.base.mkdir()
            if self.shares is not None:
                _write(self.base / "cpu.shares", self.shares * self.world)
            if self.cpuset is not None:
                cs = self.cpuset_root / self.name
                cs.mkdir()
                mems = (self.cpuset_root / "cpuset.mems").read_text().strip()
                _write(cs / "cpuset.cpus", (self.cpuset_root / "cpuset.cpus").read_text().strip())
                _write(cs / "cpuset.mems", mems)
            for r in range(self.world):
                g = self.base / f"rank{r}"
                g.mkdir()
                if self.shares is not None:
                    _write(g / "cpu.shares", self.shares)
                if self.cpus is not None:
                    _write(g / "cpu.cfs_period_us", self.period_us)
                    _write(g / "cpu.cfs_quota_us", max(1000, round(self.cpus * self.period_us)))
                if self.cpuset is not None:
                    c = self.cpuset_root / self.name / f"rank{r}"
                    c.mkdir()
                    _write(c / "cpuset.cpus", self.cpuset[r])
                    _write(c / "cpuset.mems", mems)
        except (OSError, CpuShareError) as exc:
            for root in self._roots():
                _remove(root / self.name, root)
            self.reason = f"cannot create cgroups under {self.root}: {exc}"
            log.warning("CPU shares not applied: %s", self.reason)
            return self
        self.active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            for root in self._roots():
                _remove(root / self.name, root)
            self.active = False

    def join(self, rank: int, pid: int = 0) -> None:
        """Move process `pid` (0: the caller) into rank `rank`'s groups."""
        for root in self._roots():
            join(root / self.name / f"rank{rank}", pid)

    def env(self) -> dict[str, str]:
        """Environment for the workers (empty when the groups could not be made)."""
        return {ENV: self.name} if self.active else {}

    def describe(self) -> str:
        if not self.active:
            return f"no CPU shares ({self.reason})"
        parts = [f"{self.cpus:g} CPU quota" if self.cpus is not None else "no CPU cap"]
        if self.shares is not None:
            parts.append(f"cpu.shares {self.shares}")
        if self.cpuset is not None:
            same = len(set(self.cpuset)) == 1
            parts.append(f"CPUs {self.cpuset[0]}" if same else
                         "CPUs " + ", ".join(f"rank {r}: {c}" for r, c in enumerate(self.cpuset)))
        return f"one cgroup per rank ({', '.join(parts)}, period {self.period_us} us)"


def pinned(world: int, cpus: int | None = None) -> list[str]:
    """One CPU per rank, round robin (rank r on CPU r mod cpus): with gloo, a rank whose threads
    float between CPUs can wait a whole scheduler slice for its receive thread when the other
    CPUs compute, which pinning avoids."""
    n = cpus or os.cpu_count() or 1
    return [str(r % n) for r in range(world)]


def join(group: Path, pid: int = 0) -> None:
    """Move process `pid` (0: the caller) with all its threads into `group`."""
    _write(group / "cgroup.procs", pid or os.getpid())


def join_from_env(rank: int) -> bool:
    """Called by a worker at start: join ``<controller>/$PLAIT_CPU_CGROUP/rank<rank>`` for the cpu
    (and cpuset) controllers when that is set. Returns whether it joined; groups that are gone
    (the launcher ended) are ignored -- and so are groups this process cannot see: a worker in an
    emulated node's network namespace (`ip netns exec` mounts a fresh /sys without the cgroup
    filesystems) is moved into its groups by the launcher instead (`join_rank`)."""
    name = os.environ.get(ENV)
    if not name:
        return False
    return join_rank(name, rank)


def join_rank(name: str, rank: int, pid: int = 0) -> bool:
    """Move process `pid` (0: the caller), all its threads, into ``<controller>/<name>/rank<rank>``
    of the cpu and cpuset controllers that exist; returns whether it joined one."""
    joined = False
    for root in (ROOT, CPUSET_ROOT):
        group = root / name / f"rank{rank}"
        if not group.is_dir():
            continue
        try:
            join(group, pid)
            joined = True
        except CpuShareError as exc:
            log.warning("rank %d: %s", rank, exc)
    return joined


class ProcessCgroup:
    """This process (and the children it starts afterwards) in cpu (and cpuset) cgroups of its
    own for the duration of a `with` block; the process returns to the root groups on exit.

    Used to run measurements (a layer profile, a cluster profile) under the same CPU share
    as the ranks they describe."""

    def __init__(self, cpus: float | None = None, shares: int | None = None, *, cpuset: str | None = None,
                 period_us: int = 10_000, root: Path = ROOT, cpuset_root: Path = CPUSET_ROOT,
                 prefix: str = "plait") -> None:
        self._groups = RankCgroups(1, cpus, shares, cpuset=cpuset, period_us=period_us, root=root,
                                   cpuset_root=cpuset_root, prefix=prefix)
        self.active = False
        self.reason = ""

    def describe(self) -> str:
        return self._groups.describe()

    def __enter__(self) -> ProcessCgroup:
        self._groups.__enter__()
        self.reason = self._groups.reason
        if self._groups.active:
            try:
                self._groups.join(0)
                self.active = True
            except CpuShareError as exc:
                self.reason = str(exc)
                self._groups.__exit__(None, None, None)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            for root in self._groups._roots():
                try:
                    join(root)
                except CpuShareError:
                    pass
            self.active = False
        self._groups.__exit__(*exc)
