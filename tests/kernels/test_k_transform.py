"""The static K transform (``k-transform``): offset, Hadamard rotation, first tokens.

The torch reference is checked against exact algebra (attention with the transform equals
fp32 attention over the model-frame keys it dequantizes to) and against the unquantized
model (FP8 tolerance; the transform beats plain per-head scales on biased K). The public
schemes refuse a malformed transform when built (``ScaleFormatError``); the entry points refuse
per-call tensors that do not fit (``KernelInputError``). The Triton
kernels (interpreter) are compared with the reference: write codes as in test_write.py,
attention within 5e-3 over NaN-poisoned outputs and pages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from numerics import assert_close_rel
from paged_cases import PagedCase, build_case, negate_k_scale

from kvquant.errors import KernelInputError, KVQuantError, ScaleFormatError
from kvquant.kernels import hadamard, page_storage, paged_attention, write_kv
from kvquant.kernels.attention.launch import paged_attention_triton
from kvquant.kernels.fp8 import dequantize_pages, gather_kv
from kvquant.schemes import FirstTokens, GroupScales, KTransformScales, Pages, Scheme

REL_TOL = 5e-3


@pytest.mark.parametrize("dim", [1, 2, 16, 64, 128])
def test_hadamard_is_symmetric_orthonormal_with_equal_magnitudes(dim: int) -> None:
    h = hadamard(dim)
    assert h.dtype == torch.float32 and h.shape == (dim, dim)
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h, torch.eye(dim), atol=1e-6)
    assert torch.allclose(h.abs(), torch.full((dim, dim), dim**-0.5))
    assert bool((h[0] > 0).all())  # Sylvester's first row is all +


@pytest.mark.parametrize("dim", [0, 3, 96, -4])
def test_hadamard_refuses_non_power_of_two(dim: int) -> None:
    with pytest.raises(KernelInputError, match="power-of-two head_dim") as info:
        hadamard(dim)
    assert isinstance(info.value, ValueError) and "rotation=None" in str(info.value)


def _model_frame_attention(case: PagedCase) -> torch.Tensor:
    """fp32 SDPA per sequence over the keys the pages dequantize to in the model frame.

    First tokens come from the side buffer rotated back (``first_k @ R^T``). No transform
    algebra here: if the reference's rotated-frame scores differ, this catches it.
    """
    view = case.scheme.kernel_view()
    rot, off = view.k_rotation, view.k_offset
    bsz, lq, hq, d = case.query.shape
    hkv = case.pages.k.shape[2]
    group = hq // hkv
    out = torch.zeros(bsz, lq, hq, d)
    kv_start, first = case.mask.kv_start, case.first
    starts = kv_start.tolist() if kv_start is not None else [0] * bsz
    firsts = first.lens.tolist() if first is not None else [0] * bsz
    for b in range(bsz):
        n = int(case.seq_lens[b])
        if n == 0:
            continue
        k = dequantize_pages(
            gather_kv(case.pages.k, case.block_tables, n, b),
            view.k_scale,
            None,
            k_offset=off,
            k_rotation=rot,
        )
        v = dequantize_pages(gather_kv(case.pages.v, case.block_tables, n, b), view.v_scale, None)
        s0, nf = starts[b], firsts[b]
        if first is not None and nf:
            fk = first.k[b, :nf].float()
            k[s0 : s0 + nf] = fk if rot is None else fk @ rot.T
            v[s0 : s0 + nf] = first.v[b, :nf].float()
        pos_q = torch.arange(n - lq, n)[:, None]
        pos_k = torch.arange(n)[None, :]
        mask = (pos_k >= s0) & (pos_k <= pos_q)
        qb = case.query[b].float().transpose(0, 1)  # [Hq, Lq, D]
        kb = k.repeat_interleave(group, dim=1).transpose(0, 1)
        vb = v.repeat_interleave(group, dim=1).transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask, scale=case.sm_scale
        )
        out[b] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("transform", ["offset", "rotation", "both"])
@pytest.mark.parametrize("first", [None, [1, 0, 2]], ids=["no-first", "first-1-0-2"])
def test_reference_transform_is_exact_algebra(transform: str, first: list[int] | None) -> None:
    """The rotated-frame scores ``q'·(code*s + c)`` equal ``q·k`` on the model-frame keys."""
    case = build_case(
        [37, 20, 50], hq=8, hkv=2, d=64, lq=3, kv_start=[0, 4, 9], granularity="per-head",
        k_transform=transform, first_lens=first, n_first=2, qdtype=torch.float32, seed=3,
    )  # fmt: skip
    ref = case.reference()
    assert bool(torch.isfinite(ref).all())  # the poisoned first-token slots were never read
    assert_close_rel(ref, _model_frame_attention(case), rel_tol=2e-5)


