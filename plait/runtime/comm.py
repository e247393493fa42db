"""The runtime's one communication facade: named process groups, every collective and
point-to-point call, its record, and the one place where a link is slowed on purpose.

Groups (torchtitan's way, Liang et al. 2024): where the plan's ranks form a regular grid
(pp x dp x tp, Megatron's order: tp fastest, then dp, then pp) they come from one
`init_device_mesh` with named dimensions, and a rank's "pp", "dp" and "tp" groups are that
mesh's slices through it. Groups that do not follow the grid (stages sharing a tied
embedding, later uneven shares or stage DAGs) are made with `new_groups(name, rank_sets)`,
which every rank calls with the same sets (group creation is collective). "world" is the
default group.

Every call goes through `Comm._call`, which

1. opens the Timeline span of the call on the rank's `Recorder` (or marks the rank as
   waiting, for barriers outside the measured iteration), so the measured timeline is
   unchanged from before the facade;
2. applies link faults (`LinkFault`): a call whose group holds both ranks of a slowed link
   waits `delay_s` before it starts and is stretched to `factor` x its own duration --
   fault injection that also works where `tc` cannot (no root, no network namespaces);
3. writes a `plait.ir.comm.CommEnter` line as the call is entered (C4D's enter timestamp: a call
   that never ends still shows who entered it) and, when it ends,
4. appends one `plait.ir.comm.CommRecord` per call (per tensor for point-to-point) to the
   rank's JSON Lines file, line-buffered, so the records of a rank that hangs or is killed
   stay on disk up to its last finished call.

`bytes` of a record is what the call moves for this rank: the tensor of an all-reduce or
broadcast, the full (gathered) buffer of an all-gather, the full input of a reduce-scatter,
each tensor of a point-to-point batch, the pickled object of an object collective.

It also runs the injected communication faults of `--inject` (`plait.runtime.inject`): a rank
that passes by its first collective of a step (`skip`), or enters it with another size
(`mismatch`), and the link probes the doctor reads (`probe_links`).

Times are `time.perf_counter()` (CLOCK_MONOTONIC on Linux: shared by the ranks of one host).
On CUDA they are host times: `t_end` is when the call returned to Python.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import pickle
import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import (
    DeviceMesh as DeviceMesh,  # re-exported: the mesh type callers annotate with
)

from plait.errors import PlaitError
from plait.ir.comm import CommEnter, CommRecord, HostSample, group_line, header_line
from plait.runtime.inject import Injection
from plait.runtime.recorder import Recorder

# Exchanges per rank pair on a probed step (plait.doctor keeps the fastest): PROBE_BEFORE right after
# the step barrier, the rest once the step's work is done, so that one descheduling of a process
# (many ranks on few cores) cannot cover all of a step's exchanges, as it could back to back.
PROBE_REPEAT = 3
PROBE_BEFORE = 2
FAULTS_ENV = "PLAIT_COMM_FAULTS"  # JSON: {"slow_link": [a, b], "delay_s": x, "factor": f} or a list of them

# torch 2.x names of the single-tensor gather / scatter (older releases: *_single).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _future_of(work: Any) -> torch.futures.Future[Any]:
    """A started call's future. gloo's reduce-scatter works have none (torch 2.13's CPU build:
    "Work::getFuture not implemented", from `_reduce_scatter_base` and `reduce_scatter_tensor_coalesced`
    alike; its all-reduces and all-gathers have one): such a work is waited on here and its future
    is a completed one, so DTensor's reduce-scatters on gloo (sequence parallelism) complete, and are
    recorded, before the call returns."""
    try:
        return work.get_future()  # type: ignore[no-any-return]
    except RuntimeError as exc:
        if "getFuture not implemented" not in str(exc):
            raise
    work.wait()
    done: torch.futures.Future[Any] = torch.futures.Future()
    done.set_result(None)
    return done
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------- faults
@dataclass(frozen=True)
class LinkFault:
    """A slow link between ranks `a` and `b`: every call whose group holds both waits `delay_s`
    before it starts and then takes `factor` times its own transfer time (`Comm._stretch`)."""

    a: int
    b: int
    delay_s: float = 0.0
    factor: float = 1.0
    from_step: int = 0  # the first training step it applies to (0: from the start, setup calls too)

    def applies(self, ranks: frozenset[int]) -> bool:
        return self.a in ranks and self.b in ranks

    def active(self, step: int | None) -> bool:
        return self.from_step == 0 if step is None else step >= self.from_step

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"slow_link": [self.a, self.b], "delay_s": self.delay_s, "factor": self.factor}
        if self.from_step:
            out["from_step"] = self.from_step
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = FAULTS_ENV) -> LinkFault:
        if not isinstance(data, dict):
            raise PlaitError(f"{where}: a link fault must be an object like "
                             f'{{"slow_link": [0, 1], "delay_s": 0.01, "factor": 2}}, got {data!r}')
        unknown = set(data) - {"slow_link", "delay_s", "factor", "from_step"}
        if unknown:
            raise PlaitError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; "
                             "use slow_link, delay_s, factor, from_step")
        start = data.get("from_step", 0)
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise PlaitError(f"{where}: field 'from_step' must be an integer >= 0, got {start!r}")
        link = data.get("slow_link")
        if not (isinstance(link, list | tuple) and len(link) == 2 and all(isinstance(r, int) and r >= 0 for r in link)
                and link[0] != link[1]):
            raise PlaitError(f"{where}: field 'slow_link' must be two different ranks [a, b], got {link!r}")
        delay, factor = data.get("delay_s", 0.0), data.get("factor", 1.0)
        if not isinstance(delay, int | float) or delay < 0:
            raise PlaitError(f"{where}: field 'delay_s' must be a number of seconds >= 0, got {delay!r}")
        if not isinstance(factor, int | float) or factor < 1:
            raise PlaitError(f"{where}: field 'factor' must be a number >= 1 (a slower link), got {factor!r}")
        return cls(int(link[0]), int(link[1]), float(delay), float(factor), int(start))


def parse_link_faults(spec: Any, where: str = FAULTS_ENV) -> tuple[LinkFault, ...]:
    """Link faults from JSON text, a dict, or a list of dicts (None / "" -> none)."""
    if spec is None or spec == "":
        return ()
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise PlaitError(f"{where}: not JSON ({exc.msg} at character {exc.pos})") from None
    items = spec if isinstance(spec, list) else [spec]
    return tuple(LinkFault.from_dict(item, where) for item in items)


# ---------------------------------------------------------------------------------- records
class CommLog:
    """The rank's records file: a header line, group lines, then one line per call (line-buffered)."""

    def __init__(self, path: Path, rank: int, world: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f: IO[str] | None = open(path, "w", buffering=1)  # noqa: SIM115 -- open for the whole run
        self._f.write(header_line(rank, world=world, pid=os.getpid(), host=socket.gethostname(),
                                  clock="perf_counter", perf_at_open=time.perf_counter(),
                                  wall_at_open=time.time()) + "\n")

    def group(self, name: str, ranks: list[int]) -> None:
        if self._f is not None:
            self._f.write(group_line(name, ranks) + "\n")

    def enter(self, e: CommEnter) -> None:
        if self._f is not None:
            self._f.write(e.to_line() + "\n")

    def write(self, rec: CommRecord | HostSample) -> None:
        if self._f is not None:
            self._f.write(rec.to_line() + "\n")  # one write per line: a kill cuts at most the last one

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


_CLOCK_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def host_busy_s() -> float | None:
    """CPU seconds the whole host has used since boot, over all its CPUs (Linux: /proc/stat's
    first line, every field but idle and iowait; guest time is inside user); None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 5 or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / _CLOCK_TICK


# ---------------------------------------------------------------------------------- groups
@dataclass(frozen=True)
class P2P:
    """One tensor of a point-to-point batch: `kind` "send" or "recv" with `peer` (a global rank)."""

    kind: str
    tensor: torch.Tensor
    peer: int
    key: str | None = None

    @classmethod
    def of_torch(cls, op: dist.P2POp, key: str | None = None) -> P2P:
        """A torch `P2POp` (what torch's pipeline stages hand their schedule: an isend or irecv of
        a tensor to a global rank) as one tensor of a facade batch."""
        return cls("send" if op.op is dist.isend else "recv", op.tensor, op.peer, key)


class Group:
    """This rank's view of one named process group of a `Comm`: its collectives."""

    def __init__(self, comm: Comm, name: str, ranks: list[int], pg: Any) -> None:
        self.comm = comm
        self.name = name
        self.ranks = list(ranks)
        self.members = frozenset(ranks)
        self.pg = pg  # torch's ProcessGroup (None: the default group)
        self.size = len(ranks)
        self.rank = self.ranks.index(comm.rank)

    def __repr__(self) -> str:
        return f"Group({self.name!r}, ranks={self.ranks})"

    def all_reduce(self, t: torch.Tensor, name: str, category: str = "comm", *, op: str = "sum",
                   key: str | None = None, span: bool = True, dtype: torch.dtype | None = None) -> None:
        """In-place reduction of `t` over the group (`op`: sum or max); with `dtype` the values
        cross the wire in it (a gradient reduced in the plan's `grad_reduce_dtype`: cast, reduced,
        cast back -- what Megatron-LM's and DDP's compressed reductions do)."""
        if dtype is not None and dtype != t.dtype:
            low = t.to(dtype)
            self.all_reduce(low, name, category, op=op, key=key, span=span)
            t.copy_(low)
            return
        self.comm._call(self, "all_reduce", _nbytes(t), name, category,
                        lambda: dist.all_reduce(t, op=_REDUCE_OPS[op], group=self.pg), key=key, span=span)

    def all_gather_into(self, out: torch.Tensor, x: torch.Tensor, name: str, category: str = "comm", *,
                        key: str | None = None, span: bool = True) -> None:
        """`out` (size x `x`) = every rank's `x` in group-rank order."""
        self.comm._call(self, "all_gather", _nbytes(out), name, category,
                        lambda: _all_gather(out, x, group=self.pg), key=key, span=span)

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor, name: str, category: str = "comm", *,
                       key: str | None = None, span: bool = True, dtype: torch.dtype | None = None) -> None:
        """`out` = this rank's 1/size slice of the sum of every rank's `x` (with `dtype`: summed in it)."""
        if dtype is not None and dtype != x.dtype:
            low = out.new_empty(out.shape, dtype=dtype)
            self.reduce_scatter(low, x.to(dtype), name, category, key=key, span=span)
            out.copy_(low)
            return
        self.comm._call(self, "reduce_scatter", _nbytes(x), name, category,
                        lambda: _reduce_scatter(out, x, group=self.pg), key=key, span=span)

    def broadcast(self, t: torch.Tensor, src: int, name: str, category: str = "comm", *,
                  key: str | None = None, span: bool = True) -> None:
        """In-place: every rank's `t` becomes group rank `src`'s."""
        self.comm._call(self, "broadcast", _nbytes(t), name, category,
                        lambda: dist.broadcast(t, self.ranks[src], group=self.pg), key=key, span=span)

    def reduce(self, t: torch.Tensor, dst: int, name: str, category: str = "comm", *,
               key: str | None = None, span: bool = True) -> None:
        """In-place on group rank `dst`: the sum of every rank's `t` (others' `t` is left undefined)."""
        self.comm._call(self, "reduce", _nbytes(t), name, category,
                        lambda: dist.reduce(t, self.ranks[dst], group=self.pg), key=key, span=span)

    # Uneven shards (HAP, Zhang et al. EuroSys'24 section 4.3): rank i holds sizes[i] rows of a
    # dimension. "padded": one collective over shards padded to the largest (n * max rows move);
    # "grouped": one broadcast (or reduce) per rank with its own size (sum of the rows move, in n
    # calls). Every call is recorded, so a record says which of the two ran.
    def all_gather_uneven(self, x: torch.Tensor, sizes: list[int], dim: int, name: str,
                          category: str = "comm", *, mode: str = "padded") -> torch.Tensor:
        """Every rank's `x` (``sizes[i]`` rows along `dim` on group rank i) concatenated along `dim`."""
        _check_sizes(self, sizes, x, dim, name)
        if mode == "grouped":
            parts = []
            for j, rows in enumerate(sizes):
                shape = list(x.shape)
                shape[dim] = rows
                buf = x.contiguous() if j == self.rank else x.new_empty(shape)
                self.broadcast(buf, j, name, category, key=f"broadcast {self.name} {name}")
                parts.append(buf)
            return torch.cat(parts, dim)
        top = max(sizes)
        local = _pad(x.movedim(dim, 0), top)
        out = local.new_empty((self.size * top, *local.shape[1:]))
        self.all_gather_into(out, local, name, category)
        parts = [out[j * top:j * top + rows] for j, rows in enumerate(sizes)]
        return torch.cat(parts, 0).movedim(0, dim).contiguous()

    def reduce_scatter_uneven(self, x: torch.Tensor, sizes: list[int], dim: int, name: str,
                              category: str = "comm", *, mode: str = "padded") -> torch.Tensor:
        """This rank's ``sizes[rank]`` rows along `dim` of the sum over ranks of `x` (whole on every rank)."""
        if len(sizes) != self.size or sum(sizes) != x.shape[dim]:
            raise PlaitError(f"{name}: shard sizes {sizes} do not split dimension {dim} of {list(x.shape)} "
                             f"over {self.size} ranks")
        chunks = torch.split(x.movedim(dim, 0), sizes, 0)
        if mode == "grouped":
            mine = None
            for j, chunk in enumerate(chunks):
                buf = chunk.contiguous().clone()
                self.reduce(buf, j, name, category, key=f"reduce {self.name} {name}")
                if j == self.rank:
                    mine = buf
            assert mine is not None
            return mine.movedim(0, dim).contiguous()
        top = max(sizes)
        stacked = torch.cat([_pad(c, top) for c in chunks], 0)
        out = stacked.new_empty((top, *stacked.shape[1:]))
        self.reduce_scatter(out, stacked, name, category)
        return out[:sizes[self.rank]].movedim(0, dim).contiguous()

    def all_to_all_uneven(self, x: torch.Tensor, src_sizes: list[int], src_dim: int, dst_sizes: list[int],
                          dst_dim: int, name: str, category: str = "comm") -> torch.Tensor:
        """Re-shard: `x` holds ``src_sizes[rank]`` rows of `src_dim` and all of `dst_dim`; the result
        holds all of `src_dim` and ``dst_sizes[rank]`` rows of `dst_dim` (GShard's all-to-all)."""
        _check_sizes(self, src_sizes, x, src_dim, name)
        if len(dst_sizes) != self.size or sum(dst_sizes) != x.shape[dst_dim]:
            raise PlaitError(f"{name}: shard sizes {dst_sizes} do not split dimension {dst_dim} of "
                             f"{list(x.shape)} over {self.size} ranks")
        sends = [b.contiguous().reshape(-1) for b in torch.split(x, dst_sizes, dst_dim)]
        shapes = []
        for rows in src_sizes:
            shape = list(x.shape)
            shape[src_dim], shape[dst_dim] = rows, dst_sizes[self.rank]
            shapes.append(shape)
        counts = [math.prod(s) for s in shapes]
        flat_in = torch.cat(sends)
        flat_out = flat_in.new_empty(sum(counts))
        in_splits = [s.numel() for s in sends]
        self.comm._call(self, "all_to_all", _nbytes(flat_in), name, category,
                        lambda: dist.all_to_all_single(flat_out, flat_in, counts, in_splits, group=self.pg))
        blocks = [b.reshape(s) for b, s in zip(torch.split(flat_out, counts), shapes)]
        return torch.cat(blocks, src_dim)

    def barrier(self, what: str) -> None:
        """Synchronise the group outside the measured iteration (no Timeline span)."""
        self.comm._call(self, "barrier", 0, what, "", lambda: dist.barrier(group=self.pg), wait_only=True)

    def all_reduce_async(self, t: torch.Tensor, name: str, category: str = "comm", *,
                         key: str | None = None) -> torch.futures.Future[Any]:
        """Start a sum all-reduce of `t` and return at once: the future completes with the call
        (DDP's comm hooks), and the call is recorded then -- `t_end` is its completion, not the
        return -- with its span on the rank's comm resource (it overlaps the compute that goes on)."""
        return self.comm._call_async(self, "all_reduce", _nbytes(t), name, category,
                                     lambda: dist.all_reduce(t, group=self.pg, async_op=True), key=key)


