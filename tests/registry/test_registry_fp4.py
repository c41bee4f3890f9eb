"""4-bit KV checkpoints: each producer's global scale, in its exact layout, to the canonical g.

Hand-built tensors in each producer's layout (docs/dev/fp4-formats.md): ModelOpt's fp32 ``[]``
``k_proj.k_scale = amax / 2688``, compressed-tensors' fp32 ``(1,)`` ``k_global_scale =
2688 / amax`` (a quantization multiplier), the ``amax/448`` and ``amax/6`` conventions; every
one must give the same canonical ``amax / (6 * 448)``, and every malformed input a
ScaleFormatError naming the layer or tensor, what was found and the fix.
"""

from __future__ import annotations

import pytest
import torch

from kvquant.errors import ConventionError, ScaleFormatError
from kvquant.kernels.fp4 import NVFP4
from kvquant.registry.fp4 import (
    CONVENTIONS,
    PRODUCERS,
    kv_formats_by_layer,
    normalize_fp4_global_scale,
)

AMAX_K, AMAX_V = 12.0, 30.0
LAYER = "model.layers.3"


def _modelopt() -> dict[str, torch.Tensor]:
    a = f"{LAYER}.self_attn"
    return {
        f"{a}.k_proj.k_scale": torch.tensor(AMAX_K / 2688),
        f"{a}.v_proj.v_scale": torch.tensor(AMAX_V / 2688),
        f"{a}.k_proj.weight": torch.zeros(4, 4),
    }


def _compressed_tensors() -> dict[str, torch.Tensor]:
    a = f"{LAYER}.self_attn"
    return {
        f"{a}.k_global_scale": torch.tensor([2688 / AMAX_K]),
        f"{a}.v_global_scale": torch.tensor([2688 / AMAX_V]),
    }


@pytest.mark.parametrize(
    ("producer", "tensors", "convention"),
    [
        ("modelopt", _modelopt(), None),
        ("compressed-tensors", _compressed_tensors(), None),
        ("tensorrt-llm", {f"{LAYER}.self_attn.k_proj.k_scale": torch.tensor(AMAX_K / 448),
                          f"{LAYER}.self_attn.v_proj.v_scale": torch.tensor(AMAX_V / 448)}, None),
        ("modelopt", {f"{LAYER}.self_attn.k_proj.k_scale": torch.tensor(AMAX_K / 6),
                      f"{LAYER}.self_attn.v_proj.v_scale": torch.tensor(AMAX_V / 6)}, "amax/6"),
    ],
    ids=["modelopt", "compressed-tensors", "amax-448", "amax-6-override"],
)  # fmt: skip
def test_every_convention_gives_the_canonical_scale(
    producer: str, tensors: dict[str, torch.Tensor], convention: str | None
) -> None:
    for cache, amax in (("k", AMAX_K), ("v", AMAX_V)):
        g = normalize_fp4_global_scale(
            producer, tensors, LAYER, cache, num_kv_heads=8, convention=convention
        )
        assert g.value.dtype == torch.float32 and g.value.shape == ()
        assert float(g.value) == pytest.approx(amax / 2688, rel=1e-6)
        assert float(g.implied_amax) == pytest.approx(amax, rel=1e-6)
        assert g.fmt is NVFP4 and g.fmt.block_size == 16
        assert g.tensor.startswith(LAYER) and f"{cache}_" in g.tensor
        converted = any("converted" in n for n in g.notes)
        assert converted == (g.convention != "amax/(6*448)")


def test_the_table_holds_each_convention_once() -> None:
    assert set(CONVENTIONS) == {"amax/(6*448)", "amax/448", "amax/6", "(6*448)/amax"}
    assert {p.convention for p in PRODUCERS.values()} <= set(CONVENTIONS)
    stored = {  # the number each convention stores for amax 2688: canonical g = 1
        "amax/(6*448)": 1.0, "amax/448": 6.0, "amax/6": 448.0, "(6*448)/amax": 1.0,
    }  # fmt: skip
    for name, conv in CONVENTIONS.items():
        assert float(conv.canonical(torch.tensor(stored[name], dtype=torch.float64))) == 1.0


