"""Launcher of the cache-write Triton kernel (:mod:`kvquant.kernels.write.kernel`).

:func:`write_kv_triton` picks the tile and launches; slots that are negative (skip) or beyond
the cache are not stored. Arguments are validated by :func:`kvquant.kernels.write_kv`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch
import triton

from kvquant.errors import KernelInputError
from kvquant.kernels.attention.tuning import device_sm_count
from kvquant.kernels.write.kernel import write_kv_kernel
from kvquant.schemes import KernelView, Pages, RecentTokens, Scheme

__all__ = ["is_interpreted", "write_kv_triton"]


def is_interpreted() -> bool:
    """Whether this module's kernel runs in the Triton interpreter (``TRITON_INTERPRET=1``)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(write_kv_kernel, InterpretedFunction)


_FP8_MAX: dict[torch.dtype, float] = {
    dt: float(torch.finfo(dt).max) for dt in (torch.float8_e4m3fn, torch.float8_e5m2)
}


def _current_device() -> int:
    return torch.cuda.current_device()


@functools.lru_cache(maxsize=64)
def _blocks(hkv: int, g: int, ng: int, rotate: bool = False) -> tuple[int, int, int, int]:
    """``(BLOCK_NG, BLOCK_R, BLOCK_G, BLOCK_T)`` of the tile for ``hkv`` heads of ``ng`` groups of ``g``.

    With ``rotate`` the tile's heads are one ``tl.dot`` operand: at least 16 rows (tokens x
    heads) and 16 columns (one group per head padded to 16; several groups per head span a
    power-of-two head_dim >= 16, the schemes' rule).
    """
    block_ng = triton.next_power_of_2(ng)
    block_h = triton.next_power_of_2(hkv)
    block_r = block_h * block_ng
    block_g = triton.next_power_of_2(g)
    if rotate and ng == 1:
        block_g = max(16, block_g)
    per_token = block_r * block_g
    block_t = max(1, min(16, 4096 // per_token))
    block_t = 1 << (block_t.bit_length() - 1)  # power of two
    if rotate:
        block_t = max(block_t, triton.cdiv(16, block_h))
    return block_ng, block_r, block_g, block_t


def tokens_per_program(
    tile_tokens: int, n_tokens: int, device: torch.device, least: int = 1
) -> int:
    """Tokens per program of a write: the tile's, fewer when the write is too small to fill the
    GPU (a decode step writes one token per sequence).

    On a CUDA device the count is capped so that the write has at least twice as many
    programs as the device has multiprocessors (a power of two, at least ``least``); elsewhere
    (the Triton interpreter, one program at a time) the tile's count stands.

    Example:
        >>> tokens_per_program(8, 16, torch.device("cpu"))
        8
    """
    if device.type != "cuda":
        return tile_tokens
    cap = max(1, n_tokens // (2 * device_sm_count(device)))
    return max(least, min(tile_tokens, 1 << (cap.bit_length() - 1)))


def _static_stride(s: torch.Tensor) -> int:
    return 0 if s.dim() == 0 else int(s.stride(0))


class _ScaleArgs(NamedTuple):
    """The write kernel's scale arguments: static or group scales (the other side's unread)."""

    ng: int  # groups per head (1 with static scales)
    pointers: tuple[torch.Tensor, ...]  # K and V static scales, then K and V group scales
    static_strides: tuple[int, int]
    group_strides: tuple[int, ...]  # K's (page, slot, head), then V's


def _scale_args(pages: Pages, view: KernelView, name: str) -> _ScaleArgs:
    """Unpack the scheme's static scales, or the pages' group scales, into kernel arguments."""
    k_scale, v_scale = view.k_scale, view.v_scale
    if view.group_size is not None and pages.k_scales is not None and pages.v_scales is not None:
        return _ScaleArgs(
            int(pages.k_scales.shape[-1]),
            (pages.k, pages.v, pages.k_scales, pages.v_scales),
            (0, 0),
            (*pages.k_scales.stride()[:3], *pages.v_scales.stride()[:3]),
        )
    if k_scale is not None and v_scale is not None:
        return _ScaleArgs(
            1,
            (k_scale, v_scale, pages.k, pages.v),
            (_static_stride(k_scale), _static_stride(v_scale)),
            (0,) * 6,
        )
    raise KernelInputError(
        f"write_kv_triton: a {name!r} scheme without static scales and pages without "
        "group scales; expected one. Fix: call kvquant.kernels.write_kv (it validates)."
    )


def _transform_args(
    view: KernelView, k_pages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """The K transform's rotation and offset pointers and strides (absent: unread pointers)."""
    rot, off = view.k_rotation, view.k_offset
    return (
        rot if rot is not None else k_pages,
        off if off is not None else k_pages,
        rot.stride() if rot is not None else (0, 0),
        off.stride() if off is not None else (0, 0),
    )


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    pages: Pages,
    slot_mapping: torch.Tensor,
    scheme: Scheme,
    ring: tuple[RecentTokens, torch.Tensor] | None = None,
) -> None:
    """Launch the fused K/V write (no validation: call :func:`kvquant.kernels.write_kv`).

    The scheme is unpacked here into the kernel's pointers and flags (absent: unread pointers).

    Args:
        key: ``[B, L, Hkv, D]`` fp32/fp16/bf16, any strides.
        value: ``[B, L, Hkv, D]`` fp32/fp16/bf16, any strides.
        pages: FP8 pages ``[num_pages, page_size, Hkv, D]``, any strides with no two
            elements sharing memory, written in place; group scales (dynamic schemes)
            ``[num_pages, page_size, Hkv, D // G]``, last dimension contiguous.
        slot_mapping: int64 ``[B, L]``, any strides.
        scheme: the pages' scale scheme (offset and rotation any strides).
        ring: the ring of the newest tokens (contiguous ``[B, 2, R, Hkv, D]``, ``R >= L``) and
            the int64 ``[1]`` position of the first new token, both written by the launch
            (:func:`~kvquant.kernels.write_kv`'s ``recent`` and ``recent_start``); or None.
    """
    bsz, seq, hkv, d = key.shape
    n_tokens = bsz * seq
    if n_tokens == 0:
        return
    view = scheme.kernel_view()
    k_pages, v_pages = pages.k, pages.v
    k_rotation = view.k_rotation
    num_pages, page_size = k_pages.shape[0], k_pages.shape[1]
    scales = _scale_args(pages, view, scheme.name)
    ng, g = scales.ng, d // scales.ng
    rot_arg, off_arg, rot_strides, off_strides = _transform_args(view, k_pages)
    block_ng, block_r, block_g, block_t = _blocks(hkv, g, ng, k_rotation is not None)
    # a rotated K is one tl.dot operand: at least 16 rows of (token, head)
    least = triton.cdiv(16, triton.next_power_of_2(hkv)) if k_rotation is not None else 1
    block_t = tokens_per_program(block_t, n_tokens, key.device, least)
    grid = (triton.cdiv(n_tokens, block_t),)
    fp8_max = _FP8_MAX[k_pages.dtype]
    if ring is not None:
        ring_kv, ring_start = ring[0].kv, ring[1]
        ring_len = int(ring_kv.shape[2])
        ring_strides = (ring_kv.stride(0), ring_kv.stride(1), ring_kv.stride(2), ring_kv.stride(3))
    else:
        ring_kv, ring_start, ring_len, ring_strides = k_pages, slot_mapping, 1, (0, 0, 0, 0)
    dev = key.device
    # Triton launches on the current CUDA device: switch only when the tensors are elsewhere.
    switch = dev.type == "cuda" and dev.index is not None and dev.index != _current_device()
    with torch.cuda.device(dev) if switch else contextlib.nullcontext():
        write_kv_kernel[grid](
            key,
            value,
            k_pages,
            v_pages,
            slot_mapping,
            *scales.pointers,
            rot_arg,
            off_arg,
            ring_kv,
            ring_start,
            n_tokens,
            seq,
            num_pages * page_size,
            *key.stride(),
            *value.stride(),
            *slot_mapping.stride(),
            *scales.static_strides,
            page_size,
            *k_pages.stride(),
            *v_pages.stride(),
            *scales.group_strides,
            *rot_strides,
            *off_strides,
            ring_len,
            *ring_strides,
            HKV=hkv,
            D=d,
            G=g,
            NG=ng,
            BLOCK_T=block_t,
            BLOCK_NG=block_ng,
            BLOCK_R=block_r,
            BLOCK_G=block_g,
            GROUP=view.group_size is not None,
            FP8_MAX=fp8_max,
            HAS_ROT=k_rotation is not None,
            HAS_OFF=view.k_offset is not None,
            HAS_RING=ring is not None,
            num_warps=4,
        )
