"""The normalise-or-reject policy, one test (or a few) per row of the table, with RawScale objects.

The discovery tests cover the same rows end to end with checkpoints on disk.
"""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from kvquant.errors import KVQuantError, ScaleFormatError, UnknownFormatError
from kvquant.registry import (
    MAX_SCALE,
    MIN_SCALE,
    LayerGeometry,
    RawScale,
    analyze_scales,
    resolve_scales,
)
from kvquant.registry.policy import (
    apply_rope_policy,
    broadcast_to_per_head,
    check_dtype,
    check_values,
    format_layers,
    format_shapes,
    missing_layers,
    pair_kv,
    reduce_to_per_tensor,
    resolve_group_size,
)

GEOM = LayerGeometry(num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64)


def raw(layer: int, kind: str, tensor: torch.Tensor, **kw: object) -> RawScale:
    return RawScale(
        layer,
        kind,  # type: ignore[arg-type]
        f"model.layers.{layer}.self_attn.{kind}_scale",
        "compressed-tensors",
        tensor,
        **kw,  # type: ignore[arg-type]
    )


def model(make, geometry: LayerGeometry = GEOM) -> list[RawScale]:
    """K and V for every layer, ``make(layer, kind)`` returning the tensor."""
    return [raw(i, k, make(i, k)) for i in range(geometry.num_layers) for k in ("k", "v")]


def scalar(value: float, dtype: torch.dtype = torch.float32, shape=(1,)) -> torch.Tensor:
    return torch.full(shape, value, dtype=dtype)


# --- dtypes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn]
)
def test_float_dtypes_are_cast_to_fp32_and_noted(dtype: torch.dtype) -> None:
    value = 0.03125  # exact in every dtype here
    scales = resolve_scales(model(lambda i, k: scalar(value, dtype)), GEOM)
    for layer in scales:
        assert layer.k is not None and layer.k.dtype == torch.float32
        assert float(layer.k) == value and float(layer.v) == value  # type: ignore[arg-type]
        assert layer.k_record.action == "convert"
        assert layer.k_record.raw_dtype == str(dtype).removeprefix("torch.")
        assert "cast" in layer.k_record.reason
    assert any("cast to float32" in n for n in scales.notes)


def test_fp32_scale_is_used_as_stored() -> None:
    scales = resolve_scales(model(lambda i, k: scalar(0.5 if k == "k" else 0.25, shape=())), GEOM)
    assert scales[2].k_record.action == "use"
    assert scales[2].k_record.reason == "used as stored"
    assert scales.notes == ()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_integer_and_bool_scales_are_rejected(dtype: torch.dtype) -> None:
    raws = model(lambda i, k: torch.ones(1, dtype=dtype))
    with pytest.raises(ScaleFormatError) as info:
        resolve_scales(raws, GEOM)
    message = str(info.value)
    assert "model.layers.0.self_attn.k_scale has dtype" in message
    assert str(dtype) in message and "Fix:" in message


def test_complex_and_meta_scales_are_rejected() -> None:
    with pytest.raises(ScaleFormatError, match="complex"):
        check_dtype(raw(0, "k", torch.ones(1, dtype=torch.complex64)))
    with pytest.raises(ScaleFormatError, match="meta device"):
        check_dtype(raw(0, "k", torch.ones(1, device="meta")))
    with pytest.raises(ScaleFormatError, match="expected a dense tensor"):
        check_dtype(raw(0, "k", torch.ones(4).to_sparse()))


# --- shapes -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (1,), (1, 1), (1, 1, 1)])
def test_scalar_shapes_are_per_tensor(shape: tuple[int, ...]) -> None:
    scales = resolve_scales(model(lambda i, k: scalar(0.25 + i, shape=shape)), GEOM)
    assert scales.granularity == "per-tensor"
    for i, layer in enumerate(scales):
        assert layer.granularity == "per-tensor"
        assert layer.k is not None and tuple(layer.k.shape) == ()
        assert float(layer.k) == 0.25 + i
        assert layer.k_record.raw_shape == shape


