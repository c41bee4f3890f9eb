"""The checkpoint writer export and calibrate share (kvquant/checkpoint/writer.py).

A copy holds exactly the source's tensors less the dropped ones plus the new
ones (every kept tensor bit for bit), an index that says where each tensor is and
how many bytes there are, the new configs and extra files; unchanged shards are
hard-linked; and a write that fails at any point, an interrupt included, leaves
neither the copy nor a temporary folder, and changes neither the source nor an
existing output folder.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch

import kvquant.checkpoint.writer as writer
from kvquant.calibrate import CalibrationResult, LayerCalibration, write_calibrated_checkpoint
from kvquant.checkpoint.discovery import discover_scales, scale_tensor_infos
from kvquant.checkpoint.writer import CheckpointEdit, kv_scale_tensors, write_checkpoint_copy
from kvquant.errors import CalibrationError, ExportError, KVQuantError
from kvquant.testing.checkpoints import write_checkpoint

NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 16


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safetensors.safe_open(str(file), framework="pt") as fh:
            for name in fh.keys():
                assert name not in out, f"{name} in two shards"
                out[name] = fh.get_tensor(name)
    return out


def _where(folder: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safetensors.safe_open(str(file), framework="pt") as fh:
            out.update(dict.fromkeys(fh.keys(), file.name))
    return out


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """Three shards of a tiny random model with compressed-tensors KV scales, and other files."""
    root = write_checkpoint(
        tmp_path / "src",
        convention="compressed-tensors",
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        shards=3,
        seed=int(torch.randint(0, 2**31 - 1, ()).item()),
    )
    (root / "tokenizer.json").write_text('{"model": "none"}\n')
    (root / "extra").mkdir()
    (root / "extra" / "README").write_text("kept as is\n")
    return root


def _edit(src: Path) -> tuple[CheckpointEdit, dict[str, torch.Tensor], set[str]]:
    """Replace layer 1's K/V scales with fresh random ones and add a tensor beside them."""
    found = discover_scales(src)
    dropped = {r.name for r in found.scales if r.layer == 1}
    home = Path(scale_tensor_infos(found.files)[sorted(dropped)[0]].file)
    scales = {1: (torch.rand(()) + 0.01, torch.rand(()) + 0.01)}
    (k_name, k), (v_name, v) = kv_scale_tensors("compressed-tensors", scales, (1,))[1]
    extra = torch.randn(NUM_KV_HEADS, HEAD_DIM)
    new = {k_name: k, v_name: v, "model.layers.1.self_attn.extra_test_tensor": extra}
    edit = CheckpointEdit(
        tensors=new,
        homes=dict.fromkeys(new, home),
        drop=sorted(dropped),
        quantization_config={"quant_method": "compressed-tensors", "marker": 1.5},
        hf_quant_config={"quantization": {"kv_cache_quant_algo": "FP8"}},
        files={"notes.json": {"a": [1, 2]}, "notes.txt": "text\n", "blob.bin": b"\x00\x01"},
    )
    return edit, new, dropped


def test_copy_holds_exactly_the_edit(src: Path, tmp_path: Path) -> None:
    found = discover_scales(src)
    before = _digests(src)
    edit, new, dropped = _edit(src)
    out = tmp_path / "out"
    written = write_checkpoint_copy(found.path, found.files, found.config, out, edit)
    assert written.path == out
    assert _digests(src) == before

    old, got = _tensors(src), _tensors(out)
    assert set(got) == (set(old) - dropped) | set(new)
    for name, tensor in got.items():
        want = new.get(name, old.get(name))
        assert want is not None
        assert tensor.dtype == want.dtype and torch.equal(tensor, want), name
    index = json.loads((out / writer.INDEX_FILE).read_text())
    assert index["weight_map"] == _where(out)
    nbytes = sum(t.numel() * t.element_size() for t in got.values())
    assert index["metadata"]["total_size"] == nbytes

    home = Path(edit.homes[sorted(new)[0]]).name
    assert set(written.rewritten) >= {home, writer.INDEX_FILE, "config.json", "notes.json"}
    for shard in (p.name for p in src.glob("*.safetensors")):
        same_inode = (out / shard).stat().st_ino == (src / shard).stat().st_ino
        assert same_inode == (shard != home), shard
        assert (shard in written.linked) == (shard != home)
    assert {"tokenizer.json", "extra"} <= set(written.copied)
    assert (out / "extra" / "README").read_text() == "kept as is\n"

    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "compressed-tensors", "marker": 1.5}
    assert json.loads((out / "hf_quant_config.json").read_text()) == edit.hf_quant_config
    assert json.loads((out / "notes.json").read_text()) == {"a": [1, 2]}
    assert (out / "notes.txt").read_text() == "text\n"
    assert (out / "blob.bin").read_bytes() == b"\x00\x01"


