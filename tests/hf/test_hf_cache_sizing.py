"""The cache holds memory in proportion to what it stores, and grows on demand.

A cache built without a size bound starts with the first update's tokens plus a
sixteenth (at least one page) per sequence and enlarges its pools when a
reservation needs more; a size bound (``max_cache_tokens``, ``num_pages``) is hard.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_steps import cache_kwarg, step_logits
from hf_steps import generate_exactly as _generate
from hf_tiny import build, prompt

import kvquant.integrations.hf as kvhf
from kvquant.cache import PageAllocator, PagedLayerStorage
from kvquant.errors import CacheCapacityError, CacheUsageError
from kvquant.integrations.hf.cache_layer import KVQuantCache


def _bf16_dynamic_cache_bytes(cache: Any) -> int:
    """Bytes of K/V a transformers ``DynamicCache`` of the same content holds in bf16."""
    total = 0
    for layer in cache.layers:
        total += 2 * layer.keys.numel() * 2
    return total


@pytest.mark.parametrize("page_size", [4, 16])
def test_short_batched_generate_holds_no_more_than_bf16(page_size: int) -> None:
    """The issue's target: FP8 pages <= the bf16 DynamicCache + one page per sequence and layer."""
    model = build("llama")
    ids, mask = prompt(batch=8, length=11, pad=(3, 0, 0, 5, 0, 0, 1, 0))
    ref = _generate(model, ids, mask, 5)
    dense_bytes = _bf16_dynamic_cache_bytes(ref.past_key_values)
    kvhf.patch(model, backend="torch", page_size=page_size)
    out = _generate(model, ids, mask, 5)
    cache = out.past_key_values
    assert isinstance(cache, KVQuantCache)
    assert torch.equal(out.sequences[:, :11], ids)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    page_bytes = page_size * cfg.num_key_value_heads * head_dim  # FP8: one byte per element
    allowance = 8 * cfg.num_hidden_layers * 2 * page_bytes  # one page / sequence / layer, K and V
    held = cache.memory_bytes()["pages"]
    assert held <= dense_bytes + allowance, (held, dense_bytes, allowance)


