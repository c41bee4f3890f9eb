"""Writing a changed copy of a checkpoint, atomically (``kvquant export`` and ``kvquant calibrate``).

:func:`write_checkpoint_copy` copies a checkpoint folder into a new one in which only what a
:class:`CheckpointEdit` names changes (shards that lose or receive tensors re-saved, the rest
hard-linked or copied; the index, ``config.json``'s ``quantization_config``,
``hf_quant_config.json`` and extra files rewritten); :func:`kv_scale_tensors` names and shapes
the K/V scales of every layer the way one producer stores them. The source folder is read by
the checkpoint readers' rules (regular files and real folders only). Everything is written into
a temporary folder beside ``out`` and renamed into place only when complete: a failed write
leaves no half checkpoint and never changes the source or an existing ``out``. Details:
``docs/dev/checkpoint.md`` (Writing a checkpoint copy).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvquant.checkpoint import producers
from kvquant.checkpoint.files import (
    MAX_INDEX_BYTES,
    FolderEntry,
    read_json,
    scan_folder,
    weight_files,
)
from kvquant.errors import CheckpointError, ExportError, ExportTargetExistsError

__all__ = [
    "INDEX_FILE",
    "CheckpointEdit",
    "FileContent",
    "WrittenCheckpoint",
    "check_output_path",
    "kv_scale_tensors",
    "write_checkpoint_copy",
]

INDEX_FILE = "model.safetensors.index.json"
"""The shard index transformers reads."""

_WRITER_FILES = frozenset({"config.json", "hf_quant_config.json", INDEX_FILE})

FileContent = Mapping[str, Any] | str | bytes
"""An extra file: a JSON-ready dict (written as indented strict JSON), text or bytes."""

_DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


@dataclass(frozen=True)
class CheckpointEdit:
    """What differs between a source checkpoint and its copy.

    Attributes:
        tensors: tensors to store, by name (new names, or names in ``drop``).
        homes: for every name in ``tensors``, the source shard file (one of the
            source's ``files``) whose copy receives it.
        drop: names of source tensors the copy leaves out (e.g. the KV scales
            being replaced).
        quantization_config: the copy's ``config.json`` ``quantization_config``;
            ``None`` leaves ``config.json``'s as it is.
        hf_quant_config: the copy's ``hf_quant_config.json``; ``None``: the copy
            has none (the source's is not copied either).
        files: extra files written into the copy, by file name.
        skip: source file names not copied (e.g. a report describing the source).
    """

    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    homes: Mapping[str, Path] = field(default_factory=dict)
    drop: Collection[str] = ()
    quantization_config: Mapping[str, Any] | None = None
    hf_quant_config: Mapping[str, Any] | None = None
    files: Mapping[str, FileContent] = field(default_factory=dict)
    skip: Collection[str] = ()


@dataclass(frozen=True)
class WrittenCheckpoint:
    """What :func:`write_checkpoint_copy` did.

    Attributes:
        path: the output folder (while ``finish`` runs: the temporary folder).
        rewritten: output files written anew (shards, index, configs, extra files).
        linked: files hard-linked from the source.
        copied: files and folders copied from the source.
    """

    path: Path
    rewritten: tuple[str, ...]
    linked: tuple[str, ...]
    copied: tuple[str, ...]


def kv_scale_tensors(
    convention: str,
    scales: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
    shape: tuple[int, ...],
    *,
    prefix: str = "model.",
) -> dict[int, tuple[tuple[str, torch.Tensor], tuple[str, torch.Tensor]]]:
    """Name and shape every layer's K and V scales as ``convention`` stores them.

    Args:
        convention: a producer with separate K and V tensors
            (:data:`kvquant.checkpoint.producers.PRODUCER_CONVENTIONS`, not
            ``"legacy-kv_scale"``).
        scales: ``{layer: (k, v)}``, each ``[]`` or ``[Hkv]`` (any float dtype).
        shape: the stored shape (e.g. from
            :func:`~kvquant.checkpoint.producers.stored_scale_shape`).
        prefix: what stands before ``layers.N.`` in the tensor names.

    Returns:
        ``{layer: ((k_name, k_fp32), (v_name, v_fp32))}``, tensors contiguous fp32 of ``shape``.

    Raises:
        ConventionError: an unknown convention, or one without separate K and V.
        ExportError: a scale has more or fewer elements than ``shape``.
    """
    out: dict[int, tuple[tuple[str, torch.Tensor], tuple[str, torch.Tensor]]] = {}
    for layer, (k, v) in scales.items():
        pair = []
        for kind, value in (("k", k), ("v", v)):
            name = producers.scale_tensor_name(convention, layer, kind, prefix=prefix)
            if value.numel() != math.prod(shape):
                raise ExportError(
                    f"{name}: {value.numel()} scale value(s) for the stored shape {shape}; "
                    "expected one per KV head (per-head) or one per layer (per-tensor). "
                    "This is a kvquant bug; please report it."
                )
            pair.append((name, value.detach().to(torch.float32).reshape(shape).contiguous()))
        out[layer] = (pair[0], pair[1])
    return out


def check_output_path(src: Path, out: Path, force: bool) -> None:
    """Refuse an output folder that is, holds or lies in the source, or exists without ``force``.

    Raises:
        ExportError: ``out`` is the source, inside it, or contains it.
        ExportTargetExistsError: ``out`` exists and ``force`` is False, or is not a folder,
            or a file stands where one of its parent folders would be.
    """
    src_r = src.resolve()
    out_r = out.resolve()
    if out_r == src_r or src_r in out_r.parents:
        raise ExportError(
            f"--out {out} is the source checkpoint or inside it; expected a new folder "
            "elsewhere. Fix: pass another output folder."
        )
    if out_r in src_r.parents:
        raise ExportError(
            f"--out {out} contains the source checkpoint {src}; replacing it would delete the "
            "source. Fix: pass another output folder."
        )
    blocker = next((p for p in out_r.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ExportTargetExistsError(
            f"--out {out} lies under {blocker}, which is a file, not a folder; the output "
            "folder cannot be created there. Fix: pass an --out whose parent folders exist "
            "or can be created."
        )
    if out.exists() or out.is_symlink():
        if not force:
            raise ExportTargetExistsError(
                f"{out} already exists; expected a new folder. Fix: pass another --out, or "
                "--force to replace it."
            )
        if not out.is_dir() or out.is_symlink():
            raise ExportTargetExistsError(
                f"{out} exists and is not a folder; --force replaces folders only. "
                "Fix: remove it or pass another --out."
            )


def write_checkpoint_copy(
    src: Path,
    files: Sequence[Path],
    config: Mapping[str, Any],
    out: Path,
    edit: CheckpointEdit,
    *,
    force: bool = False,
    link: bool = True,
    progress: bool = False,
    finish: Callable[[WrittenCheckpoint], Mapping[str, FileContent] | None] | None = None,
) -> WrittenCheckpoint:
    """Write a copy of the checkpoint ``src`` with ``edit`` applied, atomically.

    Args:
        src: the source checkpoint folder.
        files: its safetensors shards (discovery's ``files``: the index's shards,
            or ``model.safetensors`` alone).
        config: its parsed ``config.json``.
        out: the output folder (checked with :func:`check_output_path`).
        edit: what changes.
        force: replace ``out`` if it is an existing folder.
        link: hard-link the shards that do not change (falls back to copying);
            other files are always copied, so editing them never changes the source.
        progress: a tqdm progress bar (bytes written) on stderr.
        finish: called with the complete temporary copy before it is renamed into
            place; raise to abandon the write; return extra files to add.

    Returns:
        The :class:`WrittenCheckpoint` (its ``path`` is ``out``).

    Raises:
        ExportError: a bad edit (a tensor without a source shard, a name clashing
            with a kept tensor, an extra file named like one the writer writes), a
            bad ``out``, or the rename failed.
        ExportTargetExistsError: ``out`` exists and ``force`` is False.
        CheckpointError: a source shard could not be read, or the source folder
            holds something other than regular files and real folders (a FIFO, a
            device, a socket, a broken link, a link to a folder; nothing is written).
    """
    from tqdm import tqdm

    shards = {Path(f) for f in files}
    _check_edit(src, shards, edit)
    check_output_path(src, out, force)
    index = weight_files(src, config).index
    index_rel = None if index is None else index.relative_to(src).as_posix()
    drop_by_file = _locate(shards, edit.drop)
    changed = set(drop_by_file) | {Path(h) for h in edit.homes.values()}
    changed_rel = {f.relative_to(src).as_posix() for f in changed}
    skip = {"config.json", "hf_quant_config.json"} | set(edit.files) | set(edit.skip)
    scanned = _scan_source(src, skip)
    entries = [e for e in scanned if e.rel not in changed_rel and e.rel != index_rel]

    # the parent folders this write creates: a failed write removes them again
    created = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.kvquant-tmp-", dir=out.parent))
    except BaseException:
        _remove_empty(created)
        raise
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; give the folder the usual mode
    try:
        sizes = {e.rel: e.size for e in entries}
        sizes.update({f.relative_to(src).as_posix(): _file_bytes(f) for f in changed})
        bar = tqdm(
            total=sum(sizes.values()),
            desc=f"writing {out.name}",
            unit="B",
            unit_scale=True,
            file=sys.stderr,
            disable=not progress,
        )
        with bar:
            linked, copied = _copy_entries(entries, tmp, link, bar)
            rewritten = _rewrite_shards(src, tmp, changed, drop_by_file, edit, sizes, bar)
        if index is not None and index_rel is not None:
            _write_index(src, tmp, index, index_rel, drop_by_file, edit)
            rewritten.append(index_rel)
        rewritten += _write_metadata(tmp, config, edit)

        written = WrittenCheckpoint(tmp, tuple(rewritten), tuple(linked), tuple(copied))
        more = finish(written) if finish is not None else None
        for name, content in (more or {}).items():
            _check_file_name(name)
            _write_file(tmp, name, content)
            rewritten.append(name)
        _move_into_place(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise
    return WrittenCheckpoint(out, tuple(rewritten), tuple(linked), tuple(copied))


def _scan_source(src: Path, skip: Collection[str]) -> list[FolderEntry]:
    """The source folder's entries (:func:`scan_folder`), or a CheckpointError naming what
    is neither a regular file nor a real folder."""
    scanned, problems = scan_folder(src, skip)
    if problems:
        raise CheckpointError(
            f"{src} cannot be copied: {' '.join(problems[:3])}"
            f"{f' ({len(problems) - 3} more)' if len(problems) > 3 else ''} Nothing was "
            "written. Fix: replace it with a regular file (or a real folder), or remove it "
            "from the checkpoint folder."
        )
    return scanned


def _copy_entries(
    entries: Sequence[FolderEntry], tmp: Path, link: bool, bar: Any
) -> tuple[list[str], list[str]]:
    """Copy (or hard-link) the unchanged files and folders of the source into ``tmp``;
    returns the top-level names linked and copied."""
    linked: list[str] = []
    copied: list[str] = []
    for entry in entries:
        target = tmp / entry.rel
        top = entry.rel.split("/", 1)[0]
        if entry.is_dir:
            target.mkdir()
            if top == entry.rel:
                copied.append(top)
        elif _link_or_copy(entry.path, target, link, entry.size) and top == entry.rel:
            linked.append(top)
        elif top == entry.rel:
            copied.append(top)
        bar.update(entry.size)
    return linked, copied


def _rewrite_shards(
    src: Path,
    tmp: Path,
    changed: set[Path],
    drop_by_file: Mapping[Path, set[str]],
    edit: CheckpointEdit,
    sizes: Mapping[str, int],
    bar: Any,
) -> list[str]:
    """Re-save the shards that lose or receive tensors into ``tmp``; returns their names."""
    rewritten: list[str] = []
    for file in sorted(changed):
        rel = file.relative_to(src).as_posix()
        bar.set_postfix_str(f"rewriting {rel}")
        add = {n: t for n, t in edit.tensors.items() if Path(edit.homes[n]) == file}
        dst = tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        _rewrite_shard(file, dst, drop_by_file.get(file, set()), add)
        rewritten.append(rel)
        bar.update(sizes[rel])
    return rewritten


def _write_metadata(tmp: Path, config: Mapping[str, Any], edit: CheckpointEdit) -> list[str]:
    """Write ``config.json``, ``hf_quant_config.json`` and the edit's extra files into ``tmp``;
    returns their names."""
    _write_file(tmp, "config.json", _new_config(config, edit.quantization_config), strict=False)
    written = ["config.json"]
    if edit.hf_quant_config is not None:
        _write_file(tmp, "hf_quant_config.json", edit.hf_quant_config, strict=False)
        written.append("hf_quant_config.json")
    for name, content in edit.files.items():
        _write_file(tmp, name, content)
        written.append(name)
    return written


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders a failed write created (deepest first), each only while empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return  # not empty (someone else wrote there) or gone: keep it and those above


# ---------------------------------------------------------------------------
# helpers


def _check_file_name(name: str) -> None:
    if name in _WRITER_FILES or Path(name).name != name or name in ("", ".", ".."):
        raise ExportError(
            f"extra file {name!r}: expected a plain file name other than "
            f"{sorted(_WRITER_FILES)} (the writer writes those itself). This is a kvquant bug; "
            "please report it."
        )


def _check_edit(src: Path, shards: set[Path], edit: CheckpointEdit) -> None:
    outside = sorted(str(f) for f in shards if not f.is_relative_to(src))
    if outside:
        raise ExportError(
            f"writing a copy of {src}: shards {outside[:3]} are not inside it; expected the "
            "shard paths discovery found in that folder. This is a kvquant bug; please report it."
        )
    homeless = sorted(set(edit.tensors) - set(edit.homes))
    stray = sorted(n for n, h in edit.homes.items() if Path(h) not in shards)
    if homeless or stray:
        raise ExportError(
            f"writing a copy of {src}: tensors {(homeless + stray)[:3]} have no source shard "
            f"to go into (expected one of {sorted(p.name for p in shards)}). This is a kvquant "
            "bug; please report it."
        )
    for name in edit.files:
        _check_file_name(name)
    for name, tensor in edit.tensors.items():
        if not isinstance(tensor, torch.Tensor) or tensor.is_sparse:
            raise ExportError(
                f"writing a copy of {src}: {name} is {type(tensor).__name__}, expected a dense "
                "tensor. This is a kvquant bug; please report it."
            )


def _locate(shards: set[Path], names: Collection[str]) -> dict[Path, set[str]]:
    """Which shard holds each of ``names`` (every one must be found)."""
    from safetensors import safe_open

    wanted = set(names)
    out: dict[Path, set[str]] = {}
    for file in sorted(shards):
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            held = wanted & set(fh.keys())
        if held:
            out[file] = held
            wanted -= held
    if wanted:
        raise ExportError(
            f"tensors {sorted(wanted)[:3]} to drop are in none of the shards "
            f"{sorted(p.name for p in shards)}. This is a kvquant bug; please report it."
        )
    return out


def _link_or_copy(src: Path, dst: Path, link: bool, size: int) -> bool:
    """Hard-link a weight shard ``src`` to ``dst`` (True) or copy it (False).

    Only ``*.safetensors`` shards are ever linked: configs, tokenizer files and
    the rest are small and always copied, so editing them in the output never
    changes the source. A link is followed to its file; the copy reads the
    ``size`` bytes :func:`~kvquant.checkpoint.files.scan_folder` found, from a file
    that must still be a regular file when it is opened.
    """
    if link and src.suffix == ".safetensors":
        try:
            os.link(os.path.realpath(src), dst)
            return True
        except OSError:
            pass
    try:
        fd = os.open(src, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise CheckpointError(f"{src} could not be read while writing a copy: {exc}.") from exc
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise CheckpointError(
                f"{src} changed while kvquant was copying the checkpoint (expected a regular "
                f"file of {size} bytes). Fix: run the command again once nothing writes there."
            )
        with open(dst, "wb") as out:
            left = size
            while left:
                chunk = fh.read(min(left, 1 << 20))
                if not chunk:
                    break
                out.write(chunk)
                left -= len(chunk)
    shutil.copystat(src, dst)
    return False


def _rewrite_shard(src: Path, dst: Path, drop: set[str], add: Mapping[str, torch.Tensor]) -> None:
    """Re-save a shard without ``drop`` and with ``add``; every other tensor keeps its bytes."""
    import safetensors
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    try:
        with safetensors.safe_open(str(src), framework="pt", device="cpu") as fh:
            metadata = fh.metadata() or {}
            for name in fh.keys():
                if name not in drop:
                    tensors[name] = fh.get_tensor(name)
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(
            f"{src} could not be read while writing a copy: {exc}. Fix: re-download or "
            "re-export it."
        ) from exc
    clash = sorted(set(tensors) & set(add))
    if clash:
        raise ExportError(
            f"{src} already holds {clash[:3]} under the names being written; expected the "
            "old tensors of those names to be replaced. Fix: remove the stale tensors from the "
            "checkpoint."
        )
    tensors.update({name: t.detach().cpu().contiguous() for name, t in add.items()})
    save_file(tensors, str(dst), metadata={str(k): str(v) for k, v in metadata.items()})


def _total_size(files: Sequence[Path]) -> int:
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                sl = fh.get_slice(name)
                total += math.prod(sl.get_shape()) * _DTYPE_BYTES.get(sl.get_dtype(), 1)
    return total


def _write_index(
    src: Path,
    tmp: Path,
    index: Path,
    rel: str,
    drop_by_file: Mapping[Path, set[str]],
    edit: CheckpointEdit,
) -> None:
    data = read_json(index, "safetensors index", MAX_INDEX_BYTES)
    weight_map = dict(data.get("weight_map", {}))
    for names in drop_by_file.values():
        for name in names:
            weight_map.pop(name, None)
    for name in edit.tensors:
        weight_map[name] = Path(edit.homes[name]).relative_to(src).as_posix()
    data["weight_map"] = dict(sorted(weight_map.items()))
    meta = dict(data.get("metadata") or {})
    meta["total_size"] = _total_size(sorted({tmp / f for f in weight_map.values()}))
    data["metadata"] = meta
    (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
    _write_file(tmp, rel, data, strict=False)


def _new_config(config: Mapping[str, Any], qcfg: Mapping[str, Any] | None) -> dict[str, Any]:
    new = json.loads(json.dumps(config))
    if qcfg is None:
        return dict(new)
    text = new.get("text_config")
    if (
        "quantization_config" not in new
        and isinstance(text, dict)
        and "quantization_config" in text
    ):
        text["quantization_config"] = dict(qcfg)
    else:
        new["quantization_config"] = dict(qcfg)
    return dict(new)


def _write_file(folder: Path, name: str, content: FileContent, *, strict: bool = True) -> None:
    """Write one file; a dict as indented JSON (``strict``: no NaN or infinity, else refused).

    The source's own JSON (config, index, hf_quant_config) is rewritten with
    ``strict=False``, as the source had it.
    """
    path = folder / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    else:
        try:
            text = json.dumps(
                content, indent=2, sort_keys=name == "config.json", allow_nan=not strict
            )
        except (TypeError, ValueError) as exc:
            raise ExportError(
                f"{name}: its content is not strict JSON ({exc}); expected JSON-ready values "
                "(finite numbers, strings, lists, dicts). This is a kvquant bug; please report it."
            ) from exc
        path.write_text(text + "\n", encoding="utf-8")


def _file_bytes(path: Path) -> int:
    """Bytes of a file (for the progress bar)."""
    return path.stat().st_size


def _move_into_place(tmp: Path, out: Path, force: bool) -> None:
    if not out.exists():
        try:
            tmp.rename(out)
        except OSError as exc:
            raise ExportError(f"could not move the copy into {out}: {exc}.") from exc
        return
    if not force:  # appeared while we were writing
        raise ExportTargetExistsError(
            f"{out} appeared while writing; nothing was replaced. Fix: pass --force."
        )
    backup = Path(tempfile.mkdtemp(prefix=f".{out.name}.kvquant-old-", dir=out.parent))
    backup.rmdir()
    out.rename(backup)
    try:
        tmp.rename(out)
    except OSError as exc:
        backup.rename(out)
        raise ExportError(f"could not move the copy into {out}: {exc}.") from exc
    shutil.rmtree(backup, ignore_errors=True)
