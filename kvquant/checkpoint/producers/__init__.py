"""Checkpoint producers: one :class:`~kvquant.checkpoint.producers.base.Producer` per file, and the registry.

:data:`PRODUCERS` lists them in the order discovery asks them; writers take the
conventions of :data:`PRODUCER_CONVENTIONS`; ``tests/checkpoint/test_producers_conformance.py``
round-trips every registered one. :data:`FOUR_BIT_ONLY` lists the producers known only for
their 4-bit layout (discovery never decides them); :func:`fp4_layout` gives any producer's. Developer notes: ``docs/dev/checkpoint.md``.

Example:
    >>> from kvquant.checkpoint.producers import scale_tensor_name, stored_scale
    >>> scale_tensor_name("modelopt", 3, "k")
    'model.layers.3.self_attn.k_proj.k_scale'
    >>> import torch
    >>> stored_scale(torch.tensor([0.1, 0.2]), "compressed-tensors", "per-head", 2, torch.float32).shape
    torch.Size([2, 1, 1])
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvquant.checkpoint.fp4_formats import Fp4Producer
from kvquant.checkpoint.producers.auto_round import AutoRound
from kvquant.checkpoint.producers.base import Naming, Producer, ScaleShape
from kvquant.checkpoint.producers.compressed_tensors import (
    CompressedTensors,
    compressed_tensors_config,
    compressed_tensors_kv_scheme,
)
from kvquant.checkpoint.producers.kvquant import (
    K_OFFSET_SUFFIX,
    KV_TRANSFORM_FILE,
    KV_TRANSFORM_FORMAT,
    KV_TRANSFORM_KEYS,
    KV_TRANSFORM_VERSION,
    KVQuant,
    k_offset_tensor_name,
    kv_transform_config,
)
from kvquant.checkpoint.producers.legacy import LegacyKvScale
from kvquant.checkpoint.producers.modelopt import (
    ModelOpt,
    modelopt_hf_quant_config,
    modelopt_kv_cache_scheme,
    modelopt_quantization_config,
)
from kvquant.checkpoint.producers.quark import Quark, QuarkFp8, quark_config
from kvquant.checkpoint.producers.tensorrt_llm import TensorRTLLM
from kvquant.errors import ConventionError
from kvquant.schemes import StaticScales

__all__ = [
    "CONVENTION_SPECS",
    "FOUR_BIT_ONLY",
    "KV_TRANSFORM_FILE",
    "KV_TRANSFORM_FORMAT",
    "KV_TRANSFORM_KEYS",
    "KV_TRANSFORM_VERSION",
    "K_OFFSET_SUFFIX",
    "NAMINGS",
    "NO_PRODUCER",
    "PRODUCERS",
    "PRODUCER_CONVENTIONS",
    "AutoRound",
    "CompressedTensors",
    "KVQuant",
    "LegacyKvScale",
    "ModelOpt",
    "Naming",
    "Producer",
    "Quark",
    "QuarkFp8",
    "ScaleShape",
    "TensorRTLLM",
    "compressed_tensors_config",
    "compressed_tensors_kv_scheme",
    "config_producer",
    "convention_of",
    "detect_producer",
    "fp4_layout",
    "fp4_layouts",
    "k_offset_tensor_name",
    "kv_transform_config",
    "modelopt_hf_quant_config",
    "modelopt_kv_cache_scheme",
    "modelopt_quantization_config",
    "producer_configs",
    "producer_for",
    "quark_config",
    "reported",
    "scale_tensor_name",
    "stored_scale",
    "stored_scale_shape",
    "weight_quantization",
]

PRODUCERS: tuple[Producer, ...] = (
    CompressedTensors(),
    ModelOpt(),
    Quark(),
    QuarkFp8(),
    LegacyKvScale(),
    TensorRTLLM(),
    KVQuant(),
)
"""Every producer convention kvquant knows, in the order discovery asks them."""

FOUR_BIT_ONLY: tuple[Producer, ...] = (AutoRound(),)
"""Producers known only for their 4-bit layout (:attr:`Producer.fp4`): discovery never
decides them, so they are not in :data:`PRODUCERS`."""

NO_PRODUCER = "none"
"""The producer discovery reports for a checkpoint with no KV scales and no producer config."""

_BY_NAME: Mapping[str, Producer] = {p.name: p for p in PRODUCERS}

NAMINGS: Mapping[str, Naming] = {
    naming.family: naming for p in PRODUCERS for naming in (p.names, *p.also_reads)
}
"""Every KV-scale naming kvquant reads, keyed by family."""

_OWNER: Mapping[str, Producer] = {
    # a family no producer owns (compressed-tensors' global scales) belongs to its reader
    **{n.family: p for p in reversed(PRODUCERS) for n in p.also_reads},
    **{p.naming: p for p in reversed(PRODUCERS) if p.owns_names},
}
"""The producer a name of each family is read as when no config names one."""

PRODUCER_CONVENTIONS: tuple[str, ...] = tuple(p.name for p in PRODUCERS if p.writable)
"""The producer conventions whose KV scales kvquant can write."""

CONVENTION_SPECS: Mapping[str, Producer] = {p.name: p for p in PRODUCERS if p.writable}
"""The :class:`Producer` of each name in :data:`PRODUCER_CONVENTIONS`."""


def producer_for(convention: str) -> Producer:
    """The registered producer of a convention name (``"quark-fp8"``, ...).

    Raises:
        ConventionError: no registered producer has that name.
    """
    producer = _BY_NAME.get(convention)
    if producer is None:
        raise ConventionError(
            f"unknown convention {convention!r}; expected one of {tuple(_BY_NAME)}. "
            "Fix: pass one of those names."
        )
    return producer


def reported(name: str) -> Producer | None:
    """The producer discovery reports as ``name`` (None for :data:`NO_PRODUCER` and unknown names)."""
    return next((p for p in PRODUCERS if p.producer == name), None)


def fp4_layouts() -> dict[str, Fp4Producer]:
    """The 4-bit layout each producer declares (:attr:`Producer.fp4`), by reported name.

    Returns:
        A new dict, in registry order (:data:`PRODUCERS`, then :data:`FOUR_BIT_ONLY`); the
        producers without 4-bit support are left out.
    """
    out: dict[str, Fp4Producer] = {}
    for p in (*PRODUCERS, *FOUR_BIT_ONLY):
        if p.fp4 is not None:
            out.setdefault(p.producer, p.fp4)
    return out


def fp4_layout(name: str) -> Fp4Producer | None:
    """The 4-bit layout of the producer reported as ``name`` (None: it declares none, or the
    name is not a producer's)."""
    return fp4_layouts().get(name)


def detect_producer(
    qcfg: Mapping[str, Any] | None,
    hf_quant: Mapping[str, Any] | None,
    root: Path | None = None,
) -> Producer | None:
    """The producer the configs (then the folder's files) name, or None.

    Asked in order: ``quant_method``, ``hf_quant_config.json``, a file in ``root``.
    """
    named = config_producer(qcfg)
    if named is not None:
        return named
    for producer in PRODUCERS if hf_quant else ():
        if hf_quant is not None and producer.detect_side_config(hf_quant):
            return producer
    for producer in PRODUCERS if root is not None else ():
        if root is not None and producer.detect_in_folder(root):
            return producer
    return None


def config_producer(qcfg: Mapping[str, Any] | None) -> Producer | None:
    """The producer whose ``quant_method`` a ``quantization_config`` names, or None."""
    return next((p for p in PRODUCERS if p.detect(qcfg)), None)


def convention_of(family: str, decided: Producer | None) -> Producer:
    """The producer a scale name of ``family`` is read as, given the config's producer."""
    if decided is not None and decided.reads(family):
        return decided
    return _OWNER[family]


def _writable(convention: str) -> Producer:
    producer = CONVENTION_SPECS.get(convention)
    if producer is None:
        raise ConventionError(
            f"unknown convention {convention!r}; expected one of {PRODUCER_CONVENTIONS}. "
            "Fix: pass one of those names."
        )
    return producer


def scale_tensor_name(convention: str, layer: int, kind: str, *, prefix: str = "model.") -> str:
    """Return the tensor name a producer uses for one KV scale.

    Args:
        convention: one of :data:`PRODUCER_CONVENTIONS`.
        layer: decoder layer index.
        kind: ``"k"`` or ``"v"`` (``"kv"`` for ``"legacy-kv_scale"``).
        prefix: what stands before ``layers.N.`` (``"model."``,
            ``"model.language_model."``, ...).

    Returns:
        The name, e.g. ``model.layers.0.self_attn.k_proj.k_scale``.

    Raises:
        ConventionError: unknown convention or a kind the convention does not store.
    """
    return _writable(convention).tensor_name(layer, kind, prefix=prefix)


def stored_scale_shape(
    convention: str, granularity: str | type[StaticScales], num_kv_heads: int
) -> tuple[int, ...]:
    """Shape of one KV-scale tensor as the producer stores it.

    Args:
        convention: one of :data:`PRODUCER_CONVENTIONS`.
        granularity: ``"per-tensor"`` or ``"per-head"``, or its scheme
            (:func:`~kvquant.checkpoint.producers.base.stored_scheme`); per-head only where
            the convention has a per-head strategy: compressed-tensors ``attn_head``.
        num_kv_heads: KV heads per layer.

    Returns:
        ``(Hkv, 1, 1)`` for per-head, else the convention's per-tensor shape
        (``(1,)`` or ``()``).

    Raises:
        ConventionError: unknown convention or granularity, or per-head for a
            per-tensor-only convention.
    """
    return _writable(convention).stored_shape(granularity, num_kv_heads)


def stored_scale(
    value: float | torch.Tensor,
    convention: str,
    granularity: str | type[StaticScales],
    num_kv_heads: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Shape and type a canonical fp32 scale the way a producer stores it.

    A per-tensor target takes the max over heads of a per-head value; a
    per-head target broadcasts a scalar to every head.

    Args:
        value: a float, or a canonical tensor [] or [Hkv].
        convention: one of :data:`PRODUCER_CONVENTIONS`.
        granularity: ``"per-tensor"`` or ``"per-head"``, or its scheme.
        num_kv_heads: KV heads per layer (``Hkv``).
        dtype: the stored dtype.

    Returns:
        A new tensor of :func:`stored_scale_shape` and ``dtype``: [Hkv, 1, 1],
        [1] or [].

    Raises:
        ConventionError: see :func:`stored_scale_shape`.
    """
    return _writable(convention).stored_scale(value, granularity, num_kv_heads, dtype)


def producer_configs(
    convention: str,
    *,
    granularity: str = "per-tensor",
    fp8_weights: bool = False,
    post_rope: bool = False,
    scale_dtype: torch.dtype | None = None,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The configs a producer's own export writes (as its current release does).

    Args:
        convention: one of :data:`PRODUCER_CONVENTIONS`, or :data:`NO_PRODUCER`.
        granularity: compressed-tensors only: ``"per-head"`` writes ``attn_head``.
        fp8_weights: ModelOpt only: the FP8-weight export.
        post_rope: Quark only: ``kv_cache_post_rope``.
        scale_dtype: Quark's ``export.scale_dtype``; default the convention's.

    Returns:
        ``(quantization_config or None, hf_quant_config.json or None)``; both
        None for ``"legacy-kv_scale"`` and :data:`NO_PRODUCER`.

    Raises:
        ConventionError: unknown convention.
    """
    if convention == NO_PRODUCER:
        return None, None
    return _writable(convention).configs(
        granularity=granularity,
        fp8_weights=fp8_weights,
        post_rope=post_rope,
        scale_dtype=scale_dtype,
    )


_FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})
_BUFFER_DTYPES = frozenset({"I64", "BOOL"})  # position ids, masks: not quantized weights


def weight_quantization(
    weight_dtypes: Mapping[str, int],
    qcfg: Mapping[str, Any] | None,
    hf_quant: Mapping[str, Any] | None,
) -> str | None:
    """Describe a checkpoint's weight quantization, or ``None`` when the weights are plain floats.

    Args:
        weight_dtypes: header dtype -> count over the non-scale tensors.
        qcfg: ``quantization_config``.
        hf_quant: ``hf_quant_config.json``.
    """
    quantized = {d: n for d, n in weight_dtypes.items() if d not in _FLOAT_DTYPES | _BUFFER_DTYPES}
    if quantized:
        return f"{sum(quantized.values())} weight tensors stored as {sorted(quantized)}"
    qcfg = qcfg or {}
    if qcfg.get("config_groups"):
        return f"{qcfg.get('quant_method')} config_groups {sorted(qcfg['config_groups'])}"
    for producer in PRODUCERS:
        said = producer.weight_quantization(qcfg, hf_quant)
        if said is not None:
            return said
    return None
