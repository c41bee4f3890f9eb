"""Bounded, confined reading of checkpoint files: everything a checkpoint folder holds is
untrusted input.

A file is ``stat``-ed before it is opened and must be a regular file (symlinks are followed,
as the Hugging Face cache is made of them); JSON files are bounded in size and nesting; shard
names from an index are confined to the folder by their logical path; safetensors headers are
read through ``safetensors.safe_open``; the shards read are the ones transformers reads, in its
order, others are ignored and reported. A hub id that is not a local path is resolved through
the local Hugging Face cache only: nothing is downloaded. The rules one by one:
``docs/dev/checkpoint.md`` (Reading checkpoint files).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from kvquant.checkpoint.findings import Finding
from kvquant.errors import CheckpointError, OptionTypeError

__all__ = [
    "INDEX_NAME",
    "MAX_CONFIG_BYTES",
    "MAX_INDEX_BYTES",
    "PICKLE_NAMES",
    "SINGLE_FILE_NAME",
    "FolderEntry",
    "ShardSelection",
    "TensorInfo",
    "WeightFiles",
    "check_path_argument",
    "folder_named_by",
    "folder_of_weight_files",
    "is_hub_id",
    "locate_checkpoint",
    "read_json",
    "read_safetensors_header",
    "scan_folder",
    "select_shards",
    "weight_files",
]

MAX_CONFIG_BYTES = 16 * 1024 * 1024
"""Largest ``config.json`` / ``hf_quant_config.json`` read (real ones are a few KiB)."""

MAX_INDEX_BYTES = 64 * 1024 * 1024
"""Largest ``model.safetensors.index.json`` read."""

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class TensorInfo:
    """What a safetensors header says about one tensor (nothing is loaded).

    Attributes:
        name: tensor name.
        dtype: safetensors dtype string, e.g. ``"BF16"``, ``"F8_E4M3"``.
        shape: the stored shape.
        file: the shard file holding it.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str


@dataclass(frozen=True)
class ShardSelection:
    """The safetensors files transformers would read for a checkpoint, and where each tensor lives.

    Attributes:
        root: the checkpoint folder.
        files: the shards, in the order they are read.
        tensors: tensor name -> header facts, from the shard that holds it (the
            index decides when a name is in two shards).
        findings: stray or unlisted files ignored, names held twice.
    """

    root: Path
    files: tuple[Path, ...]
    tensors: dict[str, TensorInfo]
    findings: tuple[Finding, ...] = field(default=())


