"""The 4-bit cache write (NVFP4 / MXFP4 pages): entry point, kernel, launch, reference, checks.

:func:`write_fp4` validates every argument (nothing is written when one is refused), then runs
the pure-PyTorch reference (``backend="torch"``) or the Triton kernel (``"triton"``, imported
on first use; ``"auto"``: Triton on CUDA). The layout and codes: :mod:`kvquant.kernels.fp4`.
"""

from __future__ import annotations

import importlib

import torch

from kvquant.errors import BackendError
from kvquant.kernels.backend import resolve_backend
from kvquant.kernels.fp4 import Fp4Format
from kvquant.kernels.write_fp4.naive import write_fp4_reference
from kvquant.kernels.write_fp4.validate import check_write_fp4_inputs

__all__ = ["write_fp4"]


def write_fp4(
    key: torch.Tensor,
    value: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k_block_scales: torch.Tensor,
    v_block_scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    fmt: Fp4Format,
    k_global_scale: torch.Tensor | None = None,
    v_global_scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Quantize new K/V tokens to 4-bit codes and store them into their page slots (in place).

    Args:
        key: ``[B, L, Hkv, D]`` fp32, fp16 or bf16, any strides.
        value: like ``key`` (its dtype may differ).
        k_pages: uint8 ``[num_pages, page_size, Hkv, D // 2]``, no two elements sharing memory.
        v_pages: like ``k_pages``.
        k_block_scales: ``fmt.scale_dtype`` ``[num_pages, page_size, Hkv, D // block]``.
        v_block_scales: like ``k_block_scales``.
        slot_mapping: int64 ``[B, L]``; negative = skip, else below ``num_pages * page_size``.
        fmt: :data:`~kvquant.kernels.fp4.NVFP4` or :data:`~kvquant.kernels.fp4.MXFP4`.
        k_global_scale: NVFP4's fp32 ``[]`` or ``[Hkv]`` (canonical: ``amax / (6 * 448)``);
            None for MXFP4.
        v_global_scale: like ``k_global_scale``.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Raises:
        KernelInputError: an argument is malformed (nothing is written).
        BackendError: the requested backend cannot run here.

    Example:
        >>> import torch
        >>> from kvquant.kernels.fp4 import NVFP4, fp4_page_storage
        >>> kp, ks = fp4_page_storage(2, 4, 1, 32, NVFP4)
        >>> vp, vs = fp4_page_storage(2, 4, 1, 32, NVFP4)
        >>> x = torch.randn(1, 2, 1, 32)
        >>> g = x.abs().amax() / (6 * 448)
        >>> write_fp4(x, x, kp, vp, ks, vs, torch.tensor([[4, 5]]), fmt=NVFP4,
        ...           k_global_scale=g, v_global_scale=g, backend="torch")
        >>> bool(kp[1, :2].any())
        True
    """
    check_write_fp4_inputs(
        key, value, k_pages, v_pages, k_block_scales, v_block_scales, slot_mapping,
        fmt, k_global_scale, v_global_scale,
    )  # fmt: skip
    chosen = resolve_backend(backend, k_pages.device, "write_fp4")
    args = (key, value, k_pages, v_pages, k_block_scales, v_block_scales, slot_mapping, fmt,
            k_global_scale, v_global_scale)  # fmt: skip
    if key.numel() == 0:
        return
    if chosen == "torch":
        write_fp4_reference(*args)
        return
    launch = importlib.import_module("kvquant.kernels.write_fp4.launch")
    if k_pages.device.type != "cuda" and not launch.is_interpreted():
        raise BackendError(
            "write_fp4: backend='triton' on CPU needs the Triton interpreter, but kvquant's "
            "Triton kernels were imported before TRITON_INTERPRET=1 was set. Fix: set it in "
            "the environment before the first kernel call, or pass backend='torch'."
        )
    launch.write_fp4_triton(*args)
