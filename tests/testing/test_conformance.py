"""The exported conformance suite: every built-in and two example user formats pass it,
and it catches formats that break the rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from kvquant.registry import (
    Granularity,
    LayerGeometry,
    RawScale,
    ScaleFormat,
    default_registry,
    temporary_format,
)
from kvquant.registry.registry import BUILTIN_FORMATS
from kvquant.testing.conformance import (
    ConformanceCase,
    check_scale_format,
    conformance_cases,
)
from kvquant.testing.example_formats import InverseAmaxFormat, PerChannelMaxFormat

FORMATS = (*BUILTIN_FORMATS, PerChannelMaxFormat(), InverseAmaxFormat())


@pytest.mark.parametrize("case", conformance_cases(FORMATS), ids=str)
def test_format_conforms(case: ConformanceCase) -> None:
    case.run()


def test_cases_cover_every_format_and_check() -> None:
    ids = {str(c) for c in conformance_cases(FORMATS)}
    for name in ("per-tensor", "per-head", "per-channel-max", "inverse-amax"):
        for check in ("canonical", "rejects-nan", "rejects-int", "no-mutation", "deterministic"):
            assert f"{name}:{check}" in ids
    assert "fp32-group:reads-no-tensor" in ids
    assert "fp32-group:canonical" not in ids


def test_default_cases_follow_the_registry() -> None:
    before = {str(c) for c in conformance_cases()}
    assert "per-head:canonical" in before
    with temporary_format(PerChannelMaxFormat()):
        during = {str(c) for c in conformance_cases()}
    assert "per-channel-max:canonical" in during - before
    assert len(default_registry.formats()) >= 3


# --- the suite must catch broken formats -----------------------------------------------------------


@dataclass(frozen=True)
class _Base(ScaleFormat):
    """Per-head scales; subclasses break one rule each."""

    name: ClassVar[str] = "broken"
    granularity: ClassVar[Granularity] = "per-head"

    def raw_shapes(self, geometry: LayerGeometry) -> tuple[tuple[int, ...], ...]:
        return ((geometry.num_kv_heads,),)

    def convert(self, values: torch.Tensor, geometry: LayerGeometry) -> torch.Tensor:
        return values


@dataclass(frozen=True)
class _AcceptsNaN(_Base):
    """Skips the shared checks by overriding normalize."""

    def normalize(self, raw: RawScale, geometry: LayerGeometry) -> torch.Tensor:
        return raw.tensor.detach().float().clone()


@dataclass(frozen=True)
class _ReturnsView(_Base):
    """Returns the caller's tensor itself."""

    def normalize(self, raw: RawScale, geometry: LayerGeometry) -> torch.Tensor:
        if raw.tensor.dtype != torch.float32:
            return super().normalize(raw, geometry)
        super().normalize(raw, geometry)
        return raw.tensor


@dataclass(frozen=True)
class _Random(_Base):
    """Adds noise."""

    def convert(self, values: torch.Tensor, geometry: LayerGeometry) -> torch.Tensor:
        return values * (1 + torch.rand(values.shape) * 0.01)


@dataclass(frozen=True)
class _WrongError(_Base):
    """Raises a bare ValueError on zero."""

    def normalize(self, raw: RawScale, geometry: LayerGeometry) -> torch.Tensor:
        if bool((raw.tensor == 0).any()):
            raise ValueError("zero")
        return super().normalize(raw, geometry)


@pytest.mark.parametrize(
    ("fmt", "failing"),
    [
        (_AcceptsNaN(), ["rejects-nan", "rejects-inf", "rejects-zero", "rejects-negative"]),
        (_ReturnsView(), ["no-mutation"]),
        (_Random(), ["deterministic", "contract"]),
        (_WrongError(), ["rejects-zero"]),
    ],
    ids=lambda x: type(x).__name__ if isinstance(x, ScaleFormat) else "",
)
def test_suite_catches_broken_formats(fmt: ScaleFormat, failing: list[str]) -> None:
    with pytest.raises(AssertionError) as info:
        check_scale_format(fmt)
    message = str(info.value)
    for check in failing:
        assert f"broken:{check}:" in message
    assert "broken:canonical:" not in message or isinstance(fmt, _Random)
