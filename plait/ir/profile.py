"""Per-GPU-kind model profiles: layer times measured on the user's hardware (issue 28).

One file format, read and written here, that every cost caller reads through `ModelProfile`:

    format_version: 1
    model: {signature: "<model layer signature>", layers: [name, ...]}
    dtype: fp16
    engine: plait            # the training path measured (plait, deepspeed, megatron, ...)
    kinds:
      a100-80gb:
        torch: "2.13.0"      # versions and date of the machine that measured this kind
        cuda: "12.4"
        date: "2026-12-05"
        source: measured     # or imported:amp / imported:sailor
        optimizer_step: 0.012            # seconds per step of the whole model on this kind
        layers:                          # per layer, per tensor-parallel degree
          block0: {tp1: {micro_batch: [1, 2, 4], forward: [...], backward: [...], memory: [...]}}

A cluster YAML names it (``model_profiles: [file, ...]``, see docs/DESIGN.md "Model profiles"):
the profile belongs to a model and a dtype, the cluster file to the hardware, so one cluster can
carry profiles of several models. Profiles measured on two machines merge kind by kind
(`merge_profiles`). A lookup interpolates linearly between measured micro-batch sizes and returns
None outside them (never extrapolated silently): the caller then uses the analytic model, and
`coverage` says which kinds were measured and which modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from plait.errors import PlaitError
from plait.ir.formats import check_version, stamp


class ProfileError(PlaitError, ValueError):
    """A model profile that cannot be used; the message names the file, the entry and the reason."""


@dataclass(frozen=True)
class LayerCurve:
    """One layer's measured times on one GPU kind at one tensor-parallel degree."""

    micro_batch: tuple[int, ...]      # measured micro-batch sizes, increasing
    forward: tuple[float, ...]        # seconds per micro-batch, one per size
    backward: tuple[float, ...]       # seconds per micro-batch, one per size
    memory: tuple[float, ...] = ()    # bytes the allocator held, one per size (may be empty)

    def at(self, micro_batch: float) -> tuple[float, float] | None:
        """(forward, backward) at `micro_batch`, interpolated between measured sizes; None outside."""
        xs = self.micro_batch
        if micro_batch < xs[0] or micro_batch > xs[-1]:
            return None
        for i in range(len(xs)):
            if xs[i] == micro_batch:
                return self.forward[i], self.backward[i]
            if xs[i] > micro_batch:
                w = (micro_batch - xs[i - 1]) / (xs[i] - xs[i - 1])
                return (self.forward[i - 1] + w * (self.forward[i] - self.forward[i - 1]),
                        self.backward[i - 1] + w * (self.backward[i] - self.backward[i - 1]))
        return None


@dataclass(frozen=True)
class KindProfile:
    """What was measured on one GPU kind."""

    layers: dict[str, dict[int, LayerCurve]]   # layer name -> tp degree -> curve
    optimizer_step: float | None = None        # seconds per optimizer step (whole model)
    # torch, cuda, date, source, device, slowdown (emulated kinds); collectives: "included" when the measured times already hold the
    # layer's tensor-parallel collectives (timed around the whole layer), else they are priced apart
    meta: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelProfile:
    """A model's measured costs per GPU kind, in one dtype through one engine."""

    signature: str
    layer_names: tuple[str, ...]
    dtype: str
    engine: str
    kinds: dict[str, KindProfile]
    # the file(s) it was read from, for error messages and `plait simulate`; not part of equality
    source: str = field(default="<memory>", compare=False)

    def __hash__(self) -> int:
        # part of `ComputeModel`'s hash (cost caches key on it): what identifies the measurement
        return hash((self.signature, self.layer_names, self.dtype, self.engine,
                     tuple(sorted((k, v.meta.get("date", "")) for k, v in self.kinds.items()))))

    def layer_time(self, kind: str, layer: str, micro_batch: float, tp: int = 1) -> tuple[float, float] | None:
        """Measured (forward, backward) seconds, or None where not measured (then: the analytic model)."""
        kp = self.kinds.get(kind)
        curve = kp.layers.get(layer, {}).get(tp) if kp is not None else None
        return curve.at(micro_batch) if curve is not None else None

    def collectives_included(self, kind: str) -> bool:
        kp = self.kinds.get(kind)
        return kp is not None and kp.meta.get("collectives") == "included"

    def coverage(self, kinds: list[str]) -> str:
        """One line for a plan row and `plait simulate`: which kinds' compute was measured."""
        measured = [k for k in kinds if k in self.kinds]
        modelled = [k for k in kinds if k not in self.kinds]
        parts = []
        if measured:
            parts.append("compute measured on " + ", ".join(measured))
        if modelled:
            parts.append(("modelled on " if measured else "compute modelled on ") + ", ".join(modelled))
        return ", ".join(parts)


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ProfileError(f"{where}: expected a positive time, got {value!r}")
    return float(value)


