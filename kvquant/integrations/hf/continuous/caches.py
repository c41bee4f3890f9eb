"""kvquant's subclasses of transformers' ``PagedAttentionCache`` (5.17 block groups, 5.24 cache
allocators) and the factory that stands for transformers' class while a patched model batches."""

from __future__ import annotations

import logging
import math
import threading
import weakref
from functools import cache
from typing import Any

import torch

from kvquant.errors import (
    BatchingError,
    OptionError,
    UnsupportedModelError,
)
from kvquant.integrations.hf.compat import batching_flavour
from kvquant.integrations.hf.continuous.layout import (
    ALIGN,
    BATCH_KWARG,
    FULL_ATTENTION,
    BlockLayout,
    layout_for,
)
from kvquant.integrations.hf.continuous.storage import (
    LIVE_CACHES,
    BatchingStorage,
    allocate_buffer,
    plan_blocks,
)

__all__ = [
    "VERSION_MESSAGE",
    "install_factory",
    "is_batching_cache",
    "refuse_sliding",
    "register_config",
    "unregister_config",
]

_logger = logging.getLogger("kvquant")


# ---------------------------------------------------------------------- transformers adapters


_registry: dict[int, tuple[weakref.ref[Any], weakref.ref[Any]]] = {}
_registry_lock = threading.Lock()


def register_config(config: Any, state: Any) -> None:
    with _registry_lock:
        _registry[id(config)] = (weakref.ref(config), weakref.ref(state))


def unregister_config(config: Any) -> None:
    with _registry_lock:
        entry = _registry.get(id(config))
        if entry is not None and entry[0]() is config:
            del _registry[id(config)]
        for key, (cfg, st) in list(_registry.items()):
            if cfg() is None or st() is None:
                del _registry[key]
        if not _registry:
            _uninstall_factory()


def _state_for(config: Any) -> Any:
    with _registry_lock:
        entry = _registry.get(id(config))
    if entry is None or entry[0]() is not config:
        return None
    state = entry[1]()
    handle = getattr(state, "handle", None)
    return state if handle is not None and handle.active else None


class _CacheFactory:
    """Stands for ``PagedAttentionCache`` in transformers' ``continuous_api`` module (module docstring):
    kvquant's cache for the config of a patched model, transformers' own for any other."""

    def __init__(self, original: type) -> None:
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("config", args[0] if args else None)
        state = _state_for(config)
        if state is None:
            return self.original(*args, **kwargs)
        return _cache_class()(*args, **kwargs)


def install_factory() -> None:
    from transformers.generation.continuous_batching import continuous_api

    current = continuous_api.PagedAttentionCache
    if not isinstance(current, _CacheFactory):
        continuous_api.PagedAttentionCache = _CacheFactory(current)  # type: ignore[misc, assignment]


def _uninstall_factory() -> None:
    try:
        from transformers.generation.continuous_batching import continuous_api
    except ImportError:  # pragma: no cover - installed only where it imports
        return
    current = continuous_api.PagedAttentionCache
    if isinstance(current, _CacheFactory):
        continuous_api.PagedAttentionCache = current.original  # type: ignore[misc, assignment]


def _specs_and_backend(config: Any) -> tuple[list[Any], str, bool]:
    """The patch's layer specs, backend, and whether its ``recent_tokens`` is ``"auto"``."""
    state = _state_for(config)
    if state is None:  # pragma: no cover - the factory checked
        raise BatchingError("kvquant's batching cache was built for a model that is not patched.")
    return list(state.layer_specs), str(state.options.backend), state.options.recent_auto


def _refuse_tp(helper: Any) -> None:
    if getattr(helper, "tp_size", 1) > 1:
        raise UnsupportedModelError(
            "kvquant's continuous-batching cache runs on one device; this model is sharded "
            f"over {helper.tp_size} ranks (tensor parallelism). Fix: load the model on one "
            "device, or handle.remove() for transformers' own batching."
        )


@cache
def _cache_class() -> type:
    """kvquant's subclass of this transformers' ``PagedAttentionCache``."""
    kind = batching_flavour()
    if kind == "allocators":
        return _allocator_cache_class()
    if kind == "groups":
        return _group_cache_class()
    raise UnsupportedModelError(VERSION_MESSAGE)  # pragma: no cover - checked before


