"""Checkpoint discovery: find the KV scales a checkpoint carries, without loading its weights.

Discovery reads ``config.json`` (and ``hf_quant_config.json``), the safetensors
headers of every shard, and loads **only** the tensors named as KV scales (and
K offsets). The producer is decided from the configs first
(:func:`~kvquant.checkpoint.producers.detect_producer`), the names second; each
name becomes a :class:`~kvquant.types.RawScale` read as its producer says,
beside checkpoint-level :class:`Finding` s. Scale *contents* are never judged
here (the registry does); only a path that is not a readable checkpoint raises
:class:`~kvquant.errors.CheckpointError`. Developer notes: ``docs/dev/checkpoint.md``.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvquant.checkpoint.files import (
    ShardSelection,
    TensorInfo,
    check_path_argument,
    locate_checkpoint,
    read_json,
    read_safetensors_header,
    scan_folder,
    select_shards,
)
from kvquant.checkpoint.findings import Finding
from kvquant.checkpoint.geometry import language_config, leftover_text_config, read_geometry
from kvquant.checkpoint.producers import (
    KV_TRANSFORM_FILE,
    NAMINGS,
    NO_PRODUCER,
    PRODUCERS,
    Producer,
    convention_of,
    detect_producer,
    reported,
)
from kvquant.checkpoint.producers.kvquant import k_offset_layer, read_k_transform
from kvquant.checkpoint.scheme import scheme_findings, weight_findings
from kvquant.errors import CheckpointError, ScaleFormatError
from kvquant.types import LayerGeometry, RawKTransform, RawScale, ScaleKind

__all__ = [
    "MAX_SCALE_ELEMENTS",
    "DiscoveredCheckpoint",
    "Finding",
    "TensorInfo",
    "discover_scales",
    "match_scale_name",
    "raw_scales_from_mapping",
    "raw_scales_from_state_dict",
    "scale_tensor_infos",
]

MAX_SCALE_ELEMENTS = 1 << 20
"""Most elements a KV-scale tensor may hold to be loaded (per-channel ``[Hkv, D]`` is far below)."""

# Name patterns. ``prefix`` is whatever precedes ``layers.N`` (``model.``,
# ``model.language_model.``, ``transformer.``, ...).
_LAYER = r"(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\."
_PATTERNS: tuple[tuple[re.Pattern[str], str, ScaleKind], ...] = tuple(
    # (pattern, naming family, kind), from the producers' namings
    (re.compile(_LAYER + re.escape(suffix) + "$"), naming.family, kind)
    for naming in NAMINGS.values()
    for kind, suffix in naming.suffixes.items()
)
# Tensors that look like scales but are not KV scales: skipped on purpose.
_NOT_KV = re.compile(
    r"(?:\.q_scale|\.q_proj\.output_scale|\.prob_output_scale|\.weight_scale|\.input_scale"
    r"|\.weight_scale_2|\.output_scale)$"
)
_ZERO_POINT = re.compile(
    _LAYER + r"self_attn\.(?:(?P<kind>[kv])_zero_point|(?P<kind2>[kv])_proj\.output_zero_point)$"
)
_AFFINE_BIAS = re.compile(_LAYER + r"self_attn\.(?P<kind>[kv])_proj\.(?P=kind)_bias$")

_Match = tuple[str, int, ScaleKind, str]
"""``(tensor name, layer, kind, naming family)`` of a KV-scale name."""


@dataclass(frozen=True)
class DiscoveredCheckpoint:
    """Everything discovery learnt about a checkpoint.

    Attributes:
        path: the checkpoint folder.
        geometry: attention geometry from ``config.json`` (``text_config`` for
            multimodal configs).
        producer: the producer convention decided for the checkpoint
            (``"compressed-tensors"``, ``"modelopt"``, ``"quark"``,
            ``"legacy-kv_scale"``, ``"tensorrt-llm"``, ``"kvquant"``, or
            ``"none"`` when there are no KV scales and no KV config).
        scales: the KV scales found, sorted by (layer, kind); tensors as stored.
        findings: checkpoint-level notes, warnings and errors.
        config: the parsed ``config.json``.
        quantization_config: ``config.json``'s ``quantization_config`` (or ``None``).
        hf_quant_config: the parsed ``hf_quant_config.json`` (or ``None``).
        files: the safetensors shard files read.
        num_tensors: tensors listed in the headers.
        weight_dtypes: header dtype -> count over the non-scale tensors.
        kv_scheme: the KV scheme as declared in the config, normalised to a flat
            dict (keys vary by producer), or ``None``.
        k_transform: kvquant's ``k-transform`` settings and ``k_offset``
            tensors (as stored) when the folder has both, else ``None``.
        kv_formats: the ``(K, V)`` format of each layer (``"fp8"`` / ``"nvfp4"``) when the
            configs declare a 4-bit KV cache, else ``None``; its NVFP4 global scales are
            among :attr:`scales`, read by :func:`kvquant.registry.fp4.resolve_fp4_raws`.
    """

    path: Path
    geometry: LayerGeometry
    producer: str
    scales: tuple[RawScale, ...]
    findings: tuple[Finding, ...]
    config: dict[str, Any]
    quantization_config: dict[str, Any] | None
    hf_quant_config: dict[str, Any] | None
    files: tuple[Path, ...]
    num_tensors: int
    weight_dtypes: dict[str, int] = field(default_factory=dict)
    kv_scheme: dict[str, Any] | None = None
    k_transform: RawKTransform | None = None
    kv_formats: tuple[tuple[str, str], ...] | None = None

    @property
    def has_errors(self) -> bool:
        """Whether any checkpoint-level finding is an error."""
        return any(f.severity == "error" for f in self.findings)


def _load_tensors(names_by_file: Mapping[str, list[str]]) -> dict[str, torch.Tensor]:
    """Load the named tensors only (never the rest of a shard)."""
    import safetensors  # local: keep the module import light

    out: dict[str, torch.Tensor] = {}
    for file, names in names_by_file.items():
        try:
            with safetensors.safe_open(file, framework="pt", device="cpu") as fh:
                for name in names:
                    out[name] = fh.get_tensor(name)
        except (safetensors.SafetensorError, OSError, ValueError, TypeError, RuntimeError) as exc:
            raise CheckpointError(
                f"{file}: could not read the scale tensors {names[:4]}"
                f"{' ...' if len(names) > 4 else ''}: {exc}. Fix: re-export the shard."
            ) from exc
    return out


def match_scale_name(name: str) -> tuple[int, ScaleKind, str] | None:
    """Match a tensor name against the known KV-scale namings.

    Args:
        name: a tensor name, e.g. ``model.layers.3.self_attn.k_proj.k_scale``.

    Returns:
        ``(layer, kind, family)`` where family is a key of
        :data:`~kvquant.checkpoint.producers.NAMINGS` (``"self_attn"``,
        ``"modelopt"``, ``"output_scale"``, ...); or ``None`` when the name is
        not a KV scale.
    """
    for pattern, family, kind in _PATTERNS:
        m = pattern.match(name)
        if m:
            return int(m.group("layer")), kind, family
    return None


def _classify(
    infos: Mapping[str, TensorInfo], geometry: LayerGeometry
) -> tuple[
    list[tuple[str, int, ScaleKind, str]], list[tuple[str, int]], list[Finding], Counter[str]
]:
    """Split header names into KV scales, K offsets, rejected extras and weights."""
    matches: list[tuple[str, int, ScaleKind, str]] = []
    offsets: list[tuple[str, int]] = []
    findings: list[Finding] = []
    weight_dtypes: Counter[str] = Counter()
    zero_points: list[str] = []
    biases: list[str] = []
    for name, info in infos.items():
        hit = match_scale_name(name)
        if hit is not None:
            matches.append((name, *hit))
            continue
        offset = k_offset_layer(name)
        if offset is not None:
            offsets.append((name, offset))
            continue
        if _ZERO_POINT.match(name):
            zero_points.append(name)
            continue
        if _AFFINE_BIAS.match(name):
            biases.append(name)
            continue
        if _NOT_KV.search(name):
            continue
        weight_dtypes[info.dtype] += 1
    if zero_points:
        findings.append(
            Finding(
                "error",
                "kv-zero-points",
                f"{len(zero_points)} KV zero-point tensor(s) (e.g. {sorted(zero_points)[0]}): an "
                "asymmetric KV scheme, which kvquant's symmetric FP8 cache cannot represent. "
                "Fix: re-calibrate the KV cache with symmetric: true.",
            )
        )
    if biases:
        findings.append(
            Finding(
                "error",
                "kv-affine-bias",
                f"{len(biases)} KV bias tensor(s) (e.g. {sorted(biases)[0]}): an affine KV preset "
                "(ModelOpt *_AFFINE), which kvquant's scale-only FP8 cache cannot represent. "
                "Fix: export with kv_cache_quant_algo 'FP8'.",
            )
        )
    families = {m[3] for m in matches}
    if len(families) > 1:
        findings.append(
            Finding(
                "warning",
                "mixed-namings",
                f"KV scales use several namings ({', '.join(sorted(families))}); each is read "
                "under its own convention. Check the export: one producer should have written them.",
            )
        )
    out_of_range = sorted(
        {m[1] for m in matches if m[1] >= geometry.num_layers}
        | {layer for _, layer in offsets if layer >= geometry.num_layers}
    )
    if out_of_range:
        findings.append(
            Finding(
                "error",
                "scale-layer-out-of-range",
                f"KV scales or K offsets for layer(s) {out_of_range} but config.json has "
                f"{geometry.num_layers} layers. Fix: use the config that matches the weights.",
            )
        )
    return matches, offsets, findings, weight_dtypes


def _build_raw_scales(
    matches: list[_Match],
    tensors: Mapping[str, torch.Tensor],
    decided: Producer | None,
    qcfg: Mapping[str, Any] | None,
    geometry: LayerGeometry,
) -> tuple[list[RawScale], list[Finding]]:
    findings: list[Finding] = []
    raws: list[RawScale] = []
    seen: dict[tuple[int, str], str] = {}
    for name, layer, kind, family in sorted(matches, key=lambda m: (m[1], m[2], m[0])):
        if layer >= geometry.num_layers:
            continue
        producer = convention_of(family, decided)
        pre_rope, merged, notes = producer.scale_facts(family, qcfg)
        key = (layer, kind)
        if key in seen:
            findings.append(
                Finding(
                    "error",
                    "duplicate-scale",
                    f"layer {layer} has two {kind.upper()} scales: {seen[key]} and {name}. "
                    "Fix: keep one naming in the export.",
                )
            )
            continue
        seen[key] = name
        raws.append(
            RawScale(
                layer=layer,
                kind=kind,
                name=name,
                convention=producer.producer,
                tensor=tensors[name],
                pre_rope=pre_rope if kind != "v" else False,
                merged_kv=merged,
                notes=notes,
            )
        )
    return raws, findings


# ---------------------------------------------------------------------------
# discover_scales, in steps


@dataclass(frozen=True)
class _Configs:
    """What a checkpoint folder's config files say."""

    config: dict[str, Any]
    geometry: LayerGeometry
    qcfg: dict[str, Any] | None
    hf_quant: dict[str, Any] | None


