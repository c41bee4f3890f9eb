"""The 4-bit codes of kvquant.kernels.fp4: e2m1, NVFP4 and MXFP4 blocks, exhaustively where small.

e2m1 is checked against an independent oracle (the nearest of the eight magnitudes, ties to the
even code), all 16 codes, every tie, saturation and non-finite input; block quantization against
round-trip bounds (half a step of the block's scale) and the canonical meaning of the global
scale (``g = amax / (6 * 448)`` gives an e4m3 block scale of 448 for the largest block); the
choice between two block scales (NVFP4: the block maximum at e2m1's 6 or 4; MXFP4: the OCP
exponent or the next) on hand-built blocks and, against a naive float64 per-block reference,
on random blocks: never worse than the single-scale rule, the better candidate but at
near-ties.
"""

from __future__ import annotations

import pytest
import torch

from kvquant.errors import KernelInputError
from kvquant.kernels.fp4 import (
    E2M1_MAX,
    E4M3_MAX,
    MXFP4,
    NVFP4,
    Fp4Format,
    dequantize_fp4,
    e2m1_decode,
    e2m1_encode,
    e4m3_encode,
    e8m0_decode,
    fp4_page_storage,
    mxfp4_exponents,
    nvfp4_block_scales,
    pack_e2m1,
    quantize_fp4,
    unpack_e2m1,
)

MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _oracle(v: float) -> int:
    """Nearest magnitude (ties to the even code), saturating; the sign bit for non-zero codes."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(MAGNITUDES[c] - a), c % 2))
    return best | (8 if v < 0 and best else 0)


def test_all_sixteen_codes_decode_to_the_e2m1_values() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    want = MAGNITUDES + [-m for m in MAGNITUDES]
    got = e2m1_decode(codes)
    assert got.tolist() == want
    assert torch.signbit(got[8])  # 0x8 is -0.0
    # every value encodes back to its code (0x8 -> 0x0: zero has one code)
    back = e2m1_encode(got)
    assert back.tolist() == [*range(8), 0, *range(9, 16)]


def test_encode_matches_the_nearest_even_oracle_on_a_dense_sweep() -> None:
    grid = torch.linspace(-8, 8, 16001)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    near = [torch.nextafter(ties, ties * 2), torch.nextafter(ties, ties * 0)]
    points = torch.cat([grid, ties, -ties, *near])
    got = e2m1_encode(points)
    want = torch.tensor([_oracle(float(v)) for v in points], dtype=torch.uint8)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("value", "code"),
    [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6), (-5.0, 14)],
)
def test_ties_round_to_the_even_code(value: float, code: int) -> None:
    assert int(e2m1_encode(torch.tensor(value))) == code


def test_saturation_and_non_finite_input() -> None:
    x = torch.tensor([6.0, 7.9, 1e30, float("inf"), -1e30, float("-inf"), float("nan"), -0.0])
    assert e2m1_encode(x).tolist() == [7, 7, 7, 7, 15, 15, 0, 0]
    small_negative = torch.tensor([-0.1, -0.25])
    assert e2m1_encode(small_negative).tolist() == [0, 0]  # no negative zero is written


def test_nibble_order_is_low_first_and_round_trips() -> None:
    codes = torch.tensor([[1, 2, 3, 15, 0, 8]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0xF3, 0x80]]
    assert torch.equal(unpack_e2m1(packed), codes)
    every = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_e2m1(unpack_e2m1(every)), every)


def test_e4m3_and_e8m0_helpers() -> None:
    t = torch.tensor([0.0, 2.0**-10, 2.0**-9 * 1.5, 448.0, 500.0, float("nan")])
    assert e4m3_encode(t).view(torch.uint8).tolist() == [0, 0, 2, 0x7E, 0x7E, 0x7F]
    e = torch.tensor([1, 127, 130, 254, 255, 0], dtype=torch.uint8)
    got = e8m0_decode(e)
    assert got[:4].tolist() == [2.0**-126, 1.0, 8.0, 2.0**127]
    assert got[4].isnan() and got[5] == 0
    amax = torch.tensor([6.0, 7.99, 8.0, 0.0, 1e-45, 3.0e38])
    assert mxfp4_exponents(amax).tolist() == [127, 127, 128, 1, 1, 252]


def _random_kv(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.rand((*shape[:-1], 1), generator=g) * 8


@pytest.mark.parametrize("per_head", [False, True])
def test_nvfp4_round_trip_is_within_half_a_step(per_head: bool) -> None:
    x = _random_kv((5, 3, 2, 64), seed=1)
    amax = x.abs().amax(dim=(0, 1, 3)) if per_head else x.abs().amax()
    g = amax / (E2M1_MAX * E4M3_MAX)
    packed, scales = quantize_fp4(x, NVFP4, g)
    assert packed.shape == (5, 3, 2, 32) and packed.dtype == torch.uint8
    assert scales.shape == (5, 3, 2, 4) and scales.dtype == torch.float8_e4m3fn
    assert float(scales.float().max()) == E4M3_MAX  # the calibrated amax's block: scale 448
    back = dequantize_fp4(packed, scales, NVFP4, g)
    step = scales.float().repeat_interleave(16, dim=-1) * (g.reshape(-1, 1) if per_head else g)
    # e2m1's largest gap is 2 (between 4 and 6): error <= step (half of it); the e4m3 rounding
    # of the block scale can push the block maximum past 6 steps, which saturates within 1/16
    err = (back - x).abs()
    bound = torch.maximum(step, x.abs() / 16) * 1.0001
    assert bool((err <= bound).all()), float((err - bound).max())
    rel = (back - x).norm() / x.norm()
    assert rel < 0.1


def test_nvfp4_values_beyond_the_calibrated_amax_saturate() -> None:
    x = torch.zeros(1, 1, 16)
    x[0, 0, 0] = 1000.0
    g = torch.tensor(10.0 / (E2M1_MAX * E4M3_MAX))  # calibrated amax 10
    packed, scales = quantize_fp4(x, NVFP4, g)
    back = dequantize_fp4(packed, scales, NVFP4, g)
    assert float(scales.float()[0, 0, 0]) == E4M3_MAX
    assert back[0, 0, 0] == pytest.approx(10.0, rel=1e-6)


def test_mxfp4_round_trip_is_within_the_ocp_bound() -> None:
    x = _random_kv((4, 3, 2, 64), seed=2)
    packed, scales = quantize_fp4(x, MXFP4)
    assert scales.dtype == torch.uint8 and scales.shape == (4, 3, 2, 2)
    back = dequantize_fp4(packed, scales, MXFP4)
    step = e8m0_decode(scales).repeat_interleave(32, dim=-1)
    # OCP's floor rule: |x| / 2^(E-127) < 8, so values above 6 steps saturate (error < 2 steps)
    err = (back - x).abs()
    assert bool((err <= 2 * step).all())
    inside = x.abs() <= 6 * step
    assert bool((err[inside] <= step[inside]).all())  # half of the largest gap


def test_all_zero_and_tiny_blocks() -> None:
    x = torch.zeros(2, 1, 32)
    x[1, 0, :16] = 1e-30  # rounds below the smallest block scale
    g = torch.tensor(1.0)
    packed, scales = quantize_fp4(x, NVFP4, g)
    assert not packed.any() and not scales.view(torch.uint8).any()
    assert torch.equal(dequantize_fp4(packed, scales, NVFP4, g), torch.zeros_like(x))
    packed, scales = quantize_fp4(torch.zeros(1, 1, 32), MXFP4)
    assert scales.tolist() == [[[1]]] and not packed.any()


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.name)
def test_a_block_holding_a_non_finite_value_dequantizes_to_nan(fmt: Fp4Format) -> None:
    x = torch.randn(3, 2, 64)
    x[0, 1, 5] = float("nan")
    x[1, 0, 63] = float("inf")
    x[2, 1, 0] = float("-inf")
    g = torch.tensor(0.01) if fmt.global_scale else None
    packed, scales = quantize_fp4(x, fmt, g)
    back = dequantize_fp4(packed, scales, fmt, g)
    b = fmt.block_size
    bad = torch.zeros_like(x, dtype=torch.bool)
    bad[0, 1, :b] = bad[1, 0, 64 - b :] = bad[2, 1, :b] = True
    assert torch.equal(back.isnan(), bad)
    assert scales.view(torch.uint8)[0, 1, 0] == fmt.nan_scale_code


def test_head_dim_not_a_multiple_of_the_block_is_refused() -> None:
    with pytest.raises(KernelInputError, match="multiple of the block size 32"):
        quantize_fp4(torch.randn(2, 48), MXFP4)
    with pytest.raises(KernelInputError, match="needs a global scale"):
        quantize_fp4(torch.randn(2, 32), NVFP4)
    with pytest.raises(KernelInputError, match="block size 16"):
        fp4_page_storage(2, 4, 1, 40, NVFP4)


def test_page_storage_shapes() -> None:
    pages, scales = fp4_page_storage(3, 8, 2, 64, NVFP4)
    assert pages.shape == (3, 8, 2, 32) and scales.shape == (3, 8, 2, 4)
    assert scales.dtype == torch.float8_e4m3fn
    pages, scales = fp4_page_storage(3, 8, 2, 64, MXFP4)
    assert scales.shape == (3, 8, 2, 2) and scales.dtype == torch.uint8


def _naive_candidates(
    x: torch.Tensor, fmt: Fp4Format, g: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block, in plain Python: each candidate scale's code and the float64 squared
    error of the block dequantized with it (``[blocks, 2]`` each; the classic rule first)."""
    b = fmt.block_size
    nb = x.shape[-1] // b
    blocks = x.float().unflatten(-1, (nb, b)).reshape(-1, b)
    if g is None:
        per_block = [None] * blocks.shape[0]
    else:
        per_head = g.float().reshape(-1, 1) if g.dim() else g.float()
        per_block = torch.broadcast_to(per_head, (*x.shape[:-1], nb)).reshape(-1).tolist()
    codes, errors = [], []
    for block, gi in zip(blocks, per_block, strict=True):
        amax = float(block.abs().max())
        if gi is None:  # MXFP4: the OCP exponent, the next one
            e = int(torch.floor(torch.log2(torch.tensor(amax)))) - 2 + 127 if amax else 1
            cands = [max(e, 1), min(max(e, 1) + 1, 254)]
            steps = [2.0 ** (c - 127) for c in cands]
        else:  # NVFP4: the maximum at 6, at 4
            cands = [
                int(e4m3_encode(torch.tensor(amax / (gi * top))).view(torch.uint8))
                for top in (6.0, 4.0)
            ]
            steps = [
                float(torch.tensor(c, dtype=torch.uint8).view(torch.float8_e4m3fn).float()) * gi
                for c in cands
            ]
        row = []
        for step in steps:
            if step > 0:
                back = e2m1_decode(e2m1_encode(block / step)).double() * step
            else:
                back = torch.zeros(b, dtype=torch.float64)
            row.append(float(((back - block.double()) ** 2).sum()))
        codes.append(cands)
        errors.append(row)
    return torch.tensor(codes), torch.tensor(errors, dtype=torch.float64)


