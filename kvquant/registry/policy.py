"""The normalise-or-reject policy, one pure function per step.

Every function here takes values and returns values (or raises
:class:`~kvquant.errors.ScaleFormatError`); none of them logs, mutates its
inputs or keeps state. :func:`kvquant.registry.resolve_scales` chains them and
records what each step did. A scale ``s`` is accepted when
``2^-117 <= s <= 2^100`` (:data:`MIN_SCALE`, :data:`MAX_SCALE`).

Users: the policy table in docs/scale-formats.md ("Normalise or reject").
Design (the policy row by row, why the value limits): docs/dev/registry.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from kvquant.choices import MissingKV, MissingScales, RopePolicy
from kvquant.errors import ScaleFormatError
from kvquant.schemes import Fp4Scales, scheme_class, scheme_names
from kvquant.types import Granularity, LayerGeometry, RawOffset, RawScale

__all__ = [
    "FP8_E4M3_MAX",
    "GRANULARITIES",
    "MAX_OFFSET",
    "MAX_SCALE",
    "MIN_SCALE",
    "MISSING_KV_POLICIES",
    "MISSING_SCALES_POLICIES",
    "ROPE_POLICIES",
    "KVPair",
    "apply_rope_policy",
    "broadcast_to_per_head",
    "canonical_shape",
    "check_dtype",
    "check_geometry",
    "check_offset",
    "check_rotation",
    "check_values",
    "format_layers",
    "format_shape",
    "format_shapes",
    "fp8_granularities",
    "missing_layers",
    "model_group_size",
    "pair_kv",
    "read_values",
    "reduce_to_per_tensor",
    "resolve_group_size",
]

FP8_E4M3_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value; a scale is ``amax / FP8_E4M3_MAX``."""

MIN_SCALE = 2.0**-117
"""Smallest accepted scale (see the module docstring)."""

MAX_SCALE = 2.0**100
"""Largest accepted scale (see the module docstring)."""


def fp8_granularities() -> tuple[Granularity, ...]:
    """The words of the FP8 scale schemes a scale format may produce, in definition order.

    Every scheme class defined so far (:func:`kvquant.schemes.scheme_names`) except the
    4-bit ones, whose scales come from the 4-bit checkpoint readers: a scheme class added
    later is accepted without a change here.
    """
    return tuple(
        cast(Granularity, word)
        for word in scheme_names()
        if not issubclass(scheme_class(word), Fp4Scales)
    )


GRANULARITIES: tuple[Granularity, ...] = fp8_granularities()
"""The built-in FP8 scale schemes' words (:func:`fp8_granularities` at import)."""

MAX_OFFSET = 2.0**20
"""Largest accepted ``|k_offset|`` element: K channel means of real models are far below
(tens); a larger value is garbage or a unit mistake, and ``offset / scale`` must stay finite."""
MISSING_SCALES_POLICIES = MissingScales.values()
MISSING_KV_POLICIES = MissingKV.values()
ROPE_POLICIES = RopePolicy.values()

_DEFAULT_GROUP_SIZE = 64


def format_shape(shape: Iterable[int]) -> str:
    """Write a shape the way Python writes a tuple: ``()``, ``(8,)``, ``(4, 1, 1)``."""
    return str(tuple(int(s) for s in shape))


def format_shapes(shapes: Sequence[Iterable[int]]) -> str:
    """Join shapes for a message: ``() or (4,)``, ``(), (1,) or (4,)``."""
    texts = list(dict.fromkeys(format_shape(s) for s in shapes))
    if not texts:
        return "no static shape"
    if len(texts) == 1:
        return texts[0]
    return ", ".join(texts[:-1]) + " or " + texts[-1]