def _read_configs(root: Path) -> _Configs:
    config_path = root / "config.json"
    if not os.path.lexists(config_path):
        raise CheckpointError(
            f"{root} has no config.json, so it is not a transformers checkpoint. "
            "Fix: pass the folder written by save_pretrained (or snapshot_download)."
        )
    config = read_json(config_path, "config.json")
    geometry = read_geometry(config, str(config_path))
    qcfg_raw = config.get("quantization_config")
    language = language_config(config)
    if qcfg_raw is None and language is not config:
        qcfg_raw = language.get("quantization_config")
    qcfg: dict[str, Any] | None = dict(qcfg_raw) if isinstance(qcfg_raw, Mapping) else None
    hf_quant_path = root / "hf_quant_config.json"
    hf_quant = (
        read_json(hf_quant_path, "hf_quant_config.json") if os.path.lexists(hf_quant_path) else None
    )
    return _Configs(config, geometry, qcfg, hf_quant)


def _drop_oversized(
    matches: list[_Match],
    offsets: list[tuple[str, int]],
    infos: Mapping[str, TensorInfo],
    findings: list[Finding],
) -> tuple[list[_Match], list[tuple[str, int]]]:
    """Leave out (with an error finding) scale and offset tensors too large to load."""
    oversized = [m for m in matches if math.prod(infos[m[0]].shape) > MAX_SCALE_ELEMENTS]
    if oversized:
        findings.append(
            Finding(
                "error",
                "scale-too-large",
                f"{len(oversized)} KV-scale tensor(s) (e.g. {oversized[0][0]}, shape "
                f"{infos[oversized[0][0]].shape}) hold more than {MAX_SCALE_ELEMENTS} elements; "
                "no KV-scale layout is that large, so they were not loaded. Fix: check the "
                "export (the tensor names may be wrong).",
            )
        )
        matches = [m for m in matches if m not in oversized]
    big_offsets = [o for o in offsets if math.prod(infos[o[0]].shape) > MAX_SCALE_ELEMENTS]
    if big_offsets:
        findings.append(
            Finding(
                "error",
                "scale-too-large",
                f"{len(big_offsets)} K offset tensor(s) (e.g. {big_offsets[0][0]}, shape "
                f"{infos[big_offsets[0][0]].shape}) hold more than {MAX_SCALE_ELEMENTS} elements; "
                "a K offset is [num_kv_heads, head_dim], so they were not loaded. Fix: check "
                "the export.",
            )
        )
        offsets = [o for o in offsets if o not in big_offsets]
    return matches, offsets


