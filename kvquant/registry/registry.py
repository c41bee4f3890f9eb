"""The scale-format registry: one name per format, contracts checked at registration.

Example:
    >>> from kvquant.registry import get_scale_format, scale_format_names
    >>> scale_format_names()
    ('per-tensor', 'per-head', 'fp32-group', 'k-transform')
    >>> get_scale_format("per-head")
    PerHeadFormat()
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar, overload

import torch

from kvquant.errors import FormatRegistrationError, ScaleFormatError, UnknownFormatError
from kvquant.registry.formats import (
    Fp32GroupFormat,
    KTransformFormat,
    PerHeadFormat,
    PerTensorFormat,
    ScaleFormat,
)
from kvquant.registry.policy import canonical_shape, format_shape, fp8_granularities
from kvquant.schemes import scheme_class
from kvquant.types import LayerGeometry, RawScale

__all__ = [
    "BUILTIN_FORMATS",
    "ScaleFormatRegistry",
    "check_format_contract",
    "default_registry",
    "get_scale_format",
    "register_scale_format",
    "scale_format_names",
    "temporary_format",
]

F = TypeVar("F", bound=ScaleFormat)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
_RESERVED = frozenset({"auto"})

# Geometries the contract check runs a format on: MHA, GQA, MQA, odd sizes.
_CONTRACT_GEOMETRIES = (
    LayerGeometry(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64),
    LayerGeometry(num_layers=1, num_heads=4, num_kv_heads=4, head_dim=32),
    LayerGeometry(num_layers=1, num_heads=6, num_kv_heads=1, head_dim=16),
    LayerGeometry(num_layers=1, num_heads=9, num_kv_heads=3, head_dim=80),
)

BUILTIN_FORMATS: tuple[ScaleFormat, ...] = (
    PerTensorFormat(),
    PerHeadFormat(),
    Fp32GroupFormat(),
    KTransformFormat(),
)
"""The formats every registry starts with, in detection order."""


def _describe(fmt: object) -> str:
    cls = fmt if isinstance(fmt, type) else type(fmt)
    shown = repr(fmt) if not isinstance(fmt, type) else cls.__qualname__
    return f"{shown} (from {cls.__module__})"


def _synthetic_raw(shape: tuple[int, ...], name: str) -> RawScale:
    numel = 1
    for dim in shape:
        numel *= dim
    values = torch.linspace(0.01, 0.5, max(numel, 1), dtype=torch.float32)[:numel]
    return RawScale(
        layer=0, kind="k", name=name, convention="synthetic", tensor=values.reshape(shape)
    )


def check_format_contract(fmt: ScaleFormat) -> None:
    """Check what the registry promises about a format, before it is registered.

    Checks: a :class:`ScaleFormat` instance of a frozen dataclass, hashable; a
    valid ``name`` and ``granularity``; ``dynamic`` exactly when the
    granularity is ``fp32-group``; ``raw_shapes`` returns tuples of positive
    ints for four synthetic geometries (MHA, GQA, MQA, head_dim 80) and at least
    one shape somewhere for static formats; ``normalize`` turns a synthetic
    positive tensor of each claimed shape into fp32 of the canonical shape,
    finite and positive, twice identically, without touching its input.

    Args:
        fmt: the format instance.

    Raises:
        FormatRegistrationError: naming the format and the broken rule.
    """
    who = _describe(fmt)
    if not isinstance(fmt, ScaleFormat):
        raise FormatRegistrationError(
            f"{who} is not a kvquant.ScaleFormat; expected an instance of a "
            "@dataclass(frozen=True) subclass of kvquant.ScaleFormat. Fix: subclass ScaleFormat."
        )
    params = getattr(type(fmt), "__dataclass_params__", None)
    if not dataclasses.is_dataclass(fmt) or params is None or not params.frozen:
        raise FormatRegistrationError(
            f"{who} is not a frozen dataclass; formats are immutable value objects. "
            "Fix: decorate the class with @dataclass(frozen=True)."
        )
    try:
        hash(fmt)
    except TypeError as exc:
        raise FormatRegistrationError(
            f"{who} is not hashable ({exc}); expected a frozen dataclass of hashable fields. "
            "Fix: store tuples, not lists or tensors, in its fields."
        ) from None
    name = getattr(fmt, "name", None)
    if not isinstance(name, str) or not _NAME.match(name) or name in _RESERVED:
        raise FormatRegistrationError(
            f"{who} has name {name!r}; expected a non-empty string of letters, digits and "
            "'-_.+', not 'auto'. Fix: set the class attribute name = \"my-format\"."
        )
    granularity = getattr(fmt, "granularity", None)
    if granularity not in fp8_granularities():
        raise FormatRegistrationError(
            f"{who} has granularity {granularity!r}; expected one of {fp8_granularities()}. "
            "Fix: set the class attribute granularity to what convert() returns."
        )
    if bool(fmt.dynamic) != scheme_class(granularity).dynamic:
        raise FormatRegistrationError(
            f"{who} has dynamic={fmt.dynamic!r} with granularity {granularity!r}; dynamic "
            "formats (and only they) have granularity 'fp32-group'. Fix: make the two agree."
        )
    claimed_any = False
    for geometry in _CONTRACT_GEOMETRIES:
        try:
            shapes = fmt.raw_shapes(geometry)
        except Exception as exc:
            raise FormatRegistrationError(
                f"{who}.raw_shapes({geometry}) raised {type(exc).__name__}: {exc}. "
                "Fix: raw_shapes must return a tuple of shapes for any geometry."
            ) from exc
        if not isinstance(shapes, tuple) or not all(
            isinstance(s, tuple)
            and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in s)
            for s in shapes
        ):
            raise FormatRegistrationError(
                f"{who}.raw_shapes({geometry}) returned {shapes!r}; expected a tuple of "
                "tuples of positive ints, e.g. ((), (1,)). Fix: return tuples."
            )
        if fmt.dynamic and shapes:
            raise FormatRegistrationError(
                f"{who} is dynamic but claims raw shapes {shapes!r}; dynamic formats read no "
                "checkpoint tensor. Fix: return () from raw_shapes."
            )
        claimed_any = claimed_any or bool(shapes)
        try:
            fmt.check_geometry(geometry)
        except ScaleFormatError:
            continue  # the format does not serve this geometry: nothing to run
        for shape in shapes:
            _check_one_shape(fmt, who, shape, geometry)
    if not fmt.dynamic and not claimed_any:
        raise FormatRegistrationError(
            f"{who} is static but raw_shapes() claims no shape for any of the test geometries "
            f"{[dataclasses.astuple(g) for g in _CONTRACT_GEOMETRIES]}. "
            "Fix: return the shapes the producer stores."
        )


def _check_one_shape(
    fmt: ScaleFormat, who: str, shape: tuple[int, ...], geometry: LayerGeometry
) -> None:
    raw = _synthetic_raw(shape, f"synthetic{format_shape(shape)}")
    before = raw.tensor.clone()
    outputs = []
    for _ in range(2):
        try:
            outputs.append(fmt.normalize(raw, geometry))
        except ScaleFormatError as exc:
            raise FormatRegistrationError(
                f"{who} breaks the format contract on a synthetic positive fp32 tensor of "
                f"shape {format_shape(shape)} (claimed by raw_shapes({geometry})): {exc}"
            ) from exc
        except Exception as exc:
            raise FormatRegistrationError(
                f"{who}.normalize() failed on a synthetic positive fp32 tensor of shape "
                f"{format_shape(shape)} that raw_shapes({geometry}) claims: "
                f"{type(exc).__name__}: {exc}. Fix: make convert() accept every shape "
                "raw_shapes() returns."
            ) from exc
    expected = canonical_shape(fmt.granularity, geometry)
    out = outputs[0]
    if out.dtype != torch.float32 or tuple(out.shape) != expected:
        raise FormatRegistrationError(
            f"{who}.normalize() returned {str(out.dtype).removeprefix('torch.')} of shape {format_shape(out.shape)} for "
            f"raw shape {format_shape(shape)}; expected float32 of shape "
            f"{format_shape(expected or ())}. Fix: return the canonical tensor."
        )
    if not torch.equal(raw.tensor, before):
        raise FormatRegistrationError(
            f"{who}.normalize() modified its input tensor (raw shape {format_shape(shape)}). "
            "Fix: never write into the raw tensor."
        )
    if not torch.equal(outputs[0], outputs[1]):
        raise FormatRegistrationError(
            f"{who}.normalize() returned different values for the same input (raw shape "
            f"{format_shape(shape)}). Fix: make convert() deterministic."
        )


class ScaleFormatRegistry:
    """Formats by name, in registration order (built-ins first).

    Thread-safe. Names are unique: registering a taken name raises, naming both
    formats. Use :meth:`temporary` to register a format for the duration of a
    ``with`` block (tests).
    """

    def __init__(self, formats: Sequence[ScaleFormat] = BUILTIN_FORMATS) -> None:
        """Create a registry holding ``formats`` (contract-checked).

        Args:
            formats: the initial formats, protected from :meth:`unregister`.
        """
        self._lock = threading.RLock()
        self._formats: dict[str, ScaleFormat] = {}
        for fmt in formats:
            self.register(fmt)
        self._protected = frozenset(self._formats)

    def register(self, fmt: F) -> F:
        """Check a format's contract and add it under ``fmt.name``.

        Args:
            fmt: the format instance.

        Returns:
            ``fmt`` unchanged.

        Raises:
            FormatRegistrationError: the name is taken or the contract is broken.
        """
        check_format_contract(fmt)
        with self._lock:
            taken = self._formats.get(fmt.name)
            if taken is not None:
                raise FormatRegistrationError(
                    f"scale format name {fmt.name!r} is already registered to {_describe(taken)}; "
                    f"cannot also register {_describe(fmt)}. Fix: give the new format another "
                    "name, or use kvquant.registry.temporary_format() for a test-scoped one."
                )
            self._formats[fmt.name] = fmt
        return fmt

    def unregister(self, name: str) -> ScaleFormat:
        """Remove a user format.

        Args:
            name: its registered name.

        Returns:
            The removed format.

        Raises:
            UnknownFormatError: the name is not registered.
            FormatRegistrationError: the name is a built-in.
        """
        with self._lock:
            if name in self._protected:
                raise FormatRegistrationError(
                    f"scale format {name!r} is built in and cannot be unregistered. "
                    "Fix: register your format under another name."
                )
            fmt = self.get(name)
            del self._formats[name]
            return fmt

    def get(self, name: str) -> ScaleFormat:
        """The format registered under ``name``.

        Raises:
            UnknownFormatError: listing the registered names, the closest match
                and how to register a format.
        """
        with self._lock:
            fmt = self._formats.get(name) if isinstance(name, str) else None
            if fmt is not None:
                return fmt
            names = list(self._formats)
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownFormatError(
            f"unknown scale format {name!r}; registered: {', '.join(map(repr, names))} "
            f"(and 'auto', which picks one from the checkpoint's shapes).{hint} Fix: pass one "
            "of those, or register yours first: kvquant.register_scale_format(MyFormat()) "
            "with MyFormat a @dataclass(frozen=True) subclass of kvquant.ScaleFormat."
        )

    def names(self) -> tuple[str, ...]:
        """Registered names, in registration order."""
        with self._lock:
            return tuple(self._formats)

    def formats(self) -> tuple[ScaleFormat, ...]:
        """Registered formats, in registration order."""
        with self._lock:
            return tuple(self._formats.values())

    def detect(self, shape: Sequence[int], geometry: LayerGeometry) -> tuple[ScaleFormat, ...]:
        """Static formats that recognise a raw shape, in registration order.

        Args:
            shape: the raw tensor's shape.
            geometry: the model's attention geometry.
        """
        found = []
        for fmt in self.formats():
            if fmt.dynamic:
                continue
            try:
                fmt.check_geometry(geometry)
            except ScaleFormatError:
                continue  # the format declines this geometry
            if fmt.recognizes(shape, geometry):
                found.append(fmt)
        return tuple(found)

    def expected_shapes(self, geometry: LayerGeometry) -> tuple[tuple[int, ...], ...]:
        """Every raw shape some registered static format reads, for messages."""
        shapes: list[tuple[int, ...]] = []
        for fmt in self.formats():
            if fmt.dynamic:
                continue
            try:
                fmt.check_geometry(geometry)
            except ScaleFormatError:
                continue
            shapes.extend(fmt.raw_shapes(geometry))
        return tuple(dict.fromkeys(shapes))

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._formats

    @contextmanager
    def temporary(self, fmt: F) -> Iterator[F]:
        """Register ``fmt`` for the duration of a ``with`` block.

        Args:
            fmt: the format instance.

        Yields:
            ``fmt``, registered; it is unregistered when the block exits.

        Raises:
            FormatRegistrationError: as :meth:`register`.
        """
        self.register(fmt)
        try:
            yield fmt
        finally:
            with self._lock:
                if self._formats.get(fmt.name) is fmt:
                    del self._formats[fmt.name]


default_registry = ScaleFormatRegistry()
"""The process-wide registry :func:`register_scale_format` and ``resolve_scales`` use."""


@overload
def register_scale_format(fmt: type[F]) -> type[F]: ...


@overload
def register_scale_format(fmt: F) -> F: ...


def register_scale_format(fmt: F | type[F]) -> F | type[F]:
    """Register a scale format: call it with an instance, or decorate a class.

    A decorated class is instantiated with no arguments and that instance is
    registered; the class is returned unchanged. The format's contract is
    checked now (see :func:`check_format_contract`), not at its first use.

    Args:
        fmt: a :class:`ScaleFormat` instance, or a frozen-dataclass subclass.

    Returns:
        What was passed in.

    Raises:
        FormatRegistrationError: the name is taken (both formats are named) or
            the contract is broken.

    Example:
        >>> from dataclasses import dataclass
        >>> from kvquant.registry import ScaleFormat, default_registry, register_scale_format
        >>> @register_scale_format
        ... @dataclass(frozen=True)
        ... class InverseAmax(ScaleFormat):
        ...     '''A producer that stores 448 / amax: per-tensor, inverted on load.'''
        ...
        ...     name = "inverse-amax-doc"
        ...     granularity = "per-tensor"
        ...
        ...     def raw_shapes(self, geometry):
        ...         return ((), (1,))
        ...
        ...     def convert(self, values, geometry):
        ...         return (1.0 / values).reshape(())
        >>> "inverse-amax-doc" in default_registry.names()
        True
        >>> _ = default_registry.unregister("inverse-amax-doc")
    """
    if isinstance(fmt, type):
        if not issubclass(fmt, ScaleFormat):
            raise FormatRegistrationError(
                f"{_describe(fmt)} is not a subclass of kvquant.ScaleFormat. "
                "Fix: subclass ScaleFormat and decorate with @dataclass(frozen=True)."
            )
        try:
            instance = fmt()
        except Exception as exc:
            raise FormatRegistrationError(
                f"cannot instantiate {_describe(fmt)} with no arguments to register it "
                f"({type(exc).__name__}: {exc}). Fix: give every field a default, or "
                "register an instance: kvquant.register_scale_format(MyFormat(...))."
            ) from exc
        default_registry.register(instance)
        return fmt
    return default_registry.register(fmt)


def get_scale_format(name: str) -> ScaleFormat:
    """The format registered under ``name`` in the default registry.

    Raises:
        UnknownFormatError: listing the registered names and how to register.
    """
    return default_registry.get(name)


def scale_format_names() -> tuple[str, ...]:
    """Names registered in the default registry, in registration order."""
    return default_registry.names()


@contextmanager
def temporary_format(fmt: F) -> Iterator[F]:
    """Register ``fmt`` in the default registry for the duration of a ``with`` block.

    Args:
        fmt: the format instance.

    Yields:
        ``fmt``; unregistered again when the block exits (also on error).

    Raises:
        FormatRegistrationError: as :func:`register_scale_format`.
    """
    with default_registry.temporary(fmt) as registered:
        yield registered
