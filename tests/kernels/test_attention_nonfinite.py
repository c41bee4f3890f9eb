"""A non-finite K/V of a later key inside one causal chunk, at the kernel API.

Query row ``i`` of a chunk does not see the keys after it, but its masked
probabilities are exact zeros that still multiply those keys' values. SDPA's
math kernel and eager attention compute ``0 * NaN = NaN``: a NaN (or inf) value
of a later key reaches every row. The torch reference does the same over the
dequantized pages; the Triton kernels do it tile by tile, so rows whose query
tile ends before that key stay finite (as in fused flash kernels). Whatever
the tiling: a row that sees the key is NaN, and a finite row is the clean value.

A non-finite K is different: a masked score is replaced by ``-inf`` (not added
to), so only the rows that see that key are NaN, in the reference and the
Triton kernels alike (SDPA with a boolean mask adds ``-inf`` and gets NaN everywhere).
(The interpreter turns the FP8 NaN code into 480, so the non-finite value enters
through a NaN group scale, as a non-finite K/V written by ``write_kv`` does.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import assert_close_rel
from paged_cases import PagedCase, build_case
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvquant.kernels.attention.launch import paged_attention_triton
from kvquant.kernels.fp8 import dequantize_pages, gather_kv

LENS, LQ, PAGE = [40, 40], 24, 16
POISONED = 36  # sequence 0, chunk row 20 of 24: rows 0-19 do not see it
REL_TOL = 2e-2


def _case(which: str | None) -> PagedCase:
    case = build_case(LENS, hq=4, hkv=1, d=64, lq=LQ, granularity="fp32-group", seed=5)
    if which is not None:
        page = int(case.block_tables[0, POISONED // PAGE])
        getattr(case.pages, f"{which}_scales")[page, POISONED % PAGE, 0, 0] = float("nan")
    return case


def _rows_nan(out: torch.Tensor) -> list[int]:
    """Chunk rows of sequence 0 holding a NaN."""
    return torch.isnan(out[0].float()).flatten(1).any(-1).nonzero().flatten().tolist()


def _sdpa_math(case: PagedCase) -> torch.Tensor:
    """SDPA's math kernel on the dequantized K/V of sequence 0 with the causal boolean mask."""
    n = int(case.seq_lens[0])
    p = case.pages
    k, v = (
        dequantize_pages(gather_kv(codes, case.block_tables, n, 0), None,
                         gather_kv(scales, case.block_tables, n, 0))
        for codes, scales in ((p.k, p.k_scales), (p.v, p.v_scales))
    )  # fmt: skip
    q = case.query[0].float().transpose(0, 1)  # [Hq, Lq, D]
    k, v = (t.transpose(0, 1).repeat_interleave(4, dim=0) for t in (k, v))  # [Hq, n, D]
    pos_q = torch.arange(n - LQ, n)[:, None]
    mask = torch.arange(n)[None, :] <= pos_q
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.sm_scale)
    return out.transpose(0, 1)[None]  # [1, Lq, Hq, D]


def test_reference_nan_value_pattern_equals_sdpa_math() -> None:
    case = _case("v")
    ref = case.reference()
    assert _rows_nan(ref) == list(range(LQ))  # rows 0-19 too: 0 x NaN
    assert _rows_nan(_sdpa_math(case)) == list(range(LQ))
    assert not bool(torch.isnan(ref[1]).any())


def test_reference_nan_key_reaches_only_the_rows_that_see_it() -> None:
    case = _case("k")
    ref = case.reference()
    assert _rows_nan(ref) == list(range(POISONED - (LENS[0] - LQ), LQ))
    clean = _case(None).reference()
    torch.testing.assert_close(ref[0, :20], clean[0, :20])
    assert _rows_nan(_sdpa_math(case)) == list(range(LQ))  # SDPA: NaN + (-inf) = NaN everywhere


@pytest.mark.parametrize("which", ["v", "k"])
@pytest.mark.parametrize(
    "config", [None, {"BLOCK_M": 16, "QPB": 4, "BLOCK_N": 16}], ids=["default", "small-tiles"]
)
def test_triton_rows_are_nan_or_the_clean_value(which: str, config: dict[str, int] | None) -> None:
    case = _case(which)
    clean = _case(None).reference()
    out = torch.zeros(case.query.shape, dtype=case.query.dtype)
    extra = {} if config is None else {"config": config}
    case.attend(paged_attention_triton, out=out, **extra)
    seen = list(range(POISONED - (LENS[0] - LQ), LQ))
    rows = _rows_nan(out)
    assert set(seen) <= set(rows)  # every row that sees the key is NaN
    if which == "k":
        assert rows == seen  # a masked score never reaches the output
    finite = [r for r in range(LQ) if r not in rows]
    if finite:
        assert_close_rel(out[0, finite], clean[0, finite], rel_tol=REL_TOL)
    assert_close_rel(out[1], clean[1], rel_tol=REL_TOL)
