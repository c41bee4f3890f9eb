"""``kvquant export``'s steps: read and resolve the source's scales, rewrite them per engine, write and check a copy.

The copy is written by :mod:`kvquant.checkpoint.writer` into a temporary folder
beside ``out`` and renamed into place only after it has been re-discovered and
checked (:func:`write_report_copy`): a failed export leaves no ``out`` behind.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvquant.checkpoint.discovery import DiscoveredCheckpoint, discover_scales, scale_tensor_infos
from kvquant.checkpoint.files import check_path_argument
from kvquant.checkpoint.producers import producer_for, reported, weight_quantization
from kvquant.checkpoint.writer import (
    CheckpointEdit,
    FileContent,
    WrittenCheckpoint,
    check_output_path,
    kv_scale_tensors,
    write_checkpoint_copy,
)
from kvquant.errors import ExportError
from kvquant.export.base import Engine
from kvquant.export.engines import ENGINE_LIST, ENGINES, engine_named
from kvquant.export.report import ExportReport, LayerExport
from kvquant.registry.policy import broadcast_to_per_head, reduce_to_per_tensor
from kvquant.registry.resolve import ModelScales, analyze_scales, resolve_scales
from kvquant.schemes import scheme_class
from kvquant.types import RawScale

__all__ = ["REPORT_FILE", "export_checkpoint", "new_configs", "source_weights", "write_report_copy"]

REPORT_FILE = "kvquant-export.json"
"""The report file written into an export's folder."""


def source_weights(found: DiscoveredCheckpoint) -> str | None:
    """Describe the source's weight quantization, or ``None`` when the weights are plain floats."""
    return weight_quantization(
        found.weight_dtypes, found.quantization_config, found.hf_quant_config
    )


