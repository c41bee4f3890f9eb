"""The :class:`Engine` base: what a serving engine's loader accepts, and which producer to write.

A subclass (one file each) lists its :class:`Rule` s (granularity -> stored
shape, with the loader fact behind it) and may override :meth:`Engine.target`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from kvquant.checkpoint.discovery import DiscoveredCheckpoint
from kvquant.checkpoint.producers import CompressedTensors, Producer, ScaleShape
from kvquant.errors import ExportError

__all__ = ["Engine", "Rule"]


@dataclass(frozen=True)
class Rule:
    """One granularity an engine loads.

    Attributes:
        shape: the stored shape of every K and V scale tensor.
        note: what the engine's loader does with it (goes into the export's notes).
    """

    shape: ScaleShape
    note: str


class Engine:
    """One serving engine ``kvquant export`` writes for.

    Attributes:
        name: the ``--engine`` name.
        rules: granularity -> :class:`Rule`; the granularities it loads.
        kv_only: the producer written for a source with unquantized weights.
    """

    name: ClassVar[str]
    rules: ClassVar[Mapping[str, Rule]]
    kv_only: ClassVar[Producer] = CompressedTensors()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def shape(self, granularity: str, num_kv_heads: int) -> tuple[int, ...]:
        """The stored shape of a scale at ``granularity`` for ``num_kv_heads`` KV heads."""
        return self.rules[granularity].shape.dims(num_kv_heads)

    def target(
        self,
        found: DiscoveredCheckpoint,
        producer: Producer | None,
        granularity: str,
        weights: str | None,
    ) -> Producer:
        """The producer convention to write, or :class:`ExportError` naming why none fits.

        Args:
            found: the source checkpoint.
            producer: the source's producer (None: none).
            granularity: ``"per-tensor"`` or ``"per-head"``.
            weights: how the source quantizes its weights (None: it does not).
        """
        if weights is None:
            return self.kv_only
        if producer is not None and producer.keeps_weights:
            if granularity in producer.granularities:
                return producer
            raise ExportError(
                f"{found.path}: {found.producer} weight quantization ({weights}) is kept as is, "
                f"and the {found.producer} config has no per-head KV strategy ({self.name} "
                f"reads {found.producer} KV scales per tensor). Fix: export per-tensor (drop "
                "--per-head), or re-export the weights with llm-compressor (kv_cache_scheme "
                "strategy attn_head)."
            )
        raise ExportError(
            f"{found.path}: the weights are quantized by {found.producer} ({weights}); kvquant "
            "export keeps weight quantization untouched and writes KV scales in the weight "
            f"producer's convention, but it does not write {found.producer} KV scales for "
            f"{self.name}. Fix: use the producer's own export for that engine, or export a "
            "KV-only checkpoint (unquantized weights) and re-run kvquant export."
        )
