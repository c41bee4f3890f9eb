"""The one producer table: how each producer names, shapes, types and configures its KV scales.

:data:`NAMINGS` lists the tensor-name families; discovery
(:mod:`kvquant.checkpoint.discovery`) builds its name patterns from it (the
reading side). :data:`CONVENTION_SPECS` says which naming each producer writes,
in which dtype and shape (the writing side, shared by
:func:`kvquant.testing.checkpoints.write_checkpoint` (synthetic producer
checkpoints), :func:`kvquant.export.export_checkpoint` (engine exports) and
:func:`kvquant.calibrate.write_calibrated_checkpoint`). A name written under a
convention is read back under the same naming by construction.

================================  ====================================================  ===============
convention                        scale tensors (``{prefix}layers.N.self_attn.``...)   per-tensor stored
================================  ====================================================  ===============
``"compressed-tensors"``          ``k_scale`` / ``v_scale``                             ``(1,)``; per-head ``(Hkv,1,1)``
``"modelopt"``                    ``k_proj.k_scale`` / ``v_proj.v_scale``               ``()``
``"quark"``                       ``k_proj.output_scale`` / ``v_proj.output_scale``     ``()``
``"quark-fp8"``                   ``k_scale`` / ``v_scale`` (Quark config)              ``()``
``"legacy-kv_scale"``             ``kv_scale`` (one scale for K and V)                  ``()``
================================  ====================================================  ===============

kvquant's own ``k-transform`` convention (written by ``kvquant calibrate``, read
by discovery; no serving engine reads it): per layer ``self_attn.k_scale`` and
``self_attn.v_scale`` fp32 ``[Hkv]`` and ``self_attn.k_offset`` fp32
``[Hkv, head_dim]`` (in the rotated frame), plus :data:`KV_TRANSFORM_FILE` in the
checkpoint folder (:func:`kv_transform_config`). Offsets without the file, or
the file without offsets, are refused.

Everything here is data and small pure functions: each config builder returns
a fresh dict the caller may edit. This module imports torch only.

Example:
    >>> from kvquant.checkpoint.producers import scale_tensor_name, stored_scale
    >>> scale_tensor_name("modelopt", 3, "k")
    'model.layers.3.self_attn.k_proj.k_scale'
    >>> import torch
    >>> stored_scale(torch.tensor([0.1, 0.2]), "compressed-tensors", "per-head", 2, torch.float32).shape
    torch.Size([2, 1, 1])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvquant.errors import ConventionError
from kvquant.types import ScaleKind

__all__ = [
    "CONVENTION_SPECS",
    "KV_TRANSFORM_FILE",
    "KV_TRANSFORM_FORMAT",
    "KV_TRANSFORM_KEYS",
    "KV_TRANSFORM_VERSION",
    "K_OFFSET_SUFFIX",
    "NAMINGS",
    "PRODUCER_CONVENTIONS",
    "ConventionSpec",
    "Naming",
    "compressed_tensors_config",
    "compressed_tensors_kv_scheme",
    "k_offset_tensor_name",
    "kv_transform_config",
    "modelopt_hf_quant_config",
    "modelopt_kv_cache_scheme",
    "modelopt_quantization_config",
    "producer_configs",
    "quark_config",
    "scale_tensor_name",
    "stored_scale",
    "stored_scale_shape",
]


@dataclass(frozen=True)
class Naming:
    """One family of KV-scale tensor names.

    Attributes:
        family: the family's name, e.g. ``"modelopt"``.
        suffixes: tensor-name suffix per scale kind, after ``{prefix}layers.N.``
            (``"k"``/``"v"``, or ``"kv"`` alone for one scale serving both).
        default_producer: the producer a name of this family is read under
            when the checkpoint's config names none.
    """

    family: str
    suffixes: Mapping[ScaleKind, str]
    default_producer: str


NAMINGS: Mapping[str, Naming] = {
    n.family: n
    for n in (
        Naming(
            "self_attn", {"k": "self_attn.k_scale", "v": "self_attn.v_scale"}, "compressed-tensors"
        ),
        Naming(
            "modelopt",
            {"k": "self_attn.k_proj.k_scale", "v": "self_attn.v_proj.v_scale"},
            "modelopt",
        ),
        Naming(
            "output_scale",
            {"k": "self_attn.k_proj.output_scale", "v": "self_attn.v_proj.output_scale"},
            "quark",
        ),
        Naming("legacy-kv_scale", {"kv": "self_attn.kv_scale"}, "legacy-kv_scale"),
        Naming("tensorrt-llm", {"kv": "attention.kv_cache_scaling_factor"}, "tensorrt-llm"),
    )
}
"""Every KV-scale naming kvquant reads, keyed by family (the reading side of the table)."""


@dataclass(frozen=True)
class ConventionSpec:
    """How one producer names, shapes and types its KV scales.

    Attributes:
        name: the convention name, e.g. ``"modelopt"``.
        naming: the :data:`NAMINGS` family its tensor names follow.
        default_dtype: the dtype the producer stores its scales in.
        per_tensor_shape: shape of a per-tensor scale: ``(1,)`` or ``()``.
        per_head: whether the producer stores per-head ``(Hkv,1,1)`` scales.
    """

    name: str
    naming: str
    default_dtype: torch.dtype
    per_tensor_shape: tuple[int, ...]
    per_head: bool = False

    @property
    def suffixes(self) -> Mapping[ScaleKind, str]:
        """Tensor-name suffix per scale kind, after ``{prefix}layers.N.`` (from :attr:`naming`)."""
        return NAMINGS[self.naming].suffixes


PRODUCER_CONVENTIONS: tuple[str, ...] = (
    "compressed-tensors",
    "modelopt",
    "quark",
    "quark-fp8",
    "legacy-kv_scale",
)
"""The producer conventions whose KV scales kvquant can write."""

CONVENTION_SPECS: Mapping[str, ConventionSpec] = {
    "compressed-tensors": ConventionSpec(
        "compressed-tensors", "self_attn", torch.bfloat16, (1,), per_head=True
    ),
    "modelopt": ConventionSpec("modelopt", "modelopt", torch.float32, ()),
    "quark": ConventionSpec("quark", "output_scale", torch.bfloat16, ()),
    "quark-fp8": ConventionSpec("quark-fp8", "self_attn", torch.bfloat16, ()),
    "legacy-kv_scale": ConventionSpec("legacy-kv_scale", "legacy-kv_scale", torch.float32, ()),
}
"""One :class:`ConventionSpec` per name in :data:`PRODUCER_CONVENTIONS`."""


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


def k_offset_tensor_name(layer: int, *, prefix: str = "model.") -> str:
    """The name of layer ``layer``'s K offset: ``model.layers.N.self_attn.k_offset``."""
    return f"{prefix}layers.{layer}.{K_OFFSET_SUFFIX}"


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


