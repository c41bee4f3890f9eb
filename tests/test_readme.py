"""README's first two commands are what CI runs (and what a new user types)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S)
    assert block is not None, "README.md has no code block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_starts_with_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    first_block = text.index("```")
    # Only the title and one sentence may come before the commands.
    assert len(text[:first_block].strip().splitlines()) <= 3
    commands = readme_commands()
    assert len(commands) == 2
    assert "kvquant demo" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in [line.strip() for line in ci]


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def test_the_cpu_examples_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """README's and the quickstart's CPU example, after the command the text gives."""
    pytest.importorskip("transformers")
    from kvquant.cli import main

    pages = [ROOT / "README.md", ROOT / "docs" / "quickstart.md"]
    for page in pages:
        assert "kvquant demo --keep kvq-demo" in page.read_text(), page.name
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--keep", "kvq-demo"]) == 0
    capsys.readouterr()
    ran = 0
    for page in pages:
        for block in _python_blocks(page):
            if '"kvq-demo/' not in block:
                continue
            exec(compile(block, f"{page.name} example", "exec"), {"__name__": "__main__"})
            printed = capsys.readouterr().out
            assert printed.strip(), page.name
            ran += 1
    assert ran >= 2
