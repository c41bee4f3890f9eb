"""Tests for ``kvquant export`` (the kvquant.export package and the CLI subcommand).

The engines' loader rules are encoded here independently of kvquant/export.py
(see docs/export.md for their sources): expected tensor names, shapes, dtype
fp32 and config keys per engine; every export is also re-read by discovery and
by ``kvquant doctor`` (exit 0), and the weights are compared byte for byte.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch

import kvquant.export.write as export_write
from kvquant.checkpoint.discovery import discover_scales
from kvquant.cli import main
from kvquant.errors import KVQuantError, ScaleFormatError
from kvquant.export import ExportError, ExportTargetExistsError, export_checkpoint
from kvquant.testing.checkpoints import write_checkpoint

NUM_LAYERS = 2
NUM_KV_HEADS = 2

# ---------------------------------------------------------------------------
# the engines' rules, written down independently of the implementation

CT_NAMES = ("model.layers.{n}.self_attn.k_scale", "model.layers.{n}.self_attn.v_scale")
MODELOPT_NAMES = (
    "model.layers.{n}.self_attn.k_proj.k_scale",
    "model.layers.{n}.self_attn.v_proj.v_scale",
)
SHAPES: dict[tuple[str, str], tuple[int, ...]] = {
    ("vllm", "per-tensor"): (1,),  # vLLM docs: q/k/v_scale = [1]
    ("vllm", "per-head"): (NUM_KV_HEADS, 1, 1),  # compressed-tensors attn_head
    ("sglang", "per-tensor"): (),  # 0-dim fp32 parameters, per-tensor only
    ("tensorrt-llm", "per-tensor"): (),  # read with reshape([]) under k_proj / v_proj
}
KV_ONLY_SOURCES: dict[str, dict[str, Any]] = {
    "ct": {"convention": "compressed-tensors"},
    "ct-head": {"convention": "compressed-tensors", "granularity": "per-head"},
    "modelopt": {"convention": "modelopt"},
    "quark": {"convention": "quark"},
    "quark-post": {"convention": "quark", "post_rope": True},
    "quark-fp8": {"convention": "quark-fp8"},
    "legacy": {"convention": "legacy-kv_scale"},
}
COMBOS = [("vllm", "per-tensor"), ("vllm", "per-head"), ("sglang", "per-tensor")]


def _header(file: Path) -> dict[str, Any]:
    with file.open("rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        data: dict[str, Any] = json.loads(fh.read(n))
    data.pop("__metadata__", None)
    return data


def _all_headers(root: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for file in sorted(root.glob("*.safetensors")):
        for name, entry in _header(file).items():
            out[name] = (file.name, entry)
    return out


def _tensor(root: Path, file: str, name: str) -> torch.Tensor:
    with safetensors.safe_open(str(root / file), framework="pt", device="cpu") as fh:
        return fh.get_tensor(name)


def _is_kv_scale(name: str) -> bool:
    return name.endswith(
        (".k_scale", ".v_scale", ".kv_scale", "k_proj.output_scale", "v_proj.output_scale")
    )


def _check_engine_rules(
    out: Path, engine: str, granularity: str, convention: str
) -> dict[str, torch.Tensor]:
    """Assert the output follows the engine's rules; return {name: tensor} of the KV scales."""
    headers = _all_headers(out)
    names = CT_NAMES if convention == "compressed-tensors" else MODELOPT_NAMES
    expected = {t.format(n=n) for n in range(NUM_LAYERS) for t in names}
    found = {n for n in headers if _is_kv_scale(n)}
    assert found == expected
    shape = SHAPES[(engine, granularity)]
    tensors = {}
    for name in expected:
        file, entry = headers[name]
        assert entry["dtype"] == "F32", name
        assert tuple(entry["shape"]) == shape, name
        tensors[name] = _tensor(out, file, name)
        assert tensors[name].dtype == torch.float32
        assert torch.isfinite(tensors[name]).all() and (tensors[name] > 0).all()
    config = json.loads((out / "config.json").read_text())
    qcfg = config["quantization_config"]
    if convention == "compressed-tensors":
        assert qcfg["quant_method"] == "compressed-tensors"
        scheme = qcfg["kv_cache_scheme"]
        assert scheme["num_bits"] == 8 and scheme["type"] == "float"
        assert scheme["dynamic"] is False and scheme["symmetric"] is True
        assert scheme["strategy"] == ("attn_head" if granularity == "per-head" else "tensor")
        assert not (out / "hf_quant_config.json").exists()
    else:
        assert qcfg["quant_method"] == "modelopt"
        hf_quant = json.loads((out / "hf_quant_config.json").read_text())
        assert hf_quant["quantization"]["kv_cache_quant_algo"] == "FP8"
        assert hf_quant["quantization"]["quant_algo"] == "FP8"
    # index consistent with the shards
    index = out / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        assert data["weight_map"] == {n: f for n, (f, _) in headers.items()}
        sizes = {
            "F32": 4,
            "BF16": 2,
            "F16": 2,
            "F8_E4M3": 1,
        }
        total = sum(sizes[e["dtype"]] * math.prod(e["shape"]) for _, e in headers.values())
        assert data["metadata"]["total_size"] == total
    assert main(["doctor", str(out)]) == 0
    assert discover_scales(out).producer == convention
    return tensors