def _load_in_range(
    names: Iterable[tuple[str, int]], infos: Mapping[str, TensorInfo], geometry: LayerGeometry
) -> dict[str, torch.Tensor]:
    """Load the named tensors of layers the config has, grouped by shard."""
    by_file: dict[str, list[str]] = {}
    for name, layer in names:
        if layer < geometry.num_layers:
            by_file.setdefault(infos[name].file, []).append(name)
    return _load_tensors(by_file)


def _producer_findings(
    decided: Producer | None,
    from_folder: bool,
    producer: str,
    raws: list[RawScale],
    qcfg: Mapping[str, Any] | None,
) -> list[Finding]:
    """Which producer was decided, and from what."""
    found: list[Finding] = []
    method = qcfg.get("quant_method") if qcfg else None
    if decided is not None:
        source = (
            KV_TRANSFORM_FILE
            if from_folder
            else (f"quant_method {method!r}" if method else "hf_quant_config.json")
        )
        found.append(Finding("info", "producer", f"{producer} (from {source})."))
    elif raws:
        found.append(
            Finding(
                "info",
                "producer",
                f"{producer} (from tensor names; config.json has no quantization_config).",
            )
        )
    if qcfg is not None and method and decided is None:
        found.append(
            Finding(
                "warning",
                "unknown-quant-method",
                f"config.json quant_method {method!r} is not a KV-cache producer kvquant knows; "
                "KV scales were matched by name only.",
            )
        )
    return found


