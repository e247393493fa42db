"""The types of a stage's program: how its work is spread over its devices, op by op.

An SPMD program (HAP, Zhang et al. EuroSys'24) gives every aten op of a model a `Strategy` --
the placement each input must have and each output gets -- and every device a ratio of the
sharded work. `SpmdProgram` is the program as a plan holds it (`Plan.spmd`, `StageSpec.spmd`);
the planner that searches programs (`plait.spmd`), the cost model that prices them
(`plait.cost.program`), the simulator and the runtime all read these types from here.

How one tensor lives on the devices of an SPMD program, and what moving between two ways costs.

A placement (HAP's "property" of a tensor, Zhang et al. EuroSys'24 section 3) is a string:

* ``"R"``  -- replicated: every device holds the whole tensor;
* ``"S<d>"`` -- sharded along dimension ``d``: device ``i`` holds a contiguous slice of about
  ``r_i`` of it (uneven per-device ratios ``r``, summing to 1);
* ``"P"``  -- partial: every device holds a tensor of the full shape and the value is their sum.

Conversions (HAP's communication instructions) and their gradients. The backward pass is the
transposed program, so a forward placement has a gradient placement: ``S<d>`` -> ``S<d>``,
``P`` -> ``R``, and ``R`` -> ``R`` when the op that reads it computes redundantly on every device,
``P`` when it computes a shard (each device's part of the gradient is a partial sum: this is
Megatron's "f" all-reduce and data parallelism's gradient all-reduce, one rule for both).

===========  ======================  =================================
from -> to   forward                 (as a gradient, same table)
===========  ======================  =================================
S<d> -> R    all_gather(d)
P -> R       all_reduce
P -> S<d>    reduce_scatter(d)
S<d> -> S<e> all_to_all(d -> e)
R -> S<d>    free (each device slices its part: HAP's dynamic_slice)
R -> P       free (one device keeps it, the others hold zeros)
===========  ======================  =================================

``S -> P`` is not offered (it would need the zero-padded full tensor on every device).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plait.errors import PlaitError

REPLICATED, PARTIAL = "R", "P"


class ShardingError(PlaitError, ValueError):
    """An SPMD sharding that cannot be made; the message names the op, tensor or device."""


def shard(dim: int) -> str:
    return f"S{dim}"


def shard_dim(placement: str) -> int | None:
    """The sharded dimension of ``"S<d>"``, None for ``"R"`` and ``"P"``."""
    return int(placement[1:]) if placement.startswith("S") else None


def grad_placement(placement: str, sharded_compute: bool) -> str:
    """Placement of the gradient of a tensor read in `placement` by an op that computes a shard
    (`sharded_compute`) or redundantly."""
    if placement == PARTIAL:
        return REPLICATED
    if placement == REPLICATED:
        return PARTIAL if sharded_compute else REPLICATED
    return placement


def grad_home(origin: str) -> str:
    """Where the gradient of a tensor made in placement `origin` must arrive: a sharded tensor's in
    its shards, a partial or replicated one's whole on every device (the gradient of a partial sum
    is the whole gradient; redundant producers and stored parameters need it whole)."""
    return REPLICATED if origin == PARTIAL else origin


@dataclass(frozen=True)
class Comm:
    """One collective of the program, as a description; times come from `plait.spmd.cost`.

    `nbytes` is the full (unsharded) tensor's size; `group` the devices it spans ("world": all of
    the program's devices); `phase` "fwd" or "bwd" (a gradient's collective); `algorithm` how it
    runs, chosen per message by the search (`plait.cost.spmd.choose`): "padded" or "grouped"
    for uneven all-gathers and reduce-scatters, NCCL's ring / tree / hierarchical for
    all-reduces; None until chosen."""

    op: str  # all_gather, all_reduce, reduce_scatter, all_to_all
    tensor: str
    nbytes: int
    phase: str = "fwd"
    dim: int | None = None
    group: str = "world"
    algorithm: str | None = None


@functools.lru_cache(maxsize=1 << 16)
def conversion(src: str, dst: str, tensor: str, nbytes: int, phase: str = "fwd") -> tuple[Comm, ...] | None:
    """The collectives turning placement `src` into `dst` (empty when free); None when impossible."""
    if src == dst:
        return ()
    d_src, d_dst = shard_dim(src), shard_dim(dst)
    if src == REPLICATED:  # slicing, or keeping the value on one device only
        return ()
    if src == PARTIAL:
        if dst == REPLICATED:
            return (Comm("all_reduce", tensor, nbytes, phase),)
        return (Comm("reduce_scatter", tensor, nbytes, phase, d_dst),)
    if dst == REPLICATED:
        return (Comm("all_gather", tensor, nbytes, phase, d_src),)
    if d_dst is not None:
        return (Comm("all_to_all", tensor, nbytes, phase, d_dst),)
    return None  # S -> P


def shard_sizes(size: int, ratios: Sequence[float] | np.ndarray, unit: int = 1, *, what: str = "tensor",
                devices: Sequence[str] | None = None) -> list[int]:
    """Integer sizes of the shards of a dimension of `size` elements, in multiples of `unit`.

    HAP's rounding (section 5.2): floor ``r_i * blocks``, then one more block to the devices
    with the largest deficits until all blocks are placed. Every device must get at least one
    block (a device with zero rows would run ops on empty tensors, and some -- layer norm,
    softmax over them -- are not defined there): raises ShardingError naming `what` and the
    device otherwise.
    """
    r = np.asarray(ratios, dtype=float)
    names = list(devices) if devices is not None else [f"device {i}" for i in range(len(r))]
    if len(r) == 0 or np.any(r < 0) or not np.isfinite(r).all() or r.sum() <= 0:
        raise ShardingError(f"{what}: ratios must be non-negative and sum to 1, got {list(ratios)}")
    if size % unit:
        raise ShardingError(f"{what}: size {size} is not a multiple of the shard unit {unit}")
    blocks = size // unit
    r = r / r.sum()
    want = r * blocks
    sizes = np.floor(want + 1e-9).astype(int)
    rest = blocks - int(sizes.sum())
    for i in np.argsort(-(want - sizes), kind="stable")[:rest]:
        sizes[i] += 1
    empty = [names[i] for i in range(len(r)) if sizes[i] == 0]
    if empty:
        raise ShardingError(
            f"{what}: ratios {[round(float(x), 4) for x in r]} leave {', '.join(empty)} with zero rows "
            f"of a dimension of {size} (in units of {unit}); give every device a ratio of at least "
            f"{unit / size:.3g} or shard another dimension")
    return [int(s) * unit for s in sizes]


@dataclass(frozen=True)
class Strategy:
    """One way to run an op: the placement each input must have and each output gets."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    sharded: bool  # devices compute different parts (a replicated input's gradient is partial)

    @functools.cached_property
    def splits_work(self) -> bool:
        """Whether each device does only its ratio of the work: some tensor is sharded. An op on
        partial sums alone (``P + P``, ``P * R``) is different on each device but full-size."""
        return any(p.startswith("S") for p in (*self.inputs, *self.outputs))


