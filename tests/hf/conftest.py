"""Fixtures of the HF-integration tests (tiny random models: see hf_tiny.py)."""

from __future__ import annotations

from typing import Any

import pytest
from hf_tiny import build


@pytest.fixture
def tiny_llama() -> Any:
    """A fresh tiny Llama (2 layers, 4 query / 2 KV heads, head_dim 16)."""
    return build("llama")
