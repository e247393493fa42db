"""Tensor-parallel marks from a model's own plan: Hugging Face `transformers` configs carry
`base_model_tp_plan`, {module pattern: style} relative to the base model (`model.model` of a
`...ForCausalLM`), e.g. ``"layers.*.self_attn.q_proj": "colwise"``; transformers itself applies
it with DTensor (`transformers.integrations.tensor_parallel`, where ``*`` is a layer index).

plait reads the same plan into its own markers, so the capture (which activations are sharded),
the cost model (`plait.cost.compute`: which matmuls split their n or k) and the runtime
(`plait.runtime.tensor_parallel`: Megatron column/row linears) see one set of marks:

* ``colwise`` on an `nn.Linear` -> ``plait_tp = "column"``, ``rowwise`` -> ``"row"``;
* a column linear's partner is the first row linear after it under its parent (LLaMA's
  attention and MLP), else its grandparent (BERT's ``attention.self`` and ``attention.output``);
  the column's parent is ``"sharded"``: the ops between them (rotary, SDPA, the gated product)
  run on the local heads or features (Megatron's pairing, Shoeybi et al. 2019 §3);
* a ``colwise`` ``nn.Embedding`` inside a cut attention (T5's relative-position bias, buckets x
  heads) is a column table: each rank keeps its heads' columns;
* a config without a plan takes plait's for its ``model_type`` (`KNOWN_TP_PLANS`: BERT, RoBERTa,
  T5, GPT-2); plait's own style ``colwise_qkv`` is a column linear of three fused blocks
  [q | k | v] (GPT-2's ``c_attn``), cut block by block; transformers' ``Conv1D`` (a linear stored
  [in, out]) is a linear here;
* a module whose plan cuts two of its 3-D parameters -- ``packed_colwise`` (the experts' fused
  [gate | up] projection, cut half by half) and ``rowwise`` (their down projection) -- is
  ``"experts"``: every expert keeps its rank's slice of the intermediate features (Megatron's MLP
  cut, expert by expert, as transformers' ``moe_tp_experts``), its input passes through f and its
  output through g (`plait.runtime.tensor_parallel`); ``plait_tp_experts`` names the two tensors
  and the dimension each is cut along;
* where the plan cuts nothing of it, a standard MLP in a block (an item of a `ModuleList`) is cut
  as Megatron cuts MLPs (`detected_mlps`): a module of linears whose fx graph feeds its input to
  column linears (hidden -> F, or k x F split by ``chunk(k, -1)``: Phi-3's fused [gate | up], cut
  block by block), combines their outputs only elementwise (activation, gated product, dropout)
  and returns one row linear (F -> hidden) of that -- Qwen2-MoE's ``shared_expert``, which its
  plan leaves out; Phi-3's MLP, whose plan gathers it; every block MLP of a model with no plan
  (StableLM). Attention is not detected: whether the ops between q/k/v and the output projection
  keep to their heads is not something its graph shows as plainly;
* ``colwise_gather_output`` / ``rowwise_split_input`` (OLMo2's and Phi-3's attention, whose ops
  between the projections need every head: a norm over all of q, a fused [q | k | v] sliced by
  the config's head count) -> ``"column_gather"`` / ``"row_split"``: the linear keeps its slice of
  output / input features, its output is all-gathered / its input split, so the ops between run
  on whole tensors (transformers' styles of the same names); where a detected MLP pairs them
  Megatron's way instead, that cut wins (no gather);
* every other style (``gather``, ``sequence_parallel``, vocabulary styles) stays replicated, and
  so does a linear whose module has no partner of the other kind (a lone column linear would need
  its output gathered), and experts with biases (a row bias would be added once per rank).

A model that already marks modules (`plait_tp`) keeps its own marks.
"""

from __future__ import annotations

import math
import operator
import re

import torch
from torch import nn

from plait.ir.opgraph import TP_ALONE_ROLES

_STYLES = {"colwise": "column", "rowwise": "row", "colwise_qkv": "column",
           "colwise_gather_output": "column_gather", "rowwise_split_input": "row_split"}
_CHUNKS = {"colwise_qkv": 3}  # plait's own style: a fused [q | k | v] projection, cut block by block

