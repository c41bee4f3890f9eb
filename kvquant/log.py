"""The ``kvquant`` logger: one visible line per decision, and how to change its verbosity.

kvquant logs through the standard :mod:`logging` logger named ``"kvquant"``,
visible by default at ``INFO`` (decisions ``INFO``, lossy or risky choices
``WARNING``, details ``DEBUG``) through its own ``sys.stderr`` handler, which
stays silent once the application has configured logging (records then reach
the application's handlers by propagation, and only there).

Change the verbosity with :func:`set_verbosity` (``kvquant.set_verbosity("warning")``),
with the ``KVQUANT_VERBOSITY`` environment variable (``debug``, ``info``,
``warning``, ``error`` or ``critical``, read when kvquant is imported; an
unknown value is reported as a warning and ignored), or with
``logging.getLogger("kvquant").setLevel(...)``. Design: docs/dev/package.md.
"""

from __future__ import annotations

import logging
import os
import sys

from kvquant.errors import VerbosityError

__all__ = ["ENV_VAR", "LEVELS", "get_verbosity", "set_verbosity"]

ENV_VAR = "KVQUANT_VERBOSITY"
"""The environment variable read at import time."""

LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
"""Verbosity names and their :mod:`logging` levels."""

_LOGGER = logging.getLogger("kvquant")


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the current ``sys.stderr``; silent when the application configured logging."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)
        self.setFormatter(logging.Formatter("%(message)s"))

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the application's handlers receive it through propagation
        super().emit(record)


def _level(value: int | str, origin: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise VerbosityError(
            f"{origin}: verbosity {value!r}; expected one of {sorted(LEVELS)} or a logging "
            "level int. Fix: pass e.g. 'warning' or logging.WARNING."
        )
    if isinstance(value, int):
        return value
    level = LEVELS.get(value.strip().lower())
    if level is None:
        raise VerbosityError(
            f"{origin}: verbosity {value!r}; expected one of {sorted(LEVELS)}. "
            "Fix: pass e.g. 'warning' (only warnings and errors) or 'debug' (everything)."
        )
    return level


def set_verbosity(level: int | str) -> None:
    """Set how much kvquant logs.

    Args:
        level: ``"debug"``, ``"info"`` (the default: one line per ``patch``),
            ``"warning"``, ``"error"``, ``"critical"``, or a :mod:`logging` level int.

    Raises:
        VerbosityError: an unknown level name or a value of another type.

    Example:
        >>> import kvquant
        >>> kvquant.set_verbosity("warning")
        >>> kvquant.get_verbosity()
        30
        >>> kvquant.set_verbosity("info")
    """
    _LOGGER.setLevel(_level(level, "kvquant.set_verbosity"))


def get_verbosity() -> int:
    """The ``kvquant`` logger's effective :mod:`logging` level (``20`` is ``INFO``)."""
    return _LOGGER.getEffectiveLevel()


def _configure() -> None:
    """Give the ``kvquant`` logger its default handler and level (once per process)."""
    if not any(isinstance(h, _StderrHandler) for h in _LOGGER.handlers):
        _LOGGER.addHandler(_StderrHandler())
    if _LOGGER.level == logging.NOTSET:
        _LOGGER.setLevel(logging.INFO)
    env = os.environ.get(ENV_VAR)
    if env:
        try:
            _LOGGER.setLevel(_level(env, f"the {ENV_VAR} environment variable"))
        except VerbosityError as exc:  # importing kvquant must not fail over a log setting
            _LOGGER.warning(
                "kvquant: %s Keeping the level %s.", exc, logging.getLevelName(_LOGGER.level)
            )


_configure()
