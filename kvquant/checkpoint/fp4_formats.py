"""A checkpoint's 4-bit KV layout: the global-scale conventions, a producer's declaration of
its NVFP4 tensors, and ModelOpt's ``kv_cache_quant_algo`` and layer map.

:data:`CONVENTIONS` is the one table of what a stored global-scale number means; a producer
declares its own layout (:class:`Fp4Producer`: convention and tensor names) as its
:attr:`~kvquant.checkpoint.producers.Producer.fp4` attribute, in its own file. The ModelOpt
producer reads its format map here (:meth:`~kvquant.checkpoint.producers.Producer.kv_formats`).
:mod:`kvquant.registry.fp4` re-exports all of it beside the normalization.
Sources: docs/dev/fp4-formats.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvquant.errors import ConventionError, ScaleFormatError
from kvquant.kernels.fp4 import E2M1_MAX, E4M3_MAX

__all__ = [
    "CONVENTIONS",
    "Fp4Producer",
    "GlobalScaleConvention",
    "kv_formats_by_layer",
    "kv_formats_per_layer",
]


@dataclass(frozen=True)
class GlobalScaleConvention:
    """What a stored global-scale number means: ``g = stored * factor`` or ``factor / stored``.

    Attributes:
        name: the stored number in terms of the calibrated amax, e.g. ``"amax/448"``.
        factor: the constant relating it to the canonical ``amax / (6 * 448)``.
        reciprocal: the stored number is a quantization multiplier (``g = factor / stored``).
    """

    name: str
    factor: float
    reciprocal: bool = False

    def canonical(self, stored: torch.Tensor) -> torch.Tensor:
        """The canonical ``g`` (float64) of stored values (float64)."""
        return self.factor / stored if self.reciprocal else stored * self.factor


CONVENTIONS: dict[str, GlobalScaleConvention] = {
    c.name: c
    for c in (
        GlobalScaleConvention("amax/(6*448)", 1.0),
        GlobalScaleConvention("amax/448", 1.0 / E2M1_MAX),
        GlobalScaleConvention("amax/6", 1.0 / E4M3_MAX),
        GlobalScaleConvention("(6*448)/amax", 1.0, reciprocal=True),
    )
}
"""The known global-scale conventions, by the number they store."""


@dataclass(frozen=True)
class Fp4Producer:
    """One producer's 4-bit KV checkpoint layout (a producer's ``fp4`` attribute).

    Attributes:
        name: the producer (the name discovery reports).
        convention: a key of :data:`CONVENTIONS`.
        k_names: K global-scale tensor names, relative to the layer (``model.layers.N``).
        v_names: the V names.
        confirmed: whether the convention was read in the producer's code (else from its
            description only; docs/dev/fp4-formats.md says which).

    Raises:
        ConventionError: a convention that is not a key of :data:`CONVENTIONS`.
    """

    name: str
    convention: str
    k_names: tuple[str, ...]
    v_names: tuple[str, ...]
    confirmed: bool = True

    def __post_init__(self) -> None:
        if self.convention not in CONVENTIONS:
            raise ConventionError(
                f"{self.name}: global-scale convention {self.convention!r} is not known; "
                f"expected one of {sorted(CONVENTIONS)}. Fix: declare one of those."
            )


_ALGOS = {"FP8": ("fp8", "fp8"), "NVFP4": ("nvfp4", "nvfp4"), "FP8_K_NVFP4_V": ("fp8", "nvfp4")}


def _algo(algo: object, where: str) -> tuple[str, str]:
    if algo not in _ALGOS:
        raise ScaleFormatError(
            f"{where}: found KV cache algorithm {algo!r}; expected one of {sorted(_ALGOS)}. "
            "Fix: export the KV cache as FP8 or NVFP4 (affine NVFP4 and INT8 are not read; "
            "MXFP4 KV scales are computed when tokens are written, kv_format='mxfp4', never "
            "read from a checkpoint)."
        )
    return _ALGOS[str(algo)]


def kv_formats_by_layer(quantization: Mapping[str, object]) -> dict[str, tuple[str, str]]:
    """The per-layer ``(K format, V format)`` map of a ModelOpt quantization config.

    Reads ``kv_cache_quant_algo`` and, for ModelOpt's layer-wise KV AutoQuant,
    ``kv_cache_quantized_layers`` (``{"model.layers.0.self_attn": {"quant_algo": "NVFP4"}}``,
    ``kv_cache_schema_version`` 1) from ``hf_quant_config.json``'s ``quantization`` (or the
    ``quantization_config`` of ``config.json``, which carries the same keys).

    Returns:
        ``{attention module: (k, v)}`` with ``"fp8"`` / ``"nvfp4"``; ``{}`` when the config
        has no layer map (one model-wide algorithm: read ``kv_cache_quant_algo`` itself).

    Raises:
        ScaleFormatError: an unknown algorithm or schema version, or a malformed map.
    """
    layers = quantization.get("kv_cache_quantized_layers")
    if layers is None:
        if quantization.get("kv_cache_quant_algo") == "MIXED_PRECISION":
            raise ScaleFormatError(
                "quantization: kv_cache_quant_algo is MIXED_PRECISION but there is no "
                "kv_cache_quantized_layers map; expected one entry per attention layer. Fix: "
                "re-export the checkpoint with its layer map."
            )
        return {}
    version = quantization.get("kv_cache_schema_version")
    if version != 1 or not isinstance(layers, Mapping):
        raise ScaleFormatError(
            f"quantization: found kv_cache_schema_version {version!r} and a "
            f"{type(layers).__name__} layer map; expected version 1 and a mapping of layer "
            "names to {'quant_algo': ...}. Fix: upgrade kvquant, or re-export the checkpoint."
        )
    out = {}
    for name, entry in layers.items():
        algo = entry.get("quant_algo") if isinstance(entry, Mapping) else entry
        out[str(name)] = _algo(algo, f"kv_cache_quantized_layers[{name!r}]")
    return out


_LAYER_MODULE = re.compile(r"^(?:.*\.)?layers\.(\d+)\.self_attn$")


def kv_formats_per_layer(
    quantization: Mapping[str, object], num_layers: int
) -> tuple[tuple[str, str], ...]:
    """ModelOpt's ``kv_cache_quant_algo`` (and layer map) as one ``(K, V)`` format per layer.

    Args:
        quantization: ``hf_quant_config.json``'s ``quantization`` (or ``config.json``'s
            ``quantization_config``, which carries the same keys).
        num_layers: the model's decoder layers.

    Returns:
        ``(k, v)`` per layer, ``"fp8"`` / ``"nvfp4"``.

    Raises:
        ScaleFormatError: an algorithm kvquant does not read (``NVFP4_AFFINE``, ``MXFP4``,
            ``INT8``, ...), a malformed map, a map entry that is not an attention layer
            (``model.layers.N.self_attn``) or a layer the map leaves out.

    Example:
        >>> kv_formats_per_layer({"kv_cache_quant_algo": "FP8_K_NVFP4_V"}, 2)
        (('fp8', 'nvfp4'), ('fp8', 'nvfp4'))
    """
    by_name = kv_formats_by_layer(quantization)
    if not by_name:
        algo = quantization.get("kv_cache_quant_algo")
        return (_algo(algo, "quantization.kv_cache_quant_algo"),) * num_layers
    out: dict[int, tuple[str, str]] = {}
    for name, formats in by_name.items():
        m = _LAYER_MODULE.match(name)
        if m is None or int(m.group(1)) >= num_layers:
            raise ScaleFormatError(
                f"kv_cache_quantized_layers[{name!r}]: found a name that is not an attention "
                f"layer of this {num_layers}-layer model; expected 'model.layers.N.self_attn' "
                "with N below the layer count. Fix: use the config written with the weights."
            )
        out[int(m.group(1))] = formats
    missing = [i for i in range(num_layers) if i not in out]
    if missing:
        raise ScaleFormatError(
            f"kv_cache_quantized_layers: found no entry for layer(s) {missing}; expected one "
            "(quant_algo FP8 or NVFP4) per attention layer: kvquant stores every layer's KV "
            "cache quantized. Fix: re-export with every layer in the map."
        )
    return tuple(out[i] for i in range(num_layers))
