"""The 4-bit cache write (NVFP4 / MXFP4 pages): entry point, kernel, launch, reference, checks.

:func:`write_fp4` validates every argument (nothing is written when one is refused), then runs
the pure-PyTorch reference (``backend="torch"``) or the Triton kernel (``"triton"``, imported
on first use; ``"auto"``: Triton on CUDA). :func:`kvquant.kernels.write_kv` routes a 4-bit
scheme here. The layout and codes: :mod:`kvquant.kernels.fp4`.
"""

from __future__ import annotations

import importlib

import torch

from kvquant.errors import BackendError
from kvquant.kernels.backend import resolve_backend
from kvquant.kernels.write_fp4.naive import write_fp4_reference
from kvquant.kernels.write_fp4.validate import check_write_fp4_inputs
from kvquant.schemes import Pages, Scheme

__all__ = ["write_fp4"]


def write_fp4(
    key: torch.Tensor,
    value: torch.Tensor,
    pages: Pages,
    slot_mapping: torch.Tensor,
    scheme: Scheme,
    *,
    backend: str = "auto",
) -> None:
    """Quantize new K/V tokens to 4-bit codes (an FP8 side: FP8) and store them (in place).

    Args:
        key: ``[B, L, Hkv, D]`` fp32, fp16 or bf16, any strides.
        value: like ``key`` (its dtype may differ).
        pages: per 4-bit side, uint8 pages ``[num_pages, page_size, Hkv, D // 2]`` and block
            scales ``[num_pages, page_size, Hkv, D // block]`` (``k_scales`` / ``v_scales``,
            the format's ``scale_dtype``), last dimensions contiguous, no two elements sharing
            memory (:func:`kvquant.kernels.fp4.fp4_page_storage`); an FP8 side: FP8 pages
            ``[num_pages, page_size, Hkv, D]`` and no block scales.
        slot_mapping: int64 ``[B, L]``; negative = skip, else below ``num_pages * page_size``.
        scheme: a 4-bit scheme (:class:`~kvquant.schemes.Nvfp4Scales`,
            :class:`~kvquant.schemes.Mxfp4Scales`, :class:`~kvquant.schemes.Fp8KNvfp4VScales`,
            or one storing K in the k-transform's frame, whose K is rotated and offset first:
            ``k @ R - c``), its tensors on the pages' device.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Raises:
        KernelInputError: an argument is malformed (nothing is written).
        BackendError: the requested backend cannot run here.

    Example:
        >>> import torch
        >>> from kvquant.kernels.fp4 import NVFP4, fp4_page_storage
        >>> from kvquant.schemes import Nvfp4Scales, Pages
        >>> kp, ks = fp4_page_storage(2, 4, 1, 32, NVFP4)
        >>> vp, vs = fp4_page_storage(2, 4, 1, 32, NVFP4)
        >>> x = torch.randn(1, 2, 1, 32)
        >>> g = x.abs().amax() / (6 * 448)
        >>> write_fp4(x, x, Pages(kp, vp, ks, vs), torch.tensor([[4, 5]]),
        ...           Nvfp4Scales(32, g, g), backend="torch")
        >>> bool(kp[1, :2].any())
        True
    """
    check_write_fp4_inputs(key, value, pages, slot_mapping, scheme)
    chosen = resolve_backend(backend, pages.k.device, "write_fp4")
    if key.numel() == 0:
        return
    if chosen == "torch":
        write_fp4_reference(key, value, pages, slot_mapping, scheme)
        return
    launch = importlib.import_module("kvquant.kernels.write_fp4.launch")
    if pages.k.device.type != "cuda" and not launch.is_interpreted():
        raise BackendError(
            "write_fp4: backend='triton' on CPU needs the Triton interpreter, but kvquant's "
            "Triton kernels were imported before TRITON_INTERPRET=1 was set. Fix: set it in "
            "the environment before the first kernel call, or pass backend='torch'."
        )
    launch.write_fp4_triton(key, value, pages, slot_mapping, scheme)
