"""Findings about what a checkpoint's configs declare: its KV scheme, and FP8 weights.

Only FP8 (e4m3), symmetric, static ``tensor`` / ``attn_head`` KV schemes are judged here;
anything else is an error finding, unless the producer read it as a 4-bit declaration
(:meth:`~kvquant.checkpoint.producers.Producer.kv_formats`), which discovery then passes over.
A producer judges its own vocabulary (Quark's ``qscheme``: ``per_tensor`` only) in
:meth:`~kvquant.checkpoint.producers.Producer.kv_scheme_findings`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvquant.checkpoint.findings import Finding
from kvquant.checkpoint.producers import NO_PRODUCER, Producer, reported

__all__ = ["FP8_DTYPES", "scheme_findings", "weight_findings"]

FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"})
"""safetensors dtypes of FP8 tensors."""


def scheme_findings(producer: str, scheme: Mapping[str, Any] | None) -> list[Finding]:
    """Findings about a declared KV scheme (:meth:`~kvquant.checkpoint.producers.Producer.kv_scheme`).

    Args:
        producer: the producer's name, for the messages; its own findings follow
            (:meth:`~kvquant.checkpoint.producers.Producer.kv_scheme_findings`).
        scheme: the flattened scheme, or None (no findings).
    """
    found: list[Finding] = []
    if scheme is None:
        return found
    algo = scheme.get("kv_cache_quant_algo")
    if algo is not None and str(algo).upper() != "FP8":
        found.append(
            Finding(
                "error",
                "kv-scheme-unsupported",
                f"hf_quant_config.json declares kv_cache_quant_algo={algo!r}; kvquant serves FP8 "
                "(e4m3) KV caches only. Fix: export with kv_cache_quant_algo 'FP8', or load the "
                "model without kvquant.",
            )
        )
    bits = scheme.get("num_bits")
    qtype = scheme.get("type")
    dtype = scheme.get("dtype")
    if (
        (bits is not None and bits != 8)
        or (qtype is not None and str(qtype) != "float")
        or (dtype is not None and "fp8" not in str(dtype).lower())
    ):
        found.append(
            Finding(
                "error",
                "kv-scheme-unsupported",
                f"the {producer} KV scheme is num_bits={bits!r}, type={qtype!r}"
                f"{f', dtype={dtype!r}' if dtype is not None else ''}; kvquant serves 8-bit float "
                "(FP8 e4m3) KV caches only. Fix: export an FP8 KV scheme.",
            )
        )
    symmetric = scheme.get("symmetric")
    if symmetric is False:
        found.append(
            Finding(
                "error",
                "kv-scheme-asymmetric",
                f"the {producer} KV scheme is asymmetric (symmetric: false, zero points); kvquant's "
                "FP8 cache is symmetric (scale only). Fix: re-calibrate with symmetric: true.",
            )
        )
    if scheme.get("dynamic") is True:
        found.append(
            Finding(
                "info",
                "kv-scheme-dynamic",
                f"the {producer} KV scheme is dynamic: no stored KV scales are expected; kvquant "
                "computes scales as tokens are written (fp32-group, or as --missing-scales says).",
            )
        )
    strategy = scheme.get("strategy")
    if strategy is not None and str(strategy) not in ("tensor", "attn_head"):
        found.append(
            Finding(
                "error",
                "kv-scheme-unsupported",
                f"the {producer} KV scheme has strategy={strategy!r}; kvquant understands "
                "'tensor' (per-tensor) and 'attn_head' (per KV head). Fix: export one of those.",
            )
        )
    elif strategy is not None:
        found.append(
            Finding("info", "kv-scheme", f"{producer} kv_cache_scheme strategy={strategy!r}.")
        )
    owner = reported(producer)
    if owner is not None:
        found.extend(owner.kv_scheme_findings(scheme))
    return found


def weight_findings(
    producer: Producer | None,
    qcfg: Mapping[str, Any] | None,
    hf_quant: Mapping[str, Any] | None,
    weight_dtypes: Mapping[str, int],
) -> list[Finding]:
    """Findings about FP8 weight tensors: the producer's own, else missing or present configs.

    Args:
        producer: the decided producer (None: none).
        qcfg: ``quantization_config``.
        hf_quant: ``hf_quant_config.json``.
        weight_dtypes: header dtype -> count over the non-scale tensors.
    """
    fp8 = sum(n for d, n in weight_dtypes.items() if d in FP8_DTYPES)
    quant_algo = None
    if qcfg:
        quant_algo = qcfg.get("quant_algo")
    if hf_quant:
        quant = hf_quant.get("quantization", hf_quant)
        if isinstance(quant, Mapping) and quant.get("quant_algo") is not None:
            quant_algo = quant.get("quant_algo")
    own = producer.weight_finding(fp8, quant_algo) if producer is not None else None
    if own is not None:
        return [own]
    if fp8 and not qcfg:
        return [
            Finding(
                "warning",
                "fp8-weights-no-config",
                f"{fp8} weight tensors are stored in FP8 but config.json has no "
                "quantization_config: transformers would upcast them without any weight scale. "
                "Fix: use the checkpoint's original config, or dequantize the weights first.",
            )
        ]
    if fp8:
        name = producer.producer if producer is not None else NO_PRODUCER
        return [
            Finding(
                "info",
                "fp8-weights",
                f"{fp8} weight tensors are FP8 ({name} weight quantization); "
                "loading them needs the producer's transformers integration.",
            )
        ]
    return []