# Plans for architectures whose transformers config ships none, in the config's own format and
# with Megatron's pairing (Megatron-LM tensor-parallelises BERT and T5 with the same column/row
# attention and MLP as GPT; Shoeybi et al. 2019, §3): q/k/v and the first MLP linear by columns,
# the attention output and the second MLP linear by rows. T5's relative-position bias table
# (buckets x heads) is cut by heads like q/k/v, so every rank adds its own heads' bias.
_BERT_PLAN = {
    "encoder.layer.*.attention.self.query": "colwise", "encoder.layer.*.attention.self.key": "colwise",
    "encoder.layer.*.attention.self.value": "colwise", "encoder.layer.*.attention.output.dense": "rowwise",
    "encoder.layer.*.intermediate.dense": "colwise", "encoder.layer.*.output.dense": "rowwise",
}
_T5_ATTENTION = {f"{a}.{p}": "colwise" for a in ("layer.0.SelfAttention", "layer.1.EncDecAttention")
                 for p in ("q", "k", "v")} | {
    "layer.0.SelfAttention.o": "rowwise", "layer.1.EncDecAttention.o": "rowwise",
    "layer.0.SelfAttention.relative_attention_bias": "colwise"}
_T5_MLP = {f"layer.{i}.DenseReluDense.{p}": style for i in (1, 2)
           for p, style in (("wi", "colwise"), ("wi_0", "colwise"), ("wi_1", "colwise"), ("wo", "rowwise"))}
_T5_PLAN = {f"{stack}.block.*.{k}": v for stack in ("encoder", "decoder") for k, v in (_T5_ATTENTION | _T5_MLP).items()}
_GPT2_PLAN = {"h.*.attn.c_attn": "colwise_qkv", "h.*.attn.c_proj": "rowwise",
              "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"}  # Conv1D: weights stored [in, out]
KNOWN_TP_PLANS: dict[str, dict[str, str]] = {"bert": _BERT_PLAN, "roberta": _BERT_PLAN, "t5": _T5_PLAN,
                                             "gpt2": _GPT2_PLAN}


def is_conv1d(m: nn.Module) -> bool:
    """transformers' `Conv1D` (GPT-2): a linear whose weight is stored [in, out]."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and getattr(m, "weight", None) is not None \
        and m.weight.dim() == 2


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """{pattern relative to the model root: style} from the config's `base_model_tp_plan`, else
    plait's plan for its `model_type` (`KNOWN_TP_PLANS`), else empty. Patterns are given under the
    base model's prefix and under the root."""
    cfg = getattr(model, "config", None)
    plan = getattr(cfg, "base_model_tp_plan", None)
    if not isinstance(plan, dict) or not plan:
        plan = KNOWN_TP_PLANS.get(str(getattr(cfg, "model_type", "")), {}) if cfg is not None else {}
    if not plan:
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
    if not plan:  # no plan: the standard MLPs of its blocks, detected (attention is not: see the doc)
        return _mark_mlps(model, detected_mlps(model, everywhere=True))
    compiled = [(_pattern(p), s) for p, s in plan.items() if s in _STYLES]
    linears: dict[str, str] = {}  # in module order
    tables: list[str] = []  # colwise embeddings: cut only inside an attention the plan cuts
    chunks: dict[str, int] = {}
    for path, m in model.named_modules():
        style = next((s for rx, s in compiled if rx.match(path)), None)
        if style is None:
            continue
        if isinstance(m, nn.Linear) or is_conv1d(m):
            linears[path] = _STYLES[style]
            if style in _CHUNKS:
                chunks[path] = _CHUNKS[style]
        elif isinstance(m, nn.Embedding) and m.padding_idx is None and _STYLES[style] == "column":
            tables.append(path)
    marked: list[str] = []
    for column, row in _pairs(linears):
        parent = column.rpartition(".")[0]
        for path, style in ((parent, "sharded"), (column, "column"), (row, "row")):
            if path and path not in marked:
                model.get_submodule(path).plait_tp = style
                marked.append(path)
        if column in chunks:
            model.get_submodule(column).plait_tp_chunks = chunks[column]
    for path in tables:  # a table cut by heads inside a cut attention (T5's bias)
        if path.rpartition(".")[0] in marked:
            model.get_submodule(path).plait_tp = "column"
            marked.append(path)
    for path, m in model.named_modules():
        cut = _expert_tensors(m, path, plan)
        if cut is not None and path not in marked:
            m.plait_tp, m.plait_tp_experts = "experts", cut
            marked.append(path)
    marked += _mark_mlps(model, detected_mlps(model, everywhere=True))  # where the plan is silent
    # linears the plan cuts with their output gathered / input split, where nothing cut them above
    for path, style in linears.items():
        if style in ("column_gather", "row_split") and not any(
                getattr(model.get_submodule(p), "plait_tp", None) for p in _ancestors(path)):
            model.get_submodule(path).plait_tp = style
            marked.append(path)
    if marked and transformer_shape(model, 1):
        _mark_zoo_layers(model)
    return marked


