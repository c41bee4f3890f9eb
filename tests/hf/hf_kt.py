"""Tiny models and scales for the k-transform tests of the HF integration."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_steps import cache_kwarg
from hf_tiny import _COMMON, prompt

from kvquant.checkpoint.producers import KV_TRANSFORM_FILE, kv_transform_config
from kvquant.kernels import hadamard

transformers = pytest.importorskip("transformers")

HKV, D = 2, 16


def biased_llama(seed: int = 0, head_dim: int | None = None) -> Any:
    """A tiny fp32 Llama (of ``head_dim``, or the tiny default) whose k_proj has a large bias
    (keys with near-constant channels)."""
    torch.manual_seed(seed)
    dims = {} if head_dim is None else {"head_dim": head_dim}
    cfg = transformers.LlamaConfig(**_COMMON, **dims, attention_bias=True)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.normal_(0.0, 4.0)
    model.eval()
    model.set_attn_implementation("sdpa")
    return model


@torch.no_grad()
def unpatched_kv(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> list[Any]:
    """The unpatched model's post-RoPE K/V per layer, ``[B, Hkv, T, D]`` (fp32, on the CPU)."""
    cache = transformers.DynamicCache(config=model.config)
    ids, mask = ids.to(model.device), mask.to(model.device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    model(input_ids=ids, attention_mask=mask, position_ids=pos, **{cache_kwarg(model): cache})
    return [(layer.keys.float().cpu(), layer.values.float().cpu()) for layer in cache.layers]


def k_transform_scales(
    model: Any, rotation: str | None = "hadamard", first_tokens: int = 1
) -> dict[str, Any]:
    """A ``scales=`` mapping in kvquant's k-transform convention, calibrated on its own prompt
    (for the model's head_dim)."""
    ids, mask = prompt(batch=2, length=24, pad=(0, 0), seed=11)
    d = int(model.config.head_dim)
    rot = hadamard(d) if rotation == "hadamard" else torch.eye(d)
    out: dict[str, Any] = {}
    for i, (k, v) in enumerate(unpatched_kv(model, ids, mask)):
        k = (k.transpose(1, 2) @ rot)[:, first_tokens:]  # [B, T, Hkv, D], sink tokens apart
        offset = k.mean(dim=(0, 1))
        out[f"model.layers.{i}.self_attn.k_scale"] = (k - offset).abs().amax((0, 1, 3)) / 448 * 1.25
        out[f"model.layers.{i}.self_attn.v_scale"] = v.abs().amax((0, 2, 3)) / 448 * 1.25
        out[f"model.layers.{i}.self_attn.k_offset"] = offset
    out[KV_TRANSFORM_FILE] = kv_transform_config(
        rotation=rotation, first_tokens=first_tokens, head_dim=d, num_kv_heads=HKV, num_layers=2
    )
    return out
