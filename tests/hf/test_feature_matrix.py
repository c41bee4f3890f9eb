"""The feature table of docs/models.md: every generation path matches the unpatched model or raises.

Each case runs the same call on an unpatched tiny Llama and on an identical
patched copy. A "matches" case asserts the patched result equals the
unpatched one (tokens, text or streamed chunks exactly; gradients exactly;
logits of a manual loop within FP8 rounding) and that the FP8 cache served
it; a "raises" case asserts a :class:`~kvquant.errors.KVQuantError` before
any layer ran. The feature table of docs/models.md lists the rows of
:data:`CASES` with their expectation (``test_docs_table_matches``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_steps import cache_kwarg, min_cosine, returned_cache, step_logits
from hf_tiny import VOCAB, build, prompt, tokenizer

import kvquant.integrations.hf as kvhf
from kvquant.errors import KVQuantError
from kvquant.integrations.hf.cache_layer import KVQuantCache

transformers = pytest.importorskip("transformers")

DOCS = Path(__file__).resolve().parents[2] / "docs" / "models.md"

_BASE: dict[str, Any] = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)


@torch.no_grad()
def _gen(model: Any, ids: torch.Tensor, mask: torch.Tensor, **kw: Any) -> Any:
    ids, mask = ids.to(model.device), mask.to(model.device)
    return model.generate(input_ids=ids, attention_mask=mask, **{**_BASE, **kw})


def _plain() -> tuple[torch.Tensor, torch.Tensor]:
    return prompt(batch=2, length=10, pad=(0, 0))


def _padded() -> tuple[torch.Tensor, torch.Tensor]:
    return prompt(batch=2, length=10, pad=(4, 0))


def greedy(model: Any, ctx: dict[str, Any]) -> Any:
    return _gen(model, *_plain())


def sampling(model: Any, ctx: dict[str, Any]) -> Any:
    torch.manual_seed(3)
    return _gen(model, *_padded(), do_sample=True, top_k=20, temperature=0.9)


def beams(model: Any, ctx: dict[str, Any]) -> Any:
    return _gen(model, *_padded(), num_beams=3)


def num_return_sequences(model: Any, ctx: dict[str, Any]) -> Any:
    torch.manual_seed(4)
    return _gen(model, *_padded(), do_sample=True, num_return_sequences=2)


def left_padding(model: Any, ctx: dict[str, Any]) -> Any:
    return _gen(model, *prompt(batch=3, length=10, pad=(5, 0, 2)))


def chunked_prefill(model: Any, ctx: dict[str, Any]) -> Any:
    return _gen(model, *prompt(batch=1, length=11, pad=(0,)), prefill_chunk_size=4)


def stop_strings(model: Any, ctx: dict[str, Any]) -> Any:
    tok = ctx["tok"]
    enc = tok(["the cat sat"], return_tensors="pt")
    # a character the unpatched model generates in its 3rd new token: both runs stop there
    stop = ctx.setdefault(
        "stop", tok.decode(_gen(ctx["ref"], enc.input_ids, enc.attention_mask)[0, -4])
    )
    kw = dict(stop_strings=[stop], tokenizer=tok, min_new_tokens=0, max_new_tokens=12)
    out = _gen(model, enc.input_ids, enc.attention_mask, **kw)
    assert out.shape[1] < enc.input_ids.shape[1] + 12  # the stop string ended generation
    return out


def streamers(model: Any, ctx: dict[str, Any]) -> Any:
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self) -> None:
            self.chunks: list[list[int]] = []

        def put(self, value: torch.Tensor) -> None:
            self.chunks.append(value.flatten().tolist())

        def end(self) -> None:
            self.chunks.append([-1])

    streamer = Collect()
    ids, mask = prompt(batch=1, length=8, pad=(0,))
    _gen(model, ids, mask, streamer=streamer)
    return streamer.chunks


def pipeline(model: Any, ctx: dict[str, Any]) -> Any:
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=ctx["tok"])
    with torch.no_grad():
        out = pipe(["hello there", "a b"], **{**_BASE, "pad_token_id": None}, batch_size=2)
    return [o[0]["generated_text"] for o in out]  # the pipeline moves inputs to the model


def chat_template(model: Any, ctx: dict[str, Any]) -> Any:
    tok = ctx["tok"]
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "what is two?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    return _gen(model, enc["input_ids"], enc["attention_mask"])


def continue_from_cache(model: Any, ctx: dict[str, Any]) -> Any:
    ids, mask = prompt(batch=1, length=8, pad=(0,))
    first = _gen(model, ids, mask, return_dict_in_generate=True)
    cache = returned_cache(first)
    more = torch.randint(3, VOCAB, (1, 3), generator=torch.Generator().manual_seed(9))
    more = more.to(model.device)
    ids2 = torch.cat([first.sequences, more], dim=1)
    second = _gen(model, ids2, torch.ones_like(ids2), **{cache_kwarg(model): cache})
    return second


def manual_loop(model: Any, ctx: dict[str, Any]) -> Any:
    ids, mask = (t.to(model.device) for t in _padded())
    key = cache_kwarg(model)
    cache = transformers.DynamicCache()
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **{key: cache})
        for _ in range(5):
            logits.append(out.logits[:, -1].float())
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(
                input_ids=logits[-1].argmax(-1, keepdim=True), attention_mask=mask, **{key: cache}
            )
    return torch.stack(logits, dim=1)


def static_cache(model: Any, ctx: dict[str, Any]) -> Any:
    return _gen(model, *_plain(), cache_implementation="static")


def sliding_window_cache(model: Any, ctx: dict[str, Any]) -> Any:
    return _gen(model, *_plain(), cache_implementation="sliding_window")


def hybrid_cache(model: Any, ctx: dict[str, Any]) -> Any:
    # transformers unsets the legacy "hybrid" name: the dynamic cache (kvquant's FP8 one)
    return _gen(model, *_plain(), cache_implementation="hybrid")


def user_static_cache(model: Any, ctx: dict[str, Any]) -> Any:
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    return _gen(model, *_plain(), past_key_values=cache)


def _compile_config(model: Any, **kw: Any) -> Any:
    model.generation_config.compile_config = transformers.CompileConfig(backend="eager")
    try:
        return _gen(model, *_plain(), **kw)
    finally:
        model.generation_config.compile_config = None
        torch._dynamo.reset()


def compile_config(model: Any, ctx: dict[str, Any]) -> Any:
    # generate compiles only over a compileable cache: neither DynamicCache nor kvquant's
    return _compile_config(model)


def compile_config_static(model: Any, ctx: dict[str, Any]) -> Any:
    return _compile_config(model, cache_implementation="static")


def compiled_model_generate(model: Any, ctx: dict[str, Any]) -> Any:
    compiled = torch.compile(model, backend="eager")
    try:
        return compiled.generate(input_ids=_plain()[0], attention_mask=_plain()[1], **_BASE)
    finally:
        torch._dynamo.reset()


def compile_forward(model: Any, ctx: dict[str, Any]) -> Any:
    model.forward = torch.compile(model.forward, backend="eager")
    try:
        return _gen(model, *prompt(batch=1, length=6, pad=(0,)), max_new_tokens=3, min_new_tokens=3)
    finally:
        del model.forward
        torch._dynamo.reset()


def assisted(model: Any, ctx: dict[str, Any]) -> Any:
    ids, mask = prompt(batch=1, length=10, pad=(0,))
    return _gen(
        model, ids, mask, assistant_model=ctx["assistant"], max_new_tokens=10, min_new_tokens=10
    )


def prompt_lookup(model: Any, ctx: dict[str, Any]) -> Any:
    ids, _ = prompt(batch=1, length=10, pad=(0,))
    ids = torch.cat([ids, ids[:, 2:8], ids[:, 2:6]], dim=1)  # repeats for the lookup to find
    kw = dict(prompt_lookup_num_tokens=3, max_new_tokens=10, min_new_tokens=10)
    return _gen(model, ids, torch.ones_like(ids), **kw)


def offloaded_cache(model: Any, ctx: dict[str, Any]) -> Any:
    return _gen(model, *_plain(), cache_implementation="offloaded")


def training(model: Any, ctx: dict[str, Any]) -> Any:
    ids, mask = (t.to(model.device) for t in _padded())
    model.train()
    try:
        loss = model(
            input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)
        ).loss
        loss.backward()
    finally:
        model.eval()
    return [p.grad.clone() for p in model.model.layers[0].self_attn.parameters()]


def output_attentions(model: Any, ctx: dict[str, Any]) -> Any:
    return _gen(model, *_plain(), output_attentions=True, return_dict_in_generate=True).attentions


CASES: dict[str, tuple[Callable[[Any, dict[str, Any]], Any], str]] = {
    "greedy": (greedy, "matches"),
    "sampling (seeded)": (sampling, "matches"),
    "beam search": (beams, "matches"),
    "num_return_sequences": (num_return_sequences, "matches"),
    "left padding": (left_padding, "matches"),
    "chunked prefill (prefill_chunk_size)": (chunked_prefill, "matches"),
    "stop strings": (stop_strings, "matches"),
    "streamers": (streamers, "matches"),
    "pipeline('text-generation')": (pipeline, "matches"),
    "chat templates": (chat_template, "matches"),
    "continue from the returned cache": (continue_from_cache, "matches"),
    "manual decode loop (user's DynamicCache)": (manual_loop, "matches"),
    "cache_implementation='static'": (static_cache, "raises"),
    "cache_implementation='sliding_window'": (sliding_window_cache, "raises"),
    "cache_implementation='hybrid'": (hybrid_cache, "matches"),
    "a user's StaticCache (past_key_values=StaticCache(...))": (user_static_cache, "raises"),
    "generation_config.compile_config": (compile_config, "matches"),
    "compile_config with cache_implementation='static'": (compile_config_static, "raises"),
    "torch.compile(model) then generate": (compiled_model_generate, "matches"),
    "torch.compile(model.forward)": (compile_forward, "matches"),
    "assisted decoding (assistant_model)": (assisted, "matches"),
    "prompt lookup decoding": (prompt_lookup, "matches"),
    "cache_implementation='offloaded'": (offloaded_cache, "raises"),
    "training (gradients, use_cache=False or not)": (training, "matches"),
    "output_attentions=True": (output_attentions, "raises"),
}
"""Row name -> (case, "matches" or "raises"); the feature table of docs/models.md lists the same."""

_SLOW = {"torch.compile(model.forward)"}


_SAMPLED = {"sampling (seeded)", "num_return_sequences"}
"""Rows that draw tokens: on CUDA, FP8 rounding may move a draw across a boundary."""


def _same_up_to_rounding(model: Any, ref: Any, got: torch.Tensor, want: torch.Tensor) -> None:
    """Sampled sequences that differ: every step's distribution differs by FP8 rounding only.

    Both runs drew from the same seed; where a draw differs, the two models' next-token
    distributions over the patched run's own sequence must still agree: logits of a prefill
    and one-token steps through each model's own cache (the patched one reads its FP8
    pages), cosine > 0.999 at every step. The sequences share their prompt.
    """
    assert got.shape == want.shape
    prompt_len = got.shape[1] - _BASE["max_new_tokens"]
    ids, cont = got[:, :prompt_len], got[:, prompt_len:]
    assert torch.equal(ids, want[:, :prompt_len])
    mask = (ids != 0).long()  # the prompts' left padding (pad_token_id 0)
    a, _ = step_logits(model, ids, mask, cont)
    b, _ = step_logits(ref, ids, mask, cont)
    assert min_cosine(a, b) > 0.999


def _same(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        if want.is_floating_point() and want.dim() == 3:  # manual-loop logits [B, steps, V]
            assert min_cosine(got, want) > 0.999
            assert torch.equal(got.argmax(-1), want.argmax(-1))
        elif want.is_floating_point():  # gradients
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:
            assert torch.equal(got, want)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _same(g, w)
    else:
        assert got == want


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(
    "row",
    [pytest.param(r, marks=[pytest.mark.slow] if r in _SLOW else []) for r in CASES],
)
def test_feature_matrix(row: str, device: str) -> None:
    """CPU: the torch reference backend; CUDA: the Triton kernels (``backend="auto"``)."""
    case, expected = CASES[row]
    ref, model = build("llama").to(device), build("llama").to(device)
    ctx: dict[str, Any] = {
        "ref": ref,
        "tok": tokenizer(),
        "assistant": build("llama", seed=7).to(device),
    }
    want = case(ref, ctx) if expected == "matches" else None
    kvhf.patch(model, backend="torch" if device == "cpu" else "auto", page_size=4)
    seen: list[Any] = []
    hook = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw.get("cache", kw.get("past_key_values"))), with_kwargs=True
    )
    try:
        if expected == "raises":
            with pytest.raises(KVQuantError):
                case(model, ctx)
            assert seen == []  # refused before any layer ran
            return
        got = case(model, ctx)
    finally:
        hook.remove()
    if row in _SAMPLED and device == "cuda" and not torch.equal(got, want):
        _same_up_to_rounding(model, ref, got, want)
    else:
        _same(got, want)
    if row.startswith("training"):
        assert all(c is None or type(c) is transformers.DynamicCache for c in seen)
    else:  # the FP8 cache served every call that had a cache
        assert seen and all(isinstance(c, KVQuantCache) for c in seen if c is not None)


def test_docs_table_matches() -> None:
    """docs/models.md's feature table lists exactly the rows above with their expectations."""
    text = DOCS.read_text()
    table = text[text.index("<!-- feature-matrix -->") : text.index("<!-- /feature-matrix -->")]
    rows = dict(re.findall(r"^\| (.+?) \| (matches|raises KVQuantError) \|", table, re.M))
    assert rows == {
        r: ("matches" if e == "matches" else "raises KVQuantError") for r, (_, e) in CASES.items()
    }
