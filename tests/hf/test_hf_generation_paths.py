"""Caches a patched model's forward can get, forwards without a kvquant cache, rollback and crop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_steps import cache_kwarg, generate_exactly, min_cosine, returned_cache
from hf_tiny import VOCAB, build, prompt

import kvquant.integrations.hf as kvhf
from kvquant.errors import CacheUsageError, OptionError, UnsupportedModelError
from kvquant.integrations.hf.cache_layer import KVQuantCache, KVQuantLayer

transformers = pytest.importorskip("transformers")


@torch.no_grad()
def _manual_loop(model: Any, ids: torch.Tensor, mask: torch.Tensor, cache: Any, steps: int = 5):
    """Prefill, then ``steps`` greedy one-token calls that all pass the same ``cache`` object."""
    key = cache_kwarg(model)
    out = model(input_ids=ids, attention_mask=mask, **{key: cache})
    logits = [out.logits[:, -1].float()]
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        nxt = logits[-1].argmax(-1, keepdim=True)
        out = model(input_ids=nxt, attention_mask=mask, **{key: cache})
        logits.append(out.logits[:, -1].float())
    return torch.stack(logits, dim=1)


def test_users_dynamic_cache_keeps_its_context_across_calls() -> None:
    ids, mask = prompt(batch=2, length=10, pad=(3, 0))
    ref = _manual_loop(build("llama"), ids, mask, transformers.DynamicCache())
    model = build("llama")
    handle = kvhf.patch(model, backend="torch", page_size=4)
    user = transformers.DynamicCache(config=model.config)
    got = _manual_loop(model, ids, mask, user)
    assert isinstance(user, KVQuantCache)  # the user's own object now holds the FP8 context
    assert user.get_seq_length() == 10 + 5 and user.layers[0].k_pages is not None
    assert user.layers[0].k_pages.dtype == torch.float8_e4m3fn
    assert min_cosine(got, ref) > 0.999 and not torch.equal(got, ref)
    # A KVQuantCache the user builds works the same way, and so does the one a call returns.
    own = handle.new_cache()
    again = _manual_loop(model, ids, mask, own)
    assert torch.equal(again, got) and own.get_seq_length() == 15


def test_a_filled_bf16_cache_is_refused_before_anything_runs() -> None:
    ids, mask = prompt(batch=2, length=8, pad=(0, 0))
    model = build("llama")
    filled = transformers.DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{cache_kwarg(model): filled})
    keys = [layer.keys.clone() for layer in filled.layers]
    kvhf.patch(model, backend="torch")
    with pytest.raises(CacheUsageError, match=r"already holds 8 positions.*handle\.new_cache"):
        with torch.no_grad():
            model(input_ids=ids[:, :1], attention_mask=mask[:, :1], **{cache_kwarg(model): filled})
    assert type(filled) is transformers.DynamicCache
    assert all(torch.equal(a.keys, b) for a, b in zip(filled.layers, keys, strict=True))


def test_generate_with_a_users_empty_dynamic_cache_uses_fp8() -> None:
    ids, mask = prompt()
    model = build("llama")
    kvhf.patch(model, backend="torch", page_size=4)
    user = transformers.DynamicCache()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            **{cache_kwarg(model): user},
        )
    assert isinstance(user, KVQuantCache) and user.get_seq_length() == 10 + 5
    assert user.memory_bytes()["pages"] > 0
    assert out.shape == (2, 16)


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # sdpa and eager before the patch
def test_use_cache_false_is_exactly_the_unpatched_model(family: str) -> None:
    ids, mask = prompt(batch=2, length=10, pad=(3, 0))
    ref_model = build(family)
    model = build(family)
    kvhf.patch(model, backend="torch")
    seen: list[Any] = []
    hook = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw.get("cache", kw.get("past_key_values"))), with_kwargs=True
    )
    with torch.no_grad():
        want = ref_model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    hook.remove()
    assert seen == [None]  # no kvquant cache was built
    real = mask.bool()
    assert torch.equal(got[real], want[real])


def test_training_gradients_equal_the_unpatched_model() -> None:
    ids, mask = prompt(batch=2, length=10, pad=(3, 0))
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for patched in (False, True):
        model = build("llama")
        if patched:
            kvhf.patch(model, backend="torch")
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads.append(model.model.layers[0].self_attn.k_proj.weight.grad.clone())
        assert torch.isfinite(loss)
    assert torch.equal(grads[0], grads[1])


def test_gradients_through_a_kvquant_cache_are_refused() -> None:
    ids, mask = prompt(batch=2, length=8, pad=(0, 0))
    model = build("llama")
    handle = kvhf.patch(model, backend="torch")
    cache = handle.new_cache()
    with pytest.raises(UnsupportedModelError, match=r"gradients.*torch\.no_grad"):
        model(input_ids=ids, attention_mask=mask, **{cache_kwarg(model): cache})
    assert cache.get_seq_length() == 0 and cache.allocator is None


def test_output_attentions_refused_over_the_cache_and_exact_without() -> None:
    ids, mask = prompt(batch=2, length=8, pad=(2, 0))
    model = build("gemma2")  # eager: the unpatched model returns the weights
    ref = build("gemma2")
    handle = kvhf.patch(model, backend="torch")
    cache = handle.new_cache()
    with torch.no_grad():
        with pytest.raises(UnsupportedModelError, match="output_attentions"):
            model(
                input_ids=ids,
                attention_mask=mask,
                output_attentions=True,
                **{cache_kwarg(model): cache},
            )
        assert cache.get_seq_length() == 0
        user = transformers.DynamicCache()
        with pytest.raises(UnsupportedModelError, match="output_attentions"):
            model(
                input_ids=ids,
                attention_mask=mask,
                output_attentions=True,
                **{cache_kwarg(model): user},
            )
        assert type(user) is transformers.DynamicCache  # refused before it was converted
        got = model(input_ids=ids, attention_mask=mask, output_attentions=True, use_cache=False)
        want = ref(input_ids=ids, attention_mask=mask, output_attentions=True, use_cache=False)
    assert len(got.attentions) == 2
    for a, b in zip(got.attentions, want.attentions, strict=True):
        assert torch.equal(a[1], b[1])  # the unpadded row


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda m: transformers.StaticCache(config=m.config, max_cache_len=32), "StaticCache"),
        (lambda m: transformers.DynamicCache(offloading=True), "offloaded"),
    ],
)
def test_caches_kvquant_cannot_read_are_refused(make: Any, match: str) -> None:
    ids, mask = prompt()
    model = build("llama")
    kvhf.patch(model, backend="torch")
    with pytest.raises(CacheUsageError, match=match):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **{cache_kwarg(model): make(model)})


def _mixed_qwen2() -> Any:
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def test_a_forward_refused_by_one_layer_rolls_the_whole_cache_back() -> None:
    model = _mixed_qwen2()
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    handle = kvhf.patch(model, backend="torch", page_size=4)
    key = cache_kwarg(model)
    ids, mask = prompt(batch=2, length=8, pad=(0, 0))
    step = torch.randint(3, VOCAB, (2, 2), generator=torch.Generator().manual_seed(2))
    full = torch.ones(2, 10, dtype=torch.long)
    hole = full.clone()
    hole[1, 3] = 0  # not left padding: refused by a layer's mask check
    cache = handle.new_cache()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{key: cache})
        used = cache.allocator.num_used_pages  # type: ignore[union-attr]
        with pytest.raises(UnsupportedModelError, match="left padding"):
            model(input_ids=step, attention_mask=hole, **{key: cache})
        assert [layer.get_seq_length() for layer in cache.layers] == [8, 8]
        assert cache.allocator.num_used_pages == used  # type: ignore[union-attr]
        got = model(input_ids=step, attention_mask=full, **{key: cache}).logits
        fresh = handle.new_cache()
        model(input_ids=ids, attention_mask=mask, **{key: fresh})
        want = model(input_ids=step, attention_mask=full, **{key: fresh}).logits
    assert torch.equal(got, want)


def test_crop_rolls_back_lengths_and_frees_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build("llama")
    handle = kvhf.patch(model, backend="torch", page_size=4)
    key = cache_kwarg(model)
    ids, mask = prompt(batch=2, length=13, pad=(0, 0))
    written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the K/V each layer got
    update = KVQuantLayer.update

    def recording(layer: KVQuantLayer, k: torch.Tensor, v: torch.Tensor, *a: Any, **kw: Any):
        written.setdefault(layer.layer_idx, (k.clone(), v.clone()))
        return update(layer, k, v, *a, **kw)

    cache = handle.new_cache()
    with torch.no_grad(), monkeypatch.context() as m:
        m.setattr(KVQuantLayer, "update", recording)
        model(input_ids=ids, attention_mask=mask, **{key: cache})
    assert cache.allocator is not None and cache.allocator.num_used_pages == 2 * 4
    cache.crop(-5)  # 8 positions: 2 pages per sequence
    assert [layer.get_seq_length() for layer in cache.layers] == [8, 8]
    assert cache.allocator.num_used_pages == 2 * 2
    cache.crop(torch.tensor(-1))  # transformers 5.17 passes a 0-d tensor
    assert cache.get_seq_length() == 7
    # a positive count: what the installed transformers' DynamicCache.crop does with it
    dense = transformers.DynamicCache()
    dense.update(torch.zeros(1, 2, 7, 16), torch.zeros(1, 2, 7, 16), 0)
    try:
        dense.crop(6)
    except ValueError:  # transformers >= 5.18 refuses it
        with pytest.raises(CacheUsageError, match=r"positive value.*crop\(-1\) keeps 6"):
            cache.crop(6)
        assert cache.get_seq_length() == 7
        cache.crop(-1)
    else:  # transformers 5.17: "keep the first 6"
        assert dense.get_seq_length() == 6
        cache.crop(6)
    assert cache.get_seq_length() == 6 and cache.allocator.num_used_pages == 2 * 2
    cache.crop(0)
    assert cache.get_seq_length() == 6
    with pytest.raises(CacheUsageError, match="holds 6"):
        cache.crop(-7)
    with pytest.raises(CacheUsageError):
        cache.layers[0].crop(-1)
    assert cache.get_seq_length() == 6
    # The cropped cache holds exactly what a cache given only the first 6 of the same K/V holds
    # (same inputs, same per-token quantization: bit for bit), and continues the same way.
    rebuilt = handle.new_cache()
    for idx, (k, v) in written.items():
        rebuilt.update(k[:, :, :6], v[:, :, :6], idx)
    for a, b in zip(cache.layers, rebuilt.layers, strict=True):
        (ka, va), (kb, vb) = a.dense_kv(torch.float32), b.dense_kv(torch.float32)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    tail = ids[:, 6:9]
    with torch.no_grad():
        got = model(input_ids=tail, attention_mask=mask[:, :9], **{key: cache}).logits
        want = model(input_ids=tail, attention_mask=mask[:, :9], **{key: rebuilt}).logits
        fresh = handle.new_cache()  # a real 6-token prefill: its projections run at another shape
        model(input_ids=ids[:, :6], attention_mask=mask[:, :6], **{key: fresh})
        prefilled = model(input_ids=tail, attention_mask=mask[:, :9], **{key: fresh}).logits
    assert torch.equal(got, want)  # identical cache contents, identical shapes
    # CPU BLAS may round a 6-row and a 13-row projection differently, and a K/V element on an FP8
    # rounding boundary then lands one FP8 step apart. Measured here (logits ~0.5): relative
    # noise of 4 ulp (2**-21) on the K/V projections' weights moves these logits by at most
    # 2.4e-7 over 20 draws, 16-ulp noise on the cached K/V by 4.2e-7; a real 6-token prefill
    # differs by 9e-8. A wrong crop differs by 0.12 (one stale position kept) or 0.17 (position
    # 5 holding another token's K/V).
    torch.testing.assert_close(prefilled, got, atol=1e-4, rtol=0)


def test_disk_offloaded_layers_get_cpu_scale_buffers_and_save(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    build("llama").save_pretrained(tmp_path / "src")
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "src"), device_map=device_map, offload_folder=str(tmp_path / "offload")
    ).eval()
    assert model.model.layers[1].self_attn.k_proj.weight.device.type == "meta"
    ids, mask = prompt()
    kw: dict[str, Any] = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, **kw)
    scales = {
        f"model.layers.{i}.self_attn.{k}_scale": torch.tensor([0.02])
        for i in range(2)
        for k in "kv"
    }
    kvhf.patch(model, scales=scales, backend="torch")
    attn = model.model.layers[1].self_attn
    assert attn.k_scale.device.type == "cpu" and float(attn.k_scale) == pytest.approx(0.02)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **kw)
    assert isinstance(returned_cache(out), KVQuantCache)
    assert out.sequences.shape == ref.shape
    model.save_pretrained(tmp_path / "saved")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        assert float(f.get_tensor("model.layers.1.self_attn.k_scale")) == pytest.approx(0.02)
        assert "model.layers.1.self_attn.k_proj.weight" in f.keys()


def test_patch_and_cache_refuse_bad_sizes_and_beam_indices() -> None:
    model = build("llama")
    for bad in (2**40, 0, 2.0):
        with pytest.raises(OptionError, match="page_size"):
            kvhf.patch(model, page_size=bad)  # type: ignore[arg-type]
    assert not hasattr(model, "_kvquant_state")
    handle = kvhf.patch(model, backend="torch", page_size=4)
    with pytest.raises(CacheUsageError, match="page_size"):
        handle.new_cache(page_size=2**20)
    cache = handle.new_cache()
    ids, mask = prompt(batch=3, length=6, pad=(0, 0, 0))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{cache_kwarg(model): cache})
    before = [layer.dense_kv(torch.float32) for layer in cache.layers]
    for beam_idx in (
        torch.tensor([3, 0, 0]),
        torch.tensor([-1, 0, 0]),
        torch.tensor([0.0, 1.0, 2.0]),
        torch.tensor([0, 1]),
        [0, 1, 2],
    ):
        with pytest.raises(CacheUsageError, match="beam_idx"):
            cache.reorder_cache(beam_idx)  # type: ignore[arg-type]
    for layer, (k, v) in zip(cache.layers, before, strict=True):
        k2, v2 = layer.dense_kv(torch.float32)
        assert torch.equal(k2, k) and torch.equal(v2, v)


def test_an_unknown_previous_attention_falls_back_to_eager() -> None:
    """A model whose attention was kvquant's from the start (no previous one) runs eager attention."""
    from kvquant.integrations.hf import attention as kvattn

    ids, mask = prompt(batch=2, length=10, pad=(3, 0))
    ref = build("llama")
    model = build("llama")
    kvhf.patch(model, backend="torch")
    for layer in model.model.layers:
        layer.self_attn.__dict__[kvattn.FALLBACK_ATTR] = "kvquant"  # would recurse into itself
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_assisted_decoding_rejects_and_accepts_drafts_like_the_unpatched_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids, mask = prompt(batch=1, length=10, pad=(0,))
    kw: dict[str, Any] = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    with torch.no_grad():
        want = build("llama").generate(input_ids=ids, attention_mask=mask, **kw)
    model = build("llama")
    kvhf.patch(model, backend="torch", page_size=4)
    crops: list[tuple[int, int]] = []
    crop = KVQuantCache.crop

    def counted(self: KVQuantCache, n: int) -> None:
        crops.append((self.get_seq_length(), int(n)))
        crop(self, n)

    monkeypatch.setattr(KVQuantCache, "crop", counted)
    with torch.no_grad():
        got = model.generate(
            input_ids=ids, attention_mask=mask, assistant_model=build("llama", seed=7), **kw
        )
    assert torch.equal(got, want)
    assert any(n < 0 for _, n in crops)  # a rejected draft was rolled back
    assert any(n == 0 for _, n in crops)  # and a fully accepted one kept


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("pad", [(9, 0, 5), (4, 13, 0)])
def test_chunked_prefill_with_padding_spanning_whole_chunks(
    backend: str, pad: tuple[int, ...]
) -> None:
    """A left-padded batch whose padding fills whole prefill chunks for some rows (9 and 13 of
    14 positions with chunks of 4): such a chunk has no real query for those rows. The unpatched
    model runs it; so does kvquant: the logits after the chunked prefill match the unpatched
    model's within FP8 rounding (min cosine over the rows, measured: 0.9998 with the torch
    backend, 0.997 with Triton's interpreter; real rows attending to the padding, from position
    0, measured 0.34 to 0.51), and decoding goes on."""
    # Triton runs compiled on a GPU, in its interpreter on CPU
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    ids, mask = (t.to(device) for t in prompt(batch=3, length=14, pad=pad))
    ref = generate_exactly(build("llama").to(device), ids, mask, 1, prefill_chunk_size=4)
    model = build("llama").to(device)
    kvhf.patch(model, backend=backend, page_size=4)
    got = generate_exactly(model, ids, mask, 1, prefill_chunk_size=4)
    assert bool(torch.isfinite(got.logits[0]).all())
    assert min_cosine(got.logits[0], ref.logits[0]) > 0.99
    assert torch.equal(got.sequences, ref.sequences)
    more = generate_exactly(model, ids, mask, 4, prefill_chunk_size=4)
    assert bool(torch.isfinite(torch.stack(more.logits)).all())
    assert torch.equal(more.sequences[:, :15], got.sequences)


