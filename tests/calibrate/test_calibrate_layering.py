"""kvquant.calibrate's modules import one way: each only from the modules listed before it."""

from __future__ import annotations

import ast
from pathlib import Path

import kvquant.calibrate

PACKAGE = Path(kvquant.calibrate.__file__).parent

ORDER = (
    "options",
    "fp8",
    "statistics",
    "report",
    "layer_map",
    "result",
    "search",
    "k_transform",
    "collection",
    "evaluate",
    "pipeline",
    "data",
    "writing",
)


def _imported(path: Path) -> set[str]:
    """The kvquant.calibrate modules a file imports (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "kvquant.calibrate."
        ):
            found.add(node.module.rsplit(".", 1)[1])
    return found


def test_every_module_has_a_place_and_imports_only_earlier_ones() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert modules == set(ORDER), modules ^ set(ORDER)
    upward = [
        f"{name} imports {target}"
        for name in ORDER
        for target in _imported(PACKAGE / f"{name}.py")
        if ORDER.index(target) >= ORDER.index(name)
    ]
    assert not upward, upward