def _block_errors(x: torch.Tensor, fmt: Fp4Format, g: torch.Tensor | None) -> torch.Tensor:
    """float64 squared error of each block of ``quantize_fp4``'s codes, dequantized."""
    back = dequantize_fp4(*quantize_fp4(x, fmt, g), fmt, g)
    err = (back.double() - x.double()) ** 2
    return err.unflatten(-1, (-1, fmt.block_size)).sum(-1).reshape(-1)


def _block(values: list[float], size: int) -> torch.Tensor:
    x = torch.zeros(1, 1, size)
    x[0, 0, : len(values)] = torch.tensor(values)
    return x


@pytest.mark.parametrize(
    ("values", "scale", "why"),
    [
        ([4, 3, -2, 1.5, 1, 0.5, -4], 1.0, "on e2m1's grid below 4: the maximum at 4"),
        ([6, 3, -1, 0.5], 1.0, "on the grid up to 6, 1 and 0.5 too: the classic scale"),
        ([6, -3, 1.5], 1.0, "exact with either scale (1 and 1.5): a tie keeps the classic one"),
        ([2.8 * 2.0**-9, 1e-5], 2.0**-9, "the classic scale rounds to 0, the other does not"),
        ([4.2 * 448, 4 * 448, 3 * 448, 2 * 448, 448], 448.0, "the maximum at 4 clamps at 448"),
    ],
)
def test_nvfp4_block_scale_is_the_better_of_six_and_four(
    values: list[float], scale: float, why: str
) -> None:
    x = _block(values, 16)
    g = torch.tensor(1.0)
    packed, scales = quantize_fp4(x, NVFP4, g)
    assert float(scales.float()) == scale, why
    _, errors = _naive_candidates(x, NVFP4, g)
    assert float(_block_errors(x, NVFP4, g)) == float(errors.min()), why
    back = dequantize_fp4(packed, scales, NVFP4, g)
    assert bool((back.abs() <= 6 * scale).all())


