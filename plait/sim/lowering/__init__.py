"""Lowering: a plan's stages, each running a typed program, to the one engine's task graph.

A plan is a stage graph (a chain is the special case; `plait.ir.stage_graph`) whose every stage
runs a program over its devices, driven by the pipeline schedule's action lists
(`plait.schedule`). Two kinds of stage program exist, and each has one emitter:

* `tensor_parallel` -- Megatron tensor parallelism over a stage's tp devices, replicated over dp
  with shares, per layer (`plait.cost.compute.layer_cost`): 3D plans and graph pipelines
  (GraphPipe), with ZeRO, interleaving, uneven replicas and the layer/stage granularity switch;
* `spmd` -- an op-level SPMD program (HAP) over a stage's devices at per-device ratios, driven
  by `pipeline`: an SPMD plan is one such stage, a composed plan a chain or DAG of them.

`collectives` turns collectives and pipeline messages of op-level stages into flows on the
cluster's links (`plait.net.view`). Memory is not lowered: it comes from `plait.cost.memory`.
"""

from plait.sim.lowering.collectives import SpmdLoweringError
from plait.sim.lowering.pipeline import PipelineDriver
from plait.sim.lowering.spmd import ProgramLowered, lower_compose, lower_spmd
from plait.sim.lowering.tensor_parallel import Lowered, LoweringError, SimOptions, lower

__all__ = ["Lowered", "LoweringError", "PipelineDriver", "ProgramLowered", "SimOptions", "SpmdLoweringError",
           "lower", "lower_compose", "lower_spmd"]
