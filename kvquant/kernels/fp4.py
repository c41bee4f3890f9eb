"""Pure-PyTorch 4-bit KV codes: e2m1 values, NVFP4 and MXFP4 block scales, the paged layout.

e2m1 (OCP FP4): sign bit ``0x8``, magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6``; two codes per
uint8, element ``2i`` in the low nibble (ModelOpt's order). NVFP4: blocks of 16
along head_dim, an e4m3fn block scale and an fp32 global scale ``g`` (kvquant's canonical
meaning: ``x = (e2m1 * block_scale) * g``, ``g = amax / (6 * 448)``). MXFP4: blocks of 32, an
e8m0 exponent code ``E`` (``x = e2m1 * 2^(E - 127)``). Pages ``[num_pages, page_size, Hkv,
D // 2]`` uint8, block scales ``[num_pages, page_size, Hkv, D // block]``. Each block keeps the
better of two block scales (:func:`quantize_fp4`: the block maximum mapped to e2m1's 6 or 4 for
NVFP4, the OCP exponent or the next one for MXFP4). A block holding a non-finite value stores
the NaN scale code (dequantizes to NaN, like an FP8 group scale). Rounding, saturation and the
choice of scale: docs/dev/fp4-formats.md. The formats themselves
(:class:`~kvquant.schemes.Fp4Format`, :data:`NVFP4`, :data:`MXFP4`) live in :mod:`kvquant.schemes`.
"""

from __future__ import annotations

import torch

from kvquant.errors import KernelInputError
from kvquant.schemes import FP4_FORMATS, MXFP4, NVFP4, Fp4Format

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "FP4_FORMATS",
    "MXFP4",
    "NVFP4",
    "Fp4Format",
    "dequantize_fp4",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_encode",
    "e8m0_decode",
    "fp4_page_storage",
    "mxfp4_exponents",
    "nvfp4_block_scales",
    "pack_e2m1",
    "quantize_fp4",
    "unpack_e2m1",
]

E2M1_MAX = 6.0
"""Largest e2m1 magnitude."""

E4M3_MAX = 448.0
"""Largest e4m3fn value (the NVFP4 block scale's range)."""

# round-to-nearest-even boundaries on |y|: strict where the lower neighbour has an odd code
# (a tie goes up to the even one), inclusive where it has an even code (a tie stays)
_UP_AT_TIE = (0.75, 1.75, 3.5)
_DOWN_AT_TIE = (0.25, 1.25, 2.5, 5.0)

