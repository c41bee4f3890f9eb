"""Writing a calibrated checkpoint: a copy of the source carrying the scales in a producer convention.

:func:`write_calibrated_checkpoint` builds one :class:`~kvquant.checkpoint.writer.CheckpointEdit`
(the scale tensors, the convention's configs, ``kvquant-calibration.json``) and
writes it with :func:`kvquant.export.write_report_copy`, the machinery
``kvquant export`` uses: a temporary folder, re-discovery, an atomic rename.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kvquant.calibrate.options import CONVENTIONS, Convention, Granularity, parse_choice
from kvquant.calibrate.result import CalibrationResult
from kvquant.checkpoint import producers
from kvquant.checkpoint.writer import (
    CheckpointEdit,
    FileContent,
    check_output_path,
    kv_scale_tensors,
)
from kvquant.errors import CalibrationError

__all__ = ["REPORT_FILE", "write_calibrated_checkpoint"]

REPORT_FILE = "kvquant-calibration.json"
"""What was calibrated on, how, the per-layer report and the format written (in the copy)."""


def write_calibrated_checkpoint(
    src_dir: str | Path,
    result: CalibrationResult,
    out_dir: str | Path,
    convention: Convention | str = "compressed-tensors",
    *,
    force: bool = False,
    link: bool = False,
    progress: bool = False,
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
    extra_files: Mapping[str, FileContent] | None = None,
) -> Path:
    """Write a copy of ``src_dir`` carrying ``result``'s scales in a producer's convention.

    * ``compressed-tensors``: ``self_attn.k_scale`` / ``v_scale``, fp32 ``(1,)``
      (``strategy: tensor``) or ``(Hkv, 1, 1)`` (per-head, ``strategy: attn_head``),
      KV-only ``quantization_config`` with ``kv_cache_scheme``;
    * ``modelopt``: ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale``, fp32 ``()``,
      ``hf_quant_config.json`` with ``kv_cache_quant_algo: FP8``;
    * ``quark``: ``self_attn.k_proj.output_scale`` / ``v_proj.output_scale``, fp32
      ``()``, ``kv_cache_post_rope: true`` (separate post-RoPE K and V);
    * ``kvquant`` (k-transform results only): ``self_attn.k_scale`` / ``v_scale``
      fp32 ``(Hkv,)`` and ``self_attn.k_offset`` fp32 ``(Hkv, head_dim)`` (rotated
      frame), ``kvquant_kv_transform.json`` (format, version, rotation,
      first_tokens, geometry) and no ``quantization_config``; only kvquant reads it.

    Every file is copied (configs and tokenizer always; weight shards unless
    ``link``); the shard(s) receiving scales are re-saved with every other tensor
    unchanged; KV scales already in the source are replaced. The config records
    how the scales were chosen (compressed-tensors ``observer``: ``"mse"`` after
    a clipping search, ``"minmax"`` for ``amax / 448``; Quark's ``observer_cls``
    likewise), and ``kvquant-calibration.json`` what was calibrated on, how, the
    per-layer report and the format written. The copy is written into a
    temporary folder with :mod:`kvquant.checkpoint.writer` (the writer
    ``kvquant export`` uses), re-discovered and checked, then renamed into place:
    a failed write leaves nothing at ``out_dir``.

    Args:
        src_dir: the checkpoint folder the model was loaded from.
        result: scales from :func:`calibrate`.
        out_dir: the output folder; must not exist unless ``force``.
        convention: ``"compressed-tensors"`` (per-tensor or per-head),
            ``"modelopt"`` or ``"quark"`` (per-tensor only), ``"kvquant"`` (k-transform).
        force: replace ``out_dir`` if it is an existing folder.
        link: hard-link the unchanged weight shards instead of copying them
            (saves disk space; the output then shares those files with the source).
        progress: show a tqdm progress bar (bytes written) on stderr.
        extra_tensors: more tensors to store, by name (e.g. per-layer tensors of a
            format beyond the K/V scales); a name with ``layers.N.`` goes into the
            shard holding layer ``N``'s attention, any other into layer 0's. A
            name the checkpoint already holds is an error.
        extra_files: more files to write into the copy, by file name: a
            JSON-ready dict (strict JSON), text or bytes.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        CheckpointError: ``src_dir`` is not a readable checkpoint.
        CalibrationError: unknown convention, per-head with a per-tensor-only
            convention, geometry mismatch, or quantized weights of another producer.
        ExportTargetExistsError: ``out_dir`` exists and ``force`` is False.
        ExportError: the written copy failed its own check (nothing is left behind).
    """
    from kvquant import export
    from kvquant.checkpoint.discovery import discover_scales

    chosen = _check_convention(result, convention)
    found = discover_scales(src_dir)
    out = Path(out_dir)
    weights = _check_source(found, result, chosen)
    check_output_path(found.path, out, force)
    prefix, homes = _layer_homes(found.files, result.num_layers)
    tensors, tensor_homes, layers = _scale_tensors(result, chosen, prefix, homes)
    _add_extra_tensors(extra_tensors or {}, tensors, tensor_homes, homes, result.num_layers)
    found, qcfg, hf_quant, transform_files = _configs(found, result, chosen, weights)
    report = _export_report(found, out, result, chosen, layers)
    files = _files(found.path, result, chosen, transform_files, extra_files or {})
    edit = CheckpointEdit(
        tensors=tensors,
        homes=tensor_homes,
        drop=[raw.name for raw in found.scales],
        quantization_config=qcfg,
        hf_quant_config=hf_quant,
        files=files,
        # an export report of the source describes other scales than the copy's
        skip=(export.REPORT_FILE,),
    )
    export.write_report_copy(
        found, out, edit, report, force=force, link=link, progress=progress, report_file=None
    )
    return out


def _export_report(
    found: Any, out: Path, result: CalibrationResult, convention: Convention, layers: list[Any]
) -> Any:
    """The :class:`~kvquant.export.ExportReport` the writer checks the copy against."""
    from kvquant.export import ExportReport

    notes = [
        f"scales calibrated by kvquant on {result.num_samples} samples, {result.num_tokens} "
        f"tokens ({result.granularity}; {result.method})"
    ]
    if found.scales:
        notes.append(f"{len(found.scales)} KV-scale tensors of the source were replaced")
    return ExportReport(
        source=str(found.path),
        out=str(out),
        engine="kvquant",
        granularity=str(result.granularity),
        source_producer=found.producer,
        target_convention=str(convention),
        layers=tuple(layers),
        notes=tuple(notes),
    )


def _check_convention(result: CalibrationResult, convention: object) -> Convention:
    """The convention asked for, or its refusal for ``result``'s format."""
    chosen = parse_choice(Convention, convention)
    if chosen is None:
        raise CalibrationError(
            f"write_calibrated_checkpoint: convention {convention!r}; expected one of "
            f"{CONVENTIONS}. Fix: pass one of those names."
        )
    if (result.granularity == Granularity.K_TRANSFORM) != chosen.holds_k_transform:
        raise CalibrationError(
            f"write_calibrated_checkpoint: a {result.granularity} result in the {chosen} "
            "convention; the k-transform is stored only in kvquant's own convention (k_offset "
            "tensors and kvquant_kv_transform.json; no serving engine reads it) and kvquant's "
            "convention holds only the k-transform. Fix: pass convention='kvquant' for a "
            "k-transform result, a producer convention for per-tensor or per-head scales."
        )
    if result.granularity == Granularity.PER_HEAD and not chosen.per_head:
        raise CalibrationError(
            f"write_calibrated_checkpoint: per-head scales cannot be stored in the {chosen} "
            "convention (its config has no per-head KV strategy). Fix: use "
            "convention='compressed-tensors' (strategy attn_head) or calibrate per-tensor."
        )
    return chosen


