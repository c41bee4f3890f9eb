"""Hugging Face transformers integration: the only kvquant code that imports transformers.

Public names:

* :func:`patch` — give a loaded model kvquant's FP8 paged KV cache;
* :class:`KVQuantConfig` — ``from_pretrained(..., quantization_config=KVQuantConfig())``;
* :func:`from_pretrained` — the same, also for KV-only compressed-tensors / Quark checkpoints;
* :class:`KVQuantCache` — an explicit cache object (``cache=`` / ``past_key_values=``);
* :class:`KVQuantHandle` — what :func:`patch` returns (``remove()``).
"""

from __future__ import annotations

from kvquant.integrations.hf.cache_layer import KVQuantCache, KVQuantLayer
from kvquant.integrations.hf.models import SUPPORTED_FAMILIES
from kvquant.integrations.hf.patch import KVQuantHandle, patch
from kvquant.integrations.hf.quantizer import KVQuantConfig, KVQuantizer, from_pretrained

__all__ = [
    "SUPPORTED_FAMILIES",
    "KVQuantCache",
    "KVQuantConfig",
    "KVQuantHandle",
    "KVQuantLayer",
    "KVQuantizer",
    "from_pretrained",
    "patch",
]