NODE, RAIL, WORLD = "node", "rail", "world"  # `Comm.group` of a hierarchical program's collectives


@dataclass(frozen=True)
class Mesh:
    """Device ids of the cluster, one row per node (outer index ``a``, inner index ``j``)."""

    nodes: tuple[tuple[int, ...], ...]

    @property
    def outer(self) -> int:
        return len(self.nodes)

    @property
    def inner(self) -> int:
        return len(self.nodes[0])

    @property
    def ids(self) -> tuple[int, ...]:
        """Every device, node-major (the order of the world `Devices` of a hierarchical program)."""
        return tuple(i for node in self.nodes for i in node)

    def rails(self) -> list[tuple[int, ...]]:
        """Rail ``j``: device ``j`` of every node."""
        return [tuple(node[j] for node in self.nodes) for j in range(self.inner)]


SPMD_VERSION = 1  # version of a program's layout in a plan file (`SpmdProgram.to_dict`)


@dataclass
class SpmdProgram:
    """An op-level SPMD program as a plan holds it (`Plan.spmd`, `StageSpec.spmd`): the decisions
    only, not shard sizes or which collectives -- those follow from the model's aten graph
    (`plait.cost.program.round_shards`, the conversion table), so a plan cannot disagree with the
    model it runs on without the run saying which op differs.

    Written as ``{"version": 1, "ratios": ..., "strategies": {op: [[inputs], [outputs], sharded]},
    "collectives"?, "homes"?, "model"?, "predicted_s"?}`` (`to_dict`); `plait.ir.plan` checks a
    file's dict field by field before building one."""

    # one strategy per aten op, by the op's name in the model's AtenGraph at the program's batch
    strategies: dict[str, Strategy]
    # per-device ratios: one vector (one entry per rank) or one vector per segment
    ratios: list[float] | list[list[float]]
    # tensor -> "padded" | "grouped": how its uneven all-gathers / reduce-scatters run
    collectives: dict[str, str] = field(default_factory=dict)
    # parameter -> where it is stored when not where its first reader reads it (ZeRO-3 storage)
    homes: dict[str, str] = field(default_factory=dict)
    model: str | None = None  # the model spec it was synthesized for
    predicted_s: float | None = None  # the planner's predicted iteration time

    @property
    def world(self) -> int:
        """Ranks of the program: the length of its ratio vector(s)."""
        r = self.ratios
        return len(r[0]) if r and isinstance(r[0], list) else len(r)

    def ratio_array(self) -> np.ndarray:
        """The ratios as an array: (ranks,) or (segments, ranks)."""
        return np.asarray(self.ratios, dtype=float)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "version": SPMD_VERSION,
            "ratios": [list(v) for v in self.ratios] if self.ratios and isinstance(self.ratios[0], list)
            else list(self.ratios),
            "strategies": {op: [list(s.inputs), list(s.outputs), bool(s.sharded)] for op, s in self.strategies.items()},
        }
        if self.collectives:
            d["collectives"] = dict(self.collectives)
        if self.homes:
            d["homes"] = dict(self.homes)
        if self.model is not None:
            d["model"] = self.model
        if self.predicted_s is not None:
            d["predicted_s"] = self.predicted_s
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpmdProgram:
        """The program of a dict in `to_dict`'s layout (checked by the caller)."""
        return cls(strategies={op: Strategy(tuple(s[0]), tuple(s[1]), bool(s[2])) for op, s in d["strategies"].items()},
                   ratios=d["ratios"], collectives=dict(d.get("collectives") or {}), homes=dict(d.get("homes") or {}),
                   model=d.get("model"), predicted_s=d.get("predicted_s"))


