"""Synthetic 4-bit KV checkpoints: each producer's NVFP4 KV layout (docs/dev/fp4-formats.md).

:func:`write_fp4_checkpoint` writes a tiny Llama checkpoint whose KV cache is declared and
stored as one producer exports NVFP4 KV: ``"modelopt"`` (``k_proj.k_scale`` = ``amax / 2688``,
``kv_cache_quant_algo: "NVFP4"``), ``"modelopt-mixed"`` (``MIXED_PRECISION``, a layer map; an
FP8 side stores ``amax / 448``), ``"compressed-tensors"`` (``k_global_scale`` = ``2688 / amax``).

Example:
    >>> import tempfile
    >>> from kvquant.checkpoint.discovery import discover_scales
    >>> with tempfile.TemporaryDirectory() as d:
    ...     found = discover_scales(write_fp4_checkpoint(d, "compressed-tensors", weights="none"))
    >>> found.producer, found.kv_formats
    ('compressed-tensors', (('nvfp4', 'nvfp4'), ('nvfp4', 'nvfp4')))
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvquant.schemes import fp4_format
from kvquant.testing.synthetic import write_checkpoint

__all__ = ["FP4_LAYOUTS", "default_amax", "write_fp4_checkpoint"]

_ALGO = {("fp8", "fp8"): "FP8", ("nvfp4", "nvfp4"): "NVFP4", ("fp8", "nvfp4"): "FP8_K_NVFP4_V"}
_CANONICAL = 6.0 * 448.0


def default_amax(num_layers: int) -> dict[tuple[int, str], float]:
    """The calibrated amax of each layer's K and V: K ``3 * (l + 1)``, V ``2 * (l + 1)``."""
    return {(i, kind): (3.0 if kind == "k" else 2.0) * (i + 1)
            for i in range(num_layers) for kind in ("k", "v")}  # fmt: skip


def write_fp4_checkpoint(
    path: str | Path,
    layout: str,
    *,
    amax: Mapping[tuple[int, str], float] | None = None,
    layer_formats: Sequence[tuple[str, str]] | None = None,
    num_layers: int = 2,
    hf_quant_updates: Mapping[str, Any] | None = None,
    **options: Any,
) -> Path:
    """Write a tiny checkpoint whose KV cache is NVFP4 in one producer's layout.

    Args:
        path: the folder.
        layout: one of :data:`FP4_LAYOUTS`.
        amax: the calibrated amax per ``(layer, "k"|"v")`` (default :func:`default_amax`);
            each tensor stores it in the producer's number.
        layer_formats: ``"modelopt-mixed"`` only: ``(K, V)`` per layer, ``"fp8"`` /
            ``"nvfp4"`` (default: layer 0 FP8, the others NVFP4).
        num_layers: decoder layers.
        hf_quant_updates: keys merged into ``hf_quant_config.json``'s ``quantization``.
        options: more :func:`write_checkpoint` options (``weights``, ``head_dim``, ``scales``
            to store other tensors as given, ``quant_config_updates``, ...).

    Returns:
        The checkpoint folder.

    Raises:
        ValueError: an unknown layout, or ``layer_formats`` outside ``"modelopt-mixed"``.
    """
    spec = _LAYOUTS.get(layout)
    if spec is None:
        raise ValueError(f"unknown layout {layout!r}; expected one of {FP4_LAYOUTS}")
    if layer_formats is not None and not spec.mixed:
        raise ValueError("layer_formats is a 'modelopt-mixed' option")
    values = {**default_amax(num_layers), **dict(amax or {})}
    if spec.mixed:
        formats = list(layer_formats or [("fp8", "fp8")] + [("nvfp4", "nvfp4")] * (num_layers - 1))
    else:
        formats = [("nvfp4", "nvfp4")] * num_layers
    if spec.write is not None:
        return spec.write(path, values, num_layers, options)
    stored: dict[tuple[int, str], Any] = {}
    for i, pair in enumerate(formats):
        for kind, fmt in zip(("k", "v"), pair, strict=True):
            side = fp4_format(fmt)  # NVFP4 stores its global scale, FP8 amax / 448
            denom = _CANONICAL if side is not None and side.global_scale else 448.0
            stored[(i, kind)] = torch.tensor(values[(i, kind)] / denom, dtype=torch.float32)
    stored.update(options.pop("scales", None) or {})
    algos = {_ALGO[tuple(f)] for f in formats}  # type: ignore[index]
    quant: dict[str, Any]
    if spec.mixed and len(algos) > 1:
        quant = {
            "kv_cache_quant_algo": "MIXED_PRECISION",
            "kv_cache_quantized_layers": {
                f"model.layers.{i}.self_attn": {"quant_algo": _ALGO[tuple(f)]}  # type: ignore[index]
                for i, f in enumerate(formats)
            },
            "kv_cache_schema_version": 1,
        }
    else:
        quant = {"kv_cache_quant_algo": algos.pop()}
    updates = dict(options.pop("quant_config_updates", None) or {})
    # config.json: the algorithm as a bare kv_cache_scheme string, a layer map's keys beside it
    qcfg_updates = {**quant, "kv_cache_scheme": quant["kv_cache_quant_algo"]}
    if "kv_cache_quantized_layers" not in quant:
        del qcfg_updates["kv_cache_quant_algo"]
    root = write_checkpoint(
        path, convention="modelopt", num_layers=num_layers, scales=stored,
        quant_config_updates={**qcfg_updates, **updates}, **options,
    )  # fmt: skip
    side_path = root / "hf_quant_config.json"
    side = json.loads(side_path.read_text())
    side["quantization"].update(quant)
    side["quantization"].update(hf_quant_updates or {})
    side_path.write_text(json.dumps(side, indent=2) + "\n")
    return root


