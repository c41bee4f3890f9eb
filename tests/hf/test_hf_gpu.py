"""The HF integration on CUDA with the Triton kernels (run through the device tool)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_steps import calibrate, min_cosine, step_logits
from hf_tiny import build, prompt

import kvquant.integrations.hf as kvhf

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("granularity", ["per-tensor", "per-head", "fp32-group", "rotated-k"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_path_matches_unpatched(family: str, granularity: str, dtype: torch.dtype) -> None:
    """``rotated-k``: fp32-group scales of Hadamard-rotated keys (``k_rotation="hadamard"``)."""
    model = build(family).to(device="cuda", dtype=dtype)
    ids, mask = prompt(batch=2, length=40, pad=(5, 0))
    ids, mask = ids.cuda(), mask.cuda()
    cont = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(5)).cuda()
    ref, _ = step_logits(model, ids, mask, cont)
    dynamic = granularity in ("fp32-group", "rotated-k")
    scales = None if dynamic else calibrate(model, ids, mask, granularity)
    # compile_step=False: the eager step's kernels (the compiled step: test_hf_compile_gpu.py)
    opts: dict[str, Any] = dict(scales=scales, scale_format=granularity, compile_step=False)
    if granularity == "rotated-k":
        opts.update(scale_format="fp32-group", k_rotation="hadamard")
    handle = kvhf.patch(model, backend="triton", **opts)
    got, cache = step_logits(model, ids, mask, cont)
    assert cache.layers[0].k_pages.is_cuda
    assert torch.isfinite(got).all()
    floor = 0.98 if family.startswith("gemma") else (0.995 if dtype == torch.bfloat16 else 0.999)
    assert min_cosine(got, ref) >= floor
    # Same cache contents through the torch reference: the kernels agree with it.
    handle.remove()
    kvhf.patch(model, backend="torch", **opts)
    got_ref, _ = step_logits(model, ids, mask, cont)
    assert min_cosine(got, got_ref) >= 0.9999


def test_generate_on_gpu_bf16_auto_backend() -> None:
    model = build("llama").to(device="cuda", dtype=torch.bfloat16)
    ids, mask = prompt(batch=3, length=20, pad=(7, 0, 2))
    ids, mask = ids.cuda(), mask.cuda()
    handle = kvhf.patch(model)  # backend="auto" -> triton on CUDA
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    assert out.shape == (3, 60)
    handle.remove()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_cuda_graph_decode_matches_ordinary_steps(family: str) -> None:
    model = build(family).to(device="cuda", dtype=torch.bfloat16)
    ids, mask = prompt(batch=3, length=40, pad=(5, 0, 9))
    ids, mask = ids.cuda(), mask.cuda()
    cont = torch.randint(3, 128, (3, 30), generator=torch.Generator().manual_seed(5)).cuda()
    got = {}
    for graphs in (False, True):
        handle = kvhf.patch(model, page_size=16, cuda_graphs=graphs)
        got[graphs], cache = step_logits(model, ids, mask, cont)
        assert cache.get_seq_length() == 70
        if graphs:
            stats = handle.state.graph_runner.stats
            # 40 + 2 slots: 3 pages; the capture grows to 4 (41 tokens and their headroom), the
            # 65th token grows the pools again and the next step captures again
            assert (stats.captures, stats.replays, stats.static_eager) == (2, 30, 0)
        handle.remove()
    assert torch.isfinite(got[True]).all()
    # Same kernels; the graph's decode launches see the whole block table (more splits).
    assert min_cosine(got[True], got[False]) >= 0.9999


def test_cuda_graph_generate_recaptures_per_cache_and_capacity() -> None:
    from kvquant.errors import CacheCapacityError

    model = build("llama").to(device="cuda", dtype=torch.bfloat16)
    ids, mask = prompt(batch=2, length=20, pad=(4, 0))
    ids, mask = ids.cuda(), mask.cuda()
    handle = kvhf.patch(model, cuda_graphs=True, page_size=4, max_cache_tokens=2 * 40)
    outs = []
    for _ in range(2):
        with torch.no_grad():
            outs.append(
                model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16
                )
            )
    stats = handle.state.graph_runner.stats
    assert stats.captures == 2 and stats.replays == 2 * 15  # the prefill gives the first token
    assert torch.equal(outs[0], outs[1])
    with torch.no_grad(), pytest.raises(CacheCapacityError, match="Nothing was written"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, min_new_tokens=30)
    handle.remove()


def test_cuda_graph_capture_failure_is_a_clear_error() -> None:
    from kvquant.errors import KVQuantError

    model = build("llama").to(device="cuda", dtype=torch.bfloat16)
    ids, mask = prompt(batch=2, length=12, pad=(3, 0))
    ids, mask = ids.cuda(), mask.cuda()
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6)

    def host_sync(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        if torch.cuda.is_current_stream_capturing():
            float(out.float().sum())  # a host sync: a graph cannot hold it

    hook = model.model.layers[0].mlp.register_forward_hook(host_sync)
    # the eager step: a compiled layer traces the hook without its host sync
    handle = kvhf.patch(model, cuda_graphs=True, compile_step=False)
    stream = torch.cuda.current_stream()
    with torch.no_grad(), pytest.raises(KVQuantError, match="cuda_graphs=False"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6)
    handle.remove()
    hook.remove()
    # the device is still usable: the stream is the one before, random ops work
    assert torch.cuda.current_stream() == stream
    assert torch.randn(4, device="cuda").isfinite().all()
    with torch.no_grad():
        again = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6
        )
        sampled = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
            do_sample=True,
        )  # fmt: skip
    assert torch.equal(again, ref)
    assert sampled.shape == ref.shape


def test_default_patch_captures_and_falls_back_once_on_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``cuda_graphs=None`` (the default): graphs on CUDA; a failed capture decodes eagerly."""
    model = build("llama").to(device="cuda", dtype=torch.bfloat16)
    ids, mask = prompt(batch=2, length=12, pad=(3, 0))
    ids, mask = ids.cuda(), mask.cuda()
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6)
    handle = kvhf.patch(model, cuda_graphs=False)
    with torch.no_grad():
        eager = model.generate(**gen)
    handle.remove()
    # graphs by default; the eager step, so that tokens are bit-equal and the hook below syncs
    # (the compiled step's fallback: test_hf_compile_gpu.py)
    handle = kvhf.patch(model, compile_step=False)
    with torch.no_grad():
        graphed = model.generate(**gen)
    stats = handle.state.graph_runner.stats
    assert (stats.captures, stats.replays) == (1, 5)
    assert torch.equal(graphed, eager)

    def host_sync(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        if torch.cuda.is_current_stream_capturing():
            float(out.float().sum())  # a host sync: a graph cannot hold it

    hook = model.model.layers[0].mlp.register_forward_hook(host_sync)
    with torch.no_grad(), caplog.at_level("WARNING", logger="kvquant"):
        first = model.generate(**gen)
        second = model.generate(**gen)
    hook.remove()
    assert stats.fallbacks == 2
    assert sum("Decoding eagerly instead" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(first, eager) and torch.equal(second, eager)
    assert torch.randn(4, device="cuda").isfinite().all()
    handle.remove()


FRESH_PROCESS = "KVQUANT_TEST_FRESH_PROCESS"


def _rerun_in_a_fresh_process(request: pytest.FixtureRequest) -> bool:
    """In the test's own process: run the test again in a new Python process, assert it
    passed there, and return True (the caller returns). In that new process: False.

    For tests of what torch's caching allocator keeps: the blocks earlier tests of a
    process left cached (and live tensors pinned in them) are not the tested code's.
    """
    import os
    import subprocess
    import sys

    if os.environ.get(FRESH_PROCESS):
        return False
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
        cwd=request.config.rootpath,
        env={**os.environ, FRESH_PROCESS: "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    return True


def test_pool_growth_returns_the_old_pools_to_the_device(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """A growth frees the old pools to the device, not into torch's cache, where a chunked
    prefill's activations split them and a larger pool later found no contiguous memory."""
    import inspect

    if _rerun_in_a_fresh_process(request):
        return
    from kvquant.integrations.hf import pool_sizing

    monkeypatch.setattr(pool_sizing, "RELEASE_AFTER_GROWTH_BYTES", 1)  # the tiny model's pools
    model = build("llama").to(device="cuda", dtype=torch.bfloat16)
    ids, mask = prompt(batch=4, length=300)
    ids, mask = ids.cuda(), mask.cuda()
    # static scales: the pools are page tensors only (fp32-group's group-scale tensors of a few
    # MiB can land in a freed pool's block, which then cannot be released: allocator noise)
    scales = calibrate(model, ids, mask, "per-tensor")
    handle = kvhf.patch(model, scales=scales, page_size=16, cuda_graphs=False)
    cache = handle.new_cache()
    key = (
        "cache"
        if "cache" in inspect.signature(type(model.model).forward).parameters
        else "past_key_values"
    )
    with torch.no_grad():
        model(input_ids=ids[:, :64], attention_mask=mask[:, :64], **{key: cache})
    # pools of over 10 MiB a tensor: torch gives such blocks segments of their own (smaller
    # ones share segments with other tensors and are never released one by one)
    cache.reserve_through(100_000, cache.layers[0])
    torch.cuda.synchronize()
    old = sum(layer.storage.memory_bytes()["pages"] for layer in cache.layers)
    assert old // (2 * len(cache.layers)) > 10 * 2**20
    torch.cuda.empty_cache()
    # what torch already keeps cached here (earlier tests of the process can leave segments
    # that a live tensor pins) is not the growth's doing: compare against it
    cached_before = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    cache.reserve_through(200_000, cache.layers[0])  # grows every layer's pool again
    torch.cuda.synchronize()
    assert sum(layer.storage.memory_bytes()["pages"] for layer in cache.layers) > old
    cached_after = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    assert cached_after - cached_before < old
    with torch.no_grad():  # the grown cache still serves the rest of the prompt
        out = model(input_ids=ids[:, 64:], attention_mask=mask, **{key: cache})
    assert torch.isfinite(out.logits).all()
    assert cache.get_seq_length() == 300
    handle.remove()


@pytest.mark.parametrize("compile_step", [False, None])
def test_cuda_graph_survives_pool_growth(
    monkeypatch: pytest.MonkeyPatch, compile_step: bool | None
) -> None:
    """A cache without a bound grows during decode; the next step captures again.

    The reference is teacher-forced on the graphed run's own tokens (eager steps): a free
    running comparison would follow another token path after the first near-tie that bf16
    rounding (the compiled step's fused kernels) flips, and compare unrelated logits.
    """
    from kvquant.integrations.hf import pool_sizing

    monkeypatch.setattr(pool_sizing, "GROWTH_HEADROOM", 0.0)  # grow at every page
    model = build("llama").to(device="cuda", dtype=torch.bfloat16)
    ids, mask = prompt(batch=2, length=20, pad=(4, 0))
    ids, mask = ids.cuda(), mask.cuda()
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=200, min_new_tokens=200)
    handle = kvhf.patch(model, page_size=16, compile_step=compile_step)
    with torch.no_grad():
        graphed = model.generate(**gen, return_dict_in_generate=True, output_logits=True)
    stats = handle.state.graph_runner.stats
    assert stats.captures >= 4 and stats.replays == 199
    if compile_step is None:
        assert stats.compiled_runs > stats.captures  # a warm-up, then every capture compiled
    handle.remove()
    handle = kvhf.patch(model, cuda_graphs=False, page_size=16)
    eager, _ = step_logits(model, ids, mask, graphed.sequences[:, ids.shape[1] : -1])
    handle.remove()
    # the compiled step's fused kernels round bf16 differently (test_hf_compile_gpu.py's floor)
    floor = 0.9999 if compile_step is False else 0.999
    assert min_cosine(torch.stack(graphed.logits, dim=1).float(), eager) >= floor


def test_patch_generate_remove_cycles_leave_no_memory() -> None:
    """Patching, generating (graphs captured) and removing, again and again, holds nothing."""
    import gc

    from kvquant.errors import CacheCapacityError

    model = build("llama").to(device="cuda", dtype=torch.bfloat16)
    ids, mask = prompt(batch=2, length=20, pad=(4, 0))
    ids, mask = ids.cuda(), mask.cuda()
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8)

    def cycle(**patch_kw: object) -> None:
        handle = kvhf.patch(model, **patch_kw)
        try:
            with torch.no_grad():
                model.generate(**gen)
        finally:
            handle.remove()
        gc.collect()

    cycle()  # first use: kernels compile, library handles and workspaces are created
    base = torch.cuda.memory_allocated()
    for _ in range(3):
        cycle()
        assert torch.cuda.memory_allocated() == base
    with pytest.raises(CacheCapacityError) as failed:
        cycle(max_cache_tokens=2 * 22)  # a failed generate
    del failed  # its traceback holds generate's frames (and their tensors), not kvquant
    gc.collect()
    assert torch.cuda.memory_allocated() == base


def test_deepcopy_of_a_cache_after_graph_decode_steps() -> None:
    """A cache that holds a captured CUDA graph copies (without it) and continues alike."""
    import copy

    from hf_steps import cache_kwarg, returned_cache

    model = build("llama").to(device="cuda", dtype=torch.bfloat16)
    ids, mask = prompt(batch=2, length=20, pad=(5, 0))
    ids, mask = ids.cuda(), mask.cuda()
    cont = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(5)).cuda()
    handle = kvhf.patch(model, cuda_graphs=True, compile_step=False)
    full, _ = step_logits(model, ids, mask, cont)
    key = cache_kwarg(model)

    def fwd(tok: torch.Tensor, m: torch.Tensor, cache: object) -> Any:
        pos = (m.cumsum(-1) - 1).clamp(min=0)[:, -tok.shape[1] :]
        with torch.no_grad():
            out = model(
                input_ids=tok, attention_mask=m, position_ids=pos, use_cache=True, **{key: cache}
            )
        return out

    cache = returned_cache(fwd(ids, mask, None))
    for s in range(4):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        fwd(cont[:, s : s + 1], mask, cache)
    assert cache.decode_graph is not None and cache.decode_graph.graph is not None
    twin = copy.deepcopy(cache)
    assert twin.decode_graph is None
    for c in (cache, twin):
        m, got = mask, []
        for s in range(4, 8):
            m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
            got.append(fwd(cont[:, s : s + 1], m, c).logits[:, -1].float())
        assert torch.equal(torch.stack(got, dim=1), full[:, 5:])
    handle.remove()


@pytest.mark.parametrize("compile_step", [False, None])
def test_no_memory_outlives_generate_or_remove_without_collection(compile_step: Any) -> None:
    """With the cyclic collector off, every cache a call built is freed when the call returns
    (CUDA graphs and their buffers included), and ``remove()`` returns the memory of the patch."""
    import gc

    model = build("llama").to(device="cuda", dtype=torch.bfloat16)
    ids, mask = prompt(batch=4, length=300, pad=(5, 0, 9, 0))
    ids, mask = ids.cuda(), mask.cuda()
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        handle = kvhf.patch(model, compile_step=compile_step)
        after_calls = []
        for _ in range(3):
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40,
                               min_new_tokens=40, do_sample=False)  # fmt: skip
            torch.cuda.synchronize()
            after_calls.append(torch.cuda.memory_allocated())
        # the first call creates what lives as long as the process (cuBLAS's workspaces of the
        # warm-up stream); the caches of the calls are gone when they return
        assert after_calls[1] == after_calls[0] == after_calls[2]
        assert handle.state.graph_runner.stats.replays >= 3 * 38
        handle.remove()  # also frees cuBLAS's workspaces
        del handle
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - before < 64 * 2**10
    finally:
        if was:
            gc.enable()
