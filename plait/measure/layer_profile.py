"""Measured per-layer forward and backward times of a model on one device.

Analytic compute models describe GPUs (fused kernels, backward ~ 2 x forward); on
other devices -- a CPU core, an unusual GPU, an emulated slower kind -- per-layer costs
differ from any roofline. Simulators that must match real runs therefore *profile*
each layer on one device and simulate the parallel plan from those times: dPRO
(Hu et al. 2022, §4 "profiler"), Echo and Pipette's profiler do exactly this. This
module is that profiler for plait:

    times = profile_layer_times("gpt:layers=4,hidden=128", micro_batch=4, dtype="fp32")
    simulate(model, cluster, plan, layer_times=times)       # SimOptions.layer_times

How one layer is timed (`profile_layers`):

1. the whole model runs one forward on a real micro-batch; a forward pre-hook on every
   layer module (the OpGraph's layers, `plait.graph.capture.layer_assignment`) keeps the
   layer's inputs, so each layer later sees inputs of its real shapes and values;
2. optionally each layer is transformed the way the plan's rank runs it (`shard`, e.g.
   the runtime's Megatron tensor-parallel slicing with collectives replaced by no-ops:
   the profile is then the compute of one tensor rank; the simulator adds the
   collectives from the links);
3. each layer runs forward and backward in isolation, `repeats` times after `warmup`,
   layers interleaved round-robin so slow phases of a shared machine hit every layer
   alike; the figure is the median. The backward accumulates into the parameters'
   gradients as gradient accumulation over micro-batches does (`accumulate`). Inputs that carried gradients in the model carry
   them here (so the backward computes the input gradient, as inside the model); the
   backward starts from a fixed random output gradient. The layer that produces the
   model output also runs the training loss (`ModelSpec.loss`) in its forward and the
   loss gradient in its backward, as a training step does;
4. the optimizer step (`torch.optim.AdamW`, per-tensor like the runtime's) is timed per
   layer on that layer's parameters (a parameter shared by several layers -- tied
   embeddings -- is counted at its first layer), and once over all parameters together
   (`optimizer_total_s`, the working set of a real step).

The device runs with `threads` intra-op threads (default: 1, what a rank of
`plait run` gets when ranks share the machine's cores) and the compute dtype of the
runtime: fp32 weights, autocast for bf16 / fp16.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.errors import PlaitError

if TYPE_CHECKING:
    from plait.cluster.spec import Cluster
    from plait.graph.zoo.registry import ModelSpec

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPES = ("fp32", "tf32", "bf16", "fp16")


class LayerProfileError(PlaitError, ValueError):
    """Bad arguments to the layer profiler, or a model whose layers cannot be timed alone."""


@dataclass
class LayerProfile:
    """Result of `profile_layers`: per-layer medians (seconds) and their spread.

    `times[name] = (forward_s, backward_s)` for one micro-batch is the format of
    `plait.sim.lowering.SimOptions.layer_times`. `spread[name]` is the interquartile range
    of (forward, backward) over the repetitions; `optimizer[name]` the optimizer step
    over the layer's own parameters and `params[name]` their count."""

    model: str
    micro_batch: int
    dtype: str
    tp: int
    threads: int
    repeats: int
    statistic: str = "median"
    optimizer_total_s: float = 0.0  # one optimizer step over every parameter of the model at once
    times: dict[str, tuple[float, float]] = field(default_factory=dict)
    spread: dict[str, tuple[float, float]] = field(default_factory=dict)
    optimizer: dict[str, float] = field(default_factory=dict)
    params: dict[str, int] = field(default_factory=dict)
    loss_layer: str = ""

    @property
    def forward_s(self) -> float:
        return sum(f for f, _ in self.times.values())

    @property
    def backward_s(self) -> float:
        return sum(b for _, b in self.times.values())

    @property
    def optimizer_s(self) -> float:
        return sum(self.optimizer.values())

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "micro_batch": self.micro_batch, "dtype": self.dtype, "tp": self.tp,
                "threads": self.threads, "repeats": self.repeats, "statistic": self.statistic,
                "loss_layer": self.loss_layer, "optimizer_total_s": self.optimizer_total_s,
                "layers": {n: {"forward_s": f, "backward_s": b, "forward_iqr_s": self.spread[n][0],
                               "backward_iqr_s": self.spread[n][1], "optimizer_s": self.optimizer.get(n, 0.0),
                               "params": self.params.get(n, 0)} for n, (f, b) in self.times.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerProfile:
        """Inverse of `to_dict` (profiles travel between processes as JSON)."""
        try:
            layers = data["layers"]
            return cls(model=data["model"], micro_batch=int(data["micro_batch"]), dtype=data["dtype"],
                       tp=int(data["tp"]), threads=int(data["threads"]), repeats=int(data["repeats"]),
                       statistic=data.get("statistic", "median"), loss_layer=data.get("loss_layer", ""),
                       optimizer_total_s=float(data.get("optimizer_total_s", 0.0)),
                       times={n: (v["forward_s"], v["backward_s"]) for n, v in layers.items()},
                       spread={n: (v["forward_iqr_s"], v["backward_iqr_s"]) for n, v in layers.items()},
                       optimizer={n: v["optimizer_s"] for n, v in layers.items()},
                       params={n: int(v["params"]) for n, v in layers.items()})
        except (KeyError, TypeError, ValueError) as exc:
            raise LayerProfileError(f"layer profile: missing or bad field ({exc})") from None


def _load_spec(model_spec: str | ModelSpec) -> Any:
    if all(callable(getattr(model_spec, a, None)) for a in ("build", "sample_batch", "loss")):
        return model_spec
    if isinstance(model_spec, str):
        from plait.graph.zoo import load_model

        return load_model(model_spec)
    raise LayerProfileError(f"model_spec: expected a zoo spec string or a ModelSpec, got {type(model_spec).__name__}")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _fresh(value: Any) -> Any:
    """A detached copy of a captured input; floating tensors keep their requires_grad flag."""
    if isinstance(value, torch.Tensor):
        t = value.detach().clone()
        if value.requires_grad and t.is_floating_point():
            t.requires_grad_(True)
        return t
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    from plait.graph.capture import is_kv_cache

    if is_kv_cache(value):
        # A key/value cache carries state from one call into the next (T5's decoder passes one
        # to every block even with use_cache off): repeated runs of one layer would attend over
        # the earlier runs' keys. Within the one forward a block's cache entry is empty when the
        # block starts, so a block run without a cache computes what it computes in the model.
        return None
    return value


def _iqr(xs: list[float]) -> float:
    if len(xs) < 4:
        return max(xs) - min(xs) if xs else 0.0
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


@dataclass
class _Bench:
    """How one profile times things: device, synchronisation, autocast, repetitions."""

    dev: torch.device
    dtype: str
    warmup: int
    repeats: int
    center: Callable[[list[float]], float]

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def autocast(self) -> Any:
        return torch.autocast(self.dev.type, dtype=_AUTOCAST[self.dtype]) if self.dtype in _AUTOCAST else nullcontext()


def _check_profile_args(micro_batch: int, dtype: str, repeats: int, warmup: int, threads: int | None,
                        tp: int, statistic: str) -> None:
    if micro_batch < 1:
        raise LayerProfileError(f"micro_batch: must be >= 1, got {micro_batch}")
    if dtype not in _DTYPES:
        raise LayerProfileError(f"dtype: must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if repeats < 1 or warmup < 0:
        raise LayerProfileError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    if threads is not None and threads < 1:
        raise LayerProfileError(f"threads: must be >= 1, got {threads}")
    if tp < 1:
        raise LayerProfileError(f"tp: must be >= 1, got {tp}")
    if statistic not in ("median", "mean"):
        raise LayerProfileError(f"statistic: must be 'median' or 'mean', got {statistic!r}")


def profile_layers(model_spec: str | ModelSpec, micro_batch: int, dtype: str = "fp32", *, tp: int = 1,
                   shard: Callable[[str, nn.Module], Any] | None = None, threads: int | None = 1,
                   repeats: int = 9, warmup: int = 2, device: str = "cpu", seed: int = 0,
                   optimizer: bool = True, lr: float = 1e-3, statistic: str = "median",
                   accumulate: bool = True) -> LayerProfile:
    """Time every layer of `model_spec` alone for one micro-batch (see module docstring).

    `shard(layer_name, module)` transforms a layer in place before it is timed (tensor
    parallelism: it is called for every layer and decides itself which to slice); `tp` is
    only recorded. `threads=None` keeps torch's current intra-op thread count.
    `statistic`: "median" of the repetitions (robust to interruptions), or "mean" (the
    expected time: what a run that sums many such spans sees on a device whose speed varies
    -- a shared machine, or a CPU share enforced by CFS bandwidth control). `accumulate`: the backward adds into the
    parameters' existing gradients, as every micro-batch after the first of a step does (one
    read-modify-write of every gradient: measurable on a CPU); False resets them before each
    repetition, as for a step's first micro-batch."""
    _check_profile_args(micro_batch, dtype, repeats, warmup, threads, tp, statistic)
    from plait.graph.capture import layer_assignment

    spec = _load_spec(model_spec)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    bench = _Bench(dev, dtype, warmup, repeats, statistics.median if statistic == "median" else statistics.fmean)
    old_threads = torch.get_num_threads()
    old_tf32 = torch.backends.cuda.matmul.allow_tf32 if cuda else None
    if threads is not None:
        torch.set_num_threads(threads)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        with torch.random.fork_rng(devices=[dev] if cuda else []):
            torch.manual_seed(seed)
            model = spec.build(device=dev, dtype=torch.float32, seed=seed)
            # A key/value cache (transformers builds one in train mode when the config's
            # `use_cache` is on) would carry each layer's keys from one repetition into the next:
            # the second backward then reaches the first run's freed graph. The profile runs on
            # real values, so without a cache transformers still takes the same unmasked SDPA path.
            cfg = getattr(model, "config", None)
            if getattr(cfg, "use_cache", False) is True:
                cfg.use_cache = False
            model.train()
            heads = layer_assignment(model)
            layers = [(name, model.get_submodule(path) if path else model) for path, (name, _) in heads.items()]
            inputs, target = spec.sample_batch(micro_batch, device=dev, seed=seed)
            # 1. one forward of the whole model: every layer's real inputs, and who makes the output.
            captured, order, loss_layer = _capture_layer_inputs(spec, model, layers, inputs, bench)
            if shard is not None:
                for name, mod in layers:
                    shard(name, mod)
            modules = dict(layers)
            grads = _output_grads(modules, captured, order, loss_layer, bench, seed)
            prof = LayerProfile(model=getattr(spec, "spec", "") or spec.name, micro_batch=micro_batch, dtype=dtype,
                                tp=tp, threads=torch.get_num_threads(), repeats=repeats, statistic=statistic,
                                loss_layer=loss_layer)
            # 2. every layer, round-robin: warm-up rounds, then measured rounds.
            _time_layers(prof, spec, modules, captured, grads, order, target, bench, accumulate)
            # 3. the optimizer step over each layer's own parameters (gradients from the runs above).
            _time_optimizer(prof, modules, order, bench, lr, optimizer)
            return prof
    finally:
        torch.set_num_threads(old_threads)
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = old_tf32


def _capture_layer_inputs(spec: Any, model: nn.Module, layers: list[tuple[str, nn.Module]], inputs: Any,
                          bench: _Bench) -> tuple[dict[str, tuple[Any, Any]], list[str], str]:
    """One forward of the whole model with hooks: each layer's first (args, kwargs), the layers
    in execution order of their first calls, and the layer whose output is the model's (the
    one the loss is computed on)."""
    captured: dict[str, tuple[Any, Any]] = {}
    out_owner: dict[int, str] = {}
    handles = []
    for name, mod in layers:
        def pre(m: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
            captured.setdefault(name, (_fresh(args), _fresh(kwargs)))

        def post(m: nn.Module, args: Any, kwargs: Any, out: Any, name: str = name) -> None:
            for t in _tensors(out):
                out_owner[id(t)] = name

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
    with bench.autocast():
        output = model(*inputs)
    for h in handles:
        h.remove()
    owners = [out_owner[id(t)] for t in _tensors(output) if id(t) in out_owner]
    missing = [name for name, _ in layers if name not in captured]
    if missing:
        raise LayerProfileError(f"model {spec.name}: layers {missing} did not run in the forward; "
                                "they cannot be timed")
    order = sorted(captured, key=list(captured).index)
    return captured, order, owners[0] if owners else order[-1]


def _output_grads(modules: dict[str, nn.Module], captured: dict[str, tuple[Any, Any]], order: list[str],
                  loss_layer: str, bench: _Bench, seed: int) -> dict[str, list[torch.Tensor]]:
    """A fixed random output gradient per layer (its shapes from one forward of the layer)."""
    grads: dict[str, list[torch.Tensor]] = {}
    gen = torch.Generator(device=bench.dev).manual_seed(seed + 1)
    for name in order:
        if name == loss_layer:
            continue
        args, kwargs = captured[name]
        with bench.autocast():
            out = modules[name](*_fresh(args), **_fresh(kwargs))
        outs = [t for t in _tensors(out) if t.requires_grad]
        grads[name] = [torch.randn(t.shape, generator=gen, device=bench.dev, dtype=t.dtype) for t in outs]
    return grads


def _time_layers(prof: LayerProfile, spec: Any, modules: dict[str, nn.Module],
                 captured: dict[str, tuple[Any, Any]], grads: dict[str, list[torch.Tensor]],
                 order: list[str], target: Any, bench: _Bench, accumulate: bool) -> None:
    """Forward and backward seconds of every layer alone, round-robin over the layers so a
    slow spell of the machine spreads over all of them; the center and IQR into `prof`."""

    def run_once(name: str) -> tuple[float, float]:
        mod = modules[name]
        args, kwargs = captured[name]
        args, kwargs = _fresh(args), _fresh(kwargs)
        if not accumulate:
            for p in mod.parameters():
                p.grad = None
        bench.sync()
        t0 = time.perf_counter()
        with bench.autocast():
            out = mod(*args, **kwargs)
            loss = spec.loss(out, target) if name == prof.loss_layer else None
        bench.sync()
        t1 = time.perf_counter()
        if loss is not None:
            loss.backward()
        else:
            outs = [t for t in _tensors(out) if t.requires_grad]
            if outs:
                torch.autograd.backward(outs, grads[name])
        bench.sync()
        return t1 - t0, time.perf_counter() - t1

    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in order}
    for r in range(bench.warmup + bench.repeats):
        for name in order:
            fb = run_once(name)
            if r >= bench.warmup:
                samples[name].append(fb)
    for name in order:
        fs = [f for f, _ in samples[name]]
        bs = [b for _, b in samples[name]]
        prof.times[name] = (bench.center(fs), bench.center(bs))
        prof.spread[name] = (_iqr(fs), _iqr(bs))


def _time_optimizer(prof: LayerProfile, modules: dict[str, nn.Module], order: list[str], bench: _Bench,
                    lr: float, optimizer: bool) -> None:
    """AdamW step seconds over each layer's own parameters, and over all of them at once as a
    training step runs it (a working set of every parameter, gradient and optimizer state:
    larger than the caches a single layer fits)."""

    def time_adamw(params: list[torch.Tensor]) -> list[float]:
        """Seconds of each timed AdamW step (per-tensor, as the runtime's) over `params`."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt = torch.optim.AdamW(params, lr=lr, foreach=False)
        ts = []
        for r in range(bench.warmup + bench.repeats):
            bench.sync()
            t0 = time.perf_counter()
            opt.step()
            bench.sync()
            if r >= bench.warmup:
                ts.append(time.perf_counter() - t0)
        return ts

    seen: set[int] = set()
    for name in order:
        own = [p for p in modules[name].parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        prof.params[name] = sum(p.numel() for p in own)
        prof.optimizer[name] = bench.center(time_adamw(own)) if optimizer and own else 0.0
    every = [p for name in order for p in modules[name].parameters() if p.requires_grad]
    every = list({id(p): p for p in every}.values())
    if optimizer and every:
        prof.optimizer_total_s = bench.center(time_adamw(every))


def profile_layer_times(model_spec: str | ModelSpec, micro_batch: int, dtype: str = "fp32", **kwargs: Any
                        ) -> dict[str, tuple[float, float]]:
    """{layer name: (forward s, backward s)} for one micro-batch on this device: the format of
    `SimOptions.layer_times`. Keyword arguments go to `profile_layers`."""
    return profile_layers(model_spec, micro_batch, dtype, **kwargs).times


def profile_model(model_spec: str | ModelSpec, cluster: Cluster, micro_batches: list[int], dtype: str = "fp32", *,
                  repeats: int = 5, warmup: int = 1, threads: int | None = 1,
                  on_size: Callable[[int, float], None] | None = None) -> tuple[Any, float]:
    """A `plait.ir.profile.ModelProfile` of `model_spec` on every GPU kind of `cluster` (issue 28),
    and the CPU seconds the sweep took: each layer's forward and backward at each micro-batch of
    the sweep, through `profile_layers` (the layers, loss, autocast dtype and single intra-op
    thread a `plait run` rank trains with), plus the optimizer step.

    This machine is the emulated cluster: every kind's rank is a CPU process of it, slowed by its
    kind's emulation factor (`plait.runtime.emulate.compute_slowdown`), so the sweep runs once and
    each kind's times are the measured ones times that factor -- what its rank of `plait run`
    takes. `on_size(micro_batch, cpu_s)` reports progress."""
    import datetime

    from plait.ir.profile import KindProfile, LayerCurve, ModelProfile, model_signature
    from plait.planners.types import load_graph
    from plait.runtime.emulate import compute_slowdown

    sizes = sorted(set(micro_batches))
    if not sizes or sizes[0] < 1:
        raise LayerProfileError(f"--micro-batches: expected positive sizes, got {micro_batches!r}")
    _, graph = load_graph(model_spec, dtype)
    names = [layer.name for layer in graph.layers]
    cpu0 = time.process_time()
    runs = []
    for mb in sizes:
        t0 = time.process_time()
        runs.append(profile_layers(model_spec, mb, dtype, repeats=repeats, warmup=warmup, threads=threads))
        if on_size is not None:
            on_size(mb, time.process_time() - t0)
    cpu_s = time.process_time() - cpu0
    missing = [n for n in names if n not in runs[0].times]
    if missing:
        raise LayerProfileError(f"model {model_spec}: layers {missing} of the planned graph were not timed")
    first = {}
    for d in cluster.devices:
        first.setdefault(d.kind.name, d.id)
    meta = {"torch": str(torch.__version__), "cuda": "none (cpu)", "date": datetime.date.today().isoformat(),
            "source": "measured", "device": "cpu, emulated"}
    kinds = {}
    for kind, dev in first.items():
        emu = getattr(cluster, "emulation", None)  # as `plait run` slows its ranks: only when emulated
        f = compute_slowdown(cluster, dev, dtype) if emu is not None and emu.enabled else 1.0
        layers = {n: {1: LayerCurve(tuple(sizes), tuple(r.times[n][0] * f for r in runs),
                                    tuple(r.times[n][1] * f for r in runs))} for n in names}
        step = runs[0].optimizer_total_s * f
        kinds[kind] = KindProfile(layers, step if step > 0 else None, {**meta, "slowdown": str(f)})
    return ModelProfile(model_signature(graph), tuple(names), dtype, "plait", kinds,
                        f"plait profile --model {model_spec}"), cpu_s
