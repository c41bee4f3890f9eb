"""kvquant's own convention: ``quant_method: "kvquant"``, and the ``k-transform`` format.

A patched model's ``save_pretrained`` writes fp32 ``self_attn.k_scale`` /
``v_scale``. ``kvquant calibrate --format k-transform`` writes fp32 ``[Hkv]``
K/V scales, fp32 ``[Hkv, head_dim]`` ``self_attn.k_offset`` tensors (rotated
frame) and :data:`KV_TRANSFORM_FILE`; offsets without the file, or the file
without offsets, are refused. No serving engine reads it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvquant.checkpoint.files import read_json
from kvquant.checkpoint.findings import Finding
from kvquant.checkpoint.producers.base import SELF_ATTN, Producer, ScaleShape
from kvquant.types import (
    MAX_FIRST_TOKENS,
    ROTATIONS,
    KTransform,
    LayerGeometry,
    RawKTransform,
    RawOffset,
)

__all__ = [
    "KV_TRANSFORM_FILE",
    "KV_TRANSFORM_FORMAT",
    "KV_TRANSFORM_KEYS",
    "KV_TRANSFORM_VERSION",
    "K_OFFSET_SUFFIX",
    "KVQuant",
    "k_offset_layer",
    "k_offset_tensor_name",
    "k_transform_from_mapping",
    "kv_transform_config",
    "parse_kv_transform",
    "read_k_transform",
]

KV_TRANSFORM_FILE = "kvquant_kv_transform.json"
"""The file beside the weights that declares kvquant's ``k-transform`` format."""

KV_TRANSFORM_FORMAT = "k-transform"
"""The ``format`` entry of :data:`KV_TRANSFORM_FILE`."""

KV_TRANSFORM_VERSION = 1
"""The ``version`` entry of :data:`KV_TRANSFORM_FILE` this kvquant reads and writes."""

KV_TRANSFORM_KEYS = (
    "format",
    "version",
    "rotation",
    "first_tokens",
    "head_dim",
    "num_kv_heads",
    "num_layers",
)
"""Every entry of :data:`KV_TRANSFORM_FILE` (all required)."""

K_OFFSET_SUFFIX = "self_attn.k_offset"
"""Tensor-name suffix of a per-channel K offset, after ``{prefix}layers.N.``."""

_K_OFFSET = re.compile(
    r"(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\." + re.escape(K_OFFSET_SUFFIX) + "$"
)


def k_offset_tensor_name(layer: int, *, prefix: str = "model.") -> str:
    """The name of layer ``layer``'s K offset: ``model.layers.N.self_attn.k_offset``."""
    return f"{prefix}layers.{layer}.{K_OFFSET_SUFFIX}"


def k_offset_layer(name: str) -> int | None:
    """The layer of a K offset tensor name, or None when ``name`` is not one."""
    hit = _K_OFFSET.match(name)
    return None if hit is None else int(hit.group("layer"))


def kv_transform_config(
    *, rotation: str | None, first_tokens: int, head_dim: int, num_kv_heads: int, num_layers: int
) -> dict[str, Any]:
    """The contents of :data:`KV_TRANSFORM_FILE` (a new dict, JSON-ready).

    Args:
        rotation: ``"hadamard"`` or ``None``.
        first_tokens: first visible tokens per sequence kept at full precision.
        head_dim: the model's head size.
        num_kv_heads: KV heads per layer.
        num_layers: decoder layers.
    """
    return {
        "format": KV_TRANSFORM_FORMAT,
        "version": KV_TRANSFORM_VERSION,
        "rotation": rotation,
        "first_tokens": first_tokens,
        "head_dim": head_dim,
        "num_kv_heads": num_kv_heads,
        "num_layers": num_layers,
    }


