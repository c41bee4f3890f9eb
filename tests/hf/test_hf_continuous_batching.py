"""transformers' continuous batching on kvquant's FP8 pages (tiny fp32 models, CPU, torch backend).

Every request of a batch must equal the patched model's own ``generate`` for that
request alone: the same FP8 arithmetic (a prompt attends at full precision, every
later token over the FP8 pages). The static scales are coarse (the keys and values
land among FP8's subnormals), so FP8 visibly changes the tokens: each case also
checks that some request differs from the unpatched model, so that the equality
says something. Runs on transformers 5.17, 5.24 and 5.25 (CI runs ``tests/hf`` on each).
"""

from __future__ import annotations

import gc
import math
import time
from typing import Any

import pytest
import torch
from hf_kt import biased_llama, k_transform_scales
from hf_tiny import _COMMON, VOCAB, build

import kvquant.integrations.hf as kvhf
from kvquant.cache import PagedLayerStorage
from kvquant.errors import (
    BatchingError,
    CacheCapacityError,
    CacheUsageError,
    KVQuantError,
    OptionError,
    UnsupportedModelError,
)
from kvquant.integrations.hf import compat, continuous
from kvquant.integrations.hf.continuous import caches as cb_caches
from kvquant.integrations.hf.continuous import storage as cb_storage

transformers = pytest.importorskip("transformers")
ContinuousBatchingConfig = transformers.ContinuousBatchingConfig
from transformers.generation.continuous_batching import continuous_api  # noqa: E402

FLAVOUR = compat.batching_flavour()
PAGE_KEY = "page_size" if FLAVOUR == "allocators" else "block_size"
FORMATS = ("per-tensor", "per-head", "fp32-group", "k-transform", "rotated-k")
"""The FP8 formats; ``rotated-k``: fp32-group scales of Hadamard-rotated keys (``k_rotation``)."""
LENGTHS = (3, 9, 17, 30, 12)
NEW = 12


def cb_config(**kw: Any) -> Any:
    """A small ContinuousBatchingConfig: pages of 16 tokens, 64 fp32 blocks of budget, and the
    log-probabilities of the generated tokens."""
    kw.setdefault("num_blocks", 64)
    kw.setdefault("return_logprobs", True)
    kw.setdefault("max_batch_tokens", 256)
    kw.setdefault(PAGE_KEY, kw.pop("page", 16))
    return ContinuousBatchingConfig(**kw)


def gen_config(**kw: Any) -> Any:
    kw.setdefault("max_new_tokens", NEW)
    kw.setdefault("do_sample", False)
    kw.setdefault("pad_token_id", 0)
    kw.setdefault("eos_token_id", -1)  # none: every id is in the tiny vocabulary
    return transformers.GenerationConfig(**kw)


def coarse(values: tuple[float, ...]) -> dict[str, torch.Tensor]:
    """Static scales so large that the tiny model's K/V (|x| < 0.7) become FP8 subnormals."""
    scale = torch.tensor(values[0]) if len(values) == 1 else torch.tensor(values)
    return {
        f"model.layers.{i}.self_attn.{n}": scale.clone()
        for i in range(2)
        for n in ("k_scale", "v_scale")
    }


def coarse_k_transform(model: Any) -> dict[str, Any]:
    """The k-transform of hf_kt, its scales made coarse like :func:`coarse` (x64 amax)."""
    scales = k_transform_scales(model)
    for name, value in scales.items():
        if name.endswith(("k_scale", "v_scale")):
            scales[name] = value * (448 * 64 / 1.25)
    return scales


FOUR_BIT = ("nvfp4", "mxfp4", "fp8-k-nvfp4-v")
"""The 4-bit formats (their own tests: test_hf_continuous_batching_fp4.py)."""


def tiny(seed: int = 0) -> Any:
    """A tiny random Llama with head_dim 32 (one MXFP4 block, two NVFP4 blocks), fp32, eval."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON, head_dim=32))
    return model.eval()


def models(fmt: str, device: str = "cpu", **patch_kw: Any) -> tuple[Any, Any, Any]:
    """(patched model, its handle, the same model unpatched) on ``device``: the torch reference
    backend on CPU; on CUDA the Triton kernels, and eager decode steps for ``generate`` (no
    decode graph: the batch runs the same kernels eagerly). The 4-bit formats patch
    :func:`tiny` with ``kv_format`` (``fp8-k-nvfp4-v`` takes the unit FP8 K scale: the tiny
    model's checkpoint has none). ``patch_kw``: more options of the patch; without
    ``recent_tokens`` none (the ring of the newest tokens would hold most of these short
    requests exactly: its own tests pass it)."""
    opts: dict[str, Any] = (
        {"backend": "torch"} if device == "cpu" else {"backend": "auto", "cuda_graphs": False}
    )
    opts["recent_tokens"] = 0
    opts.update(patch_kw)
    if fmt in FOUR_BIT:
        model, ref = tiny().to(device), tiny().to(device)
        unit = {"missing_scales": "unit"} if fmt == "fp8-k-nvfp4-v" else {}
        handle = kvhf.patch(model, kv_format=fmt, **unit, **opts)
        assert all(s.granularity == fmt for s in handle.state.layer_specs)
        return model, handle, ref
    if fmt == "rotated-k":
        model, ref = tiny().to(device), tiny().to(device)
        handle = kvhf.patch(model, group_size=16, k_rotation="hadamard", **opts)
        assert handle.scales.granularity == "fp32-group"
        assert all(s.rotation == "hadamard" for s in handle.state.layer_specs)
        return model, handle, ref
    if fmt == "k-transform":
        model, ref = biased_llama(), biased_llama()
        scales = coarse_k_transform(model)
        model, ref = model.to(device), ref.to(device)
        handle = kvhf.patch(model, scales=scales, **opts)
    else:
        model, ref = build("llama").to(device), build("llama").to(device)
        if fmt == "fp32-group":
            handle = kvhf.patch(model, scale_format="fp32-group", group_size=16, **opts)
        else:
            values = (48.0,) if fmt == "per-tensor" else (48.0, 24.0)
            handle = kvhf.patch(model, scales=coarse(values), **opts)
    assert handle.scales.granularity == fmt
    return model, handle, ref


def prompts(lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


Run = tuple[list[int], list[float]]
"""A request's new tokens and their log-probabilities."""

SAME = 1e-5
"""Largest log-probability difference of one token between a batch and ``generate``: the
same arithmetic, batched (measured: 4.8e-7 on every format)."""

VISIBLE = 1e-3
"""Smallest log-probability change FP8 must show where it leaves the tokens as they were
(measured: 4.3e-3 for fp32-group, 1.6e-2 for per-head and k-transform)."""


def alone(model: Any, ids: list[int], **kw: Any) -> Run:
    """The model's own ``generate`` for one request: its new tokens and their log-probabilities."""
    out = model.generate(
        torch.tensor([ids], device=model.device),
        generation_config=gen_config(output_scores=True, return_dict_in_generate=True, **kw),
    )
    tokens = out.sequences[0, len(ids) :].tolist()
    lps = [
        float(torch.log_softmax(s[0].float(), -1)[t])
        for s, t in zip(out.scores, tokens, strict=True)
    ]
    return tokens, lps


def run_of(result: Any) -> Run:
    return list(result.generated_tokens), list(result.logprobs)


def tokens(runs: list[Run]) -> list[list[int]]:
    return [r[0] for r in runs]


def assert_same(got: list[Run], want: list[Run]) -> None:
    """Equal tokens, log-probabilities within :data:`SAME`."""
    assert tokens(got) == tokens(want)
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert len(a) == len(b)
        assert max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0) <= SAME


def assert_fp8_visible(got: list[Run], unpatched: list[Run]) -> None:
    """FP8 changed the result: a token, or a log-probability by more than :data:`VISIBLE`."""
    changed = tokens(got) != tokens(unpatched)
    for (ta, a), (tb, b) in zip(got, unpatched, strict=True):
        if ta == tb:
            changed |= max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0) > VISIBLE
    assert changed


