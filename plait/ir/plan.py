"""The Plan IR: how one training iteration is cut up and placed.

A `Plan` is what every planner returns and what the simulator and the runtime
consume. The common case, Megatron-style 3D parallelism, is expressed by the
scalar fields (`dp`, `tp`, `pp`, `micro_batch`, ...) and has a short string form::

    dp=2,tp=2,pp=2,micro_batch=4,global_batch=64,recompute=selective,zero=1,schedule=1f1b

Everything the later planners need is an optional refinement on top:

* `layer_split`   -- uneven number of layers per pipeline stage (mixed GPU kinds);
* `dp_shares`     -- uneven share of each global batch per data-parallel replica
                     (HAP / heterogeneous data parallel);
* `tp_ratios`     -- uneven tensor-shard ratios per tensor-parallel rank (HAP);
* `device_order`  -- placement: rank r runs on cluster device `device_order[r]`
                     (Pipette's GPU-to-rank assignment); ranks are numbered in
                     Megatron order (tp fastest, then dp, then pp);
* `collectives`   -- collective algorithm per traffic class (HAP / NCCL choice);
* `stages` + `stage_edges` -- an explicit DAG of stages (GraphPipe), each with its
                     own layers, device group, micro-batch size and typed program
                     (`StageSpec.program`, `plait.ir.program`: the Megatron form
                     `TensorParallel`, or an `SpmdProgram`);
* `spmd`          -- a synthesized op-level SPMD program (HAP, `plait.spmd`): one strategy
                     per aten op of the model's AtenGraph at `global_batch`, per-device
                     ratios (one vector, or one per segment), versioned on its own (see
                     `_check_spmd`). Such a plan has dp = tp = pp = 1 and one rank per ratio;
                     `device_order` places the ranks.
* `stages[i].segments` -- a graph stage that runs per input: its layers cut into consecutive
                     runs, each a forward step that waits only for the inputs it reads
                     (`plait.ir.stage_graph.segment_edges`); written only when set.
* `stages[i].spmd` -- composition: a stage of a linear or graph pipeline that runs an SPMD
                     program of its layers on its devices (same layout, one ratio per stage
                     device, synthesized at the stage's micro-batch; `plait.search.compose_family`).

When `stages` is empty the stage DAG is the chain implied by `pp` and
`layer_split`; `Plan.stage_specs()` returns the explicit form in both cases.

File format 2 (issue 27) writes each stage's program typed, ``"program": {"kind":
"tensor_parallel", "dp": 2, "tp": 4}`` or ``{"kind": "spmd", "version": 1, "ratios": ...}``;
format 1's ``dp``, ``tp``, ``dp_shares``, ``tp_ratios`` and ``spmd`` stage fields are migrated
(`_plan_v1_to_v2`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

from plait.errors import PlaitError
from plait.ir.formats import MIGRATIONS, check_version, stamp
from plait.ir.program import (
    SPMD_VERSION,
    SpmdProgram,
    StageProgram,
    TensorParallel,
    stage_program_dict,
)

RECOMPUTE_CHOICES = ("none", "selective", "full")
SCHEDULE_CHOICES = ("1f1b", "gpipe", "interleaved", "eager_1f1b")  # eager_1f1b: composed plans (runtime.supports)
ZERO_CHOICES = (0, 1, 2, 3)
# Traffic classes whose collective algorithm a plan may pin (else chosen as NCCL would).
COLLECTIVE_CLASSES = ("dp", "tp", "pp", "zero")
GRAD_REDUCE_DTYPES = ("fp32", "bf16", "fp16")
COLLECTIVE_ALGORITHMS = ("auto", "ring", "tree", "hierarchical", "padded", "grouped")


def default_grad_dtype(dtype: str) -> str:
    """Megatron-LM's gradient dtype for a compute dtype: bf16 accumulates and all-reduces fp32 main
    grads (arguments.py forces ``accumulate_allreduce_grads_in_fp32`` for bf16), fp16 keeps fp16
    gradients unless told, fp32/tf32 use fp32."""
    return {"bf16": "fp32", "fp16": "fp16"}.get(dtype, "fp32")


class PlanError(PlaitError, ValueError):
    """A plan that is malformed or inconsistent; the message names the field."""


_UNSET: Any = object()  # a StageSpec keyword not given (so a program's other fields are kept)
_MEGATRON_ONE = TensorParallel()


@dataclass(init=False)
class StageSpec:
    """One stage of a (possibly graph-shaped) pipeline: its layers, its devices, its micro-batch,
    and its typed program -- how its work is spread over its devices (`plait.ir.program`).

    `layers` are OpGraph layer names, in topological order. `devices` lists the cluster device ids
    of the stage in rank order: for the Megatron form (`TensorParallel`) replica-major, tp fastest
    (devices[d * tp + t] is dp replica d, tensor rank t); for an SPMD program one rank per ratio.

    The keywords ``dp``, ``tp``, ``dp_shares``, ``tp_ratios`` (a `TensorParallel` program) and
    ``spmd`` (an `SpmdProgram`, or a dict in its layout) build the program, as before it was typed;
    the same names read it back, plain attributes set with `program` (``dp`` and ``tp`` are 1 and
    the shares None for an SPMD stage; ``spmd`` is None for the Megatron form).
    """

    name: str
    layers: list[str]
    devices: list[int]
    micro_batch: int | None  # None: the plan's micro_batch
    program: StageProgram
    # Per-input fan-in (graph pipelines): `layers` cut into consecutive runs of these sizes, each
    # run its own forward step that waits only for the inputs it reads (a stage holding a branch's
    # last block and the join runs the block before the other branch's input arrives; GraphPipe
    # runs operators as their inputs arrive). None: the stage runs once all its inputs are in.
    segments: list[int] | None

    def __init__(self, name: str, layers: list[str] | None = None, devices: list[int] | None = None,
                 dp: int = _UNSET, tp: int = _UNSET, micro_batch: int | None = None,
                 dp_shares: list[float] | None = _UNSET, tp_ratios: list[float] | None = _UNSET,
                 spmd: SpmdProgram | dict[str, Any] | None = _UNSET, segments: list[int] | None = None, *,
                 program: StageProgram | None = None) -> None:
        self.name = name
        self.layers = list(layers) if layers is not None else []
        self.devices = list(devices) if devices is not None else []
        self.micro_batch = micro_batch
        self.segments = segments
        if dp is _UNSET and tp is _UNSET and dp_shares is _UNSET and tp_ratios is _UNSET and spmd is _UNSET:
            self.set_program(program if program is not None else TensorParallel())  # the typed form
            return
        if spmd is not _UNSET and spmd is not None:
            if (dp not in (_UNSET, 1)) or (tp not in (_UNSET, 1)) or (dp_shares not in (_UNSET, None)) \
                    or (tp_ratios not in (_UNSET, None)):
                raise PlanError(f"plan field 'stages[{name}].spmd': a stage running an SPMD program needs dp=tp=1 "
                                "and no dp_shares or tp_ratios (the program shards the stage)")
            program = spmd  # type: ignore[assignment]  # a dict is checked and typed by Plan.validate
        elif dp is not _UNSET or tp is not _UNSET or dp_shares is not _UNSET or tp_ratios is not _UNSET \
                or (spmd is None and isinstance(program, SpmdProgram)):
            base = program if isinstance(program, TensorParallel) else _MEGATRON_ONE
            program = TensorParallel(base.dp if dp is _UNSET else dp, base.tp if tp is _UNSET else tp,
                                     base.dp_shares if dp_shares is _UNSET else dp_shares,
                                     base.tp_ratios if tp_ratios is _UNSET else tp_ratios)
        self.set_program(program if program is not None else TensorParallel())

    def set_program(self, program: StageProgram) -> None:
        """Run `program` on this stage; its parts are read back as plain attributes (the planners
        read them in their innermost loops): ``dp``, ``tp``, ``dp_shares``, ``tp_ratios`` and ``spmd``."""
        self.program = program
        if isinstance(program, TensorParallel):
            self.dp, self.tp, self.dp_shares, self.tp_ratios, self.spmd = (
                program.dp, program.tp, program.dp_shares, program.tp_ratios, None)
        else:
            self.dp, self.tp, self.dp_shares, self.tp_ratios = 1, 1, None, None
            self.spmd = program if isinstance(program, SpmdProgram) else None

    def segment_layers(self) -> list[list[str]]:
        """`layers` cut into its segments (one run of all of them when `segments` is None)."""
        if not self.segments:
            return [list(self.layers)]
        out, k = [], 0
        for n in self.segments:
            out.append(list(self.layers[k:k + n]))
            k += n
        return out

    def to_dict(self) -> dict[str, Any]:
        d = _plain_fields(self, skip=("program",))
        d["program"] = stage_program_dict(self.program)
        if d["segments"] is None:
            del d["segments"]  # stages without segments are written as before
        return d


@dataclass
class Plan:
    """A parallelisation plan for one training iteration (see module docstring)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batch: int = 1
    global_batch: int = 1
    recompute: str = "none"
    zero: int = 0
    schedule: str = "1f1b"
    virtual_stages: int = 1  # model chunks per device for interleaved 1F1B
    sequence_parallel: bool = False
    dtype: str = "bf16"  # training compute dtype (mixed precision when not fp32)
    # dtype gradients are reduced in across data-parallel replicas; None: the framework's default
    # for `dtype` (`Plan.grad_dtype`)
    grad_reduce_dtype: str | None = None
    # data-parallel gradient bucket in MiB (DDP's bucket_cap_mb; Megatron's --ddp-bucket-size in
    # parameters): the runtime all-reduces gradients bucket by bucket, the simulator does the same
    # and the memory estimate holds one bucket in flight. 0: one bucket of every gradient, reduced
    # in place (Megatron's contiguous gradient buffer)
    grad_bucket_mb: float = 25.0
    layer_split: list[int] | None = None
    dp_shares: list[float] | None = None
    tp_ratios: list[float] | None = None
    device_order: list[int] | None = None
    collectives: dict[str, str] = field(default_factory=dict)
    stages: list[StageSpec] = field(default_factory=list)
    stage_edges: list[tuple[int, int]] = field(default_factory=list)
    # Planned paths of inter-node flows on a switched fabric (plait.net.planner), versioned on
    # their own: {"version": 2, "paths": [[src device, dst device, channel, [link, ...]], ...]}
    # with links named as plait.net.fabric names them; a flow split over several paths has one
    # entry per path with its share of the bytes fifth (version 2). None: ECMP decides.
    flow_paths: dict[str, Any] | None = None
    # A HAP-style SPMD program of the whole model (`plait.ir.program.SpmdProgram`; a dict in its
    # versioned layout is read as one). None: no program.
    spmd: SpmdProgram | None = None

    def __post_init__(self) -> None:
        self.validate()

    # ---------------------------------------------------------------- checks
    def validate(self) -> None:
        """Each field's own range, then the fields against each other (the first error raised names
        its field)."""
        self._check_scalars()
        self._check_batch_and_split()
        self._check_ratios("dp_shares", self.dp_shares, self.dp)
        self._check_ratios("tp_ratios", self.tp_ratios, self.tp)
        _check_flow_paths(self.flow_paths)
        self.spmd = _spmd_program(self.spmd)
        own = (self.dp, self.tp, self.pp, self.zero) != (1, 1, 1, 0) or bool(
            self.stages or self.dp_shares or self.tp_ratios or self.layer_split)
        if self.spmd is not None and own:
            raise PlanError("plan field 'spmd': an SPMD program is the whole plan: it needs dp=tp=pp=1, zero=0 "
                            "and no stages, shares, ratios or layer split of its own")
        self._check_placement()

    def _check_scalars(self) -> None:
        """Degrees, choices, dtypes and the gradient bucket: each field alone."""
        for name in ("dp", "tp", "pp", "micro_batch", "global_batch", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"plan field '{name}': must be a positive integer, got {value!r}")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise PlanError(f"plan field 'recompute': must be one of {RECOMPUTE_CHOICES}, got {self.recompute!r}")
        if self.schedule not in SCHEDULE_CHOICES:
            raise PlanError(f"plan field 'schedule': must be one of {SCHEDULE_CHOICES}, got {self.schedule!r}")
        if self.zero not in ZERO_CHOICES:
            raise PlanError(f"plan field 'zero': must be one of {ZERO_CHOICES}, got {self.zero!r}")
        if self.dtype not in ("fp32", "tf32", "bf16", "fp16"):
            raise PlanError(f"plan field 'dtype': must be fp32, tf32, bf16 or fp16, got {self.dtype!r}")
        if self.grad_reduce_dtype is not None and self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise PlanError(f"plan field 'grad_reduce_dtype': must be one of {GRAD_REDUCE_DTYPES}, "
                            f"got {self.grad_reduce_dtype!r}")
        if (isinstance(self.grad_bucket_mb, bool) or not isinstance(self.grad_bucket_mb, (int, float))
                or not self.grad_bucket_mb >= 0 or self.grad_bucket_mb == float("inf")):
            raise PlanError(f"plan field 'grad_bucket_mb': must be a finite number >= 0 (MiB), "
                            f"got {self.grad_bucket_mb!r}")

    def _check_batch_and_split(self) -> None:
        """The batch against the degrees and the schedule; the layer split against the stages."""
        if self.schedule != "interleaved" and self.virtual_stages != 1:
            raise PlanError("plan field 'virtual_stages': only the interleaved schedule uses more than 1")
        if not self.stages:
            per_step = self.dp * self.micro_batch
            if self.dp_shares is None and self.global_batch % per_step:
                raise PlanError(
                    f"plan field 'global_batch': {self.global_batch} is not a multiple of "
                    f"dp*micro_batch = {per_step}"
                )
            if self.schedule == "interleaved" and self.num_micro_batches % self.pp:
                raise PlanError("interleaved 1F1B needs the number of micro-batches to be a multiple of pp")
        if self.layer_split is not None:
            if len(self.layer_split) != self.pp * self.virtual_stages or min(self.layer_split, default=0) < 1:
                raise PlanError(
                    f"plan field 'layer_split': needs {self.pp * self.virtual_stages} positive counts, "
                    f"got {self.layer_split}"
                )

    def _check_placement(self) -> None:
        """The device order, the collectives per traffic class and the stage DAG."""
        if self.device_order is not None:
            if sorted(self.device_order) != sorted(set(self.device_order)) or len(self.device_order) != self.world_size:
                raise PlanError(
                    f"plan field 'device_order': needs {self.world_size} distinct device ids, "
                    f"got {len(self.device_order)}"
                )
            if min(self.device_order, default=0) < 0:
                raise PlanError("plan field 'device_order': device ids must be >= 0")
        for cls, algo in self.collectives.items():
            if cls not in COLLECTIVE_CLASSES:
                raise PlanError(f"plan field 'collectives': unknown traffic class {cls!r}; use {COLLECTIVE_CLASSES}")
            if algo not in COLLECTIVE_ALGORITHMS:
                raise PlanError(f"plan field 'collectives.{cls}': unknown algorithm {algo!r}; use {COLLECTIVE_ALGORITHMS}")
        n = len(self.stages)
        for a, b in self.stage_edges:
            if not (0 <= a < n and 0 <= b < n) or a == b:
                raise PlanError(f"plan field 'stage_edges': edge ({a}, {b}) does not join two stages of {n}")
        self._check_stage_dag()

    def _check_stage_dag(self) -> None:
        """An explicit stage DAG: acyclic, each layer in one stage, device groups disjoint."""
        owner: dict[str, int] = {}
        for s, st in enumerate(self.stages):
            for name in st.layers:
                if name in owner:
                    raise PlanError(f"plan field 'stages[{s}].layers': layer {name!r} is also in stage {owner[name]}")
                owner[name] = s
        holder: dict[int, int] = {}
        for s, st in enumerate(self.stages):
            _check_stage_program(s, st)
            _check_segments(s, st)
            if len(set(st.devices)) != len(st.devices):
                raise PlanError(f"plan field 'stages[{s}].devices': a device appears twice in {st.devices}")
            for d in st.devices:
                if d in holder:
                    raise PlanError(f"plan field 'stages[{s}].devices': device {d} is also in stage {holder[d]}'s "
                                    "group (device groups must not overlap)")
                holder[d] = s
        succ: dict[int, list[int]] = {}
        for a, b in self.stage_edges:
            succ.setdefault(a, []).append(b)
        state: dict[int, int] = {}  # 1: on the current path, 2: done (iterative DFS for cycles)
        for root in range(len(self.stages)):
            if state.get(root):
                continue
            stack = [(root, iter(succ.get(root, [])))]
            state[root] = 1
            while stack:
                node, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    state[node] = 2
                    stack.pop()
                elif state.get(nxt) == 1:
                    raise PlanError(f"plan field 'stage_edges': the stage graph has a cycle through stage {nxt}")
                elif not state.get(nxt):
                    state[nxt] = 1
                    stack.append((nxt, iter(succ.get(nxt, []))))

    @staticmethod
    def _check_ratios(name: str, ratios: list[float] | None, count: int) -> None:
        if ratios is None:
            return
        if len(ratios) != count:
            raise PlanError(f"plan field '{name}': needs {count} values, got {len(ratios)}")
        if not all(math.isfinite(x) for x in ratios) or min(ratios, default=0) < 0 or abs(sum(ratios) - 1.0) > 1e-6:
            raise PlanError(f"plan field '{name}': values must be >= 0 and sum to 1, got {ratios}")

    # ---------------------------------------------------------------- derived
    @property
    def world_size(self) -> int:
        if self.spmd is not None:
            return self.spmd.world
        if self.stages:
            return len({d for s in self.stages for d in s.devices})
        return self.dp * self.tp * self.pp

    @property
    def grad_bucket_bytes(self) -> int:
        """`grad_bucket_mb` in bytes; 0: one bucket of every gradient."""
        return int(self.grad_bucket_mb * 2**20)

    @property
    def grad_dtype(self) -> str:
        """The dtype gradients are reduced in: `grad_reduce_dtype`, else Megatron-LM's default
        for the compute dtype -- bf16 accumulates and all-reduces fp32 main grads (arguments.py
        forces ``accumulate_allreduce_grads_in_fp32`` for bf16), fp16 reduces in fp16 unless
        that flag is given, fp32/tf32 in fp32."""
        if self.grad_reduce_dtype is not None:
            return self.grad_reduce_dtype
        return default_grad_dtype(self.dtype)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches each data-parallel replica runs per iteration (gradient accumulation)."""
        return max(1, self.global_batch // (self.dp * self.micro_batch))

    def rank(self, pp_index: int, dp_index: int, tp_index: int) -> int:
        """Megatron's default rank order: tensor-parallel fastest, then data, then pipeline."""
        return (pp_index * self.dp + dp_index) * self.tp + tp_index

    def device_of(self, rank: int) -> int:
        """Cluster device id that runs `rank`: identity unless `device_order` places it; a graph
        plan numbers its ranks stage by stage, each stage's in the order of its `devices`
        (the runtime's (stage, replica) ranks, `plait.runtime.layout`)."""
        if self.stages:
            left = rank
            for spec in self.stages:
                if left < len(spec.devices):
                    return spec.devices[left]
                left -= len(spec.devices)
            raise PlanError(f"rank {rank}: the plan's stages hold {rank - left} ranks")
        return self.device_order[rank] if self.device_order is not None else rank

    def samples_per_replica(self) -> list[int]:
        """Samples each data-parallel replica processes per iteration (integer, sums to global_batch).

        Uneven shares are floored and the remainder handed to the largest deficits
        (HAP §5's rounding)."""
        return share_samples(self.global_batch, self.dp_shares, self.dp)

    def layers_per_stage(self, num_layers: int, styles: list[str] | None = None) -> list[int]:
        """Layers each pipeline (virtual) stage holds, in model order.

        With `layer_split` the counts are explicit (over all layers). Otherwise, when the
        layers' `styles` (OpGraph `Layer.tp_style`) are given and contain a contiguous run of
        "transformer" layers, Megatron-LM's convention applies: the transformer layers are
        divided evenly over the chunks and the layers before them (embedding) join the first
        chunk, the layers after them (final norm, LM head) the last. Any other model is split
        evenly by layer count, the remainder on the early chunks."""
        chunks = self.pp * self.virtual_stages
        if self.layer_split is not None:
            if sum(self.layer_split) != num_layers:
                raise PlanError(
                    f"plan field 'layer_split': sums to {sum(self.layer_split)} but the model has {num_layers} layers"
                )
            return list(self.layer_split)
        if num_layers < chunks:
            raise PlanError(f"plan asks for {chunks} pipeline chunks but the model has only {num_layers} layers")
        if styles is not None:
            if len(styles) != num_layers:
                raise PlanError(f"layers_per_stage: {len(styles)} styles for {num_layers} layers")
            body = [i for i, st in enumerate(styles) if st == "transformer"]
            if body and len(body) >= chunks and body == list(range(body[0], body[-1] + 1)):
                counts = _even_split(len(body), chunks)
                counts[0] += body[0]
                counts[-1] += num_layers - 1 - body[-1]
                return counts
        return _even_split(num_layers, chunks)

    def stage_specs(self, layer_names: list[str] | None = None, styles: list[str] | None = None) -> list[StageSpec]:
        """The explicit stage list; derives a chain of `pp` stages when `stages` is empty.

        `layer_names` are the model's layers in order (needed to fill a derived chain);
        `styles` their OpGraph tp_style, for Megatron's split (see `layers_per_stage`).
        A whole-model SPMD program (`spmd`) is one stage: every layer, every rank, the whole batch."""
        if self.stages:
            return self.stages
        if self.spmd is not None:
            devices = list(self.device_order) if self.device_order is not None else list(range(self.world_size))
            return [StageSpec(name="program", layers=list(layer_names or []), devices=devices,
                              micro_batch=self.global_batch, program=self.spmd)]
        counts = self.layers_per_stage(len(layer_names), styles) if layer_names is not None else None
        program = TensorParallel(self.dp, self.tp, self.dp_shares, self.tp_ratios)  # every stage's, shared
        specs, start = [], 0
        for p in range(self.pp):
            layers: list[str] = []
            if counts is not None and layer_names is not None:
                # With virtual stages, device stage p holds chunks p, p+pp, p+2pp, ...
                bounds, s = [], 0
                for c in counts:
                    bounds.append((s, s + c))
                    s += c
                for v in range(self.virtual_stages):
                    lo, hi = bounds[v * self.pp + p]
                    layers.extend(layer_names[lo:hi])
            devices = [self.device_of(self.rank(p, d, t)) for d in range(self.dp) for t in range(self.tp)]
            specs.append(StageSpec(name=f"stage{p}", layers=layers, devices=devices, micro_batch=self.micro_batch,
                                   program=program))
            start += 1
        return specs

    def stage_graph_edges(self) -> list[tuple[int, int]]:
        if self.stages:
            return list(self.stage_edges)
        return [(p, p + 1) for p in range(self.pp - 1)]

    # ---------------------------------------------------------------- string form
    _SHORT_FIELDS = ("dp", "tp", "pp", "micro_batch", "global_batch", "recompute", "zero", "schedule")

    def __str__(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in self._SHORT_FIELDS]
        if self.virtual_stages != 1:
            parts.append(f"virtual_stages={self.virtual_stages}")
        if self.sequence_parallel:
            parts.append("sequence_parallel=true")
        if self.dtype != "bf16":
            parts.append(f"dtype={self.dtype}")
        if self.grad_reduce_dtype is not None:
            parts.append(f"grad_reduce_dtype={self.grad_reduce_dtype}")
        if self.grad_bucket_mb != 25.0:
            parts.append(f"grad_bucket_mb={self.grad_bucket_mb:g}")
        if self.layer_split is not None:
            parts.append("layer_split=" + ":".join(map(str, self.layer_split)))
        if self.dp_shares is not None:
            parts.append("dp_shares=" + ":".join(f"{x:.6g}" for x in self.dp_shares))
        if self.tp_ratios is not None:
            parts.append("tp_ratios=" + ":".join(f"{x:.6g}" for x in self.tp_ratios))
        if self.device_order is not None:
            parts.append("device_order=" + ":".join(map(str, self.device_order)))
        for cls, algo in sorted(self.collectives.items()):
            parts.append(f"collective.{cls}={algo}")
        if self.stages:
            parts.append(f"stages={len(self.stages)}")
            programs = [len(st.devices) for st in self.stages if st.spmd is not None]
            if programs:
                parts.append("spmd_stages=" + "+".join(map(str, programs)))
        if self.flow_paths is not None:
            parts.append(f"flow_paths={len(self.flow_paths['paths'])}")
        if self.spmd is not None:
            parts.append(f"spmd={len(self.spmd.strategies)}ops/{self.world_size}ranks")
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str) -> Plan:
        """Parse the short form (`dp=2,tp=2,...`); unknown keys and bad values raise PlanError."""
        kwargs: dict[str, Any] = {}
        collectives: dict[str, str] = {}
        items = [p.strip() for p in text.split(",") if p.strip()]
        if not items:
            # An empty --plan would otherwise silently mean "all defaults" (dp=1, micro_batch=1, ...).
            raise PlanError("plan string: empty; give key=value fields, e.g. dp=2,micro_batch=1,global_batch=8")
        seen: set[str] = set()
        for item in items:
            if "=" not in item:
                raise PlanError(f"plan string: '{item}' is not key=value")
            key, value = (s.strip() for s in item.split("=", 1))
            key = key.replace("-", "_")
            if key in seen:
                raise PlanError(f"plan string: '{key}' is given twice")
            seen.add(key)
            try:
                if key in ("dp", "tp", "pp", "micro_batch", "global_batch", "zero", "virtual_stages"):
                    kwargs[key] = int(value)
                elif key in ("recompute", "schedule", "dtype", "grad_reduce_dtype"):
                    kwargs[key] = value.lower()
                elif key == "grad_bucket_mb":
                    kwargs[key] = float(value)
                elif key == "sequence_parallel":
                    kwargs[key] = parse_bool(value, "plan string: 'sequence_parallel'")
                elif key == "layer_split" or key == "device_order":
                    kwargs[key] = [int(x) for x in value.split(":")]
                elif key in ("dp_shares", "tp_ratios"):
                    kwargs[key] = [float(x) for x in value.split(":")]
                elif key.startswith("collective."):
                    collectives[key.split(".", 1)[1]] = value
                elif key in ("stages", "spmd", "spmd_stages"):
                    raise PlanError(f"plan string: '{key}' cannot be given in short form; use a plan JSON file")
                else:
                    raise PlanError(f"plan string: unknown key '{key}'")
            except ValueError as exc:
                if isinstance(exc, PlanError):
                    raise
                raise PlanError(f"plan string: bad value for '{key}': {value!r}") from None
        kwargs["collectives"] = collectives
        return cls(**kwargs)

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        d = _plain_fields(self, skip=("spmd", "stages"))
        d["spmd"] = self.spmd.to_dict() if self.spmd is not None else None
        d["stages"] = [st.to_dict() for st in self.stages]
        d["stage_edges"] = [list(e) for e in self.stage_edges]
        if d["flow_paths"] is None:
            del d["flow_paths"]  # plans without planned paths are written as before
        if d["spmd"] is None:
            del d["spmd"]
        return stamp("plan", d)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "plan") -> Plan:
        if not isinstance(data, dict):
            raise PlanError(f"{source}: a plan must be a JSON object, got {_json_type(data)}")
        data = dict(data["plan"]) if isinstance(data.get("plan"), dict) else dict(data)
        try:
            return cls._from_current(check_version("plan", data, source, PlanError), source)
        except PlanError as exc:  # name the file as well as the field
            text = str(exc)
            raise PlanError(text if source == "plan" or text.startswith(f"{source}:") else f"{source}: {text}") from None

    @classmethod
    def _from_current(cls, data: dict[str, Any], source: str) -> Plan:
        """`from_dict` of a dict in this plait's plan format (migrated already)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"{source}: unknown plan field(s) {unknown}")
        _check_json_types(data, _PLAN_TYPES, source, "")
        stages = []
        for i, s in enumerate(data.pop("stages", [])):
            if not isinstance(s, dict):
                raise PlanError(f"{source}: plan field 'stages[{i}]': must be an object, got {_json_type(s)}")
            bad = sorted(set(s) - set(_STAGE_TYPES))
            if bad or "name" not in s:
                raise PlanError(f"{source}: plan field 'stages[{i}]': "
                                + (f"unknown field(s) {bad}" if bad else "needs a 'name'"))
            _check_json_types(s, _STAGE_TYPES, source, f"stages[{i}].")
            s = dict(s)
            if "program" in s:
                s["program"] = _stage_program(s["program"], f"stages[{i}].program", source)
            stages.append(StageSpec(**s))
        edges = [tuple(e) for e in data.pop("stage_edges", [])]
        return cls(**data, stages=stages, stage_edges=edges)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str, source: str = "plan") -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{source}: not valid JSON ({exc})") from None
        except RecursionError:
            raise PlanError(f"{source}: JSON nested too deeply") from None
        except ValueError as exc:  # e.g. an integer beyond Python's 4300-digit conversion limit
            raise PlanError(f"{source}: not a readable plan JSON ({exc})") from None
        return cls.from_dict(data, source)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, spec: PlanSource) -> Plan:
        """Accept a Plan, a path to a plan JSON file, or the short string form.

        A string is a file when it ends in `.json` or names an existing file; anything else is
        the short form (a long short form is never handed to the OS as a path: `_is_file`)."""
        if isinstance(spec, Plan):
            return spec
        if not isinstance(spec, str | Path):
            raise PlanError(f"plan: expected a Plan, a plan string or a JSON file path, got {type(spec).__name__}")
        text = str(spec)
        if isinstance(spec, Path) or text.strip().lower().endswith(".json") or _is_file(text):
            return cls.from_json(_read_plan_file(text), source=text)
        return cls.parse(text)



# What `Plan.load` accepts: a Plan (as is), its short string form, or a plan JSON path
# (`plait.sim.api.resolve_plan` takes a plan dict too: `PlanSource | dict[str, Any]`).
PlanSource: TypeAlias = Plan | str | Path


def check_plan_for_model(plan: Plan, config: dict[str, Any], model: str = "model") -> None:
    """Raise PlanError when `plan` cannot run on the model whose zoo `config` is given.

    The one model-aware check that `plait simulate` and `plait run` share (so a plan the runtime
    rejects is never simulated): Megatron's tensor parallelism cuts attention in whole heads and the
    MLP in equal feature slices (Shoeybi et al. 2019, sec. 3), so tp must divide the head count, the
    key/value head count (GQA) and the MLP width unless `tp_ratios` deals them unevenly (then every
    rank needs at least one head); sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2) cuts
    the sequence into tp equal parts. Models without such a config (captured modules) pass."""
    tp = plan.tp
    if tp > 1:
        for key, what in (("heads", "attention heads"), ("kv_heads", "key/value heads")):
            n = config.get(key)
            if not isinstance(n, int):
                continue
            if plan.tp_ratios is None and n % tp:
                raise PlanError(f"plan field 'tp': tp={tp} does not divide the {n} {what} of {model} "
                                f"(tensor parallelism cuts attention in whole heads)")
            if plan.tp_ratios is not None and n < tp:
                raise PlanError(f"plan field 'tp_ratios': {n} {what} of {model} cannot give each of tp={tp} "
                                "ranks a head")
        ffn = config.get("ffn")
        if isinstance(ffn, int) and plan.tp_ratios is None and ffn % tp:
            raise PlanError(f"plan field 'tp': tp={tp} does not divide the MLP width ffn={ffn} of {model}")
    seq = config.get("seq")
    if plan.sequence_parallel and tp > 1 and isinstance(seq, int) and seq % tp:
        raise PlanError(f"plan field 'sequence_parallel': the sequence length {seq} of {model} does not divide "
                        f"by tp={tp} (sequence parallelism cuts it into tp equal parts)")


def parse_bool(value: str, what: str) -> bool:
    """Strict boolean: true/false, 1/0, yes/no, on/off (any case); anything else is an error
    (so `sequence_parallel=maybe` is not silently false)."""
    low = value.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise PlanError(f"{what}: {value!r} is not a boolean; use true/false, 1/0 or yes/no")


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _is_file(text: str) -> bool:
    """Whether `text` names an existing file; a string the OS cannot take as a path (too long,
    NUL bytes) is not one."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):
        return False


