"""kvquant.calibrate.writing: written checkpoints load, refusals, configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from calibration_models import load_tokenizer

from kvquant.calibrate import (
    calibrate,
    write_calibrated_checkpoint,
)
from kvquant.errors import CalibrationError
from kvquant.export import ExportTargetExistsError

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("granularity", "convention"),
    [
        ("per-tensor", "compressed-tensors"),
        ("per-head", "compressed-tensors"),
        ("per-tensor", "modelopt"),
        ("per-tensor", "quark"),
    ],
)
def test_written_checkpoint_passes_doctor_and_loads_via_patch(
    tiny: Any, tmp_path: Path, granularity: str, convention: str
) -> None:
    import kvquant
    from kvquant.report import inspect_checkpoint

    model, src = tiny
    text = "Licensed under the Apache License, Version 2.0 (the License). " * 40
    tokenizer = load_tokenizer(src)
    result = calibrate(model, text, granularity=granularity, tokenizer=tokenizer, progress=False)
    expect_shape = (2,) if granularity == "per-tensor" else (2, 2)
    assert tuple(result.k_scales.shape) == expect_shape and result.k_scales.dtype == torch.float32
    out = write_calibrated_checkpoint(src, result, tmp_path / "out", convention)
    report = inspect_checkpoint(out)
    assert report.exit_code == 0, report.render()
    assert json.loads((out / "kvquant-calibration.json").read_text())["granularity"] == granularity
    handle = kvquant.patch(model, scales=out, backend="torch")
    try:
        for i, layer in enumerate(handle.scales.layers):
            k, v = result.layer_scales(i)
            torch.testing.assert_close(layer.k, k, rtol=0, atol=0)
            torch.testing.assert_close(layer.v, v, rtol=0, atol=0)
        ids = torch.randint(0, 128, (1, 12))
        logits = model(input_ids=ids).logits
        assert torch.isfinite(logits).all()
    finally:
        handle.remove()
    # the source is untouched
    assert not (src / "kvquant-calibration.json").exists()


def test_write_refuses_bad_requests(tiny: Any, tmp_path: Path) -> None:
    from kvquant.testing.checkpoints import write_checkpoint

    model, src = tiny
    ids = torch.randint(0, 128, (1, 64))
    per_head = calibrate(model, ids, granularity="per-head", progress=False)
    with pytest.raises(CalibrationError, match="per-head"):
        write_calibrated_checkpoint(src, per_head, tmp_path / "a", "modelopt")
    with pytest.raises(CalibrationError, match="convention"):
        write_calibrated_checkpoint(src, per_head, tmp_path / "a", "tensorrt")
    other = write_checkpoint(tmp_path / "other", convention="none", num_layers=3, weights="none")
    with pytest.raises(CalibrationError, match="3 layers"):
        write_calibrated_checkpoint(other, per_head, tmp_path / "b")
    (tmp_path / "exists").mkdir()
    with pytest.raises(ExportTargetExistsError):
        write_calibrated_checkpoint(src, per_head, tmp_path / "exists")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists", "other"]
    with pytest.raises(CalibrationError, match="tokenizer"):
        calibrate(model, "some text", progress=False)
    with pytest.raises(CalibrationError, match="vocab_size"):
        calibrate(model, torch.tensor([5, 500, 7]), progress=False)
    with pytest.raises(CalibrationError, match="-100 is negative"):  # labels-style padding
        calibrate(model, torch.tensor([[5, 6, 7], [8, 9, -100]]), progress=False)


def test_observer_names_what_was_done(tiny: Any, tmp_path: Path) -> None:
    model, src = tiny
    ids = torch.randint(0, 128, (1, 200))
    amax_only = calibrate(model, ids, ratios=(1.0,), progress=False)
    searched = calibrate(model, ids, progress=False)
    assert (amax_only.observer, searched.observer) == ("minmax", "mse")
    out = write_calibrated_checkpoint(src, amax_only, tmp_path / "a")
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["kv_cache_scheme"]["observer"] == "minmax"
    meta = json.loads((out / "kvquant-calibration.json").read_text())
    assert meta["method"].startswith("scale = amax / 448")
    quark = write_calibrated_checkpoint(src, searched, tmp_path / "q", "quark")
    qcfg = json.loads((quark / "config.json").read_text())["quantization_config"]
    observers = {
        e["output_tensors"]["observer_cls"] for e in qcfg["kv_cache_quant_config"].values()
    }
    assert observers == {"PerTensorMSEObserver"}


@pytest.mark.parametrize("granularity", ["per-tensor", "per-head"])
@pytest.mark.parametrize("observer", ["minmax", "mse"])
def test_compressed_tensors_types_agree_with_the_hand_written_dict(
    granularity: str, observer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from kvquant import export

    ct = pytest.importorskip("compressed_tensors.quantization")
    built = export.compressed_tensors_config(granularity, observer=observer, version="0.20.1")
    monkeypatch.setitem(sys.modules, "compressed_tensors.quantization", None)
    hand = export.compressed_tensors_config(granularity, observer=observer, version="0.20.1")
    monkeypatch.undo()
    assert hand != built  # the fallback really ran without the library
    assert hand["kv_cache_scheme"]["observer"] == observer
    assert hand["kv_cache_scheme"]["strategy"] == built["kv_cache_scheme"]["strategy"]
    normalised = ct.QuantizationConfig.model_validate(hand).model_dump(mode="json")
    assert {**normalised, "version": "0.20.1"} == built
    scheme = ct.QuantizationArgs.model_validate(hand["kv_cache_scheme"]).model_dump(mode="json")
    assert scheme == built["kv_cache_scheme"]


def test_written_k_transform_checkpoint_loads(tiny_kt: Any, tmp_path: Path) -> None:
    import kvquant
    from kvquant.checkpoint.discovery import discover_scales

    model, src = tiny_kt
    ids = torch.randint(0, 128, (1, 2 * 96))
    res = calibrate(model, ids, window=96, granularity="k-transform", progress=False)
    with pytest.raises(CalibrationError, match="kvquant's own convention"):
        write_calibrated_checkpoint(src, res, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()
    out = write_calibrated_checkpoint(src, res, tmp_path / "kt", "kvquant")
    settings = json.loads((out / "kvquant_kv_transform.json").read_text())
    assert settings == {
        "format": "k-transform",
        "version": 1,
        "rotation": "hadamard",
        "first_tokens": 1,
        "head_dim": 64,
        "num_kv_heads": 2,
        "num_layers": 2,
    }
    found = discover_scales(out)
    assert found.producer == "kvquant" and found.k_transform is not None
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    for i in range(2):
        assert torch.equal(tensors[f"model.layers.{i}.self_attn.k_offset"], res.k_offset[i])
        assert torch.equal(tensors[f"model.layers.{i}.self_attn.k_scale"], res.k_scales[i])
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    meta = json.loads((out / "kvquant-calibration.json").read_text())
    assert meta["format"] == "k-transform" and meta["convention"] == "kvquant"
    # the per-head result cannot go into kvquant's convention; a k-transform source is refused
    head = calibrate(model, ids, window=96, granularity="per-head", progress=False)
    with pytest.raises(CalibrationError, match="holds only the k-transform"):
        write_calibrated_checkpoint(src, head, tmp_path / "x", "kvquant")
    with pytest.raises(CalibrationError, match="already carries a k-transform"):
        write_calibrated_checkpoint(out, head, tmp_path / "y")
    handle = kvquant.patch(model, scales=out, backend="torch")
    try:
        assert handle.scales.granularity == "k-transform"
        with torch.no_grad():
            logits = model(input_ids=ids[:, :40]).logits
        assert torch.isfinite(logits).all()
    finally:
        handle.remove()
