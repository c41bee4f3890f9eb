"""What users do to a model around ``kvquant.patch``: copies, casts, re-patching, other
models' caches, threads. Each gives the unpatched model's result within FP8 rounding or a
clear error that leaves the cache as it was."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from hf_steps import cache_kwarg, calibrate, min_cosine, returned_cache, step_logits
from hf_tiny import build, prompt

import kvquant.integrations.hf as kvhf
from kvquant.errors import CacheUsageError, KVQuantError, ScaleFormatError, UnsupportedModelError
from kvquant.integrations.hf.cache_layer import KVQuantCache


def _cont(seed: int = 7, steps: int = 4) -> torch.Tensor:
    return torch.randint(3, 100, (2, steps), generator=torch.Generator().manual_seed(seed))


def _snapshot(model: Any) -> tuple[Any, ...]:
    """What patch changes: attention implementation, hooks, buffers, attributes, forward."""
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    buffers = sorted(name for name, _ in model.named_buffers())
    attrs = sorted(k for m in model.modules() for k in m.__dict__ if k.startswith("_kv"))
    forward = "forward" in model.__dict__
    return model.config._attn_implementation, hooks, tuple(buffers), tuple(attrs), forward


@torch.no_grad()
def _forward(model: Any, ids: torch.Tensor, mask: torch.Tensor, cache: Any) -> Any:
    """One forward of ``ids`` (the newest tokens of ``mask``) over ``cache``."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
    kw = {cache_kwarg(getattr(model, "_orig_mod", model)): cache}
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kw)


def _decode_step(model: Any, mask: torch.Tensor, cache: Any) -> Any:
    """One decode step (token 5 for every row) after the positions of ``mask``."""
    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return _forward(model, torch.full((mask.shape[0], 1), 5), mask, cache)


def test_deepcopy_of_a_patched_model_is_patched_on_its_own() -> None:
    ids, mask = prompt(pad=(4,))
    cont = _cont()
    plain = build("llama")
    before = _snapshot(plain)
    ref, _ = step_logits(plain, ids, mask, cont)
    model = build("llama")
    handle = kvhf.patch(model, backend="torch")
    fp8, _ = step_logits(model, ids, mask, cont)
    twin = copy.deepcopy(model)
    twin_handle = twin._kvquant_state.handle
    assert twin_handle is not handle and twin_handle.active and handle.active
    twin_fp8, twin_cache = step_logits(twin, ids, mask, cont)
    assert isinstance(twin_cache, KVQuantCache)
    assert torch.equal(twin_fp8, fp8)
    # the original's cache belongs to the original's patch
    with pytest.raises(CacheUsageError, match=r"another kvquant\.patch"):
        step_logits(twin, ids, mask, cont, cache=handle.new_cache())
    twin_handle.remove()
    assert _snapshot(twin) == before
    assert torch.equal(step_logits(twin, ids, mask, cont)[0], ref)
    assert handle.active and model.config._attn_implementation == "kvquant"
    assert torch.equal(step_logits(model, ids, mask, cont)[0], fp8)
    # patching a copy (again, with other options) and removing it restores the copy alone
    other = copy.deepcopy(model)
    kvhf.patch(other, backend="torch", page_size=8).remove()
    assert _snapshot(other) == before
    assert torch.equal(step_logits(other, ids, mask, cont)[0], ref)
    assert handle.active


