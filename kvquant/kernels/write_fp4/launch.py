"""Launcher of the 4-bit cache-write kernel (:mod:`kvquant.kernels.write_fp4.kernel`).

:func:`write_fp4_triton` picks the tile and launches; negative slots are skipped. Arguments are
validated by :func:`kvquant.kernels.write_fp4.write_fp4`.
"""

from __future__ import annotations

import contextlib

import torch
import triton

from kvquant.kernels.fp4 import Fp4Format
from kvquant.kernels.write_fp4.kernel import write_fp4_kernel

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
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k_block_scales: torch.Tensor,
    v_block_scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: Fp4Format,
    k_global_scale: torch.Tensor | None = None,
    v_global_scale: torch.Tensor | None = None,
) -> None:
    """Launch the fused 4-bit K/V write (no validation: call ``write_fp4``); arguments as there."""
    bsz, seq, hkv, d = key.shape
    n_tokens = bsz * seq
    if n_tokens == 0:
        return
    num_pages, page_size = k_pages.shape[0], k_pages.shape[1]
    nb = d // fmt.block_size
    block_nb, block_r, block_t = _tile(hkv, nb, fmt.block_size)
    ks, vs = k_block_scales.view(torch.uint8), v_block_scales.view(torch.uint8)
    kg = k_global_scale if k_global_scale is not None else ks
    vg = v_global_scale if v_global_scale is not None else vs
    dev = key.device
    switch = (
        dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device()
    )
    with torch.cuda.device(dev) if switch else contextlib.nullcontext():
        write_fp4_kernel[(triton.cdiv(n_tokens, block_t),)](
            key, value, k_pages, v_pages, ks, vs, slot_mapping, kg, vg,
            n_tokens, seq, num_pages * page_size, page_size,
            *key.stride(), *value.stride(), *slot_mapping.stride(),
            *k_pages.stride()[:3], *v_pages.stride()[:3], *ks.stride()[:3], *vs.stride()[:3],
            _head_stride(k_global_scale), _head_stride(v_global_scale),
            HKV=hkv, NB=nb, BLOCK=fmt.block_size, BLOCK_T=block_t, BLOCK_NB=block_nb,
            BLOCK_R=block_r, NVFP4=fmt.global_scale, num_warps=4,
        )  # fmt: skip