def _no_scales_finding(
    producer: Producer | None, scheme: Mapping[str, Any] | None
) -> list[Finding]:
    """The finding of a checkpoint without KV scales (``producer``: the one its config names)."""
    if scheme and scheme.get("dynamic") is True:
        return []
    declared = ""
    if producer is not None:
        declared = f" although its {producer.producer} config declares a KV scheme"
    return [
        Finding(
            "info" if producer is None else "warning",
            "no-kv-scales",
            f"the checkpoint carries no KV scales{declared}; kvquant falls back to "
            "--missing-scales (default: dynamic fp32-group scales).",
        )
    ]


def _declared_formats(
    producer: Producer | None,
    cfg: _Configs,
    raws: list[RawScale],
) -> tuple[tuple[tuple[str, str], ...] | None, bool, list[Finding]]:
    """The 4-bit KV formats the configs declare: ``(formats, examined, findings)``.

    ``examined``: the configs declare a 4-bit KV cache (read, or refused in a finding), so the
    FP8 scheme checks do not apply.
    """
    found: list[Finding] = []
    formats, examined = None, False
    if producer is not None:
        try:
            formats = producer.kv_formats(cfg.qcfg, cfg.hf_quant, cfg.geometry.num_layers)
        except ScaleFormatError as exc:
            found.append(Finding("error", "kv-scheme-unsupported", str(exc)))
            examined = True
    if formats is not None:
        examined = True
        kinds = sorted({"/".join(f) for f in formats})
        name = producer.producer if producer is not None else NO_PRODUCER
        text = f"{name} declares a 4-bit KV cache: K/V {', '.join(kinds)} (per layer: the doctor)."
        found.append(Finding("info", "kv-scheme-4bit", text))
    strays = [r.name for r in raws if r.name.endswith("_global_scale")]
    if strays and formats is None and not examined:
        found.append(
            Finding(
                "error",
                "nvfp4-global-scale-undeclared",
                f"{len(strays)} NVFP4 KV global-scale tensor(s) (e.g. {strays[0]}) but no config "
                "declares an NVFP4 KV cache (compressed-tensors kv_cache_scheme num_bits 4); "
                "producers store different numbers under this name (compressed-tensors "
                "(6*448)/amax, auto-round amax/(6*448) by its description), so kvquant cannot "
                "tell which. Fix: use the config.json written with the weights; a producer "
                "other than compressed-tensors is not read yet.",
            )
        )
    return formats, examined, found


