"""The Triton twins of the 4-bit codes and the attention's 4-bit tile, through tiny test kernels.

Run in the Triton interpreter on CPU: the integer-op encoders (e2m1, e4m3) against torch on
dense sweeps, every tie and every e4m3 code's neighbours; the decoders against
:mod:`kvquant.kernels.fp4` for every code; ``load_fp4_tile`` on pages gathered through a
shuffled block table against :func:`~kvquant.kernels.fp4.dequantize_fp4`, bit for bit, with a
NaN-poisoned output whose unwritten rows must stay NaN.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kvquant.kernels.attention.fp4_tile import load_fp4_tile
from kvquant.kernels.fp4 import (
    MXFP4,
    NVFP4,
    Fp4Format,
    dequantize_fp4,
    e2m1_decode,
    e2m1_encode,
    e4m3_encode,
    e8m0_decode,
    quantize_fp4,
)
from kvquant.kernels.fp4_triton import (
    e2m1_code,
    e2m1_magnitude,
    e4m3_code,
    e4m3_value,
    e8m0_value,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the tile's decodes: portable Triton everywhere, inline PTX on CUDA devices of sm_89 and newer
PTX_OK = DEV == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
DECODES = [False, True] if PTX_OK else [False]


@triton.jit
def _codes_kernel(x_ptr, e2m1_ptr, e4m3_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + i, mask=ok, other=0.0)
    tl.store(e2m1_ptr + i, e2m1_code(x), mask=ok)
    t = tl.minimum(tl.abs(x), 448.0)
    tl.store(e4m3_ptr + i, e4m3_code(t), mask=ok)


@triton.jit
def _values_kernel(code_ptr, e4m3_ptr, e8m0_ptr, e2m1_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    c = tl.load(code_ptr + i)
    tl.store(e4m3_ptr + i, e4m3_value(c & 0x7F))
    tl.store(e8m0_ptr + i, e8m0_value(c))
    tl.store(e2m1_ptr + i, e2m1_magnitude(c))


def _e4m3_probe_points() -> torch.Tensor:
    """Every e4m3 value, the midpoints between neighbours (ties) and the floats next to them."""
    values = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (values[1:] + values[:-1]) / 2
    pts = torch.cat([values, mids, torch.tensor([448.0, 460.0, 1e30])])
    return torch.cat([pts, torch.nextafter(pts, pts + 1), torch.nextafter(pts, pts * 0)])


def test_encoders_match_torch_on_sweeps_ties_and_every_e4m3_neighbour() -> None:
    x = torch.cat([
        torch.linspace(-7, 7, 4001),
        torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5, float("inf"), -0.0]),
        _e4m3_probe_points(),
        torch.rand(2000) * 2.0 ** torch.randint(-20, 9, (2000,)).float(),
    ])  # fmt: skip
    n = x.numel()
    e2m1 = torch.full((n,), -1, dtype=torch.int32, device=DEV)
    e4m3 = torch.full((n,), -1, dtype=torch.int32, device=DEV)
    _codes_kernel[(triton.cdiv(n, 1024),)](x.to(DEV), e2m1, e4m3, n, BLOCK=1024)
    assert torch.equal(e2m1.cpu().to(torch.uint8), e2m1_encode(x))
    want = e4m3_encode(x.abs()).view(torch.uint8).int()
    bad = (e4m3.cpu() != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(x[i]), int(e4m3[i]), int(want[i])) for i in bad[:5]]


def test_decoders_match_torch_for_every_code() -> None:
    codes = torch.arange(256, dtype=torch.int32)
    e4m3, e8m0, e2m1 = (torch.empty(256, device=DEV) for _ in range(3))
    _values_kernel[(1,)](codes.to(DEV), e4m3, e8m0, e2m1, BLOCK=256)
    assert torch.equal(e2m1.cpu(), e2m1_decode((codes & 0xF).to(torch.uint8)).abs())
    want = (codes & 0x7F).to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.nan_to_num(e4m3.cpu(), 7.0), torch.nan_to_num(want, 7.0))
    assert torch.equal(e4m3.cpu().isnan(), want.isnan())
    want = e8m0_decode(codes.to(torch.uint8))
    assert torch.equal(torch.nan_to_num(e8m0.cpu(), 7.0), torch.nan_to_num(want, 7.0))


@triton.jit
def _tile_kernel(
    pages_ptr, scales_ptr, bt_ptr, g_ptr, out_ptr, n_tok, page_size,
    s_p, s_t, s_h, ss_p, ss_t, ss_h, s_g,
    D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, NVFP4: tl.constexpr,
    PTX: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    n = tl.arange(0, BLOCK_N)
    ok = n < n_tok
    page = tl.load(bt_ptr + n // page_size, mask=ok, other=0).to(tl.int64)
    tok = n % page_size
    row = (page * s_p + tok * s_t + h * s_h) // 4  # int32 words
    srow = page * ss_p + tok * ss_t + h * ss_h
    v = load_fp4_tile(
        pages_ptr.to(tl.pointer_type(tl.int32)), scales_ptr, row, srow, ok, D, BLOCK, NVFP4, PTX
    ).to(tl.float32)
    # the tile is exact over 64 (NVFP4: back to the reference's (e2m1 * s) * g) or 16 (MXFP4),
    # head_dim element 4j + 2a + b at column 4j + 2b + a
    if NVFP4:
        v = v * 64.0 * tl.load(g_ptr + h * s_g)
    else:
        v = v * 16.0
    d = tl.arange(0, D)
    d = (d & -4) | ((d & 1) << 1) | ((d >> 1) & 1)
    tl.store(out_ptr + (h * BLOCK_N + n)[:, None] * D + d[None, :], v, mask=ok[:, None])


@pytest.mark.parametrize("ptx", DECODES, ids=lambda p: "ptx" if p else "portable")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.name)
def test_tile_matches_the_reference_dequantization(fmt: Fp4Format, d: int, ptx: bool) -> None:
    torch.manual_seed(7)
    num_pages, page, hkv, n_tok, block_n = 5, 4, 2, 13, 16
    x = torch.randn(num_pages, page, hkv, d) * torch.rand(num_pages, page, hkv, 1) * 6
    table = torch.randperm(num_pages)[: (n_tok + page - 1) // page].int()
    x[table[1], 1, 0, 3] = float("nan")  # a NaN block: its scale code reads NaN
    g = torch.tensor([3.0, 5.0]) / 2688 if fmt.global_scale else None
    pages, scales = quantize_fp4(x, fmt, g)
    out = torch.full((hkv, block_n, d), float("nan"), device=DEV)
    sc = scales.view(torch.uint8)
    g_arg = g if g is not None else torch.ones(1)
    _tile_kernel[(hkv,)](
        pages.to(DEV), sc.to(DEV), table.to(DEV), g_arg.to(DEV), out, n_tok, page,
        *pages.stride()[:3], *sc.stride()[:3], g_arg.stride(0) if g is not None else 0,
        D=d, BLOCK=fmt.block_size, BLOCK_N=block_n, NVFP4=fmt.global_scale, PTX=ptx,
    )  # fmt: skip
    ids = table.long().repeat_interleave(page)[:n_tok]
    offs = torch.arange(n_tok) % page
    want = dequantize_fp4(pages[ids, offs], scales[ids, offs], fmt, g)  # [n_tok, Hkv, D]
    got = out.cpu()[:, :n_tok].transpose(0, 1)
    assert torch.equal(got.isnan(), want.isnan()) and want.isnan().any()
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    assert out.cpu()[:, n_tok:].isnan().all()  # rows past the tokens are never stored


@pytest.mark.parametrize("ptx", DECODES, ids=lambda p: "ptx" if p else "portable")
def test_tile_decodes_every_byte_to_its_two_e2m1_values(ptx: bool) -> None:
    """Bytes 0..255 (every pair of codes, -0.0 included) under a block scale of 1.0."""
    d, rows = 64, 8  # 32 bytes per row
    pages = torch.arange(256, dtype=torch.uint8).reshape(rows, 1, 1, d // 2)
    scales = torch.full((rows, 1, 1, d // 16), 0x38, dtype=torch.uint8)  # e4m3 1.0
    out = torch.full((1, rows, d), float("nan"), device=DEV)
    _tile_kernel[(1,)](
        pages.to(DEV), scales.to(DEV), torch.arange(rows, dtype=torch.int32, device=DEV),
        torch.ones(1, device=DEV), out, rows, 1, *pages.stride()[:3], *scales.stride()[:3], 0,
        D=d, BLOCK=16, BLOCK_N=rows, NVFP4=True, PTX=ptx,
    )  # fmt: skip
    b = torch.arange(256, dtype=torch.uint8)
    want = torch.stack([e2m1_decode(b & 0xF), e2m1_decode(b >> 4)], dim=-1).reshape(rows, d)
    got = out.cpu()[0]
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))
