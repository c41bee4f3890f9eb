"""Names and marks shared by the patch and continuous batching (a leaf: imports nothing of kvquant)."""

from __future__ import annotations

__all__ = ["MISSING", "STATE_ATTR"]

STATE_ATTR = "_kvquant_state"
"""Attribute of a patched model holding its :class:`~kvquant.integrations.hf.state.PatchState`."""


class _Missing:
    """The mark of an attribute that was absent before kvquant set it (restored by deleting).

    One object, also through ``copy.deepcopy`` and pickling (a copied patched model must
    recognise it when its handle restores the attributes).
    """

    def __reduce__(self) -> str:
        return "MISSING"

    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()
