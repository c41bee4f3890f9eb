"""Tiny random transformers models for the HF-integration tests (built from configs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 128
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _llama() -> Any:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON))


def _mistral() -> Any:
    return transformers.MistralForCausalLM(transformers.MistralConfig(**_COMMON, sliding_window=16))


def _qwen2() -> Any:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_COMMON))


def _qwen3() -> Any:
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_COMMON, head_dim=16))


def _phi3() -> Any:
    cfg = transformers.Phi3Config(**_COMMON, sliding_window=None, pad_token_id=0)
    return transformers.Phi3ForCausalLM(cfg)


def _gemma2() -> Any:
    cfg = transformers.Gemma2Config(
        **_COMMON,
        head_dim=16,
        sliding_window=16,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=20.0,
        final_logit_softcapping=None,
    )
    return transformers.Gemma2ForCausalLM(cfg)


def _gemma3() -> Any:
    cfg = transformers.Gemma3TextConfig(
        **_COMMON, head_dim=16, sliding_window=16, query_pre_attn_scalar=16
    )
    return transformers.Gemma3ForCausalLM(cfg)


_IDS: dict[str, Any] = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside VOCAB


def _granite() -> Any:
    cfg = transformers.GraniteConfig(
        **_COMMON,
        **_IDS,
        attention_multiplier=0.2,
        residual_multiplier=0.5,
        embedding_multiplier=2.0,
        logits_scaling=2.0,
    )
    return transformers.GraniteForCausalLM(cfg)


def _cohere2() -> Any:
    cfg = transformers.Cohere2Config(
        **_COMMON, **_IDS, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    )
    return transformers.Cohere2ForCausalLM(cfg)


def _mixtral() -> Any:
    cfg = transformers.MixtralConfig(
        **_COMMON, **_IDS, num_local_experts=4, num_experts_per_tok=2, sliding_window=6
    )
    return transformers.MixtralForCausalLM(cfg)


def _starcoder2() -> Any:
    cfg = transformers.Starcoder2Config(**_COMMON, **_IDS, sliding_window=6)
    return transformers.Starcoder2ForCausalLM(cfg)


def _smollm3() -> Any:
    cfg = transformers.SmolLM3Config(**_COMMON, **_IDS, no_rope_layer_interval=2)
    return transformers.SmolLM3ForCausalLM(cfg)


def _gemma() -> Any:
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(**_COMMON, **_IDS, head_dim=16))


def _phi() -> Any:
    cfg = transformers.PhiConfig(**_COMMON, **_IDS, partial_rotary_factor=0.5)
    return transformers.PhiForCausalLM(cfg)


def _qwen3_moe() -> Any:
    cfg = transformers.Qwen3MoeConfig(
        **_COMMON,
        **_IDS,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    return transformers.Qwen3MoeForCausalLM(cfg)


def _olmo2() -> Any:
    return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**_COMMON, **_IDS))


def _olmo3() -> Any:
    cfg = transformers.Olmo3Config(
        **_COMMON, **_IDS, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    )
    return transformers.Olmo3ForCausalLM(cfg)


def _gpt_oss() -> Any:
    cfg = transformers.GptOssConfig(
        **_COMMON,
        **_IDS,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():  # sinks large enough to matter (the random init is tiny)
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def _gemma4(**overrides: Any) -> Any:
    """Gemma 4 text: its full-attention layer has another head_dim and KV-head count.

    ``global_head_dim`` and ``num_global_key_value_heads`` are transformers' own
    config options (a heterogeneous ``per_layer_config``); with
    ``attention_k_eq_v`` that layer reuses K as V.
    """
    cfg = transformers.Gemma4TextConfig(
        **{
            **_COMMON,
            **_IDS,
            "head_dim": 16,
            "global_head_dim": 32,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
            "vocab_size_per_layer_input": VOCAB,
            "hidden_size_per_layer_input": 8,
            **overrides,
        }
    )
    return transformers.Gemma4ForCausalLM(cfg)


BUILDERS: dict[str, Callable[[], Any]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "phi3": _phi3,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
}
"""The families every granularity and the CUDA-graph step are tested on."""

MORE_BUILDERS: dict[str, Callable[[], Any]] = {
    "granite": _granite,
    "cohere2": _cohere2,
    "mixtral": _mixtral,
    "starcoder2": _starcoder2,
    "smollm3": _smollm3,
    "gemma": _gemma,
    "phi": _phi,
    "qwen3_moe": _qwen3_moe,
    "olmo2": _olmo2,
    "olmo3": _olmo3,
    "gpt_oss": _gpt_oss,
    "gemma4_text": _gemma4,
}
"""Further supported families, tested once each (the default fp32-group scales)."""

ALL_BUILDERS: dict[str, Callable[[], Any]] = {**BUILDERS, **MORE_BUILDERS}


def build(family: str, seed: int = 0) -> Any:
    """A tiny random model of ``family`` in eval mode, fp32, sdpa attention."""
    torch.manual_seed(seed)
    model = ALL_BUILDERS[family]()
    model.eval()
    eager = family.startswith("gemma") or family == "gpt_oss"  # gpt-oss: sinks need eager
    model.set_attn_implementation("eager" if eager else "sdpa")
    return model


def prompt(batch: int = 2, length: int = 10, pad: tuple[int, ...] = (3,), seed: int = 1):
    """Random ``input_ids`` [B, L] and a left-padded ``attention_mask`` [B, L]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for b, p in enumerate(pad[:batch]):
        mask[b, :p] = 0
        ids[b, :p] = 0
    return ids, mask


def tokenizer() -> Any:
    """A character-level fast tokenizer over the tiny models' 128 ids, with a chat template.

    Ids 0-2 are ``<pad>``, ``<s>``, ``</s>``, 3 is a newline, 4.. are the printable
    characters from the space on; it pads on the left (for batched generation).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "\n": 3}
    for code in range(32, 32 + VOCAB - len(vocab)):
        vocab[chr(code)] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        padding_side="left",
    )
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return tok
