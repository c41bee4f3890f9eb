"""Storage of the dynamic ``fp32-group`` scheme: one fp32 scale per token, KV head and group of
``group_size`` channels, computed on write and kept beside the pages (the group-scale pools)."""

from __future__ import annotations

from typing import ClassVar

import torch

from kvquant.cache.storage.base import DequantArgs, PagedLayerStorage, SchemeArgs, Shape, nbytes
from kvquant.errors import CacheUsageError
from kvquant.kernels import group_scale_storage
from kvquant.schemes import GroupScales, Pages, Scheme

__all__ = ["GroupStorage"]


class GroupStorage(PagedLayerStorage):
    """FP8 pages with dynamic fp32 group scales (``fp32-group``).

    Attributes:
        group_size: ``G``.
        k_group_scales: fp32 ``[num_pages, page_size, Hkv, D // G]``, one-filled when
            allocated (stored head-major: :func:`kvquant.kernels.group_scale_storage`).
        v_group_scales: like ``k_group_scales``.
    """

    schemes: ClassVar[tuple[type[Scheme], ...]] = (GroupScales,)
    pool_names: ClassVar[tuple[str, ...]] = (
        "k_pages", "v_pages", "k_group_scales", "v_group_scales",
    )  # fmt: skip

    group_size: int
    k_group_scales: torch.Tensor
    v_group_scales: torch.Tensor

    def _configure(self, args: SchemeArgs) -> None:
        self._refuse_transform(args)
        name, head_dim = self.name, self.head_dim
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

    @classmethod
    def _token_bytes(
        cls, granularity: str, num_kv_heads: int, head_dim: int, group_size: int | None
    ) -> int:
        groups = head_dim // (group_size or head_dim)
        return 2 * num_kv_heads * (head_dim + 4 * groups)  # FP8 codes and fp32 group scales

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
        return Scheme.unflatten(self.granularity, [self.head_dim, self.group_size], [])

    @property
    def pages(self) -> Pages:
        return Pages(self.k_pages, self.v_pages, self.k_group_scales, self.v_group_scales)

    def _dequant_args(self, ids: torch.Tensor) -> tuple[DequantArgs, DequantArgs]:
        return DequantArgs(groups=self.k_group_scales[ids]), DequantArgs(
            groups=self.v_group_scales[ids]
        )

    def _scale_bytes(self) -> dict[str, int]:
        return {"group_scales": nbytes(self.k_group_scales, self.v_group_scales)}

    def _describe(self) -> str:
        return f", G={self.group_size}"
