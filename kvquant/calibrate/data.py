"""Calibration data: token windows from UTF-8 text files or a ``datasets`` dataset.

:func:`load_text_files` reads bounded regular files only (:func:`check_text_file`,
:data:`MAX_TEXT_BYTES`); :func:`load_dataset_samples` reads a hub dataset, a
``save_to_disk`` folder or a local json/csv/parquet file (the optional
``datasets`` library). Both give :class:`CalibrationData`: the windows and a
description of where they came from, for the report and the written metadata.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvquant.errors import CalibrationError

__all__ = [
    "MAX_TEXT_BYTES",
    "CalibrationData",
    "check_text_file",
    "load_dataset_samples",
    "load_text_files",
]


@dataclass(frozen=True, eq=False)
class CalibrationData:
    """Calibration samples (token windows) and where they came from.

    Attributes:
        samples: int64 ``[1, T]`` token windows, ``2 <= T <= max_seq_length``;
            each is one forward pass.
        source: a description of the data (files, or dataset, config, split, column).
        max_seq_length: the most tokens per sample.
    """

    samples: tuple[torch.Tensor, ...]
    source: str
    max_seq_length: int

    @property
    def num_samples(self) -> int:
        """Samples (forward passes)."""
        return len(self.samples)

    @property
    def num_tokens(self) -> int:
        """Tokens over all samples."""
        return sum(int(t.numel()) for t in self.samples)


def _check_sizes(num_samples: int | None, max_seq_length: int) -> None:
    if num_samples is not None and num_samples < 1:
        raise CalibrationError(
            f"calibration data: num_samples={num_samples}; expected at least 1. "
            "Fix: pass --num-samples 512 (or another positive count)."
        )
    if max_seq_length < 2:
        raise CalibrationError(
            f"calibration data: max_seq_length={max_seq_length}; expected at least 2 tokens. "
            "Fix: pass --max-seq-length 2048 (or another length >= 2)."
        )


MAX_TEXT_BYTES = 64 * 1024 * 1024
"""Largest calibration text file read (about 16 M tokens; calibration uses far fewer)."""


def check_text_file(file: str | Path) -> int:
    """Check, without opening it, that a calibration text is a bounded regular file.

    Args:
        file: the ``--text`` file.

    Returns:
        Its size in bytes.

    Raises:
        CalibrationError: the file is missing, not a regular file (a FIFO, a
            device such as ``/dev/zero``, a folder), or larger than
            :data:`MAX_TEXT_BYTES`.
    """
    if not isinstance(file, (str, os.PathLike)):
        raise CalibrationError(
            f"calibration data: a text file is a {type(file).__name__}; expected a path."
        )
    try:
        st = os.stat(file)
    except OSError as exc:
        raise CalibrationError(
            f"calibration data: --text {file} cannot be read ({exc.strerror or exc}). "
            "Fix: pass an existing plain-text file."
        ) from exc
    if not stat.S_ISREG(st.st_mode):
        kind = (
            "a folder" if stat.S_ISDIR(st.st_mode)
            else "a FIFO" if stat.S_ISFIFO(st.st_mode)
            else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "not a regular file"
        )  # fmt: skip
        raise CalibrationError(
            f"calibration data: --text {file} is {kind}, expected a regular text file; kvquant "
            "reads calibration text from regular files only. Fix: save the text to a file and "
            "pass that."
        )
    if st.st_size > MAX_TEXT_BYTES:
        raise CalibrationError(
            f"calibration data: --text {file} is {st.st_size} bytes, more than the "
            f"{MAX_TEXT_BYTES} kvquant reads from one text file (calibration uses "
            "--num-samples windows of --max-seq-length tokens, far less). Fix: pass a smaller "
            "sample of the text."
        )
    return int(st.st_size)


def _read_text_file(file: str | Path) -> str:
    size = check_text_file(file)
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise OSError("it changed into a special file")
            blob = fh.read(min(size, MAX_TEXT_BYTES) + 1)
        if len(blob) > MAX_TEXT_BYTES:
            raise OSError(f"it grew beyond {MAX_TEXT_BYTES} bytes while being read")
        return blob.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationError(
            f"calibration data: --text {file} could not be read as UTF-8 text ({exc}). "
            "Fix: pass a readable plain-text file."
        ) from exc


def load_text_files(
    files: Sequence[str | Path],
    tokenizer: Any,
    *,
    num_samples: int | None = None,
    max_seq_length: int = 2048,
    progress: bool = False,
) -> CalibrationData:
    """Calibration samples from UTF-8 text files.

    Each file is tokenized whole and cut into windows of ``max_seq_length``
    tokens (a shorter last window is kept when it has at least 2 tokens).

    Args:
        files: the text files, in order.
        tokenizer: the model's tokenizer.
        num_samples: keep at most this many windows (None: all).
        max_seq_length: tokens per window.
        progress: show a tqdm bar over the files on stderr.

    Returns:
        The :class:`CalibrationData`.

    Raises:
        CalibrationError: no file, a file that is not a regular file or is
            larger than :data:`MAX_TEXT_BYTES`, an unreadable or non-UTF-8 file, no
            window of at least 2 tokens, or bad sizes.
    """
    from tqdm import tqdm

    _check_sizes(num_samples, max_seq_length)
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    if not files:
        raise CalibrationError(
            "calibration data: no text file given; expected at least one. Fix: pass "
            "--text FILE (repeatable) or --dataset NAME."
        )
    for file in files:
        check_text_file(file)
    samples: list[torch.Tensor] = []
    for file in tqdm(files, desc="tokenizing", unit="file", file=sys.stderr, disable=not progress):
        text = _read_text_file(file)
        ids = tokenizer(text, return_tensors="pt")["input_ids"].long().reshape(-1)
        for start in range(0, ids.numel(), max_seq_length):
            piece = ids[start : start + max_seq_length]
            if piece.numel() >= 2:
                samples.append(piece.view(1, -1))
        if num_samples is not None and len(samples) >= num_samples:
            samples = samples[:num_samples]
            break
    if not samples:
        raise CalibrationError(
            f"calibration data: {', '.join(map(str, files))} give no sample of at least 2 "
            "tokens; expected real text. Fix: pass longer text files."
        )
    names = ", ".join(str(f) for f in files)
    return CalibrationData(tuple(samples), f"text files {names}", max_seq_length)


def _open_dataset(name: str, config: str | None, split: str) -> Any:
    path = Path(name)
    if os.path.lexists(path):
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = 0
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            raise CalibrationError(
                f"calibration data: --dataset {name} is neither a regular file nor a folder (a "
                "FIFO, a device or a broken link); kvquant reads local datasets from files and "
                "folders only. Fix: save the data to a .jsonl/.json/.csv/.parquet file, or pass "
                "a dataset name."
            )
    try:
        import datasets
    except ImportError as exc:
        raise CalibrationError(
            f"calibration data: --dataset {name} needs the datasets library, which is not "
            "installed. Fix: pip install datasets (kvquant's 'calibrate' extra), or pass "
            "--text FILE instead."
        ) from exc
    try:
        if path.is_dir() and (path / "dataset_info.json").is_file():
            loaded = datasets.load_from_disk(str(path))
            return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
        suffix = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
        if path.is_file() and path.suffix in suffix:
            return datasets.load_dataset(suffix[path.suffix], data_files=str(path), split=split)
        return datasets.load_dataset(name, config, split=split)
    except (OSError, ValueError, KeyError, FileNotFoundError) as exc:
        raise CalibrationError(
            f"calibration data: the datasets library could not load {name!r} (config "
            f"{config!r}, split {split!r}): {type(exc).__name__}: {exc}. Fix: check the name, "
            "--dataset-config and --split (e.g. --dataset wikitext --dataset-config "
            "wikitext-2-raw-v1 --split train), or pass --text FILE."
        ) from exc


def load_dataset_samples(
    name: str,
    tokenizer: Any,
    *,
    config: str | None = None,
    split: str = "train",
    text_column: str = "text",
    num_samples: int = 512,
    max_seq_length: int = 2048,
    progress: bool = False,
    dataset: Any = None,
) -> CalibrationData:
    """Calibration samples from a dataset of the ``datasets`` library (like llm-compressor's).

    The first ``num_samples`` rows whose text has at least 2 tokens are kept,
    each truncated to ``max_seq_length`` tokens: one sample per row.

    Args:
        name: a dataset on the Hugging Face hub (``"wikitext"``), a folder
            written by ``Dataset.save_to_disk``, or a local ``.json``/``.jsonl``/
            ``.csv``/``.parquet`` file.
        tokenizer: the model's tokenizer.
        config: the dataset configuration (``"wikitext-2-raw-v1"``).
        split: the split to read.
        text_column: the column holding the text.
        num_samples: rows to keep.
        max_seq_length: tokens per sample at most.
        progress: show a tqdm bar on stderr.
        dataset: an already loaded dataset (any sequence of mappings) to read
            instead of loading ``name``; ``name`` then only describes it.

    Returns:
        The :class:`CalibrationData`.

    Raises:
        CalibrationError: ``datasets`` not installed, the dataset cannot be
            loaded, no such column, too few usable rows, or bad sizes.
    """
    from tqdm import tqdm

    _check_sizes(num_samples, max_seq_length)
    rows = dataset if dataset is not None else _open_dataset(name, config, split)
    columns = list(getattr(rows, "column_names", None) or [])
    if columns and text_column not in columns:
        raise CalibrationError(
            f"calibration data: dataset {name!r} has no column {text_column!r}; its columns "
            f"are {columns}. Fix: pass --text-column with one of them."
        )
    samples: list[torch.Tensor] = []
    bar = tqdm(
        total=num_samples, desc="tokenizing", unit="sample", file=sys.stderr, disable=not progress
    )
    with bar:
        for row in rows:
            text = row.get(text_column) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise CalibrationError(
                    f"calibration data: a row of dataset {name!r} has no text in column "
                    f"{text_column!r} (got {type(text).__name__}). Fix: pass --text-column "
                    "naming a text column."
                )
            if not text.strip():
                continue
            ids = tokenizer(text, return_tensors="pt")["input_ids"].long().reshape(-1)
            ids = ids[:max_seq_length]
            if ids.numel() < 2:
                continue
            samples.append(ids.view(1, -1))
            bar.update(1)
            if len(samples) == num_samples:
                break
    if not samples:
        raise CalibrationError(
            f"calibration data: dataset {name!r} (split {split!r}, column {text_column!r}) has "
            "no row with at least 2 tokens of text. Fix: pick another split or column."
        )
    where = name + (f" ({config})" if config else "")
    source = f"dataset {where}, split {split}, column {text_column}"
    return CalibrationData(tuple(samples), source, max_seq_length)
