"""Pure-PyTorch FP8 codes shared by the references and the cache: cast, dequantize, rotate.

A scale is a dequantization multiplier, ``x ≈ float(code) * scale``; values are clamped to
the format's finite range before every cast and non-finite inputs are stored as NaN. The
static K transform stores K as ``fp8((k @ R - c) / s_k)`` with :func:`hadamard` as the
built-in rotation. The paged layout and the references' semantics:
:mod:`kvquant.kernels.attention.naive` and :mod:`kvquant.kernels.write.naive`.
"""

from __future__ import annotations

import torch

from kvquant.errors import KernelInputError

__all__ = [
    "dequantize_pages",
    "dequantize_stored",
    "fp8_max",
    "gather_kv",
    "hadamard",
    "quantize_fp8",
    "transform_keys",
]


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def hadamard(
    dim: int, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix ``H [dim, dim]`` (symmetric, ``H @ H = I``).

    ``H[i, j] = (-1) ** popcount(i & j) / sqrt(dim)``: the built-in rotation of the
    ``k-transform`` format (``k_rotation=hadamard(head_dim)``).

    Args:
        dim: the matrix size (a head_dim), a power of two >= 1.
        device: where to allocate.
        dtype: a floating dtype (fp32 for the kernels).

    Returns:
        The ``[dim, dim]`` matrix.

    Raises:
        KernelInputError: ``dim`` is not a power of two.

    Example:
        >>> import torch
        >>> h = hadamard(4)
        >>> bool(torch.allclose(h @ h, torch.eye(4)))
        True
    """
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1 or dim & (dim - 1):
        raise KernelInputError(
            f"hadamard: dim is {dim!r}; the Hadamard rotation needs a power-of-two head_dim "
            "(Sylvester's construction). Fix: use rotation=None (offset only) for this model."
        )
    idx = torch.arange(dim)
    bits = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    signs = 1.0 - 2.0 * parity.to(torch.float64)
    return (signs / dim**0.5).to(dtype=dtype, device=device)


def transform_keys(
    key: torch.Tensor, k_offset: torch.Tensor | None, k_rotation: torch.Tensor | None
) -> torch.Tensor:
    """``key @ R - c`` in fp32: the model-frame keys ``[..., Hkv, D]`` as the pages store them.

    Args:
        key: ``[..., Hkv, D]`` any float dtype.
        k_offset: fp32 ``[Hkv, D]`` (rotated frame) or None (zeros).
        k_rotation: fp32 ``[D, D]`` orthonormal or None (identity).

    Returns:
        fp32 tensor of the shape of ``key``.
    """
    x = key.float()
    if k_rotation is not None:
        x = x @ k_rotation.float()
    if k_offset is not None:
        x = x - k_offset.float()
    return x


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Quantize ``x / scale`` to ``dtype`` with saturation; non-finite inputs become NaN.

    Args:
        x: values of any float dtype.
        scale: fp32 dequantization multipliers, broadcastable to ``x``.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Returns:
        FP8 codes with the shape of ``x``.
    """
    limit = fp8_max(dtype)
    y = x.float() / scale
    y = torch.where(torch.isfinite(x.float()), y.clamp(-limit, limit), torch.nan)
    return y.to(dtype)


def dequantize_pages(
    pages: torch.Tensor,
    static_scale: torch.Tensor | None,
    group_scales: torch.Tensor | None,
    *,
    k_offset: torch.Tensor | None = None,
    k_rotation: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize FP8 codes (whole pages, or tokens gathered from them) to fp32.

    With a K transform the result is in the model's frame, ``(code * s + c) @ R^T``, so
    that it compares with the unpatched model's K.

    Args:
        pages: ``[..., Hkv, D]`` FP8, e.g. ``[num_pages, page_size, Hkv, D]``.
        static_scale: fp32 ``[]`` or ``[Hkv]``, or None when ``group_scales`` is given.
        group_scales: fp32 ``[..., Hkv, D // G]`` (the same leading dims) or None.
        k_offset: fp32 ``[Hkv, D]`` K offset (rotated frame) of K pages, or None.
        k_rotation: fp32 ``[D, D]`` K rotation of K pages, or None.

    Returns:
        fp32 tensor of the shape of ``pages``.
    """
    x = dequantize_stored(pages, static_scale, group_scales, k_offset)
    if k_rotation is not None:
        x = x @ k_rotation.float().T
    return x


def dequantize_stored(
    pages: torch.Tensor,
    static_scale: torch.Tensor | None,
    group_scales: torch.Tensor | None,
    k_offset: torch.Tensor | None,
) -> torch.Tensor:
    """``code * scale (+ c)``: the logical values in the frame the pages store (K rotated)."""
    x = pages.float()
    if group_scales is not None:
        g = x.shape[-1] // group_scales.shape[-1]
        return x * group_scales.repeat_interleave(g, dim=-1)
    if static_scale is None:
        raise ValueError("dequantize_pages needs a static scale or group scales")
    s = static_scale.float()
    x = x * (s.reshape(-1, 1) if s.dim() else s)
    if k_offset is not None:
        x = x + k_offset.float()
    return x


def gather_kv(
    pages: torch.Tensor, block_tables: torch.Tensor, seq_len: int, batch_index: int
) -> torch.Tensor:
    """Gather the first ``seq_len`` tokens of sequence ``batch_index``.

    Works on pages ``[num_pages, page_size, Hkv, D]`` and on group scales
    ``[num_pages, page_size, Hkv, D // G]`` alike: returns ``[seq_len, Hkv, ...]``.
    """
    page_size = pages.shape[1]
    n_pages = (seq_len + page_size - 1) // page_size
    ids = block_tables[batch_index, :n_pages].long()
    return pages[ids].reshape(-1, *pages.shape[2:])[:seq_len]
