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


def test_each_convention_answers_what_the_writer_asks() -> None:
    # (holds the k-transform, per-head strategy, scale tensor names, per-tensor and per-head
    # shapes for 4 KV heads)
    facts = {
        Convention.COMPRESSED_TENSORS: (False, True, "compressed-tensors", (1,), (4, 1, 1)),
        Convention.MODELOPT: (False, False, "modelopt", (), None),
        Convention.QUARK: (False, False, "quark", (), None),
        Convention.KVQUANT: (True, False, "compressed-tensors", (4,), (4,)),
    }
    for convention, (k_transform, per_head, names, tensor, head) in facts.items():
        assert (convention.holds_k_transform, convention.per_head) == (k_transform, per_head)
        assert convention.scale_names == names
        assert convention.scale_shape("per-tensor", 4) == tensor
        if head is not None:
            assert convention.scale_shape("per-head", 4) == head
    # configs of its own: Quark's (post-RoPE, its MSE observer after a search), none elsewhere
    assert [c for c in Convention if c.own_config("minmax") is not None] == [Convention.QUARK]
    quark = Convention.QUARK.own_config("mse")
    assert quark is not None and quark["kv_cache_post_rope"] is True
    observers = {
        entry["output_tensors"]["observer_cls"]
        for group in ("layer_quant_config", "kv_cache_quant_config")
        for entry in quark[group].values()
    }
    assert observers == {"PerTensorMSEObserver"}
    assert "MSE" not in json.dumps(Convention.QUARK.own_config("minmax"))
    # a copy of unquantized weights: ModelOpt's config names its producer, the others none
    bare = Convention.MODELOPT.bare_config({"producer": {"name": "modelopt", "version": "0.1"}})
    assert bare is not None and bare["quant_method"] == "modelopt"
    assert bare["producer"] == {"name": "modelopt", "version": "0.1"}
    assert [c for c in Convention if c.bare_config(None) is not None] == [Convention.MODELOPT]
