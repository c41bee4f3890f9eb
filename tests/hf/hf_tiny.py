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


BUILDERS: dict[str, Callable[[], Any]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "phi3": _phi3,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
}


def build(family: str, seed: int = 0) -> Any:
    """A tiny random model of ``family`` in eval mode, fp32, sdpa attention."""
    torch.manual_seed(seed)
    model = BUILDERS[family]()
    model.eval()
    model.set_attn_implementation("eager" if family.startswith("gemma") else "sdpa")
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