def _raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _check_weights_identical(src: Path, out: Path) -> None:
    src_h = _all_headers(src)
    out_h = _all_headers(out)
    weights = [n for n in src_h if not _is_kv_scale(n)]
    assert weights and set(weights) == {n for n in out_h if not _is_kv_scale(n)}
    for name in weights:
        a = _tensor(src, src_h[name][0], name)
        b = _tensor(out, out_h[name][0], name)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert _raw_bytes(a) == _raw_bytes(b), name


# ---------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def random_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random Llama checkpoints (real weights), built once per module."""
    root = tmp_path_factory.mktemp("src")
    return {
        "modelopt-fp8": write_checkpoint(
            root / "modelopt-fp8", convention="modelopt", fp8_weights=True, shards=6
        ),
        "ct": write_checkpoint(root / "ct", convention="compressed-tensors", shards=3),
        "quark": write_checkpoint(root / "quark", convention="quark"),
    }


# ---------------------------------------------------------------------------
# every producer convention x every engine


@pytest.mark.parametrize("engine,granularity", COMBOS)
@pytest.mark.parametrize("source", sorted(KV_ONLY_SOURCES))
def test_kv_only_sources_follow_engine_rules(
    tmp_path: Path, source: str, engine: str, granularity: str
) -> None:
    src = write_checkpoint(tmp_path / "src", weights="none", **KV_ONLY_SOURCES[source])
    out = tmp_path / "out"
    report = export_checkpoint(src, out, engine=engine, granularity=granularity)
    assert report.target_convention == "compressed-tensors"
    tensors = _check_engine_rules(out, engine, granularity, "compressed-tensors")
    # K and V are separate tensors, never one shared name
    for n in range(NUM_LAYERS):
        assert CT_NAMES[0].format(n=n) in tensors and CT_NAMES[1].format(n=n) in tensors
    assert json.loads((out / "kvquant-export.json").read_text())["engine"] == engine


def test_kv_only_sources_refused_for_tensorrt_llm(tmp_path: Path) -> None:
    for key, options in KV_ONLY_SOURCES.items():
        src = write_checkpoint(tmp_path / key, weights="none", **options)
        with pytest.raises(ExportError, match="quant_algo"):
            export_checkpoint(src, tmp_path / f"{key}-out", engine="tensorrt-llm")
        assert not (tmp_path / f"{key}-out").exists()


@pytest.mark.parametrize("engine", ["vllm", "sglang", "tensorrt-llm"])
def test_modelopt_fp8_weights_keep_modelopt(
    tmp_path: Path, random_sources: dict[str, Path], engine: str
) -> None:
    src = random_sources["modelopt-fp8"]
    out = tmp_path / "out"
    report = export_checkpoint(src, out, engine=engine)
    assert report.target_convention == "modelopt"
    _check_engine_rules(out, engine, "per-tensor", "modelopt")
    _check_weights_identical(src, out)
    # shards without KV scales are hard links of the source, byte-identical
    assert report.linked_files
    for name in report.linked_files:
        assert (out / name).read_bytes() == (src / name).read_bytes()
        assert os.stat(out / name).st_ino == os.stat(src / name).st_ino
    shard_names = {p.name for p in src.glob("*.safetensors")}
    assert shard_names & set(report.linked_files)  # some weight shard was not rewritten
    assert shard_names & set(report.rewritten_files)


