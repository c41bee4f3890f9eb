"""``kvquant export``: rewrite a checkpoint's KV scales into what a serving engine's loader accepts.

:func:`export_checkpoint` reads a checkpoint's KV scales with discovery and the
registry (:func:`~kvquant.checkpoint.discovery.discover_scales`,
:func:`~kvquant.registry.resolve.resolve_scales`: canonical fp32 scales, or the
registry's :class:`~kvquant.errors.ScaleFormatError`), then writes a copy of
the checkpoint into a new folder in which only what must change is rewritten:

* the safetensors shard(s) holding KV scales (every other tensor in them is
  re-saved byte for byte; shards without KV scales are hard-linked or copied,
  every other file copied);
* ``model.safetensors.index.json`` (new names, new ``total_size``);
* ``config.json``'s ``quantization_config`` and ``hf_quant_config.json``.

Per engine (the sources are listed in ``docs/export.md``):

==============  ===========  ==========================================  ==============
engine          granularity  tensors per layer ``N``                     shape, dtype
==============  ===========  ==========================================  ==============
vllm            per-tensor   ``layers.N.self_attn.k_scale`` / ``v_scale``  ``(1,)`` fp32
vllm            per-head     same names, ``strategy: attn_head``           ``(Hkv,1,1)`` fp32
sglang          per-tensor   ``layers.N.self_attn.k_scale`` / ``v_scale``  ``()`` fp32
tensorrt-llm    per-tensor   ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale``  ``()`` fp32
==============  ===========  ==========================================  ==============

A source whose weights are quantized keeps its weight quantization (and so its
producer's config): a ModelOpt FP8 checkpoint stays ModelOpt for every engine,
a compressed-tensors one stays compressed-tensors. A source with unquantized
weights gets the engine's KV-only convention (compressed-tensors for vLLM and
SGLang). Per-head scales are reduced to per-tensor with max where the engine
takes per-tensor scales only, and the cost (max/min ratio per layer) is
reported. A legacy single ``kv_scale`` becomes separate ``k_scale`` and
``v_scale``. Quark's pre-RoPE K scales follow the registry's ``rope_policy``
(``"widen"`` multiplies by sqrt(2), ``"keep"`` exports as stored and warns).

The output is written by :mod:`kvquant.checkpoint.writer` into a temporary
folder beside ``out`` and renamed into place only after it has been
re-discovered and checked: a failed export leaves no ``out`` behind.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from kvquant.checkpoint import producers
from kvquant.checkpoint.discovery import (
    DiscoveredCheckpoint,
    discover_scales,
    scale_tensor_infos,
)
from kvquant.checkpoint.files import check_path_argument
from kvquant.checkpoint.writer import (
    CheckpointEdit,
    FileContent,
    WrittenCheckpoint,
    check_output_path,
    kv_scale_tensors,
    write_checkpoint_copy,
)
from kvquant.errors import ExportError, ExportTargetExistsError
from kvquant.registry.policy import broadcast_to_per_head, reduce_to_per_tensor
from kvquant.registry.resolve import analyze_scales, resolve_scales
from kvquant.tables import WIDTH, render_table
from kvquant.types import RawScale

__all__ = [
    "ENGINES",
    "ExportError",
    "ExportReport",
    "ExportTargetExistsError",
    "LayerExport",
    "compressed_tensors_config",
    "compressed_tensors_kv_scheme",
    "engine_rules",
    "export_checkpoint",
    "kv_quantization_configs",
    "weight_quantization",
]

Engine = Literal["vllm", "sglang", "tensorrt-llm"]
ExportGranularity = Literal["per-tensor", "per-head"]

ENGINES: tuple[str, ...] = ("vllm", "sglang", "tensorrt-llm")
"""The serving engines :func:`export_checkpoint` writes for."""

REPORT_FILE = "kvquant-export.json"
_FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})
_BUFFER_DTYPES = frozenset({"I64", "BOOL"})  # position ids, masks: not quantized weights


# ---------------------------------------------------------------------------
# engine rules


@dataclass(frozen=True)
class _Rule:
    engine: str
    granularity: str
    shape: str  # "()", "(1,)" or "(Hkv,1,1)"
    note: str


_RULES: dict[tuple[str, str], _Rule] = {
    ("vllm", "per-tensor"): _Rule(
        "vllm",
        "per-tensor",
        "(1,)",
        "vLLM loads each scale into a one-element fp32 parameter (numel-1 tensors are "
        "filled, so () loads too) and keeps a Python float per layer",
    ),
    ("vllm", "per-head"): _Rule(
        "vllm",
        "per-head",
        "(Hkv,1,1)",
        "vLLM's compressed-tensors attn_head path: one scale per KV head; vLLM documents "
        "per-head KV scales for the FlashAttention backend only (other backends use the "
        "max over heads)",
    ),
    ("sglang", "per-tensor"): _Rule(
        "sglang",
        "per-tensor",
        "()",
        "SGLang keeps 0-dim fp32 k_scale / v_scale parameters and raises 'Only support "
        "per-tensor scaling factor for fp8 KV cache' for anything else",
    ),
    ("tensorrt-llm", "per-tensor"): _Rule(
        "tensorrt-llm",
        "per-tensor",
        "()",
        "TensorRT-LLM's FP8 linear method reads k_proj.k_scale / v_proj.v_scale as "
        "single elements into fp32 kv_scales",
    ),
}


def engine_rules() -> list[dict[str, str]]:
    """The engine/granularity combinations :func:`export_checkpoint` supports.

    Returns:
        One dict per combination: ``engine``, ``granularity``, ``shape`` and a ``note``.
    """
    return [
        {"engine": r.engine, "granularity": r.granularity, "shape": r.shape, "note": r.note}
        for r in _RULES.values()
    ]


# ---------------------------------------------------------------------------
# report


@dataclass(frozen=True)
class LayerExport:
    """What was written for one decoder layer.

    Attributes:
        layer: decoder layer index.
        k_name: the K scale's tensor name in the output.
        v_name: the V scale's tensor name in the output.
        shape: the stored shape of both tensors.
        k: the fp32 K value(s) written.
        v: the fp32 V value(s) written.
        k_ratio: max/min over the KV heads of the K scale before a per-head ->
            per-tensor reduction (1.0 when nothing was reduced).
        v_ratio: same for V.
        sources: the source tensor names.
    """

    layer: int
    k_name: str
    v_name: str
    shape: tuple[int, ...]
    k: tuple[float, ...]
    v: tuple[float, ...]
    k_ratio: float = 1.0
    v_ratio: float = 1.0
    sources: tuple[str, ...] = ()

    @property
    def reduction_ratio(self) -> float:
        """The larger of the K and V max/min ratios (1.0: lossless)."""
        return max(self.k_ratio, self.v_ratio)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "layer": self.layer,
            "k_name": self.k_name,
            "v_name": self.v_name,
            "shape": list(self.shape),
            "k": list(self.k),
            "v": list(self.v),
            "k_ratio": self.k_ratio,
            "v_ratio": self.v_ratio,
            "sources": list(self.sources),
        }


@dataclass(frozen=True, eq=False)
class ExportReport:
    """The result of :func:`export_checkpoint`.

    Attributes:
        source: the source checkpoint folder.
        out: the output folder.
        engine: ``"vllm"``, ``"sglang"`` or ``"tensorrt-llm"``.
        granularity: ``"per-tensor"`` or ``"per-head"``.
        source_producer: the producer convention discovery decided for the source.
        target_convention: the convention written (``"compressed-tensors"`` or ``"modelopt"``).
        layers: one :class:`LayerExport` per decoder layer.
        notes: what was converted and why (registry notes included).
        warnings: what the user must know before serving the output.
        rewritten_files: output files written anew (shards holding scales, configs, index).
        linked_files: files hard-linked from the source.
        copied_files: files copied from the source.
    """

    source: str
    out: str
    engine: str
    granularity: str
    source_producer: str
    target_convention: str
    layers: tuple[LayerExport, ...]
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    rewritten_files: tuple[str, ...] = ()
    linked_files: tuple[str, ...] = ()
    copied_files: tuple[str, ...] = ()

    @property
    def reduced(self) -> bool:
        """Whether any per-head scale was reduced to per-tensor (lossy)."""
        return any(layer.reduction_ratio > 1.0 for layer in self.layers)

    @property
    def max_reduction_ratio(self) -> float:
        """The worst per-layer max/min ratio of the reduction (1.0: lossless)."""
        return max((layer.reduction_ratio for layer in self.layers), default=1.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the report."""
        return {
            "source": self.source,
            "out": self.out,
            "engine": self.engine,
            "granularity": self.granularity,
            "source_producer": self.source_producer,
            "target_convention": self.target_convention,
            "reduced": self.reduced,
            "max_reduction_ratio": self.max_reduction_ratio,
            "layers": [layer.to_dict() for layer in self.layers],
            "notes": list(self.notes),
            "warnings": list(self.warnings),
            "rewritten_files": list(self.rewritten_files),
            "linked_files": list(self.linked_files),
            "copied_files": list(self.copied_files),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """Return :meth:`to_dict` as strict JSON."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def render(self, width: int = WIDTH) -> str:
        """Plain-text summary: header, one row per layer, notes and warnings, at most ``width`` columns."""
        lines = [
            f"exported:   {self.source} -> {self.out}",
            f"engine:     {self.engine} ({self.granularity})",
            f"convention: {self.source_producer} -> {self.target_convention}",
        ]
        if self.reduced:
            worst = max(self.layers, key=lambda layer: layer.reduction_ratio)
            cost = (
                f"per-head -> per-tensor with max; worst max/min ratio "
                f"{self.max_reduction_ratio:.3g} (layer {worst.layer}, the smallest head "
                f"loses up to {math.log2(self.max_reduction_ratio):.2f} bits)"
            )
            lines.append(
                textwrap.fill(
                    cost, width=width, initial_indent="cost:       ", subsequent_indent=" " * 12
                )
            )
        k_pattern = _name_pattern([(layer.layer, layer.k_name) for layer in self.layers])
        v_pattern = _name_pattern([(layer.layer, layer.v_name) for layer in self.layers])
        named = not (k_pattern and v_pattern)
        if not named:
            lines.append(f"K tensors:  {k_pattern}")
            lines.append(f"V tensors:  {v_pattern}")
        lines.append("")
        header: tuple[str, ...] = ("layer", "K tensor", "V tensor") if named else ("layer",)
        header += ("shape", "K", "V", "max/min")
        rows = []
        for layer in self.layers:
            names = (layer.k_name, layer.v_name) if named else ()
            rows.append(
                (
                    str(layer.layer),
                    *names,
                    str(layer.shape),
                    _fmt_values(layer.k),
                    _fmt_values(layer.v),
                    f"{layer.reduction_ratio:.3g}",
                )
            )
        lines.append(
            render_table(
                header,
                rows,
                wrap={"K tensor", "V tensor", "K", "V"},
                right={"max/min"},
                width=width,
            )
        )
        for title, items in (("notes:", self.notes), ("warnings:", self.warnings)):
            if items:
                lines += ["", title]
                lines.extend(
                    textwrap.fill(
                        item,
                        width=width,
                        initial_indent="  - ",
                        subsequent_indent="    ",
                        break_long_words=False,
                        break_on_hyphens=False,
                    )
                    for item in items
                )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def _name_pattern(names: Sequence[tuple[int, str]]) -> str:
    """``"model.layers.N.self_attn.k_scale"`` when every name is that with its layer as N."""
    patterns = set()
    for layer, name in names:
        marker = f"layers.{layer}."
        if marker not in name:
            return ""
        patterns.add(name.replace(marker, "layers.N.", 1))
    return patterns.pop() if len(patterns) == 1 else ""


def _fmt_values(values: Sequence[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.6g}"
    return "[" + ", ".join(f"{v:.4g}" for v in values) + "]"


# ---------------------------------------------------------------------------
# decisions


def weight_quantization(found: DiscoveredCheckpoint) -> str | None:
    """Describe the source's weight quantization, or ``None`` when the weights are plain floats."""
    quantized = {
        d: n for d, n in found.weight_dtypes.items() if d not in _FLOAT_DTYPES | _BUFFER_DTYPES
    }
    if quantized:
        return f"{sum(quantized.values())} weight tensors stored as {sorted(quantized)}"
    qcfg = found.quantization_config or {}
    if qcfg.get("config_groups"):
        return f"{qcfg.get('quant_method')} config_groups {sorted(qcfg['config_groups'])}"
    algo = qcfg.get("quant_algo")
    if found.hf_quant_config:
        quant = found.hf_quant_config.get("quantization", found.hf_quant_config)
        if isinstance(quant, Mapping) and quant.get("quant_algo") is not None:
            algo = quant.get("quant_algo")
    if algo is not None:
        return f"ModelOpt quant_algo {algo!r}"
    for key in ("global_quant_config", "layer_quant_config", "layer_type_quant_config"):
        section = qcfg.get(key)
        entries = section.values() if isinstance(section, Mapping) else []
        if key == "global_quant_config" and isinstance(section, Mapping):
            entries = [section]
        for entry in entries:
            if isinstance(entry, Mapping) and entry.get("weight") is not None:
                return f"Quark {key} quantizes weights"
    return None


def _target_convention(
    engine: str, granularity: str, found: DiscoveredCheckpoint, weights: str | None
) -> str:
    """Pick the convention to write, or raise :class:`ExportError` naming why none fits."""
    producer = found.producer
    if engine == "tensorrt-llm":
        if producer == "modelopt" and weights is not None:
            return "modelopt"
        raise ExportError(
            f"{found.path}: a {producer} checkpoint "
            + (f"with {weights}" if weights else "with unquantized weights")
            + " cannot be exported for TensorRT-LLM. Its HF loader requires "
            "hf_quant_config.json to name a weight quant_algo ('Pre-quantized checkpoint must "
            "have quant_algo', tensorrt_llm/llmapi/llm_utils.py) and reads k_scale / v_scale "
            "only inside its FP8 linear methods, under k_proj / v_proj (ModelOpt naming). "
            "Fix: quantize the weights with ModelOpt (quant_algo FP8, kv_cache_quant_algo FP8) "
            "and export that checkpoint, or serve this one with --engine vllm or sglang."
        )
    if weights is None:
        return "compressed-tensors"
    if producer == "compressed-tensors":
        return "compressed-tensors"
    if producer == "modelopt":
        if granularity == "per-head":
            raise ExportError(
                f"{found.path}: ModelOpt weight quantization ({weights}) is kept as is, and "
                "ModelOpt's config has no per-head KV strategy (vLLM reads ModelOpt KV scales "
                "per tensor). Fix: export per-tensor (drop --per-head), or re-export the "
                "weights with llm-compressor (kv_cache_scheme strategy attn_head)."
            )
        return "modelopt"
    raise ExportError(
        f"{found.path}: the weights are quantized by {producer} ({weights}); kvquant export "
        "keeps weight quantization untouched and writes KV scales in the weight producer's "
        f"convention, but it does not write {producer} KV scales for {engine}. Fix: use the "
        "producer's own export for that engine, or export a KV-only checkpoint "
        "(unquantized weights) and re-run kvquant export."
    )


def _refuse_unusable(found: DiscoveredCheckpoint) -> None:
    if found.k_transform is not None:
        raise ExportError(
            f"{found.path} holds kvquant's k-transform format (per-channel K offsets, "
            f"rotation {found.k_transform.settings.rotation or 'none'}, first tokens at full "
            "precision; kvquant_kv_transform.json): no serving engine reads it, and its K scales "
            "were calibrated for the offset keys, so exporting them alone would saturate. Fix: "
            "calibrate a per-head format for export (`kvquant calibrate MODEL_DIR --format "
            "per-head --out DIR`) and export that checkpoint; serve this one with kvquant.patch()."
        )
    errors = [f for f in found.findings if f.severity == "error"]
    if errors:
        listed = "; ".join(f"{f.code}: {f.message}" for f in errors)
        raise ExportError(
            f"{found.path} has checkpoint-level problems that no engine format can carry: "
            f"{listed} (`kvquant doctor {found.path}` shows them)."
        )
    scheme = found.kv_scheme or {}
    if not found.scales:
        dynamic = scheme.get("dynamic") is True
        raise ExportError(
            f"{found.path} carries no static KV scales"
            + (" (its KV scheme is dynamic)" if dynamic else "")
            + "; kvquant would compute dynamic fp32-group scales while writing the cache, and "
            "that format has no static form an engine could load (vLLM and SGLang would "
            "silently use 1.0). Fix: calibrate static scales with `kvquant calibrate MODEL_DIR "
            "--out DIR` or with a producer (llm-compressor kv_cache_scheme, ModelOpt "
            "kv_cache_quant_algo FP8, Quark), then export that checkpoint."
        )
    if any(r.convention == "tensorrt-llm" for r in found.scales):
        raise ExportError(
            f"{found.path} holds TensorRT-LLM engine-checkpoint scales "
            "(attention.kv_cache_scaling_factor); that is not a Hugging Face checkpoint. "
            "Fix: export from the Hugging Face checkpoint the engine was built from."
        )


def _prefix(raw: RawScale) -> str:
    marker = f"layers.{raw.layer}."
    index = raw.name.find(marker)
    return raw.name[:index] if index >= 0 else "model."


def _shape_for(engine: str, granularity: str, num_kv_heads: int) -> tuple[int, ...]:
    rule = _RULES[(engine, granularity)]
    if rule.shape == "(Hkv,1,1)":
        return (num_kv_heads, 1, 1)
    if rule.shape == "(1,)":
        return (1,)
    return ()


# ---------------------------------------------------------------------------
# configs


def compressed_tensors_kv_scheme(
    granularity: str, *, observer: str = "minmax", base: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``kv_cache_scheme`` of static FP8 K/V scales, as compressed-tensors writes it.

    Built with compressed-tensors' own ``QuantizationArgs`` where that package is
    installed, else :func:`kvquant.checkpoint.producers.compressed_tensors_kv_scheme`'s
    hand-written dict (the two agree: tested).

    Args:
        granularity: ``"per-tensor"`` (``strategy: tensor``) or ``"per-head"``
            (``strategy: attn_head``).
        observer: how the scales were chosen (``"minmax"``: amax / 448; ``"mse"``:
            a clipping search minimising the quantization error).
        base: an existing scheme whose other keys are kept.

    Returns:
        A new JSON-ready dict.
    """
    scheme = producers.compressed_tensors_kv_scheme(granularity)
    scheme["observer"] = observer
    try:
        from compressed_tensors.quantization import QuantizationArgs
    except ImportError:
        built = scheme
    else:
        built = QuantizationArgs(
            num_bits=8,
            type="float",
            strategy="attn_head" if granularity == "per-head" else "tensor",
            dynamic=False,
            symmetric=True,
            observer=observer,
        ).model_dump(mode="json")
    if not base:
        return built
    merged = dict(base)
    for key in ("num_bits", "type", "strategy", "dynamic", "symmetric", "observer"):
        merged[key] = built[key]
    return merged


def compressed_tensors_config(
    granularity: str, *, observer: str = "minmax", version: str | None = None
) -> dict[str, Any]:
    """A KV-only compressed-tensors ``quantization_config`` (weights left unquantized).

    Built with compressed-tensors' ``QuantizationConfig`` where installed, else
    :func:`kvquant.checkpoint.producers.compressed_tensors_config`'s dict.

    Args:
        granularity: see :func:`compressed_tensors_kv_scheme`.
        observer: see :func:`compressed_tensors_kv_scheme`.
        version: the ``version`` entry; left out when None.

    Returns:
        A new JSON-ready dict.
    """
    scheme = compressed_tensors_kv_scheme(granularity, observer=observer)
    try:
        from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
    except ImportError:
        out = producers.compressed_tensors_config(granularity, version=version)
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


def kv_quantization_configs(
    convention: str,
    granularity: str,
    found: DiscoveredCheckpoint,
    weights: str | None,
    *,
    observer: str = "minmax",
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Return (quantization_config or None to leave config.json alone, hf_quant_config or None)."""
    qcfg = dict(found.quantization_config or {})
    if convention == "compressed-tensors":
        if weights is not None and found.producer == "compressed-tensors":
            qcfg["kv_cache_scheme"] = compressed_tensors_kv_scheme(
                granularity, observer=observer, base=qcfg.get("kv_cache_scheme")
            )
            return qcfg, None
        version = qcfg.get("version") if found.producer == "compressed-tensors" else None
        return compressed_tensors_config(granularity, observer=observer, version=version), None
    # modelopt, weights quantized by ModelOpt: keep the weight config, declare FP8 KV
    # (a checkpoint declaring ModelOpt in hf_quant_config.json only keeps no config entry).
    if qcfg:
        qcfg["kv_cache_scheme"] = producers.modelopt_kv_cache_scheme()
    hf_quant = json.loads(json.dumps(found.hf_quant_config or {}))
    if not hf_quant:
        hf_quant = {
            "producer": {"name": "modelopt", "version": "unknown"},
            "quantization": {"quant_algo": qcfg.get("quant_algo", "FP8")},
        }
    quant = hf_quant.setdefault("quantization", {})
    quant["kv_cache_quant_algo"] = "FP8"
    return qcfg or None, hf_quant


# ---------------------------------------------------------------------------
# main entry point


def export_checkpoint(
    src: str | Path,
    out: str | Path,
    *,
    engine: str,
    granularity: str = "per-tensor",
    rope_policy: str = "widen",
    missing_kv: str = "error",
    force: bool = False,
    link: bool = True,
    progress: bool = False,
) -> ExportReport:
    """Write a copy of a checkpoint whose KV scales follow one serving engine's loader.

    Args:
        src: the source checkpoint folder (config.json + *.safetensors).
        out: the output folder; must not exist unless ``force``.
        engine: ``"vllm"``, ``"sglang"`` or ``"tensorrt-llm"``.
        granularity: ``"per-tensor"`` (every engine; per-head scales are reduced
            with max and the cost reported) or ``"per-head"`` (vLLM only:
            compressed-tensors ``attn_head``, ``(Hkv,1,1)``; per-tensor sources
            are broadcast, losslessly).
        rope_policy: K scales calibrated before RoPE (Quark default):
            ``"widen"`` (x sqrt(2), default) or ``"keep"`` (as stored, warned).
        missing_kv: a layer with only K or only V: ``"error"`` or ``"reuse"``.
        force: replace ``out`` if it is an existing folder (only after the new
            one is complete).
        link: hard-link the unchanged weight shards (falls back to copying);
            ``False`` always copies. Other files are always copied.
        progress: show a tqdm progress bar (bytes written) on stderr.

    Returns:
        The :class:`ExportReport` (also written to ``out/kvquant-export.json``).

    Raises:
        CheckpointError: ``src`` is not a readable checkpoint.
        ScaleFormatError: the registry rejects the source's KV scales (the
            message lists every problem, as ``kvquant doctor`` does).
        ExportError: nothing static to export, the engine cannot take this
            granularity or convention, checkpoint-level errors, or a bad ``out``.
        ExportTargetExistsError: ``out`` exists and ``force`` is False.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from kvquant.testing.checkpoints import write_checkpoint
        >>> with tempfile.TemporaryDirectory() as d:
        ...     src = write_checkpoint(Path(d) / "src", convention="modelopt", weights="none")
        ...     report = export_checkpoint(src, Path(d) / "out", engine="sglang")
        ...     report.target_convention, report.layers[0].k_name, report.layers[0].shape
        ('compressed-tensors', 'model.layers.0.self_attn.k_scale', ())
    """
    if engine not in ENGINES:
        raise ExportError(
            f"engine={engine!r} is not an engine kvquant exports for; expected one of "
            f"{', '.join(ENGINES)}."
        )
    if (engine, granularity) not in _RULES:
        if granularity not in ("per-tensor", "per-head"):
            raise ExportError(f"granularity={granularity!r}; expected 'per-tensor' or 'per-head'.")
        raise ExportError(
            f"{engine} takes per-tensor KV scales only; per-head export is vLLM's "
            "compressed-tensors attn_head path. Fix: drop --per-head (per-head scales are then "
            "reduced with max and the cost reported), or use --engine vllm --per-head."
        )
    check_path_argument(src, "export_checkpoint: src")
    check_path_argument(out, "export_checkpoint: out", "the new output folder")
    src_path = Path(src)
    out_path = Path(out)
    found = discover_scales(src_path)
    src_path = found.path
    check_output_path(src_path, out_path, force)
    _refuse_unusable(found)
    scales = resolve_scales(
        found.scales,
        found.geometry,
        scale_format="auto",
        missing_scales="error",
        missing_kv=missing_kv,
        rope_policy=rope_policy,
    )
    weights = weight_quantization(found)
    convention = _target_convention(engine, granularity, found, weights)
    geometry = found.geometry

    notes: list[str] = list(scales.notes)
    warnings: list[str] = []
    by_layer: dict[int, list[RawScale]] = {}
    for raw in found.scales:
        by_layer.setdefault(raw.layer, []).append(raw)

    layers: list[LayerExport] = []
    new_tensors: dict[str, torch.Tensor] = {}
    homes: dict[str, Path] = {}
    infos = scale_tensor_infos(found.files)
    broadcast = False
    for layer_scales in scales.layers:
        layer = layer_scales.layer
        raws = by_layer[layer]
        heads = geometry.kv_heads_of(layer)  # models such as Gemma 4 differ per layer
        shape = _shape_for(engine, granularity, heads)
        notes.extend([n for n in layer_scales.notes if n not in notes])
        values: dict[str, torch.Tensor] = {}
        ratios: dict[str, float] = {}
        for kind, value in (("k", layer_scales.k), ("v", layer_scales.v)):
            if value is None:  # resolve_scales raised for rejected layers
                raise ExportError(f"layer {layer} has no usable {kind.upper()} scale.")
            ratios[kind] = 1.0
            if granularity == "per-tensor" and value.dim() == 1:
                value, ratios[kind] = reduce_to_per_tensor(value)
            elif granularity == "per-head" and value.dim() == 0:
                value = broadcast_to_per_head(value, heads)
                broadcast = True
            values[kind] = value
        (k_name, k_t), (v_name, v_t) = kv_scale_tensors(
            convention, {layer: (values["k"], values["v"])}, shape, prefix=_prefix(raws[0])
        )[layer]
        kinds = {r.kind: r for r in raws}
        k_src = kinds.get("k", kinds.get("kv", raws[0]))
        v_src = kinds.get("v", kinds.get("kv", raws[0]))
        for name, tensor, source in ((k_name, k_t, k_src), (v_name, v_t, v_src)):
            new_tensors[name] = tensor
            homes[name] = Path(infos[source.name].file)
        layers.append(
            LayerExport(
                layer=layer,
                k_name=k_name,
                v_name=v_name,
                shape=shape,
                k=tuple(float(x) for x in k_t.reshape(-1)),
                v=tuple(float(x) for x in v_t.reshape(-1)),
                k_ratio=ratios["k"],
                v_ratio=ratios["v"],
                sources=tuple(sorted(r.name for r in raws)),
            )
        )

    _conversion_notes(found, layers, broadcast, notes)
    rule = _RULES[(engine, granularity)]
    notes.append(f"{engine}: {rule.note}")
    if convention != found.producer:
        notes.append(
            f"KV scales rewritten from the {found.producer} convention to {convention} "
            f"({'weights are not quantized' if weights is None else weights})"
        )
    if rope_policy == "keep" and any(r.pre_rope for r in found.scales):
        warnings.append(
            "K scales calibrated before RoPE were exported as stored (rope_policy='keep'); "
            "the engine applies them to rotated keys, which can exceed them by up to sqrt(2) "
            "and saturate at 448. Use rope_policy='widen' to export K x sqrt(2) instead."
        )
    if convention != found.producer:
        extra = sorted(
            name
            for name in _header_names(found.files)
            if name.endswith((".output_scale", ".prob_output_scale", ".q_scale"))
            and name not in {r.name for r in found.scales}
        )
        if extra:
            warnings.append(
                f"{len(extra)} other activation-scale tensor(s) (e.g. {extra[0]}) were kept "
                f"under their {found.producer} names; the {engine} {convention} loader may not "
                "know them. Remove them if the engine refuses to load."
            )

    qcfg, hf_quant = kv_quantization_configs(convention, granularity, found, weights)
    report_base = ExportReport(
        source=str(src_path),
        out=str(out_path),
        engine=engine,
        granularity=granularity,
        source_producer=found.producer,
        target_convention=convention,
        layers=tuple(layers),
        notes=tuple(notes),
        warnings=tuple(warnings),
    )
    edit = CheckpointEdit(
        tensors=new_tensors,
        homes=homes,
        drop=[raw.name for raw in found.scales],
        quantization_config=qcfg,
        hf_quant_config=hf_quant,
    )
    return write_report_copy(
        found, out_path, edit, report_base, force=force, link=link, progress=progress
    )


def _header_names(files: Sequence[Path]) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            names.extend(fh.keys())
    return names


def _conversion_notes(
    found: DiscoveredCheckpoint,
    layers: Sequence[LayerExport],
    broadcast: bool,
    notes: list[str],
) -> None:
    reduced = [layer for layer in layers if layer.reduction_ratio > 1.0 + 1e-12]
    if reduced:
        worst = max(reduced, key=lambda layer: layer.reduction_ratio)
        per_layer = ", ".join(f"{layer.layer}: {layer.reduction_ratio:.3g}" for layer in layers)
        notes.append(
            "per-head scales reduced to per-tensor with max (lossy); max/min ratio per layer "
            f"{{{per_layer}}}; worst {worst.reduction_ratio:.3g} (layer {worst.layer}): the head "
            f"with the smallest scale loses up to {math.log2(worst.reduction_ratio):.2f} bits"
        )
    if broadcast:
        notes.append("per-tensor scales broadcast to every KV head (lossless)")
    if any(r.kind == "kv" for r in found.scales):
        notes.append("legacy single kv_scale split into separate k_scale and v_scale (same value)")


def _file_bytes(path: Path) -> int:
    """Bytes of a file, or of every file under a folder (for the progress bar)."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def write_report_copy(
    found: DiscoveredCheckpoint,
    out: Path,
    edit: CheckpointEdit,
    report: ExportReport,
    *,
    force: bool = False,
    link: bool = True,
    progress: bool = False,
    report_file: str | None = REPORT_FILE,
) -> ExportReport:
    """Write ``found`` with ``edit`` applied (:mod:`kvquant.checkpoint.writer`) and check it.

    Before the copy is renamed into place it is re-discovered and compared with
    ``report`` (convention, granularity, names, shapes, fp32 values); the final
    report, with the files written, linked and copied, goes into ``report_file``
    (``None``: none). :func:`export_checkpoint` and
    :func:`kvquant.calibrate.write_calibrated_checkpoint` write through here.

    Returns:
        ``report`` with the file lists filled in.

    Raises:
        ExportError: the copy failed its check, or the writer refused (nothing is
            left at ``out``).
    """
    final: list[ExportReport] = []

    def finish(written: WrittenCheckpoint) -> dict[str, FileContent]:
        done = replace(
            report,
            rewritten_files=written.rewritten,
            linked_files=written.linked,
            copied_files=written.copied,
        )
        _verify(written.path, done, found)
        if report_file is not None:
            done = replace(done, rewritten_files=(*done.rewritten_files, report_file))
        final.append(done)
        return {report_file: done.to_json() + "\n"} if report_file is not None else {}

    skip = (*edit.skip, report_file) if report_file is not None else tuple(edit.skip)
    write_checkpoint_copy(
        found.path,
        found.files,
        found.config,
        out,
        replace(edit, skip=skip),
        force=force,
        link=link,
        progress=progress,
        finish=finish,
    )
    return final[0]


def _verify(tmp: Path, report: ExportReport, source: DiscoveredCheckpoint) -> None:
    """Re-discover the written checkpoint and check it says what the report says."""
    found = discover_scales(tmp)
    problems: list[str] = []
    if found.producer != report.target_convention:
        problems.append(f"re-discovered as {found.producer}, expected {report.target_convention}")
    analysis = analyze_scales(found.scales, found.geometry)
    if not analysis.ok:
        problems.extend(analysis.problems)
    if found.has_errors:
        problems.extend(f.message for f in found.findings if f.severity == "error")
    # the k-transform's K/V scales are per-head (its offsets are checked by discovery)
    expected_gran = (
        "per-head" if report.granularity in ("per-head", "k-transform") else "per-tensor"
    )
    if analysis.ok and analysis.granularity != expected_gran:
        problems.append(f"re-read as {analysis.granularity}, expected {expected_gran}")
    written = {r.name: r for r in found.scales}
    for layer in report.layers:
        for name, values in ((layer.k_name, layer.k), (layer.v_name, layer.v)):
            raw = written.get(name)
            if raw is None:
                problems.append(f"{name} missing from the output")
                continue
            if raw.tensor.dtype != torch.float32 or tuple(raw.tensor.shape) != layer.shape:
                problems.append(f"{name} written as {raw.tensor.dtype} {tuple(raw.tensor.shape)}")
            elif tuple(float(x) for x in raw.tensor.reshape(-1)) != values:
                problems.append(f"{name} holds other values than exported")
    if len(found.scales) != 2 * len(report.layers):
        problems.append(
            f"{len(found.scales)} KV-scale tensors in the output, expected {2 * len(report.layers)}"
        )
    if problems:
        raise ExportError(
            f"the exported copy of {source.path} failed its own check (nothing was written to "
            f"{report.out}): " + "; ".join(problems[:5]) + ". This is a kvquant bug; please "
            "report it with `kvquant doctor` output of the source."
        )
