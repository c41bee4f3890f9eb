"""``kvquant serve MODEL``: transformers' OpenAI-compatible server over kvquant's FP8 cache.

``transformers serve`` loads its model itself, from a name or a folder, and has
no way to take a patched model or kvquant's quantization config (its
``--quantization`` knows bitsandbytes only). ``kvquant serve`` runs that same
server (transformers' ``Serve``: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, ``/health``) with continuous batching on, and applies
:func:`kvquant.patch` to the model the server loads, before it serves anything:
every request runs on kvquant's FP8 pages, or 4-bit ones with ``kv_format``
(:mod:`kvquant.integrations.hf.continuous`).
From transformers 5.25 on the server loads its model in a process of its own; the model is
patched there (:mod:`kvquant.integrations.hf.serving`).

The server needs transformers' serving extras (FastAPI, Uvicorn, pydantic, the
``openai`` package): ``pip install "transformers[serving]"``.
"""

from __future__ import annotations

import re
from typing import Any

from kvquant import errors
from kvquant.errors import BackendError, OptionError

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
    kv_format: str = "fp8",
    recent_tokens: int | str = "auto",
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
        kv_format: :func:`kvquant.patch`'s ``kv_format`` (``fp8``, or a 4-bit format:
            ``nvfp4``, ``mxfp4``, ``fp8-k-nvfp4-v``).
        recent_tokens: :func:`kvquant.patch`'s ``recent_tokens`` (``"auto"``: none, as
            every block would keep a ring; a count must divide the page size).
        page_size: tokens per block of the batching cache (transformers' default: 256).
        num_blocks: the cache's budget, in blocks of the model's dtype (the FP8
            cache holds about twice as many); None: sized from free memory.
        max_batch_tokens: tokens per batching step.
        max_memory_percent: the share of free device memory the cache may take.
        log_level: transformers' log level.
        non_blocking: return once the server listens, serving from a thread
            (``server.kill_server()`` stops it); else block until it stops. transformers
            5.25's server cannot run from a thread: there it is refused.

    Returns:
        transformers' ``Serve`` object.

    Raises:
        BackendError: transformers' serving extras are not installed.
        OptionError: ``non_blocking=True`` with transformers 5.25.
        KVQuantError: :func:`kvquant.patch` refused the model or its scales (from 5.25 on
            it patches the model in the process transformers loads it in, and its error is
            raised here again).
    """
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise BackendError(
            "kvquant serve runs transformers' server, which needs FastAPI, Uvicorn, pydantic and "
            'the openai package. Fix: pip install "transformers[serving]".'
        )
    from kvquant.integrations.hf import compat

    options: dict[str, Any] = {
        "scales": scales,
        "scale_format": scale_format,
        "missing_scales": missing_scales,
        "backend": backend,
        "kv_format": kv_format,
        "recent_tokens": recent_tokens,
    }
    settings: dict[str, Any] = {
        "force_model": model,
        "continuous_batching": True,
        "device": device,
        "dtype": dtype,
        "host": host,
        "port": port,
        "log_level": log_level,
    }
    cb: dict[str, Any] = {
        "cb_block_size": page_size,
        "cb_num_blocks": num_blocks,
        "cb_max_batch_tokens": max_batch_tokens,
        "cb_max_memory_percent": max_memory_percent,
    }
    settings.update({k: v for k, v in cb.items() if v is not None})
    if compat.serve_loads_in_engine_process():
        return _serve_from_engine_process(settings, options, non_blocking)
    return _serve_in_process(settings, options, non_blocking)


def _serve_from_engine_process(
    settings: dict[str, Any], options: dict[str, Any], non_blocking: bool
) -> Any:
    """transformers 5.25 on: the server loads its model in a process of its own, patched there
    by the loader it is handed; the server always blocks."""

    if non_blocking:
        raise OptionError(
            "kvquant serve: non_blocking=True needs transformers < 5.25, whose server can run "
            "from a thread; the installed release's server runs in the calling thread until it "
            "stops. Fix: run the server in a process of its own (python -m kvquant serve MODEL, "
            "or multiprocessing), or call serve(...) without non_blocking."
        )
    from kvquant.integrations.hf.serving import PatchingServe

    try:
        return PatchingServe(patch_options=options, **settings)
    except RuntimeError as exc:  # the model's process reports a failed load as a RuntimeError
        reraise_from_model_process(exc)
        raise


def _serve_in_process(settings: dict[str, Any], options: dict[str, Any], non_blocking: bool) -> Any:
    """transformers 5.17 to 5.24: the server loads its model in its own process, through
    ``ModelManager._load_model``, wrapped here for that one load."""
    from transformers.cli import serve as hf_serve
    from transformers.cli.serving import model_manager

    from kvquant.integrations.hf import patch

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
    try:
        serve_cls: Any = hf_serve.Serve  # its keywords differ between releases
        return serve_cls(non_blocking=non_blocking, **settings)
    finally:
        if manager_cls._load_model is load_patched:
            manager_cls._load_model = original


_CHILD_ERROR = re.compile(r"^([A-Za-z]+Error): (.*)$", re.DOTALL)


def reraise_from_model_process(exc: RuntimeError) -> None:
    """Raise the kvquant error the model's process reported, if ``exc`` carries one.

    The engine reports a failed load as ``RuntimeError("<ErrorClass>: <message>")``; when the
    class is one of kvquant's (the patch refused the model or its scales), the same error is
    raised here, in the caller's process, from ``exc``. Anything else returns.
    """
    found = _CHILD_ERROR.match(str(exc))
    if found is None or found.group(1) not in errors.__all__:
        return
    cls = getattr(errors, found.group(1))
    raise cls(found.group(2)) from exc
