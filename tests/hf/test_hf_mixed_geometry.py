"""A model whose layers differ in head_dim and KV heads (Gemma 4 text): one storage per layer geometry.

The tiny Gemma 4 of ``hf_tiny`` has a sliding layer of 2 KV heads x head_dim 16
and a full-attention layer of 1 KV head x head_dim 32 (transformers' own
``global_head_dim`` / ``num_global_key_value_heads`` options). The family test
(logits, greedy, left padding, ``remove()``) is in test_hf_families.py; these
tests check what the mixed geometry changes: static scales of each layer's
shape, the fp32-group size, the static decode step, and the refusals; and
Gemma 4's KV sharing (later layers attend over an earlier layer's K/V).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hf_steps import calibrate, generate_exactly, min_cosine, step_logits
from hf_tiny import _gemma4, build, prompt

import kvquant.integrations.hf as kvhf
from kvquant.errors import ScaleFormatError
from kvquant.integrations.hf.models import find_attention_sites, model_geometry

FP8_MAX = 448.0


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, mask = prompt(batch=2, length=10, pad=(3, 0))
    cont = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    return ids, mask, cont


def test_geometry_is_per_layer() -> None:
    model = build("gemma4_text")
    geometry = model_geometry(model, find_attention_sites(model))
    assert not geometry.uniform
    assert [geometry.kv_heads_of(i) for i in range(2)] == [2, 1]
    assert [geometry.head_dim_of(i) for i in range(2)] == [16, 32]
    assert geometry.layer(1).uniform and geometry.layer(1).head_dim == 32


def _simulated_static(model: Any, specs: list[Any]) -> Any:
    """HF's eager attention over K/V rounded through FP8 with each layer's static scales."""
    eager = importlib.import_module(type(model).__module__).eager_attention_forward

    def rounded(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        s = scale.reshape(1, -1, 1, 1) if scale.dim() else scale
        q = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return (q.float() * s).to(x.dtype)

    def attend(module, query, key, value, attention_mask, **kw):  # type: ignore[no-untyped-def]
        if query.shape[2] > 1:  # the prompt attends over its unquantized K/V, as in kvquant
            return eager(module, query, key, value, attention_mask, **kw)
        spec = specs[module.layer_idx]
        key, value = rounded(key, spec.k_scale), rounded(value, spec.v_scale)
        return eager(module, query, key, value, attention_mask, **kw)

    return attend


@pytest.mark.parametrize("granularity", ["per-tensor", "per-head"])
def test_static_scales_of_each_layer_equal_simulated_rounding(granularity: str) -> None:
    """Each layer reads its own shape of scale and stores pages of its own geometry.

    The random tiny Gemma 4 amplifies FP8 rounding itself (min cosine 0.97-0.98 to the
    unquantized logits for rounding alone), so kvquant is compared with that rounding
    simulated on HF's own attention path, with the same scales.
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    model = build("gemma4_text")
    ids, mask, cont = _inputs()
    ref, _ = step_logits(model, ids, mask, cont)
    scales = calibrate(model, ids, mask, granularity)
    handle = kvhf.patch(
        model,
        scales=scales,
        scale_format=granularity,
        backend="torch",
        page_size=4,
        recent_tokens=0,  # the simulation rounds every key
    )
    specs = handle.state.layer_specs
    assert [(s.num_kv_heads, s.head_dim) for s in specs] == [(2, 16), (1, 32)]
    want = [(), ()] if granularity == "per-tensor" else [(2,), (1,)]
    assert [tuple(s.k_scale.shape) for s in specs] == want
    got, cache = step_logits(model, ids, mask, cont)
    assert [tuple(layer.k_pages.shape[2:]) for layer in cache.layers] == [(2, 16), (1, 32)]
    assert torch.isfinite(got).all() and not torch.equal(got, ref)
    handle.remove()
    AttentionInterface.register("kvquant_test_static", _simulated_static(model, specs))
    AttentionMaskInterface.register("kvquant_test_static", eager_mask)
    model.set_attn_implementation("kvquant_test_static")
    sim, _ = step_logits(model, ids, mask, cont)
    model.set_attn_implementation("eager")
    assert min_cosine(got, sim) >= 0.99999
    assert min_cosine(got, ref) >= 0.95
    again, _ = step_logits(model, ids, mask, cont)
    assert torch.equal(again, ref)


