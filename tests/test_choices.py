"""Typed choices: members equal their words everywhere a word was accepted, and options hold members."""

from __future__ import annotations

import ast
import inspect
import itertools
import json
import textwrap

import pytest

from kvquant.choices import Backend, Choice, MissingKV, MissingScales, RopePolicy, parse_choice
from kvquant.errors import OptionError
from kvquant.integrations.hf.config import PatchOptions, check_options
from kvquant.kernels.backend import BACKENDS
from kvquant.registry.options import ResolveOptions
from kvquant.registry.policy import MISSING_KV_POLICIES, MISSING_SCALES_POLICIES, ROPE_POLICIES

KINDS = [Backend, MissingScales, MissingKV, RopePolicy]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_members_read_as_their_words_and_each_has_a_docstring(kind: type[Choice]) -> None:
    for member in kind:
        word = member.value
        assert member == word and hash(member) == hash(word)
        assert str(member) == f"{member}" == word and repr(member) == repr(word)
        assert json.dumps({member: member}) == json.dumps({word: word})
        assert parse_choice(kind, word) is member
    assert parse_choice(kind, "nonsense") is None
    body = ast.parse(textwrap.dedent(inspect.getsource(kind))).body[0].body
    documented = {
        target.id
        for stmt, after in itertools.pairwise(body)
        if isinstance(stmt, ast.Assign) and isinstance(after, ast.Expr)
        for target in stmt.targets
        if isinstance(target, ast.Name)
    }
    assert documented == {m.name for m in kind}


def test_the_accepted_tuples_are_the_members_words() -> None:
    assert BACKENDS == ("auto", "triton", "torch")
    assert MISSING_SCALES_POLICIES == ("dynamic", "error", "unit")
    assert MISSING_KV_POLICIES == ("error", "reuse")
    assert ROPE_POLICIES == ("widen", "keep")


def test_options_hold_members_whether_given_words_or_members() -> None:
    opts = ResolveOptions(missing_scales="error", missing_kv=MissingKV.REUSE, rope_policy="keep")
    assert opts.missing_scales is MissingScales.ERROR
    assert opts.missing_kv is MissingKV.REUSE and opts.rope_policy is RopePolicy.KEEP
    patch = PatchOptions(
        scale_format="auto", missing_scales="dynamic", group_size=None, missing_kv="error",
        rope_policy="widen", backend="torch", page_size=16, max_cache_tokens=None,
        num_pages=None, cuda_graphs=None, compile_step=None, prefill_tokens="auto",
    )  # fmt: skip
    assert patch.backend is Backend.TORCH and patch.resolve_options == ResolveOptions(
        missing_scales="dynamic", missing_kv="error", rope_policy="widen"
    )
    assert patch == PatchOptions(**{**vars(patch), "backend": Backend.TORCH})


def test_a_word_that_names_no_member_keeps_its_own_error() -> None:
    bad = PatchOptions(
        scale_format="auto", missing_scales="dynamic", group_size=None, missing_kv="error",
        rope_policy="widen", backend="cuda", page_size=16, max_cache_tokens=None,
        num_pages=None, cuda_graphs=None, compile_step=None, prefill_tokens="auto",
    )  # fmt: skip
    assert bad.backend == "cuda" and not isinstance(bad.backend, Backend)
    with pytest.raises(
        OptionError, match=r"backend='cuda'; expected one of \('auto', 'triton', 'torch'\)"
    ):
        check_options(bad)
