"""Importers of other planners' per-layer cost files into a `ModelProfile` (issue 28 item 3).

AMP (Li et al., NeurIPS 2022; github.com/DachengLi1/AMP, src/known_cost/*.npy). Each file
``{model}_{machine}_{mp}.npy`` is a float64 vector, one entry per DeepSpeed pipeline spec of
Megatron-DeepSpeed's GPT2ModelPipe (0 embedding, 1 transpose, 2..L+1 the transformer layers,
L+2 transpose, L+3 final norm, L+4 tied LM head, L+5 fp16->fp32): the measured *forward* seconds
of that spec at micro-batch 1 and model-parallel degree ``mp``. AMP's own cost model
(src/cost_het_cluster.py, `AMP.init_param` and `get_cost_e`) prices a spec's forward plus backward
as ``3 x`` that time and scales it linearly with the micro-batch size; the importer writes exactly
that: backward = 2 x forward, and a micro-batch sweep [1, max_micro_batch] that is linear in the
micro-batch (AMP's assumption, so `source: imported:amp` says it). AMP timed each spec's whole
forward under model parallelism (generate_known_cost.py via DeepSpeed's pipeline module), so the
times hold the layer's tensor-parallel all-reduces: `collectives: included`. Specs are summed onto plait's
layers: the embedding and first transpose onto ``embed``, transformer ``i`` onto ``layers.i``, the
rest onto ``head``. The files carry no license in AMP's repository, so plait does not ship them:
the user points the importer at their own copy.

Sailor (Strati et al., SOSP 2025; github.com/eth-easl/sailor @ cf2c8e3, MIT). Its simulator reads
``sailor/Planner/simulations/profiles_tmp.json`` (written by sailor/profiling/gather_profs.py):
``{model: {gpu_type: {micro_batch: {tp: {layer_index: [forward_s, backward_s, update_s]}}}}}``,
layer 0 the embedding, 1..L the transformer blocks, L+1 the head (runtime_simulator.py,
`simulate_iteration_time` and `get_time_layer`: a layer's time at a tensor-parallel degree is
taken as measured, its all-reduces inside, so `collectives: included`). Every micro-batch size
measured becomes a point of the sweep. The third figure (the update, which Sailor reads once per
stage at the stage's first layer) does not map onto a whole-model optimizer step and is not
imported. A measured 0.0 (the file rounds to 4 decimals: an embedding's backward) becomes 1e-6 s,
the resolution Sailor's own per-GPU profile files write, since a profile time must be positive.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from plait.ir.profile import KindProfile, LayerCurve, ModelProfile, ProfileError

# AMP's machine tags -> plait's GPU kind names (AWS p3.8xlarge: V100-16GB; g4dn.12xlarge: T4).
AMP_MACHINES = {"P3": "v100-16gb", "G4": "t4"}
_NAME = re.compile(r"^(?P<model>\w+?)_(?P<machine>[A-Z]\w*?)_(?P<mp>\d+)\.npy$")


def _amp_layer_sums(vec: np.ndarray, source: str) -> list[float]:
    """[embed, layers.0 .. layers.L-1, head] from AMP's per-spec vector."""
    blocks = len(vec) - 6
    if vec.ndim != 1 or blocks < 1:
        raise ProfileError(f"{source}: expected a vector of L + 6 pipeline-spec times, got shape {vec.shape}")
    for i, v in enumerate(vec):
        if not np.isfinite(v) or v < 0:
            raise ProfileError(f"{source}: spec {i}: expected a non-negative time, got {v!r}")
    out = [float(vec[0] + vec[1]), *(float(v) for v in vec[2:2 + blocks]), float(vec[2 + blocks:].sum())]
    for i, v in enumerate(out):
        if v <= 0:
            raise ProfileError(f"{source}: spec sum for plait layer {i}: expected a positive time, got {v!r}")
    return out


