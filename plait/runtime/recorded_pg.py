"""A process group that records every call torch's modules make on it (issue 29): the DeviceMesh
group that DTensor's tensor parallelism (`parallelize.apply_tp`) issues its collectives on, and the
"dp" group on which torch's FSDP2-based `replicate` all-reduces gradients (`parallelize.apply_replicate`).

DTensor's styles (`ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`) redistribute through
torch's functional collectives, which find their process group by name in c10d's registry and call
its virtual methods -- none of it passes through plait's communication facade. So the mesh's "tp"
dim is given a `RecordedProcessGroup` instead of the plain one: a Python `ProcessGroup` (torch's
trampoline lets a Python class override a group's collectives, as torch's own threaded test group
does) registered as the c10d backend `BACKEND` (`dist.Backend.register_backend`) and made by
`dist.new_group`, so it is in c10d's registry like any group. Each of its calls

* starts the same collective on the plain group (gloo, or NCCL on CUDA) and returns a work whose
  future completes with it (`torch._C._distributed_c10d._create_work_from_future`): DTensor's
  asynchronous collectives stay asynchronous (`AsyncCollectiveTensor` waits on them where the
  value is used);
* goes through `Comm._call_async` on the facade group of the same name: one `CommRecord` per call
  in comm/rankN.jsonl, with `t_end` at the work's completion (not the call's return), its span on
  the rank's timeline (a call outside a step -- the parameters gathered for the results -- has
  none, as the facade's barriers outside the measured iteration), link faults' delay before it starts and their stretch before its future
  completes, the injected skip / mismatch faults -- as every call of the runtime.

A record's `name` says the op, the group and the phase: "allreduce tp fwd" (a forward's, or a
recomputed forward's inside backward: "bwd"; "allreduce dp bwd", a `replicate` unit's gradients) --
the phase from autograd's current graph task, DTensor does not say which module issued the call. `bytes` follows the facade's rule (the tensor of an
all-reduce or broadcast, the gathered buffer of an all-gather, the input of a reduce-scatter or
all-to-all). The facade's own group of the dim keeps the plain process group, so a call the
runtime makes itself (`Group.all_reduce`) is recorded once, in the same sequence as DTensor's.
Point-to-point calls are not overridden: one on this group fails ("No backend type associated"),
it is never unrecorded; tensor parallelism does not send.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

if TYPE_CHECKING:
    from plait.runtime.comm import Group

BACKEND = "plait_recorded"

# this rank's (plain group, facade group, category) by the group's global ranks, for the creator
# `dist.new_group` calls (`_create`); set by `recorded_group` just before
_pending: dict[tuple[int, ...], tuple[Any, Group, str]] = {}


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _flat(lists: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for ts in lists for t in ts]


class RecordedProcessGroup(dist.ProcessGroup):
    """A facade group's collectives as a torch `ProcessGroup`: each delegated to `inner` (the plain
    group over the same ranks) and recorded through `group` (module docstring)."""

    def __init__(self, inner: Any, group: Group, category: str) -> None:
        super().__init__(group.rank, group.size)
        self._inner, self._group, self._category = inner, group, category
        self._name, self._desc = "", ""

    # ------------------------------------------------------------------ identity (c10d's registry)
    def getBackendName(self) -> str:
        return BACKEND

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:  # type: ignore[override]
        return self._desc

    def __repr__(self) -> str:
        return f"RecordedProcessGroup({self._group.name!r}, ranks={self._group.ranks})"

    # ------------------------------------------------------------------ the one call path
    def _record(self, op: str, nbytes: int, start: Callable[[], Any]) -> Any:
        g = self._group
        # inside a backward: an autograd node's, or a callback the engine runs at its end (FSDP2's
        # root unit reduces its gradients there) -- both within the backward's graph task
        phase = "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"
        # outside a step (the parameters gathered for the results) recorded, not on the timeline
        rec = g.comm.rec
        fut = g.comm._call_async(g, op, nbytes, f"{op.replace('_', '')} {g.name} {phase}", self._category, start,
                                 span=rec is not None and rec.step is not None)
        return _create_work_from_future(fut)

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._record("all_reduce", _nbytes(tensors), lambda: self._inner.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._record("all_reduce", _nbytes(tensors), lambda: self._inner.allreduce_coalesced(tensors, opts))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._record("all_gather", _nbytes(_flat(outputs)), lambda: self._inner.allgather(outputs, inputs, opts))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._record("all_gather", _nbytes([output]), lambda: self._inner._allgather_base(output, input, opts))

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        return self._record("all_gather", _nbytes(outputs),
                            lambda: self._inner.allgather_into_tensor_coalesced(outputs, inputs, opts))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        return self._record("reduce_scatter", _nbytes(_flat(inputs)),
                            lambda: self._inner.reduce_scatter(outputs, inputs, opts))

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._record("reduce_scatter", _nbytes([input]),
                            lambda: self._inner._reduce_scatter_base(output, input, opts))

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        return self._record("reduce_scatter", _nbytes(inputs),
                            lambda: self._inner.reduce_scatter_tensor_coalesced(outputs, inputs, opts))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                      input_splits: list[int], opts: Any = None) -> Any:
        return self._record("all_to_all", _nbytes([input]),
                            lambda: self._inner.alltoall_base(output, input, output_splits, input_splits, opts))

    all_to_all_single = alltoall_base

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._record("all_to_all", _nbytes(inputs), lambda: self._inner.alltoall(outputs, inputs, opts))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._record("broadcast", _nbytes(tensors), lambda: self._inner.broadcast(tensors, opts))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self._record("reduce", _nbytes(tensors), lambda: self._inner.reduce(tensors, opts))

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        return self._record("scatter", _nbytes(outputs) * self._group.size,
                            lambda: self._inner.scatter(outputs, inputs, opts))

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._record("gather", _nbytes(inputs) * self._group.size,
                            lambda: self._inner.gather(outputs, inputs, opts))

    def barrier(self, opts: Any = None) -> Any:
        return self._record("barrier", 0, lambda: self._inner.barrier(opts))


def _create(options: Any, backend_options: Any) -> RecordedProcessGroup:
    """c10d's creator for `BACKEND` (extended API: it names the group's global ranks)."""
    ranks = tuple(sorted(int(r) for r in options.global_ranks_in_group))
    try:
        inner, group, category = _pending.pop(ranks)
    except KeyError:
        raise RuntimeError(f"a {BACKEND} process group over ranks {list(ranks)} is made by recorded_group only") \
            from None
    return RecordedProcessGroup(inner, group, category)


dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def recorded_group(group: Group, inner: Any, rank_sets: list[list[int]], category: str) -> Any:
    """This rank's `RecordedProcessGroup` for the facade group `group` (its plain process group
    `inner`); every rank calls it with the same `rank_sets` (all groups of the dim, group creation is
    collective), `group.ranks` among them."""
    if group.ranks not in rank_sets:
        raise ValueError(f"group {group.name!r} over {group.ranks} is not one of {rank_sets}")
    _pending[tuple(sorted(group.ranks))] = (inner, group, category)
    mine = None
    for ranks in rank_sets:
        pg = dist.new_group(ranks, backend=BACKEND)
        if ranks == group.ranks:
            mine = pg
    assert isinstance(mine, RecordedProcessGroup)
    return mine