def test_pool_grows_during_decode_and_keeps_every_token() -> None:
    """A long decode from a short prompt grows the pools; logits equal a cache sized up front."""
    model = build("llama")
    ids, mask = prompt(batch=2, length=10, pad=(3, 0))
    cont = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(7))
    kvhf.patch(model, backend="torch", page_size=4)
    grown, cache = step_logits(model, ids, mask, cont)
    assert cache.growable and cache.capacity_version >= 1
    assert cache.allocator.num_pages >= 2 * -(-50 // 4)
    for layer in cache.layers:
        assert layer.storage.num_pages == cache.allocator.num_pages
    handle = kvhf.patch(model, backend="torch", page_size=4, num_pages=2 * 13)
    fixed, cache2 = step_logits(model, ids, mask, cont)
    assert not cache2.growable and cache2.capacity_version == 0
    # Same tokens in the same slots (page ids keep their meaning when a pool grows).
    assert torch.equal(grown, fixed)
    handle.remove()


@pytest.mark.parametrize("prefill_tokens", [None, 16])
def test_chunked_prefill_sizes_the_pools_for_the_whole_prompt_at_its_first_chunk(
    prefill_tokens: int | None,
) -> None:
    """A chunked prefill's first chunk sizes the pools for the whole prompt (its mask is a view
    of the whole prompt's): no chunk grows them, and no more pages than the need and a sixteenth.
    Also when the chunks run in row groups, which reserve the pages before the decoder runs."""
    model = build("llama")
    ids, mask = prompt(batch=2, length=60, pad=(9, 0))
    ref = _generate(model, ids, mask, 4)
    handle = kvhf.patch(model, backend="torch", page_size=4, prefill_tokens=prefill_tokens)
    out = _generate(model, ids, mask, 4, prefill_chunk_size=16)
    if prefill_tokens is not None:
        assert handle.state.row_groups.stats.split_calls == 4  # every chunk, one row at a time
    cache = out.past_key_values
    assert cache.get_seq_length() == 63
    assert cache.capacity_version == 0  # sized once, at the first chunk
    assert cache.allocator.num_pages == 2 * -(-(60 + 60 // 16) // 4)
    assert torch.equal(out.sequences[:, :60], ref.sequences[:, :60])


def test_explicit_bound_is_hard_and_failed_write_changes_nothing() -> None:
    model = build("llama")
    ids, mask = prompt(batch=2, length=10, pad=(0, 0))
    handle = kvhf.patch(model, backend="torch", page_size=4, max_cache_tokens=2 * 12)
    cache = handle.new_cache()
    key = cache_kwarg(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{key: cache})
        before = [layer.dense_kv(torch.float32) for layer in cache.layers]
        with pytest.raises(CacheCapacityError, match="max_cache_tokens"):
            model(input_ids=ids[:, :3], attention_mask=torch.ones(2, 13), **{key: cache})
    assert cache.get_seq_length() == 10 and cache.allocator.num_pages == 6
    for layer, (k, v) in zip(cache.layers, before, strict=True):
        k2, v2 = layer.dense_kv(torch.float32)
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_storage_grow_keeps_pages_and_scales() -> None:
    for gran, kw in (
        ("fp32-group", {"group_size": 8}),
        ("per-head", {"k_scale": torch.rand(2) + 0.5, "v_scale": torch.rand(2) + 0.5}),
    ):
        store = PagedLayerStorage(3, 4, 2, 16, granularity=gran, backend="torch", **kw)
        alloc = PageAllocator(3, 4)
        slots = alloc.reserve([0], 10)
        store.write(torch.randn(1, 10, 2, 16), torch.randn(1, 10, 2, 16), slots)
        bt = alloc.block_tables([0])
        k, v = store.dense(bt, 10)
        store.grow(7)
        alloc.grow(7)
        assert store.k_pages.shape[0] == 7 and store.v_pages.stride() == (
            2 * 16 * 4,
            1,
            16 * 4,
            4,
        )  # V stays keys-fastest
        k2, v2 = store.dense(bt, 10)
        assert torch.equal(k, k2) and torch.equal(v, v2)
        more = alloc.reserve([0], 9)  # needs the new pages
        assert int(more.max()) >= 3 * 4
        store.write(torch.randn(1, 9, 2, 16), torch.randn(1, 9, 2, 16), more)
        assert torch.isfinite(store.dense(alloc.block_tables([0]), 19)[0]).all()
        with pytest.raises(CacheUsageError, match="expected more"):
            store.grow(7)
        with pytest.raises(CacheUsageError, match="expected more"):
            alloc.grow(5)


def test_auto_cuda_graphs_stay_off_on_cpu() -> None:
    """The default ``cuda_graphs=None`` serves CPU models with the ordinary forward."""
    model = build("llama")
    ids, mask = prompt(batch=2, length=12, pad=(4, 0))
    handle = kvhf.patch(model, backend="torch", page_size=4)
    assert handle.state.options.cuda_graphs is None
    _generate(model, ids, mask, 6)
    stats = handle.state.graph_runner.stats
    assert (stats.static_eager, stats.replays, stats.captures) == (0, 0, 0)
    assert stats.ordinary == 6
    handle.remove()
    assert "forward" not in model.__dict__


def test_failed_growth_keeps_every_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """An allocation that fails while growing raises CacheCapacityError and changes nothing."""
    import kvquant.cache.storage.group as kvcache

    store = PagedLayerStorage(2, 4, 2, 16, granularity="fp32-group", backend="torch")
    alloc = PageAllocator(2, 4)
    slots = alloc.reserve([0], 6)
    store.write(torch.randn(1, 6, 2, 16), torch.randn(1, 6, 2, 16), slots)
    before = store.dense(alloc.block_tables([0]), 6)

    def no_memory(*args: object, **kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("test: no memory")

    monkeypatch.setattr(kvcache, "group_scale_storage", no_memory)
    with pytest.raises(CacheCapacityError, match="still holds every page"):
        store.grow(5)
    assert store.num_pages == 2 and store.k_pages.shape[0] == 2
    after = store.dense(alloc.block_tables([0]), 6)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_prefill_length_hint_reads_only_a_chunk_of_a_longer_mask() -> None:
    from kvquant.integrations.hf.routing import prefill_length_hint

    full = torch.ones(3, 50, dtype=torch.long)
    ids = torch.zeros(3, 16, dtype=torch.long)
    assert prefill_length_hint({"attention_mask": full[:, :16], "input_ids": ids}) == 50
    assert (
        prefill_length_hint({"attention_mask": full[:, :32], "inputs_embeds": ids[..., None]}) == 50
    )
    assert prefill_length_hint({"attention_mask": full, "input_ids": ids}) is None  # whole prompt
    one = torch.zeros(3, 1, dtype=torch.long)
    assert prefill_length_hint({"attention_mask": full[:, :16], "input_ids": one}) is None  # decode
    assert (
        prefill_length_hint({"attention_mask": full[:, 10:26], "input_ids": ids}) is None
    )  # not from column 0
    assert prefill_length_hint({"attention_mask": full[1:, :16], "input_ids": ids[1:]}) == 50
    assert prefill_length_hint({"attention_mask": full.t()[:16], "input_ids": ids}) is None
    assert prefill_length_hint({"attention_mask": None, "input_ids": ids}) is None


@pytest.mark.parametrize("scale_format", ["fp32-group", "per-head"])
def test_slot_bytes_and_headroom_follow_the_layers_schemes(scale_format: str) -> None:
    """Known before any pool exists, and equal to what the pools then hold per slot."""
    model = build("llama")
    cfg = model.config
    hkv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    scales = {
        f"model.layers.{i}.self_attn.{k}_scale": torch.full((hkv, 1, 1), 0.01)
        for i in range(cfg.num_hidden_layers)
        for k in "kv"
    }
    kvhf.patch(model, scales=scales, scale_format=scale_format, group_size=8, backend="torch")
    ids, mask = prompt(batch=2, length=6, pad=(1, 0))
    out = _generate(model, ids, mask, 2)
    cache = out.past_key_values
    held = cache.memory_bytes()
    slots = cache.allocator.num_pages * cache.page_size
    assert cache.slot_bytes() * slots == held["pages"] + held["group_scales"]
    fp8_slot = 2 * cfg.num_hidden_layers * hkv * d
    if scale_format == "fp32-group":  # one fp32 scale per 8 FP8 bytes: (1 + 4 / G) / 2 of bf16
        assert cache.slot_bytes() == fp8_slot * (1 + 4 / 8)
        assert cache.headroom_fraction() == pytest.approx(0.9 / ((1 + 4 / 8) / 2) - 1)
    else:
        assert cache.slot_bytes() == fp8_slot
        assert cache.headroom_fraction() == 0.5