@pytest.mark.parametrize("wrapper", [{}, {"cuda_graphs": True}, {"prefill_tokens": 8}])
def test_a_cache_of_another_patch_is_refused(wrapper: dict[str, Any]) -> None:
    ids, mask = prompt(pad=(4,))
    cont = _cont(steps=1)
    a, b = build("llama", seed=0), build("llama", seed=1)
    kvhf.patch(a, backend="torch", scales=calibrate(a, ids, mask, "per-tensor"), **wrapper)
    hb = kvhf.patch(b, backend="torch", scales=calibrate(b, ids, mask, "per-tensor"), **wrapper)
    foreign = hb.new_cache()
    with pytest.raises(CacheUsageError, match=r"another kvquant\.patch") as err:
        step_logits(a, ids, mask, cont, cache=foreign)
    assert isinstance(err.value, ValueError) and "handle.new_cache()" in str(err.value)
    assert foreign.get_seq_length() == 0 and foreign.allocator is None
    # b's own cache, returned by a prefill, then b patched again with other options
    cache = returned_cache(_forward(b, ids, mask, None))
    held = cache.get_seq_length()
    kvhf.patch(b, backend="torch", page_size=8, **wrapper)
    with pytest.raises(CacheUsageError, match=r"another kvquant\.patch"):
        _decode_step(b, mask, cache)
    assert cache.get_seq_length() == held


def test_patch_with_the_same_scales_returns_the_same_handle() -> None:
    ids, mask = prompt()
    model = build("llama")
    scales = calibrate(model, ids, mask, "per-tensor")
    handle = kvhf.patch(model, backend="torch", scales=scales)
    cache = returned_cache(_forward(model, ids, mask, None))
    again = kvhf.patch(model, backend="torch", scales={k: v.clone() for k, v in scales.items()})
    assert again is handle and handle.active
    _decode_step(model, mask, cache)  # the cache of the patch still serves
    assert cache.get_seq_length() == ids.shape[1] + 1
    other = kvhf.patch(model, backend="torch", scales={k: 2 * v for k, v in scales.items()})
    assert other is not handle and other.active and not handle.active


def test_a_concurrent_forward_from_another_thread_is_refused() -> None:
    ids, mask = prompt(pad=(4,))
    cont = _cont()
    model = build("llama")
    handle = kvhf.patch(model, backend="torch")
    alone, _ = step_logits(model, ids, mask, cont)
    inside, go_on = threading.Event(), threading.Event()

    def pause(module: Any, args: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            inside.set()
            go_on.wait(30)

    pause_hook = model.model.layers[1].mlp.register_forward_pre_hook(pause)
    result: dict[str, Any] = {}

    def worker() -> None:
        try:
            result["logits"] = step_logits(model, ids, mask, cont)[0]
        except BaseException as exc:  # reported by the assertion below
            result["error"] = exc

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert inside.wait(30)
        cache = handle.new_cache()
        with pytest.raises(UnsupportedModelError, match="one thread at a time") as err:
            step_logits(model, ids, mask, cont, cache=cache)
        assert isinstance(err.value, RuntimeError)
        assert cache.get_seq_length() == 0
    finally:
        go_on.set()
        thread.join(60)
        pause_hook.remove()
    assert "error" not in result, result.get("error")
    assert torch.equal(result["logits"], alone)
    assert torch.equal(step_logits(model, ids, mask, cont)[0], alone)


def test_an_interrupted_forward_does_not_block_other_threads() -> None:
    """``KeyboardInterrupt`` stops a forward without torch's forward hooks (no release)."""
    ids, mask = prompt()
    model = build("llama")
    kvhf.patch(model, backend="torch")

    def interrupt(module: Any, args: Any) -> None:
        raise KeyboardInterrupt

    def forward_in_thread(interrupted: bool) -> dict[str, Any]:
        result: dict[str, Any] = {}

        def worker() -> None:
            try:
                result["logits"] = step_logits(model, ids, mask, _cont(steps=1))[0]
            except BaseException as exc:  # reported by the caller
                result["error"] = exc

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join(60)
        assert ("error" in result) == interrupted, result.get("error")
        return result

    hook = model.model.layers[0].mlp.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):  # in this (live) thread
        step_logits(model, ids, mask, _cont(steps=1))
    hook.remove()
    assert torch.isfinite(forward_in_thread(False)["logits"]).all()
    hook = model.model.layers[0].mlp.register_forward_pre_hook(interrupt)
    assert isinstance(forward_in_thread(True)["error"], KeyboardInterrupt)  # a thread that ended
    hook.remove()
    logits, cache = step_logits(model, ids, mask, _cont(steps=1))
    assert isinstance(cache, KVQuantCache) and torch.isfinite(logits).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cast_after_patch_matches_the_unpatched_model_cast_alike(dtype: torch.dtype) -> None:
    ids, mask = prompt(pad=(4,))
    cont = _cont()
    plain, model = build("llama"), build("llama")
    kvhf.patch(model, backend="torch", scales=calibrate(plain, ids, mask, "per-tensor"))
    plain.to(dtype)
    model.to(dtype)
    ref, _ = step_logits(plain, ids, mask, cont)
    fp8, cache = step_logits(model, ids, mask, cont)
    assert isinstance(cache, KVQuantCache) and cache.layers[0].k_pages is not None
    assert min_cosine(ref, fp8) > 0.999 and not torch.equal(ref, fp8)


