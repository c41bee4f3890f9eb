"""Synthetic producer checkpoints for tests, demos and benchmarks.

:func:`write_checkpoint` writes a tiny Llama-architecture checkpoint folder whose KV scales are
named, shaped, typed and configured the way a given producer exports them (the conventions
and the test hooks: docs/dev/checkpoint.md, "Synthetic checkpoints"); :func:`producer_checkpoint` does
so for a registered producer; :data:`CATALOGUE` lists odd checkpoints, each with the outcome
kvquant's doors must give it (:mod:`kvquant.testing.catalogue`).
"""

from __future__ import annotations

from kvquant.testing.catalogue import CATALOGUE, CatalogueEntry
from kvquant.testing.synthetic import (
    CONVENTIONS,
    K_TRANSFORM,
    default_k_offsets,
    default_scale_values,
    producer_checkpoint,
    scale_tensor_name,
    write_checkpoint,
    write_hf_cache_entry,
)

__all__ = [
    "CATALOGUE",
    "CONVENTIONS",
    "K_TRANSFORM",
    "CatalogueEntry",
    "default_k_offsets",
    "default_scale_values",
    "producer_checkpoint",
    "scale_tensor_name",
    "write_checkpoint",
    "write_hf_cache_entry",
]
