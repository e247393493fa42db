"""A plan's SPMD programs replayed on the model: what `simulate` prices for `Plan.spmd` and for the
stage programs of a composed plan (`StageSpec.spmd`).

A program in a plan holds decisions only (`plait.ir.program.SpmdProgram`: one strategy per aten
op, ratios, how uneven collectives run). Replaying it means capturing the model's aten graph at
the batch the program was made for, building the cost problem on the plan's devices
(`plait.cost.program.Problem`), checking every op has a strategy its sharding rule offers, and
replaying the strategies with the one step function (`plait.cost.program.evaluate`): the same
collectives and costs the planner counted, each uneven all-gather / reduce-scatter run as the
plan says (padded where it says nothing: what the runtime runs). Memory comes from the one
memory model (`plait.cost.memory.memory_model`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.cost.program import Problem, Program, evaluate
from plait.cost.spmd import cluster_model_profile
from plait.errors import PlaitError
from plait.ir.aten_graph import AtenGraph
from plait.ir.plan import Plan
from plait.ir.program import SpmdProgram

if TYPE_CHECKING:
    from plait.cluster.spec import Cluster
    from plait.graph.resolve import ModelSource


class ReplayError(PlaitError, ValueError):
    """A plan's program that does not fit the model it is simulated on; the message names the field."""


def model_spec(model: ModelSource, what: str) -> Any:
    """The zoo `ModelSpec` of `model` (a spec string, file.py:factory, or a spec object): programs
    are replayed on the model's aten ops, which an OpGraph does not have."""
    from plait.graph.zoo import load_model

    if hasattr(model, "build") and hasattr(model, "sample_batch"):
        return model
    if not isinstance(model, (str, Path)) or str(model).endswith(".json"):
        raise ReplayError(f"model: {what} is simulated on the model's aten ops; give a zoo spec or "
                          "file.py:factory, not an OpGraph")
    return load_model(str(model))


def replay(problem: Problem, spmd: SpmdProgram, field: str) -> Program:
    """`spmd`'s strategies replayed on `problem` at its ratios (their mean over segments); the
    uneven collectives run as `spmd.collectives` says, padded elsewhere. ReplayError naming `field`
    when the program names ops the graph lacks or a strategy the op's rule does not offer."""
    from plait.cost.spmd import UNEVEN_OPS

    graph = problem.graph
    chosen = spmd.strategies
    unknown = sorted(set(chosen) - {op.name for op in graph.ops})
    if unknown:
        raise ReplayError(f"plan field '{field}': strategies for ops not in model {graph.model}: {unknown[:5]} "
                          "(was the plan made for another model or batch?)")
    choice = []
    for op, offered in zip(graph.ops, problem.options):
        s = chosen.get(op.name)
        if s is None or s not in offered:
            raise ReplayError(f"plan field '{field}': op {op.name} ({op.target}): "
                              + ("no strategy" if s is None else f"strategy {s} is not one its rule offers"))
        choice.append(offered.index(s))
    r = spmd.ratio_array()
    program = evaluate(problem, choice, r.mean(axis=0) if r.ndim == 2 else r)
    modes = spmd.collectives
    program.comms = [(op, dataclasses.replace(c, algorithm=modes.get(c.tensor, "padded")) if c.op in UNEVEN_OPS
                      else c) for op, c in program.comms]
    return program


def capture(spec: Any, batch: int, dtype: str) -> AtenGraph:
    """The model's aten graph at `batch` on the meta device, built and fed in `dtype` (fp32 for
    fp32 / tf32): op names do not depend on the dtype."""
    import torch

    from plait.graph.aten_capture import capture_aten

    tdtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(dtype, torch.float32)
    inputs, _ = spec.sample_batch(batch, dtype=tdtype)
    return capture_aten(spec.build(device="meta", dtype=tdtype), inputs, name=spec.name)


@dataclasses.dataclass
class ComposedReplay:
    """A composed plan's stages as the one lowering takes them (`plait.sim.lowering.pipeline`)."""

    stages: list[Any]  # plait.cost.program.ProgramStage, one per stage
    bytes_per_sample: dict[tuple[int, int], float]
    tied: list[tuple[int, int, float]]
    memory: list[int]  # peak bytes per cluster device under the plan's schedule
    flops: float  # model FLOPs of the iteration


def composed_stages(model: ModelSource, cluster: Cluster, plan: Plan, optimizer: str = "adam",
                    overhead: float | None = None) -> ComposedReplay:
    """A composed plan's stage programs replayed on the model (module docstring): each stage's
    aten sub-graph at its micro-batch on its devices, its program replayed, its memory with the
    micro-batches its schedule keeps in flight (plus `overhead` per GPU, default the framework
    constant); the bytes each edge carries and the parameters two stages share from the one stage
    graph (`plait.cost.traffic.composed_boundaries`)."""
    from plait.cost.devices import DeviceModel
    from plait.cost.memory import composed_peak_memory, memory_model
    from plait.cost.program import ProgramStage, Segments, segments, stage_problem
    from plait.cost.spmd import Devices
    from plait.cost.traffic import composed_boundaries
    from plait.graph.aten_stage import received_inputs
    from plait.graph.resolve import resolve_model

    spec = model_spec(model, "a composed plan")
    dtype = "fp32" if plan.dtype == "tf32" else plan.dtype
    opgraph = resolve_model(getattr(spec, "spec", None) or spec, Plan(dtype=plan.dtype))
    m = plan.num_micro_batches
    pp = len(plan.stages)
    captures: dict[int, AtenGraph] = {}
    devices = DeviceModel.of_cluster(cluster)
    profile = cluster_model_profile(cluster, spec, plan.dtype)
    stages, stage_bytes = [], []
    for s, st in enumerate(plan.stages):
        field = f"stages[{s}].program"
        if st.spmd is None:
            raise ReplayError(f"plan field '{field}': stage {st.name!r} has no SPMD program; a composed plan "
                              "runs one on every stage")
        b = st.micro_batch or plan.micro_batch
        if b not in captures:
            captures[b] = capture(spec, b, dtype)
        aten = captures[b]
        problem = stage_problem(aten, st.layers, Devices.of(devices, dtype, st.devices), m, s == pp - 1,
                                f"{aten.model} stage {s}", profile=profile, grad_dtype=plan.grad_dtype)
        program = replay(problem, st.spmd, field)
        r = st.spmd.ratio_array()
        segs = segments(problem, program) if r.ndim == 2 else Segments.single(problem, program)
        if r.ndim == 2 and r.shape[0] != segs.count:
            raise ReplayError(f"plan field '{field}.ratios': {r.shape[0]} ratio vectors, the program has "
                              f"{segs.count} segment(s)")
        mm = memory_model(problem, program, dtype, optimizer, segs=segs, overhead=overhead)
        held = np.broadcast_to(np.asarray(mm.on(r), dtype=float), (problem.devices.n,))
        stage_bytes.append((list(st.devices), held, np.asarray(mm.activations_on(r), dtype=float)))
        stages.append(ProgramStage(problem, program, r, segs.of_op if r.ndim == 2 else None,
                                   segs.of_dim if r.ndim == 2 else None, name=st.name,
                                   grad_inputs=received_inputs(problem.graph, aten)))
    per_sample, tied = composed_boundaries(plan, opgraph, captures[plan.stages[0].micro_batch or plan.micro_batch])
    memory = composed_peak_memory(stage_bytes, plan.schedule, m, cluster.num_devices)
    flops = (opgraph.fwd_flops + opgraph.bwd_flops) * plan.global_batch
    return ComposedReplay(stages, per_sample, tied, memory, flops)
