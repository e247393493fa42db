"""Shapes, dtypes and devices for torch.fx tracing: what lets a library's forward trace.

torch.fx traces with proxies that carry no shape, so a forward that branches on one
(transformers' ``if q_length == 1 or kv_length == q_length``) or reads a dtype
(``torch.finfo(x.dtype)``) stops it ("symbolically traced variables cannot be used as inputs to
control flow"). `ConcreteValues` works out, on demand, the value each fx node has for a sample
call -- the model run on fake tensors (shapes only, nothing allocated), the sample being the
inputs' shapes and dtypes (`plait_inputs`) -- and `ConcreteProxy` answers from it what Python
must know at trace time: ``bool`` of a comparison of sizes, ``len``, iteration, ``int``, a
tensor's ``dtype`` and ``device``. Everything else stays symbolic, so a size read into a
``view`` follows the batch at run time; only branches are taken for the sample's sizes (the
Hugging Face tracer of transformers 4 did the same with meta tensors).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

__all__ = ["ConcreteProxy", "ConcreteValues", "UNKNOWN"]


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN = _Unknown()


class ConcreteValues:
    """The value of each node of a graph being traced from `root`, computed when first asked
    (memoised), on fake tensors. `inputs`: (shape, dtype) per placeholder, in order."""

    def __init__(self, root: torch.nn.Module, inputs: tuple[tuple[tuple[int, ...], torch.dtype], ...]):
        self.root = root
        self.inputs = inputs
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.values: dict[fx.Node, Any] = {}
        self.running = False
        self.device = next((p.device for p in root.parameters()), torch.device("cpu"))

    def of(self, node: fx.Node) -> Any:
        if node not in self.values:
            outer = self.running
            self.running = True  # the tracer runs modules as they are meanwhile
            try:
                with self.mode:
                    self.values[node] = self._compute(node)
            except Exception:  # a value it cannot compute stays symbolic (the trace may still go on)
                self.values[node] = UNKNOWN
            finally:
                self.running = outer
        return self.values[node]

    def _arg(self, a: Any) -> Any:
        def conv(x: Any) -> Any:
            if isinstance(x, fx.Node):
                v = self.of(x)
                if v is UNKNOWN:
                    raise LookupError(x.name)
                return v
            return x

        return tree_map(conv, a)

    def _compute(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            index = [n for n in node.graph.nodes if n.op == "placeholder"].index(node)
            if index >= len(self.inputs):
                return node.args[0] if node.args else UNKNOWN
            shape, dtype = self.inputs[index]
            return torch.empty(shape, dtype=dtype, device=self.device)
        if node.op == "get_attr":
            obj: Any = self.root
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
            return obj
        args, kwargs = self._arg(node.args), self._arg(node.kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        if node.op == "call_module":
            return self.root.get_submodule(str(node.target))(*args, **kwargs)
        return UNKNOWN


class ConcreteProxy(fx.Proxy):
    """An fx proxy that answers ``len``, iteration, ``int``, ``dtype`` and ``device`` from the
    node's value for the sample call (`ConcreteValues`), where it is known."""

    def _value(self) -> Any:
        values = getattr(self.tracer, "concrete", None)
        return values.of(self.node) if values is not None else UNKNOWN

    def __len__(self) -> int:
        v = self._value()
        if v is UNKNOWN:
            return super().__len__()
        return len(v)

    def __iter__(self) -> Any:
        v = self._value()
        if v is UNKNOWN or not hasattr(v, "__len__"):
            return super().__iter__()
        return iter([self[i] for i in range(len(v))])

    def __index__(self) -> int:
        v = self._value()
        if isinstance(v, torch.Tensor) or v is UNKNOWN:
            raise fx.proxy.TraceError(f"{self.node.name}: an int that depends on tensor data")
        return int(v)

    __int__ = __index__

    @property
    def dtype(self) -> Any:
        v = self._value()
        return v.dtype if isinstance(v, torch.Tensor) else self.__getattr__("dtype")

    @property
    def device(self) -> Any:
        v = self._value()
        return v.device if isinstance(v, torch.Tensor) else self.__getattr__("device")

    def bool_value(self) -> bool | None:
        """bool() of a value known at trace time that depends on no tensor's data (sizes,
        Python numbers); None otherwise."""
        v = self._value()
        if v is UNKNOWN or isinstance(v, torch.Tensor):
            return None
        return bool(v)
