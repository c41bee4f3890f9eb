"""Untrusted checkpoint files: bounds, confinement, special files, shard selection, hub ids.

Each case runs the doctor (exit 0, 1 or 2, never a traceback) and checks the
error class discovery raises.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvquant.checkpoint import locate_checkpoint, select_shards
from kvquant.checkpoint.discovery import discover_scales
from kvquant.cli import main as cli_main
from kvquant.errors import CheckpointError, ScaleFormatError
from kvquant.report import inspect_checkpoint
from kvquant.testing.checkpoints import scale_tensor_name, write_checkpoint, write_hf_cache_entry


def _doctor(path: str | Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli_main(["doctor", str(path)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return code, captured.err


def _edit_config(path: Path, **updates: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(updates)
    (path / "config.json").write_text(json.dumps(cfg))


# ---------------------------------------------------------------------- config bounds


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("num_hidden_layers", 10**9),
        ("num_hidden_layers", 10**6),
        ("num_attention_heads", 10**7),
        ("num_key_value_heads", -2),
        ("head_dim", 1 << 40),
        ("hidden_size", "64"),
        ("num_hidden_layers", 2.0),
        ("num_hidden_layers", True),
    ],
)
def test_config_values_are_bounded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: object
) -> None:
    path = write_checkpoint(tmp_path / "c", convention="modelopt", weights="none")
    _edit_config(path, **{key: value})
    start = time.monotonic()
    code, err = _doctor(path, capsys)
    assert code == 2, err
    assert key in err and "expected an integer from 1 to" in err
    assert time.monotonic() - start < 10


def test_hidden_size_smaller_than_heads_is_refused(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "c", convention="modelopt", weights="none")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("head_dim", None)
    cfg.update(hidden_size=2, num_attention_heads=4, num_key_value_heads=2)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="gives head_dim 0"):
        discover_scales(path)


def test_deeply_nested_config_is_not_a_recursion_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_checkpoint(tmp_path / "c", convention="modelopt", weights="none")
    depth = 200_000
    (path / "config.json").write_text('{"x": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(CheckpointError, match="nested too deeply"):
        discover_scales(path)
    assert _doctor(path, capsys)[0] == 2


def test_oversized_json_is_refused_without_reading_it(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "c", convention="modelopt", weights="none")
    with (path / "hf_quant_config.json").open("r+b") as fh:
        fh.truncate(17 * 1024 * 1024)  # sparse file: nothing is written
    with pytest.raises(CheckpointError, match="more than the"):
        discover_scales(path)


# ---------------------------------------------------------------------- safetensors headers


def _rewrite_header(file: Path, edit: object) -> None:
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    data = raw[8 + length :]
    edit(header)  # type: ignore[operator]
    blob = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@pytest.mark.parametrize("shape", [["x"], 5, None, [-1], [1.5], [True], [[1]]])
def test_malformed_header_shape_is_not_a_readable_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], shape: object
) -> None:
    path = write_checkpoint(tmp_path / "c", convention="compressed-tensors", weights="none")
    name = scale_tensor_name("compressed-tensors", 0, "k")

    def edit(header: dict[str, dict[str, object]]) -> None:
        header[name]["shape"] = shape

    _rewrite_header(path / "model.safetensors", edit)
    with pytest.raises(CheckpointError, match="unreadable safetensors header"):
        discover_scales(path)
    assert _doctor(path, capsys)[0] == 2


@pytest.mark.parametrize("length", [0, 1 << 62, 10**9])
def test_header_length_is_bounded(tmp_path: Path, length: int) -> None:
    path = write_checkpoint(tmp_path / "c", convention="modelopt", weights="none")
    file = path / "model.safetensors"
    raw = file.read_bytes()
    file.write_bytes(struct.pack("<Q", length) + raw[8:])
    with pytest.raises(CheckpointError, match="safetensors header"):
        discover_scales(path)


def test_truncated_shard_is_not_a_readable_checkpoint(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "c", convention="modelopt", weights="none")
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-3])
    with pytest.raises(CheckpointError):
        discover_scales(path)


# ---------------------------------------------------------------------- shard selection


def test_stray_file_never_wins(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "c", convention="compressed-tensors", weights="none")
    name = scale_tensor_name("compressed-tensors", 0, "k")
    save_file({name: torch.tensor([7.0])}, str(path / "zz-stale.safetensors"))
    found = discover_scales(path)
    (k0,) = [s for s in found.scales if s.name == name]
    assert float(k0.tensor.float()) == pytest.approx(0.02, rel=1e-2)
    assert found.files == (path / "model.safetensors",)
    assert any(f.code == "stray-safetensors" and "zz-stale" in f.message for f in found.findings)


def test_index_decides_and_unlisted_shards_are_ignored(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "c", convention="modelopt", weights="none", shards=2)
    name = scale_tensor_name("modelopt", 1, "v")
    save_file({name: torch.tensor(7.0)}, str(path / "model-extra.safetensors"))
    found = discover_scales(path)
    (v1,) = [s for s in found.scales if s.name == name]
    assert float(v1.tensor) == pytest.approx(0.02)
    assert path / "model-extra.safetensors" not in found.files
    assert any(f.code == "unlisted-shard" for f in found.findings)


def test_tensor_missing_from_its_shard_is_an_error_finding(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "c", convention="modelopt", weights="none", shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.self_attn.q_proj.weight"] = (
        "model-00001-of-00002.safetensors"
    )
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert not inspect_checkpoint(path).ok


@pytest.mark.parametrize(
    "shard", ["/etc/passwd", "../outside.safetensors", "sub/../../outside.safetensors", "C:\\x", 3]
)
def test_weight_map_is_confined_to_the_folder(tmp_path: Path, shard: object) -> None:
    outside = tmp_path / "outside.safetensors"
    save_file({scale_tensor_name("modelopt", 0, "k"): torch.tensor(7.0)}, str(outside))
    path = write_checkpoint(
        tmp_path / "ckpt" / "c", convention="modelopt", weights="none", shards=2
    )
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"][scale_tensor_name("modelopt", 0, "k")] = shard
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shard"):
        discover_scales(path)


def test_symlinked_files_are_read(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", convention="modelopt", weights="none")
    linked = tmp_path / "linked"
    linked.mkdir()
    for f in src.iterdir():
        (linked / f.name).symlink_to(f)
    assert inspect_checkpoint(linked).ok


def test_bin_only_checkpoint_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_checkpoint(tmp_path / "c", convention="none", weights="none")
    (path / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(1)}, path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors checkpoints only"):
        select_shards(path)
    assert _doctor(path, capsys)[0] == 2


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "hf_quant_config.json"])
def test_fifo_is_refused_without_blocking(tmp_path: Path, name: str) -> None:
    path = write_checkpoint(tmp_path / "c", convention="modelopt", weights="none")
    (path / name).unlink()
    os.mkfifo(path / name)
    # In a child process: a reader that blocked on the FIFO would hang the test run.
    res = subprocess.run(
        [sys.executable, "-m", "kvquant", "doctor", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert res.returncode == 2, res.stderr
    assert "FIFO" in res.stderr and "Traceback" not in res.stderr


# ---------------------------------------------------------------------- hub ids


def test_hub_id_resolves_through_the_local_cache(
    tmp_path: Path, hf_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_checkpoint(tmp_path / "src", convention="modelopt", weights="none", shards=2)
    snapshot = write_hf_cache_entry(hf_cache, "org/tiny-fp8", src)
    assert all(p.is_symlink() for p in snapshot.iterdir())
    assert locate_checkpoint("org/tiny-fp8") == snapshot
    found = discover_scales("org/tiny-fp8")
    assert found.path == snapshot and len(found.scales) == 4
    assert _doctor("org/tiny-fp8", capsys)[0] == 0


def test_hub_id_not_in_cache_is_a_clear_error(
    hf_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        discover_scales("org/absent")
    code, err = _doctor("org/absent", capsys)
    assert code == 2 and "never downloads" in err


def test_export_reads_a_hub_id(tmp_path: Path, hf_cache: Path) -> None:
    from kvquant.export import export_checkpoint

    src = write_checkpoint(tmp_path / "src", convention="modelopt", weights="none")
    write_hf_cache_entry(hf_cache, "org/tiny-fp8", src)
    export_checkpoint("org/tiny-fp8", tmp_path / "out", engine="vllm")
    assert discover_scales(tmp_path / "out").scales


# ---------------------------------------------------------------------- registry inputs


def test_sparse_scale_is_a_scale_format_error() -> None:
    from kvquant.registry import LayerGeometry, RawScale, analyze_scales, resolve_scales

    g = LayerGeometry(1, 4, 2, 16)
    raws = [
        RawScale(
            0, "k", "m.layers.0.self_attn.k_scale", "compressed-tensors", torch.rand(1).to_sparse()
        ),
        RawScale(
            0, "v", "m.layers.0.self_attn.v_scale", "compressed-tensors", torch.rand(1) + 0.01
        ),
    ]
    with pytest.raises(ScaleFormatError, match="dense tensor"):
        resolve_scales(raws, g)
    assert not analyze_scales(raws, g).ok


def test_mixed_dtype_quark_pair_is_compared_by_value(tmp_path: Path) -> None:
    v = torch.tensor(0.04).to(torch.float8_e4m3fn)
    path = write_checkpoint(
        tmp_path / "q",
        convention="quark",
        weights="none",
        scales={(0, "k"): torch.tensor(float(v.float())).to(torch.bfloat16), (0, "v"): v},
    )
    report = inspect_checkpoint(path)
    assert report.ok
    assert not any(f.code == "quark-merge-mismatch" for f in report.findings)


def test_oversized_scale_tensor_is_not_loaded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvquant.checkpoint.discovery import MAX_SCALE_ELEMENTS

    big = torch.full((MAX_SCALE_ELEMENTS + 1,), 0.01, dtype=torch.float16)
    path = write_checkpoint(
        tmp_path / "c", convention="modelopt", weights="none", scales={(0, "k"): big}
    )
    found = discover_scales(path)
    assert all(s.name != scale_tensor_name("modelopt", 0, "k") for s in found.scales)
    assert any(f.code == "scale-too-large" and f.severity == "error" for f in found.findings)
    assert _doctor(path, capsys)[0] == 1


# ---------------------------------------------------------------------- transformers' file order


def test_single_file_wins_over_an_index_as_in_transformers(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "c", convention="modelopt", weights="none", shards=2)
    name = scale_tensor_name("modelopt", 0, "k")
    save_file({name: torch.tensor(7.0)}, str(path / "model.safetensors"))
    found = discover_scales(path)
    assert found.files == (path / "model.safetensors",)
    assert [float(s.tensor) for s in found.scales] == [7.0]
    assert any(f.code == "index-ignored" for f in found.findings)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("../outside.safetensors", "outside the checkpoint folder"),
        ("/etc/passwd.safetensors", "outside the checkpoint folder"),
        ("pytorch_model.bin", "never unpickles"),
        ("weights.pt", "expected the name of a"),
        (3, "expected the name of a"),
    ],
)
def test_transformers_weights_is_confined_and_typed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: object, match: str
) -> None:
    path = write_checkpoint(tmp_path / "c", convention="modelopt", weights="none")
    _edit_config(path, transformers_weights=value)
    with pytest.raises(CheckpointError, match=match):
        discover_scales(path)
    assert _doctor(path, capsys)[0] == 2


def test_folder_of_weight_files(tmp_path: Path) -> None:
    from kvquant.checkpoint.files import folder_of_weight_files

    path = write_checkpoint(tmp_path / "c", convention="modelopt", weights="none", shards=2)
    shards = sorted(path.glob("model-*.safetensors"))
    assert folder_of_weight_files(shards, str(path)) == path
    assert folder_of_weight_files(shards, "org/name") == path
    with pytest.raises(CheckpointError, match="no checkpoint folder above"):
        folder_of_weight_files(shards[:1], str(path))  # not the whole list: a variant's files
    variant = path / "model.fp16.safetensors"
    save_file({"x": torch.zeros(1)}, str(variant))
    with pytest.raises(CheckpointError, match="no variant="):
        folder_of_weight_files([variant], str(path))
    # a second folder listing the same shards, with its own config: refused, not guessed
    sub = tmp_path / "c2"
    inner = write_checkpoint(sub / "inner", convention="modelopt", weights="none", shards=2)
    index = json.loads((inner / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: f"inner/{v}" for k, v in index["weight_map"].items()}
    (sub / "model.safetensors.index.json").write_text(json.dumps(index))
    (sub / "config.json").write_text((inner / "config.json").read_text())
    with pytest.raises(CheckpointError, match="more than one checkpoint folder"):
        folder_of_weight_files(sorted(inner.glob("model-*.safetensors")), str(sub))
