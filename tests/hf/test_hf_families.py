"""Patched vs unpatched logits at every decode step, for every supported family and granularity."""

from __future__ import annotations

import pytest
import torch
from hf_steps import calibrate, min_cosine, step_logits
from hf_tiny import BUILDERS, build, prompt

import kvquant.integrations.hf as kvhf
from kvquant.integrations.hf.cache_layer import KVQuantCache


@pytest.mark.parametrize("granularity", ["per-tensor", "per-head", "fp32-group"])
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_logits_match_every_step(family: str, granularity: str) -> None:
    model = build(family)
    ids, mask = prompt(batch=2, length=10, pad=(3, 0))
    cont = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    ref, _ = step_logits(model, ids, mask, cont, cache=None)
    scales = None if granularity == "fp32-group" else calibrate(model, ids, mask, granularity)
    handle = kvhf.patch(
        model, scales=scales, scale_format=granularity, backend="torch", page_size=4
    )
    assert {s.granularity for s in handle.state.layer_specs} == {granularity}
    got, cache = step_logits(model, ids, mask, cont, cache=None)
    assert isinstance(cache, KVQuantCache)
    assert cache.get_seq_length() == 10 + 12  # left-padding slots are counted, like DynamicLayer
    assert torch.isfinite(got).all()
    cos = min_cosine(got, ref)
    # Random tiny Gemma models amplify FP8 rounding itself: plain simulated rounding of the same
    # K/V (no kvquant) gives 0.9968 / 0.9973 with fp32-group scales, and kvquant matches that
    # simulation (test_gemma_equals_simulated_rounding); measured 0.985-0.998 over granularities.
    floor = 0.98 if family.startswith("gemma") else 0.999
    assert cos >= floor, f"{family}/{granularity}: min cosine {cos:.5f}"
    # The FP8 path is really taken: logits are close but not bit-identical.
    assert not torch.equal(got, ref)
    handle.remove()
    again, _ = step_logits(model, ids, mask, cont, cache=None)
    assert torch.equal(again, ref)


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_attention_is_exact_on_dequantized_cache(family: str) -> None:
    """Every kvquant attention call equals exact attention on the dequantized pages + HF's mask."""
    from transformers import AttentionInterface

    from kvquant.integrations.hf import attention as kvattn

    errors: list[float] = []

    def checked(module, query, key, value, attention_mask, **kw):  # type: ignore[no-untyped-def]
        out, _ = kvattn.kvquant_attention(module, query, key, value, attention_mask, **kw)
        layer = kvattn._layer_of(module)
        assert layer is not None
        k, v = layer.dense_kv(torch.float32)
        dense = kvattn._dense_attention(
            module,
            query,
            k,
            v,
            attention_mask,
            float(kw["scaling"]),
            float(kw.get("softcap") or 0.0),
            int(kw.get("sliding_window") or 0),
        )
        errors.append(float((out.float() - dense.float()).abs().max()))
        return out, None

    model = build(family)
    ids, mask = prompt(batch=2, length=10, pad=(3, 0))
    cont = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(5))
    kvhf.patch(model, backend="torch", page_size=4)
    AttentionInterface.register("kvquant", checked)
    try:
        step_logits(model, ids, mask, cont, cache=None)
    finally:
        kvattn.register()
    assert len(errors) == 2 * 9  # 2 layers x (prefill + 8 decode steps)
    assert max(errors) < 1e-5


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_equals_simulated_rounding(family: str) -> None:
    """kvquant's Gemma logits equal those of simulated FP8 rounding on HF's own eager path.

    The simulation rounds the K/V that HF's eager attention receives through FP8 with dynamic
    per-token scales (``benchmarks.harness.accuracy.fake_quantize_kv``); kvquant must land on the same logits,
    which shows the cosine gap to unquantized logits is rounding, not a kvquant error.
    """
    import importlib

    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    from benchmarks.harness.accuracy import fake_quantize_kv

    module = importlib.import_module(f"transformers.models.{family[:6]}.modeling_{family[:6]}")
    eager = module.eager_attention_forward

    def simulated(mod, query, key, value, attention_mask, **kw):  # type: ignore[no-untyped-def]
        d = key.shape[-1]
        key = fake_quantize_kv(key.float(), None, group_size=d).to(key.dtype)
        value = fake_quantize_kv(value.float(), None, group_size=d).to(value.dtype)
        return eager(mod, query, key, value, attention_mask, **kw)

    ids, mask = prompt(batch=2, length=10, pad=(3, 0))
    cont = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    model = build(family)
    ref, _ = step_logits(model, ids, mask, cont, cache=None)
    AttentionInterface.register("kvquant_test_simulated", simulated)
    AttentionMaskInterface.register("kvquant_test_simulated", eager_mask)
    model.set_attn_implementation("kvquant_test_simulated")
    sim, _ = step_logits(model, ids, mask, cont, cache=None)
    model.set_attn_implementation("eager")
    handle = kvhf.patch(
        model, scales=None, scale_format="fp32-group", group_size=16, backend="torch", page_size=4
    )
    got, _ = step_logits(model, ids, mask, cont, cache=None)
    handle.remove()
    assert min_cosine(got, sim) >= 0.99999
    assert min_cosine(sim, ref) < 0.999  # the gap is there without kvquant