class WriteCount:
    """Counts the FP8 writes of kvquant's batching caches (the pages did serve the batch)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = continuous.BatchingStorage.write

        def counted(storage: Any, *a: Any, **k: Any) -> Any:
            self.calls += 1
            return original(storage, *a, **k)

        monkeypatch.setattr(continuous.BatchingStorage, "write", counted)


@pytest.mark.parametrize("fmt", FORMATS)
def test_generate_batch_equals_each_requests_own_generate(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _, ref = models(fmt)
    writes = WriteCount(monkeypatch)
    reqs = prompts()
    out = model.generate_batch(
        reqs, generation_config=gen_config(), continuous_batching_config=cb_config(), warmup=False
    )
    assert writes.calls > 0
    got = [run_of(out[f"req_{i}"]) for i in range(len(reqs))]
    assert_same(got, [alone(model, ids) for ids in reqs])
    assert all(len(t) == NEW for t in tokens(got))
    # FP8 changed the numbers, so the equality above is not the unpatched model's
    assert_fp8_visible(got, [alone(ref, ids) for ids in reqs])
    assert continuous.live_caches() == []


@pytest.mark.parametrize("fmt", ["per-tensor", "fp32-group", "k-transform", "rotated-k", "nvfp4"])
def test_the_newest_tokens_at_full_precision_under_continuous_batching(fmt: str) -> None:
    """``recent_tokens=8`` with blocks of 16: each block keeps the ring of its newest tokens, and
    every request equals its own ``generate`` with the same ring (prompts shorter than the
    ring, ending mid-block and on a block's end; a ring spanning two blocks), which differs
    from the same patch without the ring."""
    model, handle, _ = models(fmt, recent_tokens=8)
    assert all(s.recent_tokens == 8 for s in handle.state.layer_specs)
    reqs = prompts((3, 9, 16, 17, 30, 12), seed=5)
    out = model.generate_batch(
        reqs, generation_config=gen_config(), continuous_batching_config=cb_config(), warmup=False
    )
    got = [run_of(out[f"req_{i}"]) for i in range(len(reqs))]
    assert_same(got, [alone(model, ids) for ids in reqs])
    without, _, _ = models(fmt, recent_tokens=0)
    assert_fp8_visible(got, [alone(without, ids) for ids in reqs])
    assert continuous.live_caches() == []


def test_a_ring_that_does_not_divide_the_block_is_refused_before_any_thread_starts() -> None:
    model, _, _ = models("per-tensor", recent_tokens=12)
    with pytest.raises(OptionError, match=r"must divide the block size.*recent_tokens=8"):
        model.generate_batch(
            prompts(), generation_config=gen_config(), continuous_batching_config=cb_config()
        )


def test_the_default_keeps_no_ring_in_the_blocks(caplog: pytest.LogCaptureFixture) -> None:
    """``recent_tokens="auto"`` (the default; a ring of 16 in ``generate``'s cache) keeps no
    ring in the batching blocks (of 16 tokens here, which 16 divides): every request equals its own ``generate``
    with ``recent_tokens=0`` and the cache's log line names no ring."""
    model, handle, _ = models("per-tensor", recent_tokens="auto")
    assert all(s.recent_tokens == 16 for s in handle.state.layer_specs)
    reqs = prompts((3, 9, 17, 30), seed=5)
    with caplog.at_level("INFO", logger="kvquant"):
        out = model.generate_batch(
            reqs,
            generation_config=gen_config(),
            continuous_batching_config=cb_config(),
            warmup=False,
        )
    assert "blocks of 16 tokens" in caplog.text and "each with a ring" not in caplog.text
    got = [run_of(out[f"req_{i}"]) for i in range(len(reqs))]
    without, _, _ = models("per-tensor", recent_tokens=0)
    assert_same(got, [alone(without, ids) for ids in reqs])
    assert_fp8_visible(got, [alone(model, ids) for ids in reqs])  # generate keeps its 16
    assert continuous.live_caches() == []


class PlanCount:
    """Counts the steps planned on transformers' decode path and on the host, the one-token
    prompts the decode path carried, the padded steps and the steps captured in CUDA graphs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decode = self.host = self.solo = self.padded = self.captured = 0
        original = cb_storage.build_plan

        def counted(kwargs: dict[str, Any], *a: Any) -> Any:
            plan = original(kwargs, *a)
            if plan.solo is None:
                self.host += 1
                self.padded += plan.padding > 0
            elif torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                self.decode += 1  # captured into a CUDA graph: no value can be read
                self.captured += 1
            else:
                self.decode += 1
                self.solo += int(plan.solo.sum())
                self.padded += bool((plan.launches[0].seq_lens == 0).any())
            return plan

        monkeypatch.setattr(cb_storage, "build_plan", counted)


needs_decode_path = pytest.mark.skipif(
    FLAVOUR != "allocators", reason="transformers 5.17 has no decode path"
)


@needs_decode_path
@pytest.mark.parametrize("fmt", [*FORMATS, *FOUR_BIT])
def test_decode_steps_take_the_decode_path_and_equal_generate(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step after the prompts' is a decode-path step (one query token per request),
    planned on the device from transformers' block table; so is the first step of one-token
    prompts, which attend over themselves alone at full precision. Every request equals its
    own ``generate``."""
    model, _, _ = models(fmt)
    for lengths in ((1, 1, 1), (3, 9, 17, 30)):
        plans = PlanCount(monkeypatch)
        reqs = prompts(lengths, seed=7)
        out = model.generate_batch(
            reqs,
            generation_config=gen_config(),
            continuous_batching_config=cb_config(),
            warmup=False,
        )
        got = [run_of(out[f"req_{i}"]) for i in range(len(reqs))]
        assert_same(got, [alone(model, ids) for ids in reqs])
        one_token = lengths[0] == 1
        assert (plans.host, plans.decode) == (0, NEW) if one_token else (1, NEW - 1)
        assert plans.solo == (len(reqs) if one_token else 0)
    assert continuous.live_caches() == []


@needs_decode_path
@pytest.mark.parametrize(("blocks", "host"), [(0, NEW), (1, 5)])
def test_the_decode_path_takes_requests_within_its_blocks(
    blocks: int, host: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``max_blocks_per_request=0`` keeps every step on the host plan; 1 (of 16 tokens) takes a
    step to the decode path only while every request's new token lands in its first block
    (prompts of 3 and 9 tokens: steps 2 to 8 on the decode path, the rest on the host). Both
    equal ``generate``."""
    model, _, _ = models("k-transform", recent_tokens=4)
    plans = PlanCount(monkeypatch)
    reqs = prompts((3, 9), seed=2)
    out = model.generate_batch(
        reqs,
        generation_config=gen_config(),
        continuous_batching_config=cb_config(max_blocks_per_request=blocks),
        warmup=False,
    )
    got = [run_of(out[f"req_{i}"]) for i in range(len(reqs))]
    assert_same(got, [alone(model, ids) for ids in reqs])
    assert (plans.host, plans.decode) == (host, NEW - host)


def pad_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make transformers pad every step as it does for CUDA graphs (or a compiled step): it
    captures no graph on the CPU and so pads nothing there by itself."""
    from transformers.generation.continuous_batching import model_runner

    original = model_runner.ModelRunner.__init__

    def padded(runner: Any, *a: Any, **k: Any) -> None:
        original(runner, *a, **k)
        runner.pad_inputs = True

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", padded)


@needs_decode_path
@pytest.mark.parametrize("fmt", [*FORMATS, *FOUR_BIT])
def test_padded_steps_equal_generate(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers pads the steps it replays from CUDA graphs: a prompt step to a multiple
    of its query interval (query tokens of no request, requests with no query, trash read
    entries), a decode step to a power of two (rows of length 0); with the decode path off
    (``max_blocks_per_request=0``) the decode steps are padded prompt steps. The padding
    writes no slot of a request, attends to zeros, and every request equals its own
    ``generate``."""
    pad_every_step(monkeypatch)
    attend, empty = cb_storage.LayerStep.attend, torch.empty
    outputs: list[tuple[torch.Tensor, Any]] = []

    def poisoned(step: Any, *a: Any, **k: Any) -> Any:
        """The attention with every fresh tensor NaN until written; its output kept."""

        def nan_empty(*shape: Any, **kw: Any) -> torch.Tensor:
            return empty(*shape, **kw).fill_(float("nan"))

        with pytest.MonkeyPatch.context() as m:
            m.setattr(torch, "empty", nan_empty)
            out, weights = attend(step, *a, **k)
        outputs.append((out.detach().clone(), step.plan))
        return out, weights

    monkeypatch.setattr(cb_storage.LayerStep, "attend", poisoned)
    model, _, _ = models(fmt)
    for lengths, blocks in (((1, 1, 1), None), ((3, 9, 17), None), ((3, 9, 17), 0)):
        plans = PlanCount(monkeypatch)
        reqs = prompts(lengths, seed=5)
        out = model.generate_batch(
            reqs,
            generation_config=gen_config(),
            continuous_batching_config=cb_config(
                max_requests_per_batch=8, max_blocks_per_request=blocks
            ),
            warmup=False,
        )
        got = [run_of(out[f"req_{i}"]) for i in range(len(reqs))]
        assert_same(got, [alone(model, ids) for ids in reqs])
        # three requests: every step is padded (to 4 rows, or to the query interval)
        assert plans.padded == plans.host + plans.decode == NEW
        assert plans.decode == (0 if blocks == 0 else NEW - (lengths[0] > 1))
        assert all(bool(out.isfinite().all()) for out, _ in outputs)
        # query tokens of no request, rows of length 0: zeros
        unused = [
            out[0, plan.tokens - plan.padding :]
            if plan.solo is None
            else out[0, plan.launches[0].seq_lens == 0]
            for out, plan in outputs
        ]
        assert sum(t.numel() for t in unused) and not any(bool(t.any()) for t in unused)
        outputs.clear()
    assert continuous.live_caches() == []


@needs_decode_path
def test_decode_graphs_asked_for_on_the_cpu_run_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """``use_cuda_graph=(False, True)`` is taken; with no graph backend (the CPU) transformers
    turns graphs off and kvquant keeps them off: every step runs eagerly, unpadded."""
    model, _, _ = models("fp32-group")
    plans = PlanCount(monkeypatch)
    reqs = prompts((3, 9), seed=4)
    out = model.generate_batch(
        reqs,
        generation_config=gen_config(),
        continuous_batching_config=cb_config(use_cuda_graph=(False, True)),
        warmup=False,
    )
    assert_same(
        [run_of(out[f"req_{i}"]) for i in range(len(reqs))], [alone(model, i) for i in reqs]
    )
    assert (plans.host, plans.decode, plans.padded) == (1, NEW - 1, 0)


@needs_decode_path
@pytest.mark.parametrize("fmt", [*FORMATS, *FOUR_BIT])
def test_padded_chunks_equal_the_same_batch_unpadded(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts split into chunks (24 tokens a step) read the earlier chunks from the pages, so
    they are compared with the same batch unpadded, not with ``generate``: padded steps with
    chunks (a launch of several queries per row) give the same tokens and log-probabilities,
    with a ring of 4 newest tokens per block."""
    model, _, _ = models(fmt, recent_tokens=4)
    reqs = prompts((3, 9, 30, 21), seed=8)
    original, chunked, padded = cb_storage.build_plan, [0, 0], [0, 0]

    def counted(kwargs: dict[str, Any], *a: Any) -> Any:
        plan = original(kwargs, *a)
        chunks = any(x.gather.shape[1] > 1 for x in plan.launches)
        chunked[len(runs)] += chunks
        padded[len(runs)] += chunks and plan.padding > 0
        return plan

    monkeypatch.setattr(cb_storage, "build_plan", counted)
    runs: list[list[Run]] = []
    for pad in (False, True):
        if pad:
            pad_every_step(monkeypatch)
        out = model.generate_batch(
            reqs,
            generation_config=gen_config(),
            continuous_batching_config=cb_config(max_requests_per_batch=8, max_batch_tokens=24),
            warmup=False,
        )
        runs.append([run_of(out[f"req_{i}"]) for i in range(len(reqs))])
    # the same chunk steps; padded the second time unless a step fills its 24 tokens
    assert chunked[0] == chunked[1] and padded[1] > 0 == padded[0]
    assert_same(runs[1], runs[0])


def test_a_prompt_alone_is_its_value_weighted_against_the_sink() -> None:
    """A one-token prompt on the decode path attends over its own key alone: its value, times
    ``exp(s) / (exp(s) + exp(sink))`` where the head has a sink (``s`` its score, after any
    softcap), as softmax over the key and the sink gives."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 8, generator=g)
    key, value = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    sinks = torch.randn(4, generator=g)
    k = key[0].transpose(0, 1).repeat_interleave(2, dim=1)
    v = value[0].transpose(0, 1).repeat_interleave(2, dim=1)
    assert torch.equal(cb_storage._alone(q, key, value, 0.3, None, None).reshape(5, 4, 8), v)
    for softcap in (None, 2.0):
        score = (q * k).sum(-1) * 0.3
        if softcap:
            score = softcap * torch.tanh(score / softcap)
        both = torch.softmax(torch.stack((score, sinks.expand(5, 4)), -1), -1)[..., 0]
        got = cb_storage._alone(q, key, value, 0.3, softcap, sinks).reshape(5, 4, 8)
        torch.testing.assert_close(got, v * both[..., None], rtol=1e-6, atol=1e-6)


def test_paged_generate_equals_generate() -> None:
    model, _, ref = models("per-tensor")
    reqs = prompts((11, 11, 11), seed=3)
    ids = torch.tensor(reqs)
    out = model.generate(
        ids,
        generation_config=gen_config(),
        cache_implementation="paged",
        continuous_batching_config=cb_config(),
    )
    rows = out.reshape(len(reqs), -1)
    got = [row[11:].tolist() for row in rows]
    assert got == tokens([alone(model, r) for r in reqs])
    assert got != tokens([alone(ref, r) for r in reqs])


def _wait_for(manager: Any, request_id: str, tokens: int, limit: float = 120.0) -> None:
    """Block until the streaming request ``request_id`` produced ``tokens`` tokens."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        result = manager.get_result(request_id=request_id, timeout=0.5)
        if result is not None and len(result.generated_tokens) >= tokens:
            return
    raise AssertionError(f"{request_id} did not reach {tokens} tokens")


@pytest.mark.parametrize("fmt", ["per-tensor", "k-transform"])
def test_requests_arriving_while_others_decode(fmt: str) -> None:
    """The manager API: B and C arrive while A decodes, with other lengths and budgets (steps
    that mix prompts and decode steps; k-transform: first tokens written and read in one)."""
    model, _, ref = models(fmt)
    a, b, c = prompts((20, 5, 33), seed=7)
    manager = model.init_continuous_batching(
        generation_config=gen_config(max_new_tokens=16), continuous_batching_config=cb_config()
    )
    manager.start()
    try:
        manager.add_request(a, request_id="a", max_new_tokens=16, streaming=True)
        _wait_for(manager, "a", 3)
        manager.add_request(b, request_id="b", max_new_tokens=9)
        manager.add_request(c, request_id="c", max_new_tokens=14)
        finals: dict[str, Run] = {}
        deadline = time.monotonic() + 120
        while len(finals) < 3 and time.monotonic() < deadline:
            result = manager.get_result(timeout=0.5)
            if result is not None and result.is_finished():
                finals[result.request_id] = run_of(result)
    finally:
        manager.stop(block=True)
    budgets = {"a": (a, 16), "b": (b, 9), "c": (c, 14)}
    got = [finals[k] for k in budgets]
    assert_same(got, [alone(model, p, max_new_tokens=n) for p, n in budgets.values()])
    assert_fp8_visible(got, [alone(ref, p, max_new_tokens=n) for p, n in budgets.values()])


@pytest.mark.parametrize("fmt", ["per-head", "nvfp4"])
def test_eos_mid_batch_stops_each_request_where_its_generate_stops(fmt: str) -> None:
    model, _, _ = models(fmt)
    reqs = prompts(seed=11)
    free = tokens([alone(model, ids) for ids in reqs])
    # an id that first appears mid-way in one request and never in another
    eos, stop = next(
        (t, p + 1)
        for r in free
        for p, t in enumerate(r)
        if 3 <= p < NEW - 2 and t not in r[:p] and any(t not in other for other in free)
    )
    out = model.generate_batch(
        reqs,
        generation_config=gen_config(eos_token_id=eos),
        continuous_batching_config=cb_config(),
        warmup=False,
    )
    got = [run_of(out[f"req_{i}"]) for i in range(len(reqs))]
    assert_same(got, [alone(model, ids, eos_token_id=eos) for ids in reqs])
    lengths = [len(t) for t in tokens(got)]
    assert stop in lengths and NEW in lengths  # one stopped mid-way, another ran to the end
    assert continuous.live_caches() == []


def test_sampling_with_a_seed() -> None:
    """transformers' batching seeds one generator for the whole batch (``seed`` of the config);
    no request has a seed of its own. A lone request draws what ``generate`` draws after
    ``torch.manual_seed(seed)``; a batch draws the same tokens again with the same seed."""
    model, _, _ = models("per-tensor")
    reqs = prompts(seed=5)
    sample = {"do_sample": True, "temperature": 1.5, "top_k": 0}
    one = model.generate_batch(
        reqs[:1],
        generation_config=gen_config(**sample),
        continuous_batching_config=cb_config(seed=1234),
        warmup=False,
    )
    torch.manual_seed(1234)
    assert one["req_0"].generated_tokens == alone(model, reqs[0], **sample)[0]

    def batch(seed: int) -> list[list[int]]:
        out = model.generate_batch(
            reqs,
            generation_config=gen_config(**sample),
            continuous_batching_config=cb_config(seed=seed),
            warmup=False,
        )
        return [out[f"req_{i}"].generated_tokens for i in range(len(reqs))]

    first = batch(99)
    assert batch(99) == first
    assert batch(100) != first


@pytest.mark.parametrize("recent", [0, 8])
def test_a_shared_prefix_reads_the_first_requests_fp8_blocks(
    recent: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefix sharing: B's prompt starts with A's first two full blocks, reused from A.

    B then attends over those blocks in FP8, exactly as the patched model does when it
    continues from a cache that holds the prefix (not as ``generate`` on B alone,
    which attends over its whole prompt at full precision). With a ring of 8 newest
    tokens per block, B's newest 8 start inside the second shared block: they come from
    the ring A's prompt left in that block."""
    model, handle, _ = models("per-tensor", recent_tokens=recent)
    matched: list[int] = []
    cls = cb_caches._cache_class()
    original = cls.search_prefix_match

    def search(self: Any, request_id: str, prompt_ids: list[int]) -> int:
        found = original(self, request_id, prompt_ids)
        if request_id == "b":
            matched.append(found)
        return int(found)

    monkeypatch.setattr(cls, "search_prefix_match", search)
    a, tail = prompts((40, 7), seed=13)
    b = a[:33] + tail[:2]  # 2 full blocks of 16 shared, then B's own tokens
    manager = model.init_continuous_batching(
        generation_config=gen_config(max_new_tokens=8), continuous_batching_config=cb_config()
    )
    manager.start()
    try:
        manager.add_request(a, request_id="a", max_new_tokens=8, streaming=True)
        _wait_for(manager, "a", 1)  # A's prompt blocks are written and hashed
        manager.add_request(b, request_id="b", max_new_tokens=8)
        got = None
        deadline = time.monotonic() + 120
        while got is None and time.monotonic() < deadline:
            result = manager.get_result(request_id="b", timeout=0.5)
            if result is not None and result.is_finished():
                got = run_of(result)
    finally:
        manager.stop(block=True)
    assert matched == [32]  # B found A's two full blocks
    assert got is not None
    assert_same([got], [_continued(model, handle, b, 32, max_new_tokens=8)])
    assert_fp8_visible([got], [alone(model, b, max_new_tokens=8)])  # the FP8 prefix counts


def _continued(model: Any, handle: Any, ids: list[int], cached: int, **kw: Any) -> Run:
    """The patched model continuing from a cache that holds the first ``cached`` tokens of
    ``ids`` (the later tokens attend over them in FP8): its new tokens and log-probabilities."""
    cache = handle.new_cache()
    with torch.no_grad():
        model(torch.tensor([ids[:cached]]), **{_cache_kwarg(model): cache}, use_cache=True)
    out = model.generate(
        torch.tensor([ids]),
        generation_config=gen_config(output_scores=True, return_dict_in_generate=True, **kw),
        **{_cache_kwarg(model): cache},
    )
    toks = out.sequences[0, len(ids) :].tolist()
    lps = [
        float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, toks, strict=True)
    ]
    return toks, lps


@pytest.mark.parametrize("recent", [0, 8])
def test_num_return_sequences_copies_the_fp8_blocks(recent: int) -> None:
    """Parallel sampling: transformers prefills the prompt but its last token, then forks the
    request (copying the FP8 blocks the copies do not share, their rings of newest tokens
    with them); each copy's last prompt token attends over the FP8 pages. With ``top_k=1``
    every copy draws the same tokens."""
    model, handle, _ = models("per-tensor", recent_tokens=recent)
    reqs = prompts((21, 40), seed=17)
    greedy = {"do_sample": True, "top_k": 1}
    out = model.generate_batch(
        reqs,
        generation_config=gen_config(num_return_sequences=3, **greedy),
        continuous_batching_config=cb_config(),
        warmup=False,
    )
    # transformers 5.24 returns the copies; 5.17 forks them too, but returns the prompts' own
    assert len(out) == (6 if FLAVOUR == "allocators" else 2)
    for i, ids in enumerate(reqs):
        want = _continued(model, handle, ids, len(ids) - 1, **greedy)
        copies = [
            out[k] for k in (f"req_{i}", f"req_{i}__child#0", f"req_{i}__child#1") if k in out
        ]
        assert_same([run_of(c) for c in copies], [want] * len(copies))


def _cache_kwarg(model: Any) -> str:
    return "past_key_values" if compat.cache_keyword(model.model) == "past_key_values" else "cache"


# ---------------------------------------------------------------------- sizing


@pytest.mark.parametrize("fmt", ["per-tensor", "fp32-group"])
def test_num_blocks_is_a_budget_the_fp8_cache_holds_more_blocks_of(fmt: str) -> None:
    model, handle, _ = models(fmt)
    manager = model.init_continuous_batching(
        generation_config=gen_config(), continuous_batching_config=cb_config(num_blocks=10)
    )
    manager.start()
    try:
        manager.add_request(prompts((5,))[0], request_id="x", max_new_tokens=2)
        deadline = time.monotonic() + 60
        while manager.batch_processor is None and time.monotonic() < deadline:
            time.sleep(0.05)
        cache = manager.batch_processor.cache
        layout = cache.kvq.layout
    finally:
        manager.stop(block=True)
    # 10 fp32 blocks of 16 tokens, 2 layers, 2 KV heads of 16: 10 * 2*2*16*2*16*4 bytes
    budget = 10 * 2 * 2 * 16 * 2 * 16 * 4
    assert layout.dense_block_bytes(torch.float32) * 10 == budget
    per_layer = 2 * 16 * 2 * 16  # FP8 K and V codes of one layer
    if fmt == "fp32-group":  # + fp32 K and V scales: 16 tokens x 2 heads x 1 group of 16
        per_layer += 2 * 128  # 2 * 4 * 16 * 2 * 1 = 256 bytes, each part 128-aligned
    assert layout.bytes_per_block == 2 * per_layer
    assert cache.num_blocks == budget // layout.bytes_per_block
    assert cache.num_blocks == (40 if fmt == "per-tensor" else 32)
    del handle


def test_a_bf16_budget_holds_twice_the_blocks_in_fp8() -> None:
    """Llama-3.2-1B shapes: 16 layers, 8 KV heads of 64, pages of 256 tokens."""
    shape = dict(num_layers=16, page_size=256, num_kv_heads=8, head_dim=64)
    per_tensor = continuous.BlockLayout(**shape)
    assert per_tensor.dense_block_bytes(torch.bfloat16) == 2 * per_tensor.bytes_per_block
    grouped = continuous.BlockLayout(**shape, n_groups=1)  # fp32 scales, G = 64
    ratio = per_tensor.dense_block_bytes(torch.bfloat16) / grouped.bytes_per_block
    assert ratio == pytest.approx(2 / (1 + 4 / 64))  # the group scales are counted


def test_memory_sized_cache_counts_fp8_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """No num_blocks: the free memory, less one step's activations, buys FP8 blocks."""
    layout = continuous.BlockLayout(num_layers=2, page_size=16, num_kv_heads=2, head_dim=16)
    free = 8 << 20
    monkeypatch.setattr(cb_storage, "_memory_breakdown", lambda: (free, 0, 0))
    config = build("llama").config
    cfg = cb_config(num_blocks=None, max_batch_tokens=64, max_memory_percent=0.5)
    tokens, blocks = continuous.plan_blocks(cfg, config, layout, torch.float32)
    step = 64 * (max(64 * 4 + VOCAB * 4, 4 * (64 + 64 + 64 + 128)) + 52)
    assert tokens == 64
    assert blocks == (free // 2 - 2 * layout.bytes_per_block - step) // (layout.bytes_per_block + 8)
    monkeypatch.setattr(cb_storage, "_memory_breakdown", lambda: (4096, 0, 0))
    with pytest.raises(CacheCapacityError, match="hold no FP8 block"):
        continuous.plan_blocks(cfg, config, layout, torch.float32)


# ---------------------------------------------------------------------- failures


def test_a_failure_in_the_batching_thread_reaches_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, _, _ = models("per-tensor")
    calls = {"n": 0}
    original = PagedLayerStorage.write

    def failing(self: Any, *a: Any, **k: Any) -> None:
        calls["n"] += 1
        if calls["n"] > 6:  # after a few steps, inside transformers' batching thread
            raise CacheUsageError("kernel refused (test)")
        original(self, *a, **k)

    monkeypatch.setattr(PagedLayerStorage, "write", failing)
    reqs = prompts()
    with pytest.raises(CacheUsageError, match="kernel refused"):
        model.generate_batch(
            reqs,
            generation_config=gen_config(),
            continuous_batching_config=cb_config(),
            warmup=False,
        )
    calls["n"] = 0
    with pytest.raises(CacheUsageError, match="kernel refused"):
        model.generate(
            torch.tensor([reqs[0]]),
            generation_config=gen_config(),
            cache_implementation="paged",
            continuous_batching_config=cb_config(),
        )
    calls["n"] = 0
    manager = model.init_continuous_batching(
        generation_config=gen_config(), continuous_batching_config=cb_config()
    )
    manager.start()
    try:
        manager.add_request(reqs[0], request_id="r", max_new_tokens=NEW)
        with pytest.raises(CacheUsageError, match="kernel refused"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                manager.get_result(timeout=0.5)
    finally:
        manager.stop(block=True)
    assert continuous.live_caches() == []


def test_a_request_the_cache_cannot_hold_is_a_batching_error() -> None:
    """transformers' own failure (no block left, nothing to offload) names kvquant's fix."""
    model, _, _ = models("per-tensor")
    req = prompts((60,))[0]
    with pytest.raises(BatchingError, match="num_blocks") as info:
        model.generate_batch(
            [req],
            generation_config=gen_config(max_new_tokens=40),
            continuous_batching_config=cb_config(num_blocks=1),
            warmup=False,
        )
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, KVQuantError)


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"use_cuda_graph": True}, r"use_cuda_graph=\(False, True\) \(decode steps only"),
        ({"use_cuda_graph": (True, False)}, "prompts or chunks on the host"),
        ({"use_cuda_graph": (False, True, True)}, "a \\(prompt steps, decode steps\\) pair"),
        pytest.param(
            {"use_cuda_graph": (False, True), "max_blocks_per_request": 0},
            "max_blocks_per_request=0 turns off",
            marks=needs_decode_path,
        ),
        pytest.param(
            {"use_cuda_graph": (False, True)},
            "transformers 5.17 does not have",
            marks=pytest.mark.skipif(FLAVOUR == "allocators", reason="5.24 captures them"),
        ),
        ({"page": 4}, "page size of at least 8"),
    ],
)
def test_options_kvquant_cannot_honour_are_refused_in_the_callers_thread(
    option: dict[str, Any], match: str
) -> None:
    model = biased_llama()
    if "page" in option:  # 8 first tokens kept at full precision: pages of 4 cannot hold them
        kvhf.patch(model, scales=k_transform_scales(model, first_tokens=8), backend="torch")
    else:
        kvhf.patch(model, scales=coarse((48.0,)), backend="torch")
    with pytest.raises(OptionError, match=match):
        model.generate_batch(
            prompts((4,)),
            generation_config=gen_config(),
            continuous_batching_config=cb_config(**option),
        )
    assert model.config._attn_implementation == "kvquant"


def test_sliding_window_models_are_refused_before_any_thread_starts() -> None:
    model = build("mistral")
    kvhf.patch(model, backend="torch")
    with pytest.raises(UnsupportedModelError, match="full-attention layers only"):
        model.generate_batch(
            prompts((4,)), generation_config=gen_config(), continuous_batching_config=cb_config()
        )


# ---------------------------------------------------------------------- memory and removal


def test_no_memory_left_after_the_manager_stops_and_after_remove(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the cyclic collector off (transformers' own gc.collect() calls neutralised too),
    the FP8 buffer dies with the batch processor; remove() leaves nothing of kvquant."""
    monkeypatch.setattr(gc, "collect", lambda *a, **k: 0)
    monkeypatch.setattr(cb_caches, "_registry", {})  # other tests' patched models apart
    gc.disable()
    try:
        model, handle, _ = models("fp32-group")
        buffers: list[Any] = []
        original = continuous.BatchingStorage.__init__

        def spy(self: Any, buffer: torch.Tensor, *a: Any, **k: Any) -> None:
            buffers.append(__import__("weakref").ref(buffer))
            original(self, buffer, *a, **k)

        monkeypatch.setattr(continuous.BatchingStorage, "__init__", spy)
        model.generate_batch(
            prompts(),
            generation_config=gen_config(),
            continuous_batching_config=cb_config(),
            warmup=False,
        )
        manager = model.init_continuous_batching(
            generation_config=gen_config(), continuous_batching_config=cb_config()
        )
        manager.start()
        manager.add_request(prompts((6,))[0], request_id="m", max_new_tokens=3)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r = manager.get_result(timeout=0.5)
            if r is not None and r.is_finished():
                break
        manager.stop(block=True)
        del manager, r
        assert len(buffers) == 2 and all(ref() is None for ref in buffers)
        assert continuous.live_caches() == []
        assert isinstance(continuous_api.PagedAttentionCache, cb_caches._CacheFactory)
        handle.remove()
        assert not isinstance(continuous_api.PagedAttentionCache, cb_caches._CacheFactory)
        assert "init_continuous_batching" not in model.__dict__
        assert "generate_batch" not in model.__dict__
        assert not hasattr(model, "_kvquant_state")
    finally:
        gc.enable()


def test_remove_gives_transformers_its_batching_back() -> None:
    model, handle, ref = models("per-tensor")
    reqs = prompts((7, 13), seed=2)
    model.generate_batch(
        reqs, generation_config=gen_config(), continuous_batching_config=cb_config(), warmup=False
    )
    handle.remove()
    out = model.generate_batch(
        reqs, generation_config=gen_config(), continuous_batching_config=cb_config(), warmup=False
    )
    assert [out[f"req_{i}"].generated_tokens for i in range(2)] == tokens(
        [alone(ref, r) for r in reqs]
    )


def test_an_unpatched_model_keeps_transformers_cache_while_a_patched_one_batches() -> None:
    model, _, ref = models("per-tensor")
    reqs = prompts((7, 13), seed=4)
    model.generate_batch(
        reqs, generation_config=gen_config(), continuous_batching_config=cb_config(), warmup=False
    )
    assert isinstance(continuous_api.PagedAttentionCache, cb_caches._CacheFactory)
    other = build("llama")
    out = other.generate_batch(
        reqs, generation_config=gen_config(), continuous_batching_config=cb_config(), warmup=False
    )
    assert [out[f"req_{i}"].generated_tokens for i in range(2)] == tokens(
        [alone(ref, r) for r in reqs]
    )
    assert continuous.live_caches() == []


# ---------------------------------------------------------------------- the step plan


def _kwargs(cu_q: list[int], cu_k: list[int], write: list[int], read: list[int]) -> dict[str, Any]:
    i64 = torch.long
    return {
        "cu_seq_lens_q": torch.tensor(cu_q, dtype=torch.int32),
        "cu_seq_lens_k": {"full_attention": torch.tensor(cu_k, dtype=torch.int32)},
        "write_index": [torch.tensor(write, dtype=i64)],
        "read_index": [torch.tensor(read, dtype=i64)],
    }


def test_the_step_plan_splits_prompts_from_paged_rows() -> None:
    """Row 0: a prompt of 3; row 1: a decode step at position 17 (2 pages); row 2: the
    second chunk of a split prompt (tokens 4..5 of 6, one page)."""
    layout = continuous.BlockLayout(num_layers=1, page_size=16, num_kv_heads=1, head_dim=16)
    write = [5 * 16 + 0, 5 * 16 + 1, 5 * 16 + 2, 8 * 16 + 1, 2 * 16 + 4, 2 * 16 + 5]
    read = [5, 7, 8, 2]  # the page ids of each request, in batch order
    plan = continuous.build_plan(_kwargs([0, 3, 4, 6], [0, 3, 21, 27], write, read), layout)
    assert plan.tokens == 6
    assert plan.slots.tolist() == [write]
    assert plan.fresh == [(0, 3)]
    assert len(plan.launches) == 1  # 2 paged rows of 1 and 2 queries: one launch
    launch = plan.launches[0]
    assert launch.gather.tolist() == [[3, 3], [4, 5]]
    assert launch.valid.tolist() == [0, 2, 3]
    assert launch.tokens.tolist() == [3, 4, 5]
    assert launch.block_tables.tolist() == [[7, 8], [2, 2]]
    assert launch.seq_lens.tolist() == [18, 6]
    assert launch.q_lens.tolist() == [1, 2]


def test_the_step_plan_gives_long_chunks_a_launch_of_their_own() -> None:
    layout = continuous.BlockLayout(num_layers=1, page_size=4, num_kv_heads=1, head_dim=16)
    # rows 0..2 decode (1 page each), row 3 a 10-token chunk after 2 cached tokens
    cu_q, cu_k = [0, 1, 2, 3, 13], [0, 3, 3 + 2, 5 + 4, 9 + 12]
    write = [1, 9, 13] + [20 + i for i in range(2, 12)]
    read = [0, 2, 3, 5, 6, 7]
    plan = continuous.build_plan(_kwargs(cu_q, cu_k, write, read), layout)
    assert [launch.gather.shape[1] for launch in plan.launches] == [1, 10]
    assert plan.launches[0].q_lens is None and plan.launches[0].valid is None
    assert plan.launches[1].block_tables.tolist() == [[5, 6, 7]]


def _reference_plan(
    cu_q: list[int], cu_k: list[int], read: list[int], write: list[int], ps: int, nf: int, ring: int
) -> dict[str, Any]:
    """The plan's contents request by request, from their definitions (``ring``: tokens of the
    ring each block keeps of its newest tokens)."""
    rows, offset = [], 0  # (first query token, queries, cached before, tokens after, page offset)
    for b in range(len(cu_q) - 1):
        q_len, kv_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if q_len > 0:
            rows.append((cu_q[b], q_len, kv_len - q_len, kv_len, offset))
            offset += -(-kv_len // ps)
    first_block = [read[r[4]] if read else write[r[0]] // ps for r in rows]
    writes = [
        (r[0] + p - r[2], first_block[i], p)
        for i, r in enumerate(rows)
        for p in range(r[2], min(r[2] + r[1], nf))
    ]
    # the ring: a new token stays if no newer token of the step lands in its block's slot
    ring_writes = [
        (r[0] + p - r[2], write[r[0] + p - r[2]] // ps, p % ring)
        for r in rows
        for p in range(r[2], r[3])
        if ring and p > min(r[3] - 1, p // ps * ps + ps - 1) - ring
    ]

    def ring_blocks(r: tuple[int, ...]) -> list[int]:
        """Slot s: the block of the newest position < kv_len that is s mod ring (or of 0)."""
        newest = {p % ring: p for p in range(r[3] - ring, r[3])}
        return [read[r[4] + max(newest[s], 0) // ps] for s in range(ring)]

    paged = [i for i, r in enumerate(rows) if r[2] > 0]
    groups = [paged] if paged else []
    longest = max((rows[i][1] for i in paged), default=1)
    if longest > 1 and len(paged) * longest > 2 * sum(rows[i][1] for i in paged):
        groups = [g for g in ([i for i in paged if rows[i][1] == 1], [i for i in paged if rows[i][1] > 1]) if g]  # fmt: skip
    launches = []
    for g in groups:
        lq = max(rows[i][1] for i in g)
        width = max(-(-rows[i][3] // ps) for i in g)
        launches.append({
            "gather": [[rows[i][0] + min(j, rows[i][1] - 1) for j in range(lq)] for i in g],
            "valid": [n * lq + j for n, i in enumerate(g) for j in range(rows[i][1])],
            "tokens": [rows[i][0] + j for i in g for j in range(rows[i][1])],
            "block_tables": [
                [read[rows[i][4] + min(j, -(-rows[i][3] // ps) - 1)] for j in range(width)]
                for i in g
            ],
            "seq_lens": [rows[i][3] for i in g],
            "q_lens": [rows[i][1] for i in g],
            "first_pages": [first_block[i] for i in g] if nf else None,
            "first_lens": [min(nf, rows[i][3]) for i in g] if nf else None,
            "recent_blocks": [ring_blocks(rows[i]) for i in g] if ring else None,
        })  # fmt: skip
    fresh = [(r[0], r[1]) for r in rows if r[2] == 0]
    return {
        "fresh": fresh,
        "writes": writes if nf else [],
        "ring_writes": ring_writes,
        "launches": launches,
    }


def test_the_step_plan_matches_its_definition_on_random_batches() -> None:
    """Random mixes of prompts, decode steps, chunks and requests without queries, page sizes,
    first tokens and rings of newest tokens: every index vector of the plan, its dtypes, and
    the padding rules."""
    gen = torch.Generator().manual_seed(3)

    def pick(options: list[int]) -> int:
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    checked = rings = 0
    for _ in range(300):
        ps, nf = pick([1, 2, 4, 16]), pick([0, 0, 1, 3])
        ring = pick([0, 0] + [r for r in (1, 2, 4, 8) if ps % r == 0])
        cu_q, cu_k = [0], [0]
        prompts_only = pick([0, 0, 0, 1]) == 1
        for _ in range(pick([1, 2, 3, 5, 8])):
            q_len = pick([0, 1, 1, 1, 2, 5, 9])
            past = 0 if prompts_only else pick([0, 0, 1, 3, 7, 20])
            cu_q.append(cu_q[-1] + q_len)
            cu_k.append(cu_k[-1] + past + q_len)
        if cu_q[-1] == 0:
            continue
        pages = sum(
            -(-(cu_k[b + 1] - cu_k[b]) // ps) for b in range(len(cu_q) - 1) if cu_q[b + 1] > cu_q[b]
        )
        read = [100 + 3 * i for i in range(pages)] if not prompts_only else []
        write = [int(x) for x in torch.randint(0, 999, (cu_q[-1],), generator=gen)]
        layout = continuous.BlockLayout(1, ps, 1, 16, first_tokens=nf, recent_tokens=ring)
        plan = continuous.build_plan(_kwargs(cu_q, cu_k, write, read), layout)
        want = _reference_plan(cu_q, cu_k, read, write, ps, nf, ring)
        assert plan.tokens == cu_q[-1] and plan.slots.tolist() == [write]
        assert plan.fresh == want["fresh"]
        if want["writes"]:
            assert plan.first_writes is not None
            assert [t.tolist() for t in plan.first_writes] == [
                list(c) for c in zip(*want["writes"], strict=True)
            ]
        else:
            assert plan.first_writes is None
        if want["ring_writes"]:
            assert plan.recent_writes is not None
            assert [t.tolist() for t in plan.recent_writes] == [
                list(c) for c in zip(*want["ring_writes"], strict=True)
            ]
            rings += 1
        else:
            assert plan.recent_writes is None
        assert len(plan.launches) == len(want["launches"])
        for launch, expect in zip(plan.launches, want["launches"], strict=True):
            every = all(q == len(expect["gather"][0]) for q in expect["q_lens"])
            assert launch.gather.dtype == torch.long and launch.tokens.dtype == torch.long
            assert launch.gather.tolist() == expect["gather"]
            assert launch.tokens.tolist() == expect["tokens"]
            assert launch.block_tables.dtype == torch.int32
            assert launch.block_tables.tolist() == expect["block_tables"]
            assert launch.seq_lens.dtype == torch.int32
            assert launch.seq_lens.tolist() == expect["seq_lens"]
            if every:
                assert launch.valid is None and launch.q_lens is None
            else:
                assert launch.valid.tolist() == expect["valid"]
                assert launch.q_lens.dtype == torch.int32
                assert launch.q_lens.tolist() == expect["q_lens"]
            if nf:
                assert launch.first_pages.tolist() == expect["first_pages"]
                assert launch.first_lens.dtype == torch.int32
                assert launch.first_lens.tolist() == expect["first_lens"]
            else:
                assert launch.first_pages is None and launch.first_lens is None
            if ring:
                assert launch.recent_blocks.dtype == torch.long
                assert launch.recent_blocks.tolist() == expect["recent_blocks"]
            else:
                assert launch.recent_blocks is None
            checked += 1
    assert checked > 100  # most batches had paged requests
    assert rings > 50


def test_a_padded_step_plans_its_requests_and_leaves_the_padding_out() -> None:
    """transformers pads a step (CUDA graphs) past its last request: query tokens of no request
    writing the trash slot, requests with no query (``cu_seq_lens`` at a plateau), read-trash
    entries past the page ids. The plan is the unpadded step's, with the padding's slots as
    given and ``padding`` counting its query tokens."""
    layout = continuous.BlockLayout(num_layers=1, page_size=16, num_kv_heads=1, head_dim=16)
    trash, write = 16 * 40, [5 * 16 + 3, 8 * 16 + 1]
    unpadded = continuous.build_plan(_kwargs([0, 1, 2], [0, 4, 18], write, [5, 7, 8]), layout)
    cu_q, cu_k = [0, 1, 2, 2, 2], [0, 4, 18, 18, 18]
    padded = continuous.build_plan(
        _kwargs(cu_q, cu_k, write + [trash] * 6, [5, 7, 8] + [0] * 13), layout
    )
    assert (padded.tokens, padded.padding, unpadded.padding) == (8, 6, 0)
    assert padded.slots.tolist() == [write + [trash] * 6] and padded.fresh == unpadded.fresh == []
    (a,), (b,) = padded.launches, unpadded.launches
    for field in ("gather", "tokens", "block_tables", "seq_lens"):
        assert getattr(a, field).tolist() == getattr(b, field).tolist()


def test_a_plan_that_does_not_match_the_batch_is_refused() -> None:
    layout = continuous.BlockLayout(num_layers=1, page_size=16, num_kv_heads=1, head_dim=16)
    with pytest.raises(BatchingError, match="write slots"):
        continuous.build_plan(_kwargs([0, 2], [0, 2], [1], []), layout)
    with pytest.raises(BatchingError, match="page ids"):
        continuous.build_plan(_kwargs([0, 1], [0, 20], [3], [1]), layout)


def test_the_decode_path_plan_equals_the_host_plan_on_random_decode_steps() -> None:
    """transformers' decode path (5.24 and later) passes a block table instead of read and
    write indices: the plan computed from it on the device has the host plan's write slots,
    side writes (and sends the first-token writes a request does not make to the trash
    block), block tables, lengths, first pages and ring blocks, for random decode steps with
    one-token prompts among them (marked ``solo``, attended by the host plan as prompts).
    Rows of length 0 after them (the padding of a CUDA graph's step) write no slot, send
    their side writes to the trash block and attend over no key."""
    gen = torch.Generator().manual_seed(11)

    def pick(options: list[int]) -> int:
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    solos = rings = firsts = padding = 0
    for _ in range(200):
        ps, nf = pick([1, 2, 4, 16]), pick([0, 0, 1, 3])
        ring = pick([0, 0] + [r for r in (1, 2, 4, 8) if ps % r == 0])
        width, trash = pick([4, 8, 40]), 997
        lens = [pick([1, 1, 2, 3, 5, 16, 17, 33]) for _ in range(pick([1, 2, 3, 6]))]
        lens = [n for n in lens if -(-n // ps) <= width] or [1]
        blocks, next_id, table = [], 5, torch.full((1, len(lens), width), -1, dtype=torch.int32)
        for b, n in enumerate(lens):
            ids = list(range(next_id, next_id + -(-n // ps)))
            next_id += len(ids) + pick([0, 1, 3])
            blocks.append(ids)
            table[0, b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        cu_q = list(range(len(lens) + 1))
        cu_k = [0, *torch.tensor(lens).cumsum(0).tolist()]
        write = [blocks[b][(n - 1) // ps] * ps + (n - 1) % ps for b, n in enumerate(lens)]
        # every request's pages, prompts' included, once some request reads the cache
        read = [i for ids in blocks for i in ids] if max(lens) > 1 else []
        layout = continuous.BlockLayout(1, ps, 1, 16, first_tokens=nf, recent_tokens=ring)
        host = continuous.build_plan(_kwargs(cu_q, cu_k, write, read), layout)
        pad = pick([0, 0, 1, 3])
        padded = torch.cat((table, torch.full((1, pad, width), -1, dtype=torch.int32)), 1)
        kwargs = _kwargs(cu_q + cu_q[-1:] * pad, cu_k + cu_k[-1:] * pad, [trash] * len(lens), [])
        kwargs["block_table"] = padded
        whole = continuous.build_plan(kwargs, layout, trash_block=trash)
        assert whole.tokens == len(lens) + pad and whole.slots.tolist() == [write + [-1] * pad]
        assert whole.solo.tolist() == [n == 1 for n in lens] + [False] * pad
        assert whole.launches[0].seq_lens.tolist() == lens + [0] * pad
        for writes in (whole.first_writes, whole.recent_writes):
            if writes is not None:
                assert writes[1][len(lens) :].tolist() == [trash] * pad
        padding += pad
        kwargs = _kwargs(cu_q, cu_k, [trash] * len(lens), [])
        kwargs["block_table"] = table
        dev = continuous.build_plan(kwargs, layout, trash_block=trash)
        assert dev.tokens == len(lens) and dev.slots.tolist() == [write]
        assert dev.solo.tolist() == [n == 1 for n in lens]
        for got, want in (
            (whole.first_writes, dev.first_writes),
            (whole.recent_writes, dev.recent_writes),
        ):
            if want is not None:
                assert [t[: len(lens)].tolist() for t in got] == [t.tolist() for t in want]
        assert dev.fresh == [] and host.fresh == [(b, 1) for b, n in enumerate(lens) if n == 1]
        solos += sum(n == 1 for n in lens)
        if nf:
            tok, blk, pos = (t.tolist() for t in dev.first_writes)
            kept = [(t, b, p) for t, b, p in zip(tok, blk, pos, strict=True) if b != trash]
            want = (
                []
                if host.first_writes is None
                else list(zip(*(t.tolist() for t in host.first_writes), strict=True))
            )
            assert kept == want
            assert all(p == 0 for b, p in zip(blk, pos, strict=True) if b == trash)
            firsts += len(kept)
        else:
            assert dev.first_writes is None
        if ring:
            assert [t.tolist() for t in dev.recent_writes] == [
                t.tolist() for t in host.recent_writes
            ]
            rings += 1
        else:
            assert dev.recent_writes is None
        (launch,) = dev.launches
        assert launch.gather.tolist() == [[b] for b in range(len(lens))]
        assert launch.tokens.tolist() == list(range(len(lens)))
        assert launch.valid is None and launch.q_lens is None
        assert launch.block_tables.dtype == torch.int32 and launch.seq_lens.dtype == torch.int32
        assert launch.seq_lens.tolist() == lens
        assert launch.block_tables.tolist() == table[0].clamp(min=0).tolist()
        paged = [b for b, n in enumerate(lens) if n > 1]
        for hl in host.launches:  # the host plan's rows are the paged requests, in order
            for i, b in enumerate(hl.tokens.tolist()):
                assert b in paged
                pages = -(-lens[b] // ps)
                assert (
                    hl.block_tables[i, :pages].tolist() == launch.block_tables[b, :pages].tolist()
                )
                assert int(hl.seq_lens[i]) == lens[b]
                if nf:
                    assert int(hl.first_pages[i]) == int(launch.first_pages[b])
                    assert int(hl.first_lens[i]) == int(launch.first_lens[b])
                if ring:
                    assert hl.recent_blocks[i].tolist() == launch.recent_blocks[b].tolist()
    assert solos > 50 and rings > 50 and firsts > 20 and padding > 50


def test_block_layout_views_do_not_overlap_and_the_kernels_accept_them() -> None:
    layout = continuous.BlockLayout(
        num_layers=2, page_size=4, num_kv_heads=2, head_dim=16, n_groups=2, first_tokens=1,
        recent_tokens=2, side_dtype=torch.float32,
    )  # fmt: skip
    assert {"recent_k", "recent_v"} <= set(layout.views(torch.zeros(layout.bytes_per_block,
        dtype=torch.uint8), 0, 1))  # fmt: skip
    blocks = 3
    buffer = torch.zeros(blocks * layout.bytes_per_block, dtype=torch.uint8)
    owner = torch.full((buffer.numel(),), -1)
    for layer in range(2):
        for i, (name, view) in enumerate(sorted(layout.views(buffer, layer, blocks).items())):
            start = view.data_ptr() - buffer.data_ptr()
            size = view.element_size()
            offsets = torch.zeros(view.shape, dtype=torch.long)
            for dim, stride in enumerate(view.stride()):
                shape = [1] * view.dim()
                shape[dim] = view.shape[dim]
                offsets = offsets + torch.arange(view.shape[dim]).view(shape) * stride
            for byte in range(size):
                idx = start + offsets.reshape(-1) * size + byte
                assert bool((owner[idx] == -1).all()), (layer, name)
                owner[idx] = layer * 10 + i
    storage = PagedLayerStorage(
        blocks, 4, 2, 16, granularity="fp32-group", group_size=8, backend="torch",
        pages={
            k: v
            for k, v in layout.views(buffer, 1, blocks).items()
            if not k.startswith(("first", "recent"))
        },
    )  # fmt: skip
    k = torch.randn(1, 5, 2, 16)
    storage.write(k, k, torch.tensor([[0, 1, 2, 3, 4]]))
    got = storage.dense(torch.tensor([[0, 1]], dtype=torch.int32), 5)[0]
    assert float((got - k).abs().max()) <= float(k.abs().max()) / 8  # FP8 of the same keys
    assert bool((buffer.view(-1, layout.bytes_per_block)[:, : layout.bytes_per_page] == 0).all())
    assert math.isclose(layout.bytes_per_block % 128, 0)


def test_the_ring_adds_its_keys_and_values_to_each_block() -> None:
    """Blocks of 256 tokens at 8 KV heads of 64 in a bf16 model: a ring of 16 adds 16 keys and
    16 values in bf16 per layer, an eighth of the FP8 pages' bytes."""
    plain = continuous.BlockLayout(num_layers=16, page_size=256, num_kv_heads=8, head_dim=64)
    ring = continuous.BlockLayout(
        num_layers=16, page_size=256, num_kv_heads=8, head_dim=64, recent_tokens=16
    )
    assert ring.bytes_per_page - plain.bytes_per_page == 2 * 16 * 8 * 64 * 2
    assert ring.bytes_per_block / plain.bytes_per_block == 1.125
    assert ring.ring_note == ", each with a ring of its 16 newest tokens (11% of its bytes)"
    assert plain.ring_note == ""


@pytest.mark.parametrize("fmt", ["fp32-group", "rotated-k"])
def test_the_kernels_read_the_batching_buffer_itself(fmt: str) -> None:
    """No copy: every layer's FP8 pages are views of the one buffer transformers' cache holds
    (and a K rotation reaches every layer's storage)."""
    model, _, _ = models(fmt)
    manager = model.init_continuous_batching(
        generation_config=gen_config(), continuous_batching_config=cb_config()
    )
    manager.start()
    try:
        manager.add_request(prompts((5,))[0], request_id="x", max_new_tokens=2)
        deadline = time.monotonic() + 60
        while manager.batch_processor is None and time.monotonic() < deadline:
            time.sleep(0.05)
        cache = manager.batch_processor.cache
        buffer = cache.cache_tensor if FLAVOUR == "allocators" else cache.kvq_buffer
        base = buffer.untyped_storage().data_ptr()
        for storage in cache.kvq.layers:
            for t in (
                storage.k_pages,
                storage.v_pages,
                storage.k_group_scales,
                storage.v_group_scales,
            ):
                assert t.untyped_storage().data_ptr() == base
            assert (storage.k_rotation is not None) == (fmt == "rotated-k")
        assert buffer.numel() == cache.kvq.layout.bytes_per_block * cache.kvq.layers[0].num_pages
    finally:
        manager.stop(block=True)


# ---------------------------------------------------------------------- GPU (Triton kernels)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FORMATS + FOUR_BIT)
def test_gpu_generate_batch_equals_each_requests_own_generate(fmt: str) -> None:
    """CUDA, Triton kernels: the batch's paged launches over the block views and the lone
    request's decode steps over its own pages (FP8 or 4-bit) run the same kernels (fp32 model,
    so that the projections round alike); no batching cache outlives the call."""
    model, _, ref = models(fmt, "cuda")
    reqs = prompts()
    out = model.generate_batch(
        reqs, generation_config=gen_config(), continuous_batching_config=cb_config(), warmup=False
    )
    got = [run_of(out[f"req_{i}"]) for i in range(len(reqs))]
    assert_same(got, [alone(model, ids) for ids in reqs])
    assert_fp8_visible(got, [alone(ref, ids) for ids in reqs])
    assert continuous.live_caches() == []


@pytest.mark.gpu
@needs_cuda
@needs_decode_path
@pytest.mark.parametrize("fmt", FORMATS + FOUR_BIT)
def test_gpu_decode_steps_replayed_from_cuda_graphs_equal_generate(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA, ``use_cuda_graph=(False, True)``: transformers captures the decode-path steps
    (padded to a power of two: 5 requests run 8 rows) and replays them, so kvquant plans only
    the captured ones; every request equals its own ``generate``, and no cache outlives the
    call."""
    model, _, _ = models(fmt, "cuda", recent_tokens=4)
    plans = PlanCount(monkeypatch)
    reqs = prompts()
    out = model.generate_batch(
        reqs,
        generation_config=gen_config(),
        continuous_batching_config=cb_config(
            use_cuda_graph=(False, True), max_requests_per_batch=8
        ),
        warmup=False,
    )
    got = [run_of(out[f"req_{i}"]) for i in range(len(reqs))]
    assert_same(got, [alone(model, ids) for ids in reqs])
    assert plans.host == 1 and plans.captured >= 1  # the prompt step runs eagerly
    assert plans.decode < NEW - 1  # a replay runs no Python, so plans nothing
    assert plans.padded == plans.host + plans.decode - plans.captured
    assert continuous.live_caches() == []


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["fp32-group", "k-transform", "nvfp4"])
def test_gpu_the_newest_tokens_at_full_precision_under_continuous_batching(fmt: str) -> None:
    """CUDA, Triton kernels, ``recent_tokens=8`` in blocks of 16: each launch reads its rows'
    rings gathered from their blocks; every request equals its own ``generate`` with the ring."""
    model, _, _ = models(fmt, "cuda", recent_tokens=8)
    reqs = prompts((3, 9, 16, 17, 30, 12), seed=5)
    out = model.generate_batch(
        reqs, generation_config=gen_config(), continuous_batching_config=cb_config(), warmup=False
    )
    got = [run_of(out[f"req_{i}"]) for i in range(len(reqs))]
    assert_same(got, [alone(model, ids) for ids in reqs])
    without, _, _ = models(fmt, "cuda")
    assert_fp8_visible(got, [alone(without, ids) for ids in reqs])
    assert continuous.live_caches() == []


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "graphs",
    [None, pytest.param((False, True), marks=needs_decode_path, id="decode-graphs")],
)
def test_gpu_no_memory_left_after_the_manager_stops_and_after_remove(graphs: Any) -> None:
    """Also with decode steps captured in CUDA graphs (their memory pool and the graphs die
    with the batch processor)."""
    model, handle, _ = models("per-tensor", "cuda")
    reqs = prompts()
    alone(model, reqs[0])  # the allocator's and cuBLAS's first allocations happen here
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model.generate_batch(
        reqs,
        generation_config=gen_config(),
        continuous_batching_config=cb_config(use_cuda_graph=graphs),
        warmup=False,
    )
    torch.cuda.synchronize()
    # The batching thread's cuBLAS handle got its own workspace; stopping frees it too.
    assert torch.cuda.memory_allocated() <= before
    handle.remove()
    assert torch.cuda.memory_allocated() <= before
