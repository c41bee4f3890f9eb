"""The registry's resolve options as one frozen value, shared by every entry point.

:func:`~kvquant.registry.resolve_scales`, :func:`~kvquant.registry.analyze_scales`
(and so ``kvquant doctor``), :func:`kvquant.patch` and ``KVQuantConfig`` all
resolve with a :class:`ResolveOptions`, so the same options mean the same
decision everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from kvquant.choices import MissingKV, MissingScales, RopePolicy, coerce_choice

if TYPE_CHECKING:
    from kvquant.registry.formats import ScaleFormat

__all__ = ["ResolveOptions"]


@dataclass(frozen=True)
class ResolveOptions:
    """How raw scales are resolved (see :func:`~kvquant.registry.resolve_scales` for each value).

    Attributes:
        scale_format: ``"auto"``, a built-in or registered format name, or a
            :class:`~kvquant.registry.ScaleFormat` instance.
        missing_scales: no layer has a scale: ``"dynamic"``, ``"error"`` or ``"unit"``.
        group_size: ``G`` of ``fp32-group``, or None for the default.
        missing_kv: a layer with only K or only V: ``"error"`` or ``"reuse"``.
        rope_policy: K calibrated before RoPE: ``"widen"`` or ``"keep"``.

    Example:
        >>> ResolveOptions(missing_kv="reuse").as_kwargs()["missing_kv"]
        'reuse'
    """

    scale_format: str | ScaleFormat = "auto"
    missing_scales: str = "dynamic"
    group_size: int | None = None
    missing_kv: str = "error"
    rope_policy: str = "widen"

    def __post_init__(self) -> None:
        # the words as typed choices (a word that names none is left for resolve's own error)
        for name, kind in (
            ("missing_scales", MissingScales),
            ("missing_kv", MissingKV),
            ("rope_policy", RopePolicy),
        ):
            object.__setattr__(self, name, coerce_choice(kind, getattr(self, name)))

    def as_kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments of :func:`~kvquant.registry.resolve_scales`."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
