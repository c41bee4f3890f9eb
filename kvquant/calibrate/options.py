"""Calibration's choices as types: ``str`` enums whose members equal their strings.

``objective="mse"`` and ``objective=Objective.MSE`` are the same option: a member
compares equal to, hashes as and formats as its value, so results, JSON and
messages read as before. :func:`parse_choice` turns a user's value into a member
(or None, for the caller's own error message).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvquant.choices import Choice, parse_choice

__all__ = [
    "CENTRES",
    "CONVENTIONS",
    "FORMATS",
    "OBJECTIVES",
    "ROTATIONS",
    "STATIC_GRANULARITIES",
    "Centre",
    "Choice",
    "Convention",
    "Granularity",
    "Objective",
    "Rotation",
    "is_rotation",
    "parse_choice",
]


class Objective(Choice):
    """What the clipping search minimises (:func:`~kvquant.calibrate.choose_scales`)."""

    MSE = "mse"
    """Every value counts once: the expected FP8 e4m3 MSE of K and of V."""
    ATTENTION = "attention"
    """Every value weighted by its first-order effect on the attention output."""

    @property
    def description(self) -> str:
        """The objective in words, for reports and the written metadata."""
        if self is Objective.MSE:
            return "expected FP8 e4m3 MSE of K and of V (clipping + rounding)"
        return "attention-weighted expected FP8 e4m3 squared error of K and of V"


class Granularity(Choice):
    """Which static scales :func:`~kvquant.calibrate.calibrate` chooses."""

    PER_TENSOR = "per-tensor"
    """One K and one V scale per layer (every engine reads it)."""
    PER_HEAD = "per-head"
    """One K and one V scale per layer and KV head."""
    K_TRANSFORM = "k-transform"
    """Per-head scales of a rotated, offset K plus per-channel K offsets (kvquant only)."""


class Centre(Choice):
    """Per-channel centre the k-transform's K offset is."""

    MEAN = "mean"
    """The mean over the calibration tokens."""
    MIDRANGE = "midrange"
    """``(min + max) / 2`` over the calibration tokens."""


class Rotation(Choice):
    """Rotation of K before the k-transform's offset (None: no rotation, offset only)."""

    HADAMARD = "hadamard"
    """The normalised Hadamard matrix (head_dim a power of two)."""


class Convention(Choice):
    """Convention :func:`~kvquant.calibrate.write_calibrated_checkpoint` writes scales in."""

    COMPRESSED_TENSORS = "compressed-tensors"
    """llm-compressor's ``k_scale`` / ``v_scale`` and ``kv_cache_scheme`` (per-tensor, per-head)."""
    MODELOPT = "modelopt"
    """NVIDIA ModelOpt's ``k_proj.k_scale`` / ``v_proj.v_scale`` (per-tensor)."""
    QUARK = "quark"
    """AMD Quark's ``output_scale`` with ``kv_cache_post_rope: true`` (per-tensor)."""
    KVQUANT = "kvquant"
    """kvquant's own: the k-transform's offsets and settings file (k-transform only)."""

    @property
    def holds_k_transform(self) -> bool:
        """Whether it stores the k-transform (offsets, settings file), and only it: kvquant's own."""
        return self is Convention.KVQUANT

    @property
    def per_head(self) -> bool:
        """Whether its config has a per-head KV strategy (compressed-tensors' ``attn_head``)."""
        return self is Convention.COMPRESSED_TENSORS

    @property
    def scale_names(self) -> str:
        """The producer whose KV-scale tensor names it writes (kvquant's own: compressed-tensors')."""
        return str(Convention.COMPRESSED_TENSORS if self is Convention.KVQUANT else self)

    def scale_shape(self, granularity: str, num_kv_heads: int) -> tuple[int, ...]:
        """Shape of one stored KV-scale tensor: ``(Hkv,)`` in kvquant's own, else the producer's."""
        if self is Convention.KVQUANT:
            return (num_kv_heads,)
        from kvquant.checkpoint import producers

        return producers.stored_scale_shape(str(self), granularity, num_kv_heads)

    def own_config(self, observer: str) -> dict[str, Any] | None:
        """The KV-only ``quantization_config`` it writes itself, or None (kvquant export's
        producer writes the configs; kvquant's own writes none).

        Quark's: separate post-RoPE K and V, nothing else quantized, its MSE observer named
        where the scales came from a clipping search (``observer="mse"``).
        """
        if self is not Convention.QUARK:
            return None
        from kvquant.checkpoint import producers

        quark = producers.quark_config(post_rope=True)
        if observer == "mse":
            for group in ("layer_quant_config", "kv_cache_quant_config"):
                for entry in quark[group].values():
                    entry["output_tensors"]["observer_cls"] = "PerTensorMSEObserver"
        return quark

    def bare_config(self, hf_quant: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The ``quantization_config`` of a copy of unquantized weights that the producer's
        configs leave without one: ModelOpt's names its producer (from ``hf_quant``), the
        others write none."""
        if self is not Convention.MODELOPT:
            return None
        from kvquant.checkpoint import producers

        return producers.modelopt_quantization_config(
            (hf_quant or {}).get("producer", {"name": "modelopt"}), ignore=()
        )


OBJECTIVES: tuple[str, ...] = tuple(m.value for m in Objective)
"""What the ratio search minimises (see :func:`~kvquant.calibrate.choose_scales`)."""

CENTRES: tuple[str, ...] = tuple(m.value for m in Centre)
"""Per-channel centres the k-transform's offset can be."""

ROTATIONS: tuple[str | None, ...] = (Rotation.HADAMARD.value, None)
"""K rotations of the k-transform: the normalised Hadamard matrix, or none (offset only)."""

CONVENTIONS: tuple[str, ...] = tuple(m.value for m in Convention)
"""Conventions :func:`~kvquant.calibrate.write_calibrated_checkpoint` writes."""

STATIC_GRANULARITIES: tuple[str, ...] = (Granularity.PER_TENSOR.value, Granularity.PER_HEAD.value)
"""Granularities of the clipping search (:func:`~kvquant.calibrate.choose_scales`)."""

FORMATS: tuple[str, ...] = tuple(m.value for m in Granularity)
"""Every format :func:`~kvquant.calibrate.calibrate` chooses."""


def is_rotation(value: object) -> bool:
    """Whether ``value`` is a k-transform rotation: a :class:`Rotation` (or its string) or None."""
    return value is None or parse_choice(Rotation, value) is not None
