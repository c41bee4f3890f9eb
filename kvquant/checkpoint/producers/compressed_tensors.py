"""llm-compressor / compressed-tensors: ``self_attn.k_scale`` / ``v_scale``, ``(1,)`` or ``(Hkv,1,1)``.

Detected from ``quant_method``; a ``kv_cache_scheme`` with ``strategy``
``tensor`` or ``attn_head``. Before 2024-08 it named the scales
``k_proj.output_scale`` (read under its config).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvquant.checkpoint.findings import Finding
from kvquant.checkpoint.fp4_formats import Fp4Producer
from kvquant.checkpoint.producers.base import (
    GLOBAL_SCALE,
    OUTPUT_SCALE,
    SELF_ATTN,
    Producer,
    ScaleShape,
    stored_scheme,
)
from kvquant.errors import ScaleFormatError

__all__ = [
    "CompressedTensors",
    "compressed_tensors_config",
    "compressed_tensors_kv_scheme",
    "packaged_config",
    "packaged_kv_scheme",
]

_SCHEME_KEYS = ("num_bits", "type", "strategy", "dynamic", "symmetric")

_NVFP4_SCHEME = {"type": "float", "strategy": "tensor_group", "group_size": 16}
"""The ``kv_cache_scheme`` keys of an NVFP4 KV cache (llm-compressor's NVFP4 preset)."""


def _strategy(granularity: str) -> str:
    """compressed-tensors' ``strategy`` of a static scheme: ``attn_head`` per head, else ``tensor``."""
    return "attn_head" if stored_scheme(granularity).per_head else "tensor"


def compressed_tensors_kv_scheme(
    granularity: str, base: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``kv_cache_scheme`` llm-compressor writes for static FP8 KV scales.

    Args:
        granularity: ``"per-head"`` (``strategy: attn_head``) or ``"per-tensor"``
            (``strategy: tensor``).
        base: an existing scheme to keep; only its ``num_bits``, ``type``,
            ``strategy``, ``dynamic`` and ``symmetric`` are replaced.

    Returns:
        A new dict.
    """
    scheme: dict[str, Any] = {
        "num_bits": 8,
        "type": "float",
        "strategy": _strategy(granularity),
        "dynamic": False,
        "symmetric": True,
        "group_size": None,
        "block_structure": None,
        "observer": "minmax",
        "scale_dtype": None,
        "zp_dtype": None,
        "actorder": None,
    }
    if base:
        merged = dict(base)
        for key in _SCHEME_KEYS:
            merged[key] = scheme[key]
        return merged
    return scheme


def compressed_tensors_config(granularity: str, *, version: str | None = None) -> dict[str, Any]:
    """A KV-only compressed-tensors ``quantization_config`` (weights left unquantized).

    Args:
        granularity: see :func:`compressed_tensors_kv_scheme`.
        version: the ``version`` entry; left out when None.

    Returns:
        A new dict.
    """
    out: dict[str, Any] = {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "compressed",
        "config_groups": {},
        "ignore": [],
    }
    if version is not None:
        out["version"] = version
    out["kv_cache_scheme"] = compressed_tensors_kv_scheme(granularity)
    return out


def packaged_kv_scheme(
    granularity: str, *, observer: str = "minmax", base: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``kv_cache_scheme`` of static FP8 K/V scales, as compressed-tensors writes it.

    Built with compressed-tensors' own ``QuantizationArgs`` where that package is
    installed, else :func:`compressed_tensors_kv_scheme`'s hand-written dict
    (the two agree: tested).

    Args:
        granularity: ``"per-tensor"`` (``strategy: tensor``) or ``"per-head"``
            (``strategy: attn_head``).
        observer: how the scales were chosen (``"minmax"``: amax / 448; ``"mse"``:
            a clipping search minimising the quantization error).
        base: an existing scheme whose other keys are kept.

    Returns:
        A new JSON-ready dict.
    """
    scheme = compressed_tensors_kv_scheme(granularity)
    scheme["observer"] = observer
    try:
        from compressed_tensors.quantization import QuantizationArgs
    except ImportError:
        built = scheme
    else:
        built = QuantizationArgs(
            num_bits=8,
            type="float",
            strategy=_strategy(granularity),
            dynamic=False,
            symmetric=True,
            observer=observer,
        ).model_dump(mode="json")
    if not base:
        return built
    merged = dict(base)
    for key in (*_SCHEME_KEYS, "observer"):
        merged[key] = built[key]
    return merged


def packaged_config(
    granularity: str, *, observer: str = "minmax", version: str | None = None
) -> dict[str, Any]:
    """A KV-only compressed-tensors ``quantization_config`` (weights left unquantized).

    Built with compressed-tensors' ``QuantizationConfig`` where installed, else
    :func:`compressed_tensors_config`'s dict.

    Args:
        granularity: see :func:`packaged_kv_scheme`.
        observer: see :func:`packaged_kv_scheme`.
        version: the ``version`` entry; left out when None.

    Returns:
        A new JSON-ready dict.
    """
    scheme = packaged_kv_scheme(granularity, observer=observer)
    try:
        from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
    except ImportError:
        out = compressed_tensors_config(granularity, version=version)
        out["kv_cache_scheme"] = scheme
        return out
    config = QuantizationConfig(
        config_groups={},
        kv_cache_scheme=QuantizationArgs.model_validate(scheme),
        quantization_status="compressed",
        format="dense",
        ignore=[],
    )
    out = config.model_dump(mode="json")
    if version is not None:
        out["version"] = version
    return out


class CompressedTensors(Producer):
    """llm-compressor's compressed-tensors export (``strategy: tensor`` or ``attn_head``)."""

    name = "compressed-tensors"
    names = SELF_ATTN
    also_reads = (OUTPUT_SCALE, GLOBAL_SCALE)
    quant_methods = ("compressed-tensors", "compressed_tensors")
    default_dtype = torch.bfloat16
    per_tensor_shape = ScaleShape.ONE
    per_head = True
    keeps_weights = True
    # llm-compressor's NVFP4 KV: k/v_global_scale, fp32 (1,), a quantization multiplier
    fp4 = Fp4Producer(
        name,
        "(6*448)/amax",
        (GLOBAL_SCALE.suffixes["k"],),
        (GLOBAL_SCALE.suffixes["v"],),
    )

    def kv_scheme(
        self, qcfg: Mapping[str, Any] | None, hf_quant: Mapping[str, Any] | None
    ) -> dict[str, Any] | None:
        scheme = qcfg.get("kv_cache_scheme") if qcfg else None
        return dict(scheme) if isinstance(scheme, Mapping) else None

    def kv_formats(
        self, qcfg: Mapping[str, Any] | None, hf_quant: Mapping[str, Any] | None, num_layers: int
    ) -> tuple[tuple[str, str], ...] | None:
        scheme = qcfg.get("kv_cache_scheme") if qcfg else None
        if not isinstance(scheme, Mapping) or scheme.get("num_bits") != 4:
            return None
        found = {k: scheme.get(k) for k in _NVFP4_SCHEME}
        scale_dtype = scheme.get("scale_dtype")
        fp8_scales = scale_dtype is None or "e4m3" in str(scale_dtype).lower()
        if (
            found != _NVFP4_SCHEME
            or not fp8_scales
            or scheme.get("symmetric") is False
            or scheme.get("dynamic") is True
        ):
            mx = found.get("group_size") == 32 or not fp8_scales
            raise ScaleFormatError(
                f"quantization_config.kv_cache_scheme: found num_bits 4 with {found}, "
                f"scale_dtype {scale_dtype!r}, symmetric {scheme.get('symmetric')!r}, dynamic "
                f"{scheme.get('dynamic')!r}; expected NVFP4 ({_NVFP4_SCHEME}, e4m3 block "
                "scales, symmetric, a static global scale: dynamic 'local' or false). "
                + (
                    "MXFP4 block scales are computed when tokens are written; kvquant reads "
                    "no stored MXFP4 KV scales. Fix: serve with kvquant.patch(model, "
                    "kv_format='mxfp4') on the model without this config, or export NVFP4 KV."
                    if mx
                    else "Fix: export the KV cache with llm-compressor's NVFP4 scheme."
                )
            )
        return (("nvfp4", "nvfp4"),) * num_layers

    def scale_facts(
        self, family: str, qcfg: Mapping[str, Any] | None
    ) -> tuple[bool, bool, tuple[str, ...]]:
        if family == GLOBAL_SCALE.family:
            return False, False, ("NVFP4 global scale, stored as (6*448)/amax",)
        if family == OUTPUT_SCALE.family:
            return False, False, ("pre-2024-08 compressed-tensors naming (k_proj.output_scale)",)
        return False, False, ()

    def config_findings(self, qcfg: Mapping[str, Any]) -> list[Finding]:
        if not qcfg.get("config_groups"):
            return []
        return [
            Finding(
                "info",
                "ct-weight-quantization",
                f"compressed-tensors also quantizes weights (format {qcfg.get('format')!r}): "
                "loading the weights needs the compressed-tensors package.",
            )
        ]

    def config_quantizes_weights(self, qcfg: Mapping[str, Any]) -> bool:
        return bool(qcfg.get("config_groups"))

    def configs(
        self,
        *,
        granularity: str = "per-tensor",
        fp8_weights: bool = False,
        post_rope: bool = False,
        scale_dtype: torch.dtype | None = None,
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        return compressed_tensors_config(granularity, version="0.19.0"), None

    def export_configs(
        self,
        granularity: str,
        qcfg: Mapping[str, Any] | None,
        hf_quant: Mapping[str, Any] | None,
        *,
        same_producer: bool,
        weights: str | None,
        observer: str = "minmax",
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        out = dict(qcfg or {})
        if weights is not None and same_producer:
            out["kv_cache_scheme"] = packaged_kv_scheme(
                granularity, observer=observer, base=out.get("kv_cache_scheme")
            )
            return out, None
        version = out.get("version") if same_producer else None
        return packaged_config(granularity, observer=observer, version=version), None