@pytest.mark.parametrize("transform", ["offset", "rotation", "both"])
def test_write_reference_stores_the_transformed_key(transform: str) -> None:
    """Codes are ``fp8((k @ R - c) / s)``: dequantized to the model frame they give K back."""
    d, hkv = 64, 2
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(1, 12, hkv, d, generator=gen)
    key[..., 5] += 20.0  # a near-constant channel
    rot = hadamard(d) if transform != "offset" else None
    rotated = key if rot is None else key @ rot
    off = rotated[0].mean(0) if transform != "rotation" else None
    stored = rotated - (0 if off is None else off)
    ks = stored.abs().amax(dim=(0, 1, 3)) / 448
    vs = torch.full((hkv,), 0.01)
    kp, vp = page_storage(2, 16, hkv, d)
    slots = torch.arange(12)[None]
    write_kv(key, key, Pages(kp, vp), slots, KTransformScales(ks, vs, off, rot), backend="torch")
    want = (stored / ks[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(kp.view(-1, hkv, d)[:12].view(torch.uint8), want[0].view(torch.uint8))
    plain_v = (key / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)  # V untouched
    assert torch.equal(vp[0, :12].view(torch.uint8), plain_v[0].view(torch.uint8))
    back = dequantize_pages(kp.view(-1, hkv, d)[:12], ks, None, k_offset=off, k_rotation=rot)
    assert_close_rel(back, key[0], rel_tol=0.04)


def _unquantized_attention(case: PagedCase) -> torch.Tensor:
    """fp32 causal SDPA over the K/V ``build_case`` drew, before any rounding."""
    assert case.key is not None and case.value is not None
    bsz, lq, hq, d = case.query.shape
    group = hq // case.key.shape[2]
    out = torch.zeros(bsz, lq, hq, d)
    for b, n in enumerate(case.seq_lens.tolist()):
        qb = case.query[b].float().transpose(0, 1)
        kb = case.key[b, :n].repeat_interleave(group, dim=1).transpose(0, 1)
        vb = case.value[b, :n].repeat_interleave(group, dim=1).transpose(0, 1)
        mask = torch.arange(n)[None, :] <= torch.arange(n - lq, n)[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask, scale=case.sm_scale
        )
        out[b] = o.transpose(0, 1)
    return out


def test_transform_beats_per_head_on_biased_keys() -> None:
    """Against unquantized attention, offset + rotation + first token lose under half of per-head.

    The same K (large near-constant channels), V and query: per-head scales round the biased
    channels coarsely; the transform stores K around its offset.
    """
    errs = {}
    for name, kw in (
        ("per-head", {"k_transform": "biased"}),
        ("k-transform", {"k_transform": "both", "first_lens": [1, 1], "n_first": 1}),
    ):
        case = build_case(
            [300, 200], hq=8, hkv=2, d=64, lq=4, granularity="per-head", qdtype=torch.float32,
            seed=21, **kw,
        )  # fmt: skip
        exact = _unquantized_attention(case)
        errs[name] = float((case.reference() - exact).norm() / exact.norm())
    # FP8 rounding of V alone costs a few per cent against unquantized attention on random data
    assert errs["k-transform"] < 0.04, errs
    assert errs["k-transform"] * 2 < errs["per-head"], errs


# ------------------------------------------------------------------ validation


def _kt_case(**kw: Any) -> PagedCase:
    return build_case(
        [20, 9], hq=4, hkv=2, d=16, granularity="per-head", k_transform="both",
        first_lens=[1, 1], n_first=2, **kw,
    )  # fmt: skip


def _attend(case: PagedCase, scheme: Scheme, first: FirstTokens | None) -> torch.Tensor:
    """``paged_attention`` (torch) of the case's query and pages with ``scheme`` and ``first``."""
    return paged_attention(
        case.query, case.pages, case.block_tables, case.seq_lens, scheme,
        sm_scale=case.sm_scale, mask=case.mask, first=first, backend="torch",
    )  # fmt: skip


def _kt_scheme(case: PagedCase, **changes: Any) -> KTransformScales:
    """The case's K transform as a scheme, with ``changes`` to its tensors."""
    assert isinstance(case.scheme, KTransformScales) and case.first is not None
    parts: dict[str, Any] = {
        "k_scale": case.scheme.k_scale,
        "v_scale": case.scheme.v_scale,
        "k_offset": case.scheme.k_offset,
        "k_rotation": case.scheme.k_rotation,
        "first_tokens": case.first.k.shape[1],
        **changes,
    }
    return KTransformScales(**parts)


def _kt_first(case: PagedCase, **changes: Any) -> FirstTokens:
    assert case.first is not None
    return dataclasses.replace(case.first, **changes)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"k_offset": torch.zeros(2, 8)}, r"k_offset has shape \(2, 8\); expected \(2, 16\)"),
        ({"k_offset": torch.zeros(2, 16, dtype=torch.float16)}, "k_offset has dtype"),
        ({"k_rotation": torch.eye(8)}, r"k_offset has shape \(2, 16\); expected \(2, 8\)"),
        ({"k_rotation": torch.eye(16, dtype=torch.float64)}, "k_rotation has dtype"),
        ({"k_offset": torch.full((2, 16), float("nan"))}, "k_offset element 0 .* expected finite"),
        ({"k_rotation": torch.eye(16) * float("inf")}, "k_rotation element 0 .* expected finite"),
    ],
)
def test_malformed_transform_is_refused_when_the_scheme_is_built(
    changes: dict[str, Any], match: str
) -> None:
    case = _kt_case()
    with pytest.raises(ScaleFormatError, match=match) as info:
        _kt_scheme(case, **changes)
    assert isinstance(info.value, ValueError) and "Fix:" in str(info.value)