def _folder_findings(
    root: Path, config: Mapping[str, Any], selection: ShardSelection
) -> list[Finding]:
    """The leftover ``text_config``, the shard selection's findings and files no copy can take."""
    found: list[Finding] = []
    if leftover_text_config(config):
        found.append(
            Finding(
                "warning",
                "leftover-text-config",
                f"config.json has a text_config that its model_type {config.get('model_type')!r} "
                "does not use: the geometry is read from the top level, as transformers reads "
                "it. transformers cannot build a causal LM from this file while the leftover is "
                "there (get_text_config() returns it); kvquant.from_pretrained drops it. Fix: "
                "delete text_config from config.json.",
            )
        )
    found.extend(selection.findings)
    _, problems = scan_folder(root)
    if problems:
        found.append(
            Finding(
                "warning",
                "uncopyable-file",
                f"{problems[0]} kvquant reads only the config, index and weight files, but "
                "kvquant export and calibrate copy the whole folder and refuse this one. Fix: "
                "replace it with a regular file (or a real folder), or remove it.",
            )
        )
    return found


def discover_scales(path: str | Path, *, revision: str | None = None) -> DiscoveredCheckpoint:
    """Discover the KV scales of a checkpoint folder, loading only the scale tensors.

    Reads ``config.json`` (geometry; ``text_config`` for multimodal configs),
    ``hf_quant_config.json`` when present, and the safetensors headers of the
    files transformers reads (``model.safetensors``, else the shards
    ``model.safetensors.index.json`` names; see
    :func:`kvquant.checkpoint.select_shards`), decides the producer from the
    config first and the tensor names second, and loads only the tensors whose
    names are KV scales. Values are not judged here. Every file is untrusted:
    see :mod:`kvquant.checkpoint.files` for the bounds.

    Args:
        path: a checkpoint folder (or its ``config.json``), or a hub id found
            in the local Hugging Face cache (nothing is downloaded).
        revision: the hub revision when ``path`` is a hub id.

    Returns:
        A :class:`DiscoveredCheckpoint` with the raw scales and checkpoint-level findings.

    Raises:
        CheckpointError: the path does not exist (and is not a cached hub
            model), is not a checkpoint (no ``config.json``, no safetensors
            weights), or a file is malformed, special or outside the folder.
        OptionTypeError: ``path`` is not a str or path.

    Example:
        >>> import tempfile
        >>> from kvquant.testing.checkpoints import write_checkpoint
        >>> with tempfile.TemporaryDirectory() as d:
        ...     ckpt = discover_scales(write_checkpoint(d, convention="modelopt", weights="none"))
        ...     print(ckpt.producer, [(s.layer, s.kind) for s in ckpt.scales])
        modelopt [(0, 'k'), (0, 'v'), (1, 'k'), (1, 'v')]
    """
    check_path_argument(path, "discover_scales: path")
    root = locate_checkpoint(path, revision=revision)
    cfg = _read_configs(root)
    geometry, qcfg = cfg.geometry, cfg.qcfg
    selection = select_shards(root, cfg.config)
    infos = selection.tensors
    decided = detect_producer(qcfg, cfg.hf_quant)
    from_folder = decided is None and (decided := detect_producer(None, None, root)) is not None
    matches, offsets, findings, weight_dtypes = _classify(infos, geometry)
    matches, offsets = _drop_oversized(matches, offsets, infos, findings)
    tensors = _load_in_range([(m[0], m[1]) for m in matches] + offsets, infos, geometry)
    raws, dup_findings = _build_raw_scales(matches, tensors, decided, qcfg, geometry)
    findings.extend(dup_findings)
    k_transform, transform_findings = read_k_transform(root, offsets, tensors, geometry)
    findings.extend(transform_findings)

    if decided is not None:
        producer = decided.producer
    elif raws:
        producer = Counter(r.convention for r in raws).most_common(1)[0][0]
    else:
        producer = NO_PRODUCER
    final = reported(producer)
    scheme = final.kv_scheme(qcfg, cfg.hf_quant) if final is not None else None
    all_findings = _producer_findings(decided, from_folder, producer, raws, qcfg)
    # only a producer its configs name says what a 4-bit tensor stores (not one from names)
    kv_formats, four_bit, format_findings = _declared_formats(decided, cfg, raws)
    all_findings.extend(format_findings)
    all_findings.extend(scheme_findings(producer, None if four_bit else scheme))
    if not raws:
        all_findings.extend(_no_scales_finding(final, scheme))
    all_findings.extend(_folder_findings(root, cfg.config, selection))
    all_findings.extend(findings)
    for each in PRODUCERS:
        own = [r for r in raws if r.convention == each.name]
        all_findings.extend(each.scale_findings(own, qcfg))
    all_findings.extend(weight_findings(final, qcfg, cfg.hf_quant, weight_dtypes))
    if final is not None and qcfg is not None:
        all_findings.extend(final.config_findings(qcfg))

    return DiscoveredCheckpoint(
        path=root,
        geometry=geometry,
        producer=producer,
        scales=tuple(raws),
        findings=tuple(all_findings),
        config=cfg.config,
        quantization_config=qcfg,
        hf_quant_config=cfg.hf_quant,
        files=selection.files,
        num_tensors=len(infos),
        weight_dtypes=dict(weight_dtypes),
        kv_scheme=scheme,
        k_transform=k_transform,
        kv_formats=kv_formats,
    )