@pytest.mark.parametrize("shape", [(4,), (4, 1), (4, 1, 1)])
def test_kv_head_shapes_are_per_head(shape: tuple[int, ...]) -> None:
    per_head = torch.tensor([0.1, 0.2, 0.3, 0.4])
    scales = resolve_scales(model(lambda i, k: per_head.reshape(shape)), GEOM)
    assert scales.granularity == "per-head"
    for layer in scales:
        assert layer.k is not None and layer.v is not None
        torch.testing.assert_close(layer.k, per_head, rtol=0, atol=0)
        torch.testing.assert_close(layer.v, per_head, rtol=0, atol=0)
        assert layer.k.dtype == torch.float32 and layer.k.shape == (4,)


def test_query_head_vector_is_rejected_naming_expected_shapes() -> None:
    raws = model(lambda i, k: torch.full((8,), 0.1))
    with pytest.raises(ScaleFormatError) as info:
        resolve_scales(raws, GEOM)
    message = str(info.value)
    assert (
        "model.layers.3.self_attn.k_scale has shape (8,) but the layer has 4 KV heads; "
        "expected () or (4,)"
    ) in message
    assert (
        'Fix: export per-KV-head scales, or patch(model, scale_format="per-tensor") '
        "to reduce with max."
    ) in message


@pytest.mark.parametrize("shape", [(5,), (3,), (4, 64), (2, 2), (0,), (1, 4)])
def test_other_shapes_are_rejected(shape: tuple[int, ...]) -> None:
    raws = model(lambda i, k: torch.full(shape, 0.1))
    scales = analyze_scales(raws, GEOM)
    assert not scales.ok
    assert all(r.action == "reject" for r in scales.records)
    assert f"has shape {shape}" in scales.problems[0]
    assert "expected () or (4,)" in scales.problems[0]


def test_query_head_vector_reduced_with_max_when_per_tensor_is_asked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    vec = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    with caplog.at_level(logging.WARNING, logger="kvquant"):
        scales = resolve_scales(model(lambda i, k: vec), GEOM, scale_format="per-tensor")
    assert scales.granularity == "per-tensor"
    assert float(scales[0].k) == pytest.approx(0.8)  # type: ignore[arg-type]
    assert "query-head" in scales[0].k_record.reason


# --- values -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "word"),
    [
        (float("nan"), "not a number"),
        (float("inf"), "infinite"),
        (float("-inf"), "infinite"),
        (0.0, "zero"),
        (-0.5, "negative"),
        (MIN_SCALE / 2, "too small"),
        (1e-40, "too small"),  # an fp32 subnormal
        (MAX_SCALE * 2, "too large"),
    ],
)
def test_bad_values_are_rejected_with_layer_tensor_and_value(value: float, word: str) -> None:
    def make(i: int, k: str) -> torch.Tensor:
        t = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
        if i == 2 and k == "v":
            t[1] = value
        return t

    with pytest.raises(ScaleFormatError) as info:
        resolve_scales(model(make), GEOM)
    message = str(info.value)
    assert message.startswith("model.layers.2.self_attn.v_scale: element [1] is ")
    assert word in message and "1 of 4 elements" in message and "Fix:" in message
    shown = "nan" if math.isnan(value) else ("inf" if value == math.inf else None)
    if shown:
        assert f"is {shown}" in message or f"is -{shown}" in message


def test_value_limits_are_inclusive() -> None:
    scales = resolve_scales(
        model(lambda i, k: torch.tensor([MIN_SCALE, MAX_SCALE, 1.0, 2.0], dtype=torch.float64)),
        GEOM,
    )
    assert scales[0].k is not None
    assert float(scales[0].k[0]) == MIN_SCALE and float(scales[0].k[1]) == MAX_SCALE


def test_fp16_underflowed_scale_is_rejected_as_zero() -> None:
    tiny = torch.tensor([1e-9], dtype=torch.float32).to(torch.float16)  # underflows to 0
    with pytest.raises(ScaleFormatError, match="zero"):
        resolve_scales(model(lambda i, k: tiny), GEOM)


