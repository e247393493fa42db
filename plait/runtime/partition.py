"""Model side of the runtime: load a model spec, list its layers, feed it data, cut it into stages.

* `load_model_spec(spec)` returns an object with `build`, `sample_batch` and `loss`
  (the zoo's `ModelSpec` contract).
* `layer_modules(model)` lists the model's layers the way the capture does: a module
  marked `plait_layer` is one layer; an unmarked module without marked descendants is
  one layer when its parent holds marked modules (or is the root); containers of marked
  modules (e.g. a `ModuleList` of transformer blocks) are not layers.
* `make_samples(...)` builds samples from a seed per *global sample index*, so any split of
  the global batch over replicas and micro-batches (`replica_micro_batches`) sees the same
  samples as the single-process reference.
* `split_into_stages(model, counts)` cuts the model into a linear pipeline with
  `torch.fx`: layers are traced as leaves, every other node (glue such as a residual
  add or positional-embedding sum) goes to the earliest stage that has all of its inputs,
  and the values alive across each cut become the stage's outputs (GPipe's partitioning
  of a sequential model, generalised to any traceable forward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from plait.errors import PlaitError


class RuntimeSetupError(PlaitError, ValueError):
    """A model, plan or cluster that the runtime cannot run; the message says which and why."""


# ---------------------------------------------------------------------------------- model specs
def _looks_like_spec(obj: Any) -> bool:
    return all(callable(getattr(obj, name, None)) for name in ("build", "sample_batch", "loss"))


def load_model_spec(spec: Any) -> Any:
    """A ModelSpec (build, sample_batch, loss) from a zoo string, `file.py:factory`, or a ModelSpec."""
    if _looks_like_spec(spec):
        return spec
    from plait.graph.zoo import load_model

    return load_model(spec)


def model_spec_string(spec: Any) -> str:
    """The string a worker process can load `spec` from (workers cannot receive Python objects)."""
    if isinstance(spec, str):
        return spec
    source = getattr(spec, "spec", None)  # the zoo records the string a ModelSpec came from
    if isinstance(source, str) and source:
        return source
    raise RuntimeSetupError("model: pass a zoo spec string or 'file.py:factory' so worker processes can load it")


# ---------------------------------------------------------------------------------- layers
def layer_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers as (qualified name, module), in registration order: exactly the
    OpGraph's layers (`plait.graph.capture.layer_assignment`), so a plan's `layer_split`
    counts the same units here as in the planner and the simulator."""
    from plait.graph.capture import layer_assignment

    return [(path, model.get_submodule(path) if path else model) for path in layer_assignment(model)]


def _layer_style(module: nn.Module) -> str:
    """The OpGraph Layer.tp_style of a layer module (its `plait_layer` marker, else "none")."""
    style = getattr(module, "plait_layer", None)
    return style if isinstance(style, str) else "none"


# ---------------------------------------------------------------------------------- data
def sample_seed(data_seed: int, global_index: int) -> int:
    """Seed of one sample: depends only on the run's data seed and the sample's global index."""
    return (data_seed * 1_000_003 + global_index) % (2**31 - 1)


def make_samples(spec: Any, first: int, count: int, data_seed: int, device: str | torch.device = "cpu"
                 ) -> tuple[tuple[Any, ...], torch.Tensor]:
    """Samples `first .. first+count-1` (global indices), concatenated along the batch dim."""
    if count <= 0:
        raise ValueError("count must be positive")
    parts = [spec.sample_batch(1, device=device, seed=sample_seed(data_seed, first + i)) for i in range(count)]
    inputs = tuple(_cat([p[0][j] for p in parts]) for j in range(len(parts[0][0])))
    target = _cat([p[1] for p in parts])
    return inputs, target


def _cat(values: list[Any]) -> Any:
    if isinstance(values[0], torch.Tensor):
        return torch.cat(values, dim=0) if values[0].dim() > 0 else values[0]
    return values[0]


