"""Packaging metadata: the distribution name, one version, py.typed, the licence, the transformers range."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path
from typing import Any

import pytest

import kvquant

ROOT = Path(__file__).resolve().parents[1]
DIST = "kvquant-fp8"


@pytest.fixture(scope="module")
def project() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_distribution_name_and_single_sourced_version(project: dict[str, Any]) -> None:
    assert project["project"]["name"] == DIST  # `kvquant` on PyPI is another project
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kvquant.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", kvquant.__version__)
    try:
        installed = importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{DIST} is not installed (kvquant imported from a source tree)")
    assert installed == kvquant.__version__


def test_readme_and_docs_install_the_distribution_name() -> None:
    for page in [ROOT / "README.md", ROOT / "docs" / "index.md", ROOT / "docs" / "quickstart.md"]:
        text = page.read_text(encoding="utf-8")
        for line in re.findall(r"pip install [^\n`&;]*", text):
            # `pip install kvquant` would install an unrelated project
            assert not re.search(r"(?<![\w-])kvquant(?![\w-])", line), (page.name, line)


def test_py_typed_and_licence_are_shipped(project: dict[str, Any]) -> None:
    assert (ROOT / "kvquant" / "py.typed").is_file()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["kvquant"]
    assert project["project"]["license"] == "Apache-2.0"
    assert project["project"]["license-files"] == ["LICENSE"]
    licence = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert "END OF TERMS AND CONDITIONS" in licence  # the full text, not a stub


def _transformers_range(project: dict[str, Any]) -> tuple[str, str]:
    (spec,) = [d for d in project["project"]["dependencies"] if d.startswith("transformers")]
    found = re.fullmatch(r"transformers>=([\d.]+),<([\d.]+)", spec.replace(" ", ""))
    assert found, f"{spec!r}: expected transformers>=LOW,<HIGH (the integration uses internals)"
    return found.group(1), found.group(2)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def test_transformers_range_has_an_upper_bound_and_is_installed(project: dict[str, Any]) -> None:
    low, high = _transformers_range(project)
    assert _version(low) < _version(high)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert f'"transformers=={low}.0"' in ci  # CI's second leg tests the lower end
    try:
        installed = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("transformers is not installed")
    assert _version(low) <= _version(installed) < _version(high), installed


def test_metadata_names_the_project_and_its_pages(project: dict[str, Any]) -> None:
    yaml = pytest.importorskip("yaml")
    meta = project["project"]
    assert meta["authors"] and len(meta["keywords"]) >= 5
    assert "Typing :: Typed" in meta["classifiers"]
    versions = {c.rsplit(" ", 1)[-1] for c in meta["classifiers"] if "Python :: 3." in c}
    assert min(versions, key=_version) == meta["requires-python"].removeprefix(">=")
    urls = meta["urls"]
    assert {"Homepage", "Documentation", "Source", "Issues", "Changelog"} <= set(urls)
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8").replace("!!", "#"))
    # the docs' 404 page and the repository link resolve against these
    assert site["site_url"] == urls["Documentation"] and site["repo_url"] == urls["Source"]


def test_triton_is_an_extra_not_a_cpu_requirement(project: dict[str, Any]) -> None:
    """A CPU-only install needs no Triton (torch's CUDA wheels bring it where it runs)."""
    deps = project["project"]["dependencies"]
    extras = project["project"]["optional-dependencies"]
    assert not any(d.startswith("triton") for d in deps)
    assert any(d.startswith("triton") for d in extras["triton"])
    assert any(d.startswith("triton") for d in extras["test"])  # the interpreter tests
    # mkdocstrings formats the API signatures only when black or ruff is installed
    assert any(d.startswith(("ruff", "black")) for d in extras["docs"])