def _kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _regular_size(path: Path, what: str) -> int:
    """The size of ``path`` after checking, without opening it, that it is a regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"{path} ({what}) does not exist (or is a broken link). "
            "Fix: download or re-export the checkpoint completely."
        ) from exc
    except OSError as exc:
        raise CheckpointError(f"{path} ({what}) cannot be examined: {exc}.") from exc
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(
            f"{path} ({what}) is {_kind_of(st.st_mode)}, expected a regular file; kvquant does "
            "not read special files. Fix: replace it with the real file."
        )
    return int(st.st_size)


def _read_bytes(path: Path, what: str, limit: int) -> bytes:
    size = _regular_size(path, what)
    if size > limit:
        raise CheckpointError(
            f"{path} ({what}) is {size} bytes, more than the {limit} kvquant reads. "
            "Fix: the file is not a real checkpoint file; re-export it."
        )
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
        with os.fdopen(fd, "rb") as fh:
            return fh.read(limit + 1)
    except OSError as exc:
        raise CheckpointError(f"{path} ({what}) could not be read: {exc}.") from exc


def read_json(path: str | Path, what: str, limit: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
    """Read a JSON object from a checkpoint file, bounded in size and nesting.

    Args:
        path: the file.
        what: how to name the file in messages (``"config.json"``, ...).
        limit: the most bytes read.

    Returns:
        The parsed object.

    Raises:
        CheckpointError: the file is missing, special, too large, not UTF-8
            JSON, nested too deeply, or not a JSON object.
    """
    file = Path(path)
    blob = _read_bytes(file, what, limit)
    try:
        data = json.loads(blob.decode("utf-8"))
    except RecursionError as exc:
        raise CheckpointError(
            f"{file} ({what}) is nested too deeply to be a real checkpoint file. "
            "Fix: re-export the checkpoint."
        ) from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(
            f"{file} ({what}) could not be read as JSON: {exc}. "
            "Fix: re-export the checkpoint, or repair the file."
        ) from exc
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{file} ({what}) holds a JSON {type(data).__name__}, expected an object. "
            "Fix: re-export the checkpoint."
        )
    return data


def read_safetensors_header(file: str | Path) -> dict[str, TensorInfo]:
    """The tensors a safetensors file declares (name, dtype, shape); nothing is loaded.

    ``safetensors.safe_open`` reads the header: it bounds its length (100 MiB) by
    the file's size and validates dtypes, shapes and data offsets. This function
    adds what the library does not check: the path must be a regular file (a
    FIFO or a device would block or never end).

    Args:
        file: a ``.safetensors`` file.

    Returns:
        ``{tensor name: TensorInfo}``.

    Raises:
        CheckpointError: the file is missing, special, truncated, or its header
            is malformed.
    """
    path = Path(file)
    _regular_size(path, "safetensors file")
    from safetensors import SafetensorError, safe_open

    infos: dict[str, TensorInfo] = {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                sl = fh.get_slice(name)
                shape = tuple(int(d) for d in sl.get_shape())
                infos[name] = TensorInfo(
                    name=name, dtype=str(sl.get_dtype()), shape=shape, file=str(path)
                )
    except (SafetensorError, OSError, ValueError, TypeError, RuntimeError) as exc:
        raise CheckpointError(
            f"{path} has an unreadable safetensors header ({exc}). "
            "Fix: the file is corrupt; re-download or re-export it."
        ) from exc
    return infos


def _confined(root: Path, name: object, index: Path | str, what: str = "the shard") -> Path:
    """``root / name`` when ``name`` is a relative path inside ``root`` (by its logical path)."""
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise CheckpointError(
            f"{index} names {what} {name!r}, expected a file name inside {root}. "
            "Fix: re-export the checkpoint with save_pretrained."
        )
    posix, windows = PurePosixPath(name), PureWindowsPath(name)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or ".." in posix.parts:
        raise CheckpointError(
            f"{index} names {what} {name!r}, which lies outside the checkpoint folder "
            f"{root}; kvquant reads only files inside it. Fix: list the shards by their "
            "file names (as save_pretrained writes them)."
        )
    return root / posix


def _stray(root: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in root.glob("*.safetensors") if p.name not in keep)


@dataclass(frozen=True)
class WeightFiles:
    """The weight files transformers loads from a checkpoint folder (no header is read).

    Attributes:
        root: the checkpoint folder.
        files: the safetensors files, sorted.
        index: the index file that lists them, or None for a single file.
        shard_of: tensor name -> shard file, from the index (empty for a single file).
        ignored: what transformers ignores in the folder: an index beside
            ``model.safetensors``, ``*.safetensors`` files the selection does not name.
    """

    root: Path
    files: tuple[Path, ...]
    index: Path | None
    shard_of: dict[str, Path]
    ignored: tuple[str, ...] = ()


def _explicit_weights(folder: Path, config: Mapping[str, Any] | None) -> str | None:
    """``config.json``'s ``transformers_weights`` (the weights file transformers loads first), or None."""
    if config is None:
        config_path = folder / "config.json"
        if not os.path.lexists(config_path):
            return None
        config = read_json(config_path, "config.json")
    value = config.get("transformers_weights")
    if value is None:
        return None
    where = f"{folder / 'config.json'} transformers_weights"
    if not isinstance(value, str) or not (
        value.endswith(".safetensors") or value.endswith(".safetensors.index.json")
    ):
        pickled = isinstance(value, str) and value.endswith(".bin")
        raise CheckpointError(
            f"{where} is {str(value)[:80]!r}, expected the name of a *.safetensors file or a "
            "*.safetensors.index.json index inside the folder"
            + ("; kvquant never unpickles .bin files" if pickled else "")
            + ". Fix: correct config.json, or remove the key to load model.safetensors."
        )
    _confined(folder, value, where, "the weights file")
    return value