def test_per_head_and_bf16_scales() -> None:
    t = {f"{LAYER}.self_attn.k_proj.k_scale": torch.tensor([1.0, 2.0]).bfloat16() / 2688}
    g = normalize_fp4_global_scale("modelopt", t, LAYER, "k", num_kv_heads=2)
    assert g.value.shape == (2,) and g.value.dtype == torch.float32
    assert any("bfloat16 cast to float32" in n for n in g.notes)


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ({}, r"model.layers.3: found none of \['model.layers.3.self_attn.k_proj.k_scale'\]"),
        ({f"{LAYER}.self_attn.k_scale": torch.tensor(0.01)},
         r"the layer's tensors: \['model.layers.3.self_attn.k_scale'\]"),
        ({f"{LAYER}.self_attn.k_proj.k_scale": torch.zeros(3, dtype=torch.uint8)},
         "found torch.uint8; expected a floating-point tensor"),
        ({f"{LAYER}.self_attn.k_proj.k_scale": torch.rand(4, 16)},
         r"found shape \(4, 16\); expected \(\) or \(1,\)"),
        ({f"{LAYER}.self_attn.k_proj.k_scale": torch.tensor(0.0)}, "element 0 is 0.0"),
        ({f"{LAYER}.self_attn.k_proj.k_scale": torch.tensor(float("inf"))}, "element 0 is inf"),
        ({f"{LAYER}.self_attn.k_proj.k_scale": torch.tensor([0.1, float("nan")])},
         "element 1 is nan"),
    ],
    ids=["missing", "other-name", "integer", "block-scales", "zero", "inf", "nan"],
)  # fmt: skip
def test_malformed_scales_are_refused_with_the_fix(tensors: dict, match: str) -> None:
    with pytest.raises(ScaleFormatError, match=match) as info:
        normalize_fp4_global_scale("modelopt", tensors, LAYER, "k", num_kv_heads=2)
    assert "Fix:" in str(info.value)


def test_a_reciprocal_below_the_range_is_refused() -> None:
    """A stored amax/2688 read as compressed-tensors' reciprocal gives a huge g: out of range."""
    t = {f"{LAYER}.self_attn.k_global_scale": torch.tensor([2.0**-110])}
    with pytest.raises(ScaleFormatError, match=r"read as \(6\*448\)/amax"):
        normalize_fp4_global_scale("compressed-tensors", t, LAYER, "k", num_kv_heads=2)


def test_unknown_producer_convention_or_cache() -> None:
    with pytest.raises(ConventionError, match="producer 'quark' is not known"):
        normalize_fp4_global_scale("quark", _modelopt(), LAYER, "k", num_kv_heads=2)
    with pytest.raises(ConventionError, match="convention 'amax' is not known"):
        normalize_fp4_global_scale("modelopt", _modelopt(), LAYER, "k", num_kv_heads=2,
                                   convention="amax")  # fmt: skip
    with pytest.raises(ConventionError, match="cache is 'q'"):
        normalize_fp4_global_scale("modelopt", _modelopt(), LAYER, "q", num_kv_heads=2)


def test_modelopt_layer_wise_kv_map() -> None:
    quantization = {
        "kv_cache_quant_algo": "MIXED_PRECISION",
        "kv_cache_quantized_layers": {
            "model.layers.0.self_attn": {"quant_algo": "FP8"},
            "model.layers.1.self_attn": {"quant_algo": "NVFP4"},
            "model.layers.2.self_attn": {"quant_algo": "FP8_K_NVFP4_V"},
        },
        "kv_cache_schema_version": 1,
    }
    assert kv_formats_by_layer(quantization) == {
        "model.layers.0.self_attn": ("fp8", "fp8"),
        "model.layers.1.self_attn": ("nvfp4", "nvfp4"),
        "model.layers.2.self_attn": ("fp8", "nvfp4"),
    }
    assert kv_formats_by_layer({"kv_cache_quant_algo": "NVFP4"}) == {}


@pytest.mark.parametrize(
    ("quantization", "match"),
    [
        ({"kv_cache_quant_algo": "MIXED_PRECISION"}, "no kv_cache_quantized_layers map"),
        ({"kv_cache_quantized_layers": {"a": {"quant_algo": "FP8"}}, "kv_cache_schema_version": 2},
         "found kv_cache_schema_version 2"),
        ({"kv_cache_quantized_layers": {"a": {"quant_algo": "NVFP4_AFFINE"}},
          "kv_cache_schema_version": 1}, "found KV cache algorithm 'NVFP4_AFFINE'"),
    ],
)  # fmt: skip
def test_malformed_layer_maps_are_refused(quantization: dict, match: str) -> None:
    with pytest.raises(ScaleFormatError, match=match):
        kv_formats_by_layer(quantization)