@pytest.mark.parametrize(
    "scheme_changes, first_changes, match",
    [
        (
            {"k_rotation": torch.eye(8), "k_offset": None},
            {},
            r"k_rotation has shape \(8, 8\); expected \(16, 16\)",
        ),
        (
            {"k_rotation": None, "k_offset": torch.zeros(2, 8)},
            {},
            r"k_offset has shape \(2, 8\); expected \(2, 16\)",
        ),
        ({}, {"v": None}, "first_v is None but the other first-token arguments"),
        ({}, {"k": None, "lens": None}, "first_k, first_lens is None"),
        ({}, {"k": torch.zeros(2, 2, 2, 8)}, "first_k has shape"),
        ({}, {"v": torch.zeros(2, 3, 2, 16)}, "first_v has shape"),
        ({}, {"k": torch.zeros(2, 2, 2, 16, dtype=torch.float64)}, "first_k has dtype"),
        ({}, {"lens": torch.tensor([1, 1])}, "first_lens has dtype torch.int64"),
        ({}, {"lens": torch.tensor([3, 0], dtype=torch.int32)}, r"first_lens\[0\] is 3"),
        ({}, {"lens": torch.tensor([0, -1], dtype=torch.int32)}, r"first_lens\[1\] is -1"),
    ],
)
def test_attention_refuses_a_transform_or_side_buffer_that_does_not_fit(
    scheme_changes: dict[str, Any], first_changes: dict[str, Any], match: str
) -> None:
    """A well-formed scheme for other pages, or a malformed side buffer: refused per call."""
    case = _kt_case()
    scheme, first = _kt_scheme(case, **scheme_changes), _kt_first(case, **first_changes)
    with pytest.raises(KernelInputError, match=match) as info:
        _attend(case, scheme, first)
    assert isinstance(info.value, ValueError) and "Fix:" in str(info.value)


