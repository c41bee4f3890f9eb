"""The scale-format registry: names, lookups, contract checks at registration, temporary formats."""

from __future__ import annotations

import doctest
import importlib
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from kvquant.errors import (
    FormatRegistrationError,
    KVQuantError,
    ScaleFormatError,
    UnknownFormatError,
)
from kvquant.registry import (
    Fp32GroupFormat,
    Granularity,
    LayerGeometry,
    PerHeadFormat,
    PerTensorFormat,
    RawScale,
    ScaleFormat,
    ScaleFormatRegistry,
    default_registry,
    get_scale_format,
    register_scale_format,
    resolve_scales,
    scale_format_names,
    temporary_format,
)
from kvquant.testing.example_formats import InverseAmaxFormat, PerChannelMaxFormat

GEOM = LayerGeometry(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16)


def raws_for(make) -> list[RawScale]:
    return [
        RawScale(i, k, f"model.layers.{i}.self_attn.{k}_scale", "custom", make(i, k))  # type: ignore[arg-type]
        for i in range(GEOM.num_layers)
        for k in ("k", "v")
    ]


@dataclass(frozen=True)
class _Static(ScaleFormat):
    """A well-behaved per-tensor format for registry tests."""

    name: ClassVar[str] = "test-static"
    granularity: ClassVar[Granularity] = "per-tensor"

    def raw_shapes(self, geometry: LayerGeometry) -> tuple[tuple[int, ...], ...]:
        return ((2, 2),)

    def convert(self, values: torch.Tensor, geometry: LayerGeometry) -> torch.Tensor:
        return values.amax()


def test_builtins_are_registered_in_detection_order() -> None:
    assert scale_format_names()[:3] == ("per-tensor", "per-head", "fp32-group")
    assert get_scale_format("per-tensor") == PerTensorFormat()
    assert get_scale_format("per-head") == PerHeadFormat()
    assert get_scale_format("fp32-group") == Fp32GroupFormat(group_size=64)
    assert "per-head" in default_registry and "nope" not in default_registry


def test_formats_are_frozen_value_objects() -> None:
    fmt = Fp32GroupFormat(group_size=32)
    assert fmt == Fp32GroupFormat(group_size=32) and hash(fmt) == hash(Fp32GroupFormat(32))
    with pytest.raises(AttributeError):
        fmt.group_size = 64  # type: ignore[misc]


def test_unknown_name_lists_registered_names_and_how_to_register() -> None:
    with pytest.raises(UnknownFormatError) as info:
        get_scale_format("per-haed")
    message = str(info.value)
    assert isinstance(info.value, KeyError) and isinstance(info.value, KVQuantError)
    assert not message.startswith('"')  # not quoted like a plain KeyError
    assert "'per-tensor', 'per-head', 'fp32-group'" in message
    assert "Did you mean 'per-head'?" in message
    assert "kvquant.register_scale_format(MyFormat())" in message


def test_registering_a_taken_name_names_both_objects() -> None:
    @dataclass(frozen=True)
    class Impostor(PerTensorFormat):
        """Same name as the built-in."""

    with pytest.raises(FormatRegistrationError) as info:
        register_scale_format(Impostor())
    message = str(info.value)
    assert "'per-tensor' is already registered to PerTensorFormat()" in message
    assert "cannot also register" in message and "Impostor()" in message
    assert "test_registry" in message  # the module of the new object


def test_plain_call_registers_an_instance_and_returns_it() -> None:
    fmt = _Static()
    try:
        assert register_scale_format(fmt) is fmt
        assert get_scale_format("test-static") is fmt
        with pytest.raises(FormatRegistrationError, match="already registered"):
            register_scale_format(_Static())
    finally:
        default_registry.unregister("test-static")
    assert "test-static" not in scale_format_names()


def test_decorator_registers_an_instance_and_returns_the_class() -> None:
    @dataclass(frozen=True)
    class Decorated(_Static):
        name: ClassVar[str] = "test-decorated"

    try:
        assert register_scale_format(Decorated) is Decorated
        assert isinstance(get_scale_format("test-decorated"), Decorated)
    finally:
        default_registry.unregister("test-decorated")


def test_decorator_on_a_class_needing_arguments_fails_clearly() -> None:
    @dataclass(frozen=True)
    class NeedsArg(_Static):
        name: ClassVar[str] = "test-needs-arg"
        factor: float

    with pytest.raises(FormatRegistrationError, match=r"cannot instantiate .*NeedsArg"):
        register_scale_format(NeedsArg)
    with pytest.raises(FormatRegistrationError, match=r"not a subclass of kvquant\.ScaleFormat"):
        register_scale_format(int)  # type: ignore[type-var]


