"""Intel auto-round's NVFP4 KV export: known for its 4-bit layout only, not detected yet.

By its pull-request text (intel/auto-round PR #2366) it stores ``self_attn.k_global_scale`` /
``v_global_scale`` as ``amax / (6 * 448)`` through its llm-compressor exporter: compressed-
tensors' names holding the reciprocal number, so a checkpoint cannot be told apart by its
names. Its ``quant_method`` is not confirmed on a real export, so discovery never decides it
(it is not in :data:`~kvquant.checkpoint.producers.PRODUCERS`); :mod:`kvquant.registry.fp4`
reads its global scales when it is named, and only with an explicit ``convention=``.
Sources: docs/dev/fp4-formats.md.
"""

from __future__ import annotations

from kvquant.checkpoint.fp4_formats import Fp4Producer
from kvquant.checkpoint.producers.base import GLOBAL_SCALE, Producer

__all__ = ["AutoRound"]


class AutoRound(Producer):
    """auto-round's NVFP4 KV global scales (read only when named; never written)."""

    name = "auto-round"
    names = GLOBAL_SCALE
    owns_names = False
    writable = False
    fp4 = Fp4Producer(
        name,
        "amax/(6*448)",
        (GLOBAL_SCALE.suffixes["k"],),
        (GLOBAL_SCALE.suffixes["v"],),
        confirmed=False,
    )
