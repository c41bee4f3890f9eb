"""The producer conventions table: names, stored shapes/dtypes and configs (kvquant.checkpoint.producers)."""

from __future__ import annotations

import json

import pytest
import torch

from kvquant.checkpoint import producers as cv
from kvquant.checkpoint.discovery import match_scale_name
from kvquant.errors import ConventionError, KVQuantError


def test_table_covers_every_convention() -> None:
    assert set(cv.CONVENTION_SPECS) == set(cv.PRODUCER_CONVENTIONS)
    for name, spec in cv.CONVENTION_SPECS.items():
        assert spec.name == name
        assert spec.naming in cv.NAMINGS
        assert set(spec.suffixes) in ({"k", "v"}, {"kv"})
    # every naming but the read-only ones (TensorRT-LLM's, compressed-tensors' NVFP4 global
    # scales) is written by some producer
    written = {spec.naming for spec in cv.CONVENTION_SPECS.values()}
    assert set(cv.NAMINGS) - written == {"tensorrt-llm", "global_scale"}


def test_the_registry_shims_are_gone() -> None:
    """kvquant.registry.{discovery,conventions,types} were removed; kvquant.checkpoint and
    kvquant.types are the only homes of those names."""
    import importlib

    for name in ("discovery", "conventions", "types"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"kvquant.registry.{name}")


@pytest.mark.parametrize("convention", cv.PRODUCER_CONVENTIONS)
@pytest.mark.parametrize("prefix", ["model.", "model.language_model.", ""])
def test_written_names_are_read_back_by_discovery(convention: str, prefix: str) -> None:
    kinds = cv.CONVENTION_SPECS[convention].suffixes
    names = set()
    for layer in (0, 7, 31):
        for kind in kinds:
            name = cv.scale_tensor_name(convention, layer, kind, prefix=prefix)
            assert name.startswith(f"{prefix}layers.{layer}.self_attn.")
            naming = cv.CONVENTION_SPECS[convention].naming
            assert match_scale_name(name) == (layer, kind, naming)
            names.add(name)
    assert len(names) == 3 * len(kinds)


def test_names() -> None:
    assert cv.scale_tensor_name("compressed-tensors", 0, "k") == "model.layers.0.self_attn.k_scale"
    assert cv.scale_tensor_name("modelopt", 2, "v") == "model.layers.2.self_attn.v_proj.v_scale"
    assert (
        cv.scale_tensor_name("quark", 1, "v", prefix="m.")
        == "m.layers.1.self_attn.v_proj.output_scale"
    )
    assert cv.scale_tensor_name("quark-fp8", 3, "k") == "model.layers.3.self_attn.k_scale"
    assert cv.scale_tensor_name("legacy-kv_scale", 0, "kv") == "model.layers.0.self_attn.kv_scale"


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: cv.scale_tensor_name("legacy-kv_scale", 0, "k"), "one 'kv' scale"),
        (lambda: cv.scale_tensor_name("modelopt", 0, "kv"), "stores 'k' and 'v'"),
        (lambda: cv.scale_tensor_name("none", 0, "k"), "unknown convention 'none'"),
        (lambda: cv.stored_scale_shape("modelopt", "per-head", 2), "no per-head"),
        (lambda: cv.stored_scale_shape("compressed-tensors", "per-group", 2), "granularity"),
        (lambda: cv.producer_configs("vllm"), "unknown convention 'vllm'"),
    ],
)
def test_bad_requests_raise_convention_error(call: object, match: str) -> None:
    with pytest.raises(ConventionError, match=match) as info:
        call()  # type: ignore[operator]
    assert isinstance(info.value, KVQuantError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("convention", "granularity", "shape"),
    [
        ("compressed-tensors", "per-tensor", (1,)),
        ("compressed-tensors", "per-head", (3, 1, 1)),
        ("modelopt", "per-tensor", ()),
        ("quark", "per-tensor", ()),
        ("quark-fp8", "per-tensor", ()),
        ("legacy-kv_scale", "per-tensor", ()),
    ],
)
def test_stored_scale_shapes_and_values(
    convention: str, granularity: str, shape: tuple[int, ...]
) -> None:
    assert cv.stored_scale_shape(convention, granularity, 3) == shape
    per_head = torch.rand(3) + 0.5
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = cv.stored_scale(per_head, convention, granularity, 3, dtype)
        assert out.shape == shape and out.dtype == dtype
        expect = per_head if granularity == "per-head" else per_head.amax()
        torch.testing.assert_close(out.float().reshape(-1), expect.to(dtype).float().reshape(-1))
    scalar = cv.stored_scale(0.25, convention, granularity, 3, torch.float32)
    assert scalar.shape == shape and bool((scalar == 0.25).all())