class KVQuant(Producer):
    """kvquant's own checkpoints: a patched model saved, or a calibrated k-transform."""

    name = "kvquant"
    names = SELF_ATTN
    owns_names = False
    quant_methods = ("kvquant",)
    default_dtype = torch.float32
    per_tensor_shape = ScaleShape.SCALAR
    writable = False
    stores_k_transform = True
    kvquant_config = True

    def detect_in_folder(self, root: Path) -> bool:
        return os.path.lexists(root / KV_TRANSFORM_FILE)

    def kv_scheme(
        self, qcfg: Mapping[str, Any] | None, hf_quant: Mapping[str, Any] | None
    ) -> dict[str, Any] | None:
        scheme = qcfg.get("kv_cache_scheme") if qcfg else None
        return dict(scheme) if isinstance(scheme, Mapping) else None


def parse_kv_transform(
    data: Mapping[str, Any], where: str, geometry: LayerGeometry
) -> tuple[KTransform | None, list[Finding]]:
    """Check the contents of ``kvquant_kv_transform.json`` against the model's geometry.

    Args:
        data: the parsed JSON object.
        where: how to name the file in findings.
        geometry: the geometry from ``config.json``.

    Returns:
        ``(settings, findings)``; settings are ``None`` when an entry is wrong
        (an error finding says which).
    """
    found: list[Finding] = []

    def bad(message: str) -> None:
        found.append(Finding("error", "kv-transform-invalid", f"{where}: {message}"))

    def show(value: Any) -> str:
        text = repr(value)
        return text if len(text) <= 40 else f"{text[:40]}..."

    fix = "Fix: re-run kvquant calibrate, or correct the file."
    missing = [k for k in KV_TRANSFORM_KEYS if k not in data]
    unknown = sorted(str(k) for k in data if k not in KV_TRANSFORM_KEYS)
    if missing:
        bad(
            f"missing {', '.join(missing)}; expected the entries {', '.join(KV_TRANSFORM_KEYS)}. {fix}"
        )
    if unknown:
        found.append(
            Finding(
                "warning",
                "kv-transform-unknown-entry",
                f"{where}: unknown entries {unknown[:5]} ignored (written by a newer kvquant?).",
            )
        )
    if "format" in data and data["format"] != KV_TRANSFORM_FORMAT:
        bad(f"format is {show(data['format'])}; expected {KV_TRANSFORM_FORMAT!r}. {fix}")
    version = data.get("version")
    if "version" in data and (isinstance(version, bool) or version != KV_TRANSFORM_VERSION):
        bad(
            f"version is {show(version)}; this kvquant reads version {KV_TRANSFORM_VERSION}. "
            "Fix: upgrade kvquant, or re-run kvquant calibrate with this version."
        )
    rotation = data.get("rotation")
    if "rotation" in data and rotation not in ROTATIONS:
        bad(f"rotation is {show(rotation)}; expected 'hadamard' or null. {fix}")
    first = data.get("first_tokens")
    if "first_tokens" in data and (
        isinstance(first, bool) or not isinstance(first, int) or not 0 <= first <= MAX_FIRST_TOKENS
    ):
        bad(f"first_tokens is {show(first)}; expected an int from 0 to {MAX_FIRST_TOKENS}. {fix}")
    for key, want in (
        ("head_dim", geometry.head_dim),
        ("num_kv_heads", geometry.num_kv_heads),
        ("num_layers", geometry.num_layers),
    ):
        value = data.get(key)
        if key in data and (isinstance(value, bool) or value != want):
            bad(
                f"{key} is {show(value)} but config.json gives {want}: the K transform was "
                "calibrated for another model. Fix: calibrate it for this model."
            )
    if any(f.severity == "error" for f in found) or not isinstance(first, int):
        return None, found
    return KTransform(rotation=rotation, first_tokens=first), found