def _read_plan_file(path: str) -> str:
    """The text of a plan file, or a PlanError naming the file and why it cannot be read."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise PlanError(f"{path}: plan file not found") from None
    except IsADirectoryError:
        raise PlanError(f"{path}: is a directory, not a plan file") from None
    except (OSError, ValueError) as exc:
        raise PlanError(f"{path}: cannot read the plan file ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PlanError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); a plan file is JSON "
                        "as written by `plait plan --out`") from None


# JSON types of the plan fields, checked before the dataclass sees them so that a hand-edited
# file gets "field: must be ..." rather than a TypeError from deep inside validate().
_INT, _STR, _BOOL, _INTS, _NUMS, _NUMS_OR_NONE = "int", "str", "bool", "ints", "nums", "nums?"
_PLAN_TYPES: dict[str, str] = {
    "dp": _INT, "tp": _INT, "pp": _INT, "micro_batch": _INT, "global_batch": _INT, "zero": _INT,
    "virtual_stages": _INT, "recompute": _STR, "schedule": _STR, "dtype": _STR, "sequence_parallel": _BOOL,
    "layer_split": "ints?", "device_order": "ints?", "dp_shares": _NUMS_OR_NONE, "tp_ratios": _NUMS_OR_NONE,
    "collectives": "str->str", "stages": "list", "stage_edges": "pairs", "grad_reduce_dtype": "str?",
    "grad_bucket_mb": "num", "flow_paths": "obj?", "spmd": "obj?",
}
FLOW_PATHS_VERSION = 2  # version of Plan.flow_paths' layout (2: optional share per path)


def _check_flow_paths(value: Any) -> None:
    """`flow_paths`: None, or {"version": 2, "paths": [[src, dst, channel, [link names], share?], ...]}
    (version 1 has no shares)."""
    if value is None:
        return
    where = "plan field 'flow_paths'"
    if not isinstance(value, dict) or set(value) != {"version", "paths"}:
        raise PlanError(f"{where}: must be an object with 'version' and 'paths'")
    version = value["version"]
    if not _is_int(version) or version < 1:
        raise PlanError(f"{where}.version: must be a positive integer, got {version!r}")
    if version > FLOW_PATHS_VERSION:
        raise PlanError(f"{where}.version: {version} is newer than this plait reads ({FLOW_PATHS_VERSION}); "
                        "upgrade plait")
    if not isinstance(value["paths"], list):
        raise PlanError(f"{where}.paths: must be a list")
    for i, item in enumerate(value["paths"]):
        ok = (isinstance(item, list) and len(item) in ((4, 5) if version >= 2 else (4,))
              and all(_is_int(x) and x >= 0 for x in item[:3])
              and isinstance(item[3], list) and all(isinstance(x, str) for x in item[3])
              and (len(item) == 4 or (_is_num(item[4]) and 0 < item[4] <= 1)))
        if not ok:
            raise PlanError(f"{where}.paths[{i}]: must be [src device, dst device, channel, [link names]] "
                            f"(version 2: and an optional share in (0, 1]), got {item!r:.80}")


_SPMD_KEYS = ("version", "ratios", "strategies", "collectives", "homes", "model", "predicted_s")
_PLACEMENT = re.compile(r"^(R|P|S\d+)$")


def _check_segments(s: int, st: StageSpec) -> None:
    """`StageSpec.segments`: positive run lengths covering the stage's layers, no SPMD program."""
    seg = st.segments
    if seg is None:
        return
    if not isinstance(seg, list) or not seg or any(not isinstance(k, int) or k < 1 for k in seg) \
            or sum(seg) != len(st.layers):
        raise PlanError(f"plan field 'stages[{s}].segments': needs positive run lengths summing to the stage's "
                        f"{len(st.layers)} layers, got {seg!r}")
    if st.spmd is not None and len(seg) > 1:
        raise PlanError(f"plan field 'stages[{s}].segments': a stage with an SPMD program runs as one segment")