def test_modelopt_fp8_weights_per_head_refused(
    tmp_path: Path, random_sources: dict[str, Path]
) -> None:
    with pytest.raises(ExportError, match="per-head"):
        export_checkpoint(
            random_sources["modelopt-fp8"], tmp_path / "o", engine="vllm", granularity="per-head"
        )
    assert not (tmp_path / "o").exists()


def test_copy_instead_of_link(tmp_path: Path, random_sources: dict[str, Path]) -> None:
    src = random_sources["modelopt-fp8"]
    report = export_checkpoint(src, tmp_path / "o", engine="sglang", link=False)
    assert not report.linked_files and report.copied_files
    for name in report.copied_files:
        assert (tmp_path / "o" / name).read_bytes() == (src / name).read_bytes()
        assert os.stat(tmp_path / "o" / name).st_ino != os.stat(src / name).st_ino


@pytest.mark.parametrize("engine,granularity", COMBOS)
def test_real_weights_byte_identical(
    tmp_path: Path, random_sources: dict[str, Path], engine: str, granularity: str
) -> None:
    for key in ("ct", "quark"):
        out = tmp_path / key
        export_checkpoint(random_sources[key], out, engine=engine, granularity=granularity)
        _check_engine_rules(out, engine, granularity, "compressed-tensors")
        _check_weights_identical(random_sources[key], out)
        # the tokenizer-free tiny checkpoint has nothing else; the source is untouched
        assert discover_scales(random_sources[key]).producer == (
            "compressed-tensors" if key == "ct" else "quark"
        )


# ---------------------------------------------------------------------------
# values and their conversions


def _bf16(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.bfloat16).float())


def test_per_head_reduced_with_max_and_cost_reported(tmp_path: Path) -> None:
    src = write_checkpoint(
        tmp_path / "src", convention="compressed-tensors", granularity="per-head", weights="none"
    )
    report = export_checkpoint(src, tmp_path / "o", engine="sglang")
    for n, layer in enumerate(report.layers):
        heads_k = [_bf16(0.02 * (n + 1) + 0.001 * h) for h in range(NUM_KV_HEADS)]
        heads_v = [_bf16(0.01 * (n + 1) + 0.001 * h) for h in range(NUM_KV_HEADS)]
        assert layer.k == pytest.approx((max(heads_k),), rel=1e-6)
        assert layer.v == pytest.approx((max(heads_v),), rel=1e-6)
        assert layer.k_ratio == pytest.approx(max(heads_k) / min(heads_k), rel=1e-6)
        assert layer.v_ratio == pytest.approx(max(heads_v) / min(heads_v), rel=1e-6)
    assert report.reduced and report.max_reduction_ratio > 1.0
    assert any("max/min ratio per layer" in n for n in report.notes)
    assert "cost:" in report.render()
    # vLLM per-head keeps every head
    report = export_checkpoint(src, tmp_path / "h", engine="vllm", granularity="per-head")
    assert not report.reduced
    k0 = [_bf16(0.02 + 0.001 * h) for h in range(NUM_KV_HEADS)]
    assert report.layers[0].k == pytest.approx(tuple(k0), rel=1e-6)


