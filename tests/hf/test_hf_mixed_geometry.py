"""A model whose layers differ in head_dim and KV heads (Gemma 4 text): one storage per layer geometry.

The tiny Gemma 4 of ``hf_tiny`` has a sliding layer of 2 KV heads x head_dim 16
and a full-attention layer of 1 KV head x head_dim 32 (transformers' own
``global_head_dim`` / ``num_global_key_value_heads`` options). The family test
(logits, greedy, left padding, ``remove()``) is in test_hf_families.py; these
tests check what the mixed geometry changes: static scales of each layer's
shape, the fp32-group size, the static decode step, and the refusals.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from hf_steps import calibrate, min_cosine, step_logits
from hf_tiny import _gemma4, build, prompt

import kvquant.integrations.hf as kvhf
from kvquant.errors import ScaleFormatError, UnsupportedModelError
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
        model, scales=scales, scale_format=granularity, backend="torch", page_size=4
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
    from hf_steps import generate_exactly

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


def test_kv_sharing_is_refused_before_any_change() -> None:
    model = _gemma4(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        num_kv_shared_layers=1,
    ).eval()
    before = sorted(k for m in model.modules() for k in m.__dict__)
    impl = model.config._attn_implementation
    with pytest.raises(UnsupportedModelError, match=r"num_kv_shared_layers=1.*KV sharing"):
        kvhf.patch(model, backend="torch")
    assert sorted(k for m in model.modules() for k in m.__dict__) == before
    assert model.config._attn_implementation == impl


def test_calibration_refuses_mixed_kv_heads() -> None:
    from kvquant.calibrate import calibrate as kv_calibrate
    from kvquant.errors import CalibrationError

    model = build("gemma4_text")
    ids = torch.randint(3, 128, (1, 32), generator=torch.Generator().manual_seed(2))
    with pytest.raises(
        CalibrationError, match=r"different KV-head counts.*1 KV head x head_dim 32"
    ):
        kv_calibrate(model, ids, granularity="per-head", progress=False)