def test_shards_in_a_subfolder_and_symlinked_shards(src: Path, tmp_path: Path) -> None:
    """Shards the index places in a subfolder, one a symlink out of the checkpoint (as in the
    Hugging Face cache): the copy rewrites them in place, never through the link."""
    index = json.loads((src / writer.INDEX_FILE).read_text())
    (src / "sub").mkdir()
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    for i, name in enumerate(shards):
        if i == 0:
            (src / name).rename(blobs / name)
            (src / "sub" / name).symlink_to(blobs / name)
        else:
            (src / name).rename(src / "sub" / name)
    index["weight_map"] = {k: f"sub/{v}" for k, v in index["weight_map"].items()}
    (src / writer.INDEX_FILE).write_text(json.dumps(index))
    blob_before = _digests(blobs)
    found = discover_scales(src)
    edit, new, _ = _edit(src)
    home = Path(edit.homes[sorted(new)[0]])
    assert home.parent.name == "sub"
    out = tmp_path / "out"
    write_checkpoint_copy(found.path, found.files, found.config, out, edit)
    assert _digests(blobs) == blob_before
    rel = home.relative_to(src).as_posix()
    assert not (out / rel).is_symlink()
    got = {}
    for file in sorted((out / "sub").glob("*.safetensors")):
        with safetensors.safe_open(str(file), framework="pt") as fh:
            got.update({n: f"sub/{file.name}" for n in fh.keys()})
    weight_map = json.loads((out / writer.INDEX_FILE).read_text())["weight_map"]
    assert weight_map == got and set(new) <= set(got)
    assert {r.name for r in discover_scales(out).scales} >= {n for n in new if "scale" in n}


def test_link_false_copies_every_shard(src: Path, tmp_path: Path) -> None:
    found = discover_scales(src)
    out = tmp_path / "out"
    written = write_checkpoint_copy(
        found.path, found.files, found.config, out, _edit(src)[0], link=False
    )
    assert written.linked == ()
    for shard in src.glob("*.safetensors"):
        assert (out / shard.name).stat().st_ino != shard.stat().st_ino


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".kvquant-" in p.name)


@pytest.mark.parametrize("error", [ExportError("check failed"), KeyboardInterrupt()])
@pytest.mark.parametrize("existing", [False, True, "nested"])
def test_a_failed_finish_leaves_nothing(
    src: Path, tmp_path: Path, error: BaseException, existing: bool | str
) -> None:
    found = discover_scales(src)
    before = _digests(src)
    # "nested": the copy's parent folders are new; the failed write removes them too
    out = tmp_path / "new" / "parents" / "out" if existing == "nested" else tmp_path / "out"
    if existing is True:
        out.mkdir()
        (out / "old.txt").write_text("old\n")
    seen: list[Path] = []

    def finish(written: writer.WrittenCheckpoint) -> None:
        seen.append(written.path)
        assert (written.path / "config.json").is_file()  # the copy is complete here
        raise error

    with pytest.raises(type(error)):
        write_checkpoint_copy(
            found.path, found.files, found.config, out, _edit(src)[0], force=True, finish=finish
        )
    assert seen and not seen[0].exists()
    assert _leftovers(tmp_path) == []
    assert _digests(src) == before
    if existing is True:
        assert _digests(out) == {"old.txt": hashlib.sha256(b"old\n").hexdigest()}
    else:
        assert not out.exists() and not (tmp_path / "new").exists()


def test_a_failure_while_rewriting_leaves_nothing(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = discover_scales(src)
    real = writer._rewrite_shard

    def full_disk(source: Path, dst: Path, *args: Any) -> None:
        real(source, dst, *args)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "_rewrite_shard", full_disk)
    with pytest.raises(OSError, match="No space"):
        write_checkpoint_copy(found.path, found.files, found.config, tmp_path / "o", _edit(src)[0])
    assert not (tmp_path / "o").exists() and _leftovers(tmp_path) == []


def test_finish_may_add_files(src: Path, tmp_path: Path) -> None:
    found = discover_scales(src)
    written = write_checkpoint_copy(
        found.path,
        found.files,
        found.config,
        tmp_path / "out",
        _edit(src)[0],
        finish=lambda w: {"report.json": {"files": list(w.rewritten)}},
    )
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert "config.json" in report["files"] and "report.json" in written.rewritten