def _curve(raw: Any, where: str) -> LayerCurve:
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: expected a mapping with micro_batch, forward, backward")
    mbs = raw.get("micro_batch")
    if not isinstance(mbs, list) or not mbs or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in mbs):
        raise ProfileError(f"{where}.micro_batch: expected a list of positive integers, got {mbs!r}")
    if sorted(set(mbs)) != mbs:
        raise ProfileError(f"{where}.micro_batch: sizes must increase, got {mbs!r}")
    cols = {}
    for key in ("forward", "backward", "memory"):
        vals = raw.get(key, [] if key == "memory" else None)
        if not isinstance(vals, list) or (vals or key != "memory") and len(vals) != len(mbs):
            raise ProfileError(f"{where}.{key}: expected one value per micro_batch ({len(mbs)}), got {vals!r}")
        cols[key] = tuple(_positive(v, f"{where}.{key}[{i}] (micro_batch {mbs[i]})") for i, v in enumerate(vals))
    return LayerCurve(tuple(mbs), cols["forward"], cols["backward"], cols["memory"])


def parse_profile(data: Any, source: str) -> ModelProfile:
    """A `ModelProfile` from the file's data; raises `ProfileError` naming `source` and the entry."""
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: expected a mapping at the top level")
    data = check_version("profile", data, source, ProfileError)
    model = data.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("signature"), str) \
            or not isinstance(model.get("layers"), list):
        raise ProfileError(f"{source}: model: expected {{signature: str, layers: [names]}}")
    for key in ("dtype", "engine"):
        if not isinstance(data.get(key), str):
            raise ProfileError(f"{source}: {key}: expected a string, got {data.get(key)!r}")
    names = tuple(str(n) for n in model["layers"])
    kinds: dict[str, KindProfile] = {}
    for kind, raw in (data.get("kinds") or {}).items():
        where = f"{source}: kinds.{kind}"
        if not isinstance(raw, dict):
            raise ProfileError(f"{where}: expected a mapping")
        layers: dict[str, dict[int, LayerCurve]] = {}
        for lname, by_tp in (raw.get("layers") or {}).items():
            if lname not in names:
                raise ProfileError(f"{where}.layers.{lname}: not a layer of the profiled model {model['signature']}")
            layers[lname] = {}
            for tpkey, curve in (by_tp or {}).items():
                tp = str(tpkey)
                if not tp.startswith("tp") or not tp[2:].isdigit() or int(tp[2:]) < 1:
                    raise ProfileError(f"{where}.layers.{lname}.{tp}: expected a key tp<degree>, e.g. tp1")
                layers[lname][int(tp[2:])] = _curve(curve, f"{where}.layers.{lname}.{tp}")
        opt = raw.get("optimizer_step")
        meta = {k: str(raw[k]) for k in ("torch", "cuda", "date", "source", "collectives", "device", "slowdown")
                if k in raw}
        kinds[str(kind)] = KindProfile(layers, None if opt is None else _positive(opt, f"{where}.optimizer_step"), meta)
    return ModelProfile(model["signature"], names, data["dtype"], data["engine"], kinds, source)


def load_profile(path: str | Path, signature: str | None = None, layers: list[str] | None = None,
                 dtype: str | None = None, engine: str | None = None) -> ModelProfile:
    """Read a profile file and refuse it, before any work, for another model, dtype or engine."""
    source = str(path)
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ProfileError(f"{source}: cannot read: {exc}".splitlines()[0]) from None
    prof = parse_profile(data, source)
    check_matches(prof, source, signature, layers, dtype, engine)
    return prof