def test_check_values_never_prints_the_whole_tensor() -> None:
    values = torch.arange(1, 1001, dtype=torch.float32) * 0.123456
    values[500] = float("nan")
    with pytest.raises(ScaleFormatError) as info:
        check_values(values, "t")
    assert "61.6" not in str(info.value)  # another element's value
    assert "element [500] is nan" in str(info.value)


# --- K / V pairing ------------------------------------------------------------------------


def test_only_kv_scale_serves_k_and_v_and_is_noted() -> None:
    raws = [raw(i, "kv", scalar(0.25 * (i + 1))) for i in range(4)]
    scales = resolve_scales(raws, GEOM)
    for i, layer in enumerate(scales):
        assert float(layer.k) == float(layer.v) == 0.25 * (i + 1)  # type: ignore[arg-type]
        assert (
            layer.k_record.tensor == layer.v_record.tensor == f"model.layers.{i}.self_attn.kv_scale"
        )
        assert "one kv_scale" in layer.k_record.reason
        assert any("one scale for both K and V" in n for n in layer.notes)
    assert any("kv_scale serves K and V" in n for n in scales.notes)


@pytest.mark.parametrize(("have", "lack"), [("k", "V"), ("v", "K")])
def test_only_k_or_only_v_is_rejected_by_default(have: str, lack: str) -> None:
    raws = [raw(i, have, scalar(0.5)) for i in range(4)]
    with pytest.raises(ScaleFormatError) as info:
        resolve_scales(raws, GEOM)
    message = str(info.value)
    assert "4 problems" in message
    assert f"but no {lack} scale" in message and 'missing_kv="reuse"' in message


@pytest.mark.parametrize("have", ["k", "v"])
def test_missing_kv_reuse_uses_the_present_scale(have: str) -> None:
    raws = [raw(i, have, scalar(0.5)) for i in range(4)]
    scales = resolve_scales(raws, GEOM, missing_kv="reuse")
    for layer in scales:
        assert float(layer.k) == float(layer.v) == 0.5  # type: ignore[arg-type]
        assert any("reused" in n for n in layer.notes)
    assert any('missing_kv="reuse"' in n for n in scales.notes)


def test_kv_fills_in_a_missing_side_and_separate_tensors_win() -> None:
    pair = pair_kv(0, [raw(0, "k", scalar(1.0)), raw(0, "kv", scalar(2.0))])
    assert pair.k.kind == "k" and pair.v.kind == "kv" and "used for V" in pair.notes[0]
    pair = pair_kv(
        0, [raw(0, "k", scalar(1.0)), raw(0, "v", scalar(1.0)), raw(0, "kv", scalar(2.0))]
    )
    assert pair.k.kind == "k" and pair.v.kind == "v" and "ignored" in pair.notes[0]


def test_duplicate_kind_in_a_layer_is_rejected() -> None:
    extra = RawScale(1, "k", "model.layers.1.self_attn.k_proj.k_scale", "modelopt", scalar(0.5))
    raws = [*model(lambda i, k: scalar(0.5)), extra]
    scales = analyze_scales(raws, GEOM)
    assert not scales.ok and not scales[1].ok and scales[0].ok
    assert "two 'k' scales" in scales[1].problems[0]
    assert "k_proj.k_scale" in scales[1].problems[0]


# --- coverage -----------------------------------------------------------------------------


def test_some_layers_without_scales_are_rejected_naming_them() -> None:
    raws = [r for r in model(lambda i, k: scalar(0.5)) if r.layer in (0, 1)]
    with pytest.raises(ScaleFormatError) as info:
        resolve_scales(raws, GEOM)
    message = str(info.value)
    assert message.startswith("layers 2-3 have no KV scales but layers 0-1 do")
    assert 'scale_format="fp32-group"' in message
    scales = analyze_scales(raws, GEOM)
    assert [layer.ok for layer in scales] == [True, True, False, False]
    assert scales[3].k_record.action == "reject" and scales[3].k_record.tensor is None


def test_single_missing_layer_grammar() -> None:
    raws = [r for r in model(lambda i, k: scalar(0.5)) if r.layer != 2]
    scales = analyze_scales(raws, GEOM)
    assert scales.problems[0].startswith("layer 2 has no KV scales but layers 0-1, 3 do")