def new_configs(
    convention: str,
    granularity: str,
    found: DiscoveredCheckpoint,
    weights: str | None,
    *,
    observer: str = "minmax",
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Return (quantization_config or None to leave config.json alone, hf_quant_config or None).

    See :meth:`kvquant.checkpoint.producers.Producer.export_configs`.
    """
    target = producer_for(convention)
    return target.export_configs(
        granularity,
        found.quantization_config,
        found.hf_quant_config,
        same_producer=reported(found.producer) is target,
        weights=weights,
        observer=observer,
    )


def _check_request(engine: str, granularity: str) -> Engine:
    target = engine_named(engine)
    if target is None:
        raise ExportError(
            f"engine={engine!r} is not an engine kvquant exports for; expected one of "
            f"{', '.join(ENGINES)}."
        )
    if granularity not in target.rules:
        exported = dict.fromkeys(g for e in ENGINE_LIST for g in e.rules)  # the engines' words
        if granularity not in exported:
            expected = " or ".join(repr(g) for g in exported)
            raise ExportError(f"granularity={granularity!r}; expected {expected}.")
        raise ExportError(
            f"{engine} takes per-tensor KV scales only; per-head export is vLLM's "
            "compressed-tensors attn_head path. Fix: drop --per-head (per-head scales are then "
            "reduced with max and the cost reported), or use --engine vllm --per-head."
        )
    return target


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
    if found.kv_formats is not None:
        kinds = sorted({"/".join(f) for f in found.kv_formats})
        raise ExportError(
            f"{found.path} declares a 4-bit KV cache (K/V {', '.join(kinds)}); no engine "
            "loader kvquant exports for (vLLM, SGLang, TensorRT-LLM) was verified to read NVFP4 "
            "KV global scales, so kvquant does not export them. Fix: serve the checkpoint "
            "with kvquant.patch(), or hand it to an engine in its producer's own format."
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
    if any(not getattr(reported(r.convention), "hugging_face", True) for r in found.scales):
        raise ExportError(
            f"{found.path} holds TensorRT-LLM engine-checkpoint scales "
            "(attention.kv_cache_scaling_factor); that is not a Hugging Face checkpoint. "
            "Fix: export from the Hugging Face checkpoint the engine was built from."
        )


def _prefix(raw: RawScale) -> str:
    marker = f"layers.{raw.layer}."
    index = raw.name.find(marker)
    return raw.name[:index] if index >= 0 else "model."


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
    target = _check_request(engine, granularity)
    check_path_argument(src, "export_checkpoint: src")
    check_path_argument(out, "export_checkpoint: out", "the new output folder")
    out_path = Path(out)
    found = discover_scales(Path(src))
    check_output_path(found.path, out_path, force)
    _refuse_unusable(found)
    scales = resolve_scales(
        found.scales,
        found.geometry,
        scale_format="auto",
        missing_scales="error",
        missing_kv=missing_kv,
        rope_policy=rope_policy,
    )
    weights = source_weights(found)
    convention = target.target(found, reported(found.producer), granularity, weights).name
    notes: list[str] = list(scales.notes)
    layers, edit, broadcast = _rewrite_layers(found, scales, target, granularity, convention, notes)
    _conversion_notes(found, layers, broadcast, notes)
    notes.append(f"{engine}: {target.rules[granularity].note}")
    if convention != found.producer:
        notes.append(
            f"KV scales rewritten from the {found.producer} convention to {convention} "
            f"({'weights are not quantized' if weights is None else weights})"
        )
    qcfg, hf_quant = new_configs(convention, granularity, found, weights)
    report = ExportReport(
        source=str(found.path),
        out=str(out_path),
        engine=engine,
        granularity=granularity,
        source_producer=found.producer,
        target_convention=convention,
        layers=tuple(layers),
        notes=tuple(notes),
        warnings=tuple(_warnings(found, engine, convention, rope_policy)),
    )
    edit = replace(edit, quantization_config=qcfg, hf_quant_config=hf_quant)
    return write_report_copy(
        found, out_path, edit, report, force=force, link=link, progress=progress
    )


def _rewrite_layers(
    found: DiscoveredCheckpoint,
    scales: ModelScales,
    target: Engine,
    granularity: str,
    convention: str,
    notes: list[str],
) -> tuple[list[LayerExport], CheckpointEdit, bool]:
    """Each layer's scales at the engine's granularity and shape, named as ``convention`` names them.

    Returns:
        ``(layers, the edit writing them beside their sources, whether any was broadcast)``;
        the layers' notes are added to ``notes``.
    """
    by_layer: dict[int, list[RawScale]] = {}
    for raw in found.scales:
        by_layer.setdefault(raw.layer, []).append(raw)
    layers: list[LayerExport] = []
    new_tensors: dict[str, torch.Tensor] = {}
    homes: dict[str, Path] = {}
    infos = scale_tensor_infos(found.files)
    scheme = scheme_class(granularity)
    broadcast = False
    for layer_scales in scales.layers:
        layer = layer_scales.layer
        raws = by_layer[layer]
        heads = found.geometry.kv_heads_of(layer)  # models such as Gemma 4 differ per layer
        shape = target.shape(granularity, heads)
        want = scheme.scale_shape(heads)
        notes.extend([n for n in layer_scales.notes if n not in notes])
        values: dict[str, torch.Tensor] = {}
        ratios: dict[str, float] = {}
        for kind, value in (("k", layer_scales.k), ("v", layer_scales.v)):
            if value is None:  # resolve_scales raised for rejected layers
                raise ExportError(f"layer {layer} has no usable {kind.upper()} scale.")
            ratios[kind] = 1.0
            if want == () and value.dim() == 1:
                value, ratios[kind] = reduce_to_per_tensor(value)
            elif want and value.dim() == 0:
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
    edit = CheckpointEdit(tensors=new_tensors, homes=homes, drop=[raw.name for raw in found.scales])
    return layers, edit, broadcast


def _warnings(
    found: DiscoveredCheckpoint, engine: str, convention: str, rope_policy: str
) -> list[str]:
    """What the user must know before serving the copy."""
    warnings: list[str] = []
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
    return warnings


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
    # the scales re-read hold one value per tensor or per head, as written (a k-transform's
    # are per head; its offsets are checked by discovery)
    heads = source.geometry.num_kv_heads
    expected = scheme_class(report.granularity).scale_shape(heads)
    if analysis.ok and analysis.scheme.scale_shape(heads) != expected:
        problems.append(f"re-read as {analysis.granularity}, expected {report.granularity}")
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