def _check_stage_program(s: int, st: StageSpec) -> None:
    """`stages[s].program`: the Megatron form (positive dp and tp), or an SPMD program (checked
    field by field; a dict in its layout is typed here) with one ratio per stage device."""
    where = f"plan field 'stages[{s}].program'"
    if isinstance(st.program, dict | SpmdProgram):
        program = _spmd_program(st.program, where)
        assert program is not None
        st.set_program(program)
        if program.world != len(st.devices):
            raise PlanError(f"{where}.ratios: {program.world} ratios for the stage's {len(st.devices)} devices "
                            "(one per device, in order)")
    elif isinstance(st.program, TensorParallel):
        for name in ("dp", "tp"):
            value = getattr(st.program, name)
            if not _is_int(value) or value < 1:
                raise PlanError(f"{where}.{name}: must be a positive integer, got {value!r}")
    else:
        raise PlanError(f"{where}: must be a tensor_parallel or spmd program, got {type(st.program).__name__}")


def _stage_program(value: Any, field: str, source: str = "plan") -> StageProgram:
    """A stage's program from its file layout (`plait.ir.program.stage_program_dict`); `field` is
    its path in the plan (``stages[i].program``)."""
    where = f"plan field '{field}'"
    kind = value.get("kind")
    rest = {k: v for k, v in value.items() if k != "kind"}
    if kind == "spmd":
        program = _spmd_program(rest, where)
        assert program is not None
        return program
    if kind == TensorParallel.KIND:
        unknown = sorted(set(rest) - set(_TENSOR_PARALLEL_TYPES))
        if unknown:
            raise PlanError(f"{where}: unknown field(s) {unknown} of a tensor_parallel program")
        _check_json_types(rest, _TENSOR_PARALLEL_TYPES, source, f"{field}.")
        return TensorParallel(**rest)
    raise PlanError(f"{where}.kind: must be 'tensor_parallel' or 'spmd', got {kind!r}")


