"""Capture an `nn.Module`'s forward pass as an `AtenGraph`: aten ops with shapes and dtypes.

`torch.export.export` on the meta device (no memory, no data) gives the forward graph in its
training IR: aten ops at the level a sharding rule reasons about (``aten.linear``,
``aten.layer_norm``, ``aten.softmax``, ``aten.einsum``, ``aten.conv2d``, ``aten.embedding``,
``aten.scaled_dot_product_attention``; views and elementwise ops), each node carrying its output
as a fake tensor (shape, dtype) and the stack of modules that ran it (``nn_module_stack``).

Linking to the layer-level `OpGraph`: an op's layer is the layer of the innermost module that
ran it, by `plait.graph.capture.layer_assignment` -- the same definition the OpGraph capture and
the runtime's pipeline cutter use, so `AtenOp.layer` names an OpGraph `Layer`. Ops outside every
layer (top-level glue) take the layer of their first consumer, else of their last producer, as in
the OpGraph capture.

FLOPs per op: `torch.utils.flop_counter.FlopCounterMode` on the op's meta arguments (the formulas
`capture` uses: 2mnk per matmul, convolutions, attention kernels; zero for elementwise ops).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from plait.graph.capture import CaptureError, is_kv_cache, layer_assignment
from plait.ir.aten_graph import AtenGraph, AtenOp, TensorMeta

__all__ = ["capture_aten"]


def capture_aten(module: nn.Module, sample_inputs: Sequence[Any], *, name: str = "model") -> AtenGraph:
    """The forward pass of `module` on `sample_inputs` as an AtenGraph.

    A module on the meta device is exported with meta inputs (shapes only: a 175B model takes no
    memory). A module elsewhere is exported as it is -- torch.export runs it on fake tensors, so
    nothing is computed and the module is neither moved nor changed."""
    tensors = [*module.parameters(), *module.buffers()]
    on_meta = all(t.device.type == "meta" for t in tensors)
    inputs = tuple(tree_map(_to_meta, tuple(sample_inputs))) if on_meta else tuple(sample_inputs)
    return _graph(_export(module, inputs, name), inputs, module, name)


def capture_on_meta(spec: Any, batch: int, dtype: torch.dtype = torch.float32) -> AtenGraph:
    """The graph of a model spec (`plait.graph.zoo.load_model`) built and fed on the meta device
    at `batch` samples in `dtype`: what the SPMD and composed planners price
    (`plait.spmd.program_plan.capture_graph`) and what their workers run, so a model whose forward
    depends on its device (transformers' MoE routing) gives both the same ops."""
    inputs = spec.sample_batch(batch, device="meta", dtype=dtype)[0]
    return capture_aten(spec.build(device="meta", dtype=dtype), inputs, name=spec.name)


def capture_aten_values(module: nn.Module, sample_inputs: Sequence[Any], *,
                        name: str = "model") -> tuple[AtenGraph, dict[str, torch.Tensor]]:
    """The AtenGraph of `module` on real `sample_inputs` and the value of every tensor in it
    (the graph run op by op): what the numerical checks of sharding rules and per-rank
    programs compare against."""
    inputs = tuple(sample_inputs)
    exported = _export(module, inputs, name)
    graph = _graph(exported, inputs, module, name)
    return graph, _run(exported, inputs)


def _export(module: nn.Module, inputs: tuple[Any, ...], name: str) -> torch.export.ExportedProgram:
    own = module.__dict__.get("forward")  # an instance-level forward (a user's wrapper) to restore
    forward = module.forward
    module.forward = lambda *a, **k: _loss_outputs(forward(*a, **k))  # type: ignore[method-assign]
    try:
        return torch.export.export(module, inputs, strict=False)
    except Exception as exc:  # torch raises many types; report one line naming the model
        raise CaptureError(f"cannot export {name}: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    finally:
        if own is None:
            del module.forward  # the class's own forward again
        else:
            module.forward = own  # type: ignore[method-assign]


def _loss_outputs(output: Any) -> Any:
    """The model's output as the loss reads it. A mapping output (a Hugging Face ModelOutput)
    keeps the one tensor the default loss reads (`plait.graph.zoo.registry.model_output`: its
    `loss`, else its `logits`): the SPMD and composed runtimes hand the loss the graph's outputs,
    and T5's `encoder_last_hidden_state` would otherwise be an output no loss reads, made on the
    encoder's stage. Key/value caches (`is_kv_cache`) go: torch.export cannot flatten one, and
    T5 returns one even with `use_cache` off; in a tuple a cache becomes None."""
    if isinstance(output, dict):
        for key in ("loss", "logits"):
            if isinstance(output.get(key), torch.Tensor):
                return type(output)(**{key: output[key]})
        if any(is_kv_cache(v) for v in output.values()):
            return type(output)(**{k: v for k, v in output.items() if not is_kv_cache(v)})
    if isinstance(output, tuple) and any(is_kv_cache(v) for v in output):
        return tuple(None if is_kv_cache(v) else v for v in output)
    return output


def _graph(exported: torch.export.ExportedProgram, inputs: tuple[Any, ...], module: nn.Module,
           name: str) -> AtenGraph:
    batch = next((int(t.shape[0]) for t in inputs if isinstance(t, torch.Tensor) and t.dim()), 1)
    builder = _Builder(name, batch, layer_assignment(module, name))
    builder.placeholders(exported, module)
    for node in exported.graph.nodes:
        if node.op == "call_function":
            builder.call(node)
        elif node.op == "output":
            builder.output(node)
    graph = builder.graph
    _assign_glue(graph, builder.unplaced)
    graph.validate()
    return graph


def _run(exported: torch.export.ExportedProgram, inputs: tuple[Any, ...]) -> dict[str, torch.Tensor]:
    """Interpret the exported graph, naming values as `_Builder` names tensors."""
    state = {**exported.state_dict, **exported.constants}
    env: dict[Any, Any] = {}
    user = iter(inputs)
    values: dict[str, torch.Tensor] = {}
    for spec, node in zip(exported.graph_signature.input_specs,
                          (n for n in exported.graph.nodes if n.op == "placeholder")):
        env[node] = next(user) if spec.kind.name == "USER_INPUT" else state[spec.target]
    for node in exported.graph.nodes:
        if node.op != "call_function":
            continue
        args = tree_map(lambda a: env[a] if isinstance(a, torch.fx.Node) else a, node.args)
        kwargs = tree_map(lambda a: env[a] if isinstance(a, torch.fx.Node) else a, node.kwargs)
        with torch.no_grad():
            env[node] = node.target(*args, **kwargs)
    for node, val in env.items():
        if isinstance(val, torch.Tensor):
            values[node.name] = val
        elif isinstance(val, (tuple, list)) and node.target is not operator.getitem:
            for i, v in enumerate(val):
                if isinstance(v, torch.Tensor):
                    values[f"{node.name}.{i}"] = v
    return values


_CHECKS = {torch.ops.aten._assert_tensor_metadata.default}


def _to_meta(x: Any) -> Any:
    return x.detach().to("meta") if isinstance(x, torch.Tensor) else x


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


class _Builder:
    def __init__(self, name: str, batch: int, heads: dict[str, tuple[str, str]]) -> None:
        self.graph = AtenGraph(model=name, batch=batch)
        # module path -> layer name, longest prefix first
        self.heads = sorted(((p, n) for p, (n, _) in heads.items()), key=lambda x: -len(x[0]))
        self.names: dict[Any, Any] = {}  # fx node -> tensor name, or tuple of them for multi-output ops
        self.unplaced: set[str] = set()

    def layer_of(self, path: str) -> str | None:
        for prefix, layer in self.heads:
            if prefix == "" or path == prefix or path.startswith(prefix + "."):
                return layer
        return None

    def placeholders(self, exported: torch.export.ExportedProgram, module: nn.Module | None = None) -> None:
        """One tensor per placeholder -- but one per parameter *object*: a tied parameter (one
        nn.Parameter under two paths, e.g. BERT's word embedding and its MLM decoder) is exported
        as two placeholders; both become the first path's tensor, so its bytes, gradient and
        optimizer state are counted once, as the module holds them."""
        kinds = {spec.arg.name: spec for spec in exported.graph_signature.input_specs}
        owner: dict[int, str] = {}  # id of a parameter object -> the tensor that stands for it
        for node in exported.graph.nodes:
            if node.op != "placeholder":
                continue
            spec = kinds[node.name]
            kind = spec.kind.name  # PARAMETER, BUFFER, USER_INPUT, CONSTANT_TENSOR
            role = {"PARAMETER": "param", "BUFFER": "buffer", "USER_INPUT": "input"}.get(kind, "constant")
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            if role == "param" and module is not None:
                key = id(module.get_parameter(spec.target))
                if key in owner:
                    self.names[node] = owner[key]
                    continue
                owner[key] = node.name
            self.graph.tensors[node.name] = TensorMeta(node.name, list(val.shape), _dtype(val), role,
                                                       param=spec.target if role in ("param", "buffer") else None)
            if role == "input":
                self.graph.inputs.append(node.name)
            self.names[node] = node.name

    def call(self, node: torch.fx.Node) -> None:
        if node.target is operator.getitem:  # picks one output of a multi-output op: an alias
            src = self.names.get(node.args[0])
            if isinstance(src, tuple):
                self.names[node] = src[node.args[1]]
            return
        if node.target in _CHECKS:  # export's runtime assertions: no data flows through them
            return
        target = str(node.target)
        stack = node.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else ""
        layer = self.layer_of(path) if stack else None
        inputs: list[str] = []
        args = [self._arg(a, inputs) for a in node.args]
        kwargs = {k: self._arg(v, inputs) for k, v in node.kwargs.items()}
        val = node.meta.get("val")
        vals = list(val) if isinstance(val, (tuple, list)) else [val]
        outs: list[str] = []
        made_from_input = any(self.graph.tensors[t].role not in ("constant",) for t in inputs)
        for i, v in enumerate(vals):
            if not isinstance(v, torch.Tensor):
                outs.append("")
                continue
            tname = node.name if len(vals) == 1 and not isinstance(val, (tuple, list)) else f"{node.name}.{i}"
            role = "activation" if made_from_input else "constant"
            self.graph.tensors[tname] = TensorMeta(tname, list(v.shape), _dtype(v), role, producer=node.name)
            outs.append(tname)
        self.names[node] = tuple(outs) if isinstance(val, (tuple, list)) else outs[0]
        op = AtenOp(name=node.name, target=target, layer=layer or "", module=path, inputs=inputs,
                    outputs=[o for o in outs if o], args=args, kwargs=kwargs,
                    flops=_flops(node))
        if layer is None:
            self.unplaced.add(node.name)
        self.graph.ops.append(op)

    def _arg(self, a: Any, inputs: list[str]) -> Any:
        if isinstance(a, torch.fx.Node):
            name = self.names.get(a)
            if isinstance(name, str) and name:
                inputs.append(name)
                return {"t": name}
            return None
        if isinstance(a, (list, tuple)):
            return [self._arg(x, inputs) for x in a]
        if isinstance(a, (int, float, bool, str)) or a is None:
            return a
        if isinstance(a, torch.dtype):
            return _dtype(torch.empty(0, dtype=a))
        return str(a)  # devices, layouts, memory formats: kept readable, not interpreted

    def output(self, node: torch.fx.Node) -> None:
        inputs: list[str] = []
        self._arg(node.args[0], inputs)
        self.graph.outputs = inputs


def _flops(node: torch.fx.Node) -> float:
    """Forward FLOPs of one node by FlopCounterMode on its meta (fake) arguments."""

    def meta(x: Any) -> Any:
        if isinstance(x, torch.fx.Node):
            v = x.meta.get("val")
            return torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v
        return x

    args = tree_map(meta, node.args)
    kwargs = tree_map(meta, node.kwargs)
    if not callable(node.target):
        return 0.0
    try:
        with FlopCounterMode(display=False) as counter:
            node.target(*args, **kwargs)
    except Exception:  # an op without a meta kernel costs nothing we can count
        return 0.0
    return float(counter.get_total_flops())


def _assign_glue(graph: AtenGraph, unplaced: set[str]) -> None:
    """Ops outside every layer take their first consumer's layer, else their last producer's."""
    if not unplaced:
        return
    by_name = {op.name: op for op in graph.ops}
    consumers = graph.consumers()
    for op in reversed(graph.ops):
        if op.name in unplaced:
            for t in op.outputs:
                layer = next((by_name[c].layer for c in consumers[t] if by_name[c].layer), "")
                if layer:
                    op.layer = layer
                    break
    last = ""
    for op in graph.ops:
        if not op.layer:
            prods = [by_name[p].layer for t in op.inputs if (p := graph.tensors[t].producer)]
            op.layer = next((p for p in reversed(prods) if p), last)
        last = op.layer or last
    first = next((op.layer for op in graph.ops if op.layer), graph.model)
    for op in graph.ops:
        op.layer = op.layer or first