VERSION_MESSAGE = (
    "kvquant's continuous batching knows the batching caches of transformers 5.17 and 5.24; "
    "this transformers lays its cache out otherwise. Fix: install transformers 5.17 or 5.24, "
    "or run generate() per request (kvquant's cache serves it)."
)


def refuse_sliding(groups: Any) -> None:
    kinds = sorted(set(groups))
    if kinds != [FULL_ATTENTION]:
        raise UnsupportedModelError(
            f"kvquant's continuous-batching cache serves full-attention layers only; this "
            f"model's layers are {kinds} (sliding-window layers keep a ring of blocks kvquant "
            "does not manage). Fix: run generate() per request (kvquant's cache serves "
            "sliding windows there), or handle.remove() for transformers' own batching."
        )


@cache
def _block_allocator_class() -> type:
    """transformers 5.24: a full-attention cache allocator over kvquant's blocks."""
    from transformers.generation.continuous_batching.cache_allocators import (
        FullAttentionCacheAllocator,
    )

    class FP8BlockAllocator(FullAttentionCacheAllocator):  # type: ignore[misc, valid-type]
        """Full-attention allocator whose indices are kvquant slots and page ids.

        Write indices are slots (``block * page_size + offset``); read indices are
        one page id per page of the request (the block table), not one index per
        token: kvquant's kernels read the pages, nothing is gathered.
        """

        def __init__(
            self, index: int, layer_indices: list[int], layout: BlockLayout, sharing: bool
        ) -> None:
            self.head_dim = layout.head_dim
            self.num_key_value_heads = layout.num_kv_heads
            self.cache_dtype = torch.uint8
            self._before_cache_tensor_init(
                index=index,
                layer_indices=layer_indices,
                tokens_per_page=layout.page_size,
                bytes_per_page=layout.bytes_per_block // len(layer_indices),
                allow_block_sharing=sharing,
            )

        def register_cache_tensor(
            self, bytes_per_sector: int, non_trash_bytes: int, cache_tensor: Any, pool: Any
        ) -> None:
            self.bytes_per_sector = bytes_per_sector
            self._copy_view = cache_tensor.view(-1, self.bytes_per_block)
            self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, cache_tensor, pool)
            self.read_trash_index = 0
            # the write-trash sector's first slot (transformers never allocates it)
            self.write_trash_index = self.blocks_per_sector * self.tokens_per_page

        def _table(self, request_id: str) -> list[int]:
            table = self.block_table.get(request_id)
            if table is None:
                raise ValueError(f"No block table found for request {request_id}")
            return table

        def get_read_indices(self, request_id: str, past_length: int, query_length: int) -> Any:
            pages = -(-(past_length + query_length) // self.tokens_per_page)
            return self._table(request_id)[:pages]

        def get_write_indices(self, request_id: str, past_length: int, query_length: int) -> Any:
            table, ps = self._table(request_id), self.tokens_per_page
            return [
                table[p // ps] * ps + p % ps for p in range(past_length, past_length + query_length)
            ]

        def fill_block_table(
            self, request_id: str, past_length: int, query_length: int, block_table: Any
        ) -> None:
            ids = self._table(request_id)
            block_table[: len(ids)].copy_(torch.tensor(ids, dtype=block_table.dtype))

        def update(self, *args: Any, **kwargs: Any) -> Any:
            raise BatchingError(_READ_ONLY_MESSAGE)

        def get_cache_for_block_table(self, layer_idx: int) -> Any:
            raise BatchingError(_READ_ONLY_MESSAGE)

    return FP8BlockAllocator


def _allocator_cache_class() -> type:
    """transformers 5.24: the batching cache over kvquant's blocks, with their allocator."""
    from transformers.generation.continuous_batching import cache as cbc
    from transformers.generation.continuous_batching.cache_allocators import CachePool

    block_allocator = _block_allocator_class()

    class KVQuantBatchingCache(cbc.PagedAttentionCache):  # type: ignore[misc, valid-type]
        """transformers 5.24's batching cache over kvquant's blocks (module docstring)."""

        def __init__(
            self,
            config: Any,
            continuous_batching_config: Any,
            device: Any,
            distributed_helper: Any,
            dtype: torch.dtype = torch.float16,
            model_supports_logits_to_keep: bool = False,
        ) -> None:
            cb = continuous_batching_config
            specs, backend, auto_recent = _specs_and_backend(config)
            _refuse_tp(distributed_helper)
            groups = cbc.group_layers_by_attn_type(config)
            refuse_sliding(groups)
            layers = groups[FULL_ATTENTION]
            self.config, self.dtype, self.device = config, dtype, device
            # transformers' decode path: its block table of each request's blocks
            self.max_blocks_per_request = int(cb.max_blocks_per_request or 0)
            layout = layout_for(specs, int(cb.page_size), dtype, auto_recent)
            allocator = block_allocator(0, layers, layout, bool(cb.allow_block_sharing))
            self.cache_allocators = {FULL_ATTENTION: allocator}
            self.layer_to_allocator = dict.fromkeys(layers, allocator)
            self.bytes_per_sector = math.lcm(allocator.bytes_per_block, ALIGN)
            blocks_per_sector = self.bytes_per_sector // allocator.bytes_per_block
            self.tokens_per_sector = blocks_per_sector * layout.page_size
            tokens, blocks = plan_blocks(cb, config, layout, dtype, model_supports_logits_to_keep)
            self.max_batch_tokens = tokens
            self.num_sectors = max(1, blocks // blocks_per_sector)
            non_trash = self.num_sectors * self.bytes_per_sector
            self.cache_tensor = allocate_buffer(non_trash + 2 * self.bytes_per_sector, device)
            self.pool = CachePool(self.num_sectors, 1)
            allocator.register_cache_tensor(
                self.bytes_per_sector, non_trash, self.cache_tensor, self.pool
            )
            self.allow_block_sharing = bool(cb.allow_block_sharing)
            self.use_prefix_sharing = allocator.use_block_sharing and self.allow_block_sharing
            self.num_blocks = non_trash // allocator.bytes_per_block
            self.read_cache_limit = None
            self.max_decode_fast_path_length = layout.page_size * self.max_blocks_per_request
            self.max_tokens_read = allocator.tokens_per_page * allocator.num_blocks
            total_blocks = (self.num_sectors + 2) * blocks_per_sector
            trash = allocator.write_trash_index // layout.page_size
            self.kvq = BatchingStorage(
                self.cache_tensor, layout, specs, total_blocks, backend, trash_block=trash
            )
            LIVE_CACHES.add(self)
            _logger.info(
                "kvquant: continuous-batching cache of %d %s blocks of %d tokens (%d bytes)%s, "
                "%d tokens per step",
                self.num_blocks,
                layout.pages_name,
                layout.page_size,
                non_trash,
                layout.ring_note,
                tokens,
            )

        @torch.compiler.disable
        def update(
            self,
            key_states: torch.Tensor,
            value_states: torch.Tensor,
            layer_idx: int,
            kwargs: dict[str, Any],
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """Store the layer's new K/V in its pages; hand kvquant's attention the layer's step."""
            kwargs[BATCH_KWARG] = self.kvq.write(layer_idx, key_states, value_states)
            return key_states, value_states

    return KVQuantBatchingCache


_READ_ONLY_MESSAGE = (
    "kvquant's continuous-batching cache holds quantized pages that only kvquant's attention reads; "
    "another attention implementation was switched on while it runs. Fix: leave the attention "
    "implementation as kvquant.patch set it while the manager runs."
)


def _group_cache_class() -> type:
    """transformers 5.17: the batching cache (one layer group of full attention) over kvquant's blocks."""
    from transformers.generation.continuous_batching import cache as cbc
    from transformers.generation.continuous_batching.cache_manager import (
        FullAttentionCacheAllocator,
    )

    class FP8GroupAllocator(FullAttentionCacheAllocator):  # type: ignore[misc, valid-type]
        """Its write indices are already kvquant slots; its read indices become page ids."""

        def get_read_indices(self, request_id: str, past_length: int, query_length: int) -> Any:
            table = self.block_table.get(request_id)
            if table is None:
                raise ValueError(f"No block table found for request {request_id}")
            return table[: -(-(past_length + query_length) // self.block_size)]

    class KVQuantBatchingCache(cbc.PagedAttentionCache):  # type: ignore[misc, valid-type]
        """transformers 5.17's batching cache over kvquant's blocks (module docstring)."""

        def __init__(
            self,
            config: Any,
            continuous_batching_config: Any,
            device: Any,
            distributed_helper: Any,
            tp_plan: Any,
            dtype: torch.dtype = torch.float16,
        ) -> None:
            cb = continuous_batching_config
            specs, backend, auto_recent = _specs_and_backend(config)
            _refuse_tp(distributed_helper)
            layer_groups, group_types = cbc.group_layers_by_attn_type(config)
            refuse_sliding(group_types)
            self.config, self.dtype, self.device = config, dtype, device
            layout = layout_for(specs, int(cb.block_size), dtype, auto_recent)
            self.num_key_value_heads, self.head_dim = layout.num_kv_heads, layout.head_dim
            self.block_size = layout.page_size
            least = int(getattr(cbc.PagedAttentionCache, "_min_block_size", 4))
            if self.block_size < least:
                raise OptionError(
                    f"ContinuousBatchingConfig(block_size={self.block_size}); transformers needs "
                    f"at least {least}. Fix: block_size=16 or more."
                )
            self.num_groups = 1
            self.sliding_windows = dict.fromkeys(layer_groups[0], 1)
            self.layer_index_to_group_indices = {
                layer: (0, j) for j, layer in enumerate(layer_groups[0])
            }
            tokens, blocks = plan_blocks(cb, config, layout, dtype)
            self.max_batch_tokens, self.num_blocks = tokens, blocks
            self.num_pages = blocks * self.block_size
            total = blocks + 2  # transformers' read and write trash blocks come last
            self.kvq_buffer = allocate_buffer(total * layout.bytes_per_block, device)
            self.cache_shape = (total * self.block_size, layout.num_kv_heads, layout.head_dim)
            self.read_trash_index = blocks * self.block_size
            self.sentinel_index = self.read_trash_index + 1
            self.write_trash_index = (blocks + 1) * self.block_size
            self.kvq = BatchingStorage(self.kvq_buffer, layout, specs, total, backend)
            # transformers counts layers through these (its CPU offloading, refused here, reads them)
            self.key_cache = [s.k_pages for s in self.kvq.layers]
            self.value_cache = [s.v_pages for s in self.kvq.layers]
            self.allow_block_sharing = bool(cb.allow_block_sharing)
            self.group_cache_managers = [
                FP8GroupAllocator(0, self.block_size, allow_block_sharing=self.allow_block_sharing)
            ]
            self.num_full_attention_groups = 1
            self.num_sliding_attention_groups = 0
            self.max_sliding_window_blocks_per_request = 0
            cb.max_blocks_per_request = 0
            self.max_blocks_per_request = 0
            self.use_prefix_sharing = self.allow_block_sharing
            self._block_manager = cbc.BlockManager(  # type: ignore[attr-defined]  # 5.17
                blocks, self.block_size, tp_on=False
            )
            self._total_prefix_length = 0
            self._block_table_key = None  # type: ignore[assignment]
            LIVE_CACHES.add(self)
            _logger.info(
                "kvquant: continuous-batching cache of %d %s blocks of %d tokens (%d bytes)%s, "
                "%d tokens per step",
                blocks,
                layout.pages_name,
                self.block_size,
                total * layout.bytes_per_block,
                layout.ring_note,
                tokens,
            )

        def copy_cache(self, list_source_blocks: list[int], list_forked_blocks: list[int]) -> None:
            """Copy whole blocks (every layer's pages and scales) for forked requests."""
            rows = self.kvq_buffer.view(-1, self.kvq.layout.bytes_per_block)
            src = torch.tensor(list_source_blocks, dtype=torch.long, device=rows.device)
            dst = torch.tensor(list_forked_blocks, dtype=torch.long, device=rows.device)
            rows.index_copy_(0, dst, rows.index_select(0, src))

        def update(self, *args: Any, **kwargs: Any) -> Any:
            raise BatchingError(_READ_ONLY_MESSAGE)

    return KVQuantBatchingCache


def is_batching_cache(obj: Any) -> bool:
    """Whether ``obj`` is one of kvquant's continuous-batching caches."""
    return isinstance(getattr(obj, "kvq", None), BatchingStorage)