def weight_files(root: str | Path, config: Mapping[str, Any] | None = None) -> WeightFiles:
    """The safetensors files transformers loads from a checkpoint folder, in its order of preference.

    transformers (5.17 to 5.24) loads, for the default ``variant``: the file
    ``config.json``'s ``transformers_weights`` names (a shard or an index),
    else ``model.safetensors`` when it exists (an index beside it is ignored),
    else the shards ``model.safetensors.index.json`` lists, each relative to
    the folder. No header is read here; see :func:`select_shards`.

    Args:
        root: the checkpoint folder.
        config: its parsed ``config.json`` (read from the folder when None).

    Returns:
        The :class:`WeightFiles`.

    Raises:
        CheckpointError: as :func:`select_shards`.
    """
    folder = Path(root)
    explicit = _explicit_weights(folder, config)
    index = folder / INDEX_NAME
    single = folder / SINGLE_FILE_NAME
    if explicit is not None and explicit.endswith(".json"):
        return _index_files(folder, folder / explicit, [])
    if explicit is not None:
        file = folder / explicit
        return WeightFiles(folder, (file,), None, {}, tuple(_stray(folder, {explicit})))
    if os.path.lexists(single):
        ignored = [INDEX_NAME] if os.path.lexists(index) else []
        return WeightFiles(
            folder, (single,), None, {}, (*ignored, *_stray(folder, {SINGLE_FILE_NAME}))
        )
    if os.path.lexists(index):
        return _index_files(folder, index, [])
    pickles = [n for n in PICKLE_NAMES if os.path.lexists(folder / n)]
    if pickles:
        raise CheckpointError(
            f"{folder} holds {' and '.join(pickles)} but no {SINGLE_FILE_NAME}; kvquant reads "
            "safetensors checkpoints only (it never unpickles .bin files). Fix: re-save the "
            "model with save_pretrained() (safetensors is the default)."
        )
    other = _stray(folder, set())
    if other:
        raise CheckpointError(
            f"{folder} has {', '.join(other[:3])}{' ...' if len(other) > 3 else ''} but neither "
            f"{SINGLE_FILE_NAME} nor {INDEX_NAME}, which is what transformers loads. Fix: "
            "rename the weights file to model.safetensors, or re-save with save_pretrained()."
        )
    raise CheckpointError(
        f"{folder} has no {SINGLE_FILE_NAME} or {INDEX_NAME}; kvquant reads safetensors "
        "checkpoints only. Fix: re-save the model with save_pretrained() (safetensors is the "
        "default)."
    )


def _index_files(folder: Path, index: Path, ignored: list[str]) -> WeightFiles:
    data = read_json(index, "safetensors index", MAX_INDEX_BYTES)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, Mapping) or not weight_map:
        raise CheckpointError(
            f"{index} has no weight_map (a non-empty object of tensor name -> shard file). "
            "Fix: re-export the checkpoint with save_pretrained."
        )
    shard_of: dict[str, Path] = {}
    for name, shard in weight_map.items():
        shard_of[str(name)] = _confined(folder, shard, index)
    files = tuple(sorted(set(shard_of.values())))
    stray = _stray(folder, {str(f.relative_to(folder)) for f in files})
    return WeightFiles(folder, files, index, shard_of, (*ignored, *stray))


MAX_FOLDER_DEPTH = 32
"""Most folder levels between a weight file and the checkpoint folder that lists it."""


def folder_of_weight_files(files: Sequence[str | Path], hint: str | Path | None = None) -> Path:
    """The checkpoint folder transformers is loading ``files`` from, by the rules of :func:`weight_files`.

    An index may place its shards in subfolders, so a shard's parent is not
    always the checkpoint folder: the folder is the one ancestor of the files
    whose :func:`weight_files` are exactly ``files``. The search stops at
    ``hint`` (the model's ``name_or_path``) when that folder holds the files,
    and at a Hugging Face cache snapshot.

    Args:
        files: the weight files transformers passed to the quantizer.
        hint: the path or hub id the model is being loaded from.

    Returns:
        The checkpoint folder.

    Raises:
        CheckpointError: no folder, or more than one, lists exactly these files
            (a ``variant=`` load, or a folder layout kvquant cannot tell apart).
    """
    paths = [Path(os.path.abspath(f)) for f in files]
    if not paths:
        raise CheckpointError("transformers passed no weight files to kvquant's quantizer.")
    wanted = set(paths)
    stop = None
    if hint is not None and os.path.isdir(str(hint)):
        top = Path(os.path.abspath(str(hint)))
        if top in paths[0].parents:
            stop = top
    matches: list[Path] = []
    for depth, folder in enumerate(paths[0].parents):
        if depth >= MAX_FOLDER_DEPTH:
            break
        if os.path.lexists(folder / "config.json"):
            try:
                plan = weight_files(folder)
            except CheckpointError:
                plan = None
            if plan is not None and {Path(os.path.abspath(f)) for f in plan.files} == wanted:
                matches.append(folder)
        if folder == stop or folder.parent.name == "snapshots":
            break
    shown = ", ".join(str(p) for p in paths[:3]) + (" ..." if len(paths) > 3 else "")
    if not matches:
        raise CheckpointError(
            f"transformers is loading the weights {shown}, which no checkpoint folder above "
            "them lists as its weights (model.safetensors, the shards of "
            "model.safetensors.index.json, or config.json's transformers_weights); kvquant "
            "would read its KV scales from other files. Fix: load the checkpoint's default "
            "weights (no variant=), or save the model you want with save_pretrained() and load "
            "that folder."
        )
    if len(matches) > 1:
        raise CheckpointError(
            f"the weights {shown} are listed by more than one checkpoint folder "
            f"({', '.join(str(m) for m in matches)}), each with its own config.json; kvquant "
            "cannot tell which one transformers read. Fix: remove the stale index (and "
            "config.json) from one of them."
        )
    return matches[0]