def import_amp_known_cost(folder: str | Path, model: str = "gpt2", dtype: str = "fp16",
                          max_micro_batch: int = 32, signature: str | None = None) -> ModelProfile:
    """A profile from AMP's ``known_cost`` folder (every ``{model}_{machine}_{mp}.npy`` in it)."""
    folder = Path(folder)
    files = sorted(p for p in folder.glob(f"{model}_*_*.npy") if _NAME.match(p.name))
    if not files:
        raise ProfileError(f"{folder}: no AMP known_cost files {model}_<machine>_<mp>.npy")
    kinds: dict[str, dict[str, dict[int, LayerCurve]]] = {}
    names: list[str] | None = None
    for path in files:
        m = _NAME.match(path.name)
        assert m is not None
        kind = AMP_MACHINES.get(m["machine"])
        if kind is None:
            raise ProfileError(f"{path}: machine {m['machine']!r}: not one of AMP's {sorted(AMP_MACHINES)}")
        sums = _amp_layer_sums(np.load(path, allow_pickle=False), str(path))
        these = ["embed", *(f"layers.{i}" for i in range(len(sums) - 2)), "head"]
        if names is not None and these != names:
            raise ProfileError(f"{path}: {len(these) - 2} transformer layers, the folder's other files have "
                               f"{len(names) - 2}")
        names = these
        mbs = (1, max_micro_batch) if max_micro_batch > 1 else (1,)
        layers = kinds.setdefault(kind, {})
        for name, fwd in zip(these, sums):
            layers.setdefault(name, {})[int(m["mp"])] = LayerCurve(
                mbs, tuple(fwd * b for b in mbs), tuple(2 * fwd * b for b in mbs))
    assert names is not None
    return ModelProfile(signature or f"amp:{model}:layers={len(names) - 2}", tuple(names), dtype, "deepspeed",
                        {k: KindProfile(v, None, {"source": "imported:amp", "collectives": "included"}) for k, v in kinds.items()})


# Sailor's GPU type names -> plait's GPU kind names (others: lower-cased, as written)
SAILOR_GPUS = {"A100-40": "a100-40gb", "A100-80": "a100-80gb", "V100-16": "v100-16gb", "V100-32": "v100-32gb",
               "RTX-3090": "rtx-3090", "RTX-4090": "rtx-4090", "H100-80": "h100-80gb"}
_SAILOR_FLOOR = 1e-6


def import_sailor_profiles(path: str | Path, model: str, dtype: str = "fp16",
                           signature: str | None = None) -> ModelProfile:
    """A profile from Sailor's ``profiles_tmp.json``: every GPU type measured for `model`."""
    source = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ProfileError(f"{source}: cannot read: {exc}".splitlines()[0]) from None
    if not isinstance(data, dict) or not isinstance(data.get(model), dict):
        have = sorted(data) if isinstance(data, dict) else []
        raise ProfileError(f"{source}: {model}: no such model in the file (it has {have})")
    kinds: dict[str, dict[str, dict[int, LayerCurve]]] = {}
    count: int | None = None
    for gpu, by_mb in data[model].items():
        where = f"{source}: {model}.{gpu}"
        points: dict[tuple[int, int], list[tuple[int, float, float]]] = {}  # (layer, tp) -> [(mb, f, b)]
        for mb, by_tp in (by_mb or {}).items():
            for tp, layers in (by_tp or {}).items():
                if not (str(mb).isdigit() and str(tp).isdigit()) or not isinstance(layers, dict):
                    raise ProfileError(f"{where}.{mb}.{tp}: expected {{micro_batch: {{tp: {{layer: [fwd, bwd, "
                                       f"update]}}}}}} with integer keys")
                if count is not None and len(layers) != count:
                    raise ProfileError(f"{where}.{mb}.{tp}: {len(layers)} layers, the file's others have {count}")
                count = len(layers)
                for idx, vals in layers.items():
                    entry = f"{where}.{mb}.{tp}.{idx}"
                    if not str(idx).isdigit() or not isinstance(vals, list) or len(vals) < 2:
                        raise ProfileError(f"{entry}: expected [forward_s, backward_s, update_s]")
                    fb = []
                    for name, v in zip(("forward", "backward"), vals[:2]):
                        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                            raise ProfileError(f"{entry}: {name}: expected a non-negative time, got {v!r}")
                        fb.append(max(float(v), _SAILOR_FLOOR))
                    points.setdefault((int(idx), int(tp)), []).append((int(mb), fb[0], fb[1]))
        layers_of: dict[str, dict[int, LayerCurve]] = {}
        last = -1 if count is None else count - 1  # points were read, so count is set
        for (idx, tp), pts in points.items():
            pts.sort()
            name = "embed" if idx == 0 else "head" if idx == last else f"layers.{idx - 1}"
            layers_of.setdefault(name, {})[tp] = LayerCurve(tuple(p[0] for p in pts), tuple(p[1] for p in pts),
                                                            tuple(p[2] for p in pts))
        kinds[SAILOR_GPUS.get(gpu, gpu.lower())] = layers_of
    if not count or count < 3:
        raise ProfileError(f"{source}: {model}: no layer times (expected embedding, blocks and head)")
    names = ("embed", *(f"layers.{i}" for i in range(count - 2)), "head")
    return ModelProfile(signature or f"sailor:{model}:layers={count - 2}", names, dtype, "deepspeed",
                        {k: KindProfile(v, None, {"source": "imported:sailor", "collectives": "included"})
                         for k, v in kinds.items()}, source)