def _expert_tensors(m: nn.Module, path: str, plan: dict[str, str]) -> dict[str, int] | None:
    """{parameter: dimension cut} of an experts module whose plan cuts its fused [gate | up]
    tensor packed-column-wise and its down tensor row-wise (both [experts, ., .]; stored
    [out, in] per expert, or [in, out] when the module says `is_transposed`), else None."""
    styles = {}
    for name, prm in m.named_parameters(recurse=False):
        style = next((st for pat, st in plan.items() if _pattern(pat).match(f"{path}.{name}")), None)
        if style in ("packed_colwise", "rowwise") and prm.dim() == 3:
            styles[style] = name
    if set(styles) != {"packed_colwise", "rowwise"}:
        return None
    if any(name.endswith("_bias") and prm is not None for name, prm in m.named_parameters(recurse=False)):
        return None  # a row bias would be added on every rank
    flip = bool(getattr(m, "is_transposed", False))
    gate_up, down = styles["packed_colwise"], styles["rowwise"]
    out = {gate_up: 2 if flip else 1, down: 1 if flip else 2}  # the intermediate features' dimension
    g, d = getattr(m, gate_up), getattr(m, down)
    if g.shape[out[gate_up]] != 2 * d.shape[out[down]]:
        return None  # not a fused [gate | up] of the down projection's width
    return out


# Ops that act feature by feature (an MLP's activation, its gated product, dropout, casts): on
# column-cut features they give the column-cut result, so a row linear can take it (Megatron's MLP).
_ELEMENTWISE_FUNCTIONS = {
    operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow,
    torch.mul, torch.add, torch.sub, torch.div, torch.neg, torch.pow, torch.sigmoid, torch.tanh, torch.relu,
    torch.exp, torch.erf, torch.sqrt, torch.square, math.sqrt,
    nn.functional.silu, nn.functional.gelu, nn.functional.relu, nn.functional.sigmoid, nn.functional.tanh,
    nn.functional.leaky_relu, nn.functional.elu, nn.functional.mish, nn.functional.softplus,
    nn.functional.hardswish, nn.functional.relu6, nn.functional.dropout}
_ELEMENTWISE_METHODS = {"mul", "add", "sub", "div", "neg", "pow", "sigmoid", "tanh", "relu", "exp", "to", "float",
                        "half", "bfloat16", "type_as", "contiguous"}
_ELEMENTWISE_MODULES = (nn.ReLU, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Dropout, nn.LeakyReLU, nn.ELU,
                        nn.Mish, nn.Softplus, nn.Hardswish, nn.ReLU6, nn.Identity)


