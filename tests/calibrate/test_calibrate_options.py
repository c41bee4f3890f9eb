"""kvquant.calibrate.options: choices are str enums that read exactly as their strings."""

from __future__ import annotations

import ast
import inspect
import itertools
import json
import textwrap

import pytest

from kvquant.calibrate import (
    CENTRES,
    CONVENTIONS,
    OBJECTIVES,
    ROTATIONS,
    Centre,
    Convention,
    Granularity,
    Objective,
    Rotation,
)
from kvquant.calibrate.options import Choice, is_rotation, parse_choice


@pytest.mark.parametrize("kind", [Objective, Granularity, Centre, Rotation, Convention])
def test_members_equal_hash_and_format_as_their_strings(kind: type[Choice]) -> None:
    for member in kind:
        value = member.value
        assert member == value and hash(member) == hash(value)
        assert str(member) == f"{member}" == value
        assert json.dumps({member: member}) == json.dumps({value: value})
        assert parse_choice(kind, value) is member and parse_choice(kind, member) is member
    assert parse_choice(kind, "nonsense") is None and parse_choice(kind, None) is None
    body = ast.parse(textwrap.dedent(inspect.getsource(kind))).body[0].body
    documented = {
        target.id
        for stmt, after in itertools.pairwise(body)
        if isinstance(stmt, ast.Assign) and isinstance(after, ast.Expr)
        for target in stmt.targets
        if isinstance(target, ast.Name)
    }
    assert documented == {m.name for m in kind}, f"{kind.__name__}: a member without a docstring"


def test_the_tuples_list_the_members_in_order() -> None:
    assert OBJECTIVES == ("mse", "attention")
    assert CENTRES == ("mean", "midrange")
    assert ROTATIONS == ("hadamard", None)
    assert CONVENTIONS == ("compressed-tensors", "modelopt", "quark", "kvquant")
    assert [g.value for g in Granularity] == ["per-tensor", "per-head", "k-transform"]
    assert is_rotation(None) and is_rotation("hadamard") and not is_rotation("none")