def test_group_size_divides_every_head_dim() -> None:
    model = build("gemma4_text")
    handle = kvhf.patch(model, backend="torch")
    assert {s.group_size for s in handle.state.layer_specs} == {16}  # 64 capped at gcd(16, 32)
    handle.remove()
    before = dict(model.state_dict())
    with pytest.raises(ScaleFormatError, match=r"head_dim=16 of some layers.*\[16, 32\]"):
        kvhf.patch(model, scale_format="fp32-group", group_size=32, backend="torch")
    assert not hasattr(model, "_kvquant_state")
    assert model.state_dict().keys() == before.keys()


def test_scale_of_another_layers_shape_is_refused() -> None:
    """A per-head scale with the sliding layers' 2 KV heads on the 1-KV-head full layer."""
    model = build("gemma4_text")
    ids, mask, _ = _inputs()
    scales = calibrate(model, ids, mask, "per-head")
    scales["model.layers.1.self_attn.k_scale"] = torch.full((2, 1, 1), 0.01)
    with pytest.raises(ScaleFormatError, match=r"layers\.1\.self_attn\.k_scale.*1 KV head;"):
        kvhf.patch(model, scales=scales, scale_format="per-head", backend="torch")
    assert not hasattr(model, "_kvquant_state")


def test_static_decode_step_equals_ordinary_step() -> None:
    model = build("gemma4_text")
    ids, mask = prompt(batch=3, length=20, pad=(7, 0, 2))
    results = {}
    for graphs in (False, True):
        handle = kvhf.patch(model, backend="torch", page_size=4, cuda_graphs=graphs)
        out = generate_exactly(model, ids, mask, 9)
        results[graphs] = (out.sequences, torch.stack(out.logits))
        if graphs:
            assert handle.state.graph_runner.stats.static_eager == 8
        handle.remove()
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])


def _shared() -> Any:
    """Gemma 4 whose last two layers reuse the K/V of layers 0 (sliding) and 1 (full)."""
    torch.manual_seed(0)
    types = ["sliding_attention", "full_attention"] * 2
    model = _gemma4(num_hidden_layers=4, layer_types=types, num_kv_shared_layers=2).eval()
    model.set_attn_implementation("eager")
    return model