def test_layer_index_out_of_range_is_a_problem() -> None:
    raws = [*model(lambda i, k: scalar(0.5)), raw(7, "k", scalar(0.5))]
    scales = analyze_scales(raws, GEOM)
    assert "is for layer 7 but the model has 4 layers" in scales.problems[0]


# --- no scales anywhere ---------------------------------------------------------------------


def test_no_scales_default_to_fp32_group_dynamic_noted() -> None:
    scales = resolve_scales([], GEOM)
    assert scales.ok and scales.granularity == "fp32-group" and scales.group_size == 64
    assert all(layer.k is None and layer.v is None and layer.group_size == 64 for layer in scales)
    assert all(r.action == "default" for r in scales.records)
    assert "no KV scales in the checkpoint" in scales.notes[0]


def test_no_scales_error_policy_raises() -> None:
    with pytest.raises(ScaleFormatError, match='missing_scales="error"'):
        resolve_scales([], GEOM, missing_scales="error")
    assert not analyze_scales([], GEOM, missing_scales="error").ok


def test_no_scales_unit_policy_uses_one_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvquant"):
        scales = resolve_scales([], GEOM, missing_scales="unit")
    assert scales.granularity == "per-tensor"
    assert all(float(layer.k) == 1.0 == float(layer.v) for layer in scales)  # type: ignore[arg-type]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "1.0" in warnings[0].getMessage()


def test_no_scales_with_explicit_static_format_is_an_error_unless_unit() -> None:
    with pytest.raises(
        ScaleFormatError, match='scale_format="per-head" needs checkpoint KV scales'
    ):
        resolve_scales([], GEOM, scale_format="per-head")
    scales = resolve_scales([], GEOM, scale_format="per-head", missing_scales="unit")
    assert scales[0].k is not None and scales[0].k.shape == (4,)


# --- granularity conversions ------------------------------------------------------------------


def test_per_head_reduced_to_per_tensor_only_when_asked_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    per_head = torch.tensor([0.1, 0.2, 0.4, 0.8]).reshape(4, 1, 1)
    raws = model(lambda i, k: per_head)
    auto = resolve_scales(raws, GEOM)
    assert auto.granularity == "per-head"
    with caplog.at_level(logging.INFO, logger="kvquant"):
        scales = resolve_scales(raws, GEOM, scale_format="per-tensor")
    assert scales.granularity == "per-tensor"
    assert all(float(layer.k) == pytest.approx(0.8) for layer in scales)  # type: ignore[arg-type]
    assert "max/min 8" in scales[0].k_record.reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "reduced to per-tensor" in warnings[0] and "worst 8" in warnings[0]
    assert "3.00 bits" in warnings[0]


def test_per_tensor_broadcast_to_per_head_when_asked_is_lossless() -> None:
    scales = resolve_scales(model(lambda i, k: scalar(0.5)), GEOM, scale_format="per-head")
    assert scales.granularity == "per-head"
    assert scales[1].k is not None
    torch.testing.assert_close(scales[1].k, torch.full((4,), 0.5), rtol=0, atol=0)
    assert "lossless" in scales[1].k_record.reason


def test_auto_with_mixed_layers_picks_per_head_and_broadcasts() -> None:
    def make(i: int, k: str) -> torch.Tensor:
        return torch.tensor([0.1, 0.2, 0.3, 0.4]) if i == 0 else scalar(0.5)

    scales = resolve_scales(model(make), GEOM)
    assert scales.granularity == "per-head"
    assert all(layer.k is not None and layer.k.shape == (4,) for layer in scales)


def test_fp32_group_instance_brings_its_group_size() -> None:
    from kvquant.registry import Fp32GroupFormat

    scales = resolve_scales([], GEOM, scale_format=Fp32GroupFormat(group_size=16))
    assert scales.group_size == 16 and scales[0].group_size == 16
    assert resolve_scales([], GEOM, scale_format="fp32-group").group_size == 64


def test_fp32_group_ignores_static_scales_noted() -> None:
    raws = model(lambda i, k: scalar(float("nan")))  # ignored, so not judged
    scales = resolve_scales(raws, GEOM, scale_format="fp32-group", group_size=32)
    assert scales.granularity == "fp32-group" and scales.group_size == 32
    assert all(r.action == "ignore" for r in scales.records)
    assert "8 checkpoint scale tensor(s) ignored" in scales.notes[0]