def _check_source(found: Any, result: CalibrationResult, convention: Convention) -> str | None:
    """The source's weight quantization (None: plain floats), or its refusal."""
    from kvquant.export.write import source_weights as weight_quantization

    src = found.path
    geometry = found.geometry
    if geometry.num_layers != result.num_layers or geometry.num_kv_heads != result.num_kv_heads:
        raise CalibrationError(
            f"write_calibrated_checkpoint: {src} has {geometry.num_layers} layers x "
            f"{geometry.num_kv_heads} KV heads but the scales are for {result.num_layers} x "
            f"{result.num_kv_heads}. Fix: calibrate the model loaded from {src}."
        )
    weights = weight_quantization(found)
    if weights is not None and found.producer != convention:
        raise CalibrationError(
            f"write_calibrated_checkpoint: {src} has quantized weights ({weights}, producer "
            f"{found.producer}); writing {convention} KV scales would mix conventions. Fix: pass "
            f"convention={found.producer!r} if kvquant writes it, or calibrate the unquantized "
            "checkpoint."
        )
    if found.k_transform is not None:
        raise CalibrationError(
            f"write_calibrated_checkpoint: {src} already carries a k-transform (k_offset "
            "tensors and kvquant_kv_transform.json); expected a checkpoint without one. Fix: "
            "calibrate the original checkpoint it was calibrated from."
        )
    return weights


