"""Storage of the dynamic ``fp32-group`` scheme: one fp32 scale per token, KV head and group of
``group_size`` channels, computed on write and kept beside the pages (the group-scale pools),
of K as given or rotated (``k_rotation``)."""

from __future__ import annotations

from typing import ClassVar, cast

import torch

from kvquant.cache.storage.base import DequantArgs, PagedLayerStorage, SchemeArgs, Shape, nbytes
from kvquant.errors import CacheUsageError, KVQuantError, ScaleFormatError
from kvquant.kernels import group_scale_storage
from kvquant.schemes import GroupScales, Pages, Scheme

__all__ = ["GroupStorage"]


class GroupStorage(PagedLayerStorage):
    """FP8 pages with dynamic fp32 group scales (``fp32-group``), of K rotated by ``k_rotation``.

    Attributes:
        group_size: ``G``.
        k_rotation: fp32 ``[D, D]`` orthonormal K rotation on the device (K stored as
            ``fp8(k @ R / s)``, the query rotated alike), or None.
        k_group_scales: fp32 ``[num_pages, page_size, Hkv, D // G]``, one-filled when
            allocated (stored head-major: :func:`kvquant.kernels.group_scale_storage`).
        v_group_scales: like ``k_group_scales``.
    """

    schemes: ClassVar[tuple[type[Scheme], ...]] = (GroupScales,)
    pool_names: ClassVar[tuple[str, ...]] = (
        "k_pages", "v_pages", "k_group_scales", "v_group_scales",
    )  # fmt: skip

    group_size: int
    k_rotation: torch.Tensor | None
    k_group_scales: torch.Tensor
    v_group_scales: torch.Tensor

    def _configure(self, args: SchemeArgs) -> None:
        name, head_dim = self.name, self.head_dim
        if args.k_offset is not None or args.first_tokens:
            raise CacheUsageError(
                f"{name}: k_offset / first_tokens were given with granularity='fp32-group', "
                "whose only K transform is a rotation (k_rotation). Fix: drop them, or pass "
                "granularity='k-transform' (the format they belong to)."
            )
        if args.k_scale is not None or args.v_scale is not None:
            k_name, v_name = args.scale_names
            raise CacheUsageError(
                f"{name}: {k_name}/{v_name} were given with granularity='fp32-group', whose "
                "scales are computed on write. Fix: drop them, or pass granularity="
                "'per-tensor' / 'per-head'."
            )
        group_size = args.group_size
        g = min(64, head_dim) if group_size is None else group_size
        while group_size is None and head_dim % g:
            g //= 2
        if isinstance(g, bool) or not isinstance(g, int) or g <= 0 or head_dim % g:
            divisors = [d for d in (8, 16, 32, 64, 128) if head_dim % d == 0] or [head_dim]
            raise CacheUsageError(
                f"{name}: group_size={g!r} does not divide head_dim {head_dim}. "
                f"Fix: pass a group_size that divides the head dim (e.g. one of {divisors})."
            )
        self.group_size = g
        self.k_rotation = self._rotation(args.k_rotation)

    def _rotation(self, rotation: torch.Tensor | None) -> torch.Tensor | None:
        """The K rotation checked once (:class:`~kvquant.schemes.GroupScales`), on the device."""
        if rotation is None:
            return None
        if not isinstance(rotation, torch.Tensor):
            raise ScaleFormatError(
                f"{self.name}: k_rotation is a {type(rotation).__name__}; expected an fp32 "
                f"[{self.head_dim}, {self.head_dim}] tensor. Fix: pass "
                f"kvquant.kernels.hadamard({self.head_dim}), or None."
            )
        host = rotation.detach().to(device="cpu")
        try:
            checked = cast(
                torch.Tensor, GroupScales(self.head_dim, self.group_size, host).k_rotation
            )
        except KVQuantError as err:
            raise ScaleFormatError(f"{self.name}: {err}") from None
        if self.device.type == "cpu":
            return checked
        # no stream sync from pinned memory (kvquant.patch pins what it passes)
        return checked.to(device=self.device, non_blocking=True)

    def _pool_shapes(self, shape: Shape) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        gshape = (*shape[:3], shape[3] // self.group_size)
        groups = {
            "k_group_scales": (gshape, torch.float32),
            "v_group_scales": (gshape, torch.float32),
        }
        return super()._pool_shapes(shape) | groups

    def _new_pools(self, shape: Shape) -> dict[str, torch.Tensor]:
        gshape = (*shape[:3], shape[3] // self.group_size)
        k_groups = group_scale_storage(*gshape, device=self.device)
        v_groups = group_scale_storage(*gshape, device=self.device)
        return {**super()._new_pools(shape), "k_group_scales": k_groups, "v_group_scales": v_groups}

    @property
    def scheme(self) -> Scheme:
        return Scheme.unflatten(
            self.granularity, [self.head_dim, self.group_size], [self.k_rotation]
        )

    @property
    def pages(self) -> Pages:
        return Pages(self.k_pages, self.v_pages, self.k_group_scales, self.v_group_scales)

    def _dequant_args(self, ids: torch.Tensor) -> tuple[DequantArgs, DequantArgs]:
        k = DequantArgs(groups=self.k_group_scales[ids], k_rotation=self.k_rotation)
        return k, DequantArgs(groups=self.v_group_scales[ids])

    def _scale_bytes(self) -> dict[str, int]:
        groups = {"group_scales": nbytes(self.k_group_scales, self.v_group_scales)}
        return groups | {"k_transform": nbytes(self.k_rotation)}

    def _describe(self) -> str:
        rot = ", K rotated" if self.k_rotation is not None else ""
        return f", G={self.group_size}{rot}"
