"""``patch(model, prefill_tokens=N)``: batched prefill forwards run in row groups.

A forward of ``B`` rows of ``L > 1`` tokens with ``B * L > N`` runs the model's forward
on ``max(1, N // L)`` rows at a time into the same cache. The split must be invisible:
the same tokens and logits as the same patched model without it (fp32 CPU models), the
same cache contents row by row (pages and the k-transform's first-token buffers), and
the unpatched model within FP8 tolerance. The decoder's own forward calls are counted to
tell a split call from an unsplit one.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import transformers
from hf_kt import biased_llama, k_transform_scales
from hf_steps import assert_fp8_contents_match, cache_kwarg, calibrate, min_cosine, returned_cache
from hf_steps import generate_exactly as _generate
from hf_tiny import ALL_BUILDERS, build, prompt

import kvquant.integrations.hf as kvhf
from kvquant.errors import CacheCapacityError, OptionError, UnsupportedModelError
from kvquant.integrations.hf.rowgroups import RowGroupForward

PAD = (3, 0, 5, 1, 0)
"""Left padding of the 5 rows (5 is not a multiple of the group sizes used)."""


def _model(case: str) -> tuple[Any, dict[str, Any]]:
    """A fresh fp32 model and its patch options for a scale-format case."""
    if case == "k-transform":
        model = biased_llama()
        return model, {"scales": k_transform_scales(model, first_tokens=2)}
    family, fmt = case.split(":")
    model = build(family)
    if fmt == "fp32-group":
        return model, {}
    ids, mask = prompt(batch=2, length=24, pad=(0, 0), seed=9)
    return model, {"scales": calibrate(model, ids, mask, fmt), "scale_format": fmt}


def _count_decoder_rows(model: Any) -> list[int]:
    """Rows of every call of the decoder's own forward, appended as they happen."""
    rows: list[int] = []

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        lead = kwargs.get("input_ids")
        lead = kwargs.get("inputs_embeds") if lead is None else lead
        rows.append(int(lead.shape[0]))

    model.base_model.register_forward_pre_hook(hook, with_kwargs=True)
    return rows


CASES = ["llama:fp32-group", "llama:per-tensor", "k-transform", "gemma2:fp32-group"]


@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("case", CASES)
def test_generate_in_row_groups_equals_the_unsplit_call(case: str, chunk: int | None) -> None:
    """Greedy tokens and logits equal the unsplit patched model's; FP8 close to the unpatched."""
    ids, mask = prompt(batch=5, length=12, pad=PAD, seed=4)
    extra = {} if chunk is None else {"prefill_chunk_size": chunk}
    # 2 rows a group: 12 tokens (24 // 12) or chunks of 4 (10 // 4): groups of 2, 2, 1
    tokens = 24 if chunk is None else 10
    model, opts = _model(case)
    want_first = _generate(model, ids, mask, 1).logits[0]  # the unpatched model's prefill
    results = {}
    for prefill_tokens in (None, tokens):
        handle = kvhf.patch(model, backend="torch", prefill_tokens=prefill_tokens, **opts)
        rows = _count_decoder_rows(model)
        out = _generate(model, ids, mask, 6, **extra)
        results[prefill_tokens] = (out.sequences, torch.stack(out.logits))
        prefills = 1 if chunk is None else 3
        if prefill_tokens is None:
            assert rows == [5] * (prefills + 5)
        else:
            assert rows == [2, 2, 1] * prefills + [5] * 5  # the decode steps run whole
            stats = handle.state.row_groups.stats
            assert (stats.split_calls, stats.groups) == (prefills, 3 * prefills)
            assert stats.last_rows == [2, 2, 1]
        handle.remove()
    (seq, logits), (seq_split, logits_split) = results[None], results[tokens]
    assert torch.isfinite(logits_split).all()
    assert torch.equal(seq_split, seq)
    torch.testing.assert_close(logits_split, logits, rtol=1e-4, atol=1e-4)
    floor = 0.99 if case.startswith("gemma") else 0.999
    assert min_cosine(logits_split[0], want_first) >= floor