MAX_FOLDER_ENTRIES = 100_000
"""Most files and folders a checkpoint folder may hold for kvquant to copy it (export, calibrate)."""


@dataclass(frozen=True)
class FolderEntry:
    """One file or folder of a checkpoint folder, as :func:`scan_folder` found it.

    Attributes:
        rel: the path relative to the checkpoint folder, ``/``-separated.
        path: the path inside the checkpoint folder (a file may be a symlink to a regular file).
        is_dir: a folder (never a symlink).
        size: the bytes of a file (after following a symlink); 0 for a folder.
    """

    rel: str
    path: Path
    is_dir: bool
    size: int


def scan_folder(
    root: str | Path, skip: Collection[str] = ()
) -> tuple[list[FolderEntry], list[str]]:
    """Every file and folder under a checkpoint folder, by the rules its readers follow.

    A file must be a regular file (a symlink to one is followed, as the Hugging
    Face cache is made of them); a folder must be a real folder inside the
    checkpoint (a symlink to a folder is not followed); a FIFO, device, socket,
    broken link or linked folder is a problem. At most
    :data:`MAX_FOLDER_ENTRIES` entries, :data:`MAX_FOLDER_DEPTH` levels deep.

    Args:
        root: the checkpoint folder.
        skip: top-level names left out (files the caller writes itself).

    Returns:
        ``(entries, problems)``: the entries in walking order (a folder before
        what it holds) and one sentence per problem found (empty when the folder
        can be copied).
    """
    folder = Path(root)
    entries: list[FolderEntry] = []
    problems: list[str] = []
    stack: list[tuple[Path, str, int]] = [(folder, "", 0)]
    while stack and not problems:
        current, prefix, depth = stack.pop()
        try:
            with os.scandir(current) as it:
                listed = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            problems.append(f"{current} cannot be listed: {exc}.")
            break
        subfolders = []
        for entry in listed:
            rel = f"{prefix}{entry.name}"
            if not prefix and entry.name in skip:
                continue
            if len(entries) >= MAX_FOLDER_ENTRIES:
                problems.append(
                    f"{folder} holds more than {MAX_FOLDER_ENTRIES} files and folders; a "
                    "checkpoint holds a few dozen."
                )
                break
            path = current / entry.name
            try:
                st = os.stat(path)
            except OSError:
                problems.append(f"{path} is a broken link (or cannot be examined).")
                continue
            linked = entry.is_symlink()
            if stat.S_ISDIR(st.st_mode) and linked:
                problems.append(
                    f"{path} is a link to the folder {os.path.realpath(path)}; kvquant copies "
                    "only folders that lie inside the checkpoint."
                )
            elif stat.S_ISDIR(st.st_mode):
                if depth + 1 >= MAX_FOLDER_DEPTH:
                    problems.append(f"{path} is nested more than {MAX_FOLDER_DEPTH} levels deep.")
                    continue
                entries.append(FolderEntry(rel, path, True, 0))
                subfolders.append((path, f"{rel}/", depth + 1))
            elif stat.S_ISREG(st.st_mode):
                entries.append(FolderEntry(rel, path, False, int(st.st_size)))
            else:
                problems.append(
                    f"{path} is {_kind_of(st.st_mode)}{' (through a link)' if linked else ''}, "
                    "expected a regular file."
                )
        stack.extend(reversed(subfolders))
    return entries, problems


