"""Storage of the 4-bit schemes: packed e2m1 pages with block scales computed on write
(:class:`Fp4Storage`: ``nvfp4``, ``mxfp4``), the same pages with 4-bit K in the k-transform's
frame (:class:`KTransformFp4Storage`), FP8 K beside NVFP4 V (:class:`Fp8KNvfp4VStorage`:
``fp8-k-nvfp4-v``), and FP8 K in the k-transform's frame beside NVFP4 V
(:class:`KTransformNvfp4VStorage`). The layout: :mod:`kvquant.kernels.fp4`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, cast

import torch

from kvquant.cache.storage.base import DequantArgs, PagedLayerStorage, SchemeArgs, Shape, nbytes
from kvquant.cache.storage.k_transform import KTransformStorage
from kvquant.errors import CacheUsageError, ScaleFormatError
from kvquant.kernels import page_storage
from kvquant.kernels.fp4 import dequantize_fp4, fp4_page_storage
from kvquant.kernels.fp8 import dequantize_pages
from kvquant.schemes import (
    Fp4Format,
    Fp4Scales,
    Fp8KNvfp4VScales,
    KTransformMxfp4Scales,
    KTransformNvfp4Scales,
    KTransformNvfp4VScales,
    Mxfp4Scales,
    Nvfp4Scales,
    Pages,
    Scheme,
    scheme_class,
)

__all__ = ["Fp4Storage", "Fp8KNvfp4VStorage", "KTransformFp4Storage", "KTransformNvfp4VStorage"]


def _fp32(x: Any) -> Any:
    """A floating tensor as fp32 on the host (the scheme checks its values there), else ``x``."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to(device="cpu", dtype=torch.float32)
    return x


