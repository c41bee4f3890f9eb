"""AMD Quark: ``k_proj.output_scale`` / ``v_proj.output_scale`` (``()``, bf16), and its fp8 mode.

By default K is calibrated before RoPE and both tensors hold ``max(K, V)``;
``kv_cache_post_rope: true`` keeps them separate and post-RoPE. The
``custom_mode="fp8"`` export (:class:`QuarkFp8`) names them ``self_attn.k_scale``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvquant.checkpoint.findings import Finding
from kvquant.checkpoint.producers.base import OUTPUT_SCALE, SELF_ATTN, Naming, Producer, ScaleShape

if TYPE_CHECKING:
    from kvquant.types import RawScale

__all__ = ["Quark", "QuarkFp8", "quark_config"]

_WEIGHT_SECTIONS = ("global_quant_config", "layer_quant_config", "layer_type_quant_config")


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")


def _kv_entry() -> dict[str, Any]:
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
    return {
        "weight": None,
        "input_tensors": None,
        "output_tensors": out_tensors,
        "bias": None,
        "target_device": None,
    }


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
            "layer_quant_config": {"*k_proj": _kv_entry(), "*v_proj": _kv_entry()},
            "kv_cache_quant_config": {"*k_proj": _kv_entry(), "*v_proj": _kv_entry()},
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


def _post_rope(qcfg: Mapping[str, Any] | None) -> bool:
    if not qcfg:
        return False
    value = qcfg.get("kv_cache_post_rope")
    if value is None and isinstance(qcfg.get("export"), Mapping):
        value = qcfg["export"].get("kv_cache_post_rope")
    return bool(value)


class Quark(Producer):
    """AMD Quark's default ``quark`` export format."""

    name = "quark"
    names = OUTPUT_SCALE
    also_reads: ClassVar[tuple[Naming, ...]] = (SELF_ATTN,)
    quant_methods: ClassVar[tuple[str, ...]] = ("quark",)
    default_dtype = torch.bfloat16
    per_tensor_shape = ScaleShape.SCALAR
    write_options = frozenset({"post_rope"})
    custom_mode = "quark"

    def kv_scheme(
        self, qcfg: Mapping[str, Any] | None, hf_quant: Mapping[str, Any] | None
    ) -> dict[str, Any] | None:
        kvc = qcfg.get("kv_cache_quant_config") if qcfg else None
        if not isinstance(kvc, Mapping) or not kvc:
            return None
        first = next(iter(kvc.values()))
        out_t = first.get("output_tensors") if isinstance(first, Mapping) else None
        out = dict(out_t) if isinstance(out_t, Mapping) else {}
        out["keys"] = sorted(kvc)
        out["kv_cache_post_rope"] = _post_rope(qcfg)
        return out

    def kv_scheme_findings(self, scheme: Mapping[str, Any]) -> list[Finding]:
        qscheme = scheme.get("qscheme")
        if qscheme is None or str(qscheme) == "per_tensor":
            return []
        return [
            Finding(
                "error",
                "kv-scheme-unsupported",
                f"the quark KV scheme has qscheme={qscheme!r}; kvquant understands per_tensor "
                "output scales. Fix: export per_tensor KV scales.",
            )
        ]

    def scale_facts(
        self, family: str, qcfg: Mapping[str, Any] | None
    ) -> tuple[bool, bool, tuple[str, ...]]:
        notes: list[str] = []
        if qcfg is None:
            notes.append(
                "no quantization_config: assumed Quark's default (K calibrated pre-RoPE, "
                "max(K, V) stored in both)"
            )
        post_rope = _post_rope(qcfg)
        merged = not post_rope
        if family == SELF_ATTN.family:
            merged = True
            notes.append("Quark fp8-mode export: both tensors hold max(K, V)")
        return not post_rope, merged, tuple(notes)

    def scale_findings(
        self, raws: Sequence[RawScale], qcfg: Mapping[str, Any] | None
    ) -> list[Finding]:
        if not raws:
            return []
        if _post_rope(qcfg):
            return [
                Finding(
                    "info",
                    "quark-post-rope",
                    "Quark export with kv_cache_post_rope: true: K calibrated after RoPE, K and "
                    "V scales kept separate; used as is.",
                )
            ]
        found = [
            Finding(
                "info",
                "quark-pre-rope-merged",
                "Quark default export (kv_cache_post_rope: false): K was calibrated before RoPE "
                "and both tensors hold max(K, V). RoPE can raise a post-RoPE key component up to "
                "sqrt(2)x the pre-RoPE amax, so K may saturate at 448 unless the merge with V "
                "already covers it; the registry's policy decides (see per-layer notes).",
            )
        ]
        by_layer: dict[int, dict[str, torch.Tensor]] = {}
        for r in raws:
            by_layer.setdefault(r.layer, {})[r.kind] = r.tensor
        pairs = [d for d in by_layer.values() if "k" in d and "v" in d]
        identical = all(
            d["k"].shape == d["v"].shape
            and bool(torch.equal(d["k"].to(torch.float64), d["v"].to(torch.float64)))
            for d in pairs
        )
        if pairs and not identical:
            found.append(
                Finding(
                    "warning",
                    "quark-merge-mismatch",
                    "the Quark config says K and V scales are merged, but some layers hold "
                    "different K and V values: treated as separate scales.",
                )
            )
        return found

    def weight_quantization(
        self, qcfg: Mapping[str, Any], hf_quant: Mapping[str, Any] | None
    ) -> str | None:
        for key in _WEIGHT_SECTIONS:
            section = qcfg.get(key)
            entries = list(section.values()) if isinstance(section, Mapping) else []
            if key == "global_quant_config" and isinstance(section, Mapping):
                entries = [section]
            for entry in entries:
                if isinstance(entry, Mapping) and entry.get("weight") is not None:
                    return f"Quark {key} quantizes weights"
        return None

    def config_quantizes_weights(self, qcfg: Mapping[str, Any]) -> bool:
        glob = qcfg.get("global_quant_config") or {}
        return bool(isinstance(glob, Mapping) and glob.get("weight"))

    def writes_merged(self, *, post_rope: bool = False) -> bool:
        return not post_rope

    def configs(
        self,
        *,
        granularity: str = "per-tensor",
        fp8_weights: bool = False,
        post_rope: bool = False,
        scale_dtype: torch.dtype | None = None,
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        qcfg = quark_config(
            post_rope=post_rope,
            custom_mode=self.custom_mode,
            scale_dtype=scale_dtype or self.default_dtype,
            version="0.13",
            exclude=("lm_head",),
            kv_cache_group=("*k_proj", "*v_proj"),
        )
        return qcfg, None


class QuarkFp8(Quark):
    """Quark's ``custom_mode="fp8"`` export: ``self_attn.k_scale`` / ``v_scale``, both ``max(K, V)``."""

    name = "quark-fp8"
    reports_as = "quark"
    names = SELF_ATTN
    owns_names = False
    also_reads = ()
    quant_methods = ()  # its config says quant_method "quark": read as Quark
    write_options = frozenset()
    custom_mode = "fp8"

    def writes_merged(self, *, post_rope: bool = False) -> bool:
        return True