def _bad_edits(src: Path) -> dict[str, CheckpointEdit]:
    edit = _edit(src)[0]
    name = sorted(edit.tensors)[0]
    return {
        "homeless": CheckpointEdit(tensors={"x.weight": torch.zeros(1)}),
        "home outside": CheckpointEdit(
            tensors={"x.weight": torch.zeros(1)}, homes={"x.weight": src / "other.safetensors"}
        ),
        "clash": CheckpointEdit(
            tensors={"model.norm.weight": torch.zeros(1)},
            homes={"model.norm.weight": edit.homes[name]},
        ),
        "drop absent": CheckpointEdit(drop=["model.layers.9.self_attn.k_scale"]),
        "file config.json": CheckpointEdit(files={"config.json": {}}),
        "file path": CheckpointEdit(files={"../escape.json": {}}),
        "file nan": CheckpointEdit(files={"notes.json": {"x": math.nan}}),
        "sparse": CheckpointEdit(
            tensors={"x.weight": torch.zeros(2).to_sparse()}, homes={"x.weight": edit.homes[name]}
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "homeless",
        "home outside",
        "clash",
        "drop absent",
        "file config.json",
        "file path",
        "file nan",
        "sparse",
    ],
)
def test_bad_edits_are_refused_and_leave_nothing(src: Path, tmp_path: Path, case: str) -> None:
    found = discover_scales(src)
    before = _digests(src)
    out = tmp_path / "out"
    with pytest.raises(ExportError) as info:
        write_checkpoint_copy(found.path, found.files, found.config, out, _bad_edits(src)[case])
    assert isinstance(info.value, KVQuantError) and isinstance(info.value, ValueError)
    assert not out.exists() and _leftovers(tmp_path) == [] and _digests(src) == before
    assert not (tmp_path / "escape.json").exists()


def test_kv_scale_tensors_names_and_shapes() -> None:
    k, v = torch.rand(NUM_KV_HEADS, dtype=torch.bfloat16), torch.rand(NUM_KV_HEADS)
    (k_name, kt), (v_name, vt) = kv_scale_tensors(
        "modelopt", {3: (k.amax(), v.amax())}, (), prefix="model.language_model."
    )[3]
    assert k_name == "model.language_model.layers.3.self_attn.k_proj.k_scale"
    assert v_name == "model.language_model.layers.3.self_attn.v_proj.v_scale"
    assert kt.dtype == vt.dtype == torch.float32 and kt.shape == vt.shape == ()
    assert float(kt) == float(k.amax()) and float(vt) == float(v.amax())
    (_, kh), _ = kv_scale_tensors("compressed-tensors", {0: (k, v)}, (NUM_KV_HEADS, 1, 1))[0]
    assert torch.equal(kh.reshape(-1), k.float())
    with pytest.raises(ExportError, match="scale value"):
        kv_scale_tensors("compressed-tensors", {0: (k, v)}, (1,))


# ---------------------------------------------------------------------------
# calibrate's route through the writer


def _result(granularity: str = "per-head") -> CalibrationResult:
    shape = (NUM_LAYERS, NUM_KV_HEADS) if granularity == "per-head" else (NUM_LAYERS,)
    k, v = torch.rand(shape) + 0.01, torch.rand(shape) + 0.01
    per_layer = NUM_KV_HEADS if granularity == "per-head" else 1
    layers = tuple(
        LayerCalibration(
            layer=i,
            k_ratio=(1.0,) * per_layer,
            v_ratio=(1.0,) * per_layer,
            k_saturation=0.0,
            v_saturation=0.0,
            k_mse_vs_amax=1.0,
            v_mse_vs_amax=1.0,
            k_amax=tuple(float(x) * 448 for x in k[i].reshape(-1)),
            v_amax=tuple(float(x) * 448 for x in v[i].reshape(-1)),
        )
        for i in range(NUM_LAYERS)
    )
    return CalibrationResult(
        granularity=granularity,
        k_scales=k,
        v_scales=v,
        layers=layers,
        num_tokens=64,
        num_kv_heads=NUM_KV_HEADS,
        ratios=(1.0,),
        tolerance=0.0,
        num_samples=1,
    )


