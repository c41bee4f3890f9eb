"""Storage of a static scheme: one fp32 K and V scale per tensor or per KV head, known before
any token (:class:`~kvquant.schemes.PerTensorScales`, :class:`~kvquant.schemes.PerHeadScales`)."""

from __future__ import annotations

from typing import ClassVar

import torch

from kvquant.cache.storage.base import DequantArgs, PagedLayerStorage, SchemeArgs, nbytes
from kvquant.errors import CacheUsageError, ScaleFormatError
from kvquant.kernels.validate import SCALE_MAX, SCALE_MIN
from kvquant.schemes import PerHeadScales, PerTensorScales, Scheme, StaticScales, scheme_class

__all__ = ["StaticStorage"]


def static_scale(
    owner: str,
    label: str,
    scale: object,
    granularity: str,
    want: tuple[int, ...],
    num_kv_heads: int,
    device: torch.device,
) -> torch.Tensor:
    """Check one static scale of shape ``want`` and return an fp32 copy of it on ``device``."""
    fix = "Fix: pass the scales kvquant.registry resolved for the model."
    if scale is None:
        raise ScaleFormatError(
            f"{owner}: {label} is None; granularity {granularity!r} needs a static scale of "
            f"shape {want}. {fix}"
        )
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
        raise ScaleFormatError(
            f"{owner}: {label} is not a floating-point tensor; expected fp32 shape {want}. {fix}"
        )
    if tuple(scale.shape) != want:
        raise ScaleFormatError(
            f"{owner}: {label} has shape {tuple(scale.shape)}; expected {want} for "
            f"granularity {granularity!r} with {num_kv_heads} KV heads. {fix}"
        )
    # Values are checked on the host copy (a scale on the GPU is read once, here), so that
    # building a layer's storage inside a forward does not wait for the GPU.
    host = scale.detach()
    host = (host if host.device.type == "cpu" else host.cpu()).to(torch.float32)
    in_range = torch.isfinite(host) & (host >= SCALE_MIN) & (host <= SCALE_MAX)
    if not bool(in_range.all()):
        raise ScaleFormatError(
            f"{owner}: {label} holds a zero, negative, non-finite, subnormal or huge value; "
            f"expected finite dequantization multipliers in [{SCALE_MIN:.3g}, {SCALE_MAX:.3g}]. "
            f"{fix}"
        )
    if device.type == "cpu":
        return host.clone()
    return host.to(device=device, non_blocking=True)  # no stream sync from pinned memory


class StaticStorage(PagedLayerStorage):
    """FP8 pages with static fp32 scales (``per-tensor`` or ``per-head``).

    Attributes:
        k_scale: fp32 ``[]`` (per-tensor) or ``[Hkv]`` (per-head), on the device.
        v_scale: like ``k_scale``.
    """

    schemes: ClassVar[tuple[type[Scheme], ...]] = (PerTensorScales, PerHeadScales)

    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def _configure(self, args: SchemeArgs) -> None:
        self._configure_transform(args)
        if args.group_size is not None:
            raise CacheUsageError(
                f"{self.name}: group_size={args.group_size} was given with granularity="
                f"{self.granularity!r}. Fix: drop group_size, or pass granularity='fp32-group'."
            )
        want = self._scale_shape()
        k_name, v_name = args.scale_names
        g, hkv, dev = self.granularity, self.num_kv_heads, self.device
        self.k_scale = static_scale(self.name, k_name, args.k_scale, g, want, hkv, dev)
        self.v_scale = static_scale(self.name, v_name, args.v_scale, g, want, hkv, dev)

    def _configure_transform(self, args: SchemeArgs) -> None:
        """The K transform's arguments: refused (the ``k-transform`` storage keeps them)."""
        self._refuse_transform(args)

    def _scale_shape(self) -> tuple[int, ...]:
        """``(Hkv,)`` for a per-head scheme, ``()`` for one scale per tensor."""
        kind = scheme_class(self.granularity)
        per_head = issubclass(kind, StaticScales) and kind.per_head
        return (self.num_kv_heads,) if per_head else ()

    @property
    def scheme(self) -> Scheme:
        return Scheme.unflatten(self.granularity, [], [self.k_scale, self.v_scale])

    def _dequant_args(self, ids: torch.Tensor) -> tuple[DequantArgs, DequantArgs]:
        return DequantArgs(static=self.k_scale), DequantArgs(static=self.v_scale)

    def _scale_bytes(self) -> dict[str, int]:
        return {"static_scales": nbytes(self.k_scale, self.v_scale)}