def format_layers(layers: Iterable[int]) -> str:
    """Compress layer indices into ranges: ``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    ordered = sorted(set(layers))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ", ".join(parts)


def _format_value(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.6g}"


def check_geometry(geometry: LayerGeometry) -> None:
    """Reject a geometry that no attention layer can have.

    Args:
        geometry: the model's attention geometry.

    Raises:
        ScaleFormatError: a field is not a positive integer.
    """
    for field_name in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
        value = getattr(geometry, field_name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ScaleFormatError(
                f"LayerGeometry.{field_name} is {value!r}; expected a positive int. "
                "Fix: build the geometry from the model config (num_hidden_layers, "
                "num_attention_heads, num_key_value_heads, head_dim)."
            )
    for field_name in ("layer_num_kv_heads", "layer_head_dims"):
        values = getattr(geometry, field_name)
        if values is None:
            continue
        if (
            not isinstance(values, tuple)
            or len(values) != geometry.num_layers
            or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in values)
        ):
            raise ScaleFormatError(
                f"LayerGeometry.{field_name} is {values!r}; expected None or a tuple of "
                f"{geometry.num_layers} positive ints (one per layer). Fix: build the geometry "
                "with LayerGeometry.from_layers(num_heads, kv_heads_per_layer, head_dims)."
            )


def canonical_shape(granularity: str, geometry: LayerGeometry) -> tuple[int, ...] | None:
    """Shape of a canonical scale tensor for a granularity.

    Args:
        granularity: ``"per-tensor"``, ``"per-head"``, ``"fp32-group"`` or ``"k-transform"``.
        geometry: the model's attention geometry.

    Returns:
        The named scheme's :meth:`~kvquant.schemes.Scheme.scale_shape`: ``()`` for
        per-tensor, ``(num_kv_heads,)`` for per-head and k-transform (whose scales are
        per-head), ``None`` for the dynamic fp32-group format (no stored tensor).

    Raises:
        ScaleFormatError: a word that names no scheme.
    """
    return scheme_class(granularity).scale_shape(geometry.num_kv_heads)


def check_dtype(raw: RawScale) -> str | None:
    """Accept floating-point scales, reject the rest.

    Args:
        raw: the scale as the checkpoint stores it.

    Returns:
        ``None`` when the tensor is already fp32, otherwise a note saying it is
        cast (fp16, bf16, fp64 and the fp8 dtypes are exact or rounded to fp32).

    Raises:
        ScaleFormatError: integer, bool, complex or other non-float dtype, a
            sparse tensor, or a tensor whose data cannot be read (meta device).
    """
    tensor = raw.tensor
    if not isinstance(tensor, torch.Tensor):
        raise ScaleFormatError(
            f"{raw.name} is a {type(tensor).__name__}, not a tensor; expected a floating-point "
            "torch.Tensor. Fix: pass the tensor as loaded from the checkpoint."
        )
    dtype = tensor.dtype
    if not dtype.is_floating_point:
        raise ScaleFormatError(
            f"{raw.name} has dtype {dtype} (shape {format_shape(tensor.shape)}); expected a "
            "floating-point scale (float32, bfloat16, float16 or float64). Integer, bool and "
            "complex tensors are not dequantization multipliers. Fix: export the scale as "
            "amax / 448 in float32, or check that the tensor name maps to a KV scale."
        )
    if tensor.layout != torch.strided:
        raise ScaleFormatError(
            f"{raw.name} is a {tensor.layout} tensor (shape {format_shape(tensor.shape)}, "
            f"{dtype}); expected a dense tensor. Fix: store the scale as a dense tensor "
            "(tensor.to_dense())."
        )
    if tensor.device.type == "meta":
        raise ScaleFormatError(
            f"{raw.name} is on the meta device (shape {format_shape(tensor.shape)}, {dtype}); "
            "expected a tensor with data. Fix: load the scale tensors from the checkpoint "
            "(discovery reads them to CPU) before resolving scales."
        )
    if dtype == torch.float32:
        return None
    return f"{raw.name}: {str(dtype).removeprefix('torch.')} scale cast to float32"


def read_values(raw: RawScale) -> torch.Tensor:
    """Copy a scale's values to CPU float64, the exact common ground of every float dtype.

    Args:
        raw: a scale that passed :func:`check_dtype`.

    Returns:
        A new float64 CPU tensor with the raw tensor's shape (never a view of it).

    Raises:
        ScaleFormatError: the dtype has no conversion to float64 (e.g. packed fp4).
    """
    try:
        values = raw.tensor.detach().to(device="cpu", dtype=torch.float64, copy=True)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        raise ScaleFormatError(
            f"{raw.name} has dtype {raw.tensor.dtype}, which cannot be converted to float32 "
            f"({type(exc).__name__}); expected float32, bfloat16, float16 or float64. "
            "Fix: export the scale as amax / 448 in float32."
        ) from None
    return values


def check_values(values: torch.Tensor, name: str, *, stage: str = "", fix: str = "") -> None:
    """Reject non-finite, non-positive, underflowing or overflowing scales.

    Args:
        values: scale values of any shape, any float dtype (not modified).
        name: the tensor's checkpoint name, used in the message.
        stage: where the values come from when it is not the raw tensor, e.g.
            ``"after format 'inverse-amax' converted it"``.
        fix: replaces the default likely-cause and fix text (for values a
            conversion produced rather than a producer stored).

    Raises:
        ScaleFormatError: naming the tensor, the first offending element and its
            value, how many elements are bad, the accepted range and the fix.
    """
    flat = values.detach().reshape(-1).to(torch.float64)
    if flat.numel() == 0:
        raise ScaleFormatError(
            f"{name} is empty (0 elements); expected at least one positive scale. "
            "Fix: re-export the checkpoint's KV scales."
        )
    checks = (
        (torch.isnan(flat), "not a number", "calibration never ran or diverged"),
        (torch.isinf(flat), "infinite", "calibration overflowed"),
        (flat == 0, "zero", "observers never saw data (a known llm-compressor failure)"),
        (flat < 0, "negative", "the producer does not store dequantization multipliers"),
        (flat < MIN_SCALE, "too small", "it underflowed (e.g. stored in fp16) or is not a scale"),
        (flat > MAX_SCALE, "too large", "it is probably an inverse (448 / amax) or garbage"),
    )
    where = f" ({stage})" if stage else ""
    for mask, what, cause in checks:
        bad = mask
        count = int(bad.sum())
        if count == 0:
            continue
        index = int(torch.nonzero(bad)[0, 0])
        position = _unravel(index, tuple(values.shape))
        value = _format_value(float(flat[index]))
        raise ScaleFormatError(
            f"{name}{where}: element {position} is {value} ({what}; {count} of "
            f"{flat.numel()} elements); expected finite scales in "
            f"[{MIN_SCALE:.3g}, {MAX_SCALE:.3g}] (amax / 448). "
            + (
                fix
                or f"Likely cause: {cause}. Fix: re-calibrate and re-export the KV scales, or "
                'patch(model, scale_format="fp32-group") to ignore them and compute scales '
                "while writing the cache."
            )
        )


def check_offset(raw: RawOffset, geometry: LayerGeometry) -> torch.Tensor:
    """Check one ``k_offset`` tensor and return it as a new fp32 CPU ``[Hkv, head_dim]`` tensor.

    Args:
        raw: the offset as the checkpoint stores it (not modified).
        geometry: the model's attention geometry.

    Returns:
        The offset, fp32 ``[num_kv_heads, head_dim]``.

    Raises:
        ScaleFormatError: not a dense floating-point tensor, a wrong shape, or a
            non-finite element or one beyond :data:`MAX_OFFSET` in magnitude.
    """
    tensor = raw.tensor
    want = (geometry.num_kv_heads, geometry.head_dim)
    fix = (
        "Fix: re-run kvquant calibrate for this model, or patch(model, "
        'scale_format="fp32-group") to ignore the checkpoint\'s K transform.'
    )
    if (
        not isinstance(tensor, torch.Tensor)
        or not tensor.dtype.is_floating_point
        or tensor.layout != torch.strided
        or tensor.device.type == "meta"
    ):
        found = (
            f"a {tensor.layout} {tensor.dtype} tensor on {tensor.device.type}"
            if isinstance(tensor, torch.Tensor)
            else f"a {type(tensor).__name__}"
        )
        raise ScaleFormatError(
            f"{raw.name} is {found}; expected a dense floating-point K offset of shape "
            f"{format_shape(want)}. {fix}"
        )
    if tuple(tensor.shape) != want:
        raise ScaleFormatError(
            f"{raw.name} has shape {format_shape(tensor.shape)}; expected {format_shape(want)} "
            f"(one offset per KV head and channel: {geometry.num_kv_heads} KV heads, head_dim "
            f"{geometry.head_dim}). {fix}"
        )
    try:
        values = tensor.detach().to(device="cpu", dtype=torch.float64, copy=True)
    except (RuntimeError, NotImplementedError, TypeError):
        raise ScaleFormatError(
            f"{raw.name} has dtype {tensor.dtype}, which cannot be converted to float32; "
            f"expected float32. {fix}"
        ) from None
    bad = ~torch.isfinite(values) | (values.abs() > MAX_OFFSET)
    count = int(bad.sum())
    if count:
        flat = values.reshape(-1)
        index = int(torch.nonzero(bad.reshape(-1))[0, 0])
        raise ScaleFormatError(
            f"{raw.name}: element {_unravel(index, want)} is {_format_value(float(flat[index]))} "
            f"({count} of {flat.numel()} elements non-finite or beyond +-{MAX_OFFSET:.3g}); "
            f"expected finite K offsets (per-channel means of K). {fix}"
        )
    return values.to(torch.float32)


def check_rotation(rotation: object, head_dim: int, where: str) -> None:
    """Accept a ``k-transform`` rotation for a head size.

    Args:
        rotation: ``"hadamard"`` or ``None``.
        head_dim: the model's head size.
        where: how to name the setting's source in the message.

    Raises:
        ScaleFormatError: an unknown rotation, or ``"hadamard"`` for a
            ``head_dim`` that is not a power of two.
    """
    if rotation is None:
        return
    if rotation != "hadamard":
        raise ScaleFormatError(
            f"{where}: rotation is {rotation!r}; expected 'hadamard' or None. Fix: re-run "
            "kvquant calibrate, or correct the rotation entry."
        )
    if head_dim & (head_dim - 1):
        raise ScaleFormatError(
            f"{where}: rotation 'hadamard' needs a power-of-two head_dim but the model has "
            f"head_dim {head_dim}. Fix: calibrate the K transform with rotation=None (offset "
            "only) for this model."
        )


def _unravel(index: int, shape: tuple[int, ...]) -> str:
    if not shape:
        return "()"
    coords = []
    for dim in reversed(shape):
        coords.append(index % dim)
        index //= dim
    return "[" + ", ".join(str(c) for c in reversed(coords)) + "]"


@dataclass(frozen=True)
class KVPair:
    """The raw scales one layer's K and V caches will use.

    Attributes:
        k: the raw scale for K.
        v: the raw scale for V (the same object as ``k`` for a single ``kv_scale``
            or when ``missing_kv="reuse"`` borrowed it).
        notes: what the pairing did, for the report.
    """

    k: RawScale
    v: RawScale
    notes: tuple[str, ...] = ()


def pair_kv(layer: int, raws: Sequence[RawScale], missing_kv: str = "error") -> KVPair:
    """Decide which raw scale serves K and which serves V in one layer.

    Rules: separate ``k`` and ``v`` tensors win; a lone ``kv`` tensor serves
    both (noted); ``kv`` fills in for a missing ``k`` or ``v`` (noted); only
    ``k`` or only ``v`` is rejected unless ``missing_kv="reuse"``, which uses
    the one present for both (noted: the other cache's range is a guess).

    Args:
        layer: decoder layer index (for messages).
        raws: this layer's raw scales, at most one per kind.
        missing_kv: ``"error"`` or ``"reuse"``.

    Returns:
        The pair and the notes.

    Raises:
        ScaleFormatError: no scale at all, duplicated kinds, or only one of K
            and V with ``missing_kv="error"``.
    """
    if missing_kv not in MISSING_KV_POLICIES:
        raise ScaleFormatError(
            f"missing_kv={missing_kv!r} is not a policy; expected one of {MISSING_KV_POLICIES}."
        )
    by_kind: dict[str, RawScale] = {}
    for raw in raws:
        if raw.kind in by_kind:
            raise ScaleFormatError(
                f"layer {layer} has two {raw.kind!r} scales: {by_kind[raw.kind].name} and "
                f"{raw.name}; expected one. Fix: remove the stale tensor from the checkpoint."
            )
        if raw.kind not in ("k", "v", "kv"):
            raise ScaleFormatError(
                f"{raw.name} has kind {raw.kind!r}; expected 'k', 'v' or 'kv'. "
                "Fix: build RawScale objects with kvquant's discovery."
            )
        by_kind[raw.kind] = raw
    k, v, kv = by_kind.get("k"), by_kind.get("v"), by_kind.get("kv")
    notes: list[str] = []
    if k is not None and v is not None:
        if kv is not None:
            notes.append(f"layer {layer}: {kv.name} ignored, separate K and V scales present")
        return KVPair(k, v, tuple(notes))
    if kv is not None:
        if k is None and v is None:
            notes.append(f"layer {layer}: {kv.name} is one scale for both K and V")
            return KVPair(kv, kv, tuple(notes))
        filled = "V" if v is None else "K"
        notes.append(f"layer {layer}: {kv.name} used for {filled}")
        return KVPair(k if k is not None else kv, v if v is not None else kv, tuple(notes))
    if k is not None:
        present, have, lack = k, "K", "V"
    elif v is not None:
        present, have, lack = v, "V", "K"
    else:
        raise ScaleFormatError(
            f"layer {layer} has no KV scale; expected a K and a V scale. "
            "Fix: re-export the checkpoint with KV scales for every layer."
        )
    if missing_kv == "reuse":
        notes.append(
            f"layer {layer}: no {lack} scale; {present.name} reused for {lack} "
            '(missing_kv="reuse"; the range of the other cache is a guess)'
        )
        return KVPair(present, present, tuple(notes))
    raise ScaleFormatError(
        f"layer {layer} has a {have} scale ({present.name}) but no {lack} scale; expected both. "
        f'Fix: re-export the checkpoint with {lack} scales, or pass missing_kv="reuse" '
        "(kvquant.patch, KVQuantConfig, or --missing-kv reuse on the command line) to use the "
        f"{have} scale for {lack} too."
    )


def missing_layers(present: Iterable[int], num_layers: int) -> list[int]:
    """Layers in ``range(num_layers)`` that have no raw scale.

    Args:
        present: indices of layers with at least one raw scale.
        num_layers: decoder layers in the model.

    Returns:
        The missing indices, ascending.
    """
    have = set(present)
    return [i for i in range(num_layers) if i not in have]


def reduce_to_per_tensor(scale: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Reduce canonical per-head scales to one per-tensor scale with max (lossy).

    The max covers every head's range, so nothing saturates; heads with smaller
    scales lose ``log2(max / own)`` bits of resolution.

    Args:
        scale: fp32 ``[num_kv_heads]`` (or ``[]``).

    Returns:
        The fp32 scalar ``[]`` and the max/min ratio (1.0 when lossless).
    """
    high = scale.max()
    ratio = float(high / scale.min())
    return high.reshape(()).clone(), ratio


def broadcast_to_per_head(scale: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Repeat a per-tensor scale for every KV head (lossless).

    Args:
        scale: fp32 ``[]`` (or already ``[num_kv_heads]``).
        num_kv_heads: KV heads of the layer.

    Returns:
        A new fp32 ``[num_kv_heads]`` tensor.
    """
    if scale.dim() == 1:
        return scale.clone()
    return scale.reshape(()).expand(num_kv_heads).clone()


def apply_rope_policy(k: torch.Tensor, raw: RawScale, rope_policy: str) -> tuple[torch.Tensor, str]:
    """Adapt a K scale calibrated before RoPE to the post-RoPE keys kvquant stores.

    RoPE rotates pairs of channels, so a post-RoPE component can reach
    ``sqrt(x_i^2 + x_j^2) <= sqrt(2) * max(|x_i|, |x_j|)``: a pre-RoPE scale can
    under-cover by up to sqrt(2) and saturate at 448.

    * ``"widen"`` (default): multiply K by sqrt(2). Nothing can saturate; costs
      half a bit of resolution.
    * ``"keep"``: use the scale as stored; outliers above it saturate.

    Args:
        k: canonical fp32 K scale, ``[]`` or ``[num_kv_heads]`` (not modified).
        raw: the raw scale it came from (``pre_rope`` is read from it).
        rope_policy: ``"widen"`` or ``"keep"``.

    Returns:
        The (possibly widened) new tensor and a note for the report.

    Raises:
        ScaleFormatError: unknown policy.
    """
    if rope_policy not in ROPE_POLICIES:
        raise ScaleFormatError(
            f"rope_policy={rope_policy!r} is not a policy; expected one of {ROPE_POLICIES}."
        )
    if rope_policy == "widen":
        return (
            k * math.sqrt(2.0),
            f"{raw.name}: calibrated before RoPE; K widened by sqrt(2) so rotated keys "
            'cannot saturate (rope_policy="widen")',
        )
    return (
        k.clone(),
        f"{raw.name}: calibrated before RoPE; kept as stored, rotated keys up to sqrt(2) "
        'above it saturate at 448 (rope_policy="keep")',
    )


def model_group_size(group_size: int | None, geometry: LayerGeometry) -> int:
    """The fp32-group ``G`` of a whole model: one size that divides every layer's head_dim.

    Args:
        group_size: requested ``G``, or ``None`` for the default of
            :func:`resolve_group_size` on the greatest common divisor of the
            layers' head_dims (the head_dim itself when the layers agree).
        geometry: the model's attention geometry.

    Raises:
        ScaleFormatError: an explicit ``G`` that does not divide some layer's head_dim.
    """
    dims = geometry.head_dims()
    if group_size is None:
        return resolve_group_size(None, math.gcd(*dims))
    for dim in dims:
        try:
            resolve_group_size(group_size, dim)
        except ScaleFormatError as exc:
            if len(dims) == 1:
                raise
            common = resolve_group_size(None, math.gcd(*dims))
            raise ScaleFormatError(
                f"group_size={group_size!r} does not divide head_dim={dim} of some layers (the "
                f"model's layers have head_dims {list(dims)}); expected a divisor of every one, "
                f"such as {common}. Fix: pass group_size={common}, or group_size=None."
            ) from exc
    return group_size


def resolve_group_size(group_size: int | None, head_dim: int) -> int:
    """Pick the fp32-group group size ``G``.

    Args:
        group_size: requested ``G``, or ``None`` for the default: 64 capped at
            ``head_dim``, halved until it divides ``head_dim`` (80 -> 16).
        head_dim: elements per head.

    Returns:
        ``G``, a divisor of ``head_dim``.

    Raises:
        ScaleFormatError: an explicit ``G`` that is not a positive divisor of
            ``head_dim``.
    """
    if group_size is None:
        size = min(_DEFAULT_GROUP_SIZE, head_dim)
        while head_dim % size:
            size //= 2
        return max(size, 1)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ScaleFormatError(
            f"group_size={group_size!r}; expected a positive int dividing head_dim={head_dim}. "
            "Fix: pass group_size=None for the default."
        )
    if head_dim % group_size:
        divisors = [d for d in (8, 16, 32, 64, 128) if head_dim % d == 0 and d <= head_dim]
        raise ScaleFormatError(
            f"group_size={group_size} does not divide head_dim={head_dim}; expected a divisor "
            f"such as {divisors or [head_dim]}. Fix: pass one of those, or group_size=None."
        )
    return group_size