@contextmanager
def _simulated_dynamic(model: Any) -> Iterator[None]:
    """HF's eager attention over K/V rounded like kvquant's fp32-group pages (G=16).

    A forward over an empty cache attends over its own unquantized K/V (kvquant hands them
    back); every later forward attends over rounded K/V, its own new tokens included.
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    from benchmarks.harness.accuracy import fake_quantize_kv

    eager = importlib.import_module(type(model).__module__).eager_attention_forward
    fresh = [True]

    def watch(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        fresh[0] = cache is None or cache.get_seq_length() == 0

    def attend(module, query, key, value, attention_mask, **kw):  # type: ignore[no-untyped-def]
        if not fresh[0]:
            key = fake_quantize_kv(key.float(), None, group_size=16).to(key.dtype)
            value = fake_quantize_kv(value.float(), None, group_size=16).to(value.dtype)
        return eager(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("kvquant_test_dynamic", attend)
    AttentionMaskInterface.register("kvquant_test_dynamic", eager_mask)
    hook = model.model.register_forward_pre_hook(watch, with_kwargs=True)
    model.set_attn_implementation("kvquant_test_dynamic")
    try:
        yield
    finally:
        hook.remove()
        model.set_attn_implementation("eager")


def test_kv_sharing_layers_read_their_source_layer() -> None:
    """Shared layers attend over the K/V of their source layer's FP8 pages: simulated rounding.

    The random tiny model amplifies FP8 rounding itself (min cosine 0.966 to the unquantized
    logits for rounding alone), so kvquant is compared with that rounding simulated on HF's
    own attention path: decode steps of a left-padded batch, greedy with chunked prefill,
    beam search.
    """
    model = _shared()
    ids, mask, cont = _inputs()
    ref, _ = step_logits(model, ids, mask, cont)
    with _simulated_dynamic(model):
        sim, _ = step_logits(model, ids, mask, cont)
        sim_chunked = generate_exactly(model, ids, mask, 6, prefill_chunk_size=4)
        sim_beams = generate_exactly(model, ids, mask, 6, num_beams=3)
    handle = kvhf.patch(model, backend="torch", page_size=4, group_size=16, recent_tokens=0)
    assert [s.kv_source for s in handle.state.sites] == [None, None, 0, 1]
    assert [s.kv_reused for s in handle.state.layer_specs] == [True, True, False, False]
    assert handle.state.graph_runner is None  # no CUDA-graph step for shared K/V
    got, cache = step_logits(model, ids, mask, cont)
    assert [layer.seq_len for layer in cache.layers] == [
        22,
        22,
        0,
        0,
    ]  # shared layers store nothing
    assert not torch.equal(got, ref)
    assert min_cosine(got, sim) >= 0.99999
    chunked = generate_exactly(model, ids, mask, 6, prefill_chunk_size=4)
    assert torch.equal(chunked.sequences, sim_chunked.sequences)
    assert min_cosine(torch.stack(chunked.logits), torch.stack(sim_chunked.logits)) >= 0.99999
    beams = generate_exactly(model, ids, mask, 6, num_beams=3)
    assert torch.equal(beams.sequences, sim_beams.sequences)
    handle.remove()
    again, _ = step_logits(model, ids, mask, cont)
    assert torch.equal(again, ref)


def test_kv_sharing_refuses_cuda_graphs_before_any_change() -> None:
    from kvquant.errors import OptionError

    model = _shared()
    before = sorted(k for m in model.modules() for k in m.__dict__)
    with pytest.raises(OptionError, match=r"cuda_graphs=True.*KV sharing.*cuda_graphs=None"):
        kvhf.patch(model, backend="torch", cuda_graphs=True)
    assert sorted(k for m in model.modules() for k in m.__dict__) == before
    assert model.config._attn_implementation == "eager"


def test_calibration_refuses_mixed_kv_heads() -> None:
    from kvquant.calibrate import calibrate as kv_calibrate
    from kvquant.errors import CalibrationError

    model = build("gemma4_text")
    ids = torch.randint(3, 128, (1, 32), generator=torch.Generator().manual_seed(2))
    with pytest.raises(
        CalibrationError, match=r"different KV-head counts.*1 KV head x head_dim 32"
    ):
        kv_calibrate(model, ids, granularity="per-head", progress=False)


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True], ids=["mixed", "kv-sharing"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernels_match_the_reference_on_gpu(shared: bool, dtype: torch.dtype) -> None:
    """The Triton kernels on each layer's own geometry agree with the torch reference.

    (On CPU the Triton interpreter's FP8 cast rounds some values to the wrong binade, so this
    comparison runs on the GPU.)
    """
    model = (_shared() if shared else build("gemma4_text")).to(device="cuda", dtype=dtype)
    ids, mask = prompt(batch=2, length=40, pad=(5, 0))
    ids, mask = ids.cuda(), mask.cuda()
    cont = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(5)).cuda()
    got = {}
    for backend in ("triton", "torch"):
        # eager steps: this compares kernels (the decode graph: the test below)
        handle = kvhf.patch(model, backend=backend, group_size=16, cuda_graphs=False)
        got[backend], cache = step_logits(model, ids, mask, cont)
        assert cache.layers[0].k_pages.is_cuda
        handle.remove()
    assert torch.isfinite(got["triton"]).all()
    # bf16 activations round differently in the two backends' attention (test_hf_gpu.py's floor)
    floor = 0.995 if dtype == torch.bfloat16 else 0.999
    assert min_cosine(got["triton"], got["torch"]) >= floor


@pytest.mark.gpu
@pytest.mark.parametrize("compile_step", [False, None])
def test_decode_graph_captures_on_gpu(compile_step: bool | None) -> None:
    """Gemma 4's mixed geometry decodes from a captured graph (no fallback), as eager steps do."""
    model = build("gemma4_text").to(device="cuda", dtype=torch.bfloat16)
    ids, mask = prompt(batch=2, length=40, pad=(5, 0))
    ids, mask = ids.cuda(), mask.cuda()
    handle = kvhf.patch(model, group_size=16, compile_step=compile_step)
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24,
                return_dict_in_generate=True, output_logits=True,
            )  # fmt: skip
        stats = handle.state.graph_runner.stats
    finally:
        handle.remove()
    assert stats.captures >= 1 and stats.replays == 23 and stats.fallbacks == 0
    assert stats.compile_fallbacks == 0
    handle = kvhf.patch(model, group_size=16, cuda_graphs=False)
    try:
        eager, _ = step_logits(model, ids, mask, out.sequences[:, ids.shape[1] : -1])
    finally:
        handle.remove()
    floor = 0.999 if compile_step is False else 0.99  # test_hf_compile_gpu.py's gemma floor
    assert min_cosine(torch.stack(out.logits, dim=1).float(), eager) >= floor
