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
"""

from __future__ import annotations

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
