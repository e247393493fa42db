"""Tensor-parallel marks from a model's own plan: Hugging Face `transformers` configs carry
`base_model_tp_plan`, {module pattern: style} relative to the base model (`model.model` of a
`...ForCausalLM`), e.g. ``"layers.*.self_attn.q_proj": "colwise"``; transformers itself applies
it with DTensor (`transformers.integrations.tensor_parallel`, where ``*`` is a layer index).

plait reads the same plan into its own markers, so the capture (which activations are sharded),
the cost model (`plait.cost.compute`: which matmuls split their n or k) and the runtime
(`plait.runtime.tensor_parallel`: Megatron column/row linears) see one set of marks:

* ``colwise`` on an `nn.Linear` -> ``plait_tp = "column"``, ``rowwise`` -> ``"row"``;
* the module that holds a column and a row linear of the plan (the attention, the MLP) is
  ``"sharded"``: the ops between them (rotary, SDPA, the gated product) run on the local heads
  or features (Megatron's pairing, Shoeybi et al. 2019 §3);
* every other style (``packed_colwise`` expert tensors, ``gather``, ``sequence_parallel``,
  vocabulary styles) stays replicated, and so does a linear whose module has no partner of the
  other kind (a lone column linear would need its output gathered).

A model that already marks modules (`plait_tp`) keeps its own marks.
"""

from __future__ import annotations

import re

from torch import nn

_STYLES = {"colwise": "column", "rowwise": "row"}


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """{pattern relative to the model root: style} from the config's `base_model_tp_plan` (empty
    without one). Patterns are given under the base model's prefix and under the root."""
    cfg = getattr(model, "config", None)
    plan = getattr(cfg, "base_model_tp_plan", None)
    if not isinstance(plan, dict) or not plan:
        return {}
    prefix = getattr(model, "base_model_prefix", "") or ""
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        if isinstance(pattern, str) and isinstance(style, str):
            out[pattern] = style
            if prefix and hasattr(model, prefix):
                out[f"{prefix}.{pattern}"] = style
    return out


def _pattern(p: str) -> re.Pattern[str]:
    return re.compile(re.escape(p).replace(r"\*", r"\d+") + r"\Z")


def mark_tp_plan(model: nn.Module) -> list[str]:
    """Set `plait_tp` markers from the model's own tensor-parallel plan (see the module doc);
    returns the marked module paths (empty when the model has no plan or marks itself)."""
    if any(getattr(m, "plait_tp", None) is not None for m in model.modules()):
        return []
    plan = model_tp_plan(model)
    if not plan:
        return []
    compiled = [(_pattern(p), _STYLES[s]) for p, s in plan.items() if s in _STYLES]
    linears: dict[str, str] = {}
    for path, m in model.named_modules():
        if isinstance(m, nn.Linear):
            style = next((s for rx, s in compiled if rx.match(path)), None)
            if style is not None:
                linears[path] = style
    by_parent: dict[str, dict[str, str]] = {}
    for path, style in linears.items():
        by_parent.setdefault(path.rpartition(".")[0], {})[path] = style
    marked: list[str] = []
    for parent, members in by_parent.items():
        if set(members.values()) != {"column", "row"}:
            continue  # no partner: leave the linears replicated
        if parent:
            model.get_submodule(parent).plait_tp = "sharded"
            marked.append(parent)
        for path, style in members.items():
            model.get_submodule(path).plait_tp = style
            marked.append(path)
    return marked


def tensor_parallel_style(module: nn.Module) -> str:
    """A layer's OpGraph `tp_style` from its markers: "transformer" when it holds both a column-
    and a row-parallel linear (a block tensor parallelism cuts), else "none"."""
    styles = {getattr(m, "plait_tp", None) for m in module.modules()}
    return "transformer" if {"column", "row"} <= styles else "none"


def head_counts(model: nn.Module) -> dict[str, int]:
    """{"heads", "kv_heads"} of a model whose blocks tensor parallelism cuts in whole heads, from
    its config (`num_attention_heads`, `num_key_value_heads`): the planner offers tp degrees that
    divide both. Empty for a model without tensor-parallel marks or without those fields."""
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if not isinstance(heads, int) or not any(getattr(m, "plait_tp", None) == "row" for m in model.modules()):
        return {}
    kv = getattr(cfg, "num_key_value_heads", None)
    return {"heads": heads, "kv_heads": kv if isinstance(kv, int) and kv > 0 else heads}


def transformer_shape(model: nn.Module, seq: int) -> dict[str, object]:
    """The shape facts the closed-form transformer cost reads (`plait.cost.compute.TransformerShape`:
    hidden, heads, kv_heads, head_dim, ffn, seq, gated, sdpa, causal), from the config of a dense
    decoder whose blocks its own plan cuts (every block's attention and MLP marked), so an HF
    Llama block is priced as the zoo's LLaMA block of the same shape. Empty otherwise (MoE blocks,
    whose experts the plan does not cut; encoders; models without a plan)."""
    cfg = getattr(model, "config", None)
    counts = head_counts(model)
    hidden, ffn = getattr(cfg, "hidden_size", None), getattr(cfg, "intermediate_size", None)
    if not counts or not isinstance(hidden, int) or not isinstance(ffn, int):
        return {}
    if any(getattr(cfg, k, 0) for k in ("num_local_experts", "num_experts", "n_routed_experts")):
        return {}
    if getattr(cfg, "is_encoder_decoder", False) or not getattr(cfg, "is_decoder", True):
        return {}
    rows = sum(getattr(m, "plait_tp", None) == "row" for m in model.modules())
    layers = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(layers, int) or rows != 2 * layers:  # attention and MLP of every block
        return {}
    act = str(getattr(cfg, "hidden_act", "")).lower()
    head_dim = getattr(cfg, "head_dim", None) or hidden // counts["heads"]
    return {**counts, "hidden": hidden, "ffn": ffn, "seq": int(seq), "head_dim": int(head_dim),
            "activation": "swiglu" if act in ("silu", "swish") else act,
            "sdpa": getattr(cfg, "_attn_implementation", "sdpa") in ("sdpa", "flash_attention_2"),
            "causal": True}
