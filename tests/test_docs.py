"""The documentation runs: docstring examples, the custom-formats tutorial, the mkdocs build.

* every ``kvquant`` module's docstring examples run under :mod:`doctest`;
* the Python blocks of ``docs/custom-formats.md`` run in order in one namespace
  (the tutorial's own ``assert`` lines check its results);
* ``mkdocs build --strict`` passes (skipped when mkdocs is not installed; CI
  installs it with the ``docs`` extra).
"""

from __future__ import annotations

import doctest
import importlib
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvquant"
DOCS = ROOT / "docs"

# Optional third-party imports a module may need; a module that cannot be
# imported for lack of one of these is skipped, anything else fails.
_OPTIONAL = ("triton", "transformers", "safetensors", "gguf", "accelerate", "numpy")

# Modules whose docstrings hold examples today: if one of them loses all its
# examples (or doctest stops finding them), test_doctests_are_found fails.
_MODULES_WITH_EXAMPLES = (
    "kvquant.cache.allocator",
    "kvquant.cache.storage.base",
    "kvquant.checkpoint.discovery",
    "kvquant.checkpoint.producers",
    "kvquant.kernels",
    "kvquant.kernels.write_fp4",
    "kvquant.integrations.hf.graphs",
    "kvquant.registry.fp4",
    "kvquant.registry.formats",
    "kvquant.registry.options",
    "kvquant.registry.registry",
    "kvquant.registry.resolve",
    "kvquant.report",
    "kvquant.testing.conformance",
    "kvquant.testing.synthetic",
    "kvquant.testing.example_formats",
)


def _module_names() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


MODULES = _module_names()


def _import(name: str) -> object:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing = (getattr(exc, "name", None) or "").split(".")[0]
        if missing in _OPTIONAL:
            pytest.skip(f"{name} cannot be imported here: {exc}")
        raise


def _run_doctests(name: str) -> tuple[int, int, str]:
    """Run a module's examples; return (attempted, failed, report of the failures)."""
    module = _import(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    report: list[str] = []
    for test in finder.find(module, name):
        if test.examples:
            runner.run(test, out=report.append)
    result = runner.summarize(verbose=False)
    return result.attempted, result.failed, "".join(report)


def test_every_module_is_collected() -> None:
    assert "kvquant.registry.registry" in MODULES
    assert "kvquant.kernels" in MODULES
    assert len(MODULES) >= 20, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    attempted, failed, report = _run_doctests(name)
    assert failed == 0, f"{failed} of {attempted} docstring examples of {name} failed:\n{report}"


def test_doctests_are_found() -> None:
    counts = {name: _run_doctests(name)[0] for name in _MODULES_WITH_EXAMPLES}
    empty = [name for name, count in counts.items() if count == 0]
    assert not empty, f"no docstring examples found in {empty}"


# ---------------------------------------------------------------------------
# docs/custom-formats.md


def python_blocks(markdown: str) -> list[str]:
    """The fenced ```python blocks of a Markdown page, in order."""
    return [m.group(1) for m in re.finditer(r"^```python[^\n]*\n(.*?)^```", markdown, re.S | re.M)]


def test_python_blocks_parser() -> None:
    text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```python title='t'\ny = 2\n```\n"
    assert python_blocks(text) == ["x = 1\n", "y = 2\n"]


def test_custom_formats_tutorial_runs() -> None:
    from kvquant.registry import default_registry

    page = DOCS / "custom-formats.md"
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    assert len(blocks) >= 4, f"{page} has only {len(blocks)} python blocks"
    assert sum(block.count("assert ") for block in blocks) >= 4, "the tutorial checks nothing"
    before = default_registry.names()
    # A real module, so that dataclasses and pickling can look the code up by name.
    module = types.ModuleType("kvquant_docs_custom_formats")
    sys.modules[module.__name__] = module
    try:
        for i, block in enumerate(blocks, 1):
            # dont_inherit: run without this file's `from __future__ import annotations`
            code = compile(block, f"{page.name} (python block {i})", "exec", dont_inherit=True)
            exec(code, module.__dict__)
    finally:
        del sys.modules[module.__name__]
        for name in default_registry.names():
            if name not in before:
                default_registry.unregister(name)
    assert default_registry.names() == before


# ---------------------------------------------------------------------------
# docs/troubleshooting.md


def test_troubleshooting_covers_every_error() -> None:
    import kvquant.errors as errors

    page = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"^## (\w+)$", page, re.M))
    names = [n for n in errors.__all__ if issubclass(getattr(errors, n), errors.KVQuantError)]
    assert len(names) >= 10
    missing = [n for n in names if n not in headings]
    assert not missing, f"docs/troubleshooting.md has no section for {missing}"


# ---------------------------------------------------------------------------
# mkdocs


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    for page in ("index.html", "scale-formats/index.html", "api/registry/index.html"):
        assert (tmp_path / page).is_file(), page
    registry_page = (tmp_path / "api/registry/index.html").read_text(encoding="utf-8")
    assert "kvquant.registry.resolve.resolve_scales" in registry_page
    assert ":class:" not in registry_page, "Sphinx roles left unrendered (docs/hooks.py)"
