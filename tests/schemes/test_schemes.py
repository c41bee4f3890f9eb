"""Scale schemes (kvquant.schemes): checked once when built, moved and flattened without checks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvquant.choices import KVFormat
from kvquant.errors import KVQuantError, ScaleFormatError
from kvquant.kernels import hadamard
from kvquant.schemes import (
    MXFP4,
    NVFP4,
    ORTHONORMAL_TOL,
    Fp8KNvfp4VScales,
    GroupScales,
    KTransformMxfp4Scales,
    KTransformNvfp4Scales,
    KTransformScales,
    Mxfp4Scales,
    Nvfp4Scales,
    PerHeadScales,
    PerTensorScales,
    Scheme,
    fp4_format,
    scheme_class,
    scheme_names,
)

H, D = 2, 16


def _kt(**change: object) -> KTransformScales:
    args: dict[str, object] = {
        "k_scale": torch.full((H,), 0.1),
        "v_scale": torch.full((H,), 0.2),
        "k_offset": torch.zeros(H, D),
        "k_rotation": hadamard(D),
        "first_tokens": 1,
    }
    args.update(change)
    return KTransformScales(**args)  # type: ignore[arg-type]


REFUSED: list[tuple[str, Callable[[], Scheme], str]] = [
    (
        "per-tensor bf16",
        lambda: PerTensorScales(torch.tensor(0.1, dtype=torch.bfloat16), torch.tensor(0.1)),
        "k_scale has dtype torch.bfloat16; expected torch.float32",
    ),
    (
        "per-tensor shape",
        lambda: PerTensorScales(torch.tensor(0.1), torch.ones(3)),
        r"v_scale has shape (3,); expected ()",
    ),
    (
        "per-tensor not a tensor",
        lambda: PerTensorScales(0.1, torch.tensor(0.1)),  # type: ignore[arg-type]
        "k_scale is a float; expected an fp32 tensor",
    ),
    (
        "per-tensor zero",
        lambda: PerTensorScales(torch.tensor(0.0), torch.tensor(0.1)),
        "k_scale element 0 is 0.0",
    ),
    (
        "per-tensor nan",
        lambda: PerTensorScales(torch.tensor(0.1), torch.tensor(float("nan"))),
        "v_scale element 0 is nan",
    ),
    (
        "per-tensor huge",
        lambda: PerTensorScales(torch.tensor(1e31), torch.tensor(0.1)),
        "element 0 is",
    ),
    (
        "per-head heads differ",
        lambda: PerHeadScales(torch.ones(3), torch.ones(2)),
        r"v_scale has shape (2,); expected (3,)",
    ),
    (
        "per-head scalar",
        lambda: PerHeadScales(torch.tensor(1.0), torch.tensor(1.0)),
        "k_scale has shape (); expected (num_kv_heads,)",
    ),
    (
        "per-head negative",
        lambda: PerHeadScales(torch.tensor([1.0, -1.0]), torch.ones(2)),
        "k_scale element 1 is -1.0",
    ),
    (
        "group not dividing",
        lambda: GroupScales(head_dim=32, group_size=24),
        "group_size=24 does not divide head_dim 32",
    ),
    ("group zero", lambda: GroupScales(head_dim=32, group_size=0), "group_size=0 does not divide"),
    ("group head_dim", lambda: GroupScales(head_dim=0, group_size=8), "head_dim is 0"),
    (
        "k-transform rotation not orthonormal",
        lambda: _kt(k_rotation=hadamard(D) * 1.01),
        "k_rotation is not orthonormal",
    ),
    (
        "k-transform rotation shape",
        lambda: _kt(k_rotation=torch.eye(D)[:8]),
        "k_rotation has shape (8, 16)",
    ),
    (
        "k-transform rotation inf",
        lambda: _kt(k_rotation=torch.full((D, D), float("inf"))),
        "k_rotation element 0 is inf; expected finite",
    ),
    (
        "k-transform offset shape",
        lambda: _kt(k_offset=torch.zeros(H, 8)),
        r"k_offset has shape (2, 8); expected (2, 16)",
    ),
    (
        "k-transform offset nan",
        lambda: _kt(k_offset=torch.full((H, D), float("nan"))),
        "k_offset element 0 is nan; expected finite",
    ),
    (
        "k-transform offset 1-D",
        lambda: KTransformScales(torch.tensor(0.1), torch.tensor(0.1), torch.zeros(D)),
        "k_offset has shape (16,); expected (num_kv_heads, head_dim)",
    ),
    (
        "k-transform offset fp16",
        lambda: _kt(k_offset=torch.zeros(H, D).half()),
        "k_offset has dtype torch.float16",
    ),
    (
        "k-transform scales differ",
        lambda: _kt(v_scale=torch.tensor(0.1)),
        "expected both () or both",
    ),
    ("k-transform first_tokens", lambda: _kt(first_tokens=2000), "first_tokens is 2000"),
    ("k-transform first_tokens bool", lambda: _kt(first_tokens=True), "first_tokens is True"),
]


@pytest.mark.parametrize(("label", "build", "message"), REFUSED, ids=[c[0] for c in REFUSED])
def test_construction_refuses_with_found_expected_fix(
    label: str, build: Callable[[], Scheme], message: str
) -> None:
    with pytest.raises(ScaleFormatError) as info:
        build()
    text = str(info.value)
    assert message in text
    assert "expected" in text and "Fix:" in text
    assert isinstance(info.value, KVQuantError) and isinstance(info.value, ValueError)


def test_scheme_keeps_its_own_copies() -> None:
    """The caller changing its tensor afterwards cannot change a checked scheme."""
    k = torch.tensor(0.1)
    s = PerTensorScales(k, torch.tensor(0.2))
    k.fill_(0.0)
    assert float(s.k_scale) == pytest.approx(0.1)
    rotation = hadamard(D)
    kt = _kt(k_rotation=rotation)
    rotation.fill_(float("nan"))
    assert bool(torch.isfinite(kt.k_rotation).all())  # type: ignore[arg-type]


def test_to_moves_without_checking_again(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _kt()
    import kvquant.schemes.fp8 as fp8

    def boom(*args: object) -> None:
        raise AssertionError("checked again")

    monkeypatch.setattr(fp8, "check_scale_values", boom)
    monkeypatch.setattr(fp8, "check_finite", boom)
    moved = s.to("cpu")
    assert type(moved) is KTransformScales and moved is not s
    assert torch.equal(moved.k_offset, s.k_offset)  # type: ignore[arg-type]
    assert moved.first_tokens == 1


@pytest.mark.parametrize(
    "scheme",
    [
        PerTensorScales(torch.tensor(0.1), torch.tensor(0.2)),
        PerHeadScales(torch.full((H,), 0.1), torch.full((H,), 0.2)),
        GroupScales(head_dim=D, group_size=8),
        KTransformScales(torch.full((H,), 0.1), torch.full((H,), 0.2), None, hadamard(D)),
        KTransformScales(torch.full((H,), 0.1), torch.full((H,), 0.2), torch.zeros(H, D), None, 3),
        Nvfp4Scales(D, torch.full((H,), 0.1), torch.full((H,), 0.2)),
        Mxfp4Scales(64),
        Fp8KNvfp4VScales(D, torch.tensor(0.1), torch.tensor(1.0)),
        KTransformNvfp4Scales(
            D, torch.tensor(1.0), torch.tensor(1.0), torch.zeros(H, D), hadamard(D), first_tokens=2
        ),
        KTransformMxfp4Scales(32, torch.zeros(H, 32), first_tokens=1),
    ],
    ids=lambda s: s.name,
)
def test_flatten_round_trips(scheme: Scheme) -> None:
    back = Scheme.unflatten(*scheme.flatten())
    assert type(back) is type(scheme)
    assert back.kernel_view().group_size == scheme.kernel_view().group_size
    assert back.dims() == scheme.dims() and back.first_tokens == scheme.first_tokens
    for a, b in zip(back.kernel_view(), scheme.kernel_view(), strict=True):
        assert (a is None) == (b is None)


def test_derived_flags_and_words() -> None:
    kt = _kt(k_offset=None)
    assert kt.has_rotation and not kt.has_offset and kt.dims() == (H, D)
    g = GroupScales.for_head_dim(80)
    assert (g.group_size, g.n_groups, g.dynamic) == (16, 5, True)
    assert GroupScales.for_head_dim(128).group_size == 64
    assert not PerHeadScales(torch.ones(H), torch.ones(H)).dynamic
    assert scheme_names() == (
        "per-tensor", "per-head", "fp32-group", "k-transform", "nvfp4", "mxfp4", "fp8-k-nvfp4-v",
        "k-transform-k-nvfp4-v", "k-transform-nvfp4", "k-transform-mxfp4",
    )  # fmt: skip
    assert scheme_class("per-head") is PerHeadScales
    with pytest.raises(ScaleFormatError, match="scale scheme 'per-token' is unknown"):
        scheme_class("per-token")
    assert ORTHONORMAL_TOL == 1e-4


def test_class_facts_describe_each_scheme_without_an_instance() -> None:
    """What the registry, the pool sizing and the checkpoint writers ask a scheme's class."""
    assert PerTensorScales.scale_shape(3) == () and PerHeadScales.scale_shape(3) == (3,)
    assert KTransformScales.scale_shape(3) == (3,) and GroupScales.scale_shape(3) is None
    assert [c.transforms_keys for c in (PerTensorScales, GroupScales, KTransformScales)] == [
        False,
        False,
        True,
    ]
    assert GroupScales.group_scales(128, 32) == 4 and GroupScales.group_scales(80) == 5
    assert PerHeadScales.group_scales(128, 32) == 0
    # one FP8 byte per element, plus 4 bytes per fp32 group scale; K and V
    assert PerTensorScales.slot_bytes(2, 128) == KTransformScales.slot_bytes(2, 128) == 512
    assert GroupScales.slot_bytes(2, 128, 32) == 2 * 2 * (128 + 4 * 4) == 576
    with pytest.raises(ScaleFormatError, match="does not divide head_dim 128"):
        GroupScales.slot_bytes(2, 128, 48)
    # 4-bit: half a byte per element and one scale byte per block; FP8 K beside NVFP4 V
    assert Nvfp4Scales.slot_bytes(2, 128) == 2 * 2 * (64 + 128 // 16) == 288
    assert Mxfp4Scales.slot_bytes(2, 128) == 2 * 2 * (64 + 128 // 32) == 272
    assert Fp8KNvfp4VScales.slot_bytes(2, 128) == 2 * (128 + 64 + 8) == 400
    assert Nvfp4Scales.scale_shape(3) is None and not Nvfp4Scales.transforms_keys
    # 4-bit K in the k-transform's frame: the pages of nvfp4 / mxfp4 (the side buffer apart)
    for kt, plain in ((KTransformNvfp4Scales, Nvfp4Scales), (KTransformMxfp4Scales, Mxfp4Scales)):
        assert kt.transforms_keys and kt.kv_format() == plain.name
        assert kt.slot_bytes(2, 128) == plain.slot_bytes(2, 128)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: Mxfp4Scales(48), "head_dim is 48; expected an int, a multiple of the block size 32"),
        (lambda: Nvfp4Scales(24, torch.tensor(1.0), torch.tensor(1.0)), "block size 16"),
        (lambda: Nvfp4Scales(D, torch.tensor(1.0), None), "v_global_scale is a NoneType"),
        (lambda: Nvfp4Scales(D, torch.tensor(0.0), torch.tensor(1.0)),
         r"k_global_scale element 0 is 0.0; expected .* \(NVFP4: amax / \(6 \* 448\)\)"),
        (lambda: Nvfp4Scales(D, torch.tensor(1.0), torch.tensor(float("inf"))), "element 0 is inf"),
        (lambda: Nvfp4Scales(D, torch.ones(H), torch.tensor(1.0)), "expected the same shape"),
        (lambda: Nvfp4Scales(D, torch.ones(H, 1), torch.ones(H, 1)), r"has shape \(2, 1\)"),
        (lambda: Nvfp4Scales(D, torch.ones(H).half(), torch.ones(H)), "dtype torch.float16"),
        (lambda: Fp8KNvfp4VScales(D, torch.tensor(-1.0), torch.tensor(1.0)),
         r"k_scale element 0 is -1.0; expected .* \(amax / 448\)"),
        (lambda: KTransformNvfp4Scales(D, torch.ones(H), torch.ones(H), torch.zeros(3, D)),
         r"k-transform-nvfp4 scales: k_offset has shape \(3, 16\); expected \(2, head_dim\)"),
        (lambda: KTransformNvfp4Scales(D, torch.tensor(1.0), torch.tensor(1.0), None,
                                       torch.ones(D, D)), "not orthonormal"),
        (lambda: KTransformMxfp4Scales(64, torch.zeros(H, 32)), "for head_dim 32, the scheme's"),
        (lambda: KTransformMxfp4Scales(32, first_tokens=True), "first_tokens is True"),
    ],
)  # fmt: skip
def test_4bit_schemes_refuse_bad_input_once_at_construction(
    build: Callable[[], Scheme], match: str
) -> None:
    with pytest.raises(ScaleFormatError, match=match) as info:
        build()
    assert isinstance(info.value, ValueError) and "Fix:" in str(info.value)


