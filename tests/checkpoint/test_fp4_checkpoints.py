"""Producers' NVFP4 KV checkpoints: discovery per layer, the registry's canonical global scales,
the doctor's per-layer formats, export's refusal, and every unsupported variant refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from kvquant.checkpoint.discovery import discover_scales
from kvquant.errors import ExportError, ScaleFormatError
from kvquant.export import export_checkpoint
from kvquant.registry.fp4 import resolve_fp4_raws
from kvquant.report import inspect_checkpoint
from kvquant.testing.synthetic_fp4 import default_amax, write_fp4_checkpoint

FORMATS = {
    "modelopt": (("nvfp4", "nvfp4"), ("nvfp4", "nvfp4")),
    "modelopt-mixed": (("fp8", "fp8"), ("nvfp4", "nvfp4")),
    "compressed-tensors": (("nvfp4", "nvfp4"), ("nvfp4", "nvfp4")),
}


@pytest.mark.parametrize("layout", list(FORMATS))
def test_each_layout_resolves_to_the_canonical_global_scale(tmp_path: Path, layout: str) -> None:
    amax = {key: 1.0 + float(torch.rand(())) * 20 for key in default_amax(2)}  # fresh values
    found = discover_scales(write_fp4_checkpoint(tmp_path, layout, amax=amax, weights="none"))
    assert found.kv_formats == FORMATS[layout]
    assert not found.has_errors, found.findings
    fp4 = resolve_fp4_raws(found.producer, found.kv_formats, found.scales, found.geometry)
    nvfp4_layers = [i for i, f in enumerate(FORMATS[layout]) if f == ("nvfp4", "nvfp4")]
    assert sorted(fp4) == nvfp4_layers
    for i in nvfp4_layers:
        for side in ("k", "v"):
            g = getattr(fp4[i], side)
            assert g.value.dtype == torch.float32
            # g = amax / (6 * 448) whichever number the producer stored
            torch.testing.assert_close(
                g.implied_amax, torch.tensor(amax[(i, side)]), rtol=1e-6, atol=0
            )


def test_fp8_k_nvfp4_v_keeps_k_for_the_fp8_scale(tmp_path: Path) -> None:
    root = write_fp4_checkpoint(tmp_path, "modelopt-mixed", layer_formats=[("fp8", "nvfp4")] * 2,
                                weights="none")  # fmt: skip
    found = discover_scales(root)
    assert found.kv_formats == (("fp8", "nvfp4"),) * 2
    side = (root / "hf_quant_config.json").read_text()
    assert '"FP8_K_NVFP4_V"' in side and "MIXED_PRECISION" not in side  # a uniform map
    fp4 = resolve_fp4_raws(found.producer, found.kv_formats, found.scales, found.geometry)
    assert fp4[0].k is None and fp4[0].kv_format == "fp8-k-nvfp4-v"
    torch.testing.assert_close(fp4[1].v.implied_amax, torch.tensor(4.0), rtol=1e-6, atol=0)


def test_doctor_shows_the_format_and_global_scale_per_layer(tmp_path: Path) -> None:
    report = inspect_checkpoint(write_fp4_checkpoint(tmp_path, "modelopt-mixed", weights="none"))
    assert report.ok
    assert report.summary.startswith("would load with fp8/nvfp4 (the checkpoint's per-layer")
    text = report.render()
    assert "4-bit kv:   layer 0: K FP8 (scale below), V FP8 (scale below)" in text
    g = 6.0 / 2688  # layer 1's K amax is 6
    assert f"4-bit kv:   layer 1: K NVFP4 g={g:.4g}" in text
    rows = report.to_dict()["checkpoint_kv_formats"]
    assert rows[1]["k"] == "nvfp4" and rows[1]["k_global_scale"] == pytest.approx([g])


def test_export_refuses_a_4bit_checkpoint(tmp_path: Path) -> None:
    src = write_fp4_checkpoint(tmp_path / "src", "modelopt", weights="none")
    with pytest.raises(ExportError, match=r"declares a 4-bit KV cache .*no engine loader"):
        export_checkpoint(src, tmp_path / "out", engine="vllm")
    assert not (tmp_path / "out").exists()


REFUSED = {
    "affine": ("modelopt", {"hf_quant_updates": {"kv_cache_quant_algo": "NVFP4_AFFINE"}},
               "'NVFP4_AFFINE'; expected one of"),
    "mxfp4-algo": ("modelopt", {"hf_quant_updates": {"kv_cache_quant_algo": "MXFP4"}},
                   "'MXFP4'; expected one of .*MXFP4 KV scales are computed"),
    "mxfp4-scheme": ("compressed-tensors",
                     {"kv_scheme_updates": {"group_size": 32, "scale_dtype": "torch.uint8"}},
                     "MXFP4 block scales are computed when tokens are written"),
    "group": ("compressed-tensors", {"kv_scheme_updates": {"strategy": "group"}},
              "expected NVFP4"),
    "map-leaves-a-layer": (
        "modelopt-mixed",
        {"hf_quant_updates": {"kv_cache_quantized_layers": {
            "model.layers.0.self_attn": {"quant_algo": "NVFP4"}}}},
        r"no entry for layer\(s\) \[1\]"),
    "auto-round": ("compressed-tensors", {"quant_config_updates": {"quant_method": "auto-round"}},
                   "nvfp4-global-scale-undeclared"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_variants_are_refused_by_the_doctor(tmp_path: Path, case: str) -> None:
    layout, options, message = REFUSED[case]
    report = inspect_checkpoint(write_fp4_checkpoint(tmp_path, layout, weights="none", **options))
    assert not report.ok
    text = " ".join([*report.problems, *(f.code for f in report.findings)])
    assert re.search(message, text), text


def test_a_bad_global_scale_names_layer_tensor_and_fix(tmp_path: Path) -> None:
    bad = {(1, "v"): torch.tensor(float("nan"))}
    found = discover_scales(write_fp4_checkpoint(tmp_path, "modelopt", weights="none", scales=bad))
    with pytest.raises(ScaleFormatError) as info:
        resolve_fp4_raws(found.producer, found.kv_formats, found.scales, found.geometry)
    msg = str(info.value)
    assert "model.layers.1.self_attn.v_proj.v_scale" in msg and "expected" in msg and "Fix:" in msg
    report = inspect_checkpoint(found.path)
    assert not report.ok and "4-bit global scales unusable" in report.summary
    assert "v_proj.v_scale: element 0 is nan" in report.render(width=400)


def test_a_missing_global_scale_is_refused(tmp_path: Path) -> None:
    drop = {"model.layers.0.self_attn.k_global_scale"}
    root = write_fp4_checkpoint(tmp_path, "compressed-tensors", weights="none")
    from safetensors.torch import load_file, save_file

    tensors = {k: v for k, v in load_file(str(root / "model.safetensors")).items() if k not in drop}
    save_file(tensors, str(root / "model.safetensors"))
    report = inspect_checkpoint(root)
    assert not report.ok
    assert any("model.layers.0: found none of" in p for p in report.problems), report.problems


def test_kvquant_doctor_prints_the_formats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvquant.cli import main

    root = write_fp4_checkpoint(tmp_path, "compressed-tensors", weights="none")
    assert main(["doctor", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"4-bit kv:   layer 0: K NVFP4 g={3.0 / 2688:.4g}, V NVFP4 g={2.0 / 2688:.4g}" in out
    assert main(["doctor", str(root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["checkpoint_kv_formats"]
    assert [(r["k"], r["v"]) for r in rows] == [("nvfp4", "nvfp4")] * 2


def test_modelopt_config_json_alone_declares_nvfp4(tmp_path: Path) -> None:
    root = write_fp4_checkpoint(tmp_path, "modelopt", weights="none")
    (root / "hf_quant_config.json").unlink()  # config.json's kv_cache_scheme: "NVFP4" remains
    found = discover_scales(root)
    assert found.kv_formats == (("nvfp4", "nvfp4"),) * 2 and not found.has_errors


def test_doctor_with_another_kv_format_says_what_patch_refuses(tmp_path: Path) -> None:
    root = write_fp4_checkpoint(tmp_path, "modelopt-mixed", weights="none")
    assert inspect_checkpoint(root, kv_format="fp8").ok  # the default: the checkpoint's formats
    assert inspect_checkpoint(root, kv_format={0: "fp8", "default": "nvfp4"}).ok
    report = inspect_checkpoint(root, kv_format="nvfp4")
    assert not report.ok
    assert any("kv_format gives layer(s) [0] ['nvfp4']" in p for p in report.problems)


def test_a_mapping_of_global_scales_is_refused() -> None:
    from kvquant.checkpoint.discovery import raw_scales_from_mapping

    name = "model.layers.0.self_attn.k_global_scale"
    with pytest.raises(ScaleFormatError, match="is an NVFP4 KV global scale; expected FP8"):
        raw_scales_from_mapping({name: torch.tensor([900.0])})
