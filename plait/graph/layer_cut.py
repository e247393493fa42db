"""Where a model is cut into OpGraph layers: the one definition the capture, the runtime's
pipeline cutter, the layer profiler and the aten capture share.

* A module marked ``plait_layer`` is one layer (the zoo marks its layers), except one marked
  ``"glue"``: no layer, its ops are glue of their first consumer (an HF decoder's rotary tables,
  which the zoo computes inside each attention core); in a model with
  markers, an unmarked module without marked descendants is one layer when its parent holds
  marked modules (or is the root), and nothing more is refined: the author chose the cut.
* A model without markers (a user's ``nn.Module``) starts from its top-level children and is
  refined, one level of the module tree per round, until it is fine enough to be pipelined
  over ``granularity`` stages (default `DEFAULT_GRANULARITY`, or the root's
  ``plait_granularity`` attribute): a layer is split into its children when it is a
  container nothing calls (``nn.ModuleList``, ``nn.ModuleDict``: never a layer of its own),
  or when it holds a container (``nn.ModuleList``, ``nn.ModuleDict``, ``nn.Sequential``, itself
  or below) and more than 1/granularity of the model's parameters. Container children are
  expanded in the same round (a tower ``proj`` + ``ModuleList`` of blocks becomes ``proj``,
  ``blocks.0``, ``blocks.1``, ...). Each round is checked with torch.fx (the tracer the runtime
  cuts stages with): a split is kept only where every new layer runs exactly once and nothing
  below a new layer is called from outside it; otherwise the module stays one layer and the
  cut says why in its ``notes``. A model whose forward torch.fx cannot trace (data-dependent
  control flow) keeps its top-level children, with a note.

Splitting by the parameter share stops at the level a balanced pipeline of ``granularity``
stages needs (PipeDream, Piper and GraphPipe all plan over such a layer graph); a finer
cut only costs search time and glue between layers.
"""

from __future__ import annotations

import dis
import inspect
import linecache
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from plait.errors import PlaitError
from plait.graph.concrete_trace import ConcreteProxy, ConcreteValues
from plait.graph.tp_plan import tensor_parallel_style

__all__ = ["DEFAULT_GRANULARITY", "LayerCut", "LayerCutError", "LayerTracer", "is_marked", "layer_cut",
           "input_signature", "model_inputs", "pure_chains"]

# Pipelines of up to 8 stages balance over a cut where no splittable layer holds more than
# 1/8 of the parameters; GraphPipe's cases (4 branches x 8 blocks, 2 x 4 on 8 devices) need it.
DEFAULT_GRANULARITY = 8

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_UNCALLED = (nn.ModuleList, nn.ModuleDict)


class LayerCutError(PlaitError, ValueError):
    """A bad ``plait_granularity`` on a model."""


@dataclass(frozen=True)
class LayerCut:
    """`heads`: {module path: (layer name, tp style)} in registration order; `notes`: why a
    module was not split further (empty when nothing stopped the refinement)."""

    heads: dict[str, tuple[str, str]]
    notes: tuple[str, ...] = ()


def _marked(m: nn.Module) -> bool:
    return getattr(m, "plait_layer", None) is not None


def is_marked(root: nn.Module) -> bool:
    """Whether any module of `root` carries a ``plait_layer`` marker (then the cut is the author's)."""
    return any(_marked(m) for m in root.modules())


def _coarse(root: nn.Module) -> dict[str, tuple[str, str]]:
    """Marked modules, and unmarked modules beside them (or under the root) without markers."""
    has_marked: dict[int, bool] = {}

    def any_marked(m: nn.Module) -> bool:
        key = id(m)
        if key not in has_marked:
            has_marked[key] = _marked(m) or any(any_marked(c) for c in m.children())
        return has_marked[key]

    heads: dict[str, tuple[str, str]] = {}
    seen: set[int] = set()

    def mark_seen(m: nn.Module) -> None:
        for sub in m.modules():
            seen.add(id(sub))

    def walk(m: nn.Module, path: str) -> None:
        if id(m) in seen:  # a module reachable twice belongs to its first path
            return
        seen.add(id(m))
        for name, child in m.named_children():
            cpath = f"{path}.{name}" if path else name
            if getattr(child, "plait_layer", None) == "glue":  # no layer: its ops go with their consumer
                mark_seen(child)
            elif _marked(child):
                heads[cpath] = (cpath, str(child.plait_layer))
                mark_seen(child)
            elif any_marked(child):
                walk(child, cpath)
            elif id(child) not in seen:
                heads[cpath] = (cpath, "none")
                mark_seen(child)

    walk(root, "")
    return heads