def test_temporary_format_registers_for_the_block_only_also_on_error() -> None:
    with temporary_format(_Static()) as fmt:
        assert get_scale_format("test-static") is fmt
    assert "test-static" not in scale_format_names()
    with pytest.raises(RuntimeError, match="boom"), temporary_format(_Static()):
        raise RuntimeError("boom")
    assert "test-static" not in scale_format_names()


def test_builtins_cannot_be_unregistered_and_unknown_names_raise() -> None:
    with pytest.raises(FormatRegistrationError, match="built in"):
        default_registry.unregister("per-head")
    with pytest.raises(UnknownFormatError):
        default_registry.unregister("never-registered")


# --- contract checks at registration ---------------------------------------------------------


def _broken(**overrides: object) -> ScaleFormat:
    """A subclass of _Static with some methods or attributes replaced."""
    cls = type("Broken", (_Static,), {"__doc__": "broken", "__module__": __name__, **overrides})
    return dataclass(frozen=True)(cls)()  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"convert": lambda self, v, g: v}, "returned float32 of shape \\(2, 2\\)"),
        ({"convert": lambda self, v, g: v.amax().double()}, "returned float64"),
        ({"convert": lambda self, v, g: 1.0}, "returned float"),
        ({"convert": lambda self, v, g: v.amax() * 0}, "element \\(\\) is 0"),
        ({"convert": lambda self, v, g: v.amax() + torch.rand(())}, "different values"),
        ({"convert": lambda self, v, g: 1 / 0}, "ZeroDivisionError"),
        ({"raw_shapes": lambda self, g: [(2, 2)]}, "expected a tuple of tuples"),
        ({"raw_shapes": lambda self, g: ((2, -1),)}, "expected a tuple of tuples"),
        ({"raw_shapes": lambda self, g: ()}, "claims no shape"),
        ({"name": "auto"}, "has name 'auto'"),
        ({"name": "has space"}, "has name 'has space'"),
        ({"name": ""}, "has name ''"),
        ({"granularity": "per-channel"}, "has granularity 'per-channel'"),
        ({"granularity": "fp32-group"}, "dynamic=False with granularity 'fp32-group'"),
        ({"dynamic": True}, "dynamic=True with granularity 'per-tensor'"),
    ],
)
def test_contract_is_checked_at_registration(overrides: dict[str, object], match: str) -> None:
    fmt = _broken(**overrides)
    registry = ScaleFormatRegistry()
    with pytest.raises(FormatRegistrationError, match=match):
        registry.register(fmt)
    assert fmt.name not in registry.names() or fmt.name == "per-tensor"


def test_contract_catches_a_normalize_that_mutates_its_input() -> None:
    def normalize(self: ScaleFormat, raw: RawScale, geometry: LayerGeometry) -> torch.Tensor:
        raw.tensor.mul_(2)
        return raw.tensor.amax().float()

    with pytest.raises(FormatRegistrationError, match="modified its input"):
        ScaleFormatRegistry().register(_broken(normalize=normalize))


def test_contract_requires_a_frozen_dataclass_instance() -> None:
    @dataclass
    class Mutable(ScaleFormat):
        name: ClassVar[str] = "test-mutable"
        granularity: ClassVar[Granularity] = "per-tensor"

        def raw_shapes(self, geometry: LayerGeometry) -> tuple[tuple[int, ...], ...]:
            return ((),)

        def convert(self, values: torch.Tensor, geometry: LayerGeometry) -> torch.Tensor:
            return values

    registry = ScaleFormatRegistry()
    with pytest.raises(FormatRegistrationError, match="not a frozen dataclass"):
        registry.register(Mutable())
    with pytest.raises(FormatRegistrationError, match=r"not a kvquant\.ScaleFormat"):
        registry.register(object())  # type: ignore[type-var]


def test_separate_registries_do_not_share_formats() -> None:
    registry = ScaleFormatRegistry()
    registry.register(_Static())
    assert "test-static" in registry and "test-static" not in default_registry
    raws = raws_for(lambda i, k: torch.full((2, 2), 0.5))
    scales = resolve_scales(raws, GEOM, registry=registry)
    assert scales[0].k_record.format == "test-static" and float(scales[0].k) == 0.5  # type: ignore[arg-type]


# --- user formats in resolve_scales ------------------------------------------------------------


def test_user_per_channel_format_is_detected_by_shape() -> None:
    per_channel = torch.linspace(0.01, 0.32, 32).reshape(2, 16)
    raws = raws_for(lambda i, k: per_channel)
    with temporary_format(PerChannelMaxFormat()):
        scales = resolve_scales(raws, GEOM)
    assert scales.granularity == "per-head"
    assert scales[0].k is not None
    torch.testing.assert_close(scales[0].k, per_channel.amax(dim=-1), rtol=0, atol=0)
    assert scales[0].k_record.format == "per-channel-max"
    assert scales[0].k_record.action == "convert"
    assert "per-channel-max" in scales[0].k_record.reason
    # Without the format registered, the shape is rejected with the registered shapes.
    with pytest.raises(ScaleFormatError, match="has shape \\(2, 16\\)"):
        resolve_scales(raws, GEOM)