# --- pre-RoPE ---------------------------------------------------------------------------------


def test_pre_rope_k_is_widened_by_sqrt2_by_default() -> None:
    raws = [
        RawScale(
            i,
            k,
            f"model.layers.{i}.self_attn.{k}_proj.output_scale",
            "quark",
            scalar(0.5, torch.bfloat16, ()),
            pre_rope=True,
            merged_kv=True,
        )
        for i in range(4)
        for k in ("k", "v")
    ]
    scales = resolve_scales(raws, GEOM)
    layer = scales[0]
    assert float(layer.k) == pytest.approx(0.5 * math.sqrt(2))  # type: ignore[arg-type]
    assert float(layer.v) == 0.5  # type: ignore[arg-type]
    assert "widened by sqrt(2)" in layer.k_record.reason
    assert layer.k_record.pre_rope and layer.k_record.merged_kv
    assert any("max(K, V)" in n for n in layer.notes)
    kept = resolve_scales(raws, GEOM, rope_policy="keep")
    assert float(kept[0].k) == 0.5  # type: ignore[arg-type]
    assert any("may saturate" in n for n in kept.notes)


def test_apply_rope_policy_does_not_modify_its_input() -> None:
    k = torch.tensor([0.5, 1.0])
    out, note = apply_rope_policy(k, raw(0, "k", k), "widen")
    assert torch.equal(k, torch.tensor([0.5, 1.0])) and "sqrt(2)" in note
    assert out[1] == pytest.approx(math.sqrt(2))


# --- reporting and raising ----------------------------------------------------------------------


def test_raising_mode_lists_all_problems_and_analysis_records_every_layer() -> None:
    def make(i: int, k: str) -> torch.Tensor:
        return scalar({0: float("nan"), 2: 0.0}.get(i, 0.5)) if k == "k" else scalar(0.5)

    with pytest.raises(ScaleFormatError) as info:
        resolve_scales(model(make), GEOM)
    message = str(info.value)
    assert message.startswith("2 problems with the checkpoint's KV scales:")
    assert (
        "model.layers.0.self_attn.k_scale" in message
        and "model.layers.2.self_attn.k_scale" in message
    )
    scales = analyze_scales(model(make), GEOM)
    assert [layer.ok for layer in scales] == [False, True, False, True]
    assert len(scales.records) == 8
    rec = scales[0].k_record
    assert rec.action == "reject" and "not a number" in rec.reason
    assert rec.raw_shape == (1,) and rec.raw_dtype == "float32" and math.isnan(rec.raw_max or 0.0)
    assert scales[1].k_record.action == "use" and scales[1].k_record.scale == (0.5,)
    # A rejected layer's V (fine on its own) is still marked reject: the layer is unusable.
    assert scales[0].v_record.action == "reject"
    text = json.dumps(scales.to_dict(), allow_nan=False)
    assert '"raw_max": "nan"' in text
    assert "REJECTED" in scales.report()


def test_more_than_ten_problems_are_counted() -> None:
    geometry = LayerGeometry(num_layers=12, num_heads=4, num_kv_heads=4, head_dim=16)
    raws = model(lambda i, k: scalar(-1.0), geometry)
    with pytest.raises(ScaleFormatError) as info:
        resolve_scales(raws, geometry)
    assert "24 problems" in str(info.value) and "... and 14 more" in str(info.value)


def test_all_ones_are_noted() -> None:
    scales = resolve_scales(model(lambda i, k: scalar(1.0)), GEOM)
    assert any("exactly 1.0" in n for n in scales.notes)


def test_identical_k_and_v_are_noted() -> None:
    scales = resolve_scales(model(lambda i, k: scalar(0.5)), GEOM)
    assert any("K and V scales identical" in n for n in scales.notes)
    different = resolve_scales(model(lambda i, k: scalar(0.5 if k == "k" else 0.25)), GEOM)
    assert not any("identical" in n for n in different.notes)


