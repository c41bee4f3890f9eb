"""Launcher of the 4-bit cache-write kernel (:mod:`kvquant.kernels.write_fp4.kernel`).

:func:`write_fp4_triton` unpacks the scheme into the kernel's pointers and per-side formats,
picks the tile and launches; negative slots are skipped. K in the k-transform's frame (FP8 or
4-bit) and rotated 4-bit K are rotated and offset in torch first
(:func:`kvquant.kernels.fp8.transform_keys`, one ``[T, Hkv, D] x [D, D]`` product: the kernel's
tiles hold even and odd elements apart). Arguments are validated by
:func:`kvquant.kernels.write_fp4.write_fp4`.
"""

from __future__ import annotations

import contextlib

import torch
import triton

from kvquant.errors import KernelInputError
from kvquant.kernels.fp8 import transform_keys
from kvquant.kernels.write.launch import tokens_per_program
from kvquant.kernels.write_fp4.kernel import write_fp4_kernel
from kvquant.kernels.write_fp4.validate import fp4_code
from kvquant.schemes import Pages, Scheme

__all__ = ["is_interpreted", "write_fp4_triton"]


def is_interpreted() -> bool:
    """Whether this module's kernel runs in the Triton interpreter (``TRITON_INTERPRET=1``)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(write_fp4_kernel, InterpretedFunction)


def _tile(hkv: int, nb: int, block: int) -> tuple[int, int, int]:
    """``(BLOCK_NB, BLOCK_R, BLOCK_T)``: rows of (head, block), tokens per program (powers of 2)."""
    block_nb = triton.next_power_of_2(nb)
    block_r = triton.next_power_of_2(hkv) * block_nb
    per_token = block_r * (block // 2)
    block_t = max(1, min(16, 2048 // per_token))
    return block_nb, block_r, 1 << (block_t.bit_length() - 1)


def _head_stride(g: torch.Tensor | None) -> int:
    return 0 if g is None or g.dim() == 0 else int(g.stride(0))


def write_fp4_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    pages: Pages,
    slot_mapping: torch.Tensor,
    scheme: Scheme,
) -> None:
    """Launch the fused 4-bit K/V write (no validation: call ``write_fp4``); arguments as there."""
    bsz, seq, hkv, d = key.shape
    n_tokens = bsz * seq
    if n_tokens == 0:
        return
    view = scheme.kernel_view()
    fmt = view.k_fp4 if view.k_fp4 is not None else view.v_fp4
    if fmt is None:
        raise KernelInputError(
            f"write_fp4_triton: the {scheme.name!r} scheme stores FP8 K and V. Fix: call "
            "kvquant.kernels.write_kv, which validates its arguments and picks the write."
        )
    if view.k_offset is not None or view.k_rotation is not None:  # k @ R - c (checked)
        key = transform_keys(key, view.k_offset, view.k_rotation)
    kp, vp = pages.k.view(torch.uint8), pages.v.view(torch.uint8)
    num_pages, page_size = kp.shape[0], kp.shape[1]
    nb = d // fmt.block_size
    block_nb, block_r, block_t = _tile(hkv, nb, fmt.block_size)
    block_t = tokens_per_program(block_t, n_tokens, key.device)
    # an FP8 side has no block scales: its pages stand in (never read or written)
    ks = pages.k_scales.view(torch.uint8) if pages.k_scales is not None else kp
    vs = pages.v_scales.view(torch.uint8) if pages.v_scales is not None else vp
    kg = view.k_scale if view.k_scale is not None else ks
    vg = view.v_scale if view.v_scale is not None else vs
    dev = key.device
    switch = (
        dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device()
    )
    with torch.cuda.device(dev) if switch else contextlib.nullcontext():
        write_fp4_kernel[(triton.cdiv(n_tokens, block_t),)](
            key, value, kp, vp, ks, vs, slot_mapping, kg, vg,
            n_tokens, seq, num_pages * page_size, page_size,
            *key.stride(), *value.stride(), *slot_mapping.stride(),
            *kp.stride(), *vp.stride(), *ks.stride()[:3], *vs.stride()[:3],
            _head_stride(view.k_scale), _head_stride(view.v_scale),
            HKV=hkv, NB=nb, BLOCK=fmt.block_size, BLOCK_T=block_t, BLOCK_NB=block_nb,
            BLOCK_R=block_r, K_FMT=fp4_code(view, "k"), V_FMT=fp4_code(view, "v"), num_warps=4,
        )  # fmt: skip
