"""Per-layer geometry (layers that differ in head_dim / KV heads): types, registry, config, doctor, export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvquant.checkpoint.geometry import read_geometry
from kvquant.errors import CheckpointError, ScaleFormatError
from kvquant.export import export_checkpoint
from kvquant.registry import analyze_scales
from kvquant.registry.policy import check_geometry, model_group_size
from kvquant.report import inspect_checkpoint
from kvquant.testing.checkpoints import write_checkpoint
from kvquant.types import LayerGeometry, RawScale

MIXED = LayerGeometry.from_layers(4, [2, 4, 2], [16, 32, 16])


def test_from_layers_uniform_and_mixed() -> None:
    same = LayerGeometry.from_layers(4, [2, 2], [16, 16])
    assert same == LayerGeometry(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    assert same.uniform and same.layer(1) is same
    assert not MIXED.uniform
    assert (MIXED.num_kv_heads, MIXED.head_dim) == (4, 32)  # the largest layer values
    assert [MIXED.kv_heads_of(i) for i in range(3)] == [2, 4, 2]
    assert MIXED.layer(1) == LayerGeometry(num_layers=3, num_heads=4, num_kv_heads=4, head_dim=32)
    assert MIXED.head_dims() == (16, 32)
    assert MIXED.describe() == (
        "2 KV heads x head_dim 16 (layers 0, 2); 4 KV heads x head_dim 32 (layer 1)"
    )
    with pytest.raises(ScaleFormatError, match="one of each per layer"):
        LayerGeometry.from_layers(4, [2, 2], [16])


@pytest.mark.parametrize(
    "bad",
    [
        {"layer_num_kv_heads": (2, 2)},
        {"layer_head_dims": (16, 0, 16)},
        {"layer_head_dims": [16] * 3},
    ],
)
def test_check_geometry_refuses_bad_per_layer_values(bad: dict[str, object]) -> None:
    geometry = LayerGeometry(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, **bad)  # type: ignore[arg-type]
    with pytest.raises(ScaleFormatError, match="one per layer"):
        check_geometry(geometry)


def test_group_size_for_mixed_head_dims() -> None:
    assert model_group_size(None, MIXED) == 16
    assert model_group_size(None, LayerGeometry.from_layers(8, [1, 1], [256, 512])) == 64
    assert model_group_size(8, MIXED) == 8
    with pytest.raises(ScaleFormatError, match=r"head_dim=16 of some layers.*group_size=16"):
        model_group_size(32, MIXED)


def _raw(layer: int, kind: str, shape: tuple[int, ...]) -> RawScale:
    name = f"model.layers.{layer}.self_attn.{kind}_scale"
    return RawScale(layer, kind, name, "compressed-tensors", torch.full(shape, 0.01))  # type: ignore[arg-type]


def test_each_layer_reads_scales_of_its_own_shape() -> None:
    raws = [_raw(i, kind, (MIXED.kv_heads_of(i), 1, 1)) for i in range(3) for kind in "kv"]
    scales = analyze_scales(raws, MIXED)
    assert scales.ok, scales.problems
    assert [tuple(layer.k.shape) for layer in scales.layers] == [(2,), (4,), (2,)]
    assert scales.to_dict()["geometry"]["layer_num_kv_heads"] == [2, 4, 2]
    # the 2-head shape of layers 0 and 2 on every layer: layer 1 (4 KV heads) is refused
    bad = analyze_scales([_raw(i, kind, (2, 1, 1)) for i in range(3) for kind in "kv"], MIXED)
    assert not bad.ok
    assert any("layers.1.self_attn.k_scale" in p and "4 KV heads" in p for p in bad.problems)
    assert all(not p.startswith("model.layers.2") for p in bad.problems)


def test_unit_scales_follow_each_layer() -> None:
    scales = analyze_scales([], MIXED, scale_format="per-head", missing_scales="unit")
    assert [tuple(layer.k.shape) for layer in scales.layers] == [(2,), (4,), (2,)]


def test_read_geometry_per_layer_config_and_gemma4_keys() -> None:
    base = {
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
    generic = {**base, "per_layer_config": {"1": {"head_dim": 32, "num_key_value_heads": 4}}}
    assert read_geometry(generic) == MIXED
    gemma = {
        **base,
        "model_type": "gemma4_text",
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "global_head_dim": 64,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
    }
    # transformers forces the last layer to full attention
    got = read_geometry(gemma)
    assert [got.head_dim_of(i) for i in range(3)] == [16, 64, 64]
    assert [got.kv_heads_of(i) for i in range(3)] == [2, 1, 1]
    no_keq = read_geometry({**gemma, "attention_k_eq_v": False})
    assert [no_keq.kv_heads_of(i) for i in range(3)] == [2, 2, 2]
    default = read_geometry({**base, "model_type": "gemma4_text", "num_hidden_layers": 7})
    assert [default.head_dim_of(i) for i in range(7)] == [16] * 5 + [512, 512]
    assert read_geometry(base).uniform


@pytest.mark.parametrize(
    ("per_layer", "match"),
    [
        ([1, 2], "mapping"),
        ({"7": {}}, "layer index"),
        ({"x": {}}, "layer index"),
        ({"0": 3}, "overrides"),
    ],
)
def test_read_geometry_refuses_malformed_per_layer_config(per_layer: object, match: str) -> None:
    config = {"num_hidden_layers": 3, "num_attention_heads": 4, "head_dim": 16}
    config["per_layer_config"] = per_layer
    with pytest.raises(CheckpointError, match=match):
        read_geometry(config)


def test_read_geometry_refuses_bad_per_layer_values() -> None:
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16}
    with pytest.raises(CheckpointError, match="layer 1: head_dim"):
        read_geometry({**config, "per_layer_config": {"1": {"head_dim": -3}}})
    with pytest.raises(CheckpointError, match="layer 1: num_attention_heads=4 is not a multiple"):
        read_geometry({**config, "per_layer_config": {"1": {"num_key_value_heads": 3}}})


def _mixed_checkpoint(tmp_path: Path, per_layer: bool) -> Path:
    """compressed-tensors per-head scales: layer 1 has 4 KV heads, the others 2."""
    path = write_checkpoint(
        tmp_path / f"c{int(per_layer)}",
        convention="compressed-tensors",
        granularity="per-head",
        num_layers=3,
        weights="none",
    )
    tensors = load_file(path / "model.safetensors")
    for kind in "kv":
        tensors[f"model.layers.1.self_attn.{kind}_scale"] = torch.full(
            (4, 1, 1), 0.03, dtype=torch.bfloat16
        )
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if per_layer:
        config = json.loads((path / "config.json").read_text())
        config["per_layer_config"] = {"1": {"head_dim": 32, "num_key_value_heads": 4}}
        (path / "config.json").write_text(json.dumps(config))
    return path


def test_doctor_checks_each_layer_against_its_config(tmp_path: Path) -> None:
    uniform = inspect_checkpoint(_mixed_checkpoint(tmp_path, per_layer=False))
    assert not uniform.ok and uniform.rejected_layers == (1,)
    report = inspect_checkpoint(_mixed_checkpoint(tmp_path, per_layer=True))
    assert report.ok, report.render()
    assert [tuple(s.k.shape) for s in report.scales] == [(2,), (4,), (2,)]
    assert "4 KV heads x head_dim 32 (layer 1)" in report.render()
    assert report.to_dict()["geometry"]["layer_head_dims"] == [16, 32, 16]


def test_export_writes_each_layers_shape(tmp_path: Path) -> None:
    src = _mixed_checkpoint(tmp_path, per_layer=True)
    export_checkpoint(src, tmp_path / "out", engine="vllm", granularity="per-head")
    tensors: dict[str, torch.Tensor] = {}
    for file in (tmp_path / "out").glob("*.safetensors"):
        tensors.update(load_file(file))
    shapes = [tuple(tensors[f"model.layers.{i}.self_attn.k_scale"].shape) for i in range(3)]
    assert shapes == [(2, 1, 1), (4, 1, 1), (2, 1, 1)]
    assert torch.equal(
        tensors["model.layers.1.self_attn.v_scale"].float(),
        torch.full((4, 1, 1), 0.03, dtype=torch.bfloat16).float(),
    )
