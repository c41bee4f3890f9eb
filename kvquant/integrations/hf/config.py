"""kvquant's options, defined once: the fields of :class:`PatchOptions` and their checks.

:class:`~kvquant.KVQuantConfig` (in :mod:`kvquant.integrations.transformers_quantizer`,
where transformers' quantizer plugin registers it) holds these options;
``kvquant.patch(model, KVQuantConfig(page_size=32))`` and
``from_pretrained(path, quantization_config=KVQuantConfig(page_size=32))`` take the same
object (the torchao shape), and ``kvquant.patch(model, page_size=32)`` is sugar for the
first. :class:`PatchOptions` is the frozen value a patch keeps (compared for
idempotence); it adds where the scales came from. This module imports no transformers.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvquant.cache import MAX_PAGE_SIZE
from kvquant.choices import (
    Backend,
    KRotation,
    KVFormat,
    KVFormatMap,
    MissingKV,
    MissingScales,
    RopePolicy,
    check_kv_format,
    coerce_choice,
)
from kvquant.errors import KVQuantError, OptionError, OptionTypeError
from kvquant.kernels.backend import BACKENDS
from kvquant.registry.options import ResolveOptions

__all__ = [
    "CONFIG_VERSION",
    "OPTION_NAMES",
    "SAVED_KEYS",
    "PatchOptions",
    "check_config_version",
    "check_option_names",
    "check_options",
    "coerce_kv_format",
]


@dataclass(frozen=True)
class PatchOptions:
    """The settings of one :func:`kvquant.patch` (a :class:`KVQuantConfig`'s values, frozen).

    Attributes:
        scale_format: see :class:`~kvquant.KVQuantConfig` (each field below too).
        missing_scales: ``"dynamic"``, ``"error"`` or ``"unit"``.
        group_size: ``G`` of the dynamic ``fp32-group`` format, or None.
        missing_kv: ``"error"`` or ``"reuse"``.
        rope_policy: ``"widen"`` or ``"keep"``.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        page_size: token slots per page.
        max_cache_tokens: token slots of a cache (whole batch), or None.
        num_pages: pages of a cache, or None.
        cuda_graphs: None (auto), True or False.
        compile_step: None (auto), True or False.
        prefill_tokens: the most tokens one prefill forward processes: ``"auto"``,
            an int or None.
        kv_format: how K and V are stored: a :class:`~kvquant.choices.KVFormat`, or a
            per-layer map ``{layer index or "default": KVFormat}``
            (:func:`~kvquant.choices.layer_kv_formats` gives each layer's).
        k_rotation: None or ``"hadamard"`` (:class:`~kvquant.choices.KRotation`): K rotated
            before its dynamic ``fp32-group`` scales or its ``nvfp4`` / ``mxfp4`` blocks.
        recent_tokens: each sequence's newest tokens attended at full precision: ``"auto"``
            (:data:`~kvquant.cache.storage.recent.AUTO_RECENT_TOKENS`; none under continuous
            batching, whose every block would keep a ring), an int, or 0 for none.
        source: a description of where the scales came from (not an option).
    """

    scale_format: str
    missing_scales: str
    group_size: int | None
    missing_kv: str
    rope_policy: str
    backend: str
    page_size: int
    max_cache_tokens: int | None
    num_pages: int | None
    cuda_graphs: bool | None
    compile_step: bool | None
    prefill_tokens: int | str | None
    kv_format: str | KVFormatMap = "fp8"
    k_rotation: str | None = None
    recent_tokens: int | str = "auto"
    source: str = ""

    def __post_init__(self) -> None:
        # the words as typed choices (a word that names none is left for check_options)
        for name, kind in (
            ("backend", Backend),
            ("missing_scales", MissingScales),
            ("missing_kv", MissingKV),
            ("rope_policy", RopePolicy),
        ):
            object.__setattr__(self, name, coerce_choice(kind, getattr(self, name)))
        object.__setattr__(self, "kv_format", coerce_kv_format(self.kv_format))
        if self.k_rotation is not None:
            object.__setattr__(self, "k_rotation", coerce_choice(KRotation, self.k_rotation))

    @property
    def recent_auto(self) -> bool:
        """Whether ``recent_tokens`` is the default ``"auto"`` (continuous batching keeps no
        ring then)."""
        return isinstance(self.recent_tokens, str) and self.recent_tokens == "auto"

    @property
    def resolve_options(self) -> ResolveOptions:
        """The registry options of this patch (what ``kvquant doctor`` resolves with)."""
        return ResolveOptions(
            scale_format=self.scale_format,
            missing_scales=self.missing_scales,
            group_size=self.group_size,
            missing_kv=self.missing_kv,
            rope_policy=self.rope_policy,
        )


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(PatchOptions) if f.name != "source")
"""The options :class:`~kvquant.KVQuantConfig` takes (and :func:`kvquant.patch` as keywords)."""

CONFIG_VERSION = 1
"""The version of the saved config's layout (``config_version`` in ``config.json``); a config
saved without one is version 1."""

SAVED_KEYS = frozenset({"quant_method", "config_version"})
"""Keys of a saved config that are not options (``save_pretrained`` writes them)."""


def coerce_kv_format(value: Any) -> Any:
    """``value`` as :func:`~kvquant.choices.check_kv_format` returns it where it accepts it;
    otherwise unchanged (for :func:`check_options`, which words the error)."""
    try:
        return check_kv_format(value, "kv_format")
    except KVQuantError:
        return value


def check_config_version(saved: Mapping[str, Any], owner: str) -> None:
    """Refuse a saved config written by a newer kvquant, whose options this one may misread.

    Raises:
        OptionError: ``config_version`` is not an int from 1 to :data:`CONFIG_VERSION`.
    """
    version = saved.get("config_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version:
        raise OptionError(
            f"{owner}: config_version={version!r}; expected an int from 1 to {CONFIG_VERSION}. "
            "Fix: remove the key from the saved config, or save it again."
        )
    if version > CONFIG_VERSION:
        raise OptionError(
            f"{owner}: the config was saved by a newer kvquant (config_version={version}); "
            f"this one reads up to {CONFIG_VERSION}. Fix: upgrade kvquant-fp8."
        )


def check_option_names(names: Mapping[str, Any] | set[str], owner: str) -> None:
    """Refuse a keyword that is not an option (a typo would otherwise be ignored).

    Raises:
        OptionTypeError: an unknown name (a ``TypeError``, as Python's own), with
            the closest option name.
    """
    for name in names:
        if name in OPTION_NAMES:
            continue
        close = difflib.get_close_matches(name, OPTION_NAMES, n=1)
        hint = f"Did you mean {close[0]!r}? " if close else ""
        raise OptionTypeError(
            f"{owner}: unknown option {name!r}. {hint}Expected one of: {', '.join(OPTION_NAMES)}."
        )


def check_options(opts: PatchOptions, owner: str = "KVQuantConfig") -> None:
    """Refuse bad option values (:class:`~kvquant.errors.OptionError`, a ``ValueError``) before any change."""

    def positive(name: str, value: object, optional: bool = False, limit: int = 0) -> None:
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OptionError(
                f"{owner}: {name}={value!r}; expected a positive int"
                + (" or None" if optional else "")
                + f". Fix: pass {name}=<int >= 1>."
            )
        if limit and value > limit:
            raise OptionError(
                f"{owner}: {name}={value}; expected at most {limit}. Fix: pass "
                f"{name} in 1..{limit} (16, 32 or 64 are typical page sizes)."
            )

    positive("page_size", opts.page_size, limit=MAX_PAGE_SIZE)
    positive("group_size", opts.group_size, optional=True)
    positive("max_cache_tokens", opts.max_cache_tokens, optional=True)
    positive("num_pages", opts.num_pages, optional=True)
    if opts.prefill_tokens != "auto":
        if isinstance(opts.prefill_tokens, str):
            raise OptionError(
                f'{owner}: prefill_tokens={opts.prefill_tokens!r}; expected "auto", a positive '
                'int or None. Fix: pass prefill_tokens="auto" (the default).'
            )
        positive("prefill_tokens", opts.prefill_tokens, optional=True)
    for name in ("cuda_graphs", "compile_step"):
        value = getattr(opts, name)
        if value is not None and not isinstance(value, bool):
            raise OptionTypeError(
                f"{owner}: {name}={value!r}; expected None (auto), True or False."
            )
    if opts.compile_step and opts.cuda_graphs is False:
        raise OptionError(
            f"{owner}: compile_step=True with cuda_graphs=False; the compiled layers run "
            "only in the decode-graph step. Fix: pass cuda_graphs=None (or True) with "
            "compile_step=True, or compile_step=None."
        )
    checked = check_kv_format(opts.kv_format, owner)
    used = set(checked.values()) if isinstance(checked, dict) else {checked}
    if used <= {KVFormat.NVFP4, KVFormat.MXFP4}:  # no layer reads scales or groups
        words = "/".join(sorted(str(f) for f in used))
        given = (
            f"kv_format={words!r}"
            if not isinstance(checked, dict)
            else f"kv_format (every layer {words})"
        )
        if opts.group_size is not None:
            raise OptionError(
                f"{owner}: group_size={opts.group_size} with {given}, whose "
                "scale blocks are fixed (16 channels for nvfp4, 32 for mxfp4). Fix: drop "
                "group_size (it sizes the FP8 fp32-group format)."
            )
        if opts.scale_format != "auto":
            raise OptionError(
                f"{owner}: scale_format={opts.scale_format!r} with {given}, "
                "which computes its scales as tokens are written and reads none. Fix: drop "
                "scale_format, or pass kv_format='fp8'."
            )
    _check_k_rotation(opts, owner, used)
    _check_recent_tokens(opts.recent_tokens, owner)
    if opts.backend not in BACKENDS:
        raise OptionError(
            f"{owner}: backend={opts.backend!r}; expected one of {BACKENDS}. "
            "Fix: pass backend='auto'."
        )


def _check_recent_tokens(value: object, owner: str) -> None:
    """``recent_tokens``: ``"auto"`` or an int from 0 to
    :data:`~kvquant.cache.storage.recent.MAX_RECENT_TOKENS`."""
    from kvquant.cache.storage.recent import MAX_RECENT_TOKENS

    if isinstance(value, str) and value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionTypeError(
            f"{owner}: recent_tokens={value!r}; expected 'auto' or an int from 0 to "
            f"{MAX_RECENT_TOKENS}. Fix: pass recent_tokens='auto' (the default), e.g. 16, or "
            "0 for none."
        )
    if not 0 <= value <= MAX_RECENT_TOKENS:
        raise OptionError(
            f"{owner}: recent_tokens={value}; expected 0..{MAX_RECENT_TOKENS}. Fix: pass e.g. "
            "recent_tokens=16, or 0 for none."
        )


_STATIC_FORMATS = frozenset({"per-tensor", "per-head", "k-transform"})
"""Built-in scale formats with static scales (a K rotation before group scales does not apply)."""


def _check_k_rotation(opts: PatchOptions, owner: str, used: set[KVFormat]) -> None:
    """``k_rotation``: None or ``"hadamard"``; not with ``fp8-k-nvfp4-v`` layers (``used``: the
    layers' formats), nor with a static scale format or scales but where every layer is 4-bit
    on both sides (no FP8 scale read)."""
    value = opts.k_rotation
    if value is None:
        return
    if not isinstance(value, str):
        raise OptionTypeError(
            f"{owner}: k_rotation={value!r}; expected None or one of {KRotation.values()}. "
            "Fix: pass k_rotation='hadamard', or leave it None."
        )
    if value not in KRotation.values():
        raise OptionError(
            f"{owner}: k_rotation={value!r}; expected None or one of {KRotation.values()}. "
            "Fix: pass k_rotation='hadamard', or leave it None."
        )
    if KVFormat.FP8_K_NVFP4_V in used:
        raise OptionError(
            f"{owner}: k_rotation={value!r} with kv_format 'fp8-k-nvfp4-v', whose FP8 K has a "
            "static scale calibrated on K as the model computes it (a rotated K would need its "
            "own; a k-transform checkpoint brings its rotation with it). Fix: drop k_rotation, "
            "or pass kv_format='nvfp4' (4-bit K, rotated without calibration)."
        )
    if used <= {KVFormat.NVFP4, KVFormat.MXFP4}:
        return
    fmt = opts.scale_format
    if isinstance(fmt, str) and fmt in _STATIC_FORMATS:
        raise OptionError(
            f"{owner}: k_rotation={value!r} with scale_format={fmt!r}; the rotation applies to "
            "the dynamic fp32-group scales only (the k-transform format carries its own "
            "rotation). Fix: drop k_rotation, or pass scale_format='fp32-group' (or 'auto' for "
            "a model without scales)."
        )
    if opts.missing_scales == "unit":
        raise OptionError(
            f"{owner}: k_rotation={value!r} with missing_scales='unit', whose static scales of "
            "1.0 take no rotation. Fix: drop k_rotation, or pass missing_scales='dynamic' (the "
            "fp32-group scales it rotates K for)."
        )