def _spec(convention: str) -> ConventionSpec:
    spec = CONVENTION_SPECS.get(convention)
    if spec is None:
        raise ConventionError(
            f"unknown convention {convention!r}; expected one of {PRODUCER_CONVENTIONS}. "
            "Fix: pass one of those names."
        )
    return spec


# ---------------------------------------------------------------------------
# tensors


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
    spec = _spec(convention)
    suffix = {str(k): v for k, v in spec.suffixes.items()}.get(kind)
    if suffix is None:
        if convention == "legacy-kv_scale":
            raise ConventionError(
                f"legacy-kv_scale stores one 'kv' scale per layer, got kind {kind!r}. "
                "Fix: ask for kind 'kv'."
            )
        raise ConventionError(
            f"{convention} stores 'k' and 'v' scales, got kind {kind!r}. Fix: ask for 'k' or 'v'."
        )
    return f"{prefix}layers.{layer}.{suffix}"


def stored_scale_shape(convention: str, granularity: str, num_kv_heads: int) -> tuple[int, ...]:
    """Shape of one KV-scale tensor as the producer stores it.

    Args:
        convention: one of :data:`PRODUCER_CONVENTIONS`.
        granularity: ``"per-tensor"`` or ``"per-head"`` (per-head only where the
            convention has a per-head strategy: compressed-tensors ``attn_head``).
        num_kv_heads: KV heads per layer.

    Returns:
        ``(Hkv, 1, 1)`` for per-head, else the convention's per-tensor shape
        (``(1,)`` or ``()``).

    Raises:
        ConventionError: unknown convention or granularity, or per-head for a
            per-tensor-only convention.
    """
    spec = _spec(convention)
    if granularity == "per-head":
        if not spec.per_head:
            raise ConventionError(
                f"{convention} has no per-head KV-scale strategy; got granularity 'per-head'. "
                "Fix: use 'compressed-tensors' (strategy attn_head) or per-tensor scales."
            )
        return (num_kv_heads, 1, 1)
    if granularity != "per-tensor":
        raise ConventionError(
            f"granularity must be 'per-tensor' or 'per-head', got {granularity!r}. "
            "Fix: pass one of those."
        )
    return spec.per_tensor_shape