def _granularity(root: nn.Module, granularity: int | None) -> int:
    g = granularity if granularity is not None else getattr(root, "plait_granularity", DEFAULT_GRANULARITY)
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise LayerCutError(
            f"model {type(root).__name__}: plait_granularity must be a positive integer (the number "
            f"of pipeline stages the layer cut should allow), got {g!r}")
    return g


def _holds_container(m: nn.Module) -> bool:
    return any(isinstance(sub, _CONTAINERS) and len(sub._modules) > 0 for sub in m.modules())


def _params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _children(root: nn.Module, path: str, seen: set[int]) -> list[str]:
    """The layers that replace `path` when it is split: its children, with uncalled containers
    expanded; modules seen before (shared) and empty containers are dropped."""
    out: list[str] = []
    for name, child in root.get_submodule(path)._modules.items():
        if child is None or id(child) in seen:
            continue
        cpath = f"{path}.{name}" if path else name
        if isinstance(child, _UNCALLED):
            seen.add(id(child))
            out.extend(_children(root, cpath, seen))
        else:
            seen.update(id(sub) for sub in child.modules())
            out.append(cpath)
    return out


class LayerTracer(fx.Tracer):
    """torch.fx with the given module paths as leaves (the runtime cuts stages with it too).

    An ``assert`` on a traced value (``assert t <= self.block_size``, nanoGPT's) is recorded as
    ``torch._assert`` and tracing goes on: torch.fx does so itself only where ``trace_asserts``
    recognises the bytecode, which Python 3.11 changed (``POP_JUMP_FORWARD_IF_TRUE``). Any other
    branch on a traced value still fails (it is data- or shape-dependent control flow)."""

    def __init__(self, leaves: set[str], inputs: int | None = None) -> None:
        super().__init__()
        self.leaves = leaves
        self.inputs = inputs
        self.concrete: ConcreteValues | None = None

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return qualified_name in self.leaves or super().is_leaf_module(m, qualified_name)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        if isinstance(root, nn.Module):
            sample = getattr(root, "plait_inputs", None)
            if self.inputs is None:
                self.inputs = model_inputs(root)
            if isinstance(sample, tuple):
                self.concrete = ConcreteValues(root, sample)
        return super().trace(root, concrete_args)

    def create_args_for_root(self, root_fn: Any, is_module: bool, concrete_args: Any = None) -> Any:
        """The root's placeholders: the arguments the model is called with (its first
        `inputs` positional ones, `model_inputs`); the rest take their defaults, as in the call
        (a Hugging Face forward has a dozen optional arguments and ``**kwargs``: as proxies,
        ``if attention_mask is None`` would take the wrong branch). A forward behind a
        ``functools.wraps`` decorator that takes ``(*args, **kwargs)`` (transformers'
        ``can_return_tuple``) is traced as the function it wraps, whose signature torch.fx reads
        (it cannot patch the wrapper's code to that signature)."""
        inner = inspect.unwrap(root_fn)
        if inner is not root_fn and _varargs_only(root_fn):
            root_fn = inner
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)
        if self.inputs is None or concrete_args is not None:
            return fn, args
        params = list(inspect.signature(inner).parameters.values())[1 if is_module else 0:]
        first = 1 if is_module else 0
        for j, param in enumerate(params):
            k = first + j
            if j < self.inputs or k >= len(args) or not isinstance(args[k], fx.Proxy):
                continue
            if param.kind is param.VAR_POSITIONAL:
                value: Any = ()
            elif param.kind is param.VAR_KEYWORD:
                value = {}
            elif param.name == "use_cache":
                value = False  # a training step keeps no key/value cache (a cache object cannot be traced)
            elif param.default is not param.empty:
                value = param.default
            else:
                continue  # required: stays a placeholder
            node = args[k].node
            if not node.users:
                self.graph.erase_node(node)
                args[k] = value
        return fn, args

    def to_bool(self, obj: fx.Proxy) -> bool:
        frame = inspect.currentframe()
        caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
        if caller is not None and _asserts(caller):
            where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
            line = linecache.getline(caller.f_code.co_filename, caller.f_lineno).strip()
            self.create_proxy("call_function", torch._assert, (obj, f"{line} ({where})"), {})
            return True
        if isinstance(obj, ConcreteProxy):
            known = obj.bool_value()
            if known is not None:
                return known
        return super().to_bool(obj)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        if self.concrete is not None and self.concrete.running:  # a sample value, not a trace
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if self.concrete is not None and self.concrete.running:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ConcreteProxy(node, self)

    def iter(self, obj: fx.Proxy) -> Any:
        if isinstance(obj, ConcreteProxy):
            return obj.__iter__()
        return super().iter(obj)


def _varargs_only(fn: Any) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_argcount <= 1 and bool(code.co_flags & inspect.CO_VARARGS)


