"""A rank's training state as torch.distributed.checkpoint (DCP) sees it: every tensor under the
single-process model's parameter name, with this rank's slice of it.

DCP stores each tensor as chunks (hyper-rectangles: global offsets + sizes) and, on load, copies
the overlap of the saved chunks with whatever chunks the loading rank asks for, so a checkpoint
written under one plan loads under any other. What plait has to supply is the map from its
runtime forms to rectangles of the *global* tensor:

* tensor parallelism (`tensor_parallel.ShardInfo`): rank t holds, along `dim`, block b's rows
  [b*block + start_t, +size_t) for each of `chunks` fused blocks (Megatron's fused QKV), with
  uneven `tp_ratios` too -- one rectangle per block;
* ZeRO-1/2 optimizer state and ZeRO-3 parameters (`data_parallel.Zero1Step`, `zero3.Zero3Step`):
  rank d holds elements [d*shard, (d+1)*shard) of the concatenation of several flattened
  parameters. A range of a row-major tensor is a union of at most 2*(ndim-1)+1 rectangles
  (`flat_range_boxes`: a partial first row, whole rows, a partial last row, recursively);
* the torch engine's DTensor parameters (FSDP2's `Shard(0)` over dp, DTensor's colwise / rowwise
  over tp): one cut along one dim in torch.chunk's pieces, a `ShardInfo` of one block (`dtensor_cuts`);
  one cut over two mesh dims at once (FSDP2 over a DTensor-TP parameter: (Shard(0) or
  `_StridedShard(0)`) over dp, the TP cut over tp) is one box at a global offset, as DTensor
  computes it (`compute_local_shape_and_global_offset`; `ParamLayout.offset`);
* a tensor replicated over dp, tp or pipeline stages (tied embeddings) is written once: identical
  chunks are de-duplicated by DCP's planner, and chunks that would only *overlap* (a tied or
  tensor-replicated parameter cut differently in two ranks' flat buffers) are written by the
  parameter's first stage and tensor rank 0 only (`ParamLayout.writer`).

Such chunk lists are what DTensor expresses for regular shardings; the flat ZeRO ranges and
uneven fused slices are not DTensor placements, so a small tensor subclass (`ChunkedTensor`)
implements DCP's checkpoint protocol (`__create_write_items__`, `__create_chunk_list__`,
`__get_tensor_shard__`, the hooks DTensor itself implements) over plain local views. Loading
copies into those views, i.e. straight into the live parameters and optimizer state.

Optimizer state is stored per parameter as `optim/<name>/<state>` (Adam's `exp_avg`,
`exp_avg_sq`, the `step` count; SGD's `momentum_buffer`), sliced like the parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from math import prod
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from plait.runtime.tensor_parallel import ShardInfo

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


class ChunkedTensor(torch.Tensor):
    """A global tensor of which this rank holds some rectangular chunks (views of live tensors).

    Only DCP's checkpoint protocol is implemented; any tensor operation on it is an error."""

    _chunks: list[tuple[torch.Size, torch.Tensor]]

    @staticmethod
    def __new__(cls, size: Iterable[int], chunks: list[tuple[tuple[int, ...], torch.Tensor]]) -> ChunkedTensor:
        if not chunks:
            raise ValueError("ChunkedTensor needs at least one chunk")
        first = chunks[0][1]
        out = torch.Tensor._make_wrapper_subclass(cls, torch.Size(size), dtype=first.dtype, device=first.device)
        out._chunks = [(torch.Size(o), c) for o, c in chunks]
        return out

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError(f"ChunkedTensor is a checkpoint view only; {func} is not supported on it")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(off, c.size()),
                                                      properties=TensorProperties.create_from_tensor(c),
                                                      size=self.size()))
                for off, c in self._chunks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(off, c.size()) for off, c in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, c in self._chunks:
            if off == index.offset:
                return c
        raise ValueError(f"{index.fqn}: no chunk at offset {index.offset}")