def _scale_tensors(
    result: CalibrationResult, convention: Convention, prefix: str, homes: dict[int, str]
) -> tuple[dict[str, torch.Tensor], dict[str, Path], list[Any]]:
    """The scale (and k-transform offset) tensors by name, their shards, the report's layers."""
    from kvquant.export import LayerExport

    shape = convention.scale_shape(str(result.granularity), result.num_kv_heads)
    named = kv_scale_tensors(
        convention.scale_names,
        {i: result.layer_scales(i) for i in range(result.num_layers)},
        shape,
        prefix=prefix,
    )
    new_tensors: dict[str, torch.Tensor] = {}
    tensor_homes: dict[str, Path] = {}
    layers: list[Any] = []
    for i, ((k_name, kt), (v_name, vt)) in named.items():
        new_tensors[k_name], new_tensors[v_name] = kt, vt
        tensor_homes[k_name] = tensor_homes[v_name] = Path(homes[i])
        if result.k_offset is not None:
            o_name = producers.k_offset_tensor_name(i, prefix=prefix)
            new_tensors[o_name] = result.k_offset[i].float().contiguous().clone()
            tensor_homes[o_name] = Path(homes[i])
        layers.append(
            LayerExport(
                layer=i,
                k_name=k_name,
                v_name=v_name,
                shape=shape,
                k=tuple(float(x) for x in kt.reshape(-1)),
                v=tuple(float(x) for x in vt.reshape(-1)),
            )
        )
    return new_tensors, tensor_homes, layers


def _add_extra_tensors(
    extra: Mapping[str, torch.Tensor],
    tensors: dict[str, torch.Tensor],
    tensor_homes: dict[str, Path],
    homes: dict[int, str],
    num_layers: int,
) -> None:
    """Add the caller's ``extra_tensors`` beside the scales (``layers.N.`` picks the shard)."""
    for name, tensor in extra.items():
        if name in tensors:
            raise CalibrationError(
                f"write_calibrated_checkpoint: extra tensor {name!r} has the name of a KV scale "
                "being written. Fix: give it another name."
            )
        layer = re.search(r"layers\.(\d+)\.", name)
        index = int(layer.group(1)) if layer is not None else 0
        if index not in homes:
            raise CalibrationError(
                f"write_calibrated_checkpoint: extra tensor {name!r} names layer {index}; the "
                f"checkpoint has layers 0..{num_layers - 1}. Fix: name an existing layer."
            )
        tensors[name] = tensor
        tensor_homes[name] = Path(homes[index])


