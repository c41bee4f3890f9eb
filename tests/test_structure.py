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


# ------------------------------------------- words of granularities, formats and producers
# A granularity, a KV format, a checkpoint producer and an export engine are each named by a
# word that only its own definition spells out: everywhere else code turns the word into the
# scheme class, the KVFormat member or the producer/engine object once, at the edge, and asks
# it a question (a property), so a new one is a new class, not a hunt for string comparisons.
WORD_HOMES = (
    "kvquant/schemes/",
    "kvquant/choices.py",
    "kvquant/checkpoint/producers/",
    "kvquant/export/vllm.py",
    "kvquant/export/sglang.py",
    "kvquant/export/tensorrt_llm.py",
)


def _registered_words() -> frozenset[str]:
    from kvquant.checkpoint.producers import PRODUCERS
    from kvquant.choices import KVFormat
    from kvquant.export.engines import ENGINE_LIST
    from kvquant.schemes import FP4_FORMATS, scheme_names

    words = {*scheme_names(), *KVFormat.values(), *(f.name for f in FP4_FORMATS)}
    words |= {e.name for e in ENGINE_LIST}
    for p in PRODUCERS:
        words |= {p.name, p.producer, *p.quant_methods}
    # "kvquant" is also the package's own name (its logger, the reader in reports)
    return frozenset(words - {"kvquant"})


def _word(node: ast.AST, words: frozenset[str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in words:
        return node.value
    return None


def _word_comparisons(tree: ast.AST, words: frozenset[str]) -> list[tuple[int, str]]:
    """``(line, code)`` of each comparison with a registered word, and each module-level
    second name for one (``FP8 = "fp8"``, to compare with)."""
    hits: list[tuple[int, ast.AST]] = []
    literal = (ast.Tuple, ast.List, ast.Set)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            left = node.left
            for op, right in zip(node.ops, node.comparators, strict=True):
                sides = [left, right]
                if isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, literal):
                    sides += right.elts
                elif isinstance(op, (ast.In, ast.NotIn)):
                    sides = []  # "word" in mapping/text: a lookup, not this test's business
                if any(_word(s, words) for s in sides):
                    hits.append((node.lineno, node))
                left = right
        elif isinstance(node, ast.MatchValue) and _word(node.value, words):
            hits.append((node.lineno, node.value))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
            and any(
                _word(a, words)
                or (isinstance(a, ast.Tuple) and any(_word(e, words) for e in a.elts))
                for a in node.args
            )
        ):
            hits.append((node.lineno, node))
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            if _word(node.value, words):
                hits.append((node.lineno, node))
    return [(line, ast.unparse(n)) for line, n in sorted(hits, key=lambda h: h[0])]


def test_no_string_comparison_names_a_granularity_format_or_producer() -> None:
    words = _registered_words()
    found = []
    for path in sorted((ROOT / "kvquant").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(WORD_HOMES):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [f"{rel}:{line}: {code}" for line, code in _word_comparisons(tree, words)]
    assert not found, (
        "string comparisons naming a granularity, a KV format, a producer or an engine outside "
        "their definitions (turn the word into the scheme class / KVFormat member / producer "
        "once and ask it a property):\n" + "\n".join(found)
    )


def test_word_comparison_finder_sees_each_form() -> None:
    words = frozenset({"nvfp4", "per-head"})
    src = (
        'FMT = "nvfp4"\n'
        'a == "nvfp4"\n"per-head" != b\nc in ("nvfp4", "fp8")\n"nvfp4" not in (d, e)\n'
        'f.startswith("nvfp4")\nmatch g:\n    case "per-head":\n        pass\n'
        '"nvfp4" in table\nh == "fp8"\nprint("nvfp4")\n'
    )
    lines = [line for line, _ in _word_comparisons(ast.parse(src), words)]
    assert lines == [1, 2, 3, 4, 5, 6, 8]