# ---------------------------------------------------------------------------------- geometry
def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Rectangles tiling elements [start, stop) of a row-major tensor of `shape`, in flat order
    (each one is a contiguous run of the flat buffer)."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    rest = tuple(shape[1:])
    if first == last:
        return [((first, *o), (1, *s)) for o, s in flat_range_boxes(rest, start - first * inner, stop - first * inner)]
    out: list[Box] = []
    lo = first
    if start % inner:
        out += [((first, *o), (1, *s)) for o, s in flat_range_boxes(rest, start % inner, inner)]
        lo = first + 1
    hi = last + 1 if stop % inner == 0 else last
    if hi > lo:
        out.append(((lo, *(0,) * len(rest)), (hi - lo, *rest)))
    if stop % inner:
        out += [((last, *o), (1, *s)) for o, s in flat_range_boxes(rest, 0, stop % inner)]
    return out


@dataclass(frozen=True)
class ParamLayout:
    """One parameter of this rank: its checkpoint name, local and global shape, how tensor
    parallelism cut it, and whether this rank writes its non-identical chunks."""

    key: str
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    info: ShardInfo | None
    tp_rank: int
    writer: bool
    offset: tuple[int, ...] | None = None  # a box's place in the global tensor (then `info` is None)

    @property
    def numel(self) -> int:
        return prod(self.local_shape)

    def to_global(self, offsets: tuple[int, ...], chunk: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """A local rectangle (at `offsets`, data `chunk`) as rectangles of the global tensor: split
        along the tensor-parallel dim where the rank's fused blocks end (`ShardInfo.ranges`); a box
        shifted to its place (`offset`)."""
        if self.offset is not None:
            return [(tuple(o + g for o, g in zip(offsets, self.offset, strict=True)), chunk)]
        if self.info is None:
            return [(offsets, chunk)]
        d = self.info.dim
        n = self.info.sizes[self.tp_rank]
        block = sum(self.info.sizes)
        first = sum(self.info.sizes[:self.tp_rank])
        out = []
        a, end = offsets[d], offsets[d] + chunk.shape[d]
        while a < end:
            b = a // n
            stop = min(end, (b + 1) * n)
            g = list(offsets)
            g[d] = b * block + first + (a - b * n)
            out.append((tuple(g), chunk.narrow(d, a - offsets[d], stop - a)))
            a = stop
        return out


def param_layout(key: str, local: torch.Tensor, info: ShardInfo | None, tp_rank: int, writer: bool) -> ParamLayout:
    shape = tuple(local.shape)
    if info is not None:
        g = list(shape)
        g[info.dim] = info.chunks * sum(info.sizes)
        return ParamLayout(key, shape, tuple(g), info, tp_rank, writer)
    return ParamLayout(key, shape, shape, None, tp_rank, writer)


def segment_chunks(flat: torch.Tensor, start: int, members: list[ParamLayout]
                   ) -> dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]:
    """Global chunks, per parameter key, of a 1-D tensor `flat` holding elements
    [start, start + len(flat)) of the concatenation of `members` (each flattened, in order;
    padding past the last member belongs to none)."""
    out: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
    stop = start + flat.numel()
    offset = 0
    for m in members:
        a, b = max(start, offset), min(stop, offset + m.numel)
        if a < b:
            pos = a - start
            for off, sizes in flat_range_boxes(m.local_shape, a - offset, b - offset):
                n = prod(sizes)
                view = flat[pos:pos + n].view(sizes)
                pos += n
                out.setdefault(m.key, []).extend(m.to_global(off, view))
        offset += m.numel
    return out


# ---------------------------------------------------------------------------------- a rank's state
@dataclass
class Segment:
    """A tensor the rank keeps (a parameter, a flat ZeRO shard) that holds elements
    [start, start + numel) of the concatenation of `params` (flattened, in order)."""

    tensor: torch.Tensor
    params: list[nn.Parameter]
    start: int


