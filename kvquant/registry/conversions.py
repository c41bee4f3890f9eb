"""The conversions the registry applies to stored scales, typed, each saying whether it loses information.

Resolution records every conversion it makes as an :class:`AppliedConversion`
(:attr:`ModelScales.conversions <kvquant.registry.resolve.ModelScales.conversions>`);
whether a choice is logged as a warning is read from :attr:`Conversion.lossy`,
never from the wording of a note.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["AppliedConversion", "Conversion"]


class Conversion(Enum):
    """One kind of change made to stored scales (``value``: its stable identifier).

    Attributes:
        lossy: the change can lose accuracy (or is a guess), so it is warned about.
    """

    CAST = "cast"
    KV_SCALE_SHARED = "kv-scale-shared"
    KV_REUSED = "kv-reused"
    QUERY_HEAD_MAX = "query-head-max"
    PER_HEAD_MAX = "per-head-max"
    BROADCAST_PER_HEAD = "broadcast-per-head"
    ROPE_WIDENED = "rope-widened"
    ROPE_KEPT = "rope-kept"
    MERGED_KV = "merged-kv"
    IDENTICAL_KV = "identical-kv"
    CHECKPOINT_IGNORED = "checkpoint-ignored"
    DYNAMIC_DEFAULT = "dynamic-default"
    UNIT_DEFAULT = "unit-default"

    @property
    def lossy(self) -> bool:
        """Whether the conversion can lose accuracy (reduced, reused, kept saturating, or 1.0)."""
        return self in _LOSSY


_LOSSY = frozenset(
    {
        Conversion.KV_REUSED,
        Conversion.QUERY_HEAD_MAX,
        Conversion.PER_HEAD_MAX,
        Conversion.ROPE_KEPT,
        Conversion.UNIT_DEFAULT,
    }
)


@dataclass(frozen=True)
class AppliedConversion:
    """A conversion as applied to one model.

    Attributes:
        conversion: what was done.
        note: the sentence the report prints for it.
        layers: the layers it was applied to (ascending).
    """

    conversion: Conversion
    note: str
    layers: tuple[int, ...] = ()

    @property
    def lossy(self) -> bool:
        """See :attr:`Conversion.lossy`."""
        return self.conversion.lossy