def test_nvfp4_scale_of_four_stays_below_six_after_rounding() -> None:
    """Every block maximum maps to at most 4 * (1 + 2^-4) under the scale of 4 (e4m3 rounds to
    three mantissa bits; in the subnormals below 2^-6 to at most 1.5 ulp): never saturated."""
    amax = torch.logspace(-12, 3.2, 20001, base=2.0) * 2.0**-6
    s4 = nvfp4_block_scales(amax, torch.tensor(1.0), 4.0).float()
    kept = (s4 > 0) & (amax / 4 < 448)
    assert bool((amax[kept] / s4[kept] <= 6.0).all())
    assert float((amax[kept] / s4[kept]).max()) <= 4 * 1.5 + 1e-6


@pytest.mark.parametrize(
    ("values", "exponent", "why"),
    [
        ([7.5] * 32, 128, "in (6, 8): the next exponent saturates nothing"),
        ([7.5 * 2.0**-10, -7.0 * 2.0**-10], 118, "the same, 2^-10 smaller"),
        ([7.0, 0.5, 0.25], 127, "0.5 and 0.25 would round to 0: the OCP exponent"),
        ([7.0] * 32, 127, "7 -> 6 or 8: a tie keeps the OCP exponent"),
        ([5.0, 1.0], 127, "no value above 6: the OCP exponent"),
    ],
)
def test_mxfp4_exponent_is_the_better_of_e_and_e_plus_one(
    values: list[float], exponent: int, why: str
) -> None:
    x = _block(values, 32)
    _, scales = quantize_fp4(x, MXFP4)
    assert int(scales) == exponent, why
    _, errors = _naive_candidates(x, MXFP4, None)
    assert float(_block_errors(x, MXFP4, None)) == float(errors.min()), why


def test_helpers_give_the_candidate_scales() -> None:
    amax = torch.tensor([4.0, 6.0, 0.0, 3000.0])
    g = torch.tensor(1.0)
    assert nvfp4_block_scales(amax, g).float().tolist() == [0.6875, 1.0, 0.0, 448.0]
    assert nvfp4_block_scales(amax, g, 4.0).float().tolist() == [1.0, 1.5, 0.0, 448.0]


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=lambda f: f.name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_choice_is_never_worse_than_the_classic_scale_on_random_blocks(
    fmt: Fp4Format, seed: int
) -> None:
    """Against the naive reference: each block's error is at most the classic scale's and is the
    lower candidate's, but where the two candidates lie within the fixed point's resolution of
    each other (the error is compared in 2^-20 of the block scale); the total error drops.
    Block magnitudes from e4m3's subnormal scales to past the 448 clamp."""
    gen = torch.Generator().manual_seed(seed)
    b = fmt.block_size
    x = torch.randn(40, 2, 64, generator=gen)
    x = x.unflatten(-1, (-1, b)) * 2.0 ** (torch.rand(40, 2, 64 // b, 1, generator=gen) * 30 - 18)
    x = x.flatten(-2)
    x[0, 0, :b] = torch.arange(b) * 2.0**-12  # a ramp: every e2m1 step used
    g = torch.tensor([0.7, 2.0**-10]) if fmt.global_scale else None
    got = _block_errors(x, fmt, g)
    codes, errors = _naive_candidates(x, fmt, g)
    classic, best = errors[:, 0], errors.min(dim=1).values
    tol = 1e-5 * best + 1e-300
    assert bool((got <= classic + tol).all())
    assert bool((got <= best + tol).all())
    assert float(got.sum()) < float(classic.sum())
    # the stored scale is a candidate's; where the candidates' errors differ clearly, the better
    _, scales = quantize_fp4(x, fmt, g)
    stored = scales.view(torch.uint8).reshape(-1).long()
    assert bool(((stored == codes[:, 0]) | (stored == codes[:, 1])).all())
    clear = (errors[:, 0] - errors[:, 1]).abs() > 1e-4 * best
    want = torch.where(errors[:, 1] < errors[:, 0], codes[:, 1], codes[:, 0])
    assert torch.equal(stored[clear], want[clear])
    assert bool((stored != codes[:, 0]).any())  # the second candidate is taken somewhere