class RankLayout:
    """Names and tensor-parallel cuts of this rank's parameters, and the segments in which its
    optimizer-step object (`DataParallelStep`, `Zero1Step`, `Zero3Step`) keeps parameters and
    optimizer state."""

    def __init__(self, module: nn.Module, opt: Any, shard_infos: dict[str, ShardInfo], tp_rank: int,
                 aliases: dict[str, str], from_earlier_stage: set[str],
                 cut_ranks: dict[str, int] | None = None, boxes: dict[str, Box] | None = None) -> None:
        """`cut_ranks`: for a parameter cut along a mesh dim other than plait's tensor ranks (a
        DTensor's shard: FSDP2's over dp, DTensor's over tp), this rank's coordinate on that dim
        (`shard_infos` then gives the cut; the parameter's local tensor is its `to_local()`).
        `boxes`: for a parameter cut over several mesh dims (`dtensor_cuts`), (its local tensor's
        global offsets, the global shape); every rank writes its box (copies are identical chunks)."""
        self.module = module
        self.opt = opt
        self.layouts: dict[int, ParamLayout] = {}
        cut_ranks, boxes = cut_ranks or {}, boxes or {}
        for name, prm in module.named_parameters():
            local = prm.to_local() if hasattr(prm, "to_local") else prm
            if name in boxes:
                offset, shape = boxes[name]
                self.layouts[id(prm)] = ParamLayout(aliases.get(name, name), tuple(local.shape), shape, None, tp_rank,
                                                    name not in from_earlier_stage, offset)
                continue
            info = shard_infos.get(name)
            writer = (info is not None or tp_rank == 0) and name not in from_earlier_stage
            self.layouts[id(prm)] = param_layout(aliases.get(name, name), local, info, cut_ranks.get(name, tp_rank),
                                                 writer)
        self.param_names = {n for n, _ in module.named_parameters(remove_duplicate=False)}

    def members(self, params: list[nn.Parameter]) -> list[ParamLayout]:
        return [self.layouts[id(p)] for p in params]

    def _chunks(self, segments: list[Segment], pick: Any, writing: bool) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for seg in segments:
            tensor = pick(seg)
            if tensor is None:
                continue
            members = self.members(seg.params)
            for key, chunks in segment_chunks(tensor.detach().view(-1), seg.start, members).items():
                if writing and not next(m.writer for m in members if m.key == key):
                    continue
                out.setdefault(key, []).extend(chunks)
        return out

    def _globals(self) -> dict[str, tuple[int, ...]]:
        return {m.key: m.global_shape for m in self.layouts.values()}

    def model_state(self, writing: bool) -> dict[str, torch.Tensor]:
        shapes = self._globals()
        segments = self.opt.param_segments()
        covered = {id(p) for seg in segments for p in seg.params}
        # Parameters the optimizer does not hold (frozen ones) are saved whole, like a plain replica.
        segments += [Segment(p, [p], 0) for _, p in self.module.named_parameters() if id(p) not in covered]
        chunks = self._chunks(segments, lambda s: s.tensor, writing)
        state: dict[str, torch.Tensor] = {k: ChunkedTensor(shapes[k], c) for k, c in chunks.items()}
        for name, buf in self.module.state_dict(keep_vars=True).items():  # persistent buffers, replicated
            if name not in self.param_names and isinstance(buf, torch.Tensor):
                state[name] = buf.detach()
        return state

    def optim_state(self, writing: bool, names: dict[str, dict[str, tuple[torch.Size, torch.dtype]]] | None = None
                    ) -> tuple[dict[str, dict[str, torch.Tensor]], list[tuple[dict[str, Any], str, list[torch.Tensor]]]]:
        """{param key: {state name: chunks}}; to save (`names` None: the optimizer's own state) or to
        load (`names`: state names, shapes and dtypes per key from the checkpoint's metadata: zero state
        is created to load into). Also returns the scalar states to set after a load."""
        shapes = self._globals()
        optimizer = self.opt.optimizer
        out: dict[str, dict[str, torch.Tensor]] = {}
        scalars: list[tuple[dict[str, Any], str, list[torch.Tensor]]] = []
        for seg in self.opt.optimizer_segments():
            members = self.members(seg.params)
            if names is not None:
                wanted: dict[str, tuple[torch.Size, torch.dtype]] = {}
                for m in members:
                    wanted.update(names.get(m.key, {}))
                st: dict[str, Any] = {}
                for n, (size, dtype) in wanted.items():
                    st[n] = torch.zeros((), dtype=dtype) if len(size) == 0 and seg.tensor.dim() > 0 \
                        else torch.zeros_like(seg.tensor, dtype=dtype)
                if st:
                    optimizer.state[seg.tensor] = st
            st = optimizer.state.get(seg.tensor, {})
            for n, value in st.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if value.shape == seg.tensor.shape:
                    by_key = segment_chunks(value.detach().view(-1), seg.start, members)
                    for key, chunks in by_key.items():
                        if writing and not next(m.writer for m in members if m.key == key):
                            continue
                        out.setdefault(key, {})[n] = ChunkedTensor(shapes[key], chunks)
                elif value.dim() == 0:  # a count shared by the segment's parameters (Adam's step)
                    copies = []
                    for m in members:
                        if names is not None and n not in names.get(m.key, {}):
                            continue
                        t = value.detach() if names is None else torch.zeros((), dtype=value.dtype)
                        out.setdefault(m.key, {})[n] = t
                        copies.append(t)
                    if names is not None and copies:
                        scalars.append((st, n, copies))
        return out, scalars