def _compressed_tensors(
    path: str | Path,
    values: Mapping[tuple[int, str], float],
    num_layers: int,
    options: dict[str, Any],
) -> Path:
    """llm-compressor's NVFP4 KV: ``k_global_scale`` ``(1,)`` fp32 of ``(6 * 448) / amax``."""
    extra = {
        f"model.layers.{i}.self_attn.{kind}_global_scale": torch.tensor(
            [_CANONICAL / values[(i, kind)]], dtype=torch.float32
        )
        for i in range(num_layers)
        for kind in ("k", "v")
    }
    extra.update(options.pop("extra_tensors", None) or {})
    scheme = {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "group_size": 16,
        "strategy": "tensor_group",
        "block_structure": None,
        "dynamic": "local",
        "actorder": None,
        "scale_dtype": "torch.float8_e4m3fn",
        "zp_dtype": None,
        "observer": "static_minmax",
        "observer_kwargs": {},
    }
    scheme.update(options.pop("kv_scheme_updates", None) or {})
    updates = {"kv_cache_scheme": scheme, **(options.pop("quant_config_updates", None) or {})}
    drop = [(i, kind) for i in range(num_layers) for kind in ("k", "v")]
    return write_checkpoint(
        path, convention="compressed-tensors", num_layers=num_layers, drop=drop,
        extra_tensors=extra, quant_config_updates=updates, **options,
    )  # fmt: skip


@dataclass(frozen=True)
class _Layout:
    """One layout :func:`write_fp4_checkpoint` writes."""

    mixed: bool = False
    """A layer map of FP8 and NVFP4 layers (ModelOpt's ``MIXED_PRECISION``)."""
    write: (
        Callable[[str | Path, Mapping[tuple[int, str], float], int, dict[str, Any]], Path] | None
    ) = None
    """The producer's own writer (None: ModelOpt's ``hf_quant_config.json`` layout)."""


_LAYOUTS: Mapping[str, _Layout] = {
    "modelopt": _Layout(),
    "modelopt-mixed": _Layout(mixed=True),
    "compressed-tensors": _Layout(write=_compressed_tensors),
}

FP4_LAYOUTS = tuple(_LAYOUTS)
"""The producer layouts :func:`write_fp4_checkpoint` writes."""
