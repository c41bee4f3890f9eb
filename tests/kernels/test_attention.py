"""Triton paged attention vs the fp32 reference, in Triton's CPU interpreter.

Every case writes into an output pre-filled with NaN (so an unwritten element
fails) over pages whose unwritten slots hold NaN codes (so a read past a
sequence's end fails), with shuffled block tables and -1 in unused entries.
Tolerance: ‖out − ref‖ / ‖ref‖ <= 5e-3 against fp32 attention over the
dequantized cache.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from numerics import assert_close_rel, error_report
from paged_cases import build_case, negate_k_scale

from kvquant.kernels.attention.launch import paged_attention_triton
from kvquant.kernels.attention.tuning import (
    choose_config,
    choose_num_splits,
    programs_per_sm,
)

REL_TOL = 5e-3
NUMPY_2_4 = tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4)

# fp32 group scales with two groups per head behind an unaligned first key (masked first tile)
_PREFILL_G32_PADDED: dict[str, Any] = dict(
    lens=[75, 60], hq=8, hkv=2, d=64, lq=40, kv_start=[13, 0], granularity="fp32-group",
    group_size=32,
)  # fmt: skip

# (id, build_case kwargs, launcher extras)
CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # ---- decode (Lq * group <= 64): split-KV path
    ("decode-mha-odd-len", dict(lens=[37], hq=2, hkv=2, d=64), {}),
    (
        "decode-gqa4-mixed-lens-per-head",
        dict(lens=[1, 17, 100, 64], hq=8, hkv=2, d=64, granularity="per-head"),
        {},
    ),
    (
        "decode-gqa4-split3-partial-page",
        dict(lens=[33, 150], hq=8, hkv=2, d=64),
        {"num_splits": 3},
    ),
    (
        "decode-gqa3-group32-split2",
        dict(lens=[5, 130], hq=6, hkv=2, d=64, granularity="fp32-group", group_size=32),
        {"num_splits": 2},
    ),
    (
        "decode-gqa4-group64-d128-page32",
        dict(lens=[70, 9], hq=8, hkv=2, d=128, page=32, granularity="fp32-group", group_size=64),
        {},
    ),
    (
        "decode-d128-per-token-group128-page64",
        dict(lens=[200], hq=4, hkv=1, d=128, page=64, granularity="fp32-group", group_size=128),
        {"num_splits": 2},
    ),
    (
        "decode-speculative-lq4-qlens",
        dict(lens=[60, 23], hq=8, hkv=2, d=64, lq=4, q_lens=[4, 2]),
        {"num_splits": 2},
    ),
    (
        "decode-left-padding",
        dict(lens=[50, 50], hq=8, hkv=2, d=64, kv_start=[0, 19]),
        {"num_splits": 2},
    ),
    ("decode-softcap", dict(lens=[90], hq=8, hkv=2, d=64, softcap=2.0), {"num_splits": 2}),
    ("decode-window", dict(lens=[90, 10], hq=8, hkv=2, d=64, window=24), {"num_splits": 2}),
    (
        "decode-bf16-query-hf-layout",
        dict(lens=[41, 77], hq=8, hkv=2, d=64, qdtype=torch.bfloat16, hf_layout=True),
        {},
    ),
    (
        "decode-group16-folded-four-row-copies",
        dict(lens=[75, 30], hq=8, hkv=2, d=64, granularity="fp32-group", group_size=16),
        {"num_splits": 2},
    ),
    (
        "decode-group16-dequantized-tiles",
        dict(lens=[75, 30], hq=8, hkv=2, d=64, granularity="fp32-group", group_size=16),
        {"num_splits": 2, "config": {"FOLD": 0}},
    ),
    (
        "decode-gqa8-lq2-group16-too-many-rows-to-fold",
        dict(lens=[47, 20], hq=16, hkv=2, d=64, lq=2, granularity="fp32-group", group_size=16),
        {},
    ),
    (
        "decode-group32-folded-huge-values",
        dict(
            lens=[70],
            hq=6,
            hkv=2,
            d=64,
            granularity="fp32-group",
            group_size=32,
            value_gain=1e4,
            qdtype=torch.float32,
        ),
        {"num_splits": 2},
    ),
    (
        "decode-group32-folded-tiny-values",
        dict(
            lens=[70],
            hq=6,
            hkv=2,
            d=64,
            granularity="fp32-group",
            group_size=32,
            value_gain=1e-5,
            qdtype=torch.float32,
        ),
        {},
    ),
    (
        "decode-group64-tiny-values",
        dict(lens=[90], hq=8, hkv=2, d=64, granularity="fp32-group", value_gain=1e-4),
        {},
    ),
    (
        "decode-group64-huge-values",
        dict(lens=[90], hq=4, hkv=1, d=64, granularity="fp32-group", value_gain=2e3),
        {"num_splits": 2},
    ),
    ("decode-fp32-query", dict(lens=[41], hq=4, hkv=4, d=64, qdtype=torch.float32), {}),
    (
        "decode-contiguous-pages-left-padding",
        dict(lens=[70, 50], hq=8, hkv=2, d=64, kv_start=[0, 37], contiguous_pages=True),
        {"num_splits": 2},
    ),
    (
        "decode-page8-unaligned-start",
        dict(lens=[75, 30], hq=8, hkv=2, d=64, page=8, kv_start=[13, 0], granularity="per-head"),
        {"num_splits": 2},
    ),
    (
        "decode-page24-group32",
        dict(
            lens=[100, 47],
            hq=8,
            hkv=2,
            d=64,
            page=24,
            kv_start=[0, 5],
            granularity="fp32-group",
            group_size=32,
        ),
        {"num_splits": 3},
    ),
    (
        "decode-group32-contiguous-pages",
        dict(
            lens=[70, 33],
            hq=8,
            hkv=2,
            d=64,
            granularity="fp32-group",
            group_size=32,
            contiguous_pages=True,
        ),
        {"num_splits": 2},
    ),
    ("decode-e5m2", dict(lens=[41, 3], hq=8, hkv=2, d=64, fp8=torch.float8_e5m2), {}),
    ("decode-empty-sequence", dict(lens=[0, 25], hq=8, hkv=2, d=64), {"num_splits": 2}),
    ("decode-more-splits-than-tiles", dict(lens=[20, 70], hq=8, hkv=2, d=64), {"num_splits": 8}),
    ("decode-gqa8", dict(lens=[47], hq=16, hkv=2, d=64, lq=2), {}),
    (
        "decode-for-loops-per-head",
        dict(lens=[150, 37], hq=8, hkv=2, d=64, granularity="per-head"),
        {"config": {"USE_WHILE": 0, "BLOCK_N": 32}},
    ),
    # ---- prefill / extend (Lq * group > 64)
    ("prefill-fresh-and-extend", dict(lens=[40, 90], hq=8, hkv=2, d=64, lq=40), {}),
    # the launcher's 256-row tiles (Lq * group >= 1024: test_prefill_tiles_follow_the_rows)
    ("prefill-256-row-tiles", dict(lens=[300, 280], hq=4, hkv=1, d=128, lq=260), {}),
    (
        "prefill-small-blocks-qlens-kvstart",
        dict(lens=[45, 80], hq=8, hkv=2, d=64, lq=40, q_lens=[33, 20], kv_start=[3, 0]),
        {"config": {"BLOCK_M": 32, "QPB": 8, "BLOCK_N": 16}},
    ),
    (
        "prefill-gqa3-group32",
        dict(lens=[61], hq=6, hkv=2, d=64, lq=30, granularity="fp32-group", group_size=32),
        {"config": {"BLOCK_M": 32, "QPB": 10, "BLOCK_N": 32}},
    ),
    (
        "prefill-e5m2-group32-left-padding",
        dict(_PREFILL_G32_PADDED, fp8=torch.float8_e5m2),
        {"config": {"BLOCK_M": 32, "QPB": 8, "BLOCK_N": 32}},
    ),
    (
        "prefill-group32-contiguous-pages-left-padding",
        dict(_PREFILL_G32_PADDED, contiguous_pages=True),
        {"config": {"BLOCK_M": 32, "QPB": 8, "BLOCK_N": 32}},
    ),
    (
        "prefill-group64-one-group-per-head",
        dict(lens=[50, 70], hq=8, hkv=2, d=64, lq=40, granularity="fp32-group"),
        {"config": {"BLOCK_M": 32, "QPB": 8, "BLOCK_N": 32}},
    ),
    (
        "prefill-softcap-window-per-head",
        dict(lens=[100], hq=8, hkv=2, d=64, lq=48, softcap=3.0, window=30, granularity="per-head"),
        {"config": {"BLOCK_M": 64, "QPB": 16, "BLOCK_N": 16}},
    ),
    (
        "prefill-contiguous-pages-window-page8",
        dict(lens=[90], hq=4, hkv=2, d=64, lq=40, page=8, window=21, contiguous_pages=True),
        {"config": {"BLOCK_M": 32, "QPB": 16, "BLOCK_N": 32}},
    ),
    (
        "prefill-non-causal-mha-d128-page64",
        dict(lens=[70], hq=2, hkv=2, d=128, lq=70, page=64, causal=False),
        {"config": {"BLOCK_M": 32, "QPB": 32, "BLOCK_N": 32}},
    ),
]


# every fp32-group case again with Hadamard-rotated keys (GroupScales.k_rotation): the write
# groups K @ R, the kernel rotates the query (each folded row copy keeps its group's columns)
ROTATED_K_CASES = [
    (f"{name}-rotated-k", {**kw, "k_transform": "rotation"}, extra)
    for name, kw, extra in CASES
    if kw.get("granularity") == "fp32-group"
]


@pytest.mark.parametrize(
    "case_kw, extra",
    [c[1:] for c in CASES + ROTATED_K_CASES],
    ids=[c[0] for c in CASES + ROTATED_K_CASES],
)
def test_matches_reference(case_kw: dict[str, Any], extra: dict[str, Any]) -> None:
    if extra.get("config", {}).get("USE_WHILE") == 0 and NUMPY_2_4:
        pytest.skip("runtime-bound for loops crash Triton's interpreter under numpy >= 2.4")
    case = build_case(**case_kw, seed=len(case_kw["lens"]) * 7 + case_kw["hq"])
    ref = case.reference()
    out = torch.full(case.query.shape, float("nan"), dtype=case.query.dtype)
    got = case.attend(paged_attention_triton, out=out, **extra)
    assert got is out
    assert out.dtype == case.query.dtype
    assert_close_rel(out, ref, rel_tol=REL_TOL, name=str(case_kw))


@pytest.mark.parametrize(
    "lq, config",
    [(1, {"FOLD": 0}), (40, {"BLOCK_M": 32, "QPB": 32, "BLOCK_N": 32})],
    ids=["decode-unfolded", "prefill"],
)
def test_dequantized_group_tiles_beyond_fp16_range_give_non_finite_output(
    lq: int, config: dict[str, int]
) -> None:
    """Tiles dequantized in fp16 with |K/V| above ~4094: inf/NaN, never a wrong number."""
    case = build_case(
        [90], hq=4, hkv=1, d=64, lq=lq, granularity="fp32-group", group_size=32,
        value_gain=1e4, seed=3,
    )  # fmt: skip
    assert case.pages.v_scales is not None
    v_amax = case.pages.v_scales.nan_to_num(0.0).max() * 448
    assert float(v_amax) > 4094  # stored V values beyond the limit
    out = torch.full(case.query.shape, float("nan"), dtype=case.query.dtype)
    case.attend(paged_attention_triton, out=out, config=config)
    assert not bool(torch.isfinite(out).all())


@pytest.mark.parametrize("lq", [1, 40], ids=["decode", "prefill"])
@pytest.mark.parametrize("sm_scale", [-0.2, 0.0])
def test_score_scale_of_any_sign(lq: int, sm_scale: float) -> None:
    """Negative and zero score scales (sm_scale x k_scale) match the reference.

    The kernel takes the row maximum of the raw scores and applies the scale's sign to the
    query: one head's k_scale is negated, so that heads see both signs.
    """
    case = build_case([50, 70], hq=8, hkv=2, d=64, lq=lq, granularity="per-head", seed=11)
    case.sm_scale = sm_scale
    case.scheme = negate_k_scale(case.scheme, 1)
    ref = case.reference()
    out = torch.full(case.query.shape, float("nan"), dtype=case.query.dtype)
    case.attend(paged_attention_triton, out=out, num_splits=2 if lq == 1 else None)
    assert_close_rel(out, ref, rel_tol=REL_TOL, name=f"lq={lq} sm_scale={sm_scale}")


@pytest.mark.parametrize("which", ["k", "v"])
def test_nan_group_scale_of_a_visible_slot_reaches_the_output(which: str) -> None:
    """A NaN group scale (a non-finite K/V was written) makes the rows that see it NaN.

    (The interpreter turns the FP8 NaN code into 480, so NaN codes are tested on the GPU.)
    """
    case = build_case([40, 40], hq=8, hkv=2, d=64, granularity="fp32-group", seed=5)
    page = int(case.block_tables[1, 1])  # sequence 1, position 16 + 3: visible to its query
    getattr(case.pages, f"{which}_scales")[page, 3, 0, 0] = float("nan")
    ref = case.reference()
    assert bool(torch.isnan(ref[1, :, :4]).all()) and not bool(torch.isnan(ref[0]).any())
    out = torch.zeros(case.query.shape, dtype=case.query.dtype)
    case.attend(paged_attention_triton, out=out, num_splits=2)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert_close_rel(out[0], ref[0], rel_tol=REL_TOL)


def test_output_with_hf_strides_and_zero_rows() -> None:
    """Non-contiguous ``out``; invalid query rows and key-less rows come out as zeros."""
    case = build_case([30, 0], hq=8, hkv=2, d=64, lq=3, q_lens=[2, 3])
    out = torch.full((2, 8, 3, 64), float("nan"), dtype=torch.float16).transpose(1, 2)
    case.attend(paged_attention_triton, out=out)
    assert_close_rel(out, case.reference(), rel_tol=REL_TOL)
    assert torch.equal(out[0, 2], torch.zeros_like(out[0, 2]))  # q_lens[0] = 2
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # empty sequence


def test_split_count_heuristic() -> None:
    assert choose_num_splits(256, 16384, 132) == 1  # B32 x Hkv8: one wave of 256 / 264
    assert choose_num_splits(512, 16384, 132) == 1  # B64: two full waves
    assert choose_num_splits(64, 16384, 132) == 4  # B8: 256 programs, not 5 x 64 = 1.2 waves
    # B1 x 32k: 32 splits of 8 tiles; 28 splits would be 10-tile splits (38 vs 33 us)
    assert choose_num_splits(8, 32768, 132) == 32
    assert choose_num_splits(8, 32768, 132, block_n=64) == 32
    assert choose_num_splits(64, 1024, 132) == 4  # B8 x 1k: 4 splits of 2 tiles
    assert choose_num_splits(3, 64, 132) == 1  # one tile: nothing to split
    assert choose_num_splits(8, 300, 132, block_n=128) == 3  # at most one split per tile
    # 9/3/64, B32: 3 programs per SM -> 4 splits (384 <= 396 slots), not 5 (1.2 waves)
    assert choose_num_splits(96, 16384, 132, programs_per_sm=3) == 4
    # 2 per SM: 5 splits (480 programs, 0.9 of a wave), not 8 (768: three waves of 264)
    assert choose_num_splits(96, 16384, 132) == 5
    # 32/8/64 B16 x 1k at 3 per SM: 3 splits (balance 8 / 9 tiles) beat 2 (0.65 of a wave)
    assert choose_num_splits(128, 1024, 132, programs_per_sm=3) == 3


def test_split_count_stays_within_two_waves_and_steady_over_table_widths() -> None:
    """B64 x 8 KV heads at 6 programs per SM (fp32-group / NVFP4 decode, head_dim 64): the
    same 3 splits for every table width of a 2k context and its growth headroom, where the
    unbounded rule jumped between 3 and 55 (17 at the 3088 key slots of a cache's tables)."""
    widths = range(2048, 4224, 16)
    counts = {choose_num_splits(512, w, 132, programs_per_sm=6, block_n=64) for w in widths}
    assert counts == {3}
    for programs, pps in ((512, 8), (256, 5), (384, 6), (128, 6), (1024, 4)):
        slots = 132 * pps
        for w in range(1024, 16384, 48):
            s = choose_num_splits(programs, w, 132, programs_per_sm=pps, block_n=64)
            assert programs * s <= max(programs, 2 * slots), (programs, pps, w, s)


def test_split_count_bound_changes_only_counts_beyond_two_waves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the wave-and-balance rule alone makes at most two waves, the bound keeps its count."""
    from kvquant.kernels.attention import tuning

    grid = [
        (programs, w, pps)
        for programs in (8, 24, 48, 96, 128, 256, 512)
        for pps in (2, 5, 8)
        for w in range(256, 40000, 1552)
    ]
    bounded = {
        g: choose_num_splits(g[0], g[1], 132, programs_per_sm=g[2], block_n=64) for g in grid
    }
    choose_num_splits.cache_clear()
    monkeypatch.setattr(tuning, "MAX_SPLIT_WAVES", 10**9)
    try:
        for (programs, w, pps), s in bounded.items():
            free = choose_num_splits(programs, w, 132, programs_per_sm=pps, block_n=64)
            if programs * free <= 2 * 132 * pps:
                assert s == free, (programs, w, pps, s, free)
            else:
                assert s < free and programs * s <= max(programs, 2 * 132 * pps)
    finally:
        choose_num_splits.cache_clear()


def test_programs_per_sm() -> None:
    """Residency from ptxas numbers of the decode kernel (sm_90, Triton 3.6)."""
    assert programs_per_sm(230, 4, 41472) == 2  # D128, BLOCK_N 128: register-limited
    assert programs_per_sm(162, 4, 39936) == 3  # D64: 168 regs after rounding -> 3
    assert programs_per_sm(115, 4, 20992) == 4
    assert programs_per_sm(64, 4, 120000) == 1  # shared-memory-limited
    assert programs_per_sm(16, 16, 0) == 4  # thread-limited: 4 x 512 threads
    assert programs_per_sm(255, 8, 1024) == 1
    assert programs_per_sm(142, 2, 20512) == 7
    assert programs_per_sm(128, 2, 20512) == 8


def test_numerics_helper_flags_errors() -> None:
    """The helper fails on NaN and on a perturbed output, and passes an exact one."""
    ref = torch.randn(4, 5)
    rep = error_report(ref.clone(), ref)
    assert rep.rel_err == 0.0 and not rep.first_mismatches
    bad = ref.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close_rel(bad, ref)
    with pytest.raises(AssertionError, match="exceeds"):
        assert_close_rel(ref * 1.01, ref)


def test_programmatic_dependent_launch_only_on_nvidia_sm90() -> None:
    """PDL launches need sm_90+ NVIDIA devices: never on CPU, ROCm or older GPUs."""
    import kvquant.kernels.attention.launch as at

    assert not at.supports_pdl(torch.device("cpu"))
    assert not at.pdl_capable((9, 0), hip=True)  # ROCm reports (9, x) capabilities too
    for cap, expected in (((8, 0), False), ((9, 0), True), ((10, 0), True)):
        assert at.pdl_capable(cap) is expected


def test_prefill_tiles_follow_the_rows() -> None:
    """Static-scale prefill at head_dim 128 takes 256-row tiles where there are rows for four."""
    assert choose_config(260, 4, 128).BLOCK_M == 256  # the "prefill-256-row-tiles" case
    assert choose_config(255, 4, 128).BLOCK_M == 128
    assert choose_config(2048, 4, 64).BLOCK_M == 128
    assert choose_config(2048, 4, 128, group_dequant=True).BLOCK_M == 128
    assert choose_config(2048, 4, 256).BLOCK_M == 64


def test_four_bit_decode_tiles_follow_the_format() -> None:
    """4-bit decode: 32-key tiles on one warp with an MXFP4 or an FP8 side, 64 keys on 2 warps
    for NVFP4 on both sides and for FP8 (the H200 sweep of docs/dev/fp4-formats.md)."""
    tiles = {f: choose_config(1, 4, 128, fp4=f) for f in ((0, 0), (1, 1), (2, 2), (0, 1))}
    assert [(t.BLOCK_N, t.num_warps) for t in tiles.values()] == [
        (64, 2),
        (64, 2),
        (32, 1),
        (32, 1),
    ]
    assert choose_config(1, 4, 256, fp4=(2, 2)).BLOCK_N == 32
    assert choose_config(1, 4, 256, fp4=(2, 2)).num_warps == 4  # head_dim 256 keeps its tiles
    assert choose_config(64, 4, 128, fp4=(2, 2)) == choose_config(64, 4, 128)  # prefill
