"""kvquant.patch on a tiny Llama: generate, remove, idempotence, isolation, padding, pages, errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_steps import cache_kwarg, step_logits
from hf_tiny import build, prompt

import kvquant.integrations.hf as kvhf
from kvquant.errors import (
    CacheCapacityError,
    KVQuantError,
    ScaleFormatError,
    UnsupportedModelError,
)
from kvquant.integrations.hf.cache_layer import KVQuantCache


def _gen(model: Any, ids: torch.Tensor, mask: torch.Tensor, n: int = 12, **kw: Any) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, **kw
        )


def _snapshot(model: Any) -> tuple[Any, ...]:
    """Everything patch may change: attention impl, hooks, buffers, attributes."""
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    buffers = sorted(name for name, _ in model.named_buffers())
    attrs = sorted(k for m in model.modules() for k in m.__dict__ if k.startswith("_kv"))
    return model.config._attn_implementation, hooks, tuple(buffers), tuple(attrs)


def test_generate_uses_fp8_cache_and_remove_restores(tiny_llama: Any) -> None:
    ids, mask = prompt()
    before = _snapshot(tiny_llama)
    ref = _gen(tiny_llama, ids, mask)
    handle = kvhf.patch(tiny_llama, backend="torch")
    assert tiny_llama.config._attn_implementation == "kvquant"
    out = _gen(tiny_llama, ids, mask, return_dict_in_generate=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert isinstance(cache, KVQuantCache)
    assert cache.layers[0].k_pages is not None
    assert cache.layers[0].k_pages.dtype == torch.float8_e4m3fn
    handle.remove()
    assert not handle.active
    assert _snapshot(tiny_llama) == before
    assert torch.equal(_gen(tiny_llama, ids, mask), ref)
    handle.remove()  # twice is harmless


def test_patch_is_idempotent(tiny_llama: Any) -> None:
    h1 = kvhf.patch(tiny_llama, backend="torch")
    snap = _snapshot(tiny_llama)
    h2 = kvhf.patch(tiny_llama, backend="torch")
    assert h2 is h1
    assert _snapshot(tiny_llama) == snap
    # Other options: re-patched in place (old patch removed, same number of hooks).
    h3 = kvhf.patch(tiny_llama, backend="torch", page_size=8)
    assert h3 is not h1 and not h1.active and h3.active
    assert _snapshot(tiny_llama) == snap
    h3.remove()
    assert tiny_llama.config._attn_implementation == "sdpa"


def test_two_models_do_not_interfere() -> None:
    a, b = build("llama", seed=0), build("llama", seed=1)
    ids, mask = prompt()
    ref_b = _gen(b, ids, mask)
    ha = kvhf.patch(a, backend="torch", page_size=4)
    assert b.config._attn_implementation == "sdpa"
    assert torch.equal(_gen(b, ids, mask), ref_b)
    hb = kvhf.patch(b, backend="torch", page_size=8)
    _gen(a, ids, mask)
    _gen(b, ids, mask)
    assert ha.state.options.page_size == 4 and hb.state.options.page_size == 8
    ha.remove()
    assert hb.active and b.config._attn_implementation == "kvquant"
    hb.remove()
    assert torch.equal(_gen(b, ids, mask), ref_b)


def test_left_padding_matches_unpadded_rows(tiny_llama: Any) -> None:
    """A left-padded row computes what the same prompt computes alone (teacher-forced steps)."""
    kvhf.patch(tiny_llama, backend="torch", page_size=4)
    ids, mask = prompt(batch=2, length=10, pad=(4, 0))
    cont = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    batched, _ = step_logits(tiny_llama, ids, mask, cont)
    alone, _ = step_logits(tiny_llama, ids[:1, 4:], mask[:1, 4:], cont[:1])
    # The two batches run the projections at other shapes, which CPU BLAS may round differently
    # in the last bit; FP8 rounding can amplify that. Measured here (logits ~0.5): 4-ulp
    # relative noise on the K/V projections' weights moves these logits by at most 4.1e-5 over
    # 20 draws; the two batches differ by 9e-8. Attending to the padding differs by 0.29.
    torch.testing.assert_close(batched[:1], alone, rtol=0, atol=1e-3)


def test_generation_crosses_pages_and_capacity_error(tiny_llama: Any) -> None:
    ids, mask = prompt(batch=2, length=10)
    kvhf.patch(tiny_llama, backend="torch", page_size=4, max_cache_tokens=2 * 24)
    out = _gen(tiny_llama, ids, mask, n=14, return_dict_in_generate=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert cache.get_seq_length() == 23  # the last token is not written
    assert cache.allocator.num_used_pages == 12  # 2 sequences x 6 pages of 4
    with pytest.raises(CacheCapacityError, match="max_cache_tokens"):
        _gen(tiny_llama, ids, mask, n=20)


def test_capacity_error_writes_nothing(tiny_llama: Any) -> None:
    handle = kvhf.patch(tiny_llama, backend="torch", page_size=4)
    cache = handle.new_cache(num_pages=4)
    ids, mask = prompt(batch=2, length=8, pad=(0, 0))
    key = cache_kwarg(tiny_llama)
    with torch.no_grad():
        tiny_llama(input_ids=ids, attention_mask=mask, **{key: cache})
        assert cache.get_seq_length() == 8
        with pytest.raises(CacheCapacityError, match="Nothing was written"):
            tiny_llama(
                input_ids=ids[:, :1],
                attention_mask=torch.ones(2, 9, dtype=torch.long),
                **{key: cache},
            )
    assert [layer.get_seq_length() for layer in cache.layers] == [8, 8]


def test_explicit_cache_object(tiny_llama: Any) -> None:
    ids, mask = prompt()
    handle = kvhf.patch(tiny_llama, backend="torch")
    auto = _gen(tiny_llama, ids, mask)
    cache = handle.new_cache(max_cache_tokens=64)
    explicit = _gen(tiny_llama, ids, mask, **{cache_kwarg(tiny_llama): cache})
    assert torch.equal(auto, explicit)
    assert cache.get_seq_length() == ids.shape[1] + 11
    with pytest.raises(KVQuantError, match="not patched"):
        KVQuantCache(build("llama"))


def test_sampling_and_beam_search(tiny_llama: Any) -> None:
    ids, mask = prompt()
    ref = _gen(tiny_llama, ids, mask, n=8, num_beams=3)
    kvhf.patch(tiny_llama, backend="torch", page_size=4)
    beams = _gen(tiny_llama, ids, mask, n=8, num_beams=3)
    assert beams.shape == ref.shape  # tokens may differ: FP8 can flip close beams
    assert torch.equal(beams[:, :10], ids)
    torch.manual_seed(0)
    with torch.no_grad():
        sampled = tiny_llama.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=20
        )
    assert sampled.shape == (2, 18)


def test_unsupported_generation_modes_raise(tiny_llama: Any) -> None:
    handle = kvhf.patch(tiny_llama, backend="torch")
    cache = handle.new_cache()
    for call in (lambda: cache.batch_repeat_interleave(2), lambda: cache.batch_select_indices(0)):
        with pytest.raises(KVQuantError, match="not supported"):
            call()


def test_bad_scales_rejected_before_any_change(tiny_llama: Any) -> None:
    before = _snapshot(tiny_llama)
    bad = {
        "model.layers.0.self_attn.k_scale": torch.tensor([float("nan")]),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.01]),
        "model.layers.1.self_attn.k_scale": torch.tensor([0.01]),
        "model.layers.1.self_attn.v_scale": torch.tensor([0.01]),
    }
    with pytest.raises(ScaleFormatError, match=r"layers\.0\.self_attn\.k_scale"):
        kvhf.patch(tiny_llama, scales=bad)
    wrong_shape = {k: torch.full((3,), 0.01) for k in bad}
    with pytest.raises(ScaleFormatError):
        kvhf.patch(tiny_llama, scales=wrong_shape)
    with pytest.raises(KVQuantError, match="page_size"):
        kvhf.patch(tiny_llama, page_size=0)
    assert _snapshot(tiny_llama) == before


def test_unsupported_family_is_named() -> None:
    import transformers

    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    model = transformers.GPT2LMHeadModel(cfg)
    with pytest.raises(UnsupportedModelError, match=r"gpt2.*Supported families"):
        kvhf.patch(model)
    assert not hasattr(model, "_kvquant_state")


def test_static_scales_installed_as_buffers(tiny_llama: Any) -> None:
    scales = {
        f"model.layers.{i}.self_attn.{k}_scale": torch.tensor([0.02 * (i + 1)])
        for i in range(2)
        for k in "kv"
    }
    handle = kvhf.patch(tiny_llama, scales=scales, backend="torch")
    attn = tiny_llama.model.layers[1].self_attn
    assert attn.k_scale.dtype == torch.float32 and attn.k_scale.shape == ()
    assert float(attn.k_scale) == pytest.approx(0.04)
    assert "model.layers.1.self_attn.k_scale" in tiny_llama.state_dict()
    handle.remove()
    assert not hasattr(attn, "k_scale")


def test_reorder_cache_moves_whole_sequences(tiny_llama: Any) -> None:
    handle = kvhf.patch(tiny_llama, backend="torch", page_size=4)
    cache = handle.new_cache()
    ids, mask = prompt(batch=3, length=9, pad=(0, 0, 0))
    with torch.no_grad():
        tiny_llama(input_ids=ids, attention_mask=mask, **{cache_kwarg(tiny_llama): cache})
    before = [layer.dense_kv(torch.float32) for layer in cache.layers]
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(beam_idx)
    for layer, (k, v) in zip(cache.layers, before, strict=True):
        k2, v2 = layer.dense_kv(torch.float32)
        assert torch.equal(k2, k[beam_idx]) and torch.equal(v2, v[beam_idx])


def test_chunked_prefill_equals_one_prefill(tiny_llama: Any) -> None:
    """A prompt fed in two chunks attends causally to the cached prefix plus itself.

    The first chunk has no prefix: it attends over its own unquantized K/V, exactly as one
    prefill does. The second reads the FP8 pages, so it matches within FP8 rounding.
    """
    kvhf.patch(tiny_llama, backend="torch", page_size=4)
    ids, mask = prompt(batch=2, length=13, pad=(5, 0))
    key = cache_kwarg(tiny_llama)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        one = tiny_llama(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        cache = None
        parts = []
        for lo, hi in ((0, 7), (7, 13)):
            out = tiny_llama(
                input_ids=ids[:, lo:hi],
                attention_mask=mask[:, :hi],
                position_ids=pos[:, lo:hi],
                **{key: cache},
            )
            cache = getattr(out, "cache", None) or out.past_key_values
            parts.append(out.logits)
    first, second = mask.clone().bool(), mask.clone().bool()
    first[:, 7:] = False
    second[:, :7] = False
    torch.testing.assert_close(parts[0][first[:, :7]], one[first], rtol=1e-5, atol=1e-5)
    got, want = parts[1][second[:, 7:]], one[second]
    assert not torch.equal(got, want)  # the FP8 pages were read
    cos = torch.nn.functional.cosine_similarity(got.float(), want.float(), dim=-1)
    assert float(cos.min()) > 0.999


def test_other_attention_gets_dense_kv_from_the_fp8_cache(tiny_llama: Any) -> None:
    """With kvquant's cache but another attention implementation, update() returns dense K/V."""
    handle = kvhf.patch(tiny_llama, backend="torch")
    ids, mask = prompt()
    fp8 = _gen(tiny_llama, ids, mask, n=6)
    tiny_llama.set_attn_implementation("sdpa")  # the cache hook stays: dense fallback
    dense = _gen(tiny_llama, ids, mask, n=6, return_dict_in_generate=True)
    cache = getattr(dense, "cache", None) or dense.past_key_values
    assert isinstance(cache, KVQuantCache)
    assert dense.sequences.shape == fp8.shape
    handle.remove()