def model_inputs(root: nn.Module) -> int | None:
    """How many positional inputs the model is called with (``plait_inputs``, which
    `ModelSpec.build` and `capture` set from a sample batch), or None when unknown."""
    n = getattr(root, "plait_inputs", None)
    return len(n) if isinstance(n, tuple) else None


def input_signature(inputs: Any) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """``plait_inputs`` of a model called with `inputs` (a tuple of tensors): their shapes and
    dtypes, which the tracer runs the model on (fake tensors) where the forward needs a size."""
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else ((), torch.float32)
                 for t in inputs)


def _asserts(frame: Any) -> bool:
    """Whether `frame` is converting a value to bool for an ``assert`` (a conditional jump
    past ``LOAD_ASSERTION_ERROR``)."""
    insts = list(dis.get_instructions(frame.f_code))
    at = next((i for i, inst in enumerate(insts) if inst.offset == frame.f_lasti), None)
    return (at is not None and at + 1 < len(insts) and "IF_TRUE" in insts[at].opname
            and insts[at + 1].opname == "LOAD_ASSERTION_ERROR")


def _calls(root: nn.Module, leaves: Iterable[str]) -> dict[str, int]:
    """How often the forward calls each module (torch.fx, `leaves` not traced into)."""
    graph = LayerTracer(set(leaves)).trace(root)
    calls: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "call_module":
            calls[str(n.target)] = calls.get(str(n.target), 0) + 1
    return calls


def _why(exc: Exception) -> str:
    line = (str(exc).strip().splitlines() or [""])[0][:160]
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _strays(calls: dict[str, int], layers: Iterable[str]) -> set[str]:
    """Modules under a layer that the forward calls from outside it."""
    layers = list(layers)
    return {t for t in calls if any(t.startswith(q + ".") for q in layers)}


def _refine(root: nn.Module, layers: list[str], g: int) -> tuple[list[str], list[str]]:
    total = _params(root)
    blocked: set[str] = set()
    notes: list[str] = []
    try:
        before = _strays(_calls(root, layers), layers)
    except Exception as exc:  # data-dependent control flow, untraceable ops: keep the coarse cut
        return layers, [f"layers are the model's top-level children: torch.fx cannot trace its "
                        f"forward ({_why(exc)})"]

    def splittable(path: str) -> bool:
        m = root.get_submodule(path)
        if path in blocked or not m._modules:
            return False
        if isinstance(m, _UNCALLED):
            return True
        return _holds_container(m) and _params(m) * g > total

    while True:
        candidates = [p for p in layers if splittable(p)]
        if not candidates:
            return layers, notes
        seen = {id(root)}
        for p in layers:
            if p not in candidates:
                seen.update(id(sub) for sub in root.get_submodule(p).modules())
        split = {p: _children(root, p, seen) for p in candidates}
        accepted, why = _check(root, layers, split, before)
        if accepted is None:  # the trace failed (or is ambiguous): try each candidate alone
            accepted, why = {}, {}
            for p in candidates:
                one, one_why = _check(root, layers, {p: split[p]}, before)
                accepted.update(one or {})
                why.update(one_why)
        if accepted:  # the accepted splits together (rejecting one may strand another's callers)
            together, _ = _check(root, layers, {p: split[p] for p in accepted}, before)
            if together != accepted:
                why.update({p: "its children and its neighbours' cannot all be layers at once"
                            for p in accepted})
                accepted = {}
        for p in candidates:
            if p not in accepted:
                blocked.add(p)
                reason = why.get(p, "its children do not trace as layers")
                if reason:
                    notes.append(f"module {p!r} is one layer: {reason}")
        layers = [q for p in layers for q in (accepted[p] if p in accepted else [p])]
        if accepted:
            before = _strays(_calls(root, layers), layers)


def _drop_uncalled_tied(root: nn.Module, layers: list[str]) -> tuple[list[str], list[str]]:
    """`layers` without those the forward never calls whose parameters all belong to layers it
    calls (a tied copy: T5's `shared` embedding, the same tensor as each stack's
    `embed_tokens`); a pipeline could not place them, and their memory counts where the tensor
    runs. An uncalled layer with parameters of its own stays (it takes memory)."""
    try:
        calls = _calls(root, layers)
    except Exception:
        return layers, []
    called = {id(p) for q in layers if calls.get(q, 0) for p in root.get_submodule(q).parameters()}
    drop = [q for q in layers if not calls.get(q, 0) and _owns_state(root.get_submodule(q))
            and all(id(p) in called for p in root.get_submodule(q).parameters())
            and not any(True for _ in root.get_submodule(q).buffers())]
    return [q for q in layers if q not in drop], [
        f"module {q!r} is no layer: the forward never calls it and its parameters are those of "
        "layers it calls (tied)" for q in drop]


