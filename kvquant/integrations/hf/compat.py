"""What differs between the transformers releases kvquant supports (5.17 to 5.25), decided here.

Every other module of the integration asks this one instead of testing a version, a
signature or an attribute itself: the keyword a forward takes its cache under, the
cache compressed-tensors wraps, what ``DynamicCache.crop(n)`` means for a positive ``n``,
which continuous-batching cache code is installed and the names of its config and helpers,
where transformers' server loads its model.
Each function says which release does what. Imports torch and transformers only; design:
docs/dev/patch.md (transformers versions).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

import transformers
from torch import nn

__all__ = [
    "CACHE_KEYWORDS",
    "POSITIVE_CROP_KEEPS",
    "BatchingFlavour",
    "batching_attention_by_name",
    "batching_flavour",
    "batching_page_size",
    "cache_argument",
    "cache_keyword",
    "call_cache",
    "full_attention_groups",
    "memory_breakdown",
    "serve_loads_in_engine_process",
    "swaps_batching_caches_to_cpu",
    "unwrap_cache",
]

CACHE_KEYWORDS = ("cache", "past_key_values")
"""The keywords a model's ``forward`` takes its cache under: ``cache`` (5.24; ``generate``'s
``past_key_values=`` still reaches it) and ``past_key_values`` (5.17), the newer first."""

POSITIVE_CROP_KEEPS = tuple(int(n) for n in re.findall(r"\d+", transformers.__version__)[:2]) < (
    5,
    18,
)
"""Whether the installed transformers' ``DynamicCache.crop(n)`` takes ``n > 0`` as "keep the
first ``n``" (5.17, deprecated there); from 5.18 on it refuses a positive ``n``."""

BatchingFlavour = Literal["allocators", "groups"]
"""The continuous-batching cache code: ``"allocators"`` (5.24: one cache allocator per layer
group, ``ContinuousBatchingConfig.page_size``) or ``"groups"`` (5.17: layer groups of a
``BlockManager``, ``block_size``, a CPU swap pool)."""


def cache_keyword(module: nn.Module) -> str:
    """The keyword ``module.forward`` takes its cache under: ``"cache"`` (transformers 5.24) or
    ``"past_key_values"`` (5.17)."""
    params = inspect.signature(type(module).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_argument(kwargs: Mapping[str, Any]) -> tuple[str | None, Any]:
    """The call's cache keyword (``cache`` on 5.24, ``past_key_values`` on 5.17; None when the
    call names neither) and the object it passes there."""
    key = next((n for n in CACHE_KEYWORDS if n in kwargs), None)
    return key, (kwargs.get(key) if key else None)


def call_cache(kwargs: Mapping[str, Any]) -> Any:
    """The cache a forward's keywords pass: under ``cache`` (5.24) if the call names it, else
    under ``past_key_values`` (5.17), else None."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


def unwrap_cache(obj: Any) -> Any:
    """The cache behind compressed-tensors' ``QuantizedKVCache`` (an ``nn.Module`` whose
    ``past_key_values()`` returns it: what a compressed-tensors model's attention gets on
    transformers 5.17), else ``obj`` itself (5.24 hands the cache as it is)."""
    if obj is None or not isinstance(obj, nn.Module):
        return obj
    inner = getattr(obj, "past_key_values", None)
    if callable(inner):
        try:
            return inner()
        except TypeError:
            return obj
    return obj


def batching_flavour() -> BatchingFlavour | None:
    """Which continuous-batching cache code this transformers has (:data:`BatchingFlavour`),
    told by ``PagedAttentionCache.__init__``'s parameters and the module's classes; None: a
    layout kvquant does not know (another release)."""
    try:
        from transformers.generation.continuous_batching import cache as cbc
    except ImportError:
        return None
    params = list(inspect.signature(cbc.PagedAttentionCache.__init__).parameters)
    known = ["self", "config", "continuous_batching_config", "device", "distributed_helper"]
    if params == [*known, "dtype", "model_supports_logits_to_keep"] and hasattr(
        cbc, "ATTN_TYPE_TO_ALLOCATOR"
    ):
        return "allocators"
    if params == [*known, "tp_plan", "dtype"] and hasattr(cbc, "BlockManager"):
        return "groups"
    return None


def batching_page_size(cb_config: Any, kind: BatchingFlavour) -> int | None:
    """Tokens per block a ``ContinuousBatchingConfig`` asks for: ``page_size`` (5.24) or
    ``block_size`` (5.17); None when it leaves the default."""
    page = getattr(cb_config, "page_size" if kind == "allocators" else "block_size", None)
    return None if page is None else int(page)


def full_attention_groups(groups: Any, kind: BatchingFlavour) -> Any:
    """The attention type of each layer group from ``group_layers_by_attn_type``: its whole
    result (5.24) or its second item (5.17 returns ``(groups, types)``)."""
    return groups if kind == "allocators" else groups[1]


def batching_attention_by_name(kind: BatchingFlavour) -> bool:
    """Whether continuous batching runs a ``paged|<name>`` attention function handed the
    batching cache, which the manager switches back from when it stops (5.17); 5.24 keeps the
    model's attention (presented as ``paged|eager``) and adds the cache's step to its call."""
    return kind == "groups"


def swaps_batching_caches_to_cpu(kind: BatchingFlavour) -> bool:
    """Whether ``ContinuousBatchingConfig.cpu_offload_space`` swaps requests' caches to a CPU
    pool in the model's dtype (5.17; 5.24 recomputes requests that do not fit instead)."""
    return kind == "groups"


def memory_breakdown() -> Callable[[], Any]:
    """transformers' ``get_device_and_memory_breakdown``: in ``continuous_batching.utils``
    (5.24) or ``continuous_batching.requests`` (5.17)."""
    try:
        from transformers.generation.continuous_batching.utils import (
            get_device_and_memory_breakdown,
        )
    except ImportError:  # transformers 5.17
        from transformers.generation.continuous_batching.requests import (  # type: ignore[no-redef]
            get_device_and_memory_breakdown,
        )
    return get_device_and_memory_breakdown


def serve_loads_in_engine_process() -> bool:
    """Whether transformers' server loads its model in a spawned process of its own, through a
    pickled ``ModelLoader``, and runs blocking with no ``non_blocking`` (5.25), rather than in
    the server's process through ``ModelManager._load_model`` (5.17, 5.24). Needs the serving
    extras."""
    from transformers.cli.serving import model_manager

    return hasattr(model_manager, "ModelLoader")