def _plan_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    """Plan format 1 -> 2: a stage's ``dp``, ``tp``, ``dp_shares``, ``tp_ratios`` and ``spmd`` fields
    become its typed ``program`` (``{"kind": "tensor_parallel", ...}`` or ``{"kind": "spmd", ...}``)."""
    out = dict(data)
    stages = out.get("stages")
    if not isinstance(stages, list):
        return out
    moved = []
    for i, st in enumerate(stages):
        if not isinstance(st, dict) or "program" in st:
            moved.append(st)
            continue
        st = dict(st)
        parts = {k: st.pop(k) for k in ("dp", "tp", "dp_shares", "tp_ratios") if k in st}
        spmd = st.pop("spmd", None)
        if spmd is not None:  # checked as format 1 named it, so an old file's error names its own field
            where = f"plan field 'stages[{i}].spmd'"
            if (parts.get("dp", 1), parts.get("tp", 1)) != (1, 1) or parts.get("dp_shares") or parts.get("tp_ratios"):
                raise PlanError(f"{where}: a stage running an SPMD program needs dp=tp=1 and no dp_shares or "
                                "tp_ratios (the program shards the stage)")
            program = _spmd_program(spmd, where)
            devices = st.get("devices")
            if program is not None and isinstance(devices, list) and program.world != len(devices):
                raise PlanError(f"{where}.ratios: {program.world} ratios for the stage's {len(devices)} devices "
                                "(one per device, in order)")
            st["program"] = {"kind": "spmd", **spmd}
        else:
            st["program"] = {"kind": TensorParallel.KIND, **{k: v for k, v in parts.items() if v is not None}}
        moved.append(st)
    out["stages"] = moved
    return out