def test_first_lens_beyond_the_cached_tokens_is_refused() -> None:
    case = _kt_case(kv_start=[0, 8])  # row 1: 9 tokens, 8 of them padding: one first token max
    scheme = _kt_scheme(case)
    _attend(case, scheme, _kt_first(case))
    too_many = _kt_first(case, lens=torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(KernelInputError, match=r"first_lens\[1\] is 2.*seq_lens\[1\] - kv_start"):
        _attend(case, scheme, too_many)


def test_transform_with_group_scales_is_refused() -> None:
    """A K transform needs static scales (refused when built without); beside group scales in
    the Pages, or a side buffer beside a GroupScales scheme, the kernel refuses the mix."""
    case = build_case([20], hq=4, hkv=2, d=16, granularity="fp32-group", group_size=8)
    with pytest.raises(ScaleFormatError, match="k_scale is a NoneType; expected an fp32 tensor"):
        KTransformScales(None, None, torch.zeros(2, 16))  # type: ignore[arg-type]
    transform = KTransformScales(torch.full((2,), 0.1), torch.full((2,), 0.1), torch.zeros(2, 16))
    with pytest.raises(KernelInputError, match=r"'k-transform' scheme and Pages\.k_scales"):
        _attend(case, transform, None)
    first = FirstTokens(
        torch.zeros(1, 1, 2, 16), torch.zeros(1, 1, 2, 16), torch.ones(1, dtype=torch.int32)
    )
    with pytest.raises(KernelInputError, match=r"first-token buffers.*fp32 group scales"):
        _attend(case, GroupScales(head_dim=16, group_size=8), first)


def test_write_refuses_malformed_transform() -> None:
    kp, vp = page_storage(2, 16, 2, 16)
    key = torch.randn(1, 3, 2, 16)
    slots = torch.arange(3)[None]
    ks = torch.tensor(0.01)
    before = kp.clone()
    with pytest.raises(ScaleFormatError, match=r"k_offset has shape \(16,\)"):
        KTransformScales(ks, ks, k_offset=torch.zeros(16))
    with pytest.raises(ScaleFormatError, match="expected finite"):
        KTransformScales(ks, ks, k_offset=torch.full((2, 16), float("inf")))
    with pytest.raises(KernelInputError, match=r"k_rotation has shape \(4, 4\)"):
        write_kv(key, key, Pages(kp, vp), slots, KTransformScales(ks, ks, k_rotation=torch.eye(4)),
                 backend="torch")  # fmt: skip
    gs = torch.ones(2, 16, 2, 2)
    with pytest.raises(KVQuantError, match=r"'k-transform' scheme and Pages\.k_scales"):
        write_kv(key, key, Pages(kp, vp, gs, gs.clone()), slots,
                 KTransformScales(ks, ks, torch.zeros(2, 16)), backend="torch")  # fmt: skip
    assert torch.equal(kp.view(torch.uint8), before.view(torch.uint8))  # nothing written


# ------------------------------------------------------------------ Triton vs reference

# (id, build_case kwargs, launcher extras); every case has the biased K of build_case
KT_CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("decode-offset", dict(lens=[37, 90], hq=8, hkv=2, d=64, k_transform="offset"), {}),
    ("decode-rotation-per-tensor",
     dict(lens=[37, 90], hq=8, hkv=2, d=64, k_transform="rotation", granularity="per-tensor"),
     {}),
    ("decode-both-split3", dict(lens=[150, 33], hq=8, hkv=2, d=64, k_transform="both"),
     {"num_splits": 3}),
    ("decode-first-only", dict(lens=[40, 70], hq=8, hkv=2, d=64, first_lens=[1, 2], n_first=2),
     {"num_splits": 2}),
    ("decode-both-first-rows-differ-split2",
     dict(lens=[75, 30, 50], hq=8, hkv=2, d=64, k_transform="both", first_lens=[1, 0, 3],
          n_first=3, kv_start=[0, 5, 13]),
     {"num_splits": 2}),
    ("decode-gqa3-d16-first-bf16",
     dict(lens=[20, 9], hq=6, hkv=2, d=16, k_transform="both", first_lens=[1, 1], n_first=1,
          first_dtype=torch.bfloat16, qdtype=torch.bfloat16),
     {}),
    ("decode-mha-d128-page32-both-first",
     dict(lens=[70, 1], hq=2, hkv=2, d=128, page=32, k_transform="both", first_lens=[1, 1],
          n_first=1),
     {"num_splits": 2}),
    ("decode-softcap-window-first",
     dict(lens=[90, 40], hq=8, hkv=2, d=64, k_transform="both", first_lens=[2, 1], n_first=2,
          softcap=5.0, window=24),
     {"num_splits": 2}),
    ("decode-window-hides-first",
     dict(lens=[90], hq=4, hkv=1, d=64, k_transform="offset", first_lens=[1], n_first=1,
          window=30),
     {}),
    ("decode-speculative-lq3-first",
     dict(lens=[60, 4], hq=8, hkv=2, d=64, lq=3, q_lens=[3, 2], k_transform="both",
          first_lens=[1, 1], n_first=1),
     {"num_splits": 2}),
    ("decode-fp32-query-e5m2",
     dict(lens=[41, 3], hq=8, hkv=2, d=64, k_transform="both", first_lens=[1, 1], n_first=1,
          qdtype=torch.float32, fp8=torch.float8_e5m2),
     {}),
    ("prefill-fresh-first-tokens",
     dict(lens=[40, 55], hq=8, hkv=2, d=64, lq=40, q_lens=[40, 33], k_transform="both",
          first_lens=[1, 2], n_first=2),
     {"config": {"BLOCK_M": 32, "QPB": 8, "BLOCK_N": 16}}),
    ("prefill-chunk-over-prefix-left-padding",
     dict(lens=[80, 64], hq=8, hkv=2, d=64, lq=24, kv_start=[3, 17], k_transform="both",
          first_lens=[1, 0], n_first=1),
     {"config": {"BLOCK_M": 32, "QPB": 8, "BLOCK_N": 32}}),
    ("prefill-softcap-window-offset",
     dict(lens=[100], hq=8, hkv=2, d=64, lq=48, softcap=3.0, window=30, k_transform="offset",
          first_lens=[1], n_first=1),
     {"config": {"BLOCK_M": 64, "QPB": 16, "BLOCK_N": 16}}),
    ("prefill-non-causal-rotation",
     dict(lens=[70], hq=2, hkv=2, d=128, lq=70, page=64, causal=False, k_transform="rotation",
          first_lens=[2], n_first=2),
     {"config": {"BLOCK_M": 32, "QPB": 32, "BLOCK_N": 32}}),
]  # fmt: skip


