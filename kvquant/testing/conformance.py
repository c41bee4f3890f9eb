"""The conformance suite every scale format must pass, built-in or a plugin's.

Run it on one format:

    >>> from kvquant.registry import PerHeadFormat
    >>> from kvquant.testing.conformance import check_scale_format
    >>> check_scale_format(PerHeadFormat())

or parametrize pytest over every registered format (or your own list) with
:func:`conformance_cases`. The checks of a static format: ``canonical``,
``rejects-X`` for X in nan, inf, neg-inf, zero, negative, tiny, huge, int, bool
and other-shape, ``no-mutation``, ``deterministic``; of a dynamic one:
``reads-no-tensor``; of every format: ``contract``.

Users: docs/custom-formats.md. What each check requires: docs/dev/registry.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from kvquant.errors import ScaleFormatError
from kvquant.registry.formats import ScaleFormat
from kvquant.registry.policy import MAX_SCALE, MIN_SCALE, canonical_shape, format_shape
from kvquant.registry.registry import check_format_contract, default_registry
from kvquant.types import LayerGeometry, RawScale

__all__ = [
    "CONFORMANCE_GEOMETRIES",
    "ConformanceCase",
    "check_scale_format",
    "conformance_cases",
]

CONFORMANCE_GEOMETRIES: tuple[LayerGeometry, ...] = (
    LayerGeometry(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64),  # GQA
    LayerGeometry(num_layers=1, num_heads=4, num_kv_heads=4, head_dim=32),  # MHA
    LayerGeometry(num_layers=1, num_heads=6, num_kv_heads=1, head_dim=16),  # MQA
    LayerGeometry(num_layers=1, num_heads=9, num_kv_heads=3, head_dim=80),  # odd sizes
    LayerGeometry(num_layers=1, num_heads=32, num_kv_heads=8, head_dim=128),  # Llama-8B-like
)
"""Geometries the suite runs each format on (a format may decline some via check_geometry)."""

_BAD_VALUES: tuple[tuple[str, float], ...] = (
    ("rejects-nan", float("nan")),
    ("rejects-inf", float("inf")),
    ("rejects-neg-inf", float("-inf")),
    ("rejects-zero", 0.0),
    ("rejects-negative", -0.25),
    ("rejects-tiny", MIN_SCALE / 4),
    ("rejects-huge", MAX_SCALE * 4),
)


def _raw(tensor: torch.Tensor, shape: tuple[int, ...]) -> RawScale:
    return RawScale(
        layer=0,
        kind="k",
        name=f"conformance.layers.0.self_attn.k_scale{format_shape(shape)}",
        convention="conformance",
        tensor=tensor,
    )


def _good(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    numel = 1
    for d in shape:
        numel *= d
    values = torch.linspace(0.015625, 0.75, max(numel, 1), dtype=torch.float64)[:numel]
    return values.reshape(shape).to(dtype)


def _served(fmt: ScaleFormat, geometries: Sequence[LayerGeometry]) -> list[LayerGeometry]:
    served = []
    for geometry in geometries:
        try:
            fmt.check_geometry(geometry)
        except ScaleFormatError:
            continue
        served.append(geometry)
    return served


def _each_shape(
    fmt: ScaleFormat, geometries: Sequence[LayerGeometry]
) -> list[tuple[LayerGeometry, tuple[int, ...]]]:
    return [(g, tuple(s)) for g in _served(fmt, geometries) for s in fmt.raw_shapes(g)]


def _expect_reject(fmt: ScaleFormat, raw: RawScale, geometry: LayerGeometry, what: str) -> None:
    try:
        out = fmt.normalize(raw, geometry)
    except ScaleFormatError:
        return
    except Exception as exc:
        raise AssertionError(
            f"format {fmt.name!r} raised {type(exc).__name__} instead of ScaleFormatError "
            f"for {what} (shape {format_shape(raw.tensor.shape)}, {geometry}): {exc}"
        ) from exc
    raise AssertionError(
        f"format {fmt.name!r} accepted {what} (shape {format_shape(raw.tensor.shape)}, "
        f"{geometry}) and returned a {out.dtype} tensor of shape {format_shape(out.shape)}; "
        "expected ScaleFormatError"
    )


def _check_contract(fmt: ScaleFormat, geometries: Sequence[LayerGeometry]) -> None:
    check_format_contract(fmt)


def _check_canonical(fmt: ScaleFormat, geometries: Sequence[LayerGeometry]) -> None:
    for geometry, shape in _each_shape(fmt, geometries):
        expected = canonical_shape(fmt.granularity, geometry)
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raw = _raw(_good(shape, dtype), shape)
            out = fmt.normalize(raw, geometry)
            if not isinstance(out, torch.Tensor):
                raise AssertionError(f"format {fmt.name!r} returned {type(out).__name__}")
            problems = []
            if out.dtype != torch.float32:
                problems.append(f"dtype {out.dtype} (expected torch.float32)")
            if tuple(out.shape) != expected:
                problems.append(
                    f"shape {format_shape(out.shape)} (expected {format_shape(expected or ())})"
                )
            if out.device.type != "cpu":
                problems.append(f"device {out.device} (expected cpu)")
            if not bool(torch.isfinite(out).all()) or not bool((out > 0).all()):
                problems.append("non-finite or non-positive values")
            if problems:
                raise AssertionError(
                    f"format {fmt.name!r} on raw shape {format_shape(shape)} {dtype} "
                    f"({geometry}) returned " + ", ".join(problems)
                )


def _check_bad_value(value: float) -> Callable[[ScaleFormat, Sequence[LayerGeometry]], None]:
    def check(fmt: ScaleFormat, geometries: Sequence[LayerGeometry]) -> None:
        for geometry, shape in _each_shape(fmt, geometries):
            tensor = _good(shape, torch.float64)
            tensor.view(-1)[-1] = value
            _expect_reject(fmt, _raw(tensor, shape), geometry, f"a scale holding {value!r}")

    return check


def _check_int(dtype: torch.dtype) -> Callable[[ScaleFormat, Sequence[LayerGeometry]], None]:
    def check(fmt: ScaleFormat, geometries: Sequence[LayerGeometry]) -> None:
        for geometry, shape in _each_shape(fmt, geometries):
            tensor = torch.ones(shape, dtype=dtype)
            _expect_reject(fmt, _raw(tensor, shape), geometry, f"a {dtype} scale")

    return check


def _check_other_shape(fmt: ScaleFormat, geometries: Sequence[LayerGeometry]) -> None:
    for geometry in _served(fmt, geometries):
        claimed = set(fmt.raw_shapes(geometry))
        candidates = [
            (geometry.num_kv_heads + 5,),
            (2, 3, 5, 7),
            (geometry.num_kv_heads, geometry.head_dim + 3),
            (0,),
        ]
        for shape in candidates:
            if shape in claimed:
                continue
            _expect_reject(fmt, _raw(_good(shape), shape), geometry, f"an unclaimed shape {shape}")


def _check_no_mutation(fmt: ScaleFormat, geometries: Sequence[LayerGeometry]) -> None:
    for geometry, shape in _each_shape(fmt, geometries):
        tensor = _good(shape)
        before = tensor.clone()
        out = fmt.normalize(_raw(tensor, shape), geometry)
        if not torch.equal(tensor, before):
            raise AssertionError(
                f"format {fmt.name!r} modified its input (raw shape {format_shape(shape)})"
            )
        out.fill_(-1.0)  # the result must not alias the input
        if not torch.equal(tensor, before):
            raise AssertionError(
                f"format {fmt.name!r} returned a view of its input (raw shape "
                f"{format_shape(shape)}): writing the result changed the raw tensor"
            )


def _check_deterministic(fmt: ScaleFormat, geometries: Sequence[LayerGeometry]) -> None:
    for geometry, shape in _each_shape(fmt, geometries):
        first = fmt.normalize(_raw(_good(shape), shape), geometry)
        second = fmt.normalize(_raw(_good(shape), shape), geometry)
        if not torch.equal(first, second):
            raise AssertionError(
                f"format {fmt.name!r} is not deterministic on raw shape {format_shape(shape)}"
            )


def _check_dynamic(fmt: ScaleFormat, geometries: Sequence[LayerGeometry]) -> None:
    for geometry in geometries:
        shapes = fmt.raw_shapes(geometry)
        if shapes:
            raise AssertionError(f"dynamic format {fmt.name!r} claims raw shapes {shapes}")
        for shape in ((), (1,), (geometry.num_kv_heads,)):
            _expect_reject(fmt, _raw(_good(shape), shape), geometry, "a checkpoint tensor")


_Check = Callable[[ScaleFormat, Sequence[LayerGeometry]], None]

_STATIC_CHECKS: tuple[tuple[str, _Check], ...] = (
    ("contract", _check_contract),
    ("canonical", _check_canonical),
    *((name, _check_bad_value(value)) for name, value in _BAD_VALUES),
    ("rejects-int", _check_int(torch.int32)),
    ("rejects-bool", _check_int(torch.bool)),
    ("rejects-other-shape", _check_other_shape),
    ("no-mutation", _check_no_mutation),
    ("deterministic", _check_deterministic),
)

_DYNAMIC_CHECKS: tuple[tuple[str, _Check], ...] = (
    ("contract", _check_contract),
    ("reads-no-tensor", _check_dynamic),
)


@dataclass(frozen=True)
class ConformanceCase:
    """One check of one format; ``str(case)`` is a readable pytest id.

    Attributes:
        fmt: the format under test.
        check: the check's name (listed in the module docstring).
        geometries: the geometries it runs on.
    """

    fmt: ScaleFormat
    check: str
    geometries: tuple[LayerGeometry, ...] = CONFORMANCE_GEOMETRIES

    def run(self) -> None:
        """Run the check.

        Raises:
            AssertionError: the format breaks the rule (the message says how).
        """
        checks = dict(_DYNAMIC_CHECKS if self.fmt.dynamic else _STATIC_CHECKS)
        checks[self.check](self.fmt, self.geometries)

    def __str__(self) -> str:
        return f"{self.fmt.name}:{self.check}"


def conformance_cases(
    formats: Iterable[ScaleFormat] | None = None,
    geometries: Sequence[LayerGeometry] = CONFORMANCE_GEOMETRIES,
) -> list[ConformanceCase]:
    """Every check for every format, for ``pytest.mark.parametrize(..., ids=str)``.

    .. code-block:: python

        import pytest
        from kvquant.testing.conformance import conformance_cases

        @pytest.mark.parametrize("case", conformance_cases([MyFormat()]), ids=str)
        def test_my_format(case):
            case.run()

    Args:
        formats: the formats to test; ``None``: everything registered in the
            default registry now.
        geometries: the geometries each check runs on.

    Returns:
        One :class:`ConformanceCase` per (format, check).
    """
    chosen = default_registry.formats() if formats is None else tuple(formats)
    cases: list[ConformanceCase] = []
    for fmt in chosen:
        checks = _DYNAMIC_CHECKS if fmt.dynamic else _STATIC_CHECKS
        cases.extend(ConformanceCase(fmt, name, tuple(geometries)) for name, _ in checks)
    return cases


def check_scale_format(
    fmt: ScaleFormat, geometries: Sequence[LayerGeometry] = CONFORMANCE_GEOMETRIES
) -> None:
    """Run the whole suite on one format.

    Args:
        fmt: the format under test (registered or not).
        geometries: the geometries each check runs on.

    Raises:
        AssertionError: listing every failed check and why.
    """
    failures = []
    for case in conformance_cases([fmt], geometries):
        try:
            case.run()
        except Exception as exc:
            failures.append(f"{case}: {type(exc).__name__}: {exc}")
    if failures:
        raise AssertionError(
            f"format {fmt.name!r} fails {len(failures)} conformance check(s):\n  "
            + "\n  ".join(failures)
        )
