"""ModelSpec, the zoo registry and the model-spec parser.

A model spec string is one of

* ``name`` or ``name:key=value,...`` -- a zoo model with overrides, e.g.
  ``gpt:layers=24,hidden=1024,heads=16,seq=1024,vocab=50257`` or ``gpt:size=175b``.
  ``size`` (when the model has named sizes) is applied first, then the other keys,
  whatever their order. Values are parsed to the type of the key (int, float,
  bool, str); ints accept ``1_000_000`` and ``1e6``.
* ``path/to/file.py:factory`` -- a user model. ``factory()`` (called with no
  arguments) returns either a :class:`ModelSpec`, or a tuple
  ``(module, sample_batch)`` / ``(module, sample_batch, loss)`` where

  - ``module`` is an ``nn.Module`` (each ``build`` deep-copies it and moves the
    copy) or a zero-argument callable returning a fresh ``nn.Module`` (called
    under the target device, so ``meta`` allocates nothing);
  - ``sample_batch(batch, device="cpu", seed=0)`` returns ``(inputs: tuple, target)``;
  - ``loss(output, target)`` returns a scalar; without it, cross-entropy over the
    last output dimension for integer targets, mean squared error otherwise.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from plait.errors import PlaitError


class ModelSpecError(PlaitError, ValueError):
    """A model spec that cannot be parsed or built; the message names the spec, the key and why."""


Batch = tuple[tuple[Tensor, ...], Tensor]


@dataclass
class ModelSpec:
    """A model the rest of plait can build, feed, and score.

    ``construct()`` makes the module on the current default device (``build`` wraps it
    in ``torch.device(...)``); ``make_batch(batch, generator, dtype)`` makes a CPU batch
    from a seeded generator; ``init(module)`` re-initialises weights (skipped on meta).
    """

    name: str
    config: dict[str, Any]
    construct: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator, torch.dtype], Batch]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    init: Callable[[nn.Module], None] | None = None
    param_formula: Callable[[], int] | None = None
    spec: str = ""  # a string load_model() turns back into this model (workers rebuild from it)
    description: str = field(default="", repr=False)

    def build(
        self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> nn.Module:
        """A fresh module in train mode. Deterministic for a given ``seed`` on every real device
        (weights are drawn on CPU under a forked RNG, then moved); on ``meta`` nothing is allocated."""
        device = torch.device(device)
        if device.type == "meta":
            with torch.device("meta"), _SkipInitOnMeta():
                module = self.construct()
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                with torch.device("cpu"):
                    module = self.construct()
                if self.init is not None:
                    self.init(module)
        module = module.to(device=device, dtype=dtype).train()
        # A Hugging Face config's tensor-parallel plan becomes plait's markers, read alike by the
        # capture, the cost model and the runtime (`plait.graph.tp_plan`).
        from plait.graph.tp_plan import mark_tp_plan

        mark_tp_plan(module)
        if getattr(module, "plait_inputs", None) is None:
            # How many inputs the forward is called with: torch.fx traces it with those as
            # placeholders and the rest at their defaults (`plait.graph.layer_cut.LayerTracer`).
            from plait.graph.layer_cut import input_signature

            inputs = self.make_batch(2, torch.Generator().manual_seed(0), dtype)[0]
            module.plait_inputs = input_signature(inputs)
        return module

    def sample_batch(
        self,
        batch: int,
        device: str | torch.device = "cpu",
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> Batch:
        """Deterministic synthetic ``(inputs, target)``, batch-first; float inputs in ``dtype``.

        The same ``seed`` gives the same values on every device (drawn on CPU, then moved);
        on ``meta`` only the shapes are real.
        """
        if batch < 1:
            raise ModelSpecError(f"model {self.name}: batch must be >= 1, got {batch}")
        gen = torch.Generator().manual_seed(seed)
        inputs, target = self.make_batch(batch, gen, dtype)
        return tuple(t.to(device) for t in inputs), target.to(device)

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Scalar training loss, mean over the batch."""
        return self.loss_fn(output, target)

    def param_count_formula(self) -> int:
        """Closed-form parameter count (tied weights counted once); counted on meta for user models."""
        if self.param_formula is not None:
            return self.param_formula()
        return count_params(self.build("meta"))

    @classmethod
    def from_module(
        cls,
        module: nn.Module | Callable[[], nn.Module],
        sample_batch: Callable[..., Batch],
        loss: Callable[[Tensor, Tensor], Tensor] | None = None,
        *,
        name: str = "model",
        config: dict[str, Any] | None = None,
        spec: str = "",
    ) -> ModelSpec:
        """Wrap a user module (or module factory) and a ``sample_batch`` function."""
        if isinstance(module, nn.Module):
            template = module

            def construct() -> nn.Module:
                device = torch.get_default_device()
                return copy.deepcopy(template).to(device)

        elif callable(module):
            construct = module  # type: ignore[assignment]
        else:
            raise ModelSpecError(f"model {name}: expected an nn.Module or a callable, got {type(module).__name__}")
        accepted = _accepted_kwargs(sample_batch)

        def make_batch(batch: int, gen: torch.Generator, dtype: torch.dtype) -> Batch:
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
            kwargs = {k: v for k, v in (("device", "cpu"), ("seed", seed)) if k in accepted}
            out = sample_batch(batch, **kwargs)
            if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Tensor)):
                raise ModelSpecError(
                    f"model {name}: sample_batch({batch}) returned {type(out).__name__}; it must return "
                    "(inputs: tuple, target: Tensor)"
                )
            inputs = out[0] if isinstance(out[0], tuple) else (out[0],)
            return tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs), out[1]

        return cls(
            name=name,
            config=dict(config or {}),
            construct=construct,
            make_batch=make_batch,
            loss_fn=loss or default_loss,
            spec=spec,
        )


