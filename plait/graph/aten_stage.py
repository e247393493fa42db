"""A pipeline stage's share of the model as an AtenGraph: the op-level view of the stage's layers.

Composition of families (issue 17 item 1) runs an SPMD program per pipeline stage. Its program is
synthesized (`plait.spmd.ratios.synthesize`) on the stage's own graph: the ops of the model's
AtenGraph whose `AtenOp.layer` is one of the stage's layers (the layers of `plait.ir.stage_graph`,
so both views cut the model at the same place), captured at the stage's micro-batch. A value made
by an earlier stage enters as an input (it arrives whole from the previous stage, so any shard of
it is free, as the search treats inputs); the stage's outputs are its values read by a later stage
or by the loss, gathered whole at its end (the search makes the loss's reads whole, which is what
the next stage receives).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from plait.ir.aten_graph import AtenGraph, TensorMeta
from plait.ir.program import ShardingError


def stage_subgraph(graph: AtenGraph, layers: Iterable[str], *, name: str | None = None) -> AtenGraph:
    """The ops of `layers` with their tensors; values from other stages become inputs.

    Raises ShardingError when the layers own no op or read a value a later stage makes (the stage
    order must follow the model's)."""
    keep = set(layers)
    ops = [op for op in graph.ops if op.layer in keep]
    if not ops:
        raise ShardingError(f"stage {name or sorted(keep)[:3]}: its layers own no op of {graph.model!r}")
    mine = {op.name for op in ops}
    position = {op.name: k for k, op in enumerate(graph.ops)}
    first = position[ops[0].name]
    tensors: dict[str, TensorMeta] = {}
    inputs: list[str] = []
    for op in ops:
        for t in op.inputs:
            meta = graph.tensors[t]
            if t in tensors:
                continue
            if meta.producer is not None and meta.producer not in mine:
                if position[meta.producer] > first:
                    raise ShardingError(f"stage {name or ''}: op {op.name} reads {t}, made later by "
                                        f"{meta.producer} in another stage")
                tensors[t] = TensorMeta(t, list(meta.shape), meta.dtype, "input")
                inputs.append(t)
            else:
                tensors[t] = meta
                if meta.role == "input":
                    inputs.append(t)
        for t in op.outputs:
            tensors[t] = graph.tensors[t]
    later: set[str] = set(graph.outputs)
    for op in graph.ops:
        if op.name not in mine:
            later.update(op.inputs)
    outputs = [t for op in ops for t in op.outputs if t in later]
    if not outputs:
        raise ShardingError(f"stage {name or ''}: nothing it computes is read by a later stage or the loss")
    sub = AtenGraph(model=name or graph.model, batch=graph.batch, tensors=tensors, ops=ops,
                    inputs=inputs, outputs=outputs)
    sub.validate()
    return sub


def shared_params(graph: AtenGraph, stages: list[list[str]]) -> list[str]:
    """Parameters read by ops of more than one stage (tied weights: each stage keeps a copy)."""
    owner: dict[str, set[int]] = {}
    for s, layers in enumerate(stages):
        keep = set(layers)
        for op in graph.ops:
            if op.layer in keep:
                for t in op.inputs:
                    if graph.tensors[t].role == "param":
                        owner.setdefault(t, set()).add(s)
    return sorted(t for t, s in owner.items() if len(s) > 1)


def batch_loss_output(sub: AtenGraph, strategies: dict[str, Any]) -> str | None:
    """The last stage's output whose loss its ranks compute on their batch shards, each weighted by
    its rows (as a pipeline weighs micro-batches, n_j / B), instead of gathering it whole: the
    stage's one output when its producer's strategy leaves it sharded on dimension 0 of batch size.
    The runtime (`plait.runtime.compose_worker`) and the simulator (`plait.sim.lowering.pipeline`) both
    ask here."""
    from plait.ir.program import shard_dim

    if len(sub.outputs) != 1:
        return None
    t = sub.outputs[0]
    meta = sub.tensors[t]
    for op in sub.ops:
        if t in op.outputs:
            p = strategies[op.name].outputs[op.outputs.index(t)]
            return t if shard_dim(p) == 0 and meta.shape and meta.shape[0] == sub.batch else None
    return None


def free_outputs(sub: AtenGraph, loss: bool) -> dict[str, tuple[str, ...]]:
    """The placements a stage's outputs may be left in at no boundary cost (`plait.spmd.search.
    Problem.outputs_free`): whole (what the next stage receives, `plait.sim.lowering.spmd.
    boundary_comms` gathers anything else), and for the `loss` stage's one output of batch rows
    also sharded on the batch (`batch_loss_output`: each rank's loss on its rows, never gathered).
    Without it the search leaves an output sharded on any dimension for free and the boundary
    pays the gather -- BERT's head left its logits sharded on the sequence: 1 GB gathered per
    micro-batch of 32."""
    out = {t: ("R",) for t in sub.outputs}
    if loss and len(sub.outputs) == 1:
        meta = sub.tensors[sub.outputs[0]]
        if meta.shape and meta.shape[0] == sub.batch:
            out[sub.outputs[0]] = ("R", "S0")
    return out


def received_inputs(sub: AtenGraph, model: AtenGraph) -> tuple[str, ...]:
    """The floating values stage `sub` receives from an earlier stage (its inputs that are not
    `model`'s own): their gradients go back to the stage that sent them."""
    return tuple(t for t in sub.inputs if t not in model.inputs
                 and sub.tensors[t].dtype.startswith(("float", "bfloat")))