def detected_mlps(model: nn.Module, everywhere: bool = False
                  ) -> list[tuple[str, list[str], str, dict[str, int]]]:
    """(module, its column linears, its row linear, {fused column: blocks}) of every standard MLP
    left uncut inside a block the plan cuts (an item of a `ModuleList` holding marks; `everywhere`:
    in every block): a module with no parameters of its own whose parameters are all in
    `nn.Linear` children, its column linears hidden -> F (or k x F, split by ``chunk(k, -1)``) and
    one row linear F -> hidden, and whose forward (fx-traced) passes its one input to every
    column, joins their outputs only by elementwise ops and returns the row of that.
    Megatron's MLP cut is exact for such a module whatever the activation (Shoeybi et al. 2019, §3)."""
    found: list[tuple[str, list[str], str, dict[str, int]]] = []
    for list_path, ml in model.named_modules():
        if not isinstance(ml, nn.ModuleList):
            continue
        for i, block in enumerate(ml):
            if not everywhere and not any(getattr(m, "plait_tp", None) is not None for m in block.modules()):
                continue
            for sub, m in block.named_modules():
                if sub and not any(getattr(x, "plait_tp", None) is not None for x in m.modules()):
                    cut = _mlp_cut(m)
                    if cut is not None:
                        path = f"{list_path}.{i}.{sub}"
                        found.append((path, [f"{path}.{c}" for c in cut[0]], f"{path}.{cut[1]}",
                                      {f"{path}.{c}": k for c, k in cut[2].items()}))
    return [f for f in found if not any(f[0].startswith(g[0] + ".") for g in found)]


def _mlp_cut(m: nn.Module) -> tuple[list[str], str, dict[str, int]] | None:
    """([column children], row child, {fused column: blocks}) of a module that is a standard MLP
    (`detected_mlps`), else None. A column of k x F features split by ``chunk(k, -1)`` (Phi-3's
    fused [gate | up]) is k fused blocks, cut block by block (`plait_tp_chunks`)."""
    if next(m.parameters(recurse=False), None) is not None:
        return None
    linears = {n: c for n, c in m.named_children() if isinstance(c, nn.Linear)}
    if len(linears) < 2 or any(next(c.parameters(), None) is not None for n, c in m.named_children()
                               if n not in linears):
        return None
    rows = [n for n, c in linears.items() if c.in_features != c.out_features
            and all(o.in_features == c.out_features and o.out_features % c.in_features == 0
                    for k, o in linears.items() if k != n)]
    if len(rows) != 1:
        return None
    row, columns = rows[0], [n for n in linears if n != rows[0]]
    width = linears[row].in_features
    try:
        graph = torch.fx.symbolic_trace(m).graph
    except Exception:  # noqa: BLE001 -- an untraceable forward is simply not detected
        return None
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        return None
    sharded: set[torch.fx.Node] = set()
    fused: dict[torch.fx.Node, int] = {}  # a fused column's output -> its blocks
    split: set[torch.fx.Node] = set()  # chunk(k, -1) of a fused column: its items are sharded
    chunks: dict[str, int] = {}
    returned = None
    for node in graph.nodes:
        tensors = [a for a in node.all_input_nodes]
        if node.op == "placeholder":
            continue
        if node.op == "output":
            returned = node.args[0]
        elif node.op == "call_module" and node.target in columns:
            if list(node.args) != inputs or node.kwargs:
                return None
            k = linears[str(node.target)].out_features // width
            if k == 1:
                sharded.add(node)
            else:
                fused[node] = k
                chunks[str(node.target)] = k
        elif node.op == "call_module" and node.target == row:
            if len(node.args) != 1 or node.args[0] not in sharded or node.kwargs:
                return None
        elif _chunk_of(node) is not None and node.args[0] in fused and _chunk_of(node) == fused[node.args[0]]:
            split.add(node)
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in split:
            sharded.add(node)
        elif tensors and all(t in sharded for t in tensors) and _elementwise(node, m):
            sharded.add(node)
        else:
            return None
    if not (isinstance(returned, torch.fx.Node) and returned.op == "call_module" and returned.target == row):
        return None
    if any(u not in split for f in fused for u in f.users):  # a fused output used whole
        return None
    used = {n.target for n in graph.nodes if n.op == "call_module"}
    return (columns, row, chunks) if set(columns) <= used else None


def _chunk_of(node: torch.fx.Node) -> int | None:
    """k of ``x.chunk(k, -1)`` / ``torch.chunk(x, k, dim=-1)`` (the last dimension), else None."""
    if not ((node.op == "call_method" and node.target == "chunk")
            or (node.op == "call_function" and node.target is torch.chunk)):
        return None
    k = node.args[1] if len(node.args) > 1 else node.kwargs.get("chunks")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    return k if isinstance(k, int) and dim == -1 else None