def select_shards(root: str | Path, config: Mapping[str, Any] | None = None) -> ShardSelection:
    """Choose the safetensors files transformers would read, and read their headers.

    The files of :func:`weight_files`: ``config.json``'s ``transformers_weights``,
    else ``model.safetensors``, else the shards ``model.safetensors.index.json``
    lists (its ``weight_map`` decides which shard holds each tensor). Any other
    ``*.safetensors`` file, or an index beside ``model.safetensors``, is
    ignored and reported; a name held by two shards is reported and the index's
    choice kept.

    Args:
        root: the checkpoint folder.
        config: its parsed ``config.json`` (read from the folder when None).

    Returns:
        The :class:`ShardSelection`.

    Raises:
        CheckpointError: no safetensors weights (``.bin``-only checkpoints are
            refused here, before anything unpickles them), a malformed index, a
            shard outside the folder or missing, or a malformed header.
    """
    plan = weight_files(root, config)
    findings: list[Finding] = []
    if plan.index is None:
        (single,) = plan.files
        tensors = read_safetensors_header(single)
    else:
        tensors = _read_indexed_shards(plan, plan.index, findings)
    findings += _ignored_file_findings(plan)
    return ShardSelection(plan.root, plan.files, tensors, tuple(findings))


def _read_indexed_shards(
    plan: WeightFiles, index: Path, findings: list[Finding]
) -> dict[str, TensorInfo]:
    """The headers of the shards ``index`` (``plan.index``) lists, each tensor from the shard
    the index names; what disagrees with the index goes to ``findings``."""
    folder, shard_of, files = plan.root, plan.shard_of, plan.files
    index_name = str(index.relative_to(folder))
    missing = [str(f.relative_to(folder)) for f in files if not os.path.lexists(f)]
    if missing:
        raise CheckpointError(
            f"{index} lists shard(s) {missing} that are not in {folder}. "
            "Fix: download every shard of the checkpoint."
        )
    tensors: dict[str, TensorInfo] = {}
    unlisted: list[str] = []
    twice: list[str] = []
    for file in files:
        for name, info in read_safetensors_header(file).items():
            owner = shard_of.get(name)
            if owner is None:
                unlisted.append(name)
            elif owner != file:
                twice.append(name)
            else:
                tensors[name] = info
    absent = sorted(n for n in shard_of if n not in tensors)
    if absent:
        findings.append(
            Finding(
                "error",
                "index-tensor-missing",
                f"{index_name} places {len(absent)} tensor(s) (e.g. {absent[0]}) in shards "
                "that do not hold them. Fix: re-download the shards, or re-export the "
                "checkpoint.",
            )
        )
    if twice:
        findings.append(
            Finding(
                "warning",
                "tensor-in-two-files",
                f"{len(twice)} tensor name(s) (e.g. {sorted(twice)[0]}) are held by two "
                f"shards; the one {index_name} names is used, as transformers does. Fix: "
                "remove the stale copies.",
            )
        )
    if unlisted:
        findings.append(
            Finding(
                "warning",
                "tensor-not-in-index",
                f"{len(unlisted)} tensor(s) (e.g. {sorted(unlisted)[0]}) are in a shard but "
                f"not in {index_name}'s weight_map; ignored. Fix: re-export the checkpoint.",
            )
        )
    return tensors


def _ignored_file_findings(plan: WeightFiles) -> list[Finding]:
    """Warnings for the index or ``*.safetensors`` files transformers (and kvquant) ignore."""
    findings: list[Finding] = []
    if INDEX_NAME in plan.ignored and plan.index is None:
        findings.append(
            Finding(
                "warning",
                "index-ignored",
                f"{INDEX_NAME} is ignored: transformers loads {plan.files[0].name} when it is "
                "present, and so does kvquant. Fix: delete the stale index (and its shards) or "
                "the stale single file.",
            )
        )
    stray = [n for n in plan.ignored if n != INDEX_NAME]
    if stray:
        code = "unlisted-shard" if plan.index is not None else "stray-safetensors"
        what = (
            f"that {plan.index.name} does not name"
            if plan.index is not None
            else f"besides {plan.files[0].name}"
        )
        findings.append(
            Finding(
                "warning",
                code,
                f"{len(stray)} *.safetensors file(s) {what} "
                f"({', '.join(stray[:3])}{' ...' if len(stray) > 3 else ''}); ignored, as "
                "transformers ignores them. Fix: delete stale files from the folder.",
            )
        )
    return findings


