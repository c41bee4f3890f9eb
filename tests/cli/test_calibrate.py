"""kvquant calibrate (kvquant.cli.calibrate): exit codes, data sources, refusals, JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from calibration_models import char_tokenizer, jsonl

pytest.importorskip("transformers")


def test_cli_calibrate_exit_codes(tiny: Any, tmp_path: Path, capsys: Any) -> None:
    from kvquant.cli import main

    _, src = tiny
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    out = tmp_path / "out"
    argv = ["calibrate", str(src), "--out", str(out), "--text", str(text), "--json"]
    assert main([*argv, "--format", "per-head"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["granularity"] == "per-head" and len(payload["layers"]) == 2
    assert main(["doctor", str(out)]) == 0
    capsys.readouterr()
    assert main(argv) == 2  # --out exists
    error = json.loads(capsys.readouterr().out)
    assert error["error"] == "ExportTargetExistsError" and "already exists" in error["message"]
    assert main([*argv, "--force", "--convention", "quark"]) == 0
    capsys.readouterr()
    assert main(["doctor", str(out)]) == 0
    assert main(["calibrate", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    assert main([*argv[:3], str(tmp_path / "y"), "--text", str(tmp_path / "none.txt")]) == 2
    bad = [*argv[:3], str(tmp_path / "z"), "--format", "per-head", "--convention", "modelopt"]
    assert main(bad) == 2
    assert main([*argv[:3], str(tmp_path / "z"), "--max-tokens", "1"]) == 2
    assert not (tmp_path / "x").exists() and not (tmp_path / "z").exists()


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_cli_calibrate_refuses_a_model_with_non_finite_kv(
    tiny_dir: Path, tmp_path: Path, capsys: Any, poison: float
) -> None:
    """A poisoned weight makes K non-finite: refused (exit 1), no scales of NaN/inf written."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kvquant.cli import main

    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    weights = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    row = int(torch.randint(weights[name].shape[0], ()))
    weights[name][row, :] = poison
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8, encoding="utf-8")
    out = tmp_path / "out"
    argv = ["calibrate", str(src), "--out", str(out), "--text", str(text), "--json"]
    assert main([*argv, "--device", "cpu"]) == 1
    error = json.loads(capsys.readouterr().out)
    assert error["error"] == "CalibrationError" and "non-finite K/V" in error["message"]
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "src"]