def _elementwise(node: torch.fx.Node, root: nn.Module) -> bool:
    if node.op == "call_function":
        return node.target in _ELEMENTWISE_FUNCTIONS
    if node.op == "call_method":
        return node.target in _ELEMENTWISE_METHODS
    if node.op == "call_module":
        return isinstance(root.get_submodule(str(node.target)), _ELEMENTWISE_MODULES)
    return False


def _mark_zoo_layers(model: nn.Module) -> None:
    """A dense decoder priced as the zoo's LLaMA gets the zoo's layers: its token embedding the
    `embedding` layer and its LM head the `head` layer (vocabulary-parallel on GPUs, as Megatron
    cuts them; replicated by plait's runtime, which says so), each block a `transformer` layer.
    Marking is all or nothing for the layer cut, so the blocks are marked too, and the rotary
    tables (no parameters) are glue of the first block, as the zoo computes them inside its blocks;
    the final norm stays a layer of its own (its weight must live on one stage)."""
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    blocks = next((list(ml) for ml in model.modules() if isinstance(ml, nn.ModuleList) and len(ml) > 0
                   and all(any(getattr(m, "plait_tp", None) == "row" for m in b.modules()) for b in ml)), None)
    if not isinstance(embed, nn.Embedding) or not isinstance(head, nn.Linear) or not blocks:
        return
    embed.plait_layer, head.plait_layer = "embedding", "head"
    for block in blocks:
        block.plait_layer = "transformer"
    rotary = getattr(getattr(model, "base_model", model), "rotary_emb", None)
    if isinstance(rotary, nn.Module) and next(rotary.parameters(), None) is None:
        rotary.plait_layer = "glue"  # the zoo's closed-form block holds its rotary tables


def _mark_mlps(model: nn.Module, mlps: list[tuple[str, list[str], str, dict[str, int]]]) -> list[str]:
    """Megatron's marks on detected MLPs (`detected_mlps`): the module sharded, its columns (fused
    ones with their blocks) and its row; returns the marked paths."""
    marked = []
    for path, columns, row, chunks in mlps:
        for sub, style in ((path, "sharded"), *((c, "column") for c in columns), (row, "row")):
            model.get_submodule(sub).plait_tp = style
            marked.append(sub)
        for column, k in chunks.items():
            model.get_submodule(column).plait_tp_chunks = k
    return marked


def _ancestors(path: str) -> list[str]:
    """`path` and the modules above it (not the root)."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _pairs(linears: dict[str, str]) -> list[tuple[str, str]]:
    """(column, row) partners: a column's row is the first row after it (module order) inside
    its parent, else its grandparent -- the same parent for LLaMA's attention, the attention
    module above BERT's `attention.self` and `attention.output`, the block above BERT's
    `intermediate` and `output`. A column without a row stays replicated (it would need its
    output gathered); so does a row no column feeds."""
    order = list(linears)
    pairs = []
    for i, column in enumerate(order):
        if linears[column] != "column":
            continue
        parts = column.split(".")
        for depth in range(len(parts) - 1, max(len(parts) - 3, -1), -1):  # its parent, then grandparent
            prefix = ".".join(parts[:depth])
            inside = [p for p in order[i + 1:] if linears[p] == "row" and (not prefix or p.startswith(prefix + "."))]
            if inside:
                pairs.append((column, inside[0]))
                break
    return pairs


def tensor_parallel_style(module: nn.Module) -> str:
    """A layer's OpGraph `tp_style` from its markers: "transformer" when it holds both a column-
    and a row-parallel linear, experts cut by features or a gathered / split linear (a block
    tensor parallelism cuts; the runtime's `is_tensor_parallel_layer`), else "none"."""
    styles = {getattr(m, "plait_tp", None) for m in module.modules()}
    return "transformer" if {"column", "row"} <= styles or styles & set(TP_ALONE_ROLES) else "none"


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
    vocab = getattr(cfg, "vocab_size", None)
    return {**counts, "hidden": hidden, "ffn": ffn, "seq": int(seq), "head_dim": int(head_dim),
            **({"vocab": vocab} if isinstance(vocab, int) else {}),
            "activation": "swiglu" if act in ("silu", "swish") else act,
            "sdpa": getattr(cfg, "_attn_implementation", "sdpa") in ("sdpa", "flash_attention_2"),
            "causal": True}