def stored_scale(
    value: float | torch.Tensor,
    convention: str,
    granularity: str,
    num_kv_heads: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Shape and type a canonical fp32 scale the way a producer stores it.

    A per-tensor target takes the max over heads of a per-head value; a
    per-head target broadcasts a scalar to every head.

    Args:
        value: a float, or a canonical tensor [] or [Hkv].
        convention: one of :data:`PRODUCER_CONVENTIONS`.
        granularity: ``"per-tensor"`` or ``"per-head"``.
        num_kv_heads: KV heads per layer (``Hkv``).
        dtype: the stored dtype.

    Returns:
        A new tensor of :func:`stored_scale_shape` and ``dtype``: [Hkv, 1, 1],
        [1] or [].

    Raises:
        ConventionError: see :func:`stored_scale_shape`.
    """
    shape = stored_scale_shape(convention, granularity, num_kv_heads)
    if isinstance(value, torch.Tensor):
        t = value.detach().to(torch.float32).reshape(-1)
    else:
        t = torch.tensor([float(value)], dtype=torch.float32)
    if granularity == "per-head":
        if t.numel() == 1:
            t = t.expand(num_kv_heads)
        return t.reshape(shape).to(dtype).clone()
    return t.amax().reshape(shape).to(dtype).clone()


# ---------------------------------------------------------------------------
# configs


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
        "strategy": "attn_head" if granularity == "per-head" else "tensor",
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
        for key in ("num_bits", "type", "strategy", "dynamic", "symmetric"):
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


def modelopt_kv_cache_scheme() -> dict[str, Any]:
    """The ``kv_cache_scheme`` ModelOpt writes into ``quantization_config`` for FP8 KV.

    Returns:
        A new dict.
    """
    return {"dynamic": False, "num_bits": 8, "type": "float"}


def modelopt_quantization_config(
    producer: Any,
    *,
    ignore: Sequence[str] = ("lm_head",),
    fp8_weights: bool = False,
) -> dict[str, Any]:
    """ModelOpt's ``quantization_config`` (config.json) with FP8 KV scales.

    Args:
        producer: the ``producer`` entry (``{"name": "modelopt", "version": ...}``;
            a mapping is copied, anything else is stored as given).
        ignore: the ``ignore`` list.
        fp8_weights: also declare FP8 Linear weights and inputs (``quant_algo: FP8``).

    Returns:
        A new dict.
    """
    qcfg: dict[str, Any] = {
        "quant_method": "modelopt",
        "ignore": list(ignore),
        "producer": dict(producer) if isinstance(producer, Mapping) else producer,
        "kv_cache_scheme": modelopt_kv_cache_scheme(),
    }
    if fp8_weights:
        qcfg["quant_algo"] = "FP8"
        qcfg["config_groups"] = {
            "group_0": {
                "weights": {"num_bits": 8, "type": "float", "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": False},
                "targets": ["Linear"],
            }
        }
    return qcfg


def modelopt_hf_quant_config(
    producer: Mapping[str, Any],
    *,
    exclude_modules: Sequence[str] = ("lm_head",),
    fp8_weights: bool = False,
) -> dict[str, Any]:
    """ModelOpt's ``hf_quant_config.json`` with ``kv_cache_quant_algo: FP8``.

    Args:
        producer: the ``producer`` entry.
        exclude_modules: the ``exclude_modules`` list.
        fp8_weights: ``quant_algo: FP8`` (else ``None`` with empty ``quantized_layers``).

    Returns:
        A new dict.
    """
    quant: dict[str, Any] = {
        "quant_algo": "FP8" if fp8_weights else None,
        "kv_cache_quant_algo": "FP8",
        "exclude_modules": list(exclude_modules),
    }
    if not fp8_weights:
        quant["quantized_layers"] = {}
    return {"producer": dict(producer), "quantization": quant}


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")


def quark_config(
    *,
    post_rope: bool,
    custom_mode: str = "quark",
    scale_dtype: torch.dtype = torch.float32,
    version: str | None = None,
    exclude: Sequence[str] = (),
    kv_cache_group: Sequence[str] = (),
) -> dict[str, Any]:
    """A KV-only AMD Quark ``quantization_config`` (per-tensor FP8 K/V output scales).

    Args:
        post_rope: ``kv_cache_post_rope`` (separate post-RoPE K and V scales;
            otherwise Quark stores ``max(K, V)`` pre-RoPE in both).
        custom_mode: ``export.custom_mode``: ``"quark"`` (``k_proj.output_scale``
            names) or ``"fp8"`` (``self_attn.k_scale`` names).
        scale_dtype: ``export.scale_dtype`` (bf16, fp16, else ``"float32"``).
        version: the ``version`` entry; left out when None.
        exclude: the ``exclude`` list.
        kv_cache_group: ``export.kv_cache_group``.

    Returns:
        A new dict.
    """
    out_tensors = {
        "dtype": "fp8_e4m3",
        "qscheme": "per_tensor",
        "is_dynamic": False,
        "symmetric": True,
        "observer_cls": "PerTensorMinMaxObserver",
        "round_method": "half_even",
        "scale_type": "float",
        "ch_axis": None,
        "group_size": None,
    }

    def kv_cfg() -> dict[str, Any]:
        return {
            "weight": None,
            "input_tensors": None,
            "output_tensors": dict(out_tensors),
            "bias": None,
            "target_device": None,
        }

    out: dict[str, Any] = {"quant_method": "quark", "quant_mode": "eager_mode"}
    if version is not None:
        out["version"] = version
    out.update(
        {
            "global_quant_config": {
                "weight": None,
                "input_tensors": None,
                "output_tensors": None,
                "bias": None,
                "target_device": None,
            },
            "layer_type_quant_config": {},
            "layer_quant_config": {"*k_proj": kv_cfg(), "*v_proj": kv_cfg()},
            "kv_cache_quant_config": {"*k_proj": kv_cfg(), "*v_proj": kv_cfg()},
            "kv_cache_post_rope": post_rope,
            "exclude": list(exclude),
            "export": {
                "kv_cache_group": list(kv_cache_group),
                "min_kv_scale": 0.0,
                "pack_method": "reorder",
                "weight_format": "real_quantized",
                "weight_merge_groups": None,
                "custom_mode": custom_mode,
                "scale_dtype": _dtype_name(scale_dtype),
            },
        }
    )
    return out


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
        convention: one of :data:`PRODUCER_CONVENTIONS`, or ``"none"``.
        granularity: compressed-tensors only: ``"per-head"`` writes ``attn_head``.
        fp8_weights: ModelOpt only: the FP8-weight export.
        post_rope: Quark only: ``kv_cache_post_rope``.
        scale_dtype: Quark's ``export.scale_dtype``; default the convention's.

    Returns:
        ``(quantization_config or None, hf_quant_config.json or None)``; both
        None for ``"legacy-kv_scale"`` and ``"none"``.

    Raises:
        ConventionError: unknown convention.
    """
    if convention == "none":
        return None, None
    spec = _spec(convention)
    if convention == "compressed-tensors":
        return compressed_tensors_config(granularity, version="0.19.0"), None
    if convention == "modelopt":
        producer = {"name": "modelopt", "version": "0.47.0"}
        return (
            modelopt_quantization_config(producer, fp8_weights=fp8_weights),
            modelopt_hf_quant_config(producer, fp8_weights=fp8_weights),
        )
    if convention in ("quark", "quark-fp8"):
        return (
            quark_config(
                post_rope=post_rope,
                custom_mode="fp8" if convention == "quark-fp8" else "quark",
                scale_dtype=scale_dtype or spec.default_dtype,
                version="0.13",
                exclude=("lm_head",),
                kv_cache_group=("*k_proj", "*v_proj"),
            ),
            None,
        )
    return None, None