def _pad(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` with zero rows appended along dimension 0 up to `rows` (contiguous)."""
    if x.shape[0] == rows:
        return x.contiguous()
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))], 0)


def _check_sizes(group: Group, sizes: list[int], x: torch.Tensor, dim: int, name: str) -> None:
    if len(sizes) != group.size or x.shape[dim] != sizes[group.rank]:
        raise PlaitError(f"{name}: rank {group.comm.rank} holds {x.shape[dim]} rows of dimension {dim}, "
                         f"the shard sizes {sizes} say {sizes[group.rank] if len(sizes) == group.size else '?'} "
                         f"(group of {group.size})")


class NullGroup:
    """A group whose collectives do nothing: a stand-in to time one tensor rank's compute alone
    (layer profiling), never for training."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self.name, self.size, self.rank = "null", size, rank

    def all_reduce(self, t: torch.Tensor, name: str, category: str = "comm", **_: Any) -> None:
        return None

    def all_gather_into(self, out: torch.Tensor, x: torch.Tensor, name: str, category: str = "comm",
                        **_: Any) -> None:
        return None

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor, name: str, category: str = "comm",
                       **_: Any) -> None:
        return None

    # the uneven collectives of an SPMD program (`plait.runtime.spmd_program`): this rank's result
    # shape, its own rows in place and the others' zero -- to time one rank's program alone
    def all_gather_uneven(self, x: torch.Tensor, sizes: list[int], dim: int, name: str, category: str = "comm",
                          **_: Any) -> torch.Tensor:
        shape = list(x.shape)
        shape[dim] = sum(sizes)
        out = x.new_zeros(shape)
        out.narrow(dim, sum(sizes[:self.rank]), sizes[self.rank]).copy_(x)
        return out

    def reduce_scatter_uneven(self, x: torch.Tensor, sizes: list[int], dim: int, name: str,
                              category: str = "comm", **_: Any) -> torch.Tensor:
        return x.narrow(dim, sum(sizes[:self.rank]), sizes[self.rank]).clone()

    def all_to_all_uneven(self, x: torch.Tensor, src_sizes: list[int], src_dim: int, dst_sizes: list[int],
                          dst_dim: int, name: str, category: str = "comm", **_: Any) -> torch.Tensor:
        shape = list(x.shape)
        shape[src_dim], shape[dst_dim] = sum(src_sizes), dst_sizes[self.rank]
        out = x.new_zeros(shape)
        mine = x.narrow(dst_dim, sum(dst_sizes[:self.rank]), dst_sizes[self.rank])
        out.narrow(src_dim, sum(src_sizes[:self.rank]), src_sizes[self.rank]).copy_(mine)
        return out


# ---------------------------------------------------------------------------------- facade
class Comm:
    """One rank's communication: its named groups, calls, records and link faults."""

    def __init__(self, rank: int, world: int, rec: Recorder | None = None, log: CommLog | None = None,
                 faults: tuple[LinkFault, ...] = (), injection: Injection | None = None,
                 probe_bytes: int = 1 << 18) -> None:
        self.rank = rank
        self.world = world
        self.rec = rec
        self.log = log
        self.faults = faults
        # skip / mismatch faults of this rank, by step; each fires once, on the step's first collective
        self._armed = {f.step: f.kind for f in (injection or Injection()).faults
                       if f.rank == rank and f.kind in ("skip", "mismatch")}
        self.probe_bytes = probe_bytes
        self._fastest: dict[Any, float] = {}  # (group, bytes) -> fastest slowed call (LinkFault stretch)
        self._probe_bufs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.groups: dict[str, Group] = {}
        self._seq: dict[str, int] = {}
        self.mesh: Any = None
        # False: calls are not written (the overhead bench's "recording off" steps; the file stays open).
        self.recording = log is not None

    # ------------------------------------------------------------------ setup
    def init_process_group(self, backend: str, timeout_s: float | None = None, init_method: str | None = None
                           ) -> Group:
        """Join the job (torchrun's environment, or `init_method`); returns the "world" group."""
        if not dist.is_initialized():
            kwargs: dict[str, Any] = {"rank": self.rank, "world_size": self.world}
            if timeout_s is not None:
                kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
            if init_method is not None:
                kwargs["init_method"] = init_method
            dist.init_process_group(backend, **kwargs)
        return self._register("world", list(range(self.world)), None)

    @property
    def backend(self) -> str:
        return str(dist.get_backend()) if dist.is_initialized() else "none"

    def build_mesh(self, device_type: str, dims: dict[str, int], recorded: tuple[str, ...] = ()) -> None:
        """Named groups from one DeviceMesh over the grid `dims` (outermost first, e.g.
        {"pp": 2, "dp": 2, "tp": 2}: rank = (p * dp + d) * tp + t). In the mesh that torch's modules
        get (`self.mesh`), the dims named in `recorded` (of size > 1) are process groups that record
        every call made on them through this facade (`recorded_pg.RecordedProcessGroup`: DTensor's
        functional collectives); the facade's own groups of those dims keep the plain groups."""
        from torch.distributed.device_mesh import init_device_mesh

        names = tuple(dims)
        mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=names)
        for name in names:
            ranks = [int(r) for r in mesh[name].mesh.reshape(-1).tolist()]
            self._register(name, ranks, mesh.get_group(name))
        if any(dims[name] > 1 for name in recorded):
            from plait.runtime.recorded_pg import recorded_group

            groups = []
            for i, name in enumerate(names):
                pg = mesh.get_group(name)
                if name in recorded and dims[name] > 1:
                    sets = mesh.mesh.movedim(i, -1).reshape(-1, dims[name]).tolist()
                    pg = recorded_group(self.group(name), pg, sets, f"comm_{name}")
                groups.append(pg)
            mesh = DeviceMesh.from_group(groups, device_type, mesh=mesh.mesh, mesh_dim_names=names)
        self.mesh = mesh

    def new_groups(self, name: str, rank_sets: list[list[int]]) -> Group | None:
        """Explicit groups for sets of ranks off the grid; every rank calls it with the same sets in
        the same order. Returns this rank's group named `name` (None when it is in no set)."""
        mine = None
        for ranks in rank_sets:
            pg = dist.new_group(ranks)
            if self.rank in ranks:
                if mine is not None:
                    raise PlaitError(f"process group {name!r}: rank {self.rank} is in two of its sets {rank_sets}")
                mine = self._register(name, list(ranks), pg)
        return mine

    def _register(self, name: str, ranks: list[int], pg: Any) -> Group:
        g = Group(self, name, ranks, pg)
        self.groups[name] = g
        if self.log is not None:
            self.log.group(name, ranks)
        return g

    def group(self, name: str) -> Group:
        try:
            return self.groups[name]
        except KeyError:
            raise PlaitError(f"no process group {name!r} on rank {self.rank}; have {sorted(self.groups)}") from None

    @property
    def world_group(self) -> Group:
        return self.group("world")

    def close(self) -> None:
        if self.log is not None:
            self.log.close()

    @staticmethod
    def destroy() -> None:
        """Leave the job (end of the worker)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ whole-job helpers
    def barrier(self, what: str) -> None:
        self.world_group.barrier(what)

    def all_gather_object(self, obj: Any, name: str = "all_gather_object") -> list[Any]:
        out: list[Any] = [None] * self.world
        self._call(self.world_group, "all_gather_object", self._pickled(obj), name, "",
                   lambda: dist.all_gather_object(out, obj), wait_only=True)
        return out

    def gather_object(self, obj: Any, dst: int, name: str = "gather_object") -> list[Any] | None:
        out: list[Any] | None = [None] * self.world if self.rank == dst else None
        self._call(self.world_group, "gather_object", self._pickled(obj), name, "",
                   lambda: dist.gather_object(obj, out, dst=dst), wait_only=True)
        return out

    def broadcast_object(self, obj: Any, src: int, name: str = "broadcast_object") -> Any:
        box = [obj]
        self._call(self.world_group, "broadcast_object", self._pickled(obj), name, "",
                   lambda: dist.broadcast_object_list(box, src=src), wait_only=True)
        return box[0]

    def _pickled(self, obj: Any) -> int:
        return len(pickle.dumps(obj)) if self.log is not None else 0

    # ------------------------------------------------------------------ point to point
    def p2p(self, ops: list[P2P], name: str, category: str = "comm_pp", micro_batch: int | None = None, *,
            chunk: int | None = None, wait_sends: bool = True, wait_recvs: bool = True, timeline: bool = True,
            **span_args: Any) -> list[Any]:
        """Post every send and receive of `ops` together (`batch_isend_irecv`) and wait for the
        receives -- and the sends too unless `wait_sends` is False: then the sends' works are
        returned for the caller to wait later (the executor's interleaved and graph schedules,
        whose sends must not block; `plait.schedule.check` proves both semantics deadlock-free).
        Deadlock-free when the peers post the matching batch (Megatron's pipeline exchange).
        A deferred send's record ends when its batch returned, not when the peer received it.
        `wait_recvs=False` defers the receives the same way (their works are returned; the executor
        posts a later segment's receives early and waits them at its forward, `Comm.wait`)."""
        if not ops:
            return []
        t_enq = time.perf_counter()
        step = self.rec.step if self.rec is not None else None
        fired = self._fire(step, probe=any(o.key == "probe" for o in ops))
        if fired == "skip":  # injected: the rank passes the batch by (its sequence numbers still count it)
            for o in ops:
                self._next_seq(f"p2p {self.rank}->{o.peer}" if o.kind == "send" else f"p2p {o.peer}->{self.rank}")
            return []
        if fired == "mismatch":  # injected: each tensor one element longer than the peer expects
            ops = [P2P(o.kind, torch.zeros(o.tensor.numel() + 1, dtype=o.tensor.dtype, device=o.tensor.device),
                       o.peer, o.key) for o in ops]
        faults = self._faults_on([frozenset((self.rank, o.peer)) for o in ops])  # the links the batch uses
        pending: list[Any] = []
        nbytes = sum(_nbytes(o.tensor) for o in ops)
        links = [f"p2p {self.rank}->{o.peer}" if o.kind == "send" else f"p2p {o.peer}->{self.rank}" for o in ops]
        seqs = [self._next_seq(link) for link in links]
        if self.recording and self.log is not None:
            for o, link, seq in zip(ops, links, seqs):
                self.log.enter(CommEnter(rank=self.rank, group=link, op=o.kind, bytes=_nbytes(o.tensor), seq=seq,
                                         t=t_enq, key=o.key, peer=o.peer, step=step))
        with self._span(name, category, micro_batch, nbytes, wait_only=not timeline, chunk=chunk, **span_args):
            t_start, injected = self._delay(faults)
            batch = [dist.P2POp(dist.isend if o.kind == "send" else dist.irecv, o.tensor, o.peer) for o in ops]
            works = dist.batch_isend_irecv(batch)
            for o, work in zip(ops, works):
                if (o.kind == "send" and not wait_sends) or (o.kind == "recv" and not wait_recvs):
                    pending.append(work)
                else:
                    work.wait()
            t_end, injected = self._stretch(faults, t_start, injected, (tuple(links), nbytes))
        if self.log is None:
            return pending
        for o, link, seq in zip(ops, links, seqs):
            # The batch is posted at once, so a slowed link delays all of it; the injected time is
            # attributed to the ops on the slowed link only (the others merely waited with it).
            mine = injected if self._faults_on([frozenset((self.rank, o.peer))]) else 0.0
            if self.recording:
                self.log.write(CommRecord(rank=self.rank, group=link, op=o.kind, bytes=_nbytes(o.tensor), seq=seq,
                                          t_enqueue=t_enq, t_start=t_start, t_end=t_end, key=o.key, name=name,
                                          peer=o.peer, step=step, injected_s=mine))
        return pending

    def wait(self, works: list[Any], name: str = "wait sends") -> None:
        """Wait the deferred sends `works` of earlier `p2p` calls (the executor's non-blocking
        schedules). The wait is on a peer, not local work: the rank is marked waiting and the
        interval is recorded (op "wait", group "wait"), so the doctor does not count it as compute."""
        if not works:
            return
        t0 = time.perf_counter()
        with self.rec.waiting(name) if self.rec is not None else nullcontext():
            for work in works:
                work.wait()
        t1 = time.perf_counter()
        if self.recording and self.log is not None:
            self.log.write(CommRecord(rank=self.rank, group="wait", op="wait", bytes=0, seq=self._next_seq("wait"),
                                      t_enqueue=t0, t_start=t0, t_end=t1, key="wait", name=name,
                                      step=self.rec.step if self.rec is not None else None))

    # ------------------------------------------------------------------ the one call path
    def _call(self, group: Group, op: str, nbytes: int, name: str, category: str, fn: Callable[[], Any],
              key: str | None = None, span: bool = True, wait_only: bool = False) -> None:
        seq = self._next_seq(group.name)  # counted when not written too: the n-th call stays seq n
        t_enq = time.perf_counter()
        step = self.rec.step if self.rec is not None else None
        fired = self._fire(step, probe=wait_only or group.size < 2)
        if fired == "skip":  # injected: the rank passes this collective by; its peers wait in it
            return
        if fired == "mismatch":  # injected: another size at this sequence number (peers cannot agree)
            wrong = torch.zeros(nbytes // 4 + 1, dtype=torch.float32,
                                device="cuda" if self.backend == "nccl" else "cpu")
            op, nbytes = "all_reduce", _nbytes(wrong)
            fn = lambda: dist.all_reduce(wrong, group=group.pg)  # noqa: E731 -- the replaced call
        if self.recording and self.log is not None:
            self.log.enter(CommEnter(rank=self.rank, group=group.name, op=op, bytes=nbytes, seq=seq, t=t_enq,
                                     key=key or f"{op} {group.name}", step=step))
        ctx = self._span(name, category, None, nbytes, wait_only) if span else nullcontext()
        faults = self._faults_on([group.members])
        with ctx:
            t_start, injected = self._delay(faults)
            fn()
            t_end, injected = self._stretch(faults, t_start, injected, (group.name, nbytes))
        if self.recording and self.log is not None:
            self.log.write(CommRecord(rank=self.rank, group=group.name, op=op, bytes=nbytes, seq=seq,
                                      t_enqueue=t_enq, t_start=t_start, t_end=t_end,
                                      key=key or f"{op} {group.name}", name=name, step=step, injected_s=injected))

    def _call_async(self, group: Group, op: str, nbytes: int, name: str, category: str,
                    start: Callable[[], Any], key: str | None = None, span: bool = True
                    ) -> torch.futures.Future[Any]:
        """`_call` for a call that returns a work: link faults delay its start and stretch it
        before its future completes; its record and span (unless not `span`) are written at completion."""
        seq = self._next_seq(group.name)
        t_enq = time.perf_counter()
        step = self.rec.step if self.rec is not None else None
        key = key or f"{op} {group.name}"
        fired = self._fire(step, probe=group.size < 2)
        if fired == "skip":  # injected, as `_call`: the rank passes the call by; its peers wait in it
            skipped: torch.futures.Future[Any] = torch.futures.Future()
            skipped.set_result(None)
            return skipped
        if fired == "mismatch":  # injected, as `_call`: another size at this sequence number
            wrong = torch.zeros(nbytes // 4 + 1, dtype=torch.float32,
                                device="cuda" if self.backend == "nccl" else "cpu")
            op, nbytes = "all_reduce", _nbytes(wrong)
            start = lambda: dist.all_reduce(wrong, group=group.pg, async_op=True)  # noqa: E731
        recording = self.recording and self.log is not None
        if recording:
            assert self.log is not None
            self.log.enter(CommEnter(rank=self.rank, group=group.name, op=op, bytes=nbytes, seq=seq, t=t_enq,
                                     key=key, step=step))
        faults = self._faults_on([group.members])
        t_start, injected = self._delay(faults)
        fut = _future_of(start())

        def done(f: torch.futures.Future[Any]) -> Any:
            value = f.value()  # a failed call raises here, unrecorded (as in `_call`)
            t_end, extra = self._stretch(faults, t_start, injected, (group.name, nbytes))
            if recording:
                assert self.log is not None
                self.log.write(CommRecord(rank=self.rank, group=group.name, op=op, bytes=nbytes, seq=seq,
                                          t_enqueue=t_enq, t_start=t_start, t_end=t_end, key=key, name=name,
                                          step=step, injected_s=extra))
            if self.rec is not None and span:
                self.rec.comm_span(name, category, t_start, t_end, bytes=nbytes)
            return value

        return fut.then(done)

    def _fire(self, step: int | None, probe: bool) -> str | None:
        """The skip / mismatch fault armed for this step, once, on its first real collective
        (barriers, object collectives, one-rank groups and link probes do not count)."""
        if not self._armed or step is None or probe or step not in self._armed:
            return None
        return self._armed.pop(step)

    # ------------------------------------------------------------------ link probes
    def probe_links(self, repeats: int = PROBE_REPEAT) -> None:
        """Time every rank pair's link `repeats` times (the doctor's rank x rank matrix; C4D times
        each connection): `world - 1` rounds of the circle method, each rank exchanging
        `probe_bytes` with one partner per round, recorded as point-to-point calls with key
        "probe". Link faults apply to them as to any call over the pair. The worker calls it right
        after the step barrier and again after the step's work; the doctor times each exchange
        from the later of the two arrivals, so compute skew between the ends does not enter."""
        n = self.world
        if n < 2 or self.log is None or not self.recording or self.probe_bytes <= 0:
            return
        if self._probe_bufs is None:
            dev = "cuda" if self.backend == "nccl" else "cpu"
            numel = max(1, self.probe_bytes // 4)
            self._probe_bufs = (torch.zeros(numel, device=dev), torch.zeros(numel, device=dev))
        send, recv = self._probe_bufs
        busy = host_busy_s()
        if busy is not None and self.recording:  # the host's CPU counters beside the link's times
            self.log.write(HostSample(rank=self.rank, t=time.perf_counter(), cpu_s=time.process_time(),
                                      host_busy_s=busy, host_cpus=os.cpu_count() or 1,
                                      step=self.rec.step if self.rec is not None else None))
        m = n if n % 2 == 0 else n + 1  # odd world: a ghost player, its partner rests that round
        for rnd in range(m - 1):
            partner = _circle_partner(self.rank, rnd, m)
            if partner >= n:
                continue
            # A few exchanges per pair: the doctor keeps the fastest, which a descheduled process
            # (many ranks on few cores) cannot make faster, while a slow link makes every one slower.
            for _ in range(repeats):
                self.p2p([P2P("send", send, partner, "probe"), P2P("recv", recv, partner, "probe")],
                         "link probe", "probe", timeline=False)

    def _span(self, name: str, category: str, micro_batch: int | None, nbytes: int, wait_only: bool,
              **span_args: Any) -> AbstractContextManager[None]:
        if self.rec is None:
            return nullcontext()
        if wait_only:
            return self.rec.waiting(name)
        return self.rec.comm(name, category, micro_batch=micro_batch, bytes=nbytes, **span_args)

    def _next_seq(self, group: str) -> int:
        seq = self._seq.get(group, 0)
        self._seq[group] = seq + 1
        return seq

    # ------------------------------------------------------------------ link faults
    def _faults_on(self, member_sets: list[frozenset[int]]) -> tuple[LinkFault, ...]:
        """The slowed links inside any of `member_sets` (a group's ranks, or each {rank, peer} pair)
        that are active at the current step."""
        if not self.faults:
            return ()
        step = self.rec.step if self.rec is not None else None
        return tuple(f for f in self.faults if f.active(step) and any(f.applies(m) for m in member_sets))

    @staticmethod
    def _delay(faults: tuple[LinkFault, ...]) -> tuple[float, float]:
        """Sleep the delays of `faults`; returns (start time, seconds slept)."""
        delay = sum(f.delay_s for f in faults)
        if delay > 0:
            time.sleep(delay)
        return time.perf_counter(), delay

    def _stretch(self, faults: tuple[LinkFault, ...], t_start: float, injected: float, kind: Any
                 ) -> tuple[float, float]:
        """Stretch the finished call by (`factor` - 1) x its transfer time (the slowest of `faults`).
        A blocking call's duration also holds the wait for a late peer, which a slow link does not
        lengthen: the transfer time is the call's duration capped at twice the fastest call of the
        same kind (group, bytes) seen so far -- stretching the waits too would feed back (each
        stretched wait makes the peers wait longer)."""
        t_end = time.perf_counter()
        factor = max((f.factor for f in faults), default=1.0)
        if factor > 1.0:
            took = t_end - t_start
            fastest = min(self._fastest.get(kind, took), took)
            self._fastest[kind] = fastest
            extra = (factor - 1.0) * min(took, 2.0 * fastest)
            time.sleep(extra)
            t_end = time.perf_counter()
            injected += extra
        return t_end, injected


def _circle_partner(rank: int, rnd: int, m: int) -> int:
    """Round `rnd` of the circle method over `m` (even) players: player m-1 stays, the others
    rotate; every pair meets exactly once in m-1 rounds."""
    if rank == m - 1:
        return rnd
    if rank == rnd:
        return m - 1
    return (2 * rnd - rank) % (m - 1)


# ---------------------------------------------------------------------------------- FSDP2's collectives
# FSDP2 (`fully_shard`) takes its all-gather and reduce-scatter as objects (`set_custom_all_gather`,
# `set_custom_reduce_scatter`): these run them through a facade group, so each is recorded, spanned
# and slowed by link faults like any call of the runtime.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _FsdpAllGather  # noqa: E402
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _FsdpReduceScatter  # noqa: E402


class _FsdpAlloc:
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class RecordedAllGather(_FsdpAlloc, _FsdpAllGather):
    """FSDP2's parameter all-gather of one unit through the facade group `group` ("dp")."""

    def __init__(self, group: Group, unit: str) -> None:
        self.group, self.unit = group, unit

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> None:
        self.group.comm._call(self.group, "all_gather", _nbytes(output_tensor), f"allgather zero {self.unit}",
                              "comm_zero", lambda: _all_gather(output_tensor, input_tensor, group=group),
                              key=f"all_gather zero {self.unit}")


class RecordedReduceScatter(_FsdpAlloc, _FsdpReduceScatter):
    """FSDP2's gradient reduce-scatter of one unit through the facade group `group` ("dp")."""

    def __init__(self, group: Group, unit: str) -> None:
        self.group, self.unit = group, unit

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        self.group.comm._call(self.group, "reduce_scatter", _nbytes(input_tensor), f"reducescatter zero {self.unit}",
                              "comm_zero", lambda: _reduce_scatter(output_tensor, input_tensor, op=op, group=group),
                              key=f"reduce_scatter zero {self.unit}")
