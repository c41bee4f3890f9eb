"""Where a loaded model's checkpoint lives: its folder, or its snapshot in the local Hugging Face cache."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from kvquant.checkpoint.files import (
    INDEX_NAME,
    PICKLE_NAMES,
    SINGLE_FILE_NAME,
    is_hub_id,
    locate_checkpoint,
    weight_files,
)
from kvquant.errors import CheckpointError

__all__ = ["model_checkpoint"]

_logger = logging.getLogger("kvquant")


def _declared_quantization(config: Any) -> str | None:
    for cfg in (config, getattr(config, "text_config", None)):
        qcfg = getattr(cfg, "quantization_config", None)
        if qcfg is None:
            continue
        as_dict = qcfg if isinstance(qcfg, dict) else getattr(qcfg, "to_dict", dict)()
        return str(as_dict.get("quant_method", "unknown"))
    return None


def model_checkpoint(model: Any) -> Path | None:
    """The local checkpoint folder a transformers model was loaded from, or None.

    ``model.name_or_path`` is a local folder, or a hub id resolved through the
    local Hugging Face cache; nothing is downloaded. For a hub id the snapshot
    is the commit transformers recorded (``config._commit_hash``, transformers
    5.17); transformers 5.24 records none, so the cache's snapshots of that id
    are used only when there is one, or when they all hold the same KV scales
    and configs: otherwise the revision the model was loaded at cannot be known
    and kvquant refuses rather than read another revision's scales.

    Args:
        model: a transformers model (read: ``name_or_path``, ``config``).

    Returns:
        The folder, or None when the model was not loaded from a checkpoint
        (empty ``name_or_path``), or its files (``config.json`` and weights)
        cannot be found and its config declares no quantization (a warning is
        logged). A folder whose weights are ``.bin`` only is returned: discovery
        then refuses it ("safetensors only").

    Raises:
        CheckpointError: the files cannot be found although the config declares
            a ``quantization_config`` (its KV scales would be silently lost), or
            the hub id has snapshots with different KV scales in the cache and
            the revision the model was loaded at is not recorded, or the folder
            and its subfolders hold checkpoints of the model's geometry with
            different KV scales (a ``subfolder=`` load is not recorded either).
    """
    config = getattr(model, "config", None)
    name = getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", "") or ""
    if not name:
        return None
    local = os.path.lexists(str(name))
    revision = None if local else getattr(config, "_commit_hash", None)
    try:
        if local or revision:
            folder = locate_checkpoint(str(name), revision=revision)
        else:
            folder = _unrecorded_revision(str(name))
    except _AmbiguousSourceError:
        raise
    except CheckpointError as exc:
        _not_found(model, str(name), str(exc))
        return None
    candidates = [c for c in (folder, *_subfolders(folder)) if _is_checkpoint(c)]
    if len(candidates) > 1 and folder in candidates:
        # a subfolder holding the folder's own weight shards (an index may place them there)
        # is part of that checkpoint, not another one
        try:
            own = {f.parent for f in weight_files(folder).files}
        except CheckpointError:
            own = set()
        candidates = [c for c in candidates if c == folder or c not in own]
    if not candidates:
        _not_found(model, str(name), f"{folder} holds no config.json and weights")
        return None
    if len(candidates) == 1:
        return candidates[0]
    return _one_of(candidates, folder, config)


def _is_checkpoint(folder: Path) -> bool:
    weights = [n for n in (INDEX_NAME, SINGLE_FILE_NAME, *PICKLE_NAMES) if (folder / n).exists()]
    return (folder / "config.json").exists() and bool(weights)


def _subfolders(folder: Path) -> list[Path]:
    """The folder's immediate subfolders that hold a ``config.json`` (a ``subfolder=`` load's home)."""
    try:
        with os.scandir(folder) as it:
            subs = sorted(
                Path(e.path)
                for e in it
                if e.is_dir(follow_symlinks=False) and os.path.lexists(Path(e.path) / "config.json")
            )
    except OSError:
        return []
    return subs[:MAX_SNAPSHOTS]


def _one_of(candidates: list[Path], folder: Path, config: Any) -> Path:
    """The checkpoint among ``folder`` and its subfolders that the model was loaded from.

    transformers does not record a ``subfolder=`` load: the candidates whose
    config describes the model's geometry must all give kvquant the same scales
    (then ``folder`` itself when it is one of them), else kvquant refuses.
    """
    from kvquant.checkpoint.discovery import discover_scales
    from kvquant.checkpoint.geometry import read_geometry

    try:
        as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        wanted = read_geometry(as_dict, "the model's config")
    except Exception:  # a config kvquant cannot read: every candidate stays in
        wanted = None
    prints: dict[Path, str] = {}
    for candidate in candidates:
        try:
            found = discover_scales(candidate)
        except CheckpointError:
            prints[candidate] = "unreadable"
            continue
        if wanted is None or found.geometry == wanted:
            prints[candidate] = repr(_fingerprint(found))
    if not prints:
        return folder if folder in candidates else candidates[0]
    if len(set(prints.values())) == 1 and "unreadable" not in prints.values():
        return folder if folder in prints else next(iter(prints))
    listed = ", ".join(str(c.relative_to(folder)) if c != folder else "." for c in prints)
    raise _AmbiguousSourceError(
        f"the model was loaded from {folder}, which holds several checkpoints of this model's "
        f"geometry with different KV scales ({listed}: the folder and its subfolders), and "
        "transformers does not record a subfolder= load; kvquant will not guess. Fix: pass "
        "kvquant.patch(model, scales=<the folder you loaded>), or load with "
        "kvquant.from_pretrained(path, subfolder=...), which reads the files it loads."
    )


MAX_SNAPSHOTS = 64
"""Most snapshots of one hub id kvquant compares when the loaded revision is not recorded."""


class _AmbiguousSourceError(CheckpointError):
    """The checkpoints a model may have been loaded from differ, and which one is not recorded
    (a hub id's snapshots, or a folder and its subfolders)."""


def _fingerprint(found: Any) -> tuple[Any, ...]:
    """What kvquant takes from a checkpoint: equal fingerprints patch a model identically."""
    scales = tuple(
        (
            *(s.name, s.layer, s.kind, s.convention, s.pre_rope, s.merged_kv, s.notes),
            (str(s.tensor.dtype), tuple(s.tensor.shape), s.tensor.double().flatten().tolist()),
        )
        for s in found.scales
    )
    transform = found.k_transform
    offsets = (
        ()
        if transform is None
        else tuple((o.name, o.tensor.double().flatten().tolist()) for o in transform.offsets)
    )
    return (
        found.producer,
        found.geometry,
        scales,
        offsets,
        None if transform is None else transform.settings,
        found.quantization_config,
        found.hf_quant_config,
        tuple((f.severity, f.code) for f in found.findings),
    )


def _snapshot_refs(repo: Path) -> dict[str, list[str]]:
    refs: dict[str, list[str]] = {}
    folder = repo / "refs"
    if not folder.is_dir():
        return refs
    for ref in sorted(folder.rglob("*"))[:MAX_SNAPSHOTS]:
        try:
            if ref.is_file() and ref.stat().st_size <= 64:
                refs.setdefault(ref.read_text().strip(), []).append(
                    ref.relative_to(folder).as_posix()
                )
        except OSError:
            continue
    return refs


def _unrecorded_revision(repo_id: str) -> Path:
    """The snapshot of ``repo_id`` a model was loaded from, when transformers recorded no revision.

    The only snapshot of ``repo_id`` in the cache, or, when there are several and
    every one gives kvquant the same scales and configs, the one ``refs/main``
    names; otherwise the revision cannot be known and this refuses.
    """
    from kvquant.checkpoint.discovery import discover_scales

    if not is_hub_id(repo_id):
        return locate_checkpoint(repo_id)  # raises: neither a folder nor a hub id
    try:
        default: Path | None = locate_checkpoint(repo_id)
    except CheckpointError:
        default = None
    snapshots_dir = _snapshots_dir(repo_id)
    try:
        snapshots = sorted(p for p in snapshots_dir.iterdir() if p.is_dir())
    except OSError:
        snapshots = []
    if default is None and len(snapshots) != 1:
        return locate_checkpoint(repo_id)  # raises: not in the cache (or no refs/main)
    if default is None:
        return snapshots[0]
    if len(snapshots) <= 1:
        return default
    prints: set[Any] = set()
    unreadable = False
    if len(snapshots) <= MAX_SNAPSHOTS:
        for snapshot in snapshots:
            try:
                prints.add(repr(_fingerprint(discover_scales(snapshot))))
            except CheckpointError:
                unreadable = True
                break
            if len(prints) > 1:
                break
    if len(prints) == 1 and not unreadable:
        return default
    refs = _snapshot_refs(snapshots_dir.parent)
    listed = ", ".join(
        f"{s.name[:12]}" + (f" ({', '.join(refs[s.name])})" if s.name in refs else "")
        for s in snapshots[:8]
    ) + (" ..." if len(snapshots) > 8 else "")
    raise _AmbiguousSourceError(
        f"the model was loaded from the hub id {repo_id!r}, whose local Hugging Face cache "
        f"holds {len(snapshots)} snapshots with different KV scales or configs ({listed}), and "
        "this version of transformers does not record the revision a model was loaded at; "
        "kvquant will not guess. Fix: pass kvquant.patch(model, "
        f"scales='{snapshots_dir}/<commit of the revision you loaded>'), or load with "
        f"kvquant.from_pretrained({repo_id!r}, revision=...), which reads the files it loads."
    )


def _snapshots_dir(repo_id: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--")) / "snapshots"


def _not_found(model: Any, name: str, why: str) -> None:
    """No checkpoint for ``model``: an error when its config declares quantization, else a warning."""
    method = _declared_quantization(getattr(model, "config", None))
    if method is not None:
        raise CheckpointError(
            f"{type(model).__name__} was loaded from {name!r}, whose config declares a "
            f"quantization_config (quant_method {method!r}), but kvquant cannot find its "
            f"files to read the KV scales: {why} Fix: pass "
            "kvquant.patch(model, scales=<the checkpoint folder>)."
        )
    _logger.warning(
        "kvquant: %s was loaded from %r, whose checkpoint files cannot be found (%s); its "
        "config declares no quantization, so no KV scales are read from it.",
        type(model).__name__,
        name,
        why,
    )
