"""KVQuantCache's cached block tables and decode slots stay right (page boundaries, reset, beams)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvquant.integrations.hf as kvhf
from kvquant.errors import CacheCapacityError
from kvquant.integrations.hf.cache_layer import KVQuantCache
from kvquant.kernels import compute_slot_mapping
from kvquant.schemes import GroupScales, Pages

HKV, D = 2, 16  # tiny Llama: 2 KV heads, head_dim 64 / 4


def _cache(model: Any, page_size: int = 4, **kw: Any) -> KVQuantCache:
    handle = kvhf.patch(model, backend="torch", page_size=page_size)
    return handle.new_cache(**kw)


def _step(cache: KVQuantCache, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Update every layer with ``k``/``v`` ``[B, Hkv, L, D]``; return the slot mapping they used."""
    slots = None
    for layer in cache.layers:
        start = layer.seq_len
        layer.update(k, v)
        assert layer.seq_len == start + k.shape[2]
        shared = cache.book.last_slots
        assert shared is not None  # the slots of this update, shared by the layers
        if slots is None:
            slots = shared
        assert shared is slots
    assert slots is not None
    return slots


def _check_tables(cache: KVQuantCache, slots: torch.Tensor, start: int, new: int) -> None:
    """The cached block table equals a fresh one from the allocator; slots agree with it."""
    assert cache.allocator is not None
    ids = list(range(cache.batch_size_))
    fresh = cache.allocator.block_tables(ids)
    bt = cache.book.block_table(torch.device("cpu"))
    assert bt.dtype == torch.int32 and bt.is_contiguous()
    assert torch.equal(bt, fresh)
    pos = torch.arange(start, start + new).expand(len(ids), -1)
    assert torch.equal(slots, compute_slot_mapping(fresh, pos, cache.page_size))


def _kv(gen: torch.Generator, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, HKV, n, D, generator=gen), torch.randn(b, HKV, n, D, generator=gen)


def test_decode_slots_and_block_table_across_page_boundaries(tiny_llama: Any) -> None:
    gen = torch.Generator().manual_seed(0)
    b, prompt, steps = 3, 5, 14
    stepwise = _cache(tiny_llama, max_cache_tokens=b * 32)
    k0, v0 = _kv(gen, b, prompt)
    _step(stepwise, k0, v0)
    ks, vs = [k0], [v0]
    for i in range(steps):
        k, v = _kv(gen, b, 1)
        start = prompt + i
        _check_tables(stepwise, _step(stepwise, k, v), start, 1)
        ks.append(k)
        vs.append(v)
    # Same tokens in one update (generic slot path): identical pages content, read densely.
    tiny_llama_cache = KVQuantCache(tiny_llama, max_cache_tokens=b * 32)
    _step(tiny_llama_cache, torch.cat(ks, 2), torch.cat(vs, 2))
    for a, c in zip(stepwise.layers, tiny_llama_cache.layers, strict=True):
        ka, va = a.dense_kv(torch.float32)
        kc, vc = c.dense_kv(torch.float32)
        assert ka.shape == (b, HKV, prompt + steps, D)
        assert torch.equal(ka, kc) and torch.equal(va, vc)


def test_block_table_after_reset_and_multi_token_steps(tiny_llama: Any) -> None:
    gen = torch.Generator().manual_seed(1)
    cache = _cache(tiny_llama, max_cache_tokens=2 * 40)
    for _ in range(2):
        _check_tables(cache, _step(cache, *_kv(gen, 2, 3)), 0, 3)
        for n in (1, 1, 2, 1, 5, 1):
            start = cache.layers[0].seq_len
            _check_tables(cache, _step(cache, *_kv(gen, 2, n)), start, n)
        cache.reset()
        assert cache.reserved == 0 and cache.allocator is not None
        assert cache.allocator.num_free_pages == cache.allocator.num_pages