def test_calibrate_writes_extra_tensors_and_files(src: Path, tmp_path: Path) -> None:
    (src / "kvquant-export.json").write_text('{"engine": "vllm"}\n')  # describes the source
    result = _result()
    extra = {
        "model.layers.1.self_attn.extra_test_tensor": torch.randn(NUM_KV_HEADS, HEAD_DIM),
        "model.extra_test_tensor": torch.randn(3),
    }
    out = write_calibrated_checkpoint(
        src,
        result,
        tmp_path / "out",
        extra_tensors=extra,
        extra_files={"notes.json": {"layers": NUM_LAYERS}},
    )
    got, where = _tensors(out), _where(out)
    for name, tensor in extra.items():
        assert torch.equal(got[name], tensor), name
    assert (
        where["model.layers.1.self_attn.extra_test_tensor"]
        == where["model.layers.1.self_attn.k_proj.weight"]
    )
    assert where["model.extra_test_tensor"] == where["model.layers.0.self_attn.k_proj.weight"]
    for layer in range(NUM_LAYERS):
        k, v = result.layer_scales(layer)
        stored_k = got[f"model.layers.{layer}.self_attn.k_scale"]
        stored_v = got[f"model.layers.{layer}.self_attn.v_scale"]
        assert torch.equal(stored_k.reshape(-1), k) and torch.equal(stored_v.reshape(-1), v)
    assert json.loads((out / writer.INDEX_FILE).read_text())["weight_map"] == where
    assert json.loads((out / "notes.json").read_text()) == {"layers": NUM_LAYERS}
    meta = json.loads((out / "kvquant-calibration.json").read_text())
    assert meta["granularity"] == "per-head"
    assert not (out / "kvquant-export.json").exists()


@pytest.mark.parametrize(
    ("extra_tensors", "extra_files", "match"),
    [
        ({"model.layers.0.self_attn.k_scale": torch.ones(1)}, None, "KV scale"),
        ({"model.layers.7.self_attn.extra": torch.ones(1)}, None, "layer 7"),
        (None, {"kvquant-calibration.json": {}}, "calibration report"),
    ],
)
def test_calibrate_refuses_clashing_extras(
    src: Path, tmp_path: Path, extra_tensors: Any, extra_files: Any, match: str
) -> None:
    before = _digests(src)
    with pytest.raises(CalibrationError, match=match):
        write_calibrated_checkpoint(
            src, _result(), tmp_path / "out", extra_tensors=extra_tensors, extra_files=extra_files
        )
    assert not (tmp_path / "out").exists() and _digests(src) == before


def test_calibrate_a_failed_check_leaves_nothing(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvquant.export.write as export_write

    def boom(*args: Any) -> None:
        raise ExportError("the copy failed its own check")

    monkeypatch.setattr(export_write, "_verify", boom)
    with pytest.raises(ExportError, match="own check"):
        write_calibrated_checkpoint(src, _result("per-tensor"), tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


# ---------------------------------------------------------------------- the source folder's files


def _special_entries(src: Path, tmp_path: Path) -> dict[str, Path]:
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "big.bin").write_bytes(b"\x00" * 1024)
    return {
        "link to /dev/zero": Path("/dev/zero"),
        "link to a folder outside": outside,
        "broken link": tmp_path / "absent",
    }


@pytest.mark.parametrize(
    "case", ["link to /dev/zero", "fifo", "fifo in a subfolder", "link to a folder outside",
             "broken link"],
)  # fmt: skip
def test_special_files_in_the_source_are_refused_before_writing(
    src: Path, tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The writer reads the source by the readers' rules: regular files and real folders
    only; anything else is a CheckpointError (CLI exit 2) before a byte is written."""
    import os

    from kvquant.cli import main as cli_main
    from kvquant.errors import CheckpointError

    if case.startswith("fifo"):
        if not hasattr(os, "mkfifo"):
            pytest.skip("needs FIFOs")
        os.mkfifo(src / ("extra/pipe" if "subfolder" in case else "tokenizer.model"))
    else:
        (src / "linked").symlink_to(_special_entries(src, tmp_path)[case])
    found = discover_scales(src)
    assert [f.code for f in found.findings if f.code == "uncopyable-file"] == ["uncopyable-file"]
    out = tmp_path / "out" / "nested"
    with pytest.raises(CheckpointError, match="Nothing was written") as info:
        write_checkpoint_copy(found.path, found.files, found.config, out, _edit(src)[0])
    assert isinstance(info.value, KVQuantError)
    assert not (tmp_path / "out").exists()
    code = cli_main(["export", str(src), "--engine", "vllm", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "Nothing was written" in err, err
    assert not (tmp_path / "out").exists()


def test_symlinked_files_are_copied_as_files(src: Path, tmp_path: Path) -> None:
    """A symlink to a regular file (the Hugging Face cache's layout) is copied as the file."""
    outside = tmp_path / "tok.json"
    outside.write_text('{"linked": true}\n')
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(outside)
    found = discover_scales(src)
    out = tmp_path / "out"
    write_checkpoint_copy(found.path, found.files, found.config, out, _edit(src)[0])
    assert not (out / "tokenizer.json").is_symlink()
    assert (out / "tokenizer.json").read_text() == '{"linked": true}\n'
    (out / "tokenizer.json").write_text("edited\n")
    assert outside.read_text() == '{"linked": true}\n'