class _SkipInitOnMeta(TorchFunctionMode):
    """Skip in-place random/fill initialisers while constructing on meta (they would be no-ops).

    Why: the first ``normal_`` on a meta tensor imports torch's Python decompositions,
    which costs seconds; a 175B GPT then builds in a fraction of a second.
    """

    _SKIP = frozenset(
        {
            torch.Tensor.normal_,
            torch.Tensor.uniform_,
            torch.Tensor.fill_,
            torch.Tensor.zero_,
            torch.Tensor.erfinv_,
            torch.Tensor.bernoulli_,
            torch.Tensor.random_,
            nn.init.normal_,
            nn.init.uniform_,
            nn.init.trunc_normal_,
            nn.init.kaiming_uniform_,
            nn.init.kaiming_normal_,
            nn.init.xavier_uniform_,
            nn.init.xavier_normal_,
            nn.init.constant_,
            nn.init.ones_,
            nn.init.zeros_,
        }
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in self._SKIP:
            target = args[0] if args else kwargs.get("tensor")  # nn.init passes it by keyword
            if isinstance(target, Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def model_output(output: Any) -> Tensor:
    """The tensor the default loss reads from a model's output: the output itself when it is a
    tensor; from a Hugging Face ``ModelOutput`` (or any mapping/object with these fields) the
    ``loss`` the model computed from labels passed in its inputs, else its ``logits``; else
    refused, saying what to return."""
    if isinstance(output, Tensor):
        return output
    for key in ("loss", "logits"):
        value = output.get(key) if isinstance(output, dict) else getattr(output, key, None)
        if isinstance(value, Tensor):
            return value
    raise ModelSpecError(
        f"the model returned {type(output).__name__}, which the default loss cannot take: return a "
        "Tensor (the logits or the prediction), or an object with .logits (a Hugging Face ModelOutput) "
        "or .loss, or give the factory a third item loss(output, target)")


def default_loss(output: Any, target: Tensor) -> Tensor:
    output = model_output(output)
    if output.dim() == 0:  # a loss the model computed itself (labels among its inputs)
        return output
    if not target.is_floating_point():
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.mse_loss(output.reshape(target.shape), target)


def count_params(module: nn.Module) -> int:
    """Parameters counted once each (``parameters()`` skips tied duplicates)."""
    return sum(p.numel() for p in module.parameters())


def tied_parameters(module: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (e.g. GPT's embedding and LM head).

    A pipeline runtime that puts the members of a group on different stages must
    all-reduce their gradients, as Megatron-LM does for the word embeddings.
    """
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


class _LayerTracer(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return hasattr(m, "plait_layer") or super().is_leaf_module(m, module_qualified_name)


def layer_graph(module: nn.Module) -> torch.fx.GraphModule:
    """The model's data flow between its OpGraph layers, as a torch.fx graph.

    Modules marked ``plait_layer`` are kept as leaves (``call_module`` nodes), so the
    graph says which layer's output feeds which argument of which layer -- what a
    graph-pipeline executor needs to wire stages. Every zoo model traces this way;
    their top-level ``forward`` holds no computation outside layers besides indexing.
    """
    tracer = _LayerTracer()
    graph = tracer.trace(module)
    return torch.fx.GraphModule(tracer.root, graph, type(module).__name__)


def _accepted_kwargs(fn: Callable[..., Any]) -> set[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return {"device", "seed"}
    return {p.name for p in params}


# ----------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Param:
    """One override key: its type, default (``None`` = derived from other keys) and a help line."""

    type: type
    default: Any
    help: str = ""


@dataclass
class ModelEntry:
    name: str
    description: str
    params: dict[str, Param]
    make: Callable[[dict[str, Any]], ModelSpec]
    sizes: dict[str, dict[str, Any]] = field(default_factory=dict)
    default_size: str | None = None

    def defaults(self) -> dict[str, Any]:
        return {k: p.default for k, p in self.params.items()}


_REGISTRY: dict[str, ModelEntry] = {}


def register(entry: ModelEntry) -> ModelEntry:
    _REGISTRY[entry.name] = entry
    return entry


def list_models() -> list[str]:
    """Names of the zoo models, sorted."""
    return sorted(_REGISTRY)


def model_entry(name: str) -> ModelEntry:
    if name not in _REGISTRY:
        raise ModelSpecError(
            f"model spec {name!r}: unknown model {name!r}; zoo models: {', '.join(list_models())}"
            " (or give path/to/file.py:factory)"
        )
    return _REGISTRY[name]


_FILE_SPEC = re.compile(r"^(?P<path>.+\.py):(?P<factory>[A-Za-z_][A-Za-z0-9_]*)$")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]*$")


def parse_spec(text: str) -> tuple[str, dict[str, str]]:
    """``"gpt:layers=2,hidden=64"`` -> ``("gpt", {"layers": "2", "hidden": "64"})`` (values unparsed)."""
    text = text.strip()
    name, _, rest = text.partition(":")
    name = name.strip()
    if not _NAME.match(name):
        raise ModelSpecError(f"model spec {text!r}: {name!r} is not a model name")
    overrides: dict[str, str] = {}
    if rest.strip():
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or not key or not value:
                raise ModelSpecError(
                    f"model spec {text!r}: {item.strip()!r} is not key=value (write {name}:key=value,...)"
                )
            if key in overrides:
                raise ModelSpecError(f"model spec {text!r}: key {key!r} given twice")
            overrides[key] = value
    return name, overrides


def _coerce(text: str, key: str, param: Param, value: Any) -> Any:
    """Parse a string (or check a Python value) to the key's type."""
    want = param.type
    if not isinstance(value, str):
        if want is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if want is int and isinstance(value, bool):
            raise ModelSpecError(f"model spec {text!r}: {key} must be an integer, got {value!r}")
        if isinstance(value, want) or (want is str and isinstance(value, list | tuple)):
            return value
        raise ModelSpecError(f"model spec {text!r}: {key} must be {want.__name__}, got {value!r}")
    raw = value.strip()
    try:
        if want is bool:
            low = raw.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if want is int:
            try:
                return int(raw.replace("_", ""))
            except ValueError:
                f = float(raw)
                if not f.is_integer():
                    raise ValueError from None
                return int(f)
        if want is float:
            f = float(raw)
            if not math.isfinite(f):
                raise ValueError
            return f
        return raw
    except ValueError:
        raise ModelSpecError(
            f"model spec {text!r}: {key}={raw!r} is not a valid {want.__name__}"
        ) from None


def load_model(spec: str | ModelSpec, **overrides: Any) -> ModelSpec:
    """A :class:`ModelSpec` from a zoo spec string, ``path/to/file.py:factory``, or a ModelSpec.

    Keyword ``overrides`` are applied after those in the string (zoo models only).
    """
    if isinstance(spec, ModelSpec):
        if overrides:
            raise ModelSpecError(f"model {spec.name}: overrides need a zoo spec string, not a ModelSpec")
        return spec
    if not isinstance(spec, str):
        raise ModelSpecError(f"model spec must be a string or ModelSpec, got {type(spec).__name__}")
    match = _FILE_SPEC.match(spec.strip())
    if match:
        if overrides:
            raise ModelSpecError(f"model spec {spec!r}: overrides apply to zoo models only")
        return _load_file(match["path"], match["factory"], spec)
    if spec.strip().endswith(".py"):
        raise ModelSpecError(f"model spec {spec!r}: name the factory, as in {spec.strip()}:make_model")
    name, raw = parse_spec(spec)
    entry = model_entry(name)
    given: dict[str, Any] = {**raw, **overrides}
    valid = ["size"] * bool(entry.sizes) + list(entry.params)
    for key in given:
        if key not in valid:
            raise ModelSpecError(
                f"model spec {spec!r}: unknown key {key!r} for {name}; valid keys: {', '.join(valid)}"
            )
    cfg = entry.defaults()
    size = given.pop("size", None)
    if size is not None:
        size = str(size).lower()
        if size not in entry.sizes:
            raise ModelSpecError(
                f"model spec {spec!r}: unknown size {size!r} for {name}; sizes: {', '.join(entry.sizes)}"
            )
        cfg.update(entry.sizes[size])
    for key, value in given.items():
        cfg[key] = _coerce(spec, key, entry.params[key], value)
    canonical = _canonical(entry, cfg)
    try:
        model = entry.make(cfg)
    except ModelSpecError as exc:
        raise ModelSpecError(f"model spec {spec!r}: {exc}") from None
    model.spec = canonical
    return model


def _canonical(entry: ModelEntry, cfg: dict[str, Any]) -> str:
    """The shortest spec string that rebuilds ``cfg``: every key that differs from the defaults."""

    def fmt(v: Any) -> str:
        if isinstance(v, list | tuple):
            return "-".join(str(x) for x in v)
        return str(v).lower() if isinstance(v, bool) else str(v)

    base = entry.defaults()
    items = [f"{k}={fmt(v)}" for k, v in cfg.items() if v is not None and v != base.get(k)]
    return entry.name + (":" + ",".join(items) if items else "")


def _load_file(path_text: str, factory_name: str, spec: str) -> ModelSpec:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ModelSpecError(f"model spec {spec!r}: file {path_text} does not exist")
    path = path.resolve()
    module_name = f"plait_user_model_{abs(hash(str(path)))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    assert loader_spec is not None and loader_spec.loader is not None
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:  # the user's file: report it as one line naming the file
        sys.modules.pop(module_name, None)
        raise ModelSpecError(f"{path}: importing failed: {type(exc).__name__}: {exc}") from exc
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ModelSpecError(
            f"{path}: no callable {factory_name!r}; callables defined there: {', '.join(found) or 'none'}"
        )
    try:
        result = factory()
    except PlaitError:
        raise
    except Exception as exc:
        raise ModelSpecError(f"{path}: {factory_name}() failed: {type(exc).__name__}: {exc}") from exc
    canonical = f"{path}:{factory_name}"
    if isinstance(result, ModelSpec):
        result.spec = canonical
        return result
    if isinstance(result, tuple) and len(result) in (2, 3):
        where = f"{path}: {factory_name}()"
        if not (isinstance(result[0], nn.Module) or callable(result[0])):
            raise ModelSpecError(f"{where}: the first item must be an nn.Module (or a function returning one), "
                                 f"got {type(result[0]).__name__}; {USER_CONTRACT}")
        if not callable(result[1]):
            raise ModelSpecError(f"{where}: the second item must be a function, not a sample batch "
                                 f"(got {type(result[1]).__name__}); {USER_CONTRACT}")
        if len(result) == 3 and not callable(result[2]):
            raise ModelSpecError(f"{where}: the third item must be a loss function loss(output, target), "
                                 f"got {type(result[2]).__name__}")
        loss = result[2] if len(result) == 3 else None
        return ModelSpec.from_module(result[0], result[1], loss, name=factory_name, spec=canonical)
    raise ModelSpecError(f"{path}: {factory_name}() returned {type(result).__name__}; {USER_CONTRACT}")


# The user-model contract, stated the same way in the README and in every error about it.
USER_CONTRACT = ("expected a ModelSpec or a tuple (module, sample_batch[, loss]) where sample_batch is a "
                 "function sample_batch(batch, device='cpu', seed=0) -> (inputs: tuple, target: Tensor)")