def test_stored_scale_is_a_new_tensor() -> None:
    src = torch.tensor([0.5, 0.25])
    out = cv.stored_scale(src, "compressed-tensors", "per-head", 2, torch.float32)
    out.fill_(float("nan"))
    assert src.tolist() == [0.5, 0.25]


def test_configs_are_fresh_dicts() -> None:
    for convention in cv.PRODUCER_CONVENTIONS:
        first = cv.producer_configs(convention)
        snapshot = json.dumps(first, sort_keys=True)
        for part in first:
            if part is not None:
                part.clear()
        assert json.dumps(cv.producer_configs(convention), sort_keys=True) == snapshot
    assert cv.producer_configs("none") == (None, None)
    assert cv.producer_configs("legacy-kv_scale") == (None, None)


def test_compressed_tensors_scheme() -> None:
    assert cv.compressed_tensors_kv_scheme("per-head")["strategy"] == "attn_head"
    assert cv.compressed_tensors_kv_scheme("per-tensor")["strategy"] == "tensor"
    base = {"strategy": "attn_head", "observer": "mse", "num_bits": 4, "extra": 1}
    merged = cv.compressed_tensors_kv_scheme("per-tensor", base)
    assert merged["strategy"] == "tensor" and merged["num_bits"] == 8
    assert merged["observer"] == "mse" and merged["extra"] == 1
    assert base["num_bits"] == 4  # the base is not modified
    assert "version" not in cv.compressed_tensors_config("per-tensor")
    qcfg, hf = cv.producer_configs("compressed-tensors", granularity="per-head")
    assert hf is None and qcfg is not None
    assert qcfg["version"] == "0.19.0" and qcfg["kv_cache_scheme"]["strategy"] == "attn_head"