def check_matches(prof: ModelProfile, source: str, signature: str | None = None, layers: list[str] | None = None,
                  dtype: str | None = None, engine: str | None = None) -> None:
    """Refuse a profile of another model (a layer that differs), dtype or engine, in one line."""
    if layers is not None and tuple(layers) != prof.layer_names:
        diff = next((i for i, (a, b) in enumerate(zip(layers, prof.layer_names)) if a != b),
                    min(len(layers), len(prof.layer_names)))
        got = prof.layer_names[diff] if diff < len(prof.layer_names) else "(none)"
        want = layers[diff] if diff < len(layers) else "(none)"
        raise ProfileError(f"{source}: model.layers[{diff}]: profiled layer {got} differs from the model's {want}; "
                           f"profile this model again")
    if signature is not None and signature != prof.signature:
        raise ProfileError(f"{source}: model.signature: profiled {prof.signature!r}, the model is {signature!r}")
    if dtype is not None and dtype != prof.dtype:
        raise ProfileError(f"{source}: dtype: profiled in {prof.dtype}, the plan runs {dtype}")
    if engine is not None and engine != prof.engine:
        raise ProfileError(f"{source}: engine: profiled through {prof.engine}, the plan runs {engine}")


def profile_to_dict(prof: ModelProfile) -> dict[str, Any]:
    """The file form of `prof` (stamped with format_version)."""
    kinds: dict[str, Any] = {}
    for kind, kp in prof.kinds.items():
        out: dict[str, Any] = {k: str(v) for k, v in kp.meta.items()}
        if kp.optimizer_step is not None:
            out["optimizer_step"] = kp.optimizer_step
        out["layers"] = {name: {f"tp{tp}": {"micro_batch": list(c.micro_batch), "forward": list(c.forward),
                                            "backward": list(c.backward),
                                            **({"memory": list(c.memory)} if c.memory else {})}
                                for tp, c in sorted(by_tp.items())}
                         for name, by_tp in kp.layers.items()}
        kinds[kind] = out
    return stamp("profile", {"model": {"signature": prof.signature, "layers": list(prof.layer_names)},
                             "dtype": prof.dtype, "engine": prof.engine, "kinds": kinds})


def save_profile(prof: ModelProfile, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(profile_to_dict(prof), sort_keys=False))


def merge_profiles(a: ModelProfile, b: ModelProfile, source: str = "merge") -> ModelProfile:
    """Profiles of one model measured on two machines, kind by kind; a kind in both is refused
    unless one is a superset of the other's layers (then the later-dated one wins per layer)."""
    check_matches(b, source, a.signature, list(a.layer_names), a.dtype, a.engine)
    kinds = dict(a.kinds)
    for kind, kp in b.kinds.items():
        if kind not in kinds:
            kinds[kind] = kp
            continue
        old = kinds[kind]
        first, second = (old, kp) if old.meta.get("date", "") <= kp.meta.get("date", "") else (kp, old)
        layers = {name: {**first.layers.get(name, {}), **second.layers.get(name, {})}
                  for name in {*first.layers, *second.layers}}
        step = second.optimizer_step if second.optimizer_step is not None else first.optimizer_step
        kinds[kind] = KindProfile(layers, step, {**first.meta, **second.meta})
    return ModelProfile(a.signature, a.layer_names, a.dtype, a.engine, kinds, f"{a.source} + {b.source}")


def model_signature(graph: Any) -> str:
    """The layer signature a profile is keyed by: the model's name and a digest of its layers
    (name, tensor-parallel style, parameters) and architecture config (hidden, seq, ...), so a
    profile of another size or sequence length of the same model is refused, not silently used."""
    import hashlib
    import json

    layers = [(layer.name, layer.tp_style, int(layer.param_count)) for layer in graph.layers]
    config = {k: v for k, v in sorted((graph.config or {}).items()) if isinstance(v, (int, float, str, bool))}
    digest = hashlib.sha1(json.dumps([layers, config], sort_keys=True).encode()).hexdigest()[:12]
    return f"{graph.model}:layers={len(layers)}:{digest}"


def profile_for(profiles: list[ModelProfile], graph: Any, dtype: str, engine: str = "plait") -> ModelProfile | None:
    """The merged profile of `graph` in `dtype` through `engine` among a cluster's `profiles`
    (None when the cluster names none). A cluster may carry profiles of several models; when it
    names profiles but none is of this model, dtype and engine, the first one's mismatch is
    refused in one line (file, entry, reason) -- before any work, as every other bad input."""
    if not profiles:
        return None
    names = [layer.name for layer in graph.layers]
    sig = model_signature(graph)
    mine = [p for p in profiles if p.signature == sig and p.layer_names == tuple(names)
            and p.dtype == dtype and p.engine == engine]
    if not mine:
        same = [p for p in profiles if p.signature == sig] or profiles
        check_matches(same[0], same[0].source, sig, names, dtype, engine)
        raise ProfileError(f"{same[0].source}: model: not a profile of {sig}")  # unreachable in practice
    out = mine[0]
    for other in mine[1:]:
        out = merge_profiles(out, other, other.source)
    return out