MIGRATIONS[("plan", 1)] = _plan_v1_to_v2


def _spmd_program(value: Any, where: str = "plan field 'spmd'") -> SpmdProgram | None:
    """`spmd`: None, or a program (`SpmdProgram`, or a dict as `plait plan --family spmd` writes
    it), checked field by field; the typed program."""
    if value is None:
        return None
    _check_spmd(value.to_dict() if isinstance(value, SpmdProgram) else value, where)
    return value if isinstance(value, SpmdProgram) else SpmdProgram.from_dict(value)


def _check_spmd(value: Any, where: str) -> None:
    """A program's dict layout (`SpmdProgram.to_dict`), field by field."""
    if not isinstance(value, dict):
        raise PlanError(f"{where}: must be an object")
    unknown = sorted(set(value) - set(_SPMD_KEYS))
    missing = [k for k in ("version", "ratios", "strategies") if k not in value]
    if unknown or missing:
        raise PlanError(f"{where}: " + (f"unknown field(s) {unknown}" if unknown else f"needs {missing}"))
    version = value["version"]
    if not _is_int(version) or version < 1:
        raise PlanError(f"{where}.version: must be a positive integer, got {version!r}")
    if version > SPMD_VERSION:
        raise PlanError(f"{where}.version: {version} is newer than this plait reads ({SPMD_VERSION}); upgrade plait")
    ratios = value["ratios"]
    vectors = ratios if isinstance(ratios, list) and ratios and isinstance(ratios[0], list) else [ratios]
    for i, vec in enumerate(vectors):
        if not (isinstance(vec, list) and vec and all(map(_is_num, vec))):
            raise PlanError(f"{where}.ratios: must be a list of numbers (one per rank) or one such list per "
                            f"segment, got {vec!r:.80}")
        if len(vec) != len(vectors[0]):
            raise PlanError(f"{where}.ratios[{i}]: {len(vec)} values, the first vector has {len(vectors[0])}")
        if not all(math.isfinite(x) and x >= 0 for x in vec) or abs(sum(vec) - 1.0) > 1e-6:
            raise PlanError(f"{where}.ratios: values must be >= 0 and sum to 1, got {vec}")
    strategies = value["strategies"]
    if not isinstance(strategies, dict) or not strategies:
        raise PlanError(f"{where}.strategies: must be a non-empty object (op name -> strategy)")
    for op, s in strategies.items():
        ok = (isinstance(s, list) and len(s) == 3 and isinstance(s[2], bool)
              and all(isinstance(x, list) and all(isinstance(p, str) and _PLACEMENT.match(p) for p in x)
                      for x in s[:2]))
        if not ok:
            raise PlanError(f"{where}.strategies.{op}: must be [[input placements], [output placements], sharded] "
                            f"with placements R, P or S<dim>, got {s!r:.80}")
    collectives = value.get("collectives", {})
    if not isinstance(collectives, dict) or not all(v in ("padded", "grouped") for v in collectives.values()):
        raise PlanError(f"{where}.collectives: must map tensor names to 'padded' or 'grouped'")
    homes = value.get("homes", {})
    if not isinstance(homes, dict) or not all(isinstance(v, str) and _PLACEMENT.match(v) and v != "P"
                                              for v in homes.values()):
        raise PlanError(f"{where}.homes: must map parameter names to where they are stored, 'R' or 'S<dim>'")
    if "predicted_s" in value and not (_is_num(value["predicted_s"]) and value["predicted_s"] >= 0):
        raise PlanError(f"{where}.predicted_s: must be a number of seconds >= 0")
    if "model" in value and not isinstance(value["model"], str):
        raise PlanError(f"{where}.model: must be a string (the model spec)")


