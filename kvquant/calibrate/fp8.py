"""FP8 e4m3 rounding in torch, as kvquant's cache stores K and V: the simulations' arithmetic.

Static scales (``fp8(clamp(x / s, +-448)) * s``), dynamic fp32 groups, the
k-transform's keys and the Hadamard rotation, each in fp32; and the 4-bit formats' rounding
(:func:`fake_quantize_fp4`, kvquant's own NVFP4 / MXFP4 codes). The calibration
report (:mod:`kvquant.calibrate.evaluate`) measures every candidate format with
these; the statistics and the search use the same constants.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvquant.errors import CalibrationError

__all__ = [
    "E4M3_MIN_NORMAL",
    "FP8_E4M3_MAX",
    "fake_quantize_fp4",
    "fake_quantize_groups",
    "fake_quantize_static",
    "hadamard_matrix",
    "k_transform_keys",
    "k_transform_keys_fp4",
    "per_head_scale",
]

FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""

E4M3_MIN_NORMAL = 2.0**-6
"""Smallest normal float8_e4m3fn magnitude: below it values are subnormal."""


def hadamard_matrix(dim: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """:func:`kvquant.kernels.hadamard` (fp32 ``[dim, dim]``), refused with calibration's fix.

    Raises:
        CalibrationError: ``dim`` is not a power of two.
    """
    from kvquant.kernels import hadamard

    if dim < 1 or dim & (dim - 1):
        raise CalibrationError(
            f"Hadamard rotation: head_dim {dim} is not a power of two; the built-in rotation "
            "needs one. Fix: calibrate with rotation=None (--rotation none: offset only)."
        )
    return hadamard(dim, device=device)


def per_head_scale(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``scale`` (fp32 [] or [Hkv]) shaped to broadcast over ``x`` [B, Hkv, T, D]."""
    s = scale.float().to(x.device)
    return s.view(1, -1, 1, 1) if s.dim() == 1 else s


def fake_quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8_e4m3(clamp(x / s, +-448)) * s`` in fp32 (the static write's rounding).

    Args:
        x: [B, Hkv, T, D].
        scale: fp32 [] or [Hkv].
    """
    s = per_head_scale(scale, x)
    q = (x.float() / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.float() * s


def fake_quantize_groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dynamic fp32-group rounding: ``s = amax / 448`` per token, head and group of G channels.

    Args:
        x: [B, Hkv, T, D], D a multiple of ``group_size``.
    """
    d = x.shape[-1]
    xg = x.float().unflatten(-1, (d // group_size, group_size))
    amax = xg.abs().amax(dim=-1, keepdim=True)
    s = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (xg / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() * s
    return q.flatten(-2)


def fake_quantize_fp4(x: torch.Tensor, which: str) -> torch.Tensor:
    """``x`` through ``which`` (``"nvfp4"`` or ``"mxfp4"``) 4-bit codes and back, in fp32.

    The codes :func:`kvquant.kernels.fp4.quantize_fp4` writes (which the cache's write kernels
    match), with the global scale of a calibration-free NVFP4 cache
    (:data:`kvquant.schemes.DYNAMIC_NVFP4_GLOBAL_SCALE`), which ``kv_format="nvfp4"`` uses.

    Args:
        x: [B, Hkv, T, D], D a multiple of the format's block (16 NVFP4, 32 MXFP4).
        which: ``"nvfp4"`` or ``"mxfp4"``.
    """
    from kvquant.kernels.fp4 import dequantize_fp4, quantize_fp4
    from kvquant.schemes import DYNAMIC_NVFP4_GLOBAL_SCALE, fp4_format

    fmt = fp4_format(which)
    if fmt is None:
        raise CalibrationError(
            f"fake_quantize_fp4: format {which!r}; expected 'nvfp4' or 'mxfp4'. Fix: pass one."
        )
    g = torch.tensor(DYNAMIC_NVFP4_GLOBAL_SCALE, device=x.device) if fmt.global_scale else None
    tokens = x.float().transpose(1, 2)  # [B, T, Hkv, D]: the layout the pages hold
    packed, scales = quantize_fp4(tokens, fmt, g)
    return dequantize_fp4(packed, scales, fmt, g).transpose(1, 2)


def k_transform_keys(
    key: torch.Tensor,
    k_scale: torch.Tensor,
    k_offset: torch.Tensor,
    rotation: torch.Tensor | None,
    first_tokens: int,
) -> torch.Tensor:
    """Keys as the k-transform's attention reads them, in the rotated frame.

    ``k' = fp8(clamp((k R - c) / s_k, +-448)) * s_k + c``; the first
    ``first_tokens`` positions (of dim 2) are ``k R`` exactly (the side buffer).

    Args:
        key: [B, Hkv, T, D] post-RoPE keys, position ``t`` at index ``t``.
        k_scale: fp32 [Hkv] (or []).
        k_offset: fp32 [Hkv, D], in the rotated frame.
        rotation: fp32 [D, D] orthonormal, or None (identity).
        first_tokens: positions kept exact.

    Returns:
        fp32 [B, Hkv, T, D]; pair it with the query ``q @ R``.
    """
    return _keys_in_the_frame(
        key, k_offset, rotation, first_tokens, lambda x: fake_quantize_static(x, k_scale)
    )


def k_transform_keys_fp4(
    key: torch.Tensor,
    which: str,
    k_offset: torch.Tensor,
    rotation: torch.Tensor | None,
    first_tokens: int,
) -> torch.Tensor:
    """Keys as a 4-bit cache reads them in the k-transform's frame, in the rotated frame.

    ``k' = round_4bit(k R - c) + c`` (:func:`fake_quantize_fp4`: the codes the cache's write
    stores, NVFP4 with its calibration-free global scale); the first ``first_tokens``
    positions (of dim 2) are ``k R`` exactly (the side buffer).

    Args:
        key: [B, Hkv, T, D] post-RoPE keys, position ``t`` at index ``t``.
        which: ``"nvfp4"`` or ``"mxfp4"``.
        k_offset: fp32 [Hkv, D], in the rotated frame.
        rotation: fp32 [D, D] orthonormal, or None (identity).
        first_tokens: positions kept exact.

    Returns:
        fp32 [B, Hkv, T, D]; pair it with the query ``q @ R``.
    """
    return _keys_in_the_frame(
        key, k_offset, rotation, first_tokens, lambda x: fake_quantize_fp4(x, which)
    )


def _keys_in_the_frame(
    key: torch.Tensor,
    k_offset: torch.Tensor,
    rotation: torch.Tensor | None,
    first_tokens: int,
    rounded: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``rounded(k R - c) + c`` in fp32, the first ``first_tokens`` positions ``k R`` exactly."""
    kr = key.float()
    if rotation is not None:
        kr = kr @ rotation.to(kr.device)
    c = k_offset.float().to(kr.device)[None, :, None, :]
    out = rounded(kr - c) + c
    n = min(first_tokens, out.shape[2])
    if n:
        out[:, :, :n] = kr[:, :, :n]
    return out