_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, 0..15) of ``x``, rounded to nearest even and saturated at ±6.

    Zero (and anything that rounds to it) is ``0x0``, never ``0x8``; ±inf saturates to
    ``±6``; NaN gives ``0x0`` (e2m1 has no NaN: the block quantizers mark the block's scale).
    """
    y = x.float()
    a = y.abs()
    code = torch.zeros(y.shape, dtype=torch.int32, device=y.device)
    for bound in _UP_AT_TIE:
        code += (a >= bound).int()
    for bound in _DOWN_AT_TIE:
        code += (a > bound).int()
    negative = (y < 0) & (code > 0)
    return (code | (negative.int() << 3)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of e2m1 codes (uint8, low four bits used; ``0x8`` is ``-0.0``)."""
    table = torch.tensor(
        _MAGNITUDES + tuple(-m for m in _MAGNITUDES), dtype=torch.float32, device=codes.device
    )
    return table[(codes & 0xF).long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dimension: element ``2i`` low nibble, ``2i + 1`` high."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """The codes of :func:`pack_e2m1`'s bytes: ``[..., n]`` -> ``[..., 2n]``."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def e4m3_encode(t: torch.Tensor) -> torch.Tensor:
    """e4m3fn codes of non-negative fp32 ``t``: round to nearest even, clamped to 448; NaN -> 0x7F."""
    return t.float().clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 ``2^(E - 127)`` of e8m0 codes; ``255`` is NaN and ``0`` reads as 0 (never written)."""
    e = codes.to(torch.int32)
    value = (e << 23).view(torch.float32)
    return torch.where(e == 255, torch.nan, value)


def _blocks(x: torch.Tensor, fmt: Fp4Format) -> torch.Tensor:
    d = x.shape[-1]
    if d % fmt.block_size:
        raise KernelInputError(
            f"{fmt.name}: head_dim is {d}; expected a multiple of the block size "
            f"{fmt.block_size}. Fix: use {fmt.name} only for models whose head_dim it divides."
        )
    return x.float().unflatten(-1, (-1, fmt.block_size))


def _per_head(global_scale: torch.Tensor) -> torch.Tensor:
    """``[]`` or ``[Hkv]`` as a multiplier of block tensors ``[..., Hkv, NB]``."""
    g = global_scale.float()
    return g.reshape(-1, 1) if g.dim() else g


def nvfp4_block_scales(
    amax: torch.Tensor, global_scale: torch.Tensor, top: float = E2M1_MAX
) -> torch.Tensor:
    """NVFP4 block scales (e4m3fn) ``e4m3(min(amax / (g * top), 448))`` of block maxima ``amax``.

    ``top`` is the e2m1 value the block maximum maps to: 6 (e2m1's largest, the classic rule)
    or 4 (finer steps near the top of the block; :func:`quantize_fp4` keeps the better of the
    two). ``global_scale`` broadcasts against ``amax`` (``[..., Hkv, NB]`` with ``g [Hkv, 1]``).
    """
    t = amax / (global_scale * top)
    return e4m3_encode(t)


def mxfp4_exponents(amax: torch.Tensor) -> torch.Tensor:
    """MXFP4 e8m0 codes ``E = floor(log2(amax)) - 2 + 127`` (OCP), clamped to ``[1, 254]``.

    Read from amax's fp32 exponent field; zero and subnormal maxima get ``E = 1``. The OCP
    rule's exponent; :func:`quantize_fp4` may store ``E + 1`` instead.
    """
    field = (amax.float().view(torch.int32) >> 23) & 0xFF
    return (field - 2).clamp(1, 254).to(torch.uint8)


_ERROR_FRACTION_BITS = 20
"""Fixed-point resolution of a block's rounding error, in units of its block scale."""

_ERROR_CLAMP = 8.0
"""Errors (in units of the block scale) are clamped here before the fixed point (no overflow)."""


def _candidate(xb: torch.Tensor, denom: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e2m1 codes of blocks ``xb [..., NB, B]`` under the scales ``denom [..., NB]`` (0: all
    zero codes) and each block's squared rounding error in units of its scale, in fixed point.

    The error of an element is ``min(| |y| - |e2m1(y)| |, 8)`` with ``y = x / denom``,
    truncated to a multiple of ``2^-20``; the block's is the int64 sum of the squares of those
    integers (exact, so any summation order gives it: the Triton write computes the same).
    """
    d = denom[..., None]
    y = torch.where(d > 0, xb / torch.where(d > 0, d, 1.0), 0.0)
    codes = e2m1_encode(y)
    r = (y.abs() - e2m1_decode(codes & 0x7)).abs().clamp(max=_ERROR_CLAMP)
    fixed = (r * float(1 << _ERROR_FRACTION_BITS)).to(torch.int64)
    return codes, (fixed * fixed).sum(dim=-1)


def _e4m3_mantissa_exponent(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, p)`` with e4m3 value ``M * 2^(p - 10)`` (int64) of non-negative e4m3fn codes."""
    c = codes.view(torch.uint8).to(torch.int64)
    field, mantissa = c >> 3, c & 7
    return torch.where(field > 0, mantissa + 8, mantissa), field.clamp(min=1)


def _second_is_better(
    err_a: torch.Tensor,
    m_a: torch.Tensor,
    p_a: torch.Tensor,
    err_b: torch.Tensor,
    m_b: torch.Tensor,
    p_b: torch.Tensor,
) -> torch.Tensor:
    """Whether scale ``b = m_b * 2^p_b`` has a strictly lower squared error than ``a = m_a *
    2^p_a`` (``p_b >= p_a``), errors in units of their scales: ``err_b * b^2 < err_a * a^2``
    in int64 (exact; a tie keeps ``a``)."""
    return ((err_b * m_b * m_b) << (2 * (p_b - p_a))) < err_a * m_a * m_a


def quantize_fp4(
    x: torch.Tensor, fmt: Fp4Format, global_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., Hkv, D]`` to packed e2m1 codes and block scales.

    Each block keeps the better of two candidate scales: the one whose codes reconstruct it
    with the lower squared error (a tie, the first). NVFP4: ``s6 = e4m3(min(amax_b / (g * 6),
    448))`` (the block maximum at e2m1's 6) or ``s4 = e4m3(min(amax_b / (g * 4), 448))`` (at 4:
    finer steps for the block's large values), codes ``e2m1(x / (s * g))`` (all zero where
    ``s * g`` is 0). MXFP4: ``E`` of :func:`mxfp4_exponents` (OCP: values in ``(6, 8) *
    2^(E - 127)`` saturate at 6) or ``min(E + 1, 254)`` (none saturate, coarser steps), codes
    ``e2m1(x / 2^(E - 127))``. The error is measured in fixed point (:func:`_candidate`), so
    the Triton write makes the same choice. A block holding a non-finite value gets the NaN
    scale code and zero codes.

    Args:
        x: ``[..., Hkv, D]`` any float dtype, ``D`` a multiple of the block size.
        fmt: :data:`NVFP4` or :data:`MXFP4`.
        global_scale: NVFP4's fp32 ``[]`` or ``[Hkv]``; None for MXFP4.

    Returns:
        ``(packed, scales)``: uint8 ``[..., Hkv, D // 2]`` and ``fmt.scale_dtype``
        ``[..., Hkv, D // block]``.
    """
    xb = _blocks(x, fmt)  # [..., Hkv, NB, B]
    finite = torch.isfinite(xb).all(dim=-1)
    xb = torch.where(finite[..., None], xb, 0.0)  # a non-finite block: zeros, then the NaN code
    amax = xb.abs().amax(dim=-1)
    if fmt.global_scale:
        if global_scale is None:
            raise KernelInputError(f"{fmt.name}: needs a global scale; got None.")
        g = _per_head(global_scale)
        s6 = nvfp4_block_scales(amax, g, E2M1_MAX)
        s4 = nvfp4_block_scales(amax, g, 4.0)
        denom6, denom4 = s6.float() * g, s4.float() * g
        values_a, err6 = _candidate(xb, denom6)
        values_b, err4 = _candidate(xb, denom4)
        m6, p6 = _e4m3_mantissa_exponent(s6)
        m4, p4 = _e4m3_mantissa_exponent(s4)
        # s6 * g of 0 reconstructs zeros: s4 is better as soon as one of its codes is not 0
        take = _second_is_better(err6, m6, p6, err4, m4, p4) | (
            (denom6 == 0) & (values_b != 0).any(dim=-1)
        )
        codes = torch.where(take, s4.view(torch.uint8), s6.view(torch.uint8))
    else:
        e_ocp = mxfp4_exponents(amax).to(torch.int64)
        e_up = (e_ocp + 1).clamp(max=254)
        values_a, err_ocp = _candidate(xb, e8m0_decode(e_ocp))
        values_b, err_up = _candidate(xb, e8m0_decode(e_up))
        one = torch.ones_like(e_ocp)
        take = _second_is_better(err_ocp, one, e_ocp, err_up, one, e_up)
        codes = torch.where(take, e_up, e_ocp)
    values = torch.where(take[..., None], values_b, values_a)
    values = torch.where(finite[..., None], values, 0)
    codes = torch.where(finite, codes, fmt.nan_scale_code).to(torch.uint8)
    return pack_e2m1(values.flatten(-2)), codes.view(fmt.scale_dtype)


def dequantize_fp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    fmt: Fp4Format,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 values of packed e2m1 codes and their block scales (pages or gathered tokens).

    NVFP4: ``(e2m1 * block_scale) * g``; MXFP4: ``e2m1 * 2^(E - 127)``.

    Args:
        packed: uint8 ``[..., Hkv, D // 2]``.
        scales: ``fmt.scale_dtype`` ``[..., Hkv, D // block]``.
        fmt: :data:`NVFP4` or :data:`MXFP4`.
        global_scale: NVFP4's fp32 ``[]`` or ``[Hkv]``; None for MXFP4.

    Returns:
        fp32 ``[..., Hkv, D]``.
    """
    values = e2m1_decode(unpack_e2m1(packed)).unflatten(-1, (-1, fmt.block_size))
    if fmt.global_scale:
        if global_scale is None:
            raise KernelInputError(f"{fmt.name}: needs a global scale; got None.")
        x = (values * scales.float()[..., None]) * _per_head(global_scale)[..., None]
    else:
        x = values * e8m0_decode(scales.view(torch.uint8))[..., None]
    return x.flatten(-2)


def fp4_page_storage(
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    fmt: Fp4Format,
    *,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed pages ``uint8 [P, S, Hkv, D // 2]`` and block scales ``[P, S, Hkv, D // block]``."""
    if head_dim % fmt.block_size:
        raise KernelInputError(
            f"fp4_page_storage: head_dim is {head_dim}; expected a multiple of {fmt.name}'s "
            f"block size {fmt.block_size}. Fix: use another format for this model."
        )
    shape = (num_pages, page_size, num_kv_heads, head_dim // 2)
    pages = torch.zeros(shape, dtype=torch.uint8, device=device)
    nb = head_dim // fmt.block_size
    scales = torch.zeros(num_pages, page_size, num_kv_heads, nb, dtype=torch.uint8, device=device)
    return pages, scales.view(fmt.scale_dtype)