def test_modelopt_configs() -> None:
    qcfg, hf = cv.producer_configs("modelopt")
    assert qcfg is not None and hf is not None
    assert "quant_algo" not in qcfg and hf["quantization"]["quant_algo"] is None
    assert hf["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert hf["quantization"]["quantized_layers"] == {}
    assert list(hf["quantization"]) == [
        "quant_algo",
        "kv_cache_quant_algo",
        "exclude_modules",
        "quantized_layers",
    ]
    qcfg8, hf8 = cv.producer_configs("modelopt", fp8_weights=True)
    assert qcfg8 is not None and hf8 is not None
    assert qcfg8["quant_algo"] == "FP8" and "group_0" in qcfg8["config_groups"]
    assert hf8["quantization"]["quant_algo"] == "FP8"
    assert "quantized_layers" not in hf8["quantization"]
    kv_only = cv.modelopt_quantization_config({"name": "modelopt"}, ignore=())
    assert kv_only["ignore"] == [] and kv_only["kv_cache_scheme"] == cv.modelopt_kv_cache_scheme()


@pytest.mark.parametrize(
    ("convention", "dtype", "post_rope", "mode", "dtype_name"),
    [
        ("quark", torch.bfloat16, False, "quark", "bfloat16"),
        ("quark", torch.float16, True, "quark", "float16"),
        ("quark-fp8", torch.float32, False, "fp8", "float32"),
    ],
)
def test_quark_configs(
    convention: str, dtype: torch.dtype, post_rope: bool, mode: str, dtype_name: str
) -> None:
    qcfg, hf = cv.producer_configs(convention, scale_dtype=dtype, post_rope=post_rope)
    assert hf is None and qcfg is not None
    assert qcfg["kv_cache_post_rope"] is post_rope
    assert qcfg["export"]["custom_mode"] == mode
    assert qcfg["export"]["scale_dtype"] == dtype_name
    assert qcfg["version"] == "0.13" and qcfg["exclude"] == ["lm_head"]
    assert sorted(qcfg["kv_cache_quant_config"]) == ["*k_proj", "*v_proj"]
    # the nested per-projection configs are independent
    qcfg["kv_cache_quant_config"]["*k_proj"]["output_tensors"]["dtype"] = "int8"
    assert qcfg["kv_cache_quant_config"]["*v_proj"]["output_tensors"]["dtype"] == "fp8_e4m3"
    bare = cv.quark_config(post_rope=True)
    assert "version" not in bare and bare["exclude"] == []
    assert bare["export"]["kv_cache_group"] == [] and bare["export"]["scale_dtype"] == "float32"


@pytest.mark.parametrize(
    ("qcfg", "name", "weights"),
    [
        ({"quant_method": "compressed-tensors"}, "compressed-tensors", False),
        (
            {"quant_method": "compressed_tensors", "config_groups": {"g": {}}},
            "compressed-tensors",
            True,
        ),
        ({"quant_method": "modelopt", "quant_algo": None}, "modelopt", False),
        ({"quant_method": "modelopt", "quant_algo": "null"}, "modelopt", False),
        ({"quant_method": "MODELOPT", "quant_algo": "FP8"}, "modelopt", True),
        ({"quant_method": "quark", "global_quant_config": {"weight": None}}, "quark", False),
        (
            {"quant_method": "quark", "global_quant_config": {"weight": {"dtype": "fp8"}}},
            "quark",
            True,
        ),
        ({"quant_method": "kvquant", "page_size": 16}, "kvquant", False),
        ({"quant_method": "bitsandbytes"}, None, False),
        (None, None, False),
    ],
)
def test_config_producer_and_whether_its_config_quantizes_weights(
    qcfg: dict[str, object] | None, name: str | None, weights: bool
) -> None:
    producer = cv.config_producer(qcfg)
    assert (producer.name if producer is not None else None) == name
    if producer is not None:
        assert producer.config_quantizes_weights(qcfg or {}) is weights


def test_only_kvquants_own_config_is_a_kvquant_config() -> None:
    assert [p.name for p in cv.PRODUCERS if p.kvquant_config] == ["kvquant"]
    assert cv.reported(cv.NO_PRODUCER) is None


def test_written_granularity_is_a_static_scheme() -> None:
    """A checkpoint's scales are written per tensor or per head; any other word is refused
    (compressed-tensors' strategy took it for 'tensor')."""
    from kvquant.checkpoint.producers.base import stored_scheme
    from kvquant.schemes import PerHeadScales, PerTensorScales

    assert stored_scheme("per-head") is PerHeadScales
    assert stored_scheme(PerTensorScales) is PerTensorScales
    assert cv.compressed_tensors_kv_scheme("per-head")["strategy"] == "attn_head"
    for word in ("fp32-group", "k-transform", "per-token"):
        with pytest.raises(ConventionError, match=f"got '{word}'. Fix"):
            cv.compressed_tensors_kv_scheme(word)
    shape = cv.stored_scale(
        torch.tensor(0.5), "compressed-tensors", PerHeadScales, 3, torch.float32
    )
    assert shape.shape == (3, 1, 1) and bool((shape == 0.5).all())