@dataclass
class TensorParallel:
    """A stage's program in the Megatron form (Narayanan et al. SC'21): its layers' weights split over
    `tp` tensor ranks (column- and row-parallel pairs), the stage replicated `dp` times, replica
    ``d`` taking ``dp_shares[d]`` of the batch and tensor rank ``t`` ``tp_ratios[t]`` of every split
    (even when None; HAP's uneven shares and ratios otherwise). A 3D plan's stages all run one."""

    dp: int = 1
    tp: int = 1
    dp_shares: list[float] | None = None
    tp_ratios: list[float] | None = None

    KIND = "tensor_parallel"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.KIND, "dp": self.dp, "tp": self.tp}
        if self.dp_shares is not None:
            d["dp_shares"] = list(self.dp_shares)
        if self.tp_ratios is not None:
            d["tp_ratios"] = list(self.tp_ratios)
        return d


# How a stage's work is spread over its devices: the Megatron form, or an op-level SPMD program.
StageProgram = TensorParallel | SpmdProgram


def stage_program_dict(program: StageProgram) -> dict[str, Any]:
    """A stage's program as a plan file writes it: ``{"kind": "tensor_parallel" | "spmd", ...}``."""
    if isinstance(program, SpmdProgram):
        return {"kind": "spmd", **program.to_dict()}
    return program.to_dict()