def scale_tensor_infos(files: Iterable[str | Path]) -> dict[str, TensorInfo]:
    """Header facts (dtype, shape, file) of the KV-scale tensors in safetensors files; nothing is loaded.

    For code that must size buffers before the weights load (e.g. a transformers
    quantizer's ``_process_model_before_weight_loading(checkpoint_files=...)``).

    Args:
        files: safetensors files (shards) of one checkpoint.

    Returns:
        ``{tensor name: TensorInfo}`` for every name :func:`match_scale_name` accepts.

    Raises:
        CheckpointError: a file is missing or its header is unreadable.
    """
    out: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in read_safetensors_header(file).items():
            if match_scale_name(name) is not None:
                out[name] = info
    return out


def raw_scales_from_mapping(
    mapping: Mapping[str, Any], where: str = "scales", *, allow_none: bool = False
) -> list[RawScale]:
    """The raw KV scales of an explicit ``{tensor_name: tensor}`` mapping (``patch(scales=...)``).

    Unlike :func:`raw_scales_from_state_dict`, a mapping that names no KV scale
    kvquant recognises (a typo, an empty dict) is an error, not "no scales";
    unless ``allow_none`` (a dynamic scale format, which uses no stored scale).

    Args:
        mapping: tensor name -> tensor, producer names (other tensors are ignored).
        where: how to name the mapping in messages.
        allow_none: accept a mapping that names no KV scale.

    Returns:
        The raw scales, sorted by (layer, kind).

    Raises:
        OptionTypeError: a key is not a str.
        ScaleFormatError: a value is not a tensor, no name is a KV scale, or two
            names give one layer's K (or V) scale.
    """
    from kvquant.errors import OptionTypeError, ScaleFormatError

    for name, t in mapping.items():
        if not isinstance(name, str):
            raise OptionTypeError(
                f"{where} has the key {name!r} (a {type(name).__name__}); expected tensor names "
                "(str), e.g. 'model.layers.0.self_attn.k_scale'. Fix: pass {tensor_name: tensor}."
            )
        if name == KV_TRANSFORM_FILE:
            continue  # the k-transform settings (k_transform_from_mapping)
        if not isinstance(t, torch.Tensor):
            raise ScaleFormatError(
                f"{where}[{name!r}] is a {type(t).__name__}; expected a torch.Tensor. "
                "Fix: pass {tensor_name: tensor}."
            )
    raws = raw_scales_from_state_dict(
        {k: v for k, v in mapping.items() if k != KV_TRANSFORM_FILE}, strict=where
    )
    global_scales = [r.name for r in raws if r.name.endswith("_global_scale")]
    if global_scales:
        raise ScaleFormatError(
            f"{where}[{global_scales[0]!r}] is an NVFP4 KV global scale; expected FP8 KV scales: "
            "a mapping has no config saying which producer wrote it, and producers store "
            "different numbers under that name. Fix: pass the checkpoint folder (scales=path), "
            "whose config declares the NVFP4 KV cache."
        )
    if not raws and not allow_none:
        names = sorted(str(n) for n in mapping)
        shown = f"{len(names)} name(s), e.g. {names[:3]}" if names else "an empty mapping"
        raise ScaleFormatError(
            f"{where} names no tensor kvquant recognises as a KV scale (got {shown}); expected "
            "producer names such as model.layers.0.self_attn.k_scale / v_scale, "
            "self_attn.k_proj.k_scale, self_attn.k_proj.output_scale or self_attn.kv_scale. "
            "Fix: correct the names, leave scales unset to read the model's own checkpoint, or "
            'pass scale_format="fp32-group" (dynamic scales, no stored ones) with scales={}.'
        )
    return raws


