"""``kvquant serve MODEL``: transformers' OpenAI-compatible server over kvquant's FP8 cache.

``transformers serve`` loads its model itself, from a name or a folder, and has
no way to take a patched model or kvquant's quantization config (its
``--quantization`` knows bitsandbytes only). ``kvquant serve`` runs that same
server (transformers' ``Serve``: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, ``/health``) with continuous batching on, and applies
:func:`kvquant.patch` to the model the server loads, before it serves anything:
every request runs on kvquant's FP8 pages (:mod:`kvquant.integrations.hf.continuous`).

The server needs transformers' serving extras (FastAPI, Uvicorn, pydantic, the
``openai`` package): ``pip install "transformers[serving]"``.
"""

from __future__ import annotations

from typing import Any

from kvquant.errors import BackendError

__all__ = ["serve"]


def serve(
    model: str,
    *,
    host: str = "localhost",
    port: int = 8000,
    device: str = "auto",
    dtype: str = "auto",
    scales: str | None = None,
    scale_format: str = "auto",
    missing_scales: str = "dynamic",
    backend: str = "auto",
    page_size: int | None = None,
    num_blocks: int | None = None,
    max_batch_tokens: int | None = None,
    max_memory_percent: float | None = None,
    log_level: str = "warning",
    non_blocking: bool = False,
) -> Any:
    """Run transformers' server for ``model`` with continuous batching on kvquant's FP8 cache.

    Args:
        model: a checkpoint folder or a hub id (the server loads it, as
            ``transformers serve MODEL`` does; local files only when offline).
        host: address to listen on (``localhost``; ``0.0.0.0`` for every interface).
        port: port to listen on.
        device: where to load the model (``auto``, ``cpu``, ``cuda:0``, ...).
        dtype: the model's dtype (``auto``: the checkpoint's).
        scales: where the KV scales come from (a checkpoint folder), as
            :func:`kvquant.patch`'s ``scales``; None: the model's own checkpoint.
        scale_format: :func:`kvquant.patch`'s ``scale_format``.
        missing_scales: :func:`kvquant.patch`'s ``missing_scales``.
        backend: kernel backend (``auto``: Triton on CUDA, the torch reference on CPU).
        page_size: tokens per block of the batching cache (transformers' default: 256).
        num_blocks: the cache's budget, in blocks of the model's dtype (the FP8
            cache holds about twice as many); None: sized from free memory.
        max_batch_tokens: tokens per batching step.
        max_memory_percent: the share of free device memory the cache may take.
        log_level: transformers' log level.
        non_blocking: return once the server listens, serving from a thread
            (``server.kill_server()`` stops it); else block until it stops.

    Returns:
        transformers' ``Serve`` object.

    Raises:
        BackendError: transformers' serving extras are not installed.
        KVQuantError: :func:`kvquant.patch` refused the model or its scales.
    """
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise BackendError(
            "kvquant serve runs transformers' server, which needs FastAPI, Uvicorn, pydantic and "
            'the openai package. Fix: pip install "transformers[serving]".'
        )
    from transformers.cli.serve import Serve
    from transformers.cli.serving import model_manager

    from kvquant.integrations.hf import patch

    options: dict[str, Any] = {
        "scales": scales,
        "scale_format": scale_format,
        "missing_scales": missing_scales,
        "backend": backend,
    }
    manager_cls: Any = model_manager.ModelManager
    original = manager_cls._load_model

    def load_patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        # The server preloads its one model (force_model) while it is built: patched here,
        # then transformers' loader is put back.
        manager_cls._load_model = original
        loaded = original(self, *args, **kwargs)
        patch(loaded, **options)
        return loaded

    manager_cls._load_model = load_patched
    cb: dict[str, Any] = {
        "cb_block_size": page_size,
        "cb_num_blocks": num_blocks,
        "cb_max_batch_tokens": max_batch_tokens,
        "cb_max_memory_percent": max_memory_percent,
    }
    try:
        return Serve(
            force_model=model,
            continuous_batching=True,
            device=device,
            dtype=dtype,
            host=host,
            port=port,
            log_level=log_level,
            non_blocking=non_blocking,
            **{k: v for k, v in cb.items() if v is not None},
        )
    finally:
        if manager_cls._load_model is load_patched:
            manager_cls._load_model = original
