"""The :class:`Producer` base: what every checkpoint producer says about its KV scales.

A subclass (one file each) declares names read and written, how its config is
detected, its KV scheme (and findings about its own vocabulary in it), findings, whether
its weights are quantized, the granularities and stored shapes it supports, its 4-bit
(NVFP4) layout, and the configs it writes; the base holds what is the same for all.
Developer notes: ``docs/dev/checkpoint.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvquant.checkpoint.fp4_formats import Fp4Producer
from kvquant.errors import ConventionError, ScaleFormatError
from kvquant.schemes import PerHeadScales, PerTensorScales, StaticScales, scheme_class
from kvquant.types import ScaleKind

if TYPE_CHECKING:
    from kvquant.checkpoint.findings import Finding
    from kvquant.types import RawScale

__all__ = [
    "GLOBAL_SCALE",
    "OUTPUT_SCALE",
    "SELF_ATTN",
    "Naming",
    "Producer",
    "ScaleShape",
    "stored_scheme",
]


def stored_scheme(granularity: str | type[StaticScales]) -> type[StaticScales]:
    """The static scheme a checkpoint's scales are written at: ``granularity`` as a class.

    Args:
        granularity: :class:`~kvquant.schemes.PerTensorScales` or
            :class:`~kvquant.schemes.PerHeadScales`, or its word (``"per-tensor"``,
            ``"per-head"``).

    Raises:
        ConventionError: anything else (a dynamic or transformed scheme is not written as
            one static scale per tensor or head).
    """
    if isinstance(granularity, str):
        try:
            cls = scheme_class(granularity)
        except ScaleFormatError:
            cls = None
    else:
        cls = granularity
    if not (isinstance(cls, type) and issubclass(cls, StaticScales)):
        words = (PerTensorScales.name, PerHeadScales.name)
        raise ConventionError(
            f"granularity must be {words[0]!r} or {words[1]!r}, got {granularity!r}. "
            "Fix: pass one of those."
        )
    return cls


@dataclass(frozen=True)
class Naming:
    """One family of KV-scale tensor names.

    Attributes:
        family: the family's name, e.g. ``"modelopt"``.
        suffixes: tensor-name suffix per scale kind, after ``{prefix}layers.N.``
            (``"k"``/``"v"``, or ``"kv"`` alone for one scale serving both).
    """

    family: str
    suffixes: Mapping[ScaleKind, str]


SELF_ATTN = Naming("self_attn", {"k": "self_attn.k_scale", "v": "self_attn.v_scale"})
"""``self_attn.k_scale`` / ``v_scale``: written by compressed-tensors, Quark's fp8 mode and kvquant."""

OUTPUT_SCALE = Naming(
    "output_scale",
    {"k": "self_attn.k_proj.output_scale", "v": "self_attn.v_proj.output_scale"},
)
"""``k_proj.output_scale`` / ``v_proj.output_scale``: Quark's default, compressed-tensors before 2024-08."""

GLOBAL_SCALE = Naming(
    "global_scale", {"k": "self_attn.k_global_scale", "v": "self_attn.v_global_scale"}
)
"""``self_attn.k_global_scale`` / ``v_global_scale``: compressed-tensors' NVFP4 KV global scales."""


class ScaleShape(Enum):
    """The shape a KV-scale tensor is stored in; the value is how reports print it."""

    SCALAR = "()"
    """A 0-dim tensor."""
    ONE = "(1,)"
    """A one-element tensor."""
    PER_HEAD = "(Hkv,1,1)"
    """One scale per KV head (compressed-tensors ``attn_head``)."""

    def dims(self, num_kv_heads: int) -> tuple[int, ...]:
        """The tensor shape for ``num_kv_heads`` KV heads."""
        return {"()": (), "(1,)": (1,)}.get(self.value, (num_kv_heads, 1, 1))