def test_save_after_patch_and_patch_again(tiny_llama: Any, tmp_path: Any) -> None:
    import transformers

    scales = {
        f"model.layers.{i}.self_attn.{k}_scale": torch.full((2, 1, 1), 0.01 * (i + 1))
        for i in range(2)
        for k in "kv"
    }
    handle = kvhf.patch(tiny_llama, scales=scales, backend="torch")
    assert handle.state.layer_specs[0].granularity == "per-head"
    tiny_llama.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))  # scales dropped
    h2 = kvhf.patch(again, backend="torch")  # ... and found again in its folder
    for a, b in zip(handle.state.layer_specs, h2.state.layer_specs, strict=True):
        assert a.granularity == b.granularity
        assert torch.equal(a.k_scale, b.k_scale) and torch.equal(a.v_scale, b.v_scale)


def test_memory_bytes_counts_pages_and_scales(tiny_llama: Any) -> None:
    """KVQuantCache.memory_bytes: nothing before the first update, then every layer's pool."""
    handle = kvhf.patch(tiny_llama, backend="torch", page_size=4)
    cache = handle.new_cache(num_pages=5)
    assert cache.memory_bytes()["total"] == 0 and cache.layers[0].memory_bytes()["total"] == 0
    assert cache.layers[0].k_pages is None and cache.layers[0].device is None
    ids, mask = prompt(batch=2, length=6, pad=(0, 0))
    with torch.no_grad():
        tiny_llama(input_ids=ids, attention_mask=mask, **{cache_kwarg(tiny_llama): cache})
    slots, hkv, d = 5 * 4, 2, 16  # tiny Llama: 2 KV heads of 16; fp32-group with G = 16
    per_layer = {"pages": 2 * slots * hkv * d, "group_scales": 2 * slots * hkv * 4}
    # the default ring: 16 fp32 keys and values per sequence (2 sequences)
    per_layer |= {"recent": 2 * 2 * 16 * hkv * d * 4, "static_scales": 0, "k_transform": 0}
    per_layer["total"] = per_layer["pages"] + per_layer["group_scales"] + per_layer["recent"]
    assert [layer.memory_bytes() for layer in cache.layers] == [per_layer] * 2
    assert cache.memory_bytes() == {k: 2 * n for k, n in per_layer.items()}
    layer = cache.layers[1]
    assert layer.storage is not None and layer.k_pages is layer.storage.k_pages
    assert layer.k_group_scales is layer.storage.k_group_scales and layer.k_scale is None
    assert layer.device == torch.device("cpu")


def test_refused_mask_leaves_the_cache_as_it_was(tiny_llama: Any) -> None:
    handle = kvhf.patch(tiny_llama, backend="torch", page_size=4)
    cache = handle.new_cache()
    ids, mask = prompt(batch=2, length=8, pad=(0, 0))
    key = cache_kwarg(tiny_llama)
    step = torch.randint(3, 100, (2, 2), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        tiny_llama(input_ids=ids, attention_mask=mask, **{key: cache})
        hole = torch.ones(2, 10, dtype=torch.long)
        hole[1, 3] = 0  # not left padding
        with pytest.raises(UnsupportedModelError, match="left padding"):
            tiny_llama(input_ids=step, attention_mask=hole, **{key: cache})
        assert [layer.get_seq_length() for layer in cache.layers] == [8, 8]
        got = tiny_llama(
            input_ids=step, attention_mask=torch.ones(2, 10, dtype=torch.long), **{key: cache}
        ).logits
        fresh = handle.new_cache()
        tiny_llama(input_ids=ids, attention_mask=mask, **{key: fresh})
        want = tiny_llama(
            input_ids=step, attention_mask=torch.ones(2, 10, dtype=torch.long), **{key: fresh}
        ).logits
    assert torch.equal(got, want)