def raw_scales_from_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    *,
    producer: str | None = None,
    quantization_config: Mapping[str, Any] | None = None,
    strict: str = "",
) -> list[RawScale]:
    """Map an in-memory ``{tensor_name: tensor}`` mapping to raw KV scales.

    Same naming rules as :func:`discover_scales` (non-KV tensors are ignored),
    for scales that are already in memory (e.g. the HF quantizer after load).

    Args:
        state_dict: tensor name -> tensor (any shape/dtype, as stored).
        producer: the producer convention when known (``"quark"``, ...); else
            decided from ``quantization_config`` and then the names.
        quantization_config: the checkpoint's ``quantization_config`` dict, if any.

        strict: when not empty, how to name the mapping in an error: two
            tensors for one layer and kind (two namings, e.g. ``self_attn.k_scale``
            and ``self_attn.k_proj.k_scale``) then raise, as discovery refuses
            them in a checkpoint folder.

    Returns:
        The raw scales, sorted by (layer, kind). Unless ``strict``, duplicate
        (layer, kind) pairs keep the first name in sorted order.

    Raises:
        ScaleFormatError: ``strict`` and two tensors name one layer's K (or V) scale.
    """
    qcfg = dict(quantization_config) if quantization_config else None
    decided = reported(producer) if producer else detect_producer(qcfg, None)
    matches = []
    for name in state_dict:
        hit = match_scale_name(name)
        if hit is not None:
            matches.append((name, *hit))
    big = LayerGeometry(num_layers=1 << 30, num_heads=1, num_kv_heads=1, head_dim=1)
    tensors = {name: state_dict[name] for name, *_ in matches}
    raws, findings = _build_raw_scales(matches, tensors, decided, qcfg, big)
    if strict:
        errors = [f.message for f in findings if f.severity == "error"]
        if errors:
            from kvquant.errors import ScaleFormatError

            raise ScaleFormatError(
                f"{strict}: {len(errors)} problem(s) with the KV scales: " + " ".join(errors)
            )
    return raws