def locate_checkpoint(
    path: str | Path, *, revision: str | None = None, cache_dir: str | Path | None = None
) -> Path:
    """The local checkpoint folder for a folder path, a ``config.json`` path, or a hub id.

    A path that exists locally is used as is (``config.json``, the index or a
    ``*.safetensors`` shard stands for its folder, as on the command line). Otherwise a string shaped like a hub id (``"org/name"``) is looked
    up in the local Hugging Face cache (``HF_HUB_CACHE`` / ``HF_HOME``) with
    ``huggingface_hub.snapshot_download(..., local_files_only=True)``; nothing
    is downloaded.

    Args:
        path: a folder, its ``config.json``, index or a shard, or a hub id.
        revision: the hub revision (branch, tag or commit) when ``path`` is a hub id.
        cache_dir: the Hugging Face hub cache to look in (default ``HF_HUB_CACHE``).

    Returns:
        The checkpoint folder (for a hub id, its snapshot folder in the cache).

    Raises:
        CheckpointError: the path does not exist and is not a cached hub model,
            or it is a file other than those.
        OptionTypeError: ``path`` is not a str or path, or ``revision`` not a str.
    """
    check_path_argument(path, "path")
    if revision is not None and not isinstance(revision, str):
        raise OptionTypeError(
            f"revision is a {type(revision).__name__}; expected a branch, tag or commit (str) "
            "or None."
        )
    local = Path(folder_named_by(path))
    if os.path.lexists(local):
        try:
            st = os.stat(local)
        except OSError as exc:
            raise CheckpointError(f"{local} cannot be examined: {exc}.") from exc
        if not stat.S_ISDIR(st.st_mode):
            raise CheckpointError(
                f"{local} is {_kind_of(st.st_mode) if not stat.S_ISREG(st.st_mode) else 'a file'}"
                ", expected a checkpoint folder holding config.json and model.safetensors. "
                "Fix: pass the checkpoint folder."
            )
        return local
    text = str(path)
    if not is_hub_id(text):
        raise CheckpointError(
            f"{local} does not exist. Fix: pass the folder of a saved checkpoint (the one "
            "holding config.json and model.safetensors), or a hub id in the local Hugging Face "
            "cache."
        )
    return _from_hf_cache(text, revision, cache_dir)


def check_path_argument(
    value: object,
    name: str,
    expected: str = "a checkpoint folder, or a hub id in the local Hugging Face cache",
) -> None:
    """Refuse a path argument that is not a ``str`` or ``os.PathLike`` (before any file is touched).

    Args:
        value: the argument.
        name: how to name it, e.g. ``"discover_scales: path"``.
        expected: what the path names, for the message.

    Raises:
        OptionTypeError: ``value`` is of another type (``None``, a list, bytes, ...).
    """
    if not isinstance(value, (str, os.PathLike)) or isinstance(os.fspath(value), bytes):
        raise OptionTypeError(
            f"{name} is a {type(value).__name__}; expected a path (str or pathlib.Path): "
            f"{expected}."
        )


def is_hub_id(text: str) -> bool:
    """Whether ``text`` is a valid Hugging Face repo id (``name`` or ``org/name``), by the hub's rule."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def folder_named_by(path: str | Path) -> str | Path:
    """The checkpoint folder a path names, by one rule at every door (CLI, Python, loading).

    A checkpoint's own file (``config.json``, the safetensors index, a
    ``*.safetensors`` shard) names its folder; any other path (a folder, another
    file, a hub id) is returned unchanged, for the caller to use or refuse.
    """
    p = Path(path)
    own_file = p.name in ("config.json", INDEX_NAME) or p.suffix == ".safetensors"
    return p.parent if own_file and os.path.lexists(p) and not p.is_dir() else path


def _from_hf_cache(repo_id: str, revision: str | None, cache_dir: str | Path | None) -> Path:
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError as exc:  # pragma: no cover - transformers depends on huggingface_hub
        raise CheckpointError(
            f"{repo_id} is not a local folder, and huggingface_hub (needed to look it up in the "
            "Hugging Face cache) is not installed. Fix: pip install huggingface_hub, or pass "
            "the checkpoint folder."
        ) from exc
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=None if cache_dir is None else str(cache_dir),
            local_files_only=True,
        )
    except Exception as exc:  # huggingface_hub raises several error types for "not cached"
        at = f" at revision {revision!r}" if revision else ""
        where = cache_dir if cache_dir is not None else constants.HF_HUB_CACHE
        command = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
        if cache_dir is not None:
            command += f" --cache-dir {cache_dir}"
        raise CheckpointError(
            f"{repo_id} is not a local folder and not in the local Hugging Face cache{at} "
            f"({where}): {type(exc).__name__}. kvquant never downloads. Fix: "
            f"download it first ({command}), or pass the checkpoint folder."
        ) from exc
    return Path(folder)