def test_user_inverse_format_is_used_only_when_named() -> None:
    raws = raws_for(lambda i, k: torch.tensor([448.0 / 4.0]))
    with temporary_format(InverseAmaxFormat()):
        auto = resolve_scales(raws, GEOM)  # the built-in per-tensor wins detection
        assert float(auto[0].k) == 112.0  # type: ignore[arg-type]
        named = resolve_scales(raws, GEOM, scale_format="inverse-amax")
    assert float(named[0].k) == pytest.approx(4.0 / 448.0)  # type: ignore[arg-type]
    assert named.options["scale_format"] == "inverse-amax"
    # A named user format reads every tensor: a shape it does not claim is rejected.
    bad = raws_for(lambda i, k: torch.full((2,), 100.0))
    with (
        temporary_format(InverseAmaxFormat()),
        pytest.raises(Exception, match="format 'inverse-amax' reads \\(\\) or \\(1,\\)"),
    ):
        resolve_scales(bad, GEOM, scale_format="inverse-amax")


def test_format_instance_can_be_passed_without_registering() -> None:
    raws = raws_for(lambda i, k: torch.tensor(56.0))
    scales = resolve_scales(raws, GEOM, scale_format=InverseAmaxFormat())
    assert float(scales[1].v) == pytest.approx(1 / 56.0)  # type: ignore[arg-type]


def test_user_format_output_out_of_range_is_rejected_after_conversion() -> None:
    raws = raws_for(lambda i, k: torch.tensor(2.0**-110))  # fine as input, inverse too large
    with pytest.raises(ScaleFormatError, match="after format 'inverse-amax' converted it"):
        resolve_scales(raws, GEOM, scale_format=InverseAmaxFormat())


# --- module hygiene -----------------------------------------------------------------------------


def test_registry_imports_neither_transformers_nor_triton() -> None:
    code = (
        "import sys, kvquant.registry, kvquant.testing.conformance\n"
        "bad = [m for m in ('transformers', 'triton') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "module",
    [
        "kvquant.registry.formats",
        "kvquant.registry.registry",
        "kvquant.registry.resolve",
        "kvquant.testing.conformance",
        "kvquant.testing.example_formats",
    ],
)
def test_docstring_examples_run(module: str) -> None:
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_resolve_options_object_matches_keywords() -> None:
    import pytest as _pytest

    from kvquant.errors import OptionError
    from kvquant.registry import LayerGeometry, RawScale, ResolveOptions, resolve_scales

    g = LayerGeometry(1, 4, 2, 16)
    k = torch.rand(2) * 0.1 + 0.01
    raws = [RawScale(0, "k", "m.layers.0.self_attn.k_scale", "compressed-tensors", k)]
    opts = ResolveOptions(missing_kv="reuse", scale_format="per-tensor")
    by_object = resolve_scales(raws, g, options=opts)
    by_keywords = resolve_scales(raws, g, **opts.as_kwargs())
    assert torch.equal(by_object.layers[0].k, by_keywords.layers[0].k)
    assert torch.equal(by_object.layers[0].k, k.max())
    assert by_object.options == by_keywords.options
    with _pytest.raises(OptionError, match="one or the other"):
        resolve_scales(raws, g, options=opts, missing_kv="reuse")


def test_conversions_are_typed_and_drive_the_warning(caplog: Any) -> None:
    import logging

    from kvquant.registry import Conversion, LayerGeometry, RawScale, resolve_scales

    g = LayerGeometry(2, 4, 2, 16)
    per_head = [
        RawScale(layer, kind, f"m.layers.{layer}.self_attn.{kind}_scale", "compressed-tensors", t)
        for layer in range(2)
        for kind, t in (("k", torch.rand(2) * 0.1 + 0.01), ("v", torch.rand(2) * 0.1 + 0.01))
    ]
    with caplog.at_level(logging.INFO, logger="kvquant"):
        lossless = resolve_scales(per_head, g)
    assert {c.conversion for c in lossless.conversions} == set()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvquant"):
        reduced = resolve_scales(per_head, g, scale_format="per-tensor")
    kinds = {c.conversion for c in reduced.conversions}
    assert Conversion.PER_HEAD_MAX in kinds and all(c.lossy for c in reduced.conversions)
    assert [c.layers for c in reduced.conversions] == [(0, 1), (0, 1)]
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert all(c.note in warning.getMessage() for c in reduced.conversions)
    assert reduced.to_dict()["conversions"][0]["conversion"] == "per-head-max"
    assert not Conversion.BROADCAST_PER_HEAD.lossy and Conversion.KV_REUSED.lossy