def test_a_float64_model_is_refused_with_the_fix() -> None:
    ids, mask = prompt()
    model = build("llama")
    handle = kvhf.patch(model, backend="torch")
    model.double()
    cache = handle.new_cache()
    with pytest.raises(CacheUsageError, match="float64") as err:
        _forward(model, ids, mask, cache)
    assert isinstance(err.value, KVQuantError) and "model.to(torch.float32)" in str(err.value)
    assert cache.get_seq_length() == 0
    model.float()
    assert returned_cache(_forward(model, ids, mask, cache)) is cache
    assert cache.get_seq_length() == ids.shape[1]


def test_patch_again_switches_kvquant_attention_back_on() -> None:
    model = build("llama")
    handle = kvhf.patch(model, backend="torch")
    model.set_attn_implementation("sdpa")  # the FP8 cache stays, read densely
    assert kvhf.patch(model, backend="torch") is handle
    assert model.config._attn_implementation == "kvquant"
    handle.remove()
    assert model.config._attn_implementation == "sdpa"


def test_right_padding_is_refused_with_the_fix() -> None:
    ids, mask = prompt(pad=(4,))
    ids, mask = ids.flip(1), mask.flip(1)
    plain, model = build("llama"), build("llama")
    kvhf.patch(model, backend="torch")
    ref = _forward(plain, ids, mask, None)
    out = _forward(model, ids, mask, None)  # a prompt alone is the unpatched model's
    assert torch.equal(out.logits, ref.logits)
    cache = returned_cache(out)
    held = cache.get_seq_length()
    with pytest.raises(UnsupportedModelError, match="right padding") as err:
        _decode_step(model, mask, cache)
    assert "padding_side = 'left'" in str(err.value)
    assert cache.get_seq_length() == held


def test_load_state_dict_keeps_the_patch_scales_or_refuses_others() -> None:
    ids, mask = prompt(pad=(4,))
    cont = _cont()
    plain, model = build("llama"), build("llama")
    scales = calibrate(plain, ids, mask, "per-tensor")
    handle = kvhf.patch(model, backend="torch", scales=scales)
    fp8, _ = step_logits(model, ids, mask, cont)
    own = model.state_dict()
    model.load_state_dict(own)  # the patched model's own state dict
    model.load_state_dict(plain.state_dict())  # the unpatched model's: no missing keys
    model.load_state_dict({**plain.state_dict(), **scales})  # the producer's tensors, same values
    assert torch.equal(step_logits(model, ids, mask, cont)[0], fp8)
    other = {k: 10 * v if k.endswith("k_scale") else v + 1 for k, v in own.items()}
    weight = model.lm_head.weight.clone()
    with pytest.raises(ScaleFormatError, match=r"kvquant\.patch\(model, scales=state_dict\)"):
        model.load_state_dict(other)
    assert torch.equal(model.lm_head.weight, weight)  # nothing was loaded
    # the fix the message gives: patch with the new scales, then load
    again = kvhf.patch(model, backend="torch", scales=other)
    model.load_state_dict(other)
    assert again is not handle
    assert torch.equal(again.state.layer_specs[0].k_scale, 10 * handle.state.layer_specs[0].k_scale)