def test_4bit_schemes_describe_each_side() -> None:
    s = Fp8KNvfp4VScales(D, torch.full((H,), 0.1), torch.full((H,), 2.0))
    view = s.kernel_view()
    assert (view.k_fp4, view.v_fp4, view.group_size) == (None, NVFP4, None)
    assert s.dims() == (H, D) and s.dynamic and s.first_tokens == 0
    assert Mxfp4Scales(64).kernel_view()[:2] == (None, None)
    assert Mxfp4Scales(64).kernel_view().k_fp4 is MXFP4 and Mxfp4Scales(64).dims() == (None, 64)
    g = torch.tensor(1.0)
    nv = Nvfp4Scales(D, g, g)
    g.fill_(5.0)  # the scheme keeps its own copy
    assert float(nv.k_global_scale) == 1.0  # type: ignore[arg-type]
    assert scheme_class("fp8-k-nvfp4-v") is Fp8KNvfp4VScales


def test_kv_formats_agree_with_their_schemes() -> None:
    """KVFormat's properties (kvquant.choices imports no torch) say what the schemes' classes
    say: each 4-bit word names a scheme whose sides and blocks are the format's."""
    assert fp4_format("nvfp4") is NVFP4 and fp4_format("mxfp4") is MXFP4
    assert fp4_format("fp8") is None and fp4_format(KVFormat.NVFP4) is NVFP4
    assert not KVFormat.FP8.four_bit and KVFormat.FP8.block_size is None
    for fmt in KVFormat:
        sides = tuple(fp4_format(s) for s in fmt.sides)
        assert fmt.fp8_keys == (sides[0] is None) and fmt.four_bit == (sides[1] is not None)
        if not fmt.four_bit:
            continue
        kind = scheme_class(fmt.value)
        assert (kind.k_format, kind.v_format) == sides  # type: ignore[attr-defined]
        assert fmt.block_size == max(f.block_size for f in sides if f is not None)
    labels = [f.label for f in KVFormat]
    assert labels == ["FP8", "NVFP4", "MXFP4", "FP8 K + NVFP4 V"]
