"""A finished or failed call holds no memory; the pools hold memory in proportion to their tokens.

Every test runs with Python's cyclic garbage collector off: a reference cycle through a
cache keeps its pages until that collector runs, and GPU memory pressure never runs it, so
on a GPU such a cache is memory lost to the next call. Reference counting alone must free
every cache when its last user reference goes.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hf_steps import generate_exactly
from hf_tiny import build, prompt

import kvquant.integrations.hf as kvhf
from kvquant.cache import PagedLayerStorage
from kvquant.cache.storage.recent import AUTO_RECENT_TOKENS
from kvquant.errors import CacheCapacityError
from kvquant.integrations.hf.cache_layer import KVQuantCache, KVQuantLayer

_KVQUANT_TYPES = (KVQuantCache, KVQuantLayer, PagedLayerStorage)


@pytest.fixture(autouse=True)
def no_cyclic_gc() -> Iterator[None]:
    """The cyclic collector off for the test (what a GPU process under memory pressure gets)."""
    gc.collect()  # start from a clean heap: earlier tests' garbage is not this test's
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _alive() -> list[str]:
    """kvquant cache objects still alive (gc.get_objects sees them with the collector off)."""
    return [type(o).__name__ for o in gc.get_objects() if isinstance(o, _KVQUANT_TYPES)]


def _tensor_bytes() -> int:
    """Bytes of every live tensor's storage, each storage counted once."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        # plain tensors and parameters only (an earlier test's fake or functional tensors,
        # still alive, have no storage to count)
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and not obj.is_meta:
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def _gen(model: Any, ids: torch.Tensor, mask: torch.Tensor, n: int, **kw: Any) -> torch.Tensor:
    """Greedy generate of exactly ``n`` tokens, returning the token tensor only (as users do)."""
    with torch.no_grad():
        out: torch.Tensor = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            **kw,
        )
    return out


def _user_cache(model: Any, handle: Any, ids: torch.Tensor, mask: torch.Tensor) -> None:
    cache = handle.new_cache()
    key = "cache" if "cache" in _generate_kwargs(model) else "past_key_values"
    _gen(model, ids, mask, 4, **{key: cache})
    del cache


def _generate_kwargs(model: Any) -> set[str]:
    import inspect

    params = inspect.signature(type(model.model).forward).parameters
    return set(params)


def _adopted_dynamic(model: Any, handle: Any, ids: torch.Tensor, mask: torch.Tensor) -> None:
    from transformers import DynamicCache

    key = "cache" if "cache" in _generate_kwargs(model) else "past_key_values"
    _gen(model, ids, mask, 4, **{key: DynamicCache()})


_PATHS: dict[str, tuple[dict[str, Any], Callable[..., None]]] = {
    "default": ({}, lambda m, h, i, k: _gen(m, i, k, 5)),
    "chunked prefill": ({}, lambda m, h, i, k: _gen(m, i, k, 4, prefill_chunk_size=4)),
    "row groups": ({"prefill_tokens": 12}, lambda m, h, i, k: _gen(m, i, k, 4)),
    "static step (cuda_graphs=True on CPU)": (
        {"cuda_graphs": True},
        lambda m, h, i, k: _gen(m, i, k, 6),
    ),
    "user cache": ({}, _user_cache),
    "empty DynamicCache converted": ({}, _adopted_dynamic),
    "beam search": ({}, lambda m, h, i, k: _gen(m, i, k, 4, num_beams=2)),
    "dict output, then dropped": (
        {},
        lambda m, h, i, k: generate_exactly(m, i, k, 4).past_key_values.get_seq_length(),
    ),
}


@pytest.mark.parametrize("path", list(_PATHS))
def test_no_cache_outlives_its_call(path: str) -> None:
    """Every way of building a cache: nothing of it is alive once the call returned."""
    options, run = _PATHS[path]
    model = build("llama")
    ids, mask = prompt(batch=2, length=9, pad=(2, 0))
    handle = kvhf.patch(model, backend="torch", page_size=4, **options)
    for _ in range(2):  # a second call finds nothing of the first
        run(model, handle, ids, mask)
        assert _alive() == []
    handle.remove()
    assert _alive() == []


def test_a_failed_call_holds_no_cache() -> None:
    """A generate that fails (the pool's bound is reached) leaves no cache behind."""
    model = build("llama")
    ids, mask = prompt(batch=2, length=9, pad=(2, 0))
    handle = kvhf.patch(model, backend="torch", page_size=4, num_pages=8)
    with pytest.raises(CacheCapacityError):
        _gen(model, ids, mask, 20)
    assert _alive() == []
    handle.remove()


def test_remove_returns_every_byte_of_the_patch() -> None:
    """After generate calls and ``handle.remove()``, the live tensors are those before the patch."""
    model = build("llama")
    ids, mask = prompt(batch=2, length=9, pad=(2, 0))
    before = _tensor_bytes()
    handle = kvhf.patch(model, backend="torch", page_size=4, prefill_tokens=12)
    for _ in range(2):
        _gen(model, ids, mask, 5)
    out = generate_exactly(model, ids, mask, 5)
    assert _tensor_bytes() > before  # the returned cache's pages (the count sees them)
    del out
    handle.remove()
    del handle
    assert _alive() == []
    assert _tensor_bytes() == before


