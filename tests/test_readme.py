"""README's first two commands are what CI runs (and what a new user types)."""

from __future__ import annotations

import re
from pathlib import Path

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