def test_decode_after_beam_reorder_uses_the_same_block_table(tiny_llama: Any) -> None:
    gen = torch.Generator().manual_seed(2)
    cache = _cache(tiny_llama, max_cache_tokens=3 * 16)
    _step(cache, *_kv(gen, 3, 3))
    bt = cache.book.block_table(torch.device("cpu")).clone()
    before = cache.layers[1].dense_kv(torch.float32)
    beam_idx = torch.tensor([1, 1, 0])
    cache.reorder_cache(beam_idx)
    assert torch.equal(cache.book.block_table(torch.device("cpu")), bt)
    _check_tables(cache, _step(cache, *_kv(gen, 3, 1)), 3, 1)  # last slot of the first page
    _check_tables(cache, _step(cache, *_kv(gen, 3, 1)), 4, 1)  # a new page
    after_k, after_v = cache.layers[1].dense_kv(torch.float32)
    assert torch.equal(after_k[:, :, :3], before[0][beam_idx])
    assert torch.equal(after_v[:, :, :3], before[1][beam_idx])


def test_capacity_error_leaves_tables_unchanged(tiny_llama: Any) -> None:
    gen = torch.Generator().manual_seed(3)
    cache = _cache(tiny_llama, num_pages=4)
    _step(cache, *_kv(gen, 2, 4))  # 2 pages
    _step(cache, *_kv(gen, 2, 1))  # 2 more pages: full
    bt = cache.book.block_table(torch.device("cpu")).clone()
    for _ in range(3):
        _step(cache, *_kv(gen, 2, 1))  # fills the pages
    with pytest.raises(CacheCapacityError):
        cache.layers[0].update(*_kv(gen, 2, 1))
    assert cache.reserved == 8 and cache.layers[0].seq_len == 8
    assert torch.equal(cache.book.block_table(torch.device("cpu")), bt)


@pytest.mark.gpu
def test_cuda_block_table_and_slots_across_page_boundaries(tiny_llama: Any) -> None:
    model = tiny_llama.cuda()
    handle = kvhf.patch(model, backend="triton", page_size=4)
    cache = handle.new_cache(max_cache_tokens=2 * 40)
    gen = torch.Generator().manual_seed(4)
    dev = torch.device("cuda", torch.cuda.current_device())
    k, v = _kv(gen, 2, 3)
    _step(cache, k.to(dev), v.to(dev))
    for start in range(3, 20):
        k, v = _kv(gen, 2, 1)
        slots = _step(cache, k.to(dev), v.to(dev))
        fresh = cache.allocator.block_tables([0, 1])  # type: ignore[union-attr]
        bt = cache.book.block_table(dev)
        assert bt.is_cuda and bt.dtype == torch.int32 and bt.is_contiguous()
        assert torch.equal(bt.cpu(), fresh.cpu())
        pos = torch.full((2, 1), start)
        assert torch.equal(slots.cpu(), compute_slot_mapping(fresh.cpu(), pos, 4))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_triton_write_on_a_device_that_is_not_current() -> None:
    from kvquant.kernels import write_kv, write_kv_reference

    dev = torch.device("cuda", 1)
    assert torch.cuda.current_device() != 1  # the launcher must switch to cuda:1
    key = torch.randn(2, 3, 2, 16, device=dev)
    value = torch.randn(2, 3, 2, 16, device=dev)
    slots = torch.tensor([[0, 1, 2], [5, 6, -1]], device=dev)

    def fresh() -> list[torch.Tensor]:
        pages = torch.full((4, 4, 2, 16), float("nan"), device=dev).to(torch.float8_e4m3fn)
        groups = torch.full((4, 4, 2, 1), float("nan"), device=dev)
        return [pages, pages.clone(), groups, groups.clone()]

    got, want = fresh(), fresh()
    scheme = GroupScales(head_dim=16, group_size=16)
    write_kv(key, value, Pages(*got), slots, scheme)
    write_kv_reference(key, value, Pages(*want), slots, scheme)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(
            g.view(torch.uint8) if g.dtype != torch.float32 else g.nan_to_num(7.0),
            w.view(torch.uint8) if w.dtype != torch.float32 else w.nan_to_num(7.0),
        )