def _bf16_dynamic_bytes(model: Any, batch: int, tokens: int) -> int:
    """Bytes of K and V that transformers' bf16 ``DynamicCache`` holds for these tokens."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_key_value_heads * head_dim * 2  # K and V, 2 bytes each
    return cfg.num_hidden_layers * batch * tokens * per_token


@pytest.mark.parametrize("fmt", ["fp32-group", "per-tensor"])
@pytest.mark.parametrize("page_size", [16, 4])
@pytest.mark.parametrize(("prompt_len", "new"), [(2, 5), (2, 40), (20, 30), (16, 5)])
def test_pools_hold_no_more_than_bf16_plus_one_page(
    fmt: str, page_size: int, prompt_len: int, new: int
) -> None:
    """After a batched generate: bytes <= the bf16 DynamicCache's + one page per sequence and
    layer + the default ring of the newest tokens.

    Pages and their group scales together (``memory_bytes()["total"]``, static scales and the
    rings included); the allowance is one page of K and one of V, with its group scales, per
    sequence and layer (the last page, partly filled), and the ring ``recent_tokens="auto"``
    keeps: 16 keys and values per sequence and layer in the model's dtype, counted here from
    the model's shapes (at Llama-3.2-1B's, 32 KB per sequence and layer in bf16).
    """
    batch = 8
    model = build("llama")
    ids, mask = prompt(batch=batch, length=prompt_len, pad=(0,) * batch)
    options: dict[str, Any] = {}
    if fmt == "per-tensor":
        options["scales"] = {
            f"model.layers.{i}.self_attn.{n}": torch.tensor(0.05)
            for i in range(model.config.num_hidden_layers)
            for n in ("k_scale", "v_scale")
        }
    kvhf.patch(model, backend="torch", page_size=page_size, **options)
    out = generate_exactly(model, ids, mask, new)
    cache = out.past_key_values
    assert isinstance(cache, KVQuantCache)
    stored = prompt_len + new - 1  # the last token is returned, never fed back
    assert cache.get_seq_length() == stored
    held = cache.memory_bytes()
    layer_pages = cache.layers[0].storage.num_pages
    per_page = (held["pages"] + held["group_scales"]) // (layer_pages * len(cache.layers))
    allowance = batch * len(cache.layers) * per_page  # K and V pages of one slot range
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    ring = len(cache.layers) * batch * 2 * AUTO_RECENT_TOKENS * cfg.num_key_value_heads
    ring *= head_dim * itemsize
    assert held["recent"] == ring, (held, ring)
    dense = _bf16_dynamic_bytes(model, batch, stored)
    assert held["total"] <= dense + allowance + ring, (held, dense, allowance, ring)


def _decode_past_the_prompt_pages(model: Any, handle: Any) -> KVQuantCache:
    """Prefill 8 tokens (2 pages of 4 per sequence), then one step that needs a third page."""
    ids, mask = prompt(batch=2, length=8, pad=(0, 0))
    cache = handle.new_cache()
    key = "cache" if "cache" in _generate_kwargs(model) else "past_key_values"
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{key: cache})
        assert cache.book.pages_per_sequence() == 2  # exactly the prompt's pages
        model(
            input_ids=ids[:, -1:],
            attention_mask=torch.ones(2, 9),
            position_ids=torch.full((2, 1), 8),
            **{key: cache},
        )
    assert cache.get_seq_length() == 9
    return cache


def test_growth_takes_headroom_only_where_memory_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plenty of free memory: the pool grows to the need plus the headroom; none: to the need."""
    from kvquant.integrations.hf import pool_sizing

    model = build("llama")
    handle = kvhf.patch(model, backend="torch", page_size=4)
    for free, want_pages in ((2**40, None), (0, 3)):
        monkeypatch.setattr(pool_sizing, "device_free_bytes", lambda device, f=free: f)
        cache = _decode_past_the_prompt_pages(model, handle)
        pages = cache.book.pages_per_sequence()
        if want_pages is None:
            assert pages * 4 >= 9 * (1 + cache.headroom_fraction()) > 12
        else:
            assert pages == want_pages
        for layer in cache.layers:
            assert layer.storage.num_pages == cache.allocator.num_pages
    handle.remove()


def test_growth_that_runs_out_of_memory_falls_back_to_the_need(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A growth with headroom that fails for want of memory retries with the need alone."""
    model = build("llama")
    handle = kvhf.patch(model, backend="torch", page_size=4)
    real_grow = PagedLayerStorage.grow
    tried: list[int] = []

    def grow(storage: PagedLayerStorage, num_pages: int) -> None:
        tried.append(num_pages)
        if num_pages > 6:  # 2 sequences x 3 pages: the need
            raise CacheCapacityError("out of memory (test)")
        real_grow(storage, num_pages)

    monkeypatch.setattr(PagedLayerStorage, "grow", grow)
    cache = _decode_past_the_prompt_pages(model, handle)
    assert tried[0] > 6 and 6 in tried
    assert cache.book.pages_per_sequence() == 3
    assert all(layer.storage.num_pages == 6 for layer in cache.layers)
    handle.remove()