class Producer:
    """One checkpoint producer convention (subclass per producer; one instance is registered).

    Attributes:
        name: the convention name (``write_checkpoint``'s ``convention``), unique.
        reports_as: the producer discovery reports for its checkpoints (default ``name``).
        names: the KV-scale names it writes.
        owns_names: whether names of :attr:`names` are read as this producer
            when the checkpoint's config names no producer.
        also_reads: more namings read as this producer under its own config.
        quant_methods: ``quantization_config.quant_method`` values naming it.
        default_dtype: the dtype it stores scales in.
        per_tensor_shape: the stored shape of a per-tensor scale.
        per_head: whether it stores per-head ``(Hkv,1,1)`` scales.
        writable: whether kvquant writes it for users (:data:`PRODUCER_CONVENTIONS`).
        keeps_weights: whether ``kvquant export`` writes KV scales beside its quantized weights.
        stores_k_transform: kvquant's own k-transform (K offsets and a settings file).
        hugging_face: whether its checkpoints are Hugging Face checkpoints
            (``kvquant export`` refuses the others).
        kvquant_config: whether its ``quantization_config`` is a saved
            :class:`~kvquant.KVQuantConfig` (loaded by kvquant's own quantizer).
        write_options: the :func:`~kvquant.testing.checkpoints.write_checkpoint`
            options only this producer takes.
        fp4: its NVFP4 KV global-scale layout (convention and tensor names), read by
            :mod:`kvquant.registry.fp4`; None when it writes no 4-bit KV checkpoints.
    """

    name: ClassVar[str]
    reports_as: ClassVar[str | None] = None
    names: ClassVar[Naming]
    owns_names: ClassVar[bool] = True
    also_reads: ClassVar[tuple[Naming, ...]] = ()
    quant_methods: ClassVar[tuple[str, ...]] = ()
    default_dtype: ClassVar[torch.dtype] = torch.float32
    per_tensor_shape: ClassVar[ScaleShape] = ScaleShape.SCALAR
    per_head: ClassVar[bool] = False
    writable: ClassVar[bool] = True
    keeps_weights: ClassVar[bool] = False
    stores_k_transform: ClassVar[bool] = False
    hugging_face: ClassVar[bool] = True
    kvquant_config: ClassVar[bool] = False
    write_options: ClassVar[frozenset[str]] = frozenset()
    fp4: ClassVar[Fp4Producer | None] = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @property
    def producer(self) -> str:
        """The producer name discovery reports for this convention's checkpoints."""
        return self.reports_as or self.name

    @property
    def naming(self) -> str:
        """The family of :attr:`names`."""
        return self.names.family

    @property
    def suffixes(self) -> Mapping[ScaleKind, str]:
        """Tensor-name suffix per scale kind, after ``{prefix}layers.N.``."""
        return self.names.suffixes

    @property
    def granularities(self) -> tuple[str, ...]:
        """The granularities it stores: ``"per-tensor"``, and ``"per-head"`` where it can."""
        schemes = (PerTensorScales, PerHeadScales) if self.per_head else (PerTensorScales,)
        return tuple(s.name for s in schemes)

    # ------------------------------------------------------------------ reading

    def detect(self, qcfg: Mapping[str, Any] | None) -> bool:
        """Whether ``quantization_config``'s ``quant_method`` names this producer."""
        method = str(qcfg.get("quant_method", "")).lower() if qcfg else ""
        return method in self.quant_methods

    def detect_side_config(self, hf_quant: Mapping[str, Any]) -> bool:
        """Whether ``hf_quant_config.json`` names it (asked when no ``quant_method`` does)."""
        return False

    def detect_in_folder(self, root: Path) -> bool:
        """Whether a file of the folder names it (asked when no config does)."""
        return False

    def reads(self, family: str) -> bool:
        """Whether a name of ``family`` is read as this producer under its own config."""
        return family == self.naming or any(n.family == family for n in self.also_reads)

    def kv_scheme(
        self, qcfg: Mapping[str, Any] | None, hf_quant: Mapping[str, Any] | None
    ) -> dict[str, Any] | None:
        """The KV scheme its configs declare, flattened into one dict (None: none declared)."""
        return None

    def kv_scheme_findings(self, scheme: Mapping[str, Any]) -> list[Finding]:
        """Findings about its own vocabulary in the :meth:`kv_scheme` it declared (none by
        default), after the generic FP8 checks of
        :func:`~kvquant.checkpoint.scheme.scheme_findings`."""
        return []

    def scale_facts(
        self, family: str, qcfg: Mapping[str, Any] | None
    ) -> tuple[bool, bool, tuple[str, ...]]:
        """``(pre_rope, merged_kv, notes)`` of a scale of ``family`` read as this producer."""
        return False, False, ()

    def kv_formats(
        self, qcfg: Mapping[str, Any] | None, hf_quant: Mapping[str, Any] | None, num_layers: int
    ) -> tuple[tuple[str, str], ...] | None:
        """The ``(K, V)`` format of each layer when its configs declare a 4-bit KV cache.

        Returns:
            ``("fp8" | "nvfp4", "fp8" | "nvfp4")`` per layer, or None for an FP8 (or no)
            declaration, which :func:`~kvquant.checkpoint.scheme.scheme_findings` judges.

        Raises:
            ScaleFormatError: a 4-bit declaration kvquant does not read (affine NVFP4, MXFP4
                scales, another group size), naming what was found and expected.
        """
        return None

    def scale_findings(
        self, raws: Sequence[RawScale], qcfg: Mapping[str, Any] | None
    ) -> list[Finding]:
        """Findings about the scales read as this producer (``raws`` are those only)."""
        return []

    def weight_finding(self, fp8_tensors: int, quant_algo: Any) -> Finding | None:
        """A finding about FP8 weights when the producer has its own (None: the generic one)."""
        return None

    def config_findings(self, qcfg: Mapping[str, Any]) -> list[Finding]:
        """Findings about the decided producer's ``quantization_config``."""
        return []

    def weight_quantization(
        self, qcfg: Mapping[str, Any], hf_quant: Mapping[str, Any] | None
    ) -> str | None:
        """How its configs quantize the weights, or None when they say nothing of it."""
        return None

    def config_quantizes_weights(self, qcfg: Mapping[str, Any]) -> bool:
        """Whether its ``quantization_config`` alone says the weights are quantized (what
        :func:`kvquant.from_pretrained` refuses before loading anything)."""
        return False

    # ------------------------------------------------------------------ writing

    def tensor_name(self, layer: int, kind: str, *, prefix: str = "model.") -> str:
        """The tensor name of one KV scale, e.g. ``model.layers.0.self_attn.k_scale``.

        Raises:
            ConventionError: a kind the producer does not store.
        """
        suffix = {str(k): v for k, v in self.suffixes.items()}.get(kind)
        if suffix is None:
            if set(self.suffixes) == {"kv"}:
                raise ConventionError(
                    f"{self.name} stores one 'kv' scale per layer, got kind {kind!r}. "
                    "Fix: ask for kind 'kv'."
                )
            raise ConventionError(
                f"{self.name} stores 'k' and 'v' scales, got kind {kind!r}. "
                "Fix: ask for 'k' or 'v'."
            )
        return f"{prefix}layers.{layer}.{suffix}"

    def stored_shape(
        self, granularity: str | type[StaticScales], num_kv_heads: int
    ) -> tuple[int, ...]:
        """The stored shape of one scale: ``(Hkv, 1, 1)`` per head, else :attr:`per_tensor_shape`.

        Args:
            granularity: the static scheme (or its word, :func:`stored_scheme`).
            num_kv_heads: ``Hkv``.

        Raises:
            ConventionError: an unknown granularity, or per-head for a per-tensor-only producer.
        """
        scheme = stored_scheme(granularity)
        if scheme.per_head:
            if not self.per_head:
                raise ConventionError(
                    f"{self.name} has no per-head KV-scale strategy; got granularity "
                    f"{scheme.name!r}. Fix: use 'compressed-tensors' (strategy attn_head) or "
                    "per-tensor scales."
                )
            return ScaleShape.PER_HEAD.dims(num_kv_heads)
        return self.per_tensor_shape.dims(num_kv_heads)

    def stored_scale(
        self,
        value: float | torch.Tensor,
        granularity: str | type[StaticScales],
        num_kv_heads: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Shape and type a canonical fp32 scale (a float, [] or [Hkv]) as the producer stores it.

        Per-tensor takes the max over heads; per-head broadcasts a scalar to every head.
        Returns a new tensor of :meth:`stored_shape` and ``dtype``.
        """
        shape = self.stored_shape(granularity, num_kv_heads)
        if isinstance(value, torch.Tensor):
            t = value.detach().to(torch.float32).reshape(-1)
        else:
            t = torch.tensor([float(value)], dtype=torch.float32)
        if stored_scheme(granularity).per_head:
            if t.numel() == 1:
                t = t.expand(num_kv_heads)
            return t.reshape(shape).to(dtype).clone()
        return t.amax().reshape(shape).to(dtype).clone()

    def writes_merged(self, *, post_rope: bool = False) -> bool:
        """Whether its export stores ``max(K, V)`` in both the K and the V tensor."""
        return False

    def configs(
        self,
        *,
        granularity: str = "per-tensor",
        fp8_weights: bool = False,
        post_rope: bool = False,
        scale_dtype: torch.dtype | None = None,
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """``(quantization_config, hf_quant_config.json)`` its current release writes (new dicts)."""
        return None, None

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
        """The configs of a copy whose KV scales ``kvquant export`` rewrote into this producer.

        Args:
            granularity: ``"per-tensor"`` or ``"per-head"``.
            qcfg: the source's ``quantization_config`` (not modified).
            hf_quant: the source's ``hf_quant_config.json`` (not modified).
            same_producer: the source was written by this producer.
            weights: how the source quantizes its weights (None: it does not).
            observer: how the scales were chosen (``"minmax"`` or ``"mse"``).

        Returns:
            ``(quantization_config or None to leave config.json alone, hf_quant_config or None)``.

        Raises:
            ConventionError: kvquant export does not write this producer.
        """
        raise ConventionError(
            f"kvquant export does not write {self.name} KV scales; expected a producer it "
            "writes beside the weights. Fix: export a KV-only checkpoint."
        )
