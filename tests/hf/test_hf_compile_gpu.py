"""The compiled decode step on CUDA: inductor's kernels inside kvquant's CUDA graph (device tool)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_steps import cache_kwarg, generate_exactly, min_cosine, step_logits
from hf_tiny import build, prompt

import kvquant.integrations.hf as kvhf
from kvquant.integrations.hf.attention import STEP_LAYER_ATTR

pytestmark = pytest.mark.gpu


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_compiled_graph_matches_eager_graph_and_unpatched(family: str) -> None:
    model = build(family).to(device="cuda", dtype=torch.bfloat16)
    ids, mask = prompt(batch=3, length=40, pad=(5, 0, 9))
    ids, mask = ids.cuda(), mask.cuda()
    cont = torch.randint(3, 128, (3, 30), generator=torch.Generator().manual_seed(5)).cuda()
    ref, _ = step_logits(model, ids, mask, cont)
    got = {}
    for compiled in (False, None):  # None: the default, compiled on CUDA
        handle = kvhf.patch(model, page_size=16, compile_step=compiled)
        got[compiled], cache = step_logits(model, ids, mask, cont)
        assert cache.get_seq_length() == 70
        stats = handle.state.graph_runner.stats
        # one growth mid-decode (test_hf_gpu.py's test_cuda_graph_decode_matches_ordinary_steps)
        assert (stats.captures, stats.replays, stats.static_eager) == (2, 30, 0)
        assert stats.compile_fallbacks == 0
        assert stats.compiled_runs == (0 if compiled is False else 3)  # warm-up, 2 captures
        handle.remove()
    assert torch.isfinite(got[None]).all()
    # inductor fuses the bf16 elementwise work (rounding differs from eager's): close to
    # the eager graph, and as close to the unpatched model as test_hf_gpu.py asks of it
    gemma = family.startswith("gemma")
    assert min_cosine(got[None], got[False]) >= (0.99 if gemma else 0.999)
    assert min_cosine(got[None], ref) >= (0.98 if gemma else 0.995)


def test_no_recompile_across_steps_and_calls() -> None:
    model = build("llama").to(device="cuda", dtype=torch.bfloat16)
    handle = kvhf.patch(model, page_size=16)
    ids, mask = prompt(batch=2, length=24, pad=(3, 0))
    generate_exactly(model, ids.cuda(), mask.cuda(), 12)
    stats = handle.state.graph_runner.stats
    assert (stats.captures, stats.replays, stats.compiled_runs) == (1, 11, 2)
    graphs = _graphs_compiled()
    assert graphs > 0
    for length in (9, 57):  # other prompt lengths, same batch: nothing compiles again
        ids, mask = prompt(batch=2, length=length, pad=(1, 0), seed=length)
        out = generate_exactly(model, ids.cuda(), mask.cuda(), 12)
        assert torch.isfinite(torch.stack(out.logits)).all()
    assert _graphs_compiled() == graphs
    # each new cache captures again (without a second warm-up): 22 more replays
    assert (stats.captures, stats.replays, stats.compiled_runs) == (3, 33, 4)
    handle.remove()
    for layer in model.model.layers:
        assert "forward" not in layer.__dict__
        assert STEP_LAYER_ATTR not in layer.self_attn.__dict__


def test_compile_failure_in_auto_mode_captures_the_eager_step(monkeypatch: Any) -> None:
    model = build("llama").to(device="cuda", dtype=torch.bfloat16)
    ids, mask = prompt(batch=2, length=20, pad=(4, 0))
    ids, mask = ids.cuda(), mask.cuda()
    handle = kvhf.patch(model, compile_step=False)
    want = torch.stack(generate_exactly(model, ids, mask, 8).logits)
    handle.remove()

    def broken(gm: Any, example_inputs: Any) -> Any:
        raise RuntimeError("inductor is broken here")

    torch._dynamo.reset()  # nothing compiled by an earlier test may serve this one
    handle = kvhf.patch(model)
    handle.state.graph_runner.compiled.backend = broken
    got = torch.stack(generate_exactly(model, ids, mask, 8).logits)
    stats = handle.state.graph_runner.stats
    assert stats.compile_fallbacks == 1 and stats.captures == 1 and stats.replays == 7
    assert min_cosine(got, want) >= 0.9999  # the eager step's graph: the same kernels
    handle.remove()


@pytest.mark.parametrize(("family", "graphs"), [("llama", 1), ("gemma2", 2)])
def test_each_layer_type_is_one_graph_without_a_break(family: str, graphs: int) -> None:
    """kvquant's write and attention are custom ops inside the layer's graph (gemma2: sliding
    and full layers, one graph each), captured in the decode graph and replayed."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # count only this test's compiles
    counters.clear()
    model = build(family).to(device="cuda", dtype=torch.bfloat16)
    ids, mask = prompt(batch=2, length=24, pad=(3, 0))
    ids, mask = ids.cuda(), mask.cuda()
    handle = kvhf.patch(model, page_size=16, compile_step=False)
    want = torch.stack(generate_exactly(model, ids, mask, 8).logits)
    handle.remove()
    handle = kvhf.patch(model, page_size=16)
    got = torch.stack(generate_exactly(model, ids, mask, 8).logits)
    stats = handle.state.graph_runner.stats
    assert (stats.captures, stats.replays, stats.compiled_runs) == (1, 7, 2)
    assert stats.compile_fallbacks == 0 and stats.fallbacks == 0
    assert dict(counters["graph_break"]) == {}
    assert _graphs_compiled() == graphs
    assert torch.isfinite(got).all()
    assert min_cosine(got, want) >= (0.99 if family.startswith("gemma") else 0.999)
    handle.remove()


def test_a_pool_that_grows_mid_decode_captures_again_without_a_recompile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The page count and block-table width are dynamic in the compiled graph: each growth
    captures the compiled step again (no warm-up, recompiles refused) and nothing compiles.

    The reference is teacher-forced on the compiled run's own tokens (eager steps): a free
    running comparison would follow another token path after the first near-tie that the
    fused kernels' bf16 rounding flips, and compare unrelated logits.
    """
    from torch._dynamo.utils import counters

    from kvquant.integrations.hf import pool_sizing

    monkeypatch.setattr(pool_sizing, "GROWTH_HEADROOM", 0.0)  # grow at every page
    torch._dynamo.reset()
    counters.clear()  # count only this test's compiles
    model = build("llama").to(device="cuda", dtype=torch.bfloat16)
    ids, mask = prompt(batch=2, length=24, pad=(3, 0))
    ids, mask = ids.cuda(), mask.cuda()
    handle = kvhf.patch(model, page_size=16)
    cache = handle.new_cache()
    got = generate_exactly(model, ids, mask, 100, **{cache_kwarg(model): cache})
    stats = handle.state.graph_runner.stats
    assert cache.capacity_version >= 2
    assert stats.captures >= 2 and stats.replays == 99  # captured again after a growth
    assert stats.compile_fallbacks == 0 and stats.fallbacks == 0
    assert stats.compiled_runs == 1 + stats.captures  # one warm-up, then captures only
    assert _graphs_compiled() == 1
    handle.remove()
    handle = kvhf.patch(model, cuda_graphs=False, page_size=16)
    want, _ = step_logits(model, ids, mask, got.sequences[:, ids.shape[1] : -1])
    handle.remove()
    assert min_cosine(torch.stack(got.logits, dim=1).float(), want) >= 0.999
