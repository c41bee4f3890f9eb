"""The synthetic producer checkpoints (kvquant.testing.checkpoints), checked independently of discovery."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvquant.testing.checkpoints import (
    CONVENTIONS,
    default_scale_values,
    scale_tensor_name,
    write_checkpoint,
)


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            for name in fh.keys():
                out[name] = fh.get_tensor(name)
    return out


@pytest.mark.parametrize(
    "convention, kwargs, name, shape, dtype",
    [
        ("compressed-tensors", {}, "model.layers.1.self_attn.k_scale", (1,), torch.bfloat16),
        (
            "compressed-tensors",
            {"granularity": "per-head"},
            "model.layers.1.self_attn.v_scale",
            (2, 1, 1),
            torch.bfloat16,
        ),
        ("modelopt", {}, "model.layers.1.self_attn.k_proj.k_scale", (), torch.float32),
        ("quark", {}, "model.layers.1.self_attn.v_proj.output_scale", (), torch.bfloat16),
        ("quark-fp8", {}, "model.layers.1.self_attn.k_scale", (), torch.bfloat16),
        ("legacy-kv_scale", {}, "model.layers.1.self_attn.kv_scale", (), torch.float32),
    ],
)
def test_producer_tensor_layout(
    tmp_path: Path, convention: str, kwargs: dict, name: str, shape: tuple, dtype: torch.dtype
) -> None:
    path = write_checkpoint(tmp_path, convention=convention, weights="none", **kwargs)
    tensors = _read_all(path)
    assert name in tensors
    assert tuple(tensors[name].shape) == shape
    assert tensors[name].dtype == dtype
    per_layer = 1 if convention == "legacy-kv_scale" else 2
    assert len(tensors) == 2 * per_layer  # weights="none": the scales only


def test_producer_configs(tmp_path: Path) -> None:
    ct = json.loads(
        (
            write_checkpoint(
                tmp_path / "ct",
                convention="compressed-tensors",
                granularity="per-head",
                weights="none",
            )
            / "config.json"
        ).read_text()
    )
    assert ct["quantization_config"]["quant_method"] == "compressed-tensors"
    assert ct["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"
    mo = write_checkpoint(tmp_path / "mo", convention="modelopt", weights="none")
    mo_cfg = json.loads((mo / "config.json").read_text())["quantization_config"]
    assert mo_cfg["quant_method"] == "modelopt" and "strategy" not in mo_cfg["kv_cache_scheme"]
    hq = json.loads((mo / "hf_quant_config.json").read_text())
    assert hq["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert hq["quantization"]["quant_algo"] is None
    qk = json.loads(
        (
            write_checkpoint(tmp_path / "qk", convention="quark", post_rope=True, weights="none")
            / "config.json"
        ).read_text()
    )
    assert qk["quantization_config"]["kv_cache_post_rope"] is True
    assert set(qk["quantization_config"]["kv_cache_quant_config"]) == {"*k_proj", "*v_proj"}
    none = json.loads(
        (
            write_checkpoint(tmp_path / "n", convention="none", weights="none") / "config.json"
        ).read_text()
    )
    assert "quantization_config" not in none
    assert none["architectures"] == ["LlamaForCausalLM"]


def test_default_values_and_merging(tmp_path: Path) -> None:
    defaults = default_scale_values(2, 2)
    assert float(defaults[(1, "k")]) == pytest.approx(0.04)
    quark = _read_all(write_checkpoint(tmp_path / "q", convention="quark", weights="none"))
    k = quark["model.layers.0.self_attn.k_proj.output_scale"].float()
    v = quark["model.layers.0.self_attn.v_proj.output_scale"].float()
    assert torch.equal(k, v) and float(k) == pytest.approx(0.02, rel=1e-2)
    post = _read_all(
        write_checkpoint(tmp_path / "p", convention="quark", post_rope=True, weights="none")
    )
    assert float(post["model.layers.0.self_attn.v_proj.output_scale"]) == pytest.approx(
        0.01, rel=1e-2
    )
    legacy = _read_all(
        write_checkpoint(tmp_path / "l", convention="legacy-kv_scale", weights="none")
    )
    assert float(legacy["model.layers.1.self_attn.kv_scale"]) == pytest.approx(0.04)


def test_hooks_drop_override_extra(tmp_path: Path) -> None:
    path = write_checkpoint(
        tmp_path,
        convention="modelopt",
        weights="none",
        drop=[(1, "k")],
        scales={
            (0, "k"): torch.tensor(math.nan),
            (0, "v"): torch.ones(4, dtype=torch.float16),
            (1, "v"): 0.5,
        },
        extra_tensors={"model.layers.0.self_attn.k_zero_point": torch.zeros(1)},
    )
    t = _read_all(path)
    assert "model.layers.1.self_attn.k_proj.k_scale" not in t
    assert torch.isnan(t["model.layers.0.self_attn.k_proj.k_scale"])
    assert t["model.layers.0.self_attn.v_proj.v_scale"].shape == (4,)
    assert t["model.layers.0.self_attn.v_proj.v_scale"].dtype == torch.float16
    assert t["model.layers.1.self_attn.v_proj.v_scale"].item() == 0.5
    assert t["model.layers.1.self_attn.v_proj.v_scale"].dtype == torch.float32
    assert "model.layers.0.self_attn.k_zero_point" in t


def test_sharded_index_and_rewrite(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, convention="compressed-tensors", shards=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    assert len(files) == 3
    assert set(index["weight_map"].values()) == {f.name for f in files}
    assert set(index["weight_map"]) == set(_read_all(path))
    # rewriting the folder with one shard leaves no stale shard or index behind
    write_checkpoint(tmp_path, convention="none", weights="none")
    assert [p.name for p in sorted(path.glob("*.safetensors"))] == ["model.safetensors"]
    assert not (path / "model.safetensors.index.json").exists()


def test_fp8_weights_dequantize_to_the_bf16_model(tmp_path: Path) -> None:
    fp8 = _read_all(
        write_checkpoint(tmp_path / "f", convention="modelopt", fp8_weights=True, seed=3)
    )
    ref = _read_all(write_checkpoint(tmp_path / "r", convention="modelopt", seed=3))
    name = "model.layers.0.self_attn.k_proj"
    assert fp8[f"{name}.weight"].dtype == torch.float8_e4m3fn
    deq = fp8[f"{name}.weight"].float() * fp8[f"{name}.weight_scale"]
    want = ref[f"{name}.weight"].float()
    assert torch.allclose(deq, want, rtol=0.07, atol=1e-3 * float(want.abs().max()))
    assert f"{name}.input_scale" in fp8
    assert fp8["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert fp8["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "convention, shards", [("none", 2), ("legacy-kv_scale", 1), ("modelopt", 1)]
)
def test_loadable_by_transformers(tmp_path: Path, convention: str, shards: int) -> None:
    from transformers import LlamaForCausalLM

    path = write_checkpoint(tmp_path, convention=convention, shards=shards, seed=1)
    model = LlamaForCausalLM.from_pretrained(str(path))
    stored = _read_all(path)
    got = model.state_dict()["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(got.to(torch.bfloat16), stored["model.layers.1.mlp.down_proj.weight"])
    assert model.config.num_key_value_heads == 2 and model.config.head_dim == 16
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 128) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"convention": "awq"}, "unknown convention"),
        ({"convention": "modelopt", "granularity": "per-head"}, "per-head"),
        ({"convention": "quark", "fp8_weights": True}, "modelopt"),
        ({"convention": "modelopt", "post_rope": True}, "Quark"),
        ({"convention": "modelopt", "shards": 0}, "shards"),
        ({"convention": "modelopt", "shards": 9}, "non-empty shards"),
        ({"convention": "none", "scales": {(0, "k"): 1.0}}, "stores no KV scales"),
        ({"convention": "modelopt", "num_heads": 3}, "multiple"),
    ],
)
def test_bad_options(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        write_checkpoint(tmp_path, weights="none", **kwargs)


def test_scale_tensor_name() -> None:
    assert scale_tensor_name("modelopt", 2, "v") == "model.layers.2.self_attn.v_proj.v_scale"
    assert scale_tensor_name("legacy-kv_scale", 0, "kv") == "model.layers.0.self_attn.kv_scale"
    with pytest.raises(ValueError):
        scale_tensor_name("legacy-kv_scale", 0, "k")
    with pytest.raises(ValueError):
        scale_tensor_name("none", 0, "k")
    assert set(CONVENTIONS) >= {
        "compressed-tensors",
        "modelopt",
        "quark",
        "legacy-kv_scale",
        "none",
    }