def _owns_state(m: nn.Module) -> bool:
    return any(True for _ in m.parameters()) or any(True for _ in m.buffers())


def _check(root: nn.Module, layers: list[str], split: dict[str, list[str]], before: set[str]
           ) -> tuple[dict[str, list[str]] | None, dict[str, str]]:
    """The splits of `split` that hold, with the reason for each that does not; None when the
    trace fails or, splitting several, a failure cannot be pinned on one. A new layer must run exactly once, and nothing under a layer may be called
    from outside it (beyond what `before` already was); a child without parameters or buffers
    (an activation, dropout, pooling) is glue, not a layer: its ops count in the layer that
    reads its output."""
    kept = {p: [c for c in children if _owns_state(root.get_submodule(c))] for p, children in split.items()}
    new = [q for p in layers for q in kept.get(p, [p])]
    try:
        calls = _calls(root, new)
    except Exception as exc:
        return None, {p: f"torch.fx cannot trace its forward ({_why(exc)})" for p in split}
    strays = _strays(calls, new) - before
    owners: dict[int, list[str]] = {}  # a module held by two layers (reused) ties them together
    for q in new:
        for sub in root.get_submodule(q).modules():
            owners.setdefault(id(sub), []).append(q)
    shared = {q: next(o for o in qs if o != q) for qs in owners.values() if len(qs) > 1 for q in qs}
    if len(split) > 1 and any(not any(t.startswith(c + ".") for cs in kept.values() for c in cs)
                              for t in strays):
        return None, {}  # a module under a layer that stayed whole is called from a split one: try one by one
    ok: dict[str, list[str]] = {}
    why: dict[str, str] = {}
    for p, children in kept.items():
        bad = [c for c in children if calls.get(c, 0) != 1]
        mine = sorted(t for t in strays if any(t.startswith(c + ".") for c in children))
        tied = [c for c in children if c in shared]
        if bad:
            why[p] = f"its child {bad[0]!r} runs {calls.get(bad[0], 0)} times (a layer runs exactly once)"
        elif tied:
            why[p] = f"its child {tied[0]!r} holds a module that {shared[tied[0]]!r} holds too"
        elif mine:
            why[p] = f"{mine[0]!r} is called from outside the layer that holds it"
        elif strays:
            why[p] = f"{sorted(strays)[0]!r} is then called from outside the layer that holds it"
        elif len(children) < 2 and not (children and root.get_submodule(children[0])._modules):
            why[p] = ""  # nothing to gain: one layer (or none) with nothing below it
        else:
            ok[p] = children
    return ok, why


_CACHE: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, LayerCut]] = weakref.WeakKeyDictionary()


def layer_cut(root: nn.Module, root_name: str = "model", granularity: int | None = None) -> LayerCut:
    """The model's layers (see the module doc). A root with no children, or marked itself, is
    one layer named `root_name`."""
    if _marked(root):
        return LayerCut({"": (root_name, str(root.plait_layer))})
    if not root._modules:
        return LayerCut({"": (root_name, "none")})
    g = _granularity(root, granularity)
    key = (root_name, g, model_inputs(root), tuple((n, id(m)) for n, m in root.named_modules()))
    hit = _CACHE.get(root)
    if hit is not None and hit[0] == key:
        return hit[1]
    heads = _coarse(root)
    if is_marked(root):
        cut = LayerCut(heads)
    else:
        layers, notes = _refine(root, list(heads), g)
        layers, dropped = _drop_uncalled_tied(root, layers)
        notes = [*notes, *dropped]
        # a block holding column and row linears (a model's own tensor-parallel plan) is one
        # tensor parallelism cuts
        cut = LayerCut({p: (p, tensor_parallel_style(root.get_submodule(p))) for p in layers}, tuple(notes))
    _CACHE[root] = (key, cut)
    return cut


def pure_chains(root: nn.Module, layers: Iterable[str], runs: list[list[str]]) -> list[bool]:
    """For each run of layers (module paths), whether the forward passes the output of each
    layer of the run to the next one alone, and takes nothing else into it (no skip connection,
    no glue between, no second argument): then two traced copies stand for all. All False
    when torch.fx cannot trace the forward."""
    try:
        graph = LayerTracer(set(layers)).trace(root)
    except Exception:
        return [False] * len(runs)
    nodes: dict[str, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "call_module":
            nodes.setdefault(str(n.target), []).append(n)
    out = []
    for run in runs:
        ok = all(len(nodes.get(p, [])) == 1 for p in run)
        for a, b in zip(run, run[1:]):
            if not ok:
                break
            na, nb = nodes[a][0], nodes[b][0]
            ok = nb.all_input_nodes == [na] and list(na.users) == [nb] and not nb.kwargs and len(nb.args) == 1
        out.append(ok)
    return out