@pytest.mark.parametrize("family", sorted(ALL_BUILDERS))
def test_every_family_splits_like_one_call(family: str) -> None:
    """Sliding windows, softcaps, sinks, MoE outputs, KV sharing (Gemma 4: no graph runner)."""
    ids, mask = prompt(batch=5, length=12, pad=PAD, seed=4)
    model = build(family)
    results = {}
    for prefill_tokens in (None, 20):  # chunks of 6 tokens in groups of 3, 2 rows
        handle = kvhf.patch(model, backend="torch", prefill_tokens=prefill_tokens)
        out = _generate(model, ids, mask, 3, prefill_chunk_size=6)
        results[prefill_tokens] = (out.sequences, torch.stack(out.logits))
        if prefill_tokens is not None:
            assert handle.state.row_groups.stats.groups == 4
        handle.remove()
    assert torch.equal(results[20][0], results[None][0])
    torch.testing.assert_close(results[20][1], results[None][1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["llama:per-tensor", "k-transform"])
def test_the_cache_holds_each_rows_tokens_as_the_unsplit_call_stores_them(case: str) -> None:
    """Pages (dequantized) and first-token buffers of every row, after two split chunks."""
    ids, mask = prompt(batch=5, length=8, pad=PAD, seed=6)
    caches = {}
    for prefill_tokens in (None, 8):  # 2 rows of 4 tokens a group
        model, opts = _model(case)
        handle = kvhf.patch(
            model, backend="torch", page_size=4, prefill_tokens=prefill_tokens, **opts
        )
        key = cache_kwarg(model)
        cache = handle.new_cache()
        with torch.no_grad():
            for c in (0, 4):
                model(input_ids=ids[:, c : c + 4], attention_mask=mask[:, : c + 4], **{key: cache})
        caches[prefill_tokens] = cache
    whole, split = caches[None], caches[8]
    assert split.get_seq_length() == whole.get_seq_length() == 8
    assert split.reserved == whole.reserved and split.batch_size_ == 5
    for a, b in zip(whole.layers, split.layers, strict=True):
        for x, y in zip(a.dense_kv(torch.float32), b.dense_kv(torch.float32), strict=True):
            assert_fp8_contents_match(y, x)  # the groups' projections ran on fewer rows
        sa, sb = a.storage, b.storage
        if sa.first_tokens:
            assert sb.first_start.tolist() == sa.first_start.tolist() == [3, 0, 5, 1, 0]
            assert sb.first_lens.tolist() == sa.first_lens.tolist()
            torch.testing.assert_close(sb.first_k, sa.first_k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(sb.first_v, sa.first_v, rtol=1e-5, atol=1e-5)


def test_decode_graph_steps_after_a_split_prefill() -> None:
    """The static decode step (CPU, cuda_graphs=True) reads the pages the groups wrote."""
    ids, mask = prompt(batch=5, length=12, pad=PAD, seed=4)
    model = build("llama")
    results = {}
    for prefill_tokens in (None, 24):
        handle = kvhf.patch(model, backend="torch", cuda_graphs=True, prefill_tokens=prefill_tokens)
        out = _generate(model, ids, mask, 5)
        results[prefill_tokens] = (out.sequences, torch.stack(out.logits))
        assert handle.state.graph_runner.stats.static_eager == 4
        handle.remove()
    assert torch.equal(results[24][0], results[None][0])
    torch.testing.assert_close(results[24][1], results[None][1], rtol=1e-4, atol=1e-4)
    assert handle.state.row_groups.stats.last_rows == [2, 2, 1]


def test_inputs_embeds_split_like_ids() -> None:
    ids, mask = prompt(batch=4, length=6, pad=(2, 0, 0, 1), seed=2)
    model = build("llama")
    embeds = model.get_input_embeddings()(ids).detach()
    got = {}
    for prefill_tokens in (None, 12):
        handle = kvhf.patch(model, backend="torch", prefill_tokens=prefill_tokens)
        rows = _count_decoder_rows(model)
        with torch.no_grad():
            out = model(inputs_embeds=embeds, attention_mask=mask, use_cache=True)
        got[prefill_tokens] = out.logits
        assert rows == ([4] if prefill_tokens is None else [2, 2])
        assert returned_cache(out).get_seq_length() == 6
        handle.remove()
    torch.testing.assert_close(got[12], got[None], rtol=1e-4, atol=1e-4)


def _whole_cases(model: Any) -> dict[str, tuple[dict[str, Any], bool]]:
    """Calls that must run whole: keyword arguments and whether autograd is on."""
    ids, mask = prompt(batch=4, length=6, pad=(2, 0, 0, 1), seed=2)
    base = {"input_ids": ids, "attention_mask": mask, "use_cache": True}
    return {
        "one row": ({**base, "input_ids": ids[:1], "attention_mask": mask[:1]}, False),
        "within the budget": ({**base, "input_ids": ids[:2], "attention_mask": mask[:2]}, False),
        "no cache": ({**base, "use_cache": False}, False),
        "hidden states": ({**base, "output_hidden_states": True}, False),
        "gradients": (base, True),
        "labels": ({**base, "labels": ids}, False),
        "tuple output": ({**base, "return_dict": False}, False),
    }


@pytest.mark.parametrize(
    "name",
    [
        "one row",
        "within the budget",
        "no cache",
        "hidden states",
        "gradients",
        "labels",
        "tuple output",
    ],
)
def test_calls_that_run_whole(name: str) -> None:
    model = build("llama")
    kwargs, grad = _whole_cases(model)[name]
    want = model(**kwargs)
    handle = kvhf.patch(model, backend="torch", prefill_tokens=12)
    rows = _count_decoder_rows(model)
    with torch.set_grad_enabled(grad):
        got = model(**kwargs)
    assert rows == [int(kwargs["input_ids"].shape[0])]
    stats = handle.state.row_groups.stats
    assert (stats.split_calls, stats.whole_calls) == (0, 1)
    logits = got[0] if isinstance(got, tuple) else got.logits
    want_logits = want[0] if isinstance(want, tuple) else want.logits
    assert min_cosine(logits.detach(), want_logits.detach()) > 0.999


def test_decode_steps_and_training_mode_run_whole(tiny_llama: Any) -> None:
    handle = kvhf.patch(tiny_llama, backend="torch", prefill_tokens=4)
    rows = _count_decoder_rows(tiny_llama)
    ids, mask = prompt(batch=3, length=4, pad=(0, 1, 2))
    out = _generate(tiny_llama, ids, mask, 3)
    assert rows == [1, 1, 1, 3, 3]  # the prompt in groups of one row, steps whole
    assert out.sequences.shape == (3, 7)
    tiny_llama.train()
    with torch.no_grad():
        tiny_llama(input_ids=ids, attention_mask=mask, use_cache=True)
    assert rows[-1] == 3
    assert handle.state.row_groups.stats.split_calls == 1


@pytest.mark.parametrize("bad", [0, -8, True, 2.5, "4096"])
def test_bad_prefill_tokens_are_refused(tiny_llama: Any, bad: Any) -> None:
    with pytest.raises(OptionError, match=r"prefill_tokens=.*expected .*a positive int or None"):
        kvhf.patch(tiny_llama, prefill_tokens=bad)
    assert "forward" not in tiny_llama.__dict__
    assert not hasattr(tiny_llama, "_kvquant_state")
    with pytest.raises(OptionError, match="prefill_tokens"):
        kvhf.KVQuantConfig(prefill_tokens=bad)


@pytest.mark.parametrize("graphs", [False, None])
def test_remove_leaves_no_wrapper(tiny_llama: Any, graphs: bool | None) -> None:
    before = inspect.signature(tiny_llama.forward)
    handle = kvhf.patch(tiny_llama, backend="torch", cuda_graphs=graphs, prefill_tokens=16)
    wrapper = tiny_llama.__dict__["forward"]
    assert isinstance(wrapper, RowGroupForward) and handle.state.row_groups is wrapper
    assert (handle.state.graph_runner is None) == (graphs is False)
    assert inspect.signature(tiny_llama.forward) == before  # generate still finds logits_to_keep
    handle.remove()
    assert "forward" not in tiny_llama.__dict__
    assert kvhf.KVQuantConfig(prefill_tokens=16).to_dict()["prefill_tokens"] == 16


def test_patch_logs_the_option(tiny_llama: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="kvquant"):
        kvhf.patch(tiny_llama, backend="torch", prefill_tokens=2048)
    text = caplog.text
    assert "prefill row groups: at most 2048 tokens per forward" in text


def _cache_state(cache: Any) -> tuple[Any, ...]:
    layers = [layer.dense_kv(torch.float32) for layer in cache.layers]
    return (
        [layer.get_seq_length() for layer in cache.layers],
        cache.reserved,
        cache.allocator.num_used_pages,
        layers,
    )


@pytest.mark.parametrize("where", ["decoder layer", "lm_head"])
def test_a_failure_in_the_second_group_leaves_the_cache_unchanged(
    tiny_llama: Any, where: str
) -> None:
    """Inside the decoder (its rollback hook runs) or after it (only the wrapper's)."""
    ids, mask = prompt(batch=5, length=8, pad=PAD, seed=6)
    handle = kvhf.patch(tiny_llama, backend="torch", page_size=4, prefill_tokens=8)
    key = cache_kwarg(tiny_llama)
    cache = handle.new_cache()
    with torch.no_grad():
        tiny_llama(input_ids=ids[:, :4], attention_mask=mask[:, :4], **{key: cache})
    before = _cache_state(cache)
    calls = []

    def fail_second(module: Any, args: Any) -> None:
        calls.append(1)
        if len(calls) == 2:  # the second group: layer 0 (and maybe 1) has written its rows
            raise RuntimeError("injected failure")

    site = tiny_llama.model.layers[1] if where == "decoder layer" else tiny_llama.lm_head
    hook = site.register_forward_pre_hook(fail_second)
    with torch.no_grad(), pytest.raises(RuntimeError, match="injected"):
        tiny_llama(input_ids=ids[:, 4:], attention_mask=mask, **{key: cache})
    hook.remove()
    after = _cache_state(cache)
    assert after[:3] == before[:3]
    for (k0, v0), (k1, v1) in zip(before[3], after[3], strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    # the cache goes on as if the failed call never ran
    with torch.no_grad():
        got = tiny_llama(input_ids=ids[:, 4:], attention_mask=mask, **{key: cache}).logits
        fresh = handle.new_cache()
        tiny_llama(input_ids=ids[:, :4], attention_mask=mask[:, :4], **{key: fresh})
        want = tiny_llama(input_ids=ids[:, 4:], attention_mask=mask, **{key: fresh}).logits
    assert torch.equal(got, want)


def test_a_full_cache_raises_before_the_first_group(tiny_llama: Any) -> None:
    ids, mask = prompt(batch=5, length=8, pad=PAD, seed=6)
    handle = kvhf.patch(tiny_llama, backend="torch", page_size=4, prefill_tokens=8)
    key = cache_kwarg(tiny_llama)
    cache = handle.new_cache(num_pages=12)  # room for 8 tokens of 5 rows is 10 pages
    with torch.no_grad():
        tiny_llama(input_ids=ids[:, :4], attention_mask=mask[:, :4], **{key: cache})
        before = _cache_state(cache)
        rows = _count_decoder_rows(tiny_llama)
        with pytest.raises(CacheCapacityError, match="Nothing was written"):
            tiny_llama(
                input_ids=ids, attention_mask=torch.ones(5, 12, dtype=torch.long), **{key: cache}
            )
    assert rows == []
    after = _cache_state(cache)
    assert after[:3] == before[:3]


def test_an_output_field_that_cannot_be_joined_is_refused(tiny_llama: Any) -> None:
    ids, mask = prompt(batch=4, length=6, pad=(2, 0, 0, 1), seed=2)
    handle = kvhf.patch(tiny_llama, backend="torch", prefill_tokens=12)
    key = cache_kwarg(tiny_llama)
    groups = handle.state.row_groups
    inner = groups.inner

    def with_extra_field(**kwargs: Any) -> Any:
        out = inner(**kwargs)
        out["hidden_states"] = (out.logits,)  # as a model that always returned them would
        return out

    groups.inner = with_extra_field
    cache = handle.new_cache()
    with (
        torch.no_grad(),
        pytest.raises(UnsupportedModelError, match=r"'hidden_states'.*prefill_tokens=None"),
    ):
        tiny_llama(input_ids=ids, attention_mask=mask, **{key: cache})
    assert cache.get_seq_length() == 0 and cache.allocator.num_used_pages == 0
    groups.inner = inner
    with torch.no_grad():
        out = tiny_llama(input_ids=ids, attention_mask=mask, **{key: cache})
    assert out.logits.shape[0] == 4 and groups.stats.last_rows == [2, 2]


def _free_bytes_for(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    """Make the automatic bound see ``free`` bytes on every device (as on a CUDA device)."""
    from kvquant.integrations.hf import rowgroups

    monkeypatch.setattr(rowgroups, "device_free_bytes", lambda device: free)


def test_auto_runs_whole_off_cuda(tiny_llama: Any) -> None:
    """The default, ``prefill_tokens="auto"``: on a CPU model every call runs whole."""
    ids, mask = prompt(batch=4, length=6, pad=(2, 0, 0, 1), seed=2)
    handle = kvhf.patch(tiny_llama, backend="torch")
    assert handle.state.options.prefill_tokens == "auto"
    rows = _count_decoder_rows(tiny_llama)
    _generate(tiny_llama, ids, mask, 3)
    assert rows == [4, 4, 4]
    assert handle.state.row_groups.stats.split_calls == 0
    handle.remove()


@pytest.mark.parametrize("chunk", [None, 3])
def test_auto_bound_follows_the_free_memory(monkeypatch: pytest.MonkeyPatch, chunk: Any) -> None:
    """With little memory left after the KV pages, the call runs a few rows at a time; with
    plenty, whole; the tokens and logits equal the unsplit call's either way."""
    from kvquant.integrations.hf.rowgroups import AUTO_ACTIVATION_SHARE, token_activation_bytes

    ids, mask = prompt(batch=5, length=12, pad=PAD, seed=4)
    model = build("llama")
    extra = {} if chunk is None else {"prefill_chunk_size": chunk}
    handle = kvhf.patch(model, backend="torch", prefill_tokens=None)
    want = _generate(model, ids, mask, 3, **extra)
    handle.remove()
    length = ids.shape[1] if chunk is None else chunk
    per_token = token_activation_bytes(model, {"logits_to_keep": 1})
    handle = kvhf.patch(model, backend="torch")
    cache = handle.new_cache()
    cache.length_hint = None if chunk is None else ids.shape[1]  # a chunk sizes for the prompt
    pages = cache.bytes_to_hold(5, length, ids.device)  # the first prefill call's pages
    # room for two rows' activations once the call's pages are counted
    free = pages + int(2 * length * per_token / AUTO_ACTIVATION_SHARE) + 1
    _free_bytes_for(monkeypatch, free)
    rows = _count_decoder_rows(model)
    got = _generate(model, ids, mask, 3, **extra)
    assert rows[:3] == [2, 2, 1]
    if chunk is None:
        assert rows[3:] == [5, 5]  # the decode steps run whole
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(
        torch.stack(got.logits), torch.stack(want.logits), rtol=1e-4, atol=1e-4
    )
    _free_bytes_for(monkeypatch, 2**50)
    rows.clear()
    _generate(model, ids, mask, 3, **extra)
    assert rows[0] == 5  # plenty of memory: the prefill runs whole
    handle.remove()


def test_activation_estimate_of_a_llama_1b_shape() -> None:
    """The estimate, per prompt token, of a Llama-3.2-1B shape in bf16 (no model weights built):
    between the residual, Q/K/V and MLP tensors alone (about 70 KB) and a few times that."""
    from kvquant.integrations.hf.rowgroups import token_activation_bytes

    config = transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
        num_key_value_heads=8, num_hidden_layers=1, vocab_size=128256,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    kept = token_activation_bytes(model, {"logits_to_keep": 1})
    assert 70_000 < kept < 400_000
    every = token_activation_bytes(model, {})  # every position's logits kept
    assert every - kept == 2 * 128256 * (2 + 4)
