"""Shared helpers of the HF-integration tests: teacher-forced step logits and calibration."""

from __future__ import annotations

from typing import Any

import torch

from kvquant.integrations.hf.compat import cache_keyword as cache_kwarg


def returned_cache(out: Any) -> Any:
    """The cache a model output carries (name differs across versions)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def step_logits(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, cont: torch.Tensor, cache: Any = None
) -> tuple[torch.Tensor, Any]:
    """Prefill ``ids`` then feed ``cont`` [B, S] one token at a time.

    Returns:
        (logits of the last position at every step ``[B, S + 1, V]``, the cache).
    """
    key = cache_kwarg(model)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{key: cache}
    )
    cache = returned_cache(out)
    logits = [out.logits[:, -1].float()]
    for s in range(cont.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        pos = pos[:, -1:] + 1
        out = model(
            input_ids=cont[:, s : s + 1],
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            **{key: cache},
        )
        cache = returned_cache(out)
        logits.append(out.logits[:, -1].float())
    return torch.stack(logits, dim=1), cache


@torch.no_grad()
def calibrate(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, granularity: str
) -> dict[str, torch.Tensor]:
    """Static scales ``amax / 448`` of the post-RoPE K/V of the prompt, compressed-tensors names.

    Returns:
        ``{model.layers.N.self_attn.k_scale: [1] or [Hkv, 1, 1], ...}`` (fp32).
    """
    from transformers import DynamicCache

    key = cache_kwarg(model)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{key: cache})
    real = mask.bool()[:, None, :, None]  # [B, 1, T, 1]
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cache.layers):
        for kind, t in (("k", layer.keys), ("v", layer.values)):
            # sliding-window layers of a DynamicCache keep only the last tokens
            a = (t.float().abs() * real[:, :, -t.shape[2] :]).amax(dim=(0, 2, 3))  # [Hkv]
            s = a / 448.0
            s = s.amax().reshape(1) if granularity == "per-tensor" else s.reshape(-1, 1, 1)
            out[f"model.layers.{i}.self_attn.{kind}_scale"] = s
    return out


def min_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Smallest cosine similarity between matching rows of ``a`` and ``b`` [..., V]."""
    a2, b2 = a.reshape(-1, a.shape[-1]).double(), b.reshape(-1, b.shape[-1]).double()
    return float(torch.nn.functional.cosine_similarity(a2, b2, dim=-1).min())


def dense_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float,
    window: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact fp32 attention on dense K/V: query ``[B, Hq, Lq, D]``, K/V ``[B, Hkv, T, D]`` -> ``[B, Lq, Hq, D]``.

    ``mask``: boolean ``[B, 1, Lq, T]`` (True = attend) or an additive float mask, or None
    (causal over the newest ``Lq`` of ``T`` positions, plus the sliding ``window``);
    ``sinks``: ``[Hq]`` attention-sink logits, one more softmax term per head.
    """
    hq, hkv = query.shape[1], key.shape[1]
    if hq != hkv:
        key = key.repeat_interleave(hq // hkv, dim=1)
        value = value.repeat_interleave(hq // hkv, dim=1)
    dtype = query.dtype
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    lq, t = query.shape[2], key.shape[2]
    if mask is not None:
        visible = (mask if mask.dtype == torch.bool else mask == 0)[..., -t:]
    else:
        pos_q = torch.arange(t - lq, t, device=query.device)[:, None]
        cols = torch.arange(t, device=query.device)[None, :]
        visible = cols <= pos_q
        if window > 0:
            visible = visible & (cols > pos_q - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if sinks is not None:
        probs = probs[..., :-1]
    out = torch.matmul(probs, value.float())
    return out.transpose(1, 2).to(dtype)


def generate_exactly(model: Any, ids: torch.Tensor, mask: torch.Tensor, n: int, **kw: Any) -> Any:
    """Greedy ``generate`` of exactly ``n`` new tokens, with logits, as a dict output."""
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )


def assert_fp8_contents_match(got: torch.Tensor, want: torch.Tensor, max_vectors: int = 2) -> None:
    """Dequantized cache contents ``[B, Hkv, T, D]`` written from projections run at other shapes.

    CPU BLAS may round a projection of another batch composition or length differently in
    the last bit, and an element on an FP8 rounding boundary then lands one FP8 step away
    (at most 1/8 of the largest magnitude for e4m3's 3 mantissa bits). So at most
    ``max_vectors`` (row, head, position) vectors may differ, by no more than that step;
    a misplaced or stale token changes all ``D`` elements of a whole row's vectors.
    """
    assert got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    differing = int((diff > 1e-5).any(dim=-1).sum())  # full-precision buffers: rounding only
    assert differing <= max_vectors, f"{differing} (row, head, position) vectors differ"
    assert float(diff.max()) <= 2**-3 * float(want.float().abs().amax())
