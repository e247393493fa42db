"""Hugging Face `transformers` models for plait, built from configs with random weights (nothing is
downloaded): `--model examples/models/hf.py:llama` (tiny) or `...:llama_1b` (realistic size).

Each factory returns `(module, sample_batch)`: the model as transformers builds it -- no wrapper,
its `ModelOutput` is used as it is (`.logits` against the target) -- and a function that makes
`(inputs, target)` for a batch. Dropout is off (`*_dropout=0.0`) so that plans train equal to one
process; leave the configs' defaults to train with dropout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

SEQ = 32  # tokens per sample of the tiny models
VOCAB = 128


def _tokens(batch: int, seq: int, vocab: int, seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)


def _causal(make: Any, seq: int, vocab: int) -> tuple[Any, Any]:
    """A decoder LM: inputs are the tokens, the target the next tokens."""

    def sample_batch(batch: int, device: str = "cpu", seed: int = 0) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        t = _tokens(batch, seq, vocab, seed, device)
        return (t[:, :-1],), t[:, 1:]

    return make, sample_batch


def _tiny_decoder(cls_name: str, **extra: Any) -> tuple[Any, Any]:
    import transformers

    cfg_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                  **extra)
    model_cls = getattr(transformers, cls_name)
    return _causal(lambda: model_cls(cfg), SEQ, VOCAB)


def llama() -> tuple[Any, Any]:
    return _tiny_decoder("LlamaForCausalLM")


def mixtral() -> tuple[Any, Any]:
    return _tiny_decoder("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2)


def qwen2_moe() -> tuple[Any, Any]:
    return _tiny_decoder("Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=64, shared_expert_intermediate_size=128)


def qwen3() -> tuple[Any, Any]:
    """Qwen3: per-head RMSNorms of q and k (`q_norm`, `k_norm`) inside the attention its plan cuts."""
    return _tiny_decoder("Qwen3ForCausalLM", head_dim=16)


def olmoe() -> tuple[Any, Any]:
    """OLMoE: its plan cuts the experts only (its attention normalises q and k over all heads, so
    the plan gathers their outputs, which plait leaves whole)."""
    return _tiny_decoder("OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2)


def phi3() -> tuple[Any, Any]:
    """Phi-3: fused [q | k | v] and [gate | up] projections, which its plan gathers
    (`colwise_gather_output`, `rowwise_split_input`)."""
    return _tiny_decoder("Phi3ForCausalLM", pad_token_id=0)


def gpt2() -> tuple[Any, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=64, n_layer=4, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)  # inside the tiny vocabulary
    return _causal(lambda: GPT2LMHeadModel(cfg), SEQ, VOCAB)


def _bert(cfg: Any, seq: int) -> tuple[Any, Any]:
    from transformers import BertForSequenceClassification

    def sample_batch(batch: int, device: str = "cpu", seed: int = 0) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[:, seq - seq // 4:] = 0  # the last quarter is padding: the mask is real
        y = torch.randint(0, cfg.num_labels, (batch,), generator=gen)
        return (ids.to(device), mask.to(device)), y.to(device)

    return lambda: BertForSequenceClassification(cfg), sample_batch


def bert() -> tuple[Any, Any]:
    from transformers import BertConfig

    return _bert(BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                            intermediate_size=128, max_position_embeddings=2 * SEQ, num_labels=3,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), SEQ)


def _t5(cfg: Any, seq: int) -> tuple[Any, Any]:
    from transformers import T5ForConditionalGeneration

    def sample_batch(batch: int, device: str = "cpu", seed: int = 0) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        src = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
        tgt = torch.randint(0, cfg.vocab_size, (batch, seq // 2 + 1), generator=gen)
        mask = torch.ones(batch, seq, dtype=torch.long)
        # forward(input_ids, attention_mask, decoder_input_ids): teacher forcing on the target
        return (src.to(device), mask.to(device), tgt[:, :-1].to(device)), tgt[:, 1:].to(device)

    return lambda: T5ForConditionalGeneration(cfg), sample_batch


def t5() -> tuple[Any, Any]:
    from transformers import T5Config

    return _t5(T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=6, num_decoder_layers=6,
                        num_heads=4, dropout_rate=0.0), SEQ)


# Realistic sizes (for `simulate` / `plan`; capture runs on fake tensors, nothing is allocated).
def llama_1b() -> tuple[Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
    return _causal(lambda: LlamaForCausalLM(cfg), 2048, 32000)


def gpt2_xl() -> tuple[Any, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_positions=1024, n_embd=1600, n_layer=48, n_head=25)
    return _causal(lambda: GPT2LMHeadModel(cfg), 1024, cfg.vocab_size)


def mixtral_1b() -> tuple[Any, Any]:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
                        num_experts_per_tok=2, max_position_embeddings=2048)
    return _causal(lambda: MixtralForCausalLM(cfg), 2048, 32000)


def qwen2_moe_1b() -> tuple[Any, Any]:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                         num_attention_heads=16, num_key_value_heads=16, num_experts=16, num_experts_per_tok=4,
                         moe_intermediate_size=704, shared_expert_intermediate_size=2816,
                         max_position_embeddings=2048)
    return _causal(lambda: Qwen2MoeForCausalLM(cfg), 2048, 32000)


def bert_large() -> tuple[Any, Any]:
    from transformers import BertConfig

    return _bert(BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                            intermediate_size=4096, num_labels=2), 512)


def t5_base() -> tuple[Any, Any]:
    from transformers import T5Config

    return _t5(T5Config(d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12), 512)


__all__ = [n for n, v in list(globals().items()) if callable(v) and not n.startswith("_") and n != "annotations"]
_ = nn  # the factories return nn.Modules
