"""Paged FP8 KV storage: a page allocator, a batch's bookkeeping, per-layer page tensors.

:class:`PageAllocator` (:mod:`.allocator`) hands out pages and turns new tokens into slots,
block tables and lengths; :class:`SequenceBook` (:mod:`.book`) owns one batch's bookkeeping on
top of it; :class:`PagedLayerStorage` (:mod:`.storage`, a class per scheme) is one layer's FP8 pages with their
scales and the kernel calls on them; :mod:`.device` measures and releases device memory.
Layout as in :mod:`kvquant.kernels`; imports torch and the kernels only. Design: ``docs/dev/cache.md``.
"""

from __future__ import annotations

from kvquant.cache.allocator import MAX_PAGE_SIZE, MAX_PAGES, PageAllocator
from kvquant.cache.book import SequenceBook, StaticStep
from kvquant.cache.device import (
    device_free_bytes,
    release_cached_blocks,
    release_library_workspaces,
    total_memory_bytes,
)
from kvquant.cache.storage import GRANULARITIES, ORTHONORMAL_TOL, PagedLayerStorage
from kvquant.types import MAX_FIRST_TOKENS

__all__ = [
    "GRANULARITIES",
    "MAX_FIRST_TOKENS",
    "MAX_PAGES",
    "MAX_PAGE_SIZE",
    "ORTHONORMAL_TOL",
    "PageAllocator",
    "PagedLayerStorage",
    "SequenceBook",
    "StaticStep",
    "device_free_bytes",
    "release_cached_blocks",
    "release_library_workspaces",
    "total_memory_bytes",
]