def _configs(
    found: Any, result: CalibrationResult, convention: Convention, weights: str | None
) -> tuple[Any, dict[str, Any] | None, dict[str, Any] | None, dict[str, FileContent]]:
    """``(found, quantization_config, hf_quant_config, k-transform files)`` of the copy.

    For the k-transform, ``found`` comes back with its config's ``quantization_config``
    removed: kvquant_kv_transform.json alone declares the KV format.
    """
    from kvquant.export.write import new_configs as kv_quantization_configs

    if convention.holds_k_transform:
        found, files = _k_transform_files(found, result, weights)
        return found, None, None, files
    own = convention.own_config(result.observer)
    if own is not None:
        return found, own, None, {}
    qcfg, hf_quant = kv_quantization_configs(
        str(convention), str(result.granularity), found, weights, observer=result.observer
    )
    if qcfg is None and weights is None:
        qcfg = convention.bare_config(hf_quant)
    return found, qcfg, hf_quant, {}


def _k_transform_files(
    found: Any, result: CalibrationResult, weights: str | None
) -> tuple[Any, dict[str, FileContent]]:
    """The k-transform's settings file, and ``found`` without a KV quantization config."""
    if weights is not None:
        raise CalibrationError(
            f"write_calibrated_checkpoint: {found.path} has quantized weights ({weights}); the "
            "k-transform is written beside unquantized weights only. Fix: calibrate the "
            "unquantized checkpoint."
        )
    # declared by kvquant_kv_transform.json alone: config.json loses any KV scheme
    config = json.loads(json.dumps(found.config))
    for holder in (config, config.get("text_config")):
        if isinstance(holder, dict):
            holder.pop("quantization_config", None)
    found = dataclasses.replace(found, config=config)
    if result.k_offset is None:
        raise CalibrationError(
            "write_calibrated_checkpoint: a k-transform result without offsets. "
            "Fix: calibrate with granularity='k-transform'."
        )
    settings = producers.kv_transform_config(
        rotation=result.rotation,
        first_tokens=result.first_tokens,
        head_dim=int(result.k_offset.shape[-1]),
        num_kv_heads=result.num_kv_heads,
        num_layers=result.num_layers,
    )
    return found, {producers.KV_TRANSFORM_FILE: json.dumps(settings, indent=2) + "\n"}


def _files(
    src: Path,
    result: CalibrationResult,
    convention: Convention,
    transform_files: dict[str, FileContent],
    extra_files: Mapping[str, FileContent],
) -> dict[str, FileContent]:
    """The files written into the copy: the calibration metadata, the k-transform's, the caller's."""
    from kvquant import __version__

    metadata = {
        "calibrated_by": f"kvquant {__version__}",
        "source": str(src),
        "convention": str(convention),
        "format": str(result.granularity),
        **result.to_dict(),
    }
    files: dict[str, FileContent] = {REPORT_FILE: metadata, **transform_files}
    for name, content in extra_files.items():
        if name in files:
            raise CalibrationError(
                f"write_calibrated_checkpoint: extra file {name!r} is the name of a file kvquant "
                f"writes there (the calibration report or the k-transform settings: "
                f"{', '.join(sorted(files))}). Fix: give it another name."
            )
        files[name] = content
    return files


def _layer_homes(files: Sequence[Path], num_layers: int) -> tuple[str, dict[int, str]]:
    """Tensor-name prefix of the decoder layers and, per layer, the shard holding its attention."""
    from safetensors import safe_open

    pattern = re.compile(r"^(.*?)layers\.(\d+)\.self_attn\.")
    prefix: str | None = None
    homes: dict[int, str] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                m = pattern.match(name)
                if m is None:
                    continue
                prefix = m.group(1) if prefix is None else prefix
                homes.setdefault(int(m.group(2)), str(file))
    if prefix is None or sorted(homes) != list(range(num_layers)):
        raise CalibrationError(
            f"write_calibrated_checkpoint: found attention weights of layers {sorted(homes)[:8]} "
            f"in {[str(f) for f in files][:3]}; expected 'layers.N.self_attn.*' tensors for "
            f"all {num_layers} layers. Fix: pass the checkpoint the model was loaded from."
        )
    return prefix, homes