class Fp4Storage(PagedLayerStorage):
    """Packed 4-bit K and V pages with their block scales (``nvfp4``, ``mxfp4``).

    Pages are zero-filled and block scales zero (slots not yet written dequantize to 0). With
    ``k_rotation`` K is stored rotated (the codes of ``k @ R``, the query rotated alike);
    :meth:`dense` reads it back in the model's frame.

    Attributes:
        k_pages: uint8 ``[num_pages, page_size, Hkv, D // 2]`` (two e2m1 codes per byte).
        v_pages: like ``k_pages``.
        k_block_scales: ``[num_pages, page_size, Hkv, D // block]`` in the format's scale dtype.
        v_block_scales: like ``k_block_scales``.
        k_scale: NVFP4's fp32 global scale of K (``[]`` or ``[Hkv]``) on the device, else None.
        v_scale: like ``k_scale`` for V.
        k_rotation: fp32 ``[D, D]`` orthonormal K rotation on the device (the scheme's), or
            None.
    """

    schemes: ClassVar[tuple[type[Scheme], ...]] = (Nvfp4Scales, Mxfp4Scales)
    pool_names: ClassVar[tuple[str, ...]] = (
        "k_pages", "v_pages", "k_block_scales", "v_block_scales",
    )  # fmt: skip

    k_block_scales: torch.Tensor
    v_block_scales: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    k_rotation: torch.Tensor | None
    _scheme: Fp4Scales

    def _configure(self, args: SchemeArgs) -> None:
        self._configure_transform(args)
        if args.group_size is not None:
            raise CacheUsageError(
                f"{self.name}: group_size={args.group_size} was given with granularity="
                f"{self.granularity!r}, whose block size is fixed. Fix: drop group_size."
            )
        if self.kv_dtype != torch.float8_e4m3fn:
            raise CacheUsageError(
                f"{self.name}: kv_dtype={self.kv_dtype} with granularity={self.granularity!r}; "
                "the 4-bit formats' FP8 parts are e4m3fn. Fix: pass kv_dtype="
                "torch.float8_e4m3fn (the default)."
            )
        try:
            scheme = self._new_scheme(args, _fp32(args.k_scale), _fp32(args.v_scale))
        except ScaleFormatError as err:
            raise ScaleFormatError(f"{self.name}: {err}") from err
        self._scheme = scheme.to(self.device)
        view = self._scheme.kernel_view()
        self.k_scale, self.v_scale = view.k_scale, view.v_scale
        self.k_rotation = view.k_rotation

    def _configure_transform(self, args: SchemeArgs) -> None:
        """The K transform's arguments: a rotation of 4-bit K (checked by the scheme), no offset
        or first tokens (:class:`KTransformNvfp4VStorage` keeps them)."""
        four_bit_k = getattr(scheme_class(self.granularity), "k_format", None) is not None
        self._refuse_transform(replace(args, k_rotation=None) if four_bit_k else args)

    def _new_scheme(self, args: SchemeArgs, k: Any, v: Any) -> Fp4Scales:
        """The storage's scheme from the given scales (fp32 host copies, or as given)."""
        kind = scheme_class(self.granularity)
        if kind is Mxfp4Scales:
            if k is not None or v is not None:
                k_name, v_name = args.scale_names
                raise ScaleFormatError(
                    f"{k_name}/{v_name} were given; mxfp4 computes every scale on write. "
                    "Fix: drop them."
                )
            return Mxfp4Scales(self.head_dim, _fp32(args.k_rotation))
        if kind is Nvfp4Scales:
            return Nvfp4Scales(self.head_dim, k, v, _fp32(args.k_rotation))
        return Fp8KNvfp4VScales(self.head_dim, k, v)

    def _formats(self) -> tuple[Fp4Format | None, Fp4Format | None]:
        return self._scheme.k_format, self._scheme.v_format

    def _pool_shapes(self, shape: Shape) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for side, fmt in zip("kv", self._formats(), strict=True):
            if fmt is None:
                out[f"{side}_pages"] = (shape, self.kv_dtype)
                continue
            out[f"{side}_pages"] = ((*shape[:3], shape[3] // 2), torch.uint8)
            out[f"{side}_block_scales"] = ((*shape[:3], shape[3] // fmt.block_size),
                                           fmt.scale_dtype)  # fmt: skip
        return out

    def _new_pools(self, shape: Shape) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for side, fmt in zip("kv", self._formats(), strict=True):
            if fmt is None:  # FP8 K: the cache's K layout (head dim fastest)
                out[f"{side}_pages"] = page_storage(
                    *shape, dtype=self.kv_dtype, device=self.device
                )[0]
                continue
            pages, scales = fp4_page_storage(*shape, fmt, device=self.device)
            out[f"{side}_pages"], out[f"{side}_block_scales"] = pages, scales
        return out

    @property
    def scheme(self) -> Scheme:
        return self._scheme

    @property
    def pages(self) -> Pages:
        return Pages(
            self.k_pages, self.v_pages, getattr(self, "k_block_scales", None), self.v_block_scales
        )

    def _dequant_args(self, ids: torch.Tensor) -> tuple[DequantArgs, DequantArgs]:
        k = DequantArgs(static=self.k_scale, k_rotation=self.k_rotation)
        return k, DequantArgs(static=self.v_scale)

    def _dequantize(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for side, fmt, a in zip("kv", self._formats(), self._dequant_args(ids), strict=True):
            pages = getattr(self, f"{side}_pages")[ids]
            if fmt is None:  # FP8 (K in the k-transform's frame: back to the model's)
                out.append(
                    dequantize_pages(
                        pages, a.static, None, k_offset=a.k_offset, k_rotation=a.k_rotation
                    )
                )
            else:
                scales = getattr(self, f"{side}_block_scales")[ids]
                x = dequantize_fp4(pages, scales, fmt, a.static)
                if a.k_offset is not None:  # 4-bit K in the k-transform's frame: + c
                    x = x + a.k_offset.float()
                # rotated 4-bit K: back to the model's frame (R orthonormal)
                out.append(x if a.k_rotation is None else x @ a.k_rotation.float().T)
        return out[0], out[1]

    def _scale_bytes(self) -> dict[str, int]:
        blocks = nbytes(getattr(self, "k_block_scales", None), self.v_block_scales)
        return {
            "group_scales": blocks,
            "static_scales": nbytes(self.k_scale, self.v_scale),
            "k_transform": nbytes(self.k_rotation),
        }

    def _describe(self) -> str:
        return ", K rotated" if self.k_rotation is not None else ""


class _KTransformKeys:
    """What the 4-bit storages with K in the k-transform's frame take from
    :class:`~kvquant.cache.storage.k_transform.KTransformStorage`: its transform's checks,
    dequantization arguments and description, the transform read from the scheme, and the
    transform's bytes. Listed first among the bases (its ``_configure`` calls the storage's)."""

    k_offset: torch.Tensor
    k_rotation: torch.Tensor | None
    _configure_transform = KTransformStorage._configure_transform
    _dequant_args = KTransformStorage._dequant_args
    _describe = KTransformStorage._describe

    def _configure(self, args: SchemeArgs) -> None:
        super()._configure(args)  # type: ignore[misc]
        view = self._scheme.kernel_view()  # type: ignore[attr-defined]  # the scheme's transform
        self.k_offset, self.k_rotation = cast(torch.Tensor, view.k_offset), view.k_rotation

    def _scale_bytes(self) -> dict[str, int]:
        transform = nbytes(self.k_offset, self.k_rotation, *self.first_tensors())  # type: ignore[attr-defined]
        return super()._scale_bytes() | {"k_transform": transform}  # type: ignore[misc]


class KTransformFp4Storage(_KTransformKeys, Fp4Storage, KTransformStorage):
    """NVFP4 or MXFP4 K and V pages with K in the k-transform's frame (``k-transform-nvfp4``,
    ``k-transform-mxfp4``).

    The pages and block scales of :class:`Fp4Storage`, K stored as the 4-bit codes of
    ``k @ R - c``; :meth:`dense` reads K back in the model's frame (``(x + c) @ R^T``, from the
    pages). The K transform's checks and its first-token side buffer are
    :class:`~kvquant.cache.storage.k_transform.KTransformStorage`'s (``keep_first``,
    ``first_buffer``, ...).

    Attributes:
        k_scale: NVFP4's global scale of the transformed K on the device, else None.
        v_scale: like ``k_scale`` for V.
        k_offset: fp32 ``[Hkv, D]`` on the device (the scheme's).
        k_rotation: fp32 ``[D, D]`` on the device, or None.
        first_tokens: first visible tokens per sequence kept at full precision.
    """

    schemes: ClassVar[tuple[type[Scheme], ...]] = (KTransformNvfp4Scales, KTransformMxfp4Scales)

    # NVFP4's global scales, None for MXFP4 (KTransformStorage's FP8 scales are never None)
    k_scale: torch.Tensor | None  # type: ignore[assignment]
    v_scale: torch.Tensor | None  # type: ignore[assignment]

    def _new_scheme(self, args: SchemeArgs, k: Any, v: Any) -> Fp4Scales:
        offset, rotation = _fp32(args.k_offset), _fp32(args.k_rotation)
        if scheme_class(self.granularity) is KTransformMxfp4Scales:
            if k is not None or v is not None:
                k_name, v_name = args.scale_names
                raise ScaleFormatError(
                    f"{k_name}/{v_name} were given; {self.granularity} computes every scale on "
                    "write. Fix: drop them."
                )
            return KTransformMxfp4Scales(
                self.head_dim, offset, rotation, first_tokens=self.first_tokens
            )
        return KTransformNvfp4Scales(
            self.head_dim, k, v, offset, rotation, first_tokens=self.first_tokens
        )


class Fp8KNvfp4VStorage(Fp4Storage):
    """FP8 K pages with a static scale beside NVFP4 V pages (``fp8-k-nvfp4-v``).

    Attributes:
        k_pages: FP8 ``[num_pages, page_size, Hkv, D]`` (head dim fastest).
        v_pages: uint8 ``[num_pages, page_size, Hkv, D // 2]``.
        v_block_scales: e4m3 ``[num_pages, page_size, Hkv, D // 16]``.
        k_scale: fp32 ``[]`` or ``[Hkv]`` static FP8 K scale, on the device.
        v_scale: V's NVFP4 global scale, the shape of ``k_scale``.
    """

    schemes: ClassVar[tuple[type[Scheme], ...]] = (Fp8KNvfp4VScales,)
    pool_names: ClassVar[tuple[str, ...]] = ("k_pages", "v_pages", "v_block_scales")


class KTransformNvfp4VStorage(_KTransformKeys, Fp8KNvfp4VStorage, KTransformStorage):
    """FP8 K pages in the k-transform's frame beside NVFP4 V pages (``k-transform-k-nvfp4-v``).

    The pages and scales of :class:`Fp8KNvfp4VStorage`, K stored as ``fp8((k @ R - c) /
    k_scale)``; the K transform's checks and its first-token side buffer are
    :class:`~kvquant.cache.storage.k_transform.KTransformStorage`'s (``keep_first``,
    ``first_buffer``, ...).

    Attributes:
        k_offset: fp32 ``[Hkv, D]`` on the device (the scheme's).
        k_rotation: fp32 ``[D, D]`` on the device, or None.
        first_tokens: first visible tokens per sequence kept at full precision.
    """

    schemes: ClassVar[tuple[type[Scheme], ...]] = (KTransformNvfp4VScales,)

    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def _new_scheme(self, args: SchemeArgs, k: Any, v: Any) -> Fp4Scales:
        offset, rotation = _fp32(args.k_offset), _fp32(args.k_rotation)
        return KTransformNvfp4VScales(
            self.head_dim, k, v, offset, rotation, first_tokens=self.first_tokens
        )