_STAGE_TYPES: dict[str, str] = {
    "name": _STR, "layers": "strs", "devices": _INTS, "micro_batch": "int?", "program": "obj", "segments": "ints?",
}
_TENSOR_PARALLEL_TYPES: dict[str, str] = {"dp": _INT, "tp": _INT, "dp_shares": _NUMS_OR_NONE, "tp_ratios": _NUMS_OR_NONE}


def _plain_fields(obj: Any, skip: tuple[str, ...]) -> dict[str, Any]:
    """`dataclasses.asdict` of `obj`'s fields, in field order, with None for `skip` (typed parts the
    caller writes with their own `to_dict`)."""
    return {f.name: None if f.name in skip else copy.deepcopy(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


_CHECKS: dict[str, tuple[Any, str]] = {
    "int": (_is_int, "an integer"),
    "int?": (lambda x: x is None or _is_int(x), "an integer or null"),
    "str": (lambda x: isinstance(x, str), "a string"),
    "num": (lambda x: _is_num(x), "a number"),
    "str?": (lambda x: x is None or isinstance(x, str), "a string or null"),
    "bool": (lambda x: isinstance(x, bool), "true or false"),
    "ints": (lambda x: isinstance(x, list) and all(map(_is_int, x)), "a list of integers"),
    "ints?": (lambda x: x is None or (isinstance(x, list) and all(map(_is_int, x))), "a list of integers or null"),
    "strs": (lambda x: isinstance(x, list) and all(isinstance(v, str) for v in x), "a list of strings"),
    "nums?": (lambda x: x is None or (isinstance(x, list) and all(map(_is_num, x))), "a list of numbers or null"),
    "str->str": (lambda x: isinstance(x, dict) and all(isinstance(v, str) for v in x.values()),
                 "an object of strings (traffic class -> algorithm)"),
    "list": (lambda x: isinstance(x, list), "a list"),
    "obj?": (lambda x: x is None or isinstance(x, dict), "an object or null"),
    "obj": (lambda x: isinstance(x, dict), "an object"),
    "pairs": (lambda x: isinstance(x, list) and all(isinstance(e, list) and len(e) == 2 and all(map(_is_int, e))
                                                   for e in x), "a list of [from, to] stage index pairs"),
}


def _check_json_types(data: dict[str, Any], types: dict[str, str], source: str, prefix: str) -> None:
    for name, value in data.items():
        ok, want = _CHECKS[types[name]]
        if not ok(value):
            shown = repr(value) if len(repr(value)) <= 60 else _json_type(value)
            raise PlanError(f"{source}: plan field '{prefix}{name}': must be {want}, got {shown}")


def share_samples(total: int, shares: list[float] | None, dp: int) -> list[int]:
    """`total` samples over `dp` replicas by `shares` (even when None): each gets the floor of
    its exact share, the remainder goes one by one to the largest deficits (HAP §5)."""
    shares = shares or [1.0 / dp] * dp
    exact = [s * total for s in shares]
    counts = [int(x) for x in exact]
    for i in sorted(range(dp), key=lambda i: counts[i] - exact[i])[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _even_split(count: int, parts: int) -> list[int]:
    base, extra = divmod(count, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]