@pytest.mark.parametrize("graphs", [False, True])
def test_a_deepcopy_of_a_cache_continues_like_the_cache(graphs: bool) -> None:
    ids, mask = prompt(pad=(4,))
    cont = _cont(steps=6)
    model = build("llama")
    kvhf.patch(model, backend="torch", cuda_graphs=graphs)
    full, _ = step_logits(model, ids, mask, cont)
    cache = returned_cache(_forward(model, ids, mask, None))
    for s in range(3):  # decode steps (through the static step buffers with graphs)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        _forward(model, cont[:, s : s + 1], mask, cache)
    twin = copy.deepcopy(cache)
    assert twin.config is cache.config and twin.decode_graph is None
    for c in (cache, twin):
        m, got = mask, []
        for s in range(3, 6):
            m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
            got.append(_forward(model, cont[:, s : s + 1], m, c).logits[:, -1].float())
        assert torch.equal(torch.stack(got, dim=1), full[:, 4:])


def test_patch_of_a_compiled_model_patches_the_module_it_compiles() -> None:
    ids, mask = prompt(pad=(4,))
    plain, model = build("llama"), build("llama")
    want = plain.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0
    )
    before = _snapshot(model)
    compiled = torch.compile(model, backend="eager")
    handle = kvhf.patch(compiled, backend="torch", cuda_graphs=False)
    assert handle.active and model.config._attn_implementation == "kvquant"
    out = _forward(compiled, ids, mask, None)  # dynamo traced the wrapper's own hooks before
    assert isinstance(returned_cache(out), KVQuantCache)
    assert torch.equal(out.logits, _forward(plain, ids, mask, None).logits)  # the prompt: exact
    with torch.no_grad():
        got = compiled.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0
        )
    assert torch.equal(got, want)
    handle.remove()
    assert _snapshot(model) == before


def test_a_patched_model_survives_torch_save_and_load() -> None:
    import io

    ids, mask = prompt(pad=(4,))
    cont = _cont()
    plain, model = build("llama"), build("llama")
    before = _snapshot(plain)
    ref, _ = step_logits(plain, ids, mask, cont)
    kvhf.patch(model, backend="torch", scales=calibrate(plain, ids, mask, "per-head"))
    fp8, _ = step_logits(model, ids, mask, cont)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    handle = loaded._kvquant_state.handle
    assert handle.active
    got, cache = step_logits(loaded, ids, mask, cont)
    assert isinstance(cache, KVQuantCache) and torch.equal(got, fp8)
    handle.remove()
    assert _snapshot(loaded) == before
    assert torch.equal(step_logits(loaded, ids, mask, cont)[0], ref)


@pytest.mark.parametrize("graphs", [False, True])
def test_a_forward_stopped_by_keyboard_interrupt_is_cropped_at_the_next(graphs: bool) -> None:
    """torch runs no forward hook for ``KeyboardInterrupt``: the next forward crops the cache."""
    ids, mask = prompt(pad=(4,))
    cont = _cont(steps=3)
    model = build("llama")
    kvhf.patch(model, backend="torch", cuda_graphs=graphs)
    full, _ = step_logits(model, ids, mask, cont)
    cache = returned_cache(_forward(model, ids, mask, None))
    step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    _forward(model, cont[:, :1], step_mask, cache)  # a first decode step (captures with graphs)

    def interrupt(module: Any, args: Any) -> None:
        raise KeyboardInterrupt

    hook = model.model.layers[1].self_attn.register_forward_pre_hook(interrupt)
    step_mask = torch.cat([step_mask, torch.ones_like(mask[:, :1])], dim=1)
    with pytest.raises(KeyboardInterrupt):
        _forward(model, cont[:, 1:2], step_mask, cache)
    hook.remove()
    got = _forward(model, cont[:, 1:2], step_mask, cache).logits[:, -1].float()
    assert torch.equal(got, full[:, 2])
    assert cache.book.layer_lens == [ids.shape[1] + 2] * 2
