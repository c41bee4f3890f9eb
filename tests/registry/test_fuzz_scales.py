"""Fuzz the normalise-or-reject path over shapes, dtypes and values.

Properties: only KVQuantError subclasses escape; an accepted canonical scale is
always fp32 of the canonical shape, finite, positive and inside
[MIN_SCALE, MAX_SCALE]; raw tensors are never modified.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvquant.errors import KVQuantError
from kvquant.registry import (
    MAX_SCALE,
    MIN_SCALE,
    LayerGeometry,
    ModelScales,
    RawScale,
    ScaleFormat,
    analyze_scales,
    resolve_scales,
)
from kvquant.registry.registry import BUILTIN_FORMATS
from kvquant.testing.example_formats import InverseAmaxFormat, PerChannelMaxFormat

FORMATS = (*BUILTIN_FORMATS, PerChannelMaxFormat(), InverseAmaxFormat())

DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

SPECIAL = (
    0.0,
    -0.0,
    -1.0,
    1.0,
    float("nan"),
    float("inf"),
    float("-inf"),
    1e-45,  # fp32 subnormal
    1e-40,
    5e-8,  # fp16 subnormal
    MIN_SCALE,
    MIN_SCALE / 2,
    MAX_SCALE,
    MAX_SCALE * 2,
    3e38,
    1e300,
    448.0,
    0.0123,
)

# Weighted towards valid scales so that accepted models are common, not rare.
_VALID = st.floats(min_value=1e-6, max_value=10.0)
values_st = st.one_of(
    _VALID,
    _VALID,
    _VALID,
    _VALID,
    st.sampled_from(SPECIAL),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
)


@st.composite
def geometries(draw: st.DrawFn) -> LayerGeometry:
    kv = draw(st.integers(1, 4))
    return LayerGeometry(
        num_layers=draw(st.integers(1, 3)),
        num_heads=kv * draw(st.integers(1, 3)),
        num_kv_heads=kv,
        head_dim=draw(st.sampled_from([8, 16, 24])),
    )


def shapes_for(geometry: LayerGeometry) -> st.SearchStrategy[tuple[int, ...]]:
    h, hkv, d = geometry.num_heads, geometry.num_kv_heads, geometry.head_dim
    interesting = [
        (),
        (1,),
        (1, 1),
        (1, 1, 1),
        (hkv,),
        (hkv, 1),
        (hkv, 1, 1),
        (h,),
        (h, 1, 1),
        (hkv, d),
        (0,),
        (hkv + 1,),
        (1, hkv),
    ]
    random_shape = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
    valid = [(), (1,), (1, 1, 1), (hkv,), (hkv, 1, 1)]
    return st.one_of(st.sampled_from(valid), st.sampled_from(interesting), random_shape)


def make_tensor(values: list[float], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64).reshape(shape)
    if dtype == torch.bool:
        return t != 0
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.nan_to_num(t, nan=0.0).clamp(info.min, info.max).to(dtype)
    return t.to(dtype)


@st.composite
def raw_scales(draw: st.DrawFn, geometry: LayerGeometry) -> list[RawScale]:
    raws = []
    for layer in range(geometry.num_layers):
        kinds = draw(
            st.sampled_from(
                [("k", "v")] * 6 + [("kv",), ("k",), ("v",), (), ("k", "v", "kv")]  # type: ignore[list-item]
            )
        )
        for kind in kinds:
            shape = draw(shapes_for(geometry))
            numel = math.prod(shape)
            values = draw(st.lists(values_st, min_size=numel, max_size=numel))
            dtype = draw(st.one_of(st.sampled_from(FLOAT_DTYPES), st.sampled_from(DTYPES)))
            raws.append(
                RawScale(
                    layer=layer,
                    kind=kind,
                    name=f"model.layers.{layer}.self_attn.{kind}_scale",
                    convention="fuzz",
                    tensor=make_tensor(values, shape, dtype),
                    pre_rope=draw(st.booleans()),
                )
            )
    return raws


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes, so that NaN compares equal to itself."""
    return tensor.reshape(-1).view(torch.uint8)


def assert_canonical(tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    assert tensor.dtype == torch.float32
    assert tuple(tensor.shape) == shape
    assert bool(torch.isfinite(tensor).all())
    assert bool((tensor >= MIN_SCALE).all()) and bool((tensor <= MAX_SCALE).all())


def check_model(scales: ModelScales, geometry: LayerGeometry) -> None:
    assert len(scales.layers) == geometry.num_layers
    assert scales.ok == all(layer.ok for layer in scales) or bool(scales.problems)
    for layer in scales:
        if not layer.ok:
            assert layer.k is None and layer.v is None
            continue
        if layer.granularity == "fp32-group":
            assert layer.k is None and layer.v is None
            assert layer.group_size and geometry.head_dim % layer.group_size == 0
            continue
        expected = () if layer.granularity == "per-tensor" else (geometry.num_kv_heads,)
        assert layer.k is not None and layer.v is not None
        assert_canonical(layer.k, expected)
        assert_canonical(layer.v, expected)
    scales.to_dict()  # always renderable
    scales.report()


FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(data=st.data())
def test_every_format_normalizes_or_raises_a_kvquant_error(data: st.DataObject) -> None:
    geometry = data.draw(geometries())
    raws = data.draw(raw_scales(geometry))
    for raw in raws:
        before = raw.tensor.clone()
        for fmt in FORMATS:
            try:
                out = fmt.normalize(raw, geometry)
            except KVQuantError:
                continue
            expected = () if fmt.granularity == "per-tensor" else (geometry.num_kv_heads,)
            assert_canonical(out, expected)
        assert torch.equal(bits(raw.tensor), bits(before))


@FUZZ
@given(
    data=st.data(),
    scale_format=st.sampled_from(
        ["auto", "per-tensor", "per-head", "fp32-group", InverseAmaxFormat(), PerChannelMaxFormat()]
    ),
    missing_scales=st.sampled_from(["dynamic", "error", "unit"]),
    missing_kv=st.sampled_from(["error", "reuse"]),
    rope_policy=st.sampled_from(["widen", "keep"]),
)
def test_resolution_accepts_only_canonical_positive_finite_scales(
    data: st.DataObject,
    scale_format: str | ScaleFormat,
    missing_scales: str,
    missing_kv: str,
    rope_policy: str,
) -> None:
    geometry = data.draw(geometries())
    raws = data.draw(raw_scales(geometry))
    options = {
        "scale_format": scale_format,
        "missing_scales": missing_scales,
        "missing_kv": missing_kv,
        "rope_policy": rope_policy,
    }
    analysis = analyze_scales(raws, geometry, **options)  # never raises for contents
    check_model(analysis, geometry)
    try:
        resolved = resolve_scales(raws, geometry, **options)
    except KVQuantError:
        assert not analysis.ok
        return
    assert analysis.ok and resolved.ok
    check_model(resolved, geometry)