def dtensor_cuts(module: nn.Module, boxes: dict[str, Box] | None = None
                 ) -> tuple[dict[str, ShardInfo], dict[str, int]]:
    """The cut of every DTensor parameter of `module` as the checkpoint code takes a tensor-parallel
    one: (name -> `ShardInfo`, name -> this rank's coordinate on the cut's mesh dim). FSDP2's
    parameters (`Shard(0)` over dp) and DTensor tensor parallelism's (`Shard(0)` colwise, `Shard(1)`
    rowwise over tp) are one cut along one dim in torch.chunk's pieces (ceil-sized, the last ones
    smaller or empty), the other mesh dims replicated. A parameter sharded over several mesh dims
    at once (FSDP2 over a tensor-parallel DTensor: (Shard(0) or `_StridedShard(0)`) over dp, its
    TP cut over tp) goes into `boxes` (name -> (offsets, global shape) of this rank's local tensor,
    DTensor's `compute_local_shape_and_global_offset`, checked against the local shape); without
    `boxes` it is refused, naming it."""
    infos: dict[str, ShardInfo] = {}
    coords: dict[str, int] = {}
    for name, prm in module.named_parameters():
        placements = getattr(prm, "placements", None)
        if placements is None:
            continue
        cuts = [(i, pl) for i, pl in enumerate(placements) if pl.is_shard()]
        if not cuts and all(pl.is_replicate() for pl in placements):
            continue  # whole on every rank (RowwiseParallel's bias): written by tensor rank 0
        if len(cuts) != 1 or any(not (pl.is_shard() or pl.is_replicate()) for pl in placements):
            if boxes is None or any(pl.is_partial() for pl in placements):
                raise ValueError(f"parameter {name}: placements {tuple(placements)} -- a checkpoint takes a "
                                 "DTensor cut along one mesh dim, the others replicated")
            boxes[name] = _dtensor_box(name, prm)
            continue
        mesh_dim, pl = cuts[0]
        mesh = prm.device_mesh
        world, dim = mesh.size(mesh_dim), pl.dim
        size = prm.shape[dim]
        piece = -(-size // world)
        sizes = tuple(max(0, min(piece, size - t * piece)) for t in range(world))
        coord = mesh.get_local_rank(mesh_dim)
        local = prm.to_local()
        if local.shape[dim] != sizes[coord]:
            raise ValueError(f"parameter {name}: local size {local.shape[dim]} along dim {dim}, expected "
                             f"{sizes[coord]} (torch.chunk's piece {coord} of {size} in {world})")
        infos[name], coords[name] = ShardInfo(dim=dim, chunks=1, sizes=sizes), coord
    return infos, coords


def _dtensor_box(name: str, prm: Any) -> Box:
    """(global offsets, global shape) of a DTensor parameter's local tensor, one box (module docstring)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(prm.shape, prm.device_mesh, prm.placements)
    local = prm.to_local()
    if tuple(shape) != tuple(local.shape):
        raise ValueError(f"parameter {name}: local shape {tuple(local.shape)} under {tuple(prm.placements)}, "
                         f"DTensor computes {tuple(shape)} -- not one box of the whole tensor")
    return tuple(int(o) for o in offset), tuple(prm.shape)


def aliases_of(model: nn.Module) -> dict[str, str]:
    """Every parameter name of `model` -> the first name of the same tensor (a tied embedding and LM
    head are one checkpoint entry, named as in `model.named_parameters()`)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, prm in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(prm), name)
    return out
