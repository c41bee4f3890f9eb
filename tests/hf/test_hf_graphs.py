"""``patch(model, cuda_graphs=True)`` on CPU: the static decode step equals the ordinary one.

On a CPU model the graph runner runs the decode step eagerly through the same
static buffers a CUDA graph replays (static block table, device-side slots and
lengths, left-padding starts from the 2D mask), so these tests check all of
the step's bookkeeping; the capture itself is tested on the GPU
(tests/hf/test_hf_gpu.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_steps import cache_kwarg, calibrate, step_logits
from hf_steps import generate_exactly as _generate
from hf_tiny import BUILDERS, build, prompt

import kvquant.integrations.hf as kvhf
from kvquant.errors import CacheCapacityError, KVQuantError, UnsupportedModelError
from kvquant.integrations.hf.graphs import left_padding_starts, step_left_padding_starts


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_static_decode_step_equals_ordinary_step(family: str) -> None:
    model = build(family)
    ids, mask = prompt(batch=3, length=20, pad=(7, 0, 2))
    results = {}
    for graphs in (False, True):
        handle = kvhf.patch(model, backend="torch", page_size=4, cuda_graphs=graphs)
        out = _generate(model, ids, mask, 13)
        results[graphs] = (out.sequences, torch.stack(out.logits))
        if graphs:
            stats = handle.state.graph_runner.stats
            assert (stats.static_eager, stats.replays, stats.captures) == (12, 0, 0)
            assert stats.ordinary == 1  # the prefill
        handle.remove()
    assert torch.equal(results[True][0], results[False][0])
    # The same kernels on the same cache contents: bit-identical logits.
    assert torch.equal(results[True][1], results[False][1])


@pytest.mark.parametrize("granularity", ["per-tensor", "per-head"])
def test_static_step_with_checkpoint_scales(granularity: str) -> None:
    model = build("llama")
    ids, mask = prompt(batch=2, length=24, pad=(5, 0))
    cont = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    scales = calibrate(model, ids, mask, granularity)
    got = {}
    for graphs in (False, True):
        handle = kvhf.patch(
            model, scales=scales, scale_format=granularity, backend="torch", page_size=8,
            cuda_graphs=graphs,
        )  # fmt: skip
        got[graphs], cache = step_logits(model, ids, mask, cont)
        assert cache.get_seq_length() == 24 + 9
        handle.remove()
    assert torch.equal(got[True], got[False])


def test_remove_and_repatch_restore_forward(tiny_llama: Any) -> None:
    ids, mask = prompt()
    ref = _generate(tiny_llama, ids, mask, 6).sequences
    handle = kvhf.patch(tiny_llama, backend="torch", cuda_graphs=True)
    assert "forward" in tiny_llama.__dict__
    assert kvhf.patch(tiny_llama, backend="torch", cuda_graphs=True) is handle
    other = kvhf.patch(tiny_llama, backend="torch", cuda_graphs=False, prefill_tokens=None)
    assert "forward" not in tiny_llama.__dict__ and not handle.active  # no wrapper at all
    other.remove()
    kvhf.patch(tiny_llama, backend="torch", cuda_graphs=True).remove()
    assert "forward" not in tiny_llama.__dict__
    assert torch.equal(_generate(tiny_llama, ids, mask, 6).sequences, ref)


def test_runner_keeps_the_forward_signature(tiny_llama: Any) -> None:
    import inspect

    before = inspect.signature(tiny_llama.forward)
    kvhf.patch(tiny_llama, backend="torch", cuda_graphs=True)
    assert inspect.signature(tiny_llama.forward) == before


def test_bad_option_is_refused(tiny_llama: Any) -> None:
    with pytest.raises(KVQuantError, match="cuda_graphs"):
        kvhf.patch(tiny_llama, cuda_graphs="yes")  # type: ignore[arg-type]
    assert "forward" not in tiny_llama.__dict__


def test_capacity_error_before_any_write(tiny_llama: Any) -> None:
    handle = kvhf.patch(tiny_llama, backend="torch", page_size=4, cuda_graphs=True)
    cache = handle.new_cache(num_pages=4)
    ids, mask = prompt(batch=2, length=8, pad=(0, 0))
    key = cache_kwarg(tiny_llama)
    pos = torch.arange(8).expand(2, -1)
    with torch.no_grad():
        tiny_llama(input_ids=ids, attention_mask=mask, position_ids=pos, **{key: cache})
        pages = [layer.k_pages.clone() for layer in cache.layers]
        with pytest.raises(CacheCapacityError, match="Nothing was written"):
            tiny_llama(
                input_ids=ids[:, :1],
                attention_mask=torch.ones(2, 9, dtype=torch.long),
                position_ids=torch.full((2, 1), 8),
                **{key: cache},
            )
    assert [layer.get_seq_length() for layer in cache.layers] == [8, 8]
    assert all(torch.equal(p, layer.k_pages) for p, layer in zip(pages, cache.layers, strict=True))


def test_steps_the_graph_cannot_serve_take_the_ordinary_path(tiny_llama: Any) -> None:
    handle = kvhf.patch(tiny_llama, backend="torch", page_size=4, cuda_graphs=True)
    stats = handle.state.graph_runner.stats
    ids, mask = prompt(batch=2, length=8, pad=(0, 0))
    key = cache_kwarg(tiny_llama)
    cache = handle.new_cache()
    with torch.no_grad():
        tiny_llama(input_ids=ids, attention_mask=mask, **{key: cache})
        # no position_ids: the model would compute them on the host
        tiny_llama(input_ids=ids[:, :1], attention_mask=torch.ones(2, 9), **{key: cache})
    assert (stats.ordinary, stats.static_eager) == (2, 0)
    # gradients enabled: the ordinary path, which refuses gradients through the FP8 cache
    with pytest.raises(UnsupportedModelError, match="gradients"):
        tiny_llama(
            input_ids=ids[:, :1],
            attention_mask=torch.ones(2, 10),
            position_ids=torch.full((2, 1), 9),
            **{key: cache},
        )
    assert (stats.ordinary, stats.static_eager) == (3, 0)
    assert cache.get_seq_length() == 9
    with torch.no_grad():
        tiny_llama(
            input_ids=ids[:, :1],
            attention_mask=torch.ones(2, 10),
            position_ids=torch.full((2, 1), 9),
            **{key: cache},
        )
    assert stats.static_eager == 1
    assert cache.get_seq_length() == 10
    # a mask with a hole is not left padding: the ordinary path refuses it, loudly
    hole = torch.ones(2, 11)
    hole[0, 4] = 0
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match="left padding"):
        tiny_llama(
            input_ids=ids[:, :1],
            attention_mask=hole,
            position_ids=torch.full((2, 1), 10),
            **{key: cache},
        )
    assert stats.static_eager == 1
    # the refused call left the cache as it was: the next step works
    assert cache.get_seq_length() == 10
    with torch.no_grad():
        tiny_llama(
            input_ids=ids[:, :1],
            attention_mask=torch.ones(2, 11),
            position_ids=torch.full((2, 1), 10),
            **{key: cache},
        )
    assert stats.static_eager == 2 and cache.get_seq_length() == 11


def test_beam_search_and_sampling_match_ordinary_steps(tiny_llama: Any) -> None:
    ids, mask = prompt(batch=2, length=10, pad=(3, 0))
    runs: dict[bool, list[torch.Tensor]] = {}
    for graphs in (False, True):
        handle = kvhf.patch(tiny_llama, backend="torch", page_size=4, cuda_graphs=graphs)
        beams = _generate(tiny_llama, ids, mask, 8, num_beams=3).sequences
        torch.manual_seed(0)
        with torch.no_grad():
            sampled = tiny_llama.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=20
            )
        runs[graphs] = [beams, sampled]
        handle.remove()
    for a, b in zip(runs[True], runs[False], strict=True):
        assert torch.equal(a, b)


def test_left_padding_starts() -> None:
    cpu = torch.device("cpu")
    m = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    assert left_padding_starts(m, 3, 5, cpu).tolist() == [2, 0, 1]
    assert left_padding_starts(m.bool(), 3, 5, cpu).dtype == torch.int32
    assert left_padding_starts(None, 2, 5, cpu).tolist() == [0, 0]
    assert left_padding_starts(m, 3, 6, cpu) is None  # wrong length
    assert left_padding_starts(torch.tensor([[1, 1, 0]]), 1, 3, cpu) is None  # padding query
    assert left_padding_starts(torch.tensor([[0, 0, 0]]), 1, 3, cpu) is None
    assert left_padding_starts(torch.tensor([[1, 0, 1]]), 1, 3, cpu) is None  # a hole


def test_step_left_padding_starts_follows_the_growing_mask() -> None:
    """A decode step whose mask is the last one plus a column of ones reuses its starts; any
    other mask (a hole, a padding newest token, the last mask changed in place) is checked
    again in full."""
    from types import SimpleNamespace

    cpu = torch.device("cpu")
    cache = SimpleNamespace(batch_size_=3, decode_mask_memo=None)
    ones = torch.ones(3, 1, dtype=torch.long)
    m = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    first = step_left_padding_starts(cache, m, 5, cpu)  # type: ignore[arg-type]
    assert first is not None and first.tolist() == [2, 0, 1]
    m2 = torch.cat([m, ones], dim=1)
    again = step_left_padding_starts(cache, m2, 6, cpu)  # type: ignore[arg-type]
    assert again is first  # the previous step's starts, no second check
    m2[1, 2] = 0  # the caller changes the last mask in place: a hole
    holed = torch.cat([m2, ones], dim=1)
    assert step_left_padding_starts(cache, holed, 7, cpu) is None  # type: ignore[arg-type]
    assert cache.decode_mask_memo is None
    m3 = torch.cat([m, ones, ones], dim=1)
    fresh = step_left_padding_starts(cache, m3, 7, cpu)  # type: ignore[arg-type]
    assert fresh is not None and fresh.tolist() == [2, 0, 1]
    padded_newest = torch.cat([m3, torch.tensor([[1], [0], [1]])], dim=1)
    assert step_left_padding_starts(cache, padded_newest, 8, cpu) is None  # type: ignore[arg-type]
    shifted = torch.cat([torch.zeros(3, 1, dtype=torch.long), m3], dim=1)  # same length + 1
    step_left_padding_starts(cache, m3, 7, cpu)  # type: ignore[arg-type]
    moved = step_left_padding_starts(cache, shifted, 8, cpu)  # type: ignore[arg-type]
    assert moved is not None and moved.tolist() == [3, 1, 2]


def test_views_of_a_growing_tensor_reuse_one_graph(tiny_llama: Any) -> None:
    """Step inputs that are views with changing strides keep the same captured step."""
    handle = kvhf.patch(tiny_llama, backend="torch", page_size=4, cuda_graphs=True)
    cache = handle.new_cache()
    key = cache_kwarg(tiny_llama)
    ids, mask = prompt(batch=2, length=6, pad=(0, 0))
    with torch.no_grad():
        tiny_llama(input_ids=ids, attention_mask=mask, **{key: cache})
        grown = ids
        for t in range(6, 10):
            nxt = torch.full((2, 1), 5 + t)
            grown = torch.cat([grown, nxt], dim=1)
            tiny_llama(
                input_ids=grown[:, -1:],  # stride (t + 1, 1) changes every step
                attention_mask=torch.ones(2, t + 1),
                position_ids=torch.full((2, 1), t),
                **{key: cache},
            )
            graph = cache.decode_graph
            if t == 6:
                first = graph
            assert graph is first
    assert handle.state.graph_runner.stats.static_eager == 4


def test_graph_step_makes_decode_headroom_once(tiny_llama: Any) -> None:
    """Before a capture, a growable cache grows to hold the step plus its growth headroom."""
    ids, mask = prompt(batch=2, length=12, pad=(3, 0))
    handle = kvhf.patch(tiny_llama, backend="torch", page_size=4, cuda_graphs=True)
    cache = handle.new_cache()
    key = cache_kwarg(tiny_llama)
    with torch.no_grad():
        tiny_llama(input_ids=ids, attention_mask=mask, **{key: cache})
        assert cache.book.pages_per_sequence() == 3  # the prompt's pages, no more
        tiny_llama(
            input_ids=ids[:, -1:],
            attention_mask=torch.ones(2, 13),
            position_ids=torch.full((2, 1), 12),
            **{key: cache},
        )
    assert cache.capacity_version == 1  # grown once, before the first (static) step
    headroom = cache.headroom_fraction()
    assert 0 < headroom <= 0.5
    assert cache.book.pages_per_sequence() * 4 >= 13 * (1 + headroom)
    assert handle.state.graph_runner.stats.static_eager == 1
    handle.remove()
