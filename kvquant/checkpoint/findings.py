"""Checkpoint-level findings: facts about a checkpoint worth telling the user."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Finding", "Severity"]

Severity = Literal["info", "warning", "error"]
"""``"info"`` (a fact), ``"warning"`` (loads, but lossy or surprising), ``"error"`` (refused)."""


@dataclass(frozen=True)
class Finding:
    """A checkpoint-level fact worth telling the user.

    Attributes:
        severity: ``"info"`` (a fact), ``"warning"`` (loads, but something is
            lossy or surprising) or ``"error"`` (kvquant would refuse it).
        code: a short stable identifier, e.g. ``"fp8-weights-modelopt"``.
        message: one or two sentences: what was found, what it means, the fix.
    """

    severity: Severity
    code: str
    message: str

    def to_dict(self) -> dict[str, str]:
        """Return the finding as a JSON-ready dict."""
        return {"severity": self.severity, "code": self.code, "message": self.message}
