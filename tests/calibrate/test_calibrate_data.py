"""kvquant.calibrate.data: bounded text files and datasets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from calibration_models import jsonl, load_tokenizer

from kvquant.errors import CalibrationError

pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "folder", "too large"])
def test_text_inputs_are_bounded_regular_files(
    tiny: Any, tmp_path: Path, capsys: Any, kind: str
) -> None:
    """--text FIFO used to hang and --text /dev/zero to run out of memory: both, and a folder
    or an oversized file, are refused before the model loads (exit 2), in a child process so
    that a regression cannot hang the run."""
    import os
    import subprocess
    import sys

    from kvquant.calibrate import MAX_TEXT_BYTES, check_text_file, load_text_files

    _, src = tiny
    text = tmp_path / "calib.txt"
    if kind == "fifo":
        if not hasattr(os, "mkfifo"):
            pytest.skip("needs FIFOs")
        os.mkfifo(text)
    elif kind == "/dev/zero":
        text = Path("/dev/zero")
    elif kind == "folder":
        text.mkdir()
    else:
        with text.open("wb") as fh:
            fh.truncate(MAX_TEXT_BYTES + 1)  # sparse: nothing is written
    want = {"fifo": "is a FIFO", "/dev/zero": "is a device", "folder": "is a folder"}.get(
        kind, "more than the"
    )
    with pytest.raises(CalibrationError, match=want):
        check_text_file(text)
    with pytest.raises(CalibrationError, match=want):
        load_text_files([text], tokenizer=None)
    out = tmp_path / "out"
    root = str(Path(__file__).resolve().parents[1])
    res = subprocess.run(
        [sys.executable, "-m", "kvquant", "calibrate", str(src), "--out", str(out),
         "--text", str(text)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": root},
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert want in res.stderr and "Traceback" not in res.stderr
    assert not out.exists()


@pytest.mark.parametrize("kind", ["fifo", "device", "broken link"])
def test_a_special_dataset_path_is_refused(tmp_path: Path, kind: str) -> None:
    import os

    from kvquant.calibrate import load_dataset_samples

    path = tmp_path / "data.jsonl"
    if kind == "fifo":
        if not hasattr(os, "mkfifo"):
            pytest.skip("needs FIFOs")
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    else:
        path.symlink_to(tmp_path / "absent.jsonl")
    with pytest.raises(CalibrationError, match="neither a regular file nor a folder"):
        load_dataset_samples(str(path), tokenizer=None)


def test_dataset_samples_from_a_local_dataset(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    datasets = pytest.importorskip("datasets")
    from kvquant.calibrate import load_dataset_samples

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    _, src = tiny
    tokenizer = load_tokenizer(src)
    rng = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    texts = ["", "  "] + [
        "".join(chr(int(c)) for c in torch.randint(97, 123, (int(n),), generator=rng))
        for n in torch.randint(5, 300, (20,), generator=rng)
    ]
    lengths = [len(tokenizer(t)["input_ids"]) for t in texts[2:]]
    data = load_dataset_samples(
        str(jsonl(tmp_path / "d.jsonl", texts)), tokenizer, num_samples=7, max_seq_length=64
    )
    assert data.num_samples == 7  # the blank rows are skipped
    assert [int(t.numel()) for t in data.samples] == [min(n, 64) for n in lengths[:7]]
    assert data.num_tokens == sum(min(n, 64) for n in lengths[:7])
    assert "split train, column text" in data.source
    disk = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(disk))
    saved = load_dataset_samples(
        str(disk), tokenizer, text_column="body", num_samples=100, max_seq_length=32
    )
    assert saved.num_samples == 20 and max(int(t.numel()) for t in saved.samples) <= 32
    with pytest.raises(CalibrationError, match=r"no column 'text'.*body"):
        load_dataset_samples(str(disk), tokenizer)
    with pytest.raises(CalibrationError, match="could not load"):
        load_dataset_samples(str(tmp_path / "missing.jsonl"), tokenizer)


def test_dataset_path_without_the_datasets_library(
    tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from kvquant.calibrate import load_dataset_samples

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(CalibrationError, match="pip install datasets"):
        load_dataset_samples("wikitext", load_tokenizer(tiny[1]))
    rows = [{"text": "hello world, calibrate me"}, {"text": "a second row of text"}]
    data = load_dataset_samples("injected", load_tokenizer(tiny[1]), dataset=rows)
    assert data.num_samples == 2  # an injected dataset needs no library
