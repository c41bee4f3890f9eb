"""Launcher of the cache-write Triton kernel (:mod:`kvquant.kernels.write.kernel`).

:func:`write_kv_triton` picks the tile and launches; slots that are negative (skip) or beyond
the cache are not stored. Arguments are validated by :func:`kvquant.kernels.write_kv`.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton

from kvquant.kernels.write.kernel import write_kv_kernel

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

    With ``rotate`` the tile is one ``tl.dot`` operand: at least 16 rows and 16 columns.
    """
    block_ng = triton.next_power_of_2(ng)
    block_r = triton.next_power_of_2(hkv) * block_ng
    block_g = triton.next_power_of_2(g)
    if rotate:
        block_g = max(16, block_g)
    per_token = block_r * block_g
    block_t = max(1, min(16, 4096 // per_token))
    block_t = 1 << (block_t.bit_length() - 1)  # power of two
    if rotate:
        block_t = max(block_t, triton.cdiv(16, block_r))
    return block_ng, block_r, block_g, block_t


def _static_stride(s: torch.Tensor) -> int:
    return 0 if s.dim() == 0 else int(s.stride(0))


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    k_group_scales: torch.Tensor | None,
    v_group_scales: torch.Tensor | None,
    k_offset: torch.Tensor | None = None,
    k_rotation: torch.Tensor | None = None,
) -> None:
    """Launch the fused K/V write (no validation: call :func:`kvquant.kernels.write_kv`).

    Args:
        key: ``[B, L, Hkv, D]`` fp32/fp16/bf16, any strides.
        value: ``[B, L, Hkv, D]`` fp32/fp16/bf16, any strides.
        k_pages: ``[num_pages, page_size, Hkv, D]`` FP8, any strides with no two elements
            sharing memory, written in place.
        v_pages: like ``k_pages``.
        slot_mapping: int64 ``[B, L]``, any strides.
        k_scale: fp32 ``[]`` or ``[Hkv]`` (static), or None with group scales.
        v_scale: fp32 ``[]`` or ``[Hkv]`` (static), or None with group scales.
        k_group_scales: fp32 ``[num_pages, page_size, Hkv, D // G]``, last dimension
            contiguous, no two elements sharing memory (any order of the other
            dimensions), or None.
        v_group_scales: like ``k_group_scales``.
        k_offset: fp32 ``[Hkv, D]`` K offset (static scales only), any strides, or None.
        k_rotation: fp32 ``[D, D]`` K rotation (static scales only), any strides, or None.
    """
    bsz, seq, hkv, d = key.shape
    n_tokens = bsz * seq
    if n_tokens == 0:
        return
    num_pages, page_size = k_pages.shape[0], k_pages.shape[1]
    group = k_group_scales is not None and v_group_scales is not None
    if k_group_scales is not None and v_group_scales is not None:
        ng = int(k_group_scales.shape[-1])
        g = d // ng
        ks_arg, vs_arg, sks, svs = k_pages, v_pages, 0, 0
        kg_arg, vg_arg = k_group_scales, v_group_scales
        kg_strides = k_group_scales.stride()[:3]
        vg_strides = v_group_scales.stride()[:3]
    elif k_scale is not None and v_scale is not None:
        ng, g = 1, d
        ks_arg, vs_arg = k_scale, v_scale
        sks, svs = _static_stride(k_scale), _static_stride(v_scale)
        kg_arg, vg_arg = k_pages, v_pages
        kg_strides = vg_strides = (0, 0, 0)
    else:
        raise ValueError("write_kv_triton needs k_scale/v_scale or k_group_scales/v_group_scales")
    rot_arg = k_rotation if k_rotation is not None else k_pages
    off_arg = k_offset if k_offset is not None else k_pages
    rot_strides = k_rotation.stride() if k_rotation is not None else (0, 0)
    off_strides = k_offset.stride() if k_offset is not None else (0, 0)
    block_ng, block_r, block_g, block_t = _blocks(hkv, g, ng, k_rotation is not None)
    grid = (triton.cdiv(n_tokens, block_t),)
    fp8_max = _FP8_MAX[k_pages.dtype]
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
            ks_arg,
            vs_arg,
            kg_arg,
            vg_arg,
            rot_arg,
            off_arg,
            n_tokens,
            seq,
            num_pages * page_size,
            *key.stride(),
            *value.stride(),
            *slot_mapping.stride(),
            sks,
            svs,
            page_size,
            *k_pages.stride(),
            *v_pages.stride(),
            *kg_strides,
            *vg_strides,
            *rot_strides,
            *off_strides,
            HKV=hkv,
            D=d,
            G=g,
            NG=ng,
            BLOCK_T=block_t,
            BLOCK_NG=block_ng,
            BLOCK_R=block_r,
            BLOCK_G=block_g,
            GROUP=group,
            FP8_MAX=fp8_max,
            HAS_ROT=k_rotation is not None,
            HAS_OFF=k_offset is not None,
            num_warps=4,
        )