def test_cli_calibrate_needs_a_data_source(tiny: Any, tmp_path: Path, capsys: Any) -> None:
    from kvquant.cli import main

    _, src = tiny
    out = tmp_path / "out"
    assert main(["calibrate", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no calibration data" in err and "--dataset" in err and "--text" in err
    assert main(["calibrate", str(src), "--out", str(out), "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["error"] == "CalibrationError" and data["exit_code"] == 2
    if not torch.cuda.is_available():
        text = tmp_path / "t.txt"
        text.write_text("some calibration text " * 20, encoding="utf-8")
        argv = ["calibrate", str(src), "--out", str(out), "--text", str(text)]
        assert main([*argv, "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err
    assert not out.exists()


def test_cli_calibrate_on_a_dataset_writes_what_it_did(
    tiny: Any, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("datasets")
    from kvquant.cli import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    _, src = tiny
    data = jsonl(tmp_path / "d.jsonl", ["The quick brown fox jumps over the lazy dog. " * 8] * 9)
    out = tmp_path / "out"
    argv = ["calibrate", str(src / "config.json"), "--out", str(out), "--dataset", str(data)]
    argv += ["--num-samples", "5", "--max-seq-length", "100", "--device", "cpu"]
    assert main([*argv, "--dtype", "bfloat16"]) == 0
    captured = capsys.readouterr()
    flat = " ".join(captured.out.split())  # the report wraps at 100 columns
    # the last sample (a quarter at most) is held out to measure the candidate formats
    assert f"dataset {data}, split train, column text: 4 samples, 400 tokens" in flat
    assert "(and 1 sample, 100 tokens held out for the comparison below)" in flat
    assert "clipping search" in flat
    assert "calibrating" in captured.err and "writing out" in captured.err  # progress bars
    lines = [line for line in captured.out.splitlines() if str(tmp_path) not in line]
    assert max(len(line) for line in lines) <= 100
    meta = json.loads((out / "kvquant-calibration.json").read_text())
    assert (meta["num_samples"], meta["num_tokens"]) == (4, 400)
    assert meta["report"]["held_out_tokens"] == 100 and meta["report"]["written_format"] == (
        "per-tensor"
    )
    assert meta["observer"] == "mse" and meta["format"] == "per-tensor"
    assert meta["convention"] == "compressed-tensors" and meta["texts"] == [
        f"dataset {data}, split train, column text"
    ]
    scheme = json.loads((out / "config.json").read_text())["quantization_config"]
    assert scheme["kv_cache_scheme"]["observer"] == "mse"
    for f in src.iterdir():  # copies, never hard links, of every file
        if (out / f.name).is_file():
            assert (out / f.name).stat().st_ino != f.stat().st_ino, f.name
    assert main(["doctor", str(out)]) == 0
    # placement through transformers' device_map (accelerate), the model's own dtype
    pytest.importorskip("accelerate")
    mapped = [*argv[:-2], "--device-map", "cpu", "--dtype", "auto", "--force", "--json"]
    capsys.readouterr()
    assert main(mapped) == 0
    assert json.loads(capsys.readouterr().out)["num_samples"] == 4


def test_cli_calibrate_refuses_unsupported_family(tmp_path: Path, capsys: Any) -> None:
    from transformers import OlmoConfig, OlmoForCausalLM

    from kvquant.cli import main

    cfg = OlmoConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    src = tmp_path / "olmo"
    OlmoForCausalLM(cfg).save_pretrained(src)
    char_tokenizer(src)
    text = tmp_path / "t.txt"
    text.write_text("abc " * 100, encoding="utf-8")
    code = main(["calibrate", str(src), "--out", str(tmp_path / "o"), "--text", str(text)])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert "refused" in captured.err and "olmo" in captured.err
    assert not (tmp_path / "o").exists()


def test_cli_refuses_a_checkpoint_without_a_tokenizer_before_loading_the_model(
    tiny: Any, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    from kvquant.cli import main
    from kvquant.testing.checkpoints import write_checkpoint

    src = write_checkpoint(tmp_path / "demo", convention="modelopt")  # no tokenizer files
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox. " * 40, encoding="utf-8")

    def loaded(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)
    argv = ["calibrate", str(src), "--out", str(tmp_path / "out"), "--text", str(text)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer" in err and "Fix: copy the tokenizer files" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    assert main([*argv, "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"] == "CalibrationError"


def test_cli_json_of_the_report(tiny_kt: Any, tmp_path: Path, capsys: Any) -> None:
    from kvquant.cli import main

    _, src = tiny_kt
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    argv = ["calibrate", str(src), "--text", str(text), "--max-seq-length", "200"]
    argv += ["--device", "cpu", "--format", "k-transform", "--json"]
    bad = [*argv, "--out", str(tmp_path / "bad"), "--convention", "compressed-tensors"]
    assert main(bad) == 2
    err = json.loads(capsys.readouterr().out)
    assert "kvquant's own convention" in err["message"] and not (tmp_path / "bad").exists()
    assert main([*argv, "--out", str(tmp_path / "o"), "--rotation", "none"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["convention"] == "kvquant" and payload["granularity"] == "k-transform"
    assert payload["rotation"] is None and payload["first_tokens"] == 1
    report = payload["report"]
    assert report["written_format"] == "k-transform (offset only, first tokens)"
    assert set(report["scores"]) >= {"per-tensor", "per-head", "fp32-group G=32"}
    assert report["recommendation"].startswith("Written: k-transform, no rotation scales")
    assert report["read_by"]["per-head"] == "kvquant, vLLM"
    first = report["layers"][0]
    assert len(first["k_clip"]) == 2 and len(first["near_constant_energy"]) == 2
    assert all(len(v) == 2 for v in first["error"].values())
    saved = json.loads((tmp_path / "o" / "kvquant-calibration.json").read_text())
    assert saved["report"]["scores"] == report["scores"]
    # the table form carries the same report
    assert main([*argv[:-1], "--out", str(tmp_path / "p"), "--first-tokens", "0"]) == 0
    out = capsys.readouterr().out
    assert "How each format does on" in out and "k-transform, no exact first token" in out
    assert "read by kvquant" in out.splitlines()[-1]
    assert (
        json.loads((tmp_path / "p" / "kvquant_kv_transform.json").read_text())["first_tokens"] == 0
    )


def test_cli_kv_budget_prints_a_per_layer_map(tiny_kt: Any, tmp_path: Path, capsys: Any) -> None:
    """--kv-budget: the map with its reasons and kv_format= in text and JSON; bad budgets are
    usage errors (exit 2) before anything is written; the k-transform measures FP8 K (in its
    frame) + NVFP4 V among the per-layer formats."""
    from kvquant.choices import layer_kv_formats
    from kvquant.cli import main

    _, src = tiny_kt
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    argv = ["calibrate", str(src), "--text", str(text), "--max-seq-length", "200"]
    argv += ["--device", "cpu"]
    for budget, match in (("0", "expected a number in (0, 1]"), ("1.2", "widest map"),
                          ("0.5", "head_dim 64 takes 0.5312 of FP8's KV bytes")):  # fmt: skip
        assert main([*argv, "--out", str(tmp_path / "bad"), "--kv-budget", budget]) == 2
        assert match in capsys.readouterr().err
    bad = [*argv, "--out", str(tmp_path / "bad"), "--kv-budget", "0.7", "--held-out-tokens", "0"]
    assert main(bad) == 2 and "--held-out-tokens 0" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    assert main([*argv, "--out", str(tmp_path / "o"), "--kv-budget", "0.8"]) == 0
    out = capsys.readouterr().out
    assert "Per-layer K/V formats for a budget of 0.8 of FP8's KV bytes" in out
    assert "kvquant.patch(model, kv_format={" in out and "recorded in kvquant-calibration" in out
    assert "NVFP4 (4-bit K and V)" in out  # the report measured the 4-bit formats
    argv += ["--format", "k-transform", "--json", "--kv-budget", "0.6"]
    assert main([*argv, "--out", str(tmp_path / "j")]) == 0
    payload = json.loads(capsys.readouterr().out)
    proposal = payload["kv_format_map"]
    assert proposal["fp8_scheme"] == "k-transform" and proposal["fraction_of_fp8"] <= 0.6
    assert not any(note.startswith("fp8-k-nvfp4-v") for note in proposal["notes"])
    assert all("fp8-k-nvfp4-v" in lay["errors"] for lay in proposal["layers"])  # measured
    formats = layer_kv_formats(proposal["kv_format"], 2, "test")
    assert list(formats) == [lay["kv_format"] for lay in proposal["layers"]]
    assert all(lay["reason"] for lay in proposal["layers"])
    saved = json.loads((tmp_path / "j" / "kvquant-calibration.json").read_text())
    assert saved["kv_format_map"]["kv_format"] == proposal["kv_format"]