def _triton(case: PagedCase, **extra: Any) -> torch.Tensor:
    out = torch.full(case.query.shape, float("nan"), dtype=case.query.dtype)
    got = case.attend(paged_attention_triton, out=out, **extra)
    assert got is out
    return out


@pytest.mark.parametrize("case_kw, extra", [c[1:] for c in KT_CASES], ids=[c[0] for c in KT_CASES])
def test_triton_matches_reference(case_kw: dict[str, Any], extra: dict[str, Any]) -> None:
    """NaN-poisoned output, pages and first-token slots; rows beyond first_lens hold NaN."""
    kw = {"granularity": "per-head", **case_kw}
    case = build_case(**kw, seed=len(kw["lens"]) * 5 + kw["hq"])
    ref = case.reference()
    assert bool(torch.isfinite(ref).all())
    assert_close_rel(_triton(case, **extra), ref, rel_tol=REL_TOL, name=str(case_kw))


DECODE_ROTATED = [
    c
    for c in KT_CASES
    if c[0].startswith("decode") and c[1].get("k_transform") in ("rotation", "both")
]


@pytest.mark.parametrize("first_outside", [True, False], ids=["query-rotated-first", "in-kernel"])
@pytest.mark.parametrize(
    "case_kw, extra", [c[1:] for c in DECODE_ROTATED], ids=[c[0] for c in DECODE_ROTATED]
)
def test_decode_query_rotation_before_or_in_the_kernel(
    case_kw: dict[str, Any], extra: dict[str, Any], first_outside: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A decode launch rotates its query before the kernel (many sequences) or in each program
    (few): both match the reference."""
    from kvquant.kernels.attention import launch

    monkeypatch.setattr(launch, "rotates_query_first", lambda n, pairs, device: first_outside)
    kw = {"granularity": "per-head", **case_kw}
    case = build_case(**kw, seed=len(kw["lens"]) * 7 + kw["hq"])
    assert_close_rel(_triton(case, **extra), case.reference(), rel_tol=REL_TOL, name=str(case_kw))


# where the first tokens are attended: split 0 (the launcher's one way since the split merge's
# FIRST_SPLIT="merge" was retired: docs/dev/kernels.md)
FIRST_WHERE: list[dict[str, str]] = [{}]
FIRST_IDS = ["in-split"]


@pytest.mark.parametrize("first", FIRST_WHERE, ids=FIRST_IDS)
@pytest.mark.parametrize("lq", [1, 40], ids=["decode", "prefill"])
@pytest.mark.parametrize("sm_scale", [-0.2, 0.0])
def test_triton_transform_score_scale_of_any_sign(
    lq: int, sm_scale: float, first: dict[str, str]
) -> None:
    """The offset term and the first tokens follow the sign trick of the score scale."""
    case = build_case(
        [50, 70], hq=8, hkv=2, d=64, lq=lq, granularity="per-head", k_transform="both",
        first_lens=[1, 2], n_first=2, seed=11,
    )  # fmt: skip
    case.sm_scale = sm_scale
    case.scheme = negate_k_scale(case.scheme, 1)  # no scheme admits the sign
    extra: dict[str, Any] = {"num_splits": 2} if lq == 1 else {}
    got = _triton(case, **extra, config=first)
    assert_close_rel(got, case.reference(), rel_tol=REL_TOL)


@pytest.mark.parametrize("first", FIRST_WHERE, ids=FIRST_IDS)
def test_triton_learned_sinks_with_transform(first: dict[str, str]) -> None:
    """Sinks add to the denominator after the offset term (split decode and one split)."""
    case = build_case(
        [64, 100], hq=8, hkv=2, d=64, granularity="per-head", k_transform="both",
        first_lens=[1, 1], n_first=1, seed=4,
    )  # fmt: skip
    case.mask = dataclasses.replace(case.mask, sinks=torch.linspace(-2.0, 6.0, 8))
    ref = case.reference()
    for splits in (1, 3):
        assert_close_rel(_triton(case, num_splits=splits, config=first), ref, rel_tol=REL_TOL)


@pytest.mark.parametrize("first", FIRST_WHERE, ids=FIRST_IDS)
def test_nan_first_key_reaches_only_rows_that_see_it(first: dict[str, str]) -> None:
    """A NaN in a visible first token's K makes its rows NaN; unused buffer rows never matter."""
    case = build_case(
        [30, 30], hq=4, hkv=2, d=64, granularity="per-head", k_transform="both",
        first_lens=[1, 1], n_first=2, seed=9,
    )  # fmt: skip
    assert case.first is not None
    case.first.k[0, 0, 1, 5] = float("nan")  # row 0, KV head 1
    ref = case.reference()
    assert bool(ref[0, :, 2:].isnan().all()) and bool(ref[0, :, :2].isfinite().all())
    got = _triton(case, num_splits=2, config=first)
    assert torch.equal(got.isnan(), ref.isnan())
    assert_close_rel(got[1], ref[1], rel_tol=REL_TOL)


def test_public_api_dispatches_transform_to_triton() -> None:
    """``paged_attention(backend="triton")`` passes the transform through (and checks layout)."""
    case = _kt_case()
    got = case.attend(paged_attention, backend="triton")
    assert_close_rel(got, case.reference(), rel_tol=REL_TOL)
    assert case.first is not None
    strided = _kt_first(case, k=case.first.k.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(KernelInputError, match=r"first_k has strides .* needs it contiguous"):
        case.attend(paged_attention, first=strided, backend="triton")


@pytest.mark.parametrize("first", FIRST_WHERE, ids=FIRST_IDS)
def test_nan_first_value_no_query_sees_never_reaches_the_output(first: dict[str, str]) -> None:
    """A sliding window hides the first token from every query: its NaN value stays out."""
    case = build_case(
        [90, 90], hq=4, hkv=2, d=64, granularity="per-head", k_transform="offset",
        first_lens=[1, 1], n_first=1, window=30, seed=8,
    )  # fmt: skip
    assert case.first is not None
    case.first.v[0, 0] = float("nan")
    ref = case.reference()
    assert bool(ref.isfinite().all())
    assert_close_rel(_triton(case, num_splits=2, config=first), ref, rel_tol=REL_TOL)


# the query rotation: in the kernel, TF32 tensor-core dots (the other choices were retired)
ROT_VARIANTS: list[dict[str, str]] = [{}]
ROT_IDS = ["kernel-tf32"]


@pytest.mark.parametrize("rot", ROT_VARIANTS, ids=ROT_IDS)
@pytest.mark.parametrize("lq", [1, 24], ids=["decode", "prefill"])
def test_triton_rotation_variants_match_reference(rot: dict[str, str], lq: int) -> None:
    """Each rotation choice, with offset, first tokens and a negative score scale."""
    case = build_case(
        [75, 40], hq=8, hkv=2, d=64, lq=lq, granularity="per-head", k_transform="both",
        first_lens=[1, 2], n_first=2, kv_start=[0, 5], qdtype=torch.bfloat16,
        first_dtype=torch.bfloat16, seed=lq + len(rot),
    )  # fmt: skip
    case.scheme = negate_k_scale(case.scheme, 1)  # a negative scale: no scheme admits it
    if lq == 1:
        extra: dict[str, Any] = {"num_splits": 2, "config": rot}
    else:
        extra = {"config": {**rot, "BLOCK_M": 32, "QPB": 8, "BLOCK_N": 16}}
    query = case.query.clone()
    got = _triton(case, **extra)
    assert_close_rel(got, case.reference(), rel_tol=REL_TOL, name=str(rot))
    assert torch.equal(case.query, query)  # the caller's query is never rotated in place


# the transform's per-program work in its one order (the launcher's latency choices were
# retired: docs/dev/kernels.md)
LATENCY_VARIANTS: list[dict[str, Any]] = [{}]
LATENCY_IDS = ["default"]


@pytest.mark.parametrize("opts", LATENCY_VARIANTS, ids=LATENCY_IDS)
@pytest.mark.parametrize(
    "lq, splits", [(1, 2), (1, 3), (24, 1)], ids=["decode-split2", "decode-split3", "prefill"]
)
def test_triton_latency_variants_match_reference(
    opts: dict[str, Any], lq: int, splits: int
) -> None:
    """Each choice with offset, rotation and several first tokens per row (one row none).

    Three splits of two 64-key tiles leave the last split without paged keys.
    """
    case = build_case(
        [75, 40, 66], hq=8, hkv=2, d=64, lq=lq, granularity="per-head", k_transform="both",
        first_lens=[1, 3, 0], n_first=3, kv_start=[0, 5, 2], qdtype=torch.bfloat16,
        first_dtype=torch.bfloat16, seed=lq + splits + len(opts),
    )  # fmt: skip
    case.scheme = negate_k_scale(case.scheme, 1)  # a negative scale: no scheme admits it
    if lq == 1:
        extra: dict[str, Any] = {"num_splits": splits, "config": opts}
    else:
        extra = {"config": {**opts, "BLOCK_M": 32, "QPB": 8, "BLOCK_N": 16}}
    got = _triton(case, **extra)
    assert_close_rel(got, case.reference(), rel_tol=REL_TOL, name=str(opts))


@pytest.mark.parametrize("opts", LATENCY_VARIANTS, ids=LATENCY_IDS)
def test_triton_latency_variants_small_head_softcap_window(opts: dict[str, Any]) -> None:
    """A head dim of one rotation slice (16); softcap and a window keep their masks."""
    case = build_case(
        [90, 40], hq=6, hkv=2, d=16, granularity="per-head", k_transform="both",
        first_lens=[2, 1], n_first=2, softcap=5.0, window=24, seed=31,
    )  # fmt: skip
    ref = case.reference()
    assert_close_rel(_triton(case, num_splits=3, config=opts), ref, rel_tol=REL_TOL)


@pytest.mark.parametrize("granularity", ["per-head", "fp32-group"])
def test_latency_variants_leave_other_formats_alone(granularity: str) -> None:
    """Every format's split result, left padding included."""
    case = build_case(
        [150, 33], hq=8, hkv=2, d=64, granularity=granularity, kv_start=[7, 0], seed=5
    )  # fmt: skip
    ref = case.reference()
    for opts in LATENCY_VARIANTS:
        assert_close_rel(_triton(case, num_splits=3, config=opts), ref, rel_tol=REL_TOL,
                         name=str(opts))  # fmt: skip


@pytest.mark.parametrize(
    "key", ["ROT_WHERE", "ROT_PRECISION", "ROT_KIND", "ROT_SLICE", "ROT_STAGES", "EARLY_LOADS",
            "FIRST_SPLIT", "REG_TRIM", "SPLIT_FROM_END", "BLOCK_K"],
)  # fmt: skip
def test_retired_or_unknown_config_key_is_refused(key: str) -> None:
    case = _kt_case()
    with pytest.raises(KernelInputError, match=rf"config has keys \['{key}'\], expected only"):
        _triton(case, config={key: 1})


def test_decode_rotates_the_query_first_with_two_pairs_per_multiprocessor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvquant.kernels.attention import launch

    monkeypatch.setattr(launch, "device_sm_count", lambda device: 132)
    gpu = torch.device("cuda", 0)
    assert launch.rotates_query_first(1, 64 * 8, gpu)  # 64 sequences, 8 KV heads
    assert not launch.rotates_query_first(1, 32 * 8, gpu)
    assert not launch.rotates_query_first(2, 64 * 8, gpu)  # prefill: each program rotates
