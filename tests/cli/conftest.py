"""Fixtures of this folder: tiny calibratable checkpoints (tests/calibration_models.py)."""

from calibration_models import tiny, tiny_dir, tiny_kt  # noqa: F401
