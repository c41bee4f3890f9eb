"""Device memory helpers of the caches: what the device can still hand out, returning torch's
unused blocks after a growth, cuBLAS's per-stream workspaces, and a storage's byte count."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvquant.cache.storage import PagedLayerStorage

__all__ = [
    "device_free_bytes",
    "release_cached_blocks",
    "release_library_workspaces",
    "total_memory_bytes",
]


def device_free_bytes(device: torch.device) -> int | None:
    """Bytes PyTorch can still allocate on a CUDA ``device``; None elsewhere.

    The driver's free memory plus what PyTorch's caching allocator holds but
    does not use, capped by ``torch.cuda.set_per_process_memory_fraction``.
    A sizing hint (fragmentation can make less usable): a cache that relies
    on it still handles an out-of-memory error.
    """
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    avail = free + torch.cuda.memory_reserved(device) - allocated
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is not None:
        fraction = float(get_fraction(device))
        if fraction < 1.0:
            avail = min(avail, int(fraction * total) - allocated)
    return max(0, avail)


def release_cached_blocks(device: torch.device | None) -> None:
    """Return the caching allocator's unused blocks to a CUDA ``device`` (no-op elsewhere).

    For a pool that grew: torch keeps the old page tensors' blocks cached, the
    next forward's activations split them, and one long-lived tensor placed in
    such a block keeps all of it from being released, so a later, larger pool
    fails for want of contiguous memory while enough is free. Released at once,
    the old blocks cannot be split.
    """
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


def total_memory_bytes(storages: Iterable[PagedLayerStorage]) -> dict[str, int]:
    """:meth:`PagedLayerStorage.memory_bytes` summed over ``storages`` (same keys)."""
    keys = ("pages", "group_scales", "recent", "static_scales", "k_transform", "total")
    total = dict.fromkeys(keys, 0)
    for storage in storages:
        for key, value in storage.memory_bytes().items():
            total[key] += value
    return total


def release_library_workspaces() -> None:
    """Free the per-stream workspaces cuBLAS keeps (the warm-up stream's too), after a sync.

    For ``remove()`` of a patch that captured decode graphs: the warm-up stream's
    workspaces would otherwise stay allocated for the life of the process. cuBLAS
    allocates them again at its next call on a stream. No-op where torch has no
    such function or CUDA was never initialised.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize()
    clear()
