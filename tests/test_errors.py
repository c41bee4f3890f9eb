"""The fixes error messages suggest are real: keywords of patch()/KVQuantConfig(), CLI flags.

Every string literal in the package (f-string parts included) is scanned for
``patch(model, name=...)`` / ``kvquant.patch(..., name=...)`` and
``KVQuantConfig(name=...)`` suggestions, and every ``--flag`` in a string that
carries a ``Fix:`` is looked up in the ``kvquant`` command line.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import kvquant

PACKAGE = Path(kvquant.__file__).parent
_PATCH_CALL = re.compile(r"patch\((?:model|[^()]*?)\s*,\s*(?P<kw>[a-z_]+)=")
_CONFIG_CALL = re.compile(r"KVQuantConfig\((?P<kw>[a-z_]+)=")
_FLAG = re.compile(r"(?<![\w-])--(?P<flag>[a-z][a-z-]+)")


def _strings() -> list[tuple[str, str]]:
    out = []
    for file in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(file.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                text = "".join(
                    v.value
                    for v in node.values
                    if isinstance(v, ast.Constant) and isinstance(v.value, str)
                )
                out.append((str(file.relative_to(PACKAGE)), text))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append((str(file.relative_to(PACKAGE)), node.value))
    return out


def _keywords(fn: object) -> set[str]:
    return set(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def test_suggested_patch_and_config_keywords_exist() -> None:
    pytest.importorskip("transformers")
    from kvquant.integrations.hf import KVQuantConfig, patch

    config_kw = _keywords(KVQuantConfig) - {"self", "saved"}
    patch_kw = {"scales", "config"} | config_kw  # the options are keyword sugar for the config
    assert "options" in _keywords(patch)
    seen = 0
    bad = []
    for where, text in _strings():
        for m in _PATCH_CALL.finditer(text):
            seen += 1
            if m.group("kw") not in patch_kw:
                bad.append((where, m.group(0)))
        for m in _CONFIG_CALL.finditer(text):
            seen += 1
            if m.group("kw") not in config_kw:
                bad.append((where, m.group(0)))
    assert seen > 5  # the scan finds the suggestions
    assert not bad, bad


def test_flags_in_fixes_exist() -> None:
    from kvquant.cli import build_parser

    parser = build_parser()
    flags: set[str] = set()
    stack = [parser]
    while stack:
        p = stack.pop()
        for action in p._actions:
            flags.update(s.lstrip("-") for s in action.option_strings)
            choices = getattr(action, "choices", None)
            if isinstance(choices, dict):
                stack.extend(choices.values())
    bad = []
    for where, text in _strings():
        if "Fix:" not in text:
            continue
        fix = text.split("Fix:", 1)[1]
        bad += [(where, m.group(0)) for m in _FLAG.finditer(fix) if m.group("flag") not in flags]
    assert not bad, bad


def test_group_size_fix_lists_real_divisors() -> None:
    import torch

    from kvquant.cache import PagedLayerStorage
    from kvquant.errors import CacheUsageError

    with pytest.raises(CacheUsageError, match=r"one of \[8, 16\]"):
        PagedLayerStorage(
            2, 4, 1, 80, granularity="fp32-group", group_size=32, device=torch.device("cpu")
        )
    default = PagedLayerStorage(2, 4, 1, 80, granularity="fp32-group", device=torch.device("cpu"))
    assert default.group_size == 16


def test_every_public_error_derives_from_a_builtin() -> None:
    import kvquant.errors as errors

    for name in errors.__all__:
        cls = getattr(errors, name)
        if cls is errors.KVQuantError:
            continue
        assert issubclass(cls, errors.KVQuantError)
        builtin = [b for b in cls.__mro__ if b.__module__ == "builtins" and b is not object]
        assert any(b not in (Exception, BaseException) for b in builtin), name


def test_no_bare_kvquant_error_is_raised() -> None:
    bare = []
    for file in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            exc = node.exc if isinstance(node, ast.Raise) else None
            if isinstance(exc, ast.Call):
                exc = exc.func
            if isinstance(exc, ast.Name) and exc.id == "KVQuantError":
                bare.append(f"{file.relative_to(PACKAGE)}:{node.lineno}")
    assert not bare, (
        f"raise a specific subclass (KVQuantError + a builtin), not KVQuantError: {bare}"
    )