def split_counts(total: int, parts: int) -> list[int]:
    """`total` split into `parts` near-equal integers, larger first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class MicroBatch:
    index: int
    first: int  # global sample index of its first sample
    size: int


def replica_micro_batches(plan: Any, step: int, dp_index: int) -> list[MicroBatch]:
    """Micro-batches replica `dp_index` runs at `step`.

    The replica owns a contiguous range of the step's global batch (its share from
    `plan.samples_per_replica()`), cut into ceil(n / micro_batch) near-equal micro-batches,
    so even shares give exactly `plan.num_micro_batches` of size `plan.micro_batch` and an
    uneven (HAP-style) share runs more or fewer micro-batches."""
    from plait.ir.stage_graph import replica_micro_batches as stage_graph_micro_batches
    from plait.ir.stage_graph import replica_samples

    # The stage graph's rounding rule (plait.ir.stage_graph): the same split the planner,
    # the memory estimator and the simulator use.
    counts = replica_samples(plan.global_batch, plan.dp_shares, plan.dp)
    offset = step * plan.global_batch + sum(counts[:dp_index])
    return [MicroBatch(u.index, u.first, u.size)
            for u in stage_graph_micro_batches(offset, counts[dp_index], plan.micro_batch)]


# ---------------------------------------------------------------------------------- stages
class _LayerTracer(fx.Tracer):
    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(m, module_qualified_name)


@dataclass
class Stage:
    """One pipeline stage: `module(*inputs)` returns the tuple of values alive after the cut
    (the model output, unwrapped, for the last stage)."""

    index: int
    module: nn.Module
    layers: list[str]
    input_names: list[str]
    output_names: list[str]


def split_into_stages(model: nn.Module,
                      counts: Sequence[int] | Callable[[int, list[str]], list[int]]) -> list[Stage]:
    """Cut `model` into stages holding counts[i] consecutive layers each (in execution order).

    `counts` may be a function of the number of layers the forward runs and their styles
    (e.g. `plan.layers_per_stage`, which applies Megatron's split to transformers). A single
    stage is the model itself, untraced."""
    layers = layer_modules(model)
    names = [n for n, _ in layers]
    if not callable(counts) and len(counts) == 1:
        return [Stage(0, model, names, [], [])]
    try:
        graph = _LayerTracer(set(names)).trace(model)
    except Exception as exc:  # fx cannot trace data-dependent control flow
        raise RuntimeSetupError(
            f"model {type(model).__name__}: cannot be cut into pipeline stages, torch.fx tracing "
            f"failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target in set(names)]
    order: list[str] = []
    for n in calls:
        if n.target not in order:
            order.append(n.target)
    if callable(counts):
        modules = dict(layers)
        styles = [_layer_style(modules[name]) for name in order]
        counts = counts(len(order), styles)
    if len(counts) == 1:
        return [Stage(0, model, order, [], [])]
    if sum(counts) != len(order):
        raise RuntimeSetupError(
            f"model {type(model).__name__}: plan splits {sum(counts)} layers but the model runs {len(order)}")
    layer_stage: dict[str, int] = {}
    i = 0
    for s, c in enumerate(counts):
        for name in order[i:i + c]:
            layer_stage[name] = s
        i += c
    last = len(counts) - 1
    stage_of: dict[fx.Node, int | None] = {}
    nodes = list(graph.nodes)
    for n in nodes:
        if n.op == "placeholder":
            stage_of[n] = 0
        elif n.op == "call_module" and n.target in layer_stage:
            stage_of[n] = layer_stage[n.target]
        elif n.op == "output":
            stage_of[n] = last
        else:
            fixed = [stage_of[a] for a in n.all_input_nodes if stage_of[a] is not None]
            stage_of[n] = max(fixed) if fixed else None  # None: floats (get_attr, constants)
    for n in reversed(nodes):  # floating nodes go to their first consumer's stage
        if stage_of[n] is None:
            users = [stage_of[u] for u in n.users if stage_of[u] is not None]
            stage_of[n] = min(users) if users else last
    for n in nodes:
        for a in n.all_input_nodes:
            if stage_of[a] > stage_of[n]:  # type: ignore[operator]
                raise RuntimeSetupError(
                    f"model {type(model).__name__}: layer order is not a chain ({a.name} in stage "
                    f"{stage_of[a]} feeds {n.name} in stage {stage_of[n]})")
    # Values alive across cut k: produced at stage <= k, used at a stage > k.
    live: list[list[fx.Node]] = []
    for k in range(last):
        live.append([n for n in nodes if n.op != "output" and stage_of[n] <= k  # type: ignore[operator]
                     and any(stage_of[u] > k for u in n.users)])  # type: ignore[operator]
    output_node = next(n for n in nodes if n.op == "output")
    stages = []
    for k in range(len(counts)):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        lookup = env.__getitem__
        if k == 0:
            inputs = [n for n in nodes if n.op == "placeholder"]
            for n in inputs:
                env[n] = g.node_copy(n)
        else:
            inputs = live[k - 1]
            for n in inputs:
                env[n] = g.placeholder(n.name)
        for n in nodes:
            if stage_of[n] == k and n.op not in ("placeholder", "output") and n not in env:
                env[n] = g.node_copy(n, lookup)
        if k == last:
            g.output(fx.node.map_arg(output_node.args[0], lookup))
            outs: list[fx.Node] = []
        else:
            outs = live[k]
            g.output(tuple(env[n] for n in outs))
        g.lint()
        module = fx.GraphModule(model, g, class_name=f"Stage{k}")
        stages.append(Stage(k, module, [n for n in order if layer_stage[n] == k],
                            [n.name for n in inputs], [n.name for n in outs]))
    return stages
