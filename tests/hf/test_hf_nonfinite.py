"""A non-finite K or V of a later token inside one chunk: kvquant's NaN pattern against the unpatched model.

A forward over a cached prefix with several new tokens (a chunked prefill's
second chunk, a speculative verification) attends causally: query row ``i``
does not see the keys of rows after it. In transformers' eager attention and in
SDPA on CPU (math and flash kernels, with the causal mask transformers passes) the masked
probabilities are exact zeros that still multiply the masked values, so a NaN
or inf in a later token's V makes the earlier rows NaN too (``0 * NaN``).
kvquant's torch path computes the same product over the dequantized pages, so a
patched model shows the same pattern of non-finite rows; the other sequences of
the batch stay finite and equal their clean values. The FP8 write stores a
non-finite K/V as the NaN code with every scale format (an inf is never
saturated into a plausible finite value), so an inf shows as NaN.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hf_steps import cache_kwarg, calibrate, returned_cache
from hf_tiny import build, prompt

import kvquant.integrations.hf as kvhf

PREFIX, CHUNK, POISONED_ROW = 8, 5, 3  # the chunk's row 3 (of 5) gets a non-finite K or V


@contextmanager
def _poison(model: Any, proj: str, value: float, active: list[bool]) -> Iterator[None]:
    """Set layer 0's ``proj`` output of sequence 0, chunk row ``POISONED_ROW``, while ``active[0]``."""

    def hook(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        if not active[0]:
            return out
        out = out.clone()
        out[0, POISONED_ROW] = value
        return out

    handle = getattr(model.model.layers[0].self_attn, proj).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def _run(model: Any, proj: str, value: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the chunk ``[B, CHUNK, V]`` and of one decode step after it ``[B, V]``."""
    ids, mask = prompt(batch=2, length=PREFIX + CHUNK, pad=(0, 2), seed=4)
    step = torch.randint(3, 128, (2, 1), generator=torch.Generator().manual_seed(6))
    key = cache_kwarg(model)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    active = [False]
    with _poison(model, proj, value if value is not None else 0.0, active):
        out = model(input_ids=ids[:, :PREFIX], attention_mask=mask[:, :PREFIX],
                    position_ids=pos[:, :PREFIX], use_cache=True)  # fmt: skip
        cache = returned_cache(out)
        active[0] = value is not None
        out = model(input_ids=ids[:, PREFIX:], attention_mask=mask, position_ids=pos[:, PREFIX:],
                    use_cache=True, **{key: cache})  # fmt: skip
        chunk = out.logits.float()
        active[0] = False
        full = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = model(input_ids=step, attention_mask=full, position_ids=pos[:, -1:] + 1,
                    use_cache=True, **{key: returned_cache(out)})  # fmt: skip
    return chunk, out.logits[:, -1].float()


@pytest.mark.parametrize("granularity", ["fp32-group", "per-tensor"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("proj", ["v_proj", "k_proj"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_later_token_pattern_matches_unpatched(
    impl: str, proj: str, value: float, granularity: str
) -> None:
    model = build("llama")
    model.set_attn_implementation(impl)
    ref_chunk, ref_step = _run(model, proj, value)
    # the unpatched model: every row of the poisoned sequence non-finite, rows before the
    # poisoned one included (0 x NaN); the other sequence untouched
    assert not torch.isfinite(ref_chunk[0]).any(-1).any()
    assert torch.isfinite(ref_chunk[1]).all() and torch.isfinite(ref_step[1]).all()
    scales = None
    if granularity != "fp32-group":
        ids, mask = prompt(batch=2, length=PREFIX + CHUNK, pad=(0, 2), seed=4)
        scales = calibrate(model, ids, mask, granularity)
    handle = kvhf.patch(
        model, scales=scales, scale_format=granularity, backend="torch", page_size=4
    )
    clean_chunk, clean_step = _run(model, proj, None)
    got_chunk, got_step = _run(model, proj, value)
    handle.remove()
    assert torch.equal(torch.isfinite(got_chunk), torch.isfinite(ref_chunk))
    assert torch.equal(torch.isfinite(got_step), torch.isfinite(ref_step))
    # the clean sequence sees exactly what it sees without the poison
    assert torch.equal(got_chunk[1], clean_chunk[1]) and torch.equal(got_step[1], clean_step[1])