def read_k_transform(
    root: Path,
    offsets: list[tuple[str, int]],
    tensors: Mapping[str, torch.Tensor],
    geometry: LayerGeometry,
) -> tuple[RawKTransform | None, list[Finding]]:
    """The folder's K transform: the settings file and the offset tensors, or the findings why not.

    Args:
        root: the checkpoint folder.
        offsets: ``(tensor name, layer)`` of every K offset its headers list.
        tensors: the loaded offset tensors, by name.
        geometry: the geometry from ``config.json``.
    """
    path = root / KV_TRANSFORM_FILE
    has_file = os.path.lexists(path)
    if not has_file and not offsets:
        return None, []
    if not has_file:
        return None, [
            Finding(
                "error",
                "k-offset-without-transform",
                f"{len(offsets)} K offset tensor(s) (e.g. {sorted(offsets)[0][0]}) but no "
                f"{KV_TRANSFORM_FILE}: without it the rotation and first tokens the offsets were "
                "calibrated with are unknown. Fix: copy the file kvquant calibrate wrote beside "
                "the weights, or re-run kvquant calibrate.",
            )
        ]
    data = read_json(path, KV_TRANSFORM_FILE)
    settings, found = parse_kv_transform(data, str(path), geometry)
    if not offsets:
        found.append(
            Finding(
                "error",
                "kv-transform-without-offsets",
                f"{path} declares the k-transform format but the checkpoint has no "
                "model.layers.N.self_attn.k_offset tensors. Fix: save the offsets kvquant "
                f"calibrate wrote with the weights, or delete {KV_TRANSFORM_FILE}.",
            )
        )
    if settings is None or not offsets:
        return None, found
    raws = tuple(
        RawOffset(layer, name, tensors[name])
        for name, layer in sorted(offsets, key=lambda o: (o[1], o[0]))
        if layer < geometry.num_layers and name in tensors
    )
    found.append(
        Finding(
            "info",
            "kv-transform",
            f"k-transform format ({KV_TRANSFORM_FILE}): rotation {settings.rotation or 'none'}, "
            f"first {settings.first_tokens} token(s) at full precision, {len(raws)} K offset "
            "tensor(s).",
        )
    )
    return RawKTransform(settings=settings, offsets=raws, source=str(path)), found


def k_transform_from_mapping(
    mapping: Mapping[str, Any], geometry: LayerGeometry, where: str = "scales"
) -> RawKTransform | None:
    """The K transform of an explicit ``scales=`` mapping, or None when it has none.

    The mapping holds ``model.layers.N.self_attn.k_offset`` tensors and, under
    the key ``"kvquant_kv_transform.json"``, the contents of that file as a dict.

    Raises:
        ScaleFormatError: offsets without the settings, settings without
            offsets, or settings that are wrong for ``geometry``.
    """
    from kvquant.errors import ScaleFormatError

    offsets = []
    for name in mapping:
        layer = k_offset_layer(str(name))
        if layer is not None:
            offsets.append((str(name), layer))
    settings_obj = mapping.get(KV_TRANSFORM_FILE)
    if settings_obj is None and not offsets:
        return None
    if not isinstance(settings_obj, Mapping):
        raise ScaleFormatError(
            f"{where} holds {len(offsets)} K offset tensor(s) (e.g. {sorted(offsets)[0][0] if offsets else '-'}) "
            f"but {'no' if settings_obj is None else 'a non-dict'} {KV_TRANSFORM_FILE!r} entry; "
            "expected the file's contents as a dict (rotation, first_tokens, ...). Fix: pass "
            "the checkpoint folder instead, or add the settings under that key."
        )
    settings, found = parse_kv_transform(settings_obj, f"{where}[{KV_TRANSFORM_FILE!r}]", geometry)
    errors = [f.message for f in found if f.severity == "error"]
    if not offsets:
        errors.append(
            f"{where} declares the k-transform format but holds no "
            "model.layers.N.self_attn.k_offset tensor. Fix: add the offsets."
        )
    if errors or settings is None:
        raise ScaleFormatError("; ".join(errors))
    raws = tuple(
        RawOffset(layer, name, mapping[name])
        for name, layer in sorted(offsets, key=lambda o: (o[1], o[0]))
    )
    return RawKTransform(settings=settings, offsets=raws, source=f"{where} (mapping)")
