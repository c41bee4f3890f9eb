"""The code's shape: files, functions and module docstrings stay within their limits.

Limits: {FILE} lines a file, {FUNCTION} lines a function (Triton ``@jit`` kernels apart), {DOC}
lines a module docstring (the essay goes to ``docs/dev/``). The code written before these limits
is listed below with its size today: an entry may only shrink, and goes once it fits.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILE, FUNCTION, DOC = 800, 100, 15

FILE_DEBT = {}

FUNCTION_DEBT: dict[str, int] = {}

DOC_DEBT: dict[str, int] = {}


def _measure() -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    files, functions, docs = {}, {}, {}
    for path in sorted((ROOT / "kvquant").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8")
        files[rel] = len(text.splitlines())
        tree = ast.parse(text)
        doc = ast.get_docstring(tree, clean=False)
        docs[rel] = len(doc.splitlines()) if doc else 0
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any("jit" in ast.unparse(d) for d in node.decorator_list):
                    continue
                key = f"{rel}::{node.name}"
                size = node.end_lineno - node.lineno + 1 if node.end_lineno else 0
                functions[key] = max(size, functions.get(key, 0))
    return files, functions, docs


MEASURED = dict(zip(("file", "function", "docstring"), _measure(), strict=True))
CASES = [
    ("file", FILE, FILE_DEBT),
    ("function", FUNCTION, FUNCTION_DEBT),
    ("docstring", DOC, DOC_DEBT),
]


@pytest.mark.parametrize(("kind", "limit", "debt"), CASES, ids=[c[0] for c in CASES])
def test_within_limits_or_listed_and_shrinking(kind: str, limit: int, debt: dict[str, int]) -> None:
    sizes = MEASURED[kind]
    over = {k: v for k, v in sizes.items() if v > limit and k not in debt}
    assert not over, f"{kind}s over {limit} lines: {over}; split them (see docs/dev/)"
    grown = {k: (sizes[k], v) for k, v in debt.items() if sizes.get(k, 0) > v}
    assert not grown, f"listed {kind}s grew (now, listed): {grown}; they may only shrink"
    fits = sorted(k for k in debt if sizes.get(k, 0) <= limit)
    assert not fits, (
        f"{kind}s now within {limit} lines (or gone): {fits}; remove them from the list"
    )


# Parameters of the attention kernel, (all, tl.constexpr ones): at most 60 (docs/dev/kernels.md).
# A new input joins an existing stride tuple or replaces a parameter; a removed one lowers the pin.
KERNEL_PARAMETERS = {"kvquant/kernels/attention/kernel.py::paged_attn_kernel": (60, 19)}


@pytest.mark.parametrize("key", sorted(KERNEL_PARAMETERS))
def test_kernel_parameter_count_is_pinned(key: str) -> None:
    rel, name = key.split("::")
    tree = ast.parse((ROOT / rel).read_text(encoding="utf-8"))
    (node,) = (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    args = node.args.args
    constexprs = sum(
        a.annotation is not None and "constexpr" in ast.unparse(a.annotation) for a in args
    )
    assert (len(args), constexprs) == KERNEL_PARAMETERS[key], (
        f"{key} takes {len(args)} parameters, {constexprs} of them tl.constexpr; pinned at "
        f"{KERNEL_PARAMETERS[key]} (at most 60: derive flags from other arguments, pass strides "
        "as tuples; update the pin when one goes)"
    )
