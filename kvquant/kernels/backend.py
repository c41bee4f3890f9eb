"""Backend resolution for kvquant's kernel entry points.

Three backends exist:

* ``"torch"``: the pure-PyTorch reference; always available, on any device.
* ``"triton"``: the Triton kernels. Runs on CUDA tensors, or on CPU tensors
  when ``TRITON_INTERPRET=1`` is set before kvquant's Triton kernels are first
  imported.
* ``"auto"``: ``"triton"`` when the tensors are on CUDA and Triton is
  importable, ``"torch"`` otherwise (logged once per operation and device type).

Triton is imported on first use only (:func:`triton_available`), never at
import time. Design: docs/dev/backends.md.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Literal

import torch

from kvquant.choices import Backend
from kvquant.errors import BackendError

__all__ = [
    "BACKENDS",
    "Backend",
    "forget_auto_choices",
    "interpreter_requested",
    "resolve_backend",
    "triton_available",
]

BACKENDS: tuple[str, ...] = Backend.values()
"""The accepted backend names (:class:`~kvquant.choices.Backend`'s words)."""

_logger = logging.getLogger("kvquant")
_logged: set[tuple[str, str, str]] = set()


def forget_auto_choices() -> None:
    """Forget which ``backend="auto"`` choices were logged: the next of each is logged again."""
    _logged.clear()


_triton_found: bool | None = None


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (without importing it).

    Looked up once per process (the lookup costs tens of microseconds, and
    :func:`resolve_backend` asks on every kernel call on CUDA).
    """
    global _triton_found
    if _triton_found is None:
        _triton_found = importlib.util.find_spec("triton") is not None
    return _triton_found


def interpreter_requested() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set, so Triton kernels run on CPU tensors.

    Triton reads the variable when a kernel is decorated, i.e. when a kernel
    module is first imported; kvquant imports its kernel modules lazily, at
    the first Triton dispatch, so setting the variable before that is enough.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device, op: str) -> Literal["triton", "torch"]:
    """Turn a backend request into the backend that will run.

    Args:
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        device: the device of the operation's tensors.
        op: the operation's name, used in messages and in the log line.

    Returns:
        ``"triton"`` or ``"torch"``.

    Raises:
        BackendError: an unknown name, or ``"triton"`` where it cannot run
            (Triton missing, or CPU tensors without ``TRITON_INTERPRET=1``).
    """
    if backend not in BACKENDS:
        raise BackendError(
            f"{op}: backend={backend!r} is not a backend; expected one of {BACKENDS}. "
            "Fix: pass backend='auto' (Triton on CUDA, the torch reference on CPU)."
        )
    if backend == "torch":
        return "torch"
    if backend == "triton":
        if not triton_available():
            raise BackendError(
                f"{op}: backend='triton' was requested but the triton package is not installed. "
                "Fix: pip install triton, or pass backend='torch' (or 'auto')."
            )
        if device.type != "cuda" and not interpreter_requested():
            raise BackendError(
                f"{op}: backend='triton' was requested for tensors on {device}, but Triton runs "
                "only on CUDA tensors unless its interpreter is on. Fix: move the tensors to a "
                "CUDA device, set TRITON_INTERPRET=1 in the environment before the first kernel "
                "call (CPU interpreter, slow), or pass backend='torch' (or 'auto')."
            )
        return "triton"
    chosen: Literal["triton", "torch"] = (
        "triton" if device.type == "cuda" and triton_available() else "torch"
    )
    key = (op, device.type, chosen)
    if key not in _logged:
        _logged.add(key)
        why = (
            "CUDA tensors"
            if chosen == "triton"
            else ("triton is not installed" if device.type == "cuda" else f"{device.type} tensors")
        )
        level = logging.WARNING if device.type == "cuda" and chosen == "torch" else logging.DEBUG
        _logger.log(level, "kvquant %s: backend='auto' chose %r (%s).", op, chosen, why)
    return chosen