@pytest.mark.parametrize("reuse", ["generate", "forward"])
def test_a_cache_of_a_removed_patch_is_refused(reuse: str) -> None:
    """A cache returned by generate and reused after handle.remove() would run the unpatched
    model over FP8 pages with no error; it is refused like a foreign cache, nothing written."""
    ids, mask = prompt(batch=2, length=8, pad=(2, 0))
    model = build("llama")
    handle = kvhf.patch(model, backend="torch", page_size=4)
    out = generate_exactly(model, ids, mask, 3)
    cache = returned_cache(out)
    assert isinstance(cache, KVQuantCache)
    handle.remove()
    before = cache.get_seq_length()
    longer = torch.cat([out.sequences, out.sequences[:, -1:]], dim=1)
    full = torch.ones_like(longer)
    full[:, :2] = mask[:, :2]
    with pytest.raises(CacheUsageError, match=r"removed \(handle\.remove\(\)\).*Nothing was"):
        with torch.no_grad():
            if reuse == "generate":
                model.generate(
                    input_ids=longer,
                    attention_mask=full,
                    max_new_tokens=2,
                    do_sample=False,
                    **{cache_kwarg(model): cache},
                )
            else:
                model(input_ids=longer[:, -1:], attention_mask=full, **{cache_kwarg(model): cache})
    assert cache.get_seq_length() == before
    # a new patch's caches work; the old one stays refused (another patch's cache)
    handle = kvhf.patch(model, backend="torch", page_size=4)
    with pytest.raises(CacheUsageError):
        with torch.no_grad():
            model(input_ids=longer[:, -1:], attention_mask=full, **{cache_kwarg(model): cache})
    generate_exactly(model, ids, mask, 2, **{cache_kwarg(model): handle.new_cache()})


def test_keys_of_a_paged_layer_name_the_dequantizing_call() -> None:
    """transformers code reads layer.keys / .values; a paged layer has no dense tensors: None
    before the first update (as DynamicLayer), then a clear error naming dense_kv()."""
    ids, mask = prompt(batch=2, length=8, pad=(0, 0))
    model = build("llama")
    handle = kvhf.patch(model, backend="torch", page_size=4)
    cache = handle.new_cache()
    assert cache.layers[0].keys is None and cache.layers[0].values is None
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{cache_kwarg(model): cache})
    for name in ("keys", "values"):
        with pytest.raises(CacheUsageError, match=r"no dense .*dense_kv\(torch\.bfloat16\)"):
            getattr(cache.layers[1], name)
    k, v = cache.layers[1].dense_kv(torch.float32)
    assert k.shape == v.shape == (2, 2, 8, 16)
    with pytest.raises(CacheUsageError, match="write K/V through update"):
        cache.layers[0].keys = torch.zeros(2, 2, 8, 16)