def test_resolve_never_mutates_raw_tensors() -> None:
    raws = model(lambda i, k: torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.bfloat16))
    before = [r.tensor.clone() for r in raws]
    scales = resolve_scales(raws, GEOM, scale_format="per-tensor")
    for layer in scales:
        layer.k.fill_(7.0)  # type: ignore[union-attr]
    assert all(torch.equal(r.tensor, b) for r, b in zip(raws, before, strict=True))


# --- options ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{"missing_scales": "zero"}, {"missing_kv": "guess"}, {"rope_policy": "rotate"}],
)
def test_invalid_options_raise_at_once(kwargs: dict[str, str]) -> None:
    with pytest.raises(ScaleFormatError, match="is not a policy"):
        analyze_scales([], GEOM, **kwargs)  # type: ignore[arg-type]


def test_unknown_format_name_raises_unknown_format_error() -> None:
    with pytest.raises(UnknownFormatError) as info:
        resolve_scales([], GEOM, scale_format="per-chanel")
    assert isinstance(info.value, KeyError) and isinstance(info.value, KVQuantError)


@pytest.mark.parametrize(
    "geometry",
    [
        LayerGeometry(0, 8, 4, 64),
        LayerGeometry(2, 8, -4, 64),
        LayerGeometry(2, 8, 4, 64.0),  # type: ignore[arg-type]
    ],
)
def test_impossible_geometry_is_rejected(geometry: LayerGeometry) -> None:
    with pytest.raises(ScaleFormatError, match="LayerGeometry"):
        resolve_scales([], geometry)


def test_format_class_instead_of_instance_is_rejected() -> None:
    from kvquant.registry import PerHeadFormat

    with pytest.raises(ScaleFormatError, match=r"Fix: pass scale_format=PerHeadFormat\(\)"):
        resolve_scales([], GEOM, scale_format=PerHeadFormat)  # type: ignore[arg-type]


def test_not_a_raw_scale_is_rejected() -> None:
    with pytest.raises(ScaleFormatError, match=r"expected kvquant\.registry\.RawScale"):
        resolve_scales([("k", torch.ones(1))], GEOM)  # type: ignore[list-item]


# --- the pure helpers -------------------------------------------------------------------------


def test_group_size_resolution() -> None:
    assert resolve_group_size(None, 128) == 64
    assert resolve_group_size(None, 32) == 32
    assert resolve_group_size(None, 80) == 16
    assert resolve_group_size(None, 96) == 32
    assert resolve_group_size(16, 64) == 16
    with pytest.raises(ScaleFormatError, match="does not divide head_dim=128"):
        resolve_group_size(48, 128)
    with pytest.raises(ScaleFormatError, match="positive int"):
        resolve_group_size(0, 128)
    with pytest.raises(ScaleFormatError, match="does not divide"):
        resolve_scales([], GEOM, group_size=48)


def test_small_helpers() -> None:
    assert format_layers([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8"
    assert format_shapes([(), (4,)]) == "() or (4,)"
    assert format_shapes([(), (1,), (4, 1, 1)]) == "(), (1,) or (4, 1, 1)"
    assert missing_layers([0, 2], 4) == [1, 3]
    scalar_out, ratio = reduce_to_per_tensor(torch.tensor([0.5, 2.0]))
    assert scalar_out.shape == () and float(scalar_out) == 2.0 and ratio == 4.0
    out = broadcast_to_per_head(torch.tensor(0.5), 3)
    assert out.shape == (3,) and out.is_contiguous() and bool((out == 0.5).all())


def test_fp8_granularities_are_the_fp8_scheme_classes() -> None:
    """Scale formats may produce every FP8 scheme defined (none of the 4-bit ones)."""
    from kvquant.registry.policy import GRANULARITIES, fp8_granularities
    from kvquant.schemes import Fp4Scales, scheme_class, scheme_names

    words = fp8_granularities()
    assert words == GRANULARITIES == ("per-tensor", "per-head", "fp32-group", "k-transform")
    assert set(scheme_names()) - set(words) == {
        w for w in scheme_names() if issubclass(scheme_class(w), Fp4Scales)
    }
