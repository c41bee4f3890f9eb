"""Integrations of kvquant with model libraries (only :mod:`kvquant.integrations.hf` so far)."""