def test_per_tensor_broadcast_for_vllm_per_head(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", convention="modelopt", weights="none")
    report = export_checkpoint(src, tmp_path / "o", engine="vllm", granularity="per-head")
    assert report.layers[1].k == pytest.approx((0.04,) * NUM_KV_HEADS, rel=1e-6)
    assert any("broadcast" in n for n in report.notes)


def test_legacy_kv_scale_split_into_k_and_v(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", convention="legacy-kv_scale", weights="none")
    report = export_checkpoint(src, tmp_path / "o", engine="vllm")
    for n, layer in enumerate(report.layers):
        assert layer.k == layer.v == pytest.approx((0.02 * (n + 1),), rel=1e-6)
    assert any("kv_scale split" in n for n in report.notes)


@pytest.mark.parametrize("rope_policy", ["widen", "keep"])
def test_quark_pre_rope_follows_rope_policy(tmp_path: Path, rope_policy: str) -> None:
    src = write_checkpoint(tmp_path / "src", convention="quark", weights="none")
    report = export_checkpoint(src, tmp_path / "o", engine="sglang", rope_policy=rope_policy)
    for n, layer in enumerate(report.layers):
        merged = _bf16(max(0.02, 0.01) * (n + 1))
        factor = math.sqrt(2.0) if rope_policy == "widen" else 1.0
        assert layer.k == pytest.approx((merged * factor,), rel=1e-6)
        assert layer.v == pytest.approx((merged,), rel=1e-6)
    if rope_policy == "keep":
        assert any("saturate" in w for w in report.warnings)
    else:
        assert not report.warnings
        assert any("sqrt(2)" in n for n in report.notes)


def test_quark_post_rope_not_widened(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", convention="quark", post_rope=True, weights="none")
    report = export_checkpoint(src, tmp_path / "o", engine="vllm")
    assert report.layers[0].k == pytest.approx((_bf16(0.02),), rel=1e-6)
    assert report.layers[0].v == pytest.approx((_bf16(0.01),), rel=1e-6)


# ---------------------------------------------------------------------------
# refusals and atomicity


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if "kvquant-" in p.name)


def test_no_static_scales_refused(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", convention="none", weights="none")
    with pytest.raises(ExportError, match="kvquant calibrate") as info:
        export_checkpoint(src, tmp_path / "o", engine="vllm")
    assert isinstance(info.value, KVQuantError)
    assert not (tmp_path / "o").exists() and not _leftovers(tmp_path)


def test_bad_scales_raise_registry_error_and_write_nothing(tmp_path: Path) -> None:
    src = write_checkpoint(
        tmp_path / "src",
        convention="compressed-tensors",
        weights="none",
        scales={(1, "v"): torch.tensor([float("nan")], dtype=torch.bfloat16)},
    )
    with pytest.raises(ScaleFormatError, match=r"model\.layers\.1\.self_attn\.v_scale"):
        export_checkpoint(src, tmp_path / "o", engine="vllm")
    assert not (tmp_path / "o").exists() and not _leftovers(tmp_path)


def test_checkpoint_level_errors_refused(tmp_path: Path) -> None:
    src = write_checkpoint(
        tmp_path / "src",
        convention="compressed-tensors",
        weights="none",
        extra_tensors={"model.layers.0.self_attn.k_zero_point": torch.zeros(1)},
    )
    with pytest.raises(ExportError, match="kv-zero-points"):
        export_checkpoint(src, tmp_path / "o", engine="sglang")


def test_engine_and_granularity_refusals(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", convention="modelopt", weights="none")
    with pytest.raises(ExportError, match="per-tensor KV scales only"):
        export_checkpoint(src, tmp_path / "o", engine="sglang", granularity="per-head")
    with pytest.raises(ExportError, match="expected one of"):
        export_checkpoint(src, tmp_path / "o", engine="tgi")
    with pytest.raises(ExportError, match="inside it"):
        export_checkpoint(src, src / "sub", engine="vllm")
    assert not (tmp_path / "o").exists()


def test_existing_output_refused_unless_force(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", convention="modelopt", weights="none")
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(ExportTargetExistsError, match="--force"):
        export_checkpoint(src, out, engine="vllm")
    assert (out / "keep.txt").read_text() == "old"
    export_checkpoint(src, out, engine="vllm", force=True)
    assert not (out / "keep.txt").exists()
    _check_engine_rules(out, "vllm", "per-tensor", "compressed-tensors")
    assert not _leftovers(tmp_path)


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_checkpoint(tmp_path / "src", convention="modelopt", weights="none")
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("old")

    def boom(*args: object, **kwargs: object) -> None:
        raise ExportError("simulated failure")

    monkeypatch.setattr(export_write, "_verify", boom)
    with pytest.raises(ExportError, match="simulated"):
        export_checkpoint(src, tmp_path / "new", engine="vllm")
    with pytest.raises(ExportError, match="simulated"):
        export_checkpoint(src, out, engine="vllm", force=True)
    assert not (tmp_path / "new").exists()
    assert (out / "keep.txt").read_text() == "old"
    assert not _leftovers(tmp_path)


# ---------------------------------------------------------------------------
# CLI


def test_cli_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_checkpoint(
        tmp_path / "src", convention="compressed-tensors", granularity="per-head", weights="none"
    )
    assert main(["export", str(src), "--engine", "sglang", "--out", str(tmp_path / "a")]) == 0
    text = capsys.readouterr().out
    assert "max/min" in text and "K tensors:  model.layers.N.self_attn.k_scale" in text
    assert max(len(line) for line in text.splitlines() if str(tmp_path) not in line) <= 100
    argv = ["export", str(src), "--engine", "vllm", "--per-head", "--json"]
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["granularity"] == "per-head" and data["layers"][0]["shape"] == [2, 1, 1]
    _check_engine_rules(tmp_path / "b", "vllm", "per-head", "compressed-tensors")
    # refused (nothing written): 1; existing output or not a checkpoint: 2
    capsys.readouterr()
    assert main(["export", str(src), "--engine", "tensorrt-llm", "--out", str(tmp_path / "c")]) == 1
    assert "refused" in capsys.readouterr().err and not (tmp_path / "c").exists()
    assert main(["export", str(src), "--engine", "vllm", "--out", str(tmp_path / "a")]) == 2
    assert "--force" in capsys.readouterr().err
    argv = ["export", str(src), "--engine", "vllm", "--out", str(tmp_path / "a"), "--force"]
    assert main(argv) == 0
    assert main(["export", str(tmp_path / "nope"), "--engine", "vllm", "--out", "x"]) == 2
    assert main(["export", str(src), "--engine", "tgi", "--out", str(tmp_path / "d")]) == 2


# ---------------------------------------------------------------------------
# weight-quantized sources and config placement


def test_compressed_tensors_weight_config_is_kept(tmp_path: Path) -> None:
    groups = {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
        }
    }
    src = write_checkpoint(
        tmp_path / "src",
        convention="compressed-tensors",
        granularity="per-head",
        weights="none",
        quant_config_updates={"config_groups": groups, "format": "float-quantized"},
    )
    report = export_checkpoint(src, tmp_path / "o", engine="vllm", granularity="per-head")
    assert report.target_convention == "compressed-tensors"
    qcfg = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    assert qcfg["config_groups"] == groups and qcfg["format"] == "float-quantized"
    _check_engine_rules(tmp_path / "o", "vllm", "per-head", "compressed-tensors")
    with pytest.raises(ExportError, match="TensorRT-LLM"):
        export_checkpoint(src, tmp_path / "t", engine="tensorrt-llm")


def test_quark_weight_quantization_refused(tmp_path: Path) -> None:
    src = write_checkpoint(
        tmp_path / "src",
        convention="quark",
        weights="none",
        quant_config_updates={
            "global_quant_config": {"weight": {"dtype": "fp8_e4m3", "qscheme": "per_tensor"}}
        },
    )
    for engine in ("vllm", "sglang"):
        with pytest.raises(ExportError, match="quark"):
            export_checkpoint(src, tmp_path / engine, engine=engine)
        assert not (tmp_path / engine).exists()


def test_multimodal_config(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", convention="modelopt", weights="none", multimodal=True)
    export_checkpoint(src, tmp_path / "o", engine="sglang")
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert config["model_type"] == "llava" and "text_config" in config
    _check_engine_rules(tmp_path / "o", "sglang", "per-tensor", "compressed-tensors")


def test_modelopt_declared_in_hf_quant_config_only(
    tmp_path: Path, random_sources: dict[str, Path]
) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(random_sources["modelopt-fp8"], src)
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (src / "config.json").write_text(json.dumps(config))
    report = export_checkpoint(src, tmp_path / "o", engine="tensorrt-llm")
    assert report.target_convention == "modelopt"
    assert "quantization_config" not in json.loads((tmp_path / "o" / "config.json").read_text())
    hf_quant = json.loads((tmp_path / "o" / "hf_quant_config.json").read_text())
    assert hf_quant["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert main(["doctor", str(tmp_path / "o")]) == 0
    _check_weights_identical(src, tmp_path / "o")


def test_k_transform_checkpoint_refused_with_the_format_named(tmp_path: Path) -> None:
    """No serving engine reads kvquant's k-transform: export refuses it before writing anything."""
    from kvquant.testing.checkpoints import K_TRANSFORM

    src = write_checkpoint(tmp_path / "src", convention=K_TRANSFORM, weights="none")
    for engine in ("vllm", "sglang"):
        with pytest.raises(ExportError, match="k-transform format") as info:
            export_checkpoint(src, tmp_path / f"out-{engine}", engine=engine)
        assert isinstance(info.value, ValueError)
        assert "no serving engine reads it" in str(info.value)
        assert "--format per-head" in str(info.value)
        assert not (tmp_path / f"out-{engine}").exists()
