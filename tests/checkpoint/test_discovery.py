"""Checkpoint discovery, end to end from checkpoints written to disk."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import safetensors
import torch

from kvquant.checkpoint.discovery import (
    discover_scales,
    match_scale_name,
    raw_scales_from_state_dict,
)
from kvquant.checkpoint.geometry import read_geometry
from kvquant.errors import CheckpointError, KVQuantError
from kvquant.testing.checkpoints import write_checkpoint
from kvquant.types import LayerGeometry

# convention written -> (producer decided, names of layer 0, shape, dtype, pre_rope K, merged)
CASES = {
    "ct-tensor": (
        dict(convention="compressed-tensors"),
        "compressed-tensors",
        ["model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale"],
        (1,),
        torch.bfloat16,
        False,
        False,
    ),
    "ct-attn_head": (
        dict(convention="compressed-tensors", granularity="per-head"),
        "compressed-tensors",
        ["model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale"],
        (2, 1, 1),
        torch.bfloat16,
        False,
        False,
    ),
    "modelopt": (
        dict(convention="modelopt"),
        "modelopt",
        ["model.layers.0.self_attn.k_proj.k_scale", "model.layers.0.self_attn.v_proj.v_scale"],
        (),
        torch.float32,
        False,
        False,
    ),
    "quark-pre-rope": (
        dict(convention="quark"),
        "quark",
        [
            "model.layers.0.self_attn.k_proj.output_scale",
            "model.layers.0.self_attn.v_proj.output_scale",
        ],
        (),
        torch.bfloat16,
        True,
        True,
    ),
    "quark-post-rope": (
        dict(convention="quark", post_rope=True),
        "quark",
        [
            "model.layers.0.self_attn.k_proj.output_scale",
            "model.layers.0.self_attn.v_proj.output_scale",
        ],
        (),
        torch.bfloat16,
        False,
        False,
    ),
    "quark-fp8-mode": (
        dict(convention="quark-fp8"),
        "quark",
        ["model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale"],
        (),
        torch.bfloat16,
        True,
        True,
    ),
    "legacy": (
        dict(convention="legacy-kv_scale"),
        "legacy-kv_scale",
        ["model.layers.0.self_attn.kv_scale"],
        (),
        torch.float32,
        False,
        False,
    ),
}


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_discovers_each_producer(tmp_path: Path, case: str, shards: int) -> None:
    kwargs, producer, names, shape, dtype, pre_rope, merged = CASES[case]
    path = write_checkpoint(tmp_path / case, weights="none", shards=shards, **kwargs)
    found = discover_scales(path)
    assert found.producer == producer
    assert found.geometry == LayerGeometry(2, 4, 2, 16)
    assert len(found.files) == shards
    layer0 = [s for s in found.scales if s.layer == 0]
    assert [s.name for s in layer0] == names
    assert {s.layer for s in found.scales} == {0, 1}
    for s in found.scales:
        assert s.convention == producer
        assert tuple(s.tensor.shape) == shape
        assert s.tensor.dtype == dtype
        assert s.merged_kv is merged
        assert s.pre_rope is (pre_rope and s.kind == "k")
        assert torch.isfinite(s.tensor.float()).all() and (s.tensor.float() > 0).all()
    kinds = [s.kind for s in layer0]
    assert kinds == (["kv"] if producer == "legacy-kv_scale" else ["k", "v"])
    assert not found.has_errors
    assert any(f.code == "producer" for f in found.findings)


def test_values_round_trip(tmp_path: Path) -> None:
    path = write_checkpoint(
        tmp_path / "m", convention="modelopt", weights="none", scales={(1, "v"): 0.125}
    )
    by_name = {s.name: s for s in discover_scales(path).scales}
    assert by_name["model.layers.1.self_attn.v_proj.v_scale"].tensor.item() == 0.125
    assert by_name["model.layers.0.self_attn.k_proj.k_scale"].tensor.item() == pytest.approx(0.02)


def test_quark_default_merges_k_and_v(tmp_path: Path) -> None:
    found = discover_scales(write_checkpoint(tmp_path / "q", convention="quark", weights="none"))
    for layer in (0, 1):
        k, v = (s.tensor for s in found.scales if s.layer == layer)
        assert torch.equal(k, v)
    codes = {f.code for f in found.findings}
    assert "quark-pre-rope-merged" in codes and "quark-post-rope" not in codes
    post = discover_scales(
        write_checkpoint(tmp_path / "p", convention="quark", post_rope=True, weights="none")
    )
    assert "quark-post-rope" in {f.code for f in post.findings}


def test_quark_qscheme_other_than_per_tensor_is_refused(tmp_path: Path) -> None:
    """Quark's own vocabulary (its ``qscheme``) is judged by the Quark producer's hook."""
    from kvquant.checkpoint.producers import quark_config
    from kvquant.report import inspect_checkpoint

    kvc = quark_config(post_rope=False)["kv_cache_quant_config"]
    for entry in kvc.values():
        entry["output_tensors"]["qscheme"] = "per_channel"
    path = write_checkpoint(
        tmp_path / "q",
        convention="quark",
        weights="none",
        quant_config_updates={"kv_cache_quant_config": kvc},
    )
    found = discover_scales(path)
    assert found.producer == "quark" and found.kv_scheme["qscheme"] == "per_channel"
    (finding,) = [f for f in found.findings if f.code == "kv-scheme-unsupported"]
    assert finding.severity == "error"
    assert "qscheme='per_channel'" in finding.message and "Fix:" in finding.message
    assert not inspect_checkpoint(path).ok
    plain = discover_scales(write_checkpoint(tmp_path / "p", convention="quark", weights="none"))
    assert plain.kv_scheme["qscheme"] == "per_tensor"
    assert "kv-scheme-unsupported" not in {f.code for f in plain.findings}


def test_no_scales_is_a_note_not_an_error(tmp_path: Path) -> None:
    found = discover_scales(write_checkpoint(tmp_path / "n", convention="none", weights="none"))
    assert found.producer == "none"
    assert found.scales == ()
    assert {f.code for f in found.findings} == {"no-kv-scales"}
    assert not found.has_errors


def test_declared_scheme_without_tensors_warns(tmp_path: Path) -> None:
    drop = [(layer, kind) for layer in range(2) for kind in "kv"]
    found = discover_scales(
        write_checkpoint(tmp_path / "c", convention="compressed-tensors", weights="none", drop=drop)
    )
    assert found.scales == ()
    (finding,) = [f for f in found.findings if f.code == "no-kv-scales"]
    assert finding.severity == "warning"


def test_partial_and_corrupt_tensors_are_reported_as_stored(tmp_path: Path) -> None:
    path = write_checkpoint(
        tmp_path / "c",
        convention="compressed-tensors",
        weights="none",
        drop=[(1, "v")],
        scales={(0, "k"): torch.tensor([math.nan]), (0, "v"): torch.ones(4)},
    )
    found = discover_scales(path)
    keys = [(s.layer, s.kind) for s in found.scales]
    assert keys == [(0, "k"), (0, "v"), (1, "k")]
    assert torch.isnan(found.scales[0].tensor).all()
    assert tuple(found.scales[1].tensor.shape) == (4,)
    assert found.scales[1].tensor.dtype == torch.float32


def test_non_kv_scales_are_skipped_and_weights_never_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = {
        "model.layers.0.self_attn.q_scale": torch.ones(1),
        "model.layers.0.self_attn.q_proj.output_scale": torch.ones(()),
        "model.layers.0.self_attn.prob_output_scale": torch.ones(()),
        "model.layers.0.self_attn.o_proj.output_scale": torch.ones(()),
    }
    path = write_checkpoint(
        tmp_path / "m", convention="modelopt", fp8_weights=True, shards=2, extra_tensors=extra
    )
    loaded: list[str] = []
    real_safe_open = safetensors.safe_open

    class Spy:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self._inner = real_safe_open(*args, **kwargs)

        def __enter__(self) -> Spy:
            self._inner.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self._inner.__exit__(*exc)

        def get_tensor(self, name: str) -> torch.Tensor:
            loaded.append(name)
            return self._inner.get_tensor(name)

        def keys(self) -> list[str]:
            return list(self._inner.keys())

        def get_slice(self, name: str) -> object:
            # header facts only: dtype and shape, never the data
            sl = self._inner.get_slice(name)
            return type("Header", (), {"get_dtype": sl.get_dtype, "get_shape": sl.get_shape})()

        def __getattr__(self, attr: str) -> object:
            raise AssertionError(f"discovery used safe_open().{attr}")

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    found = discover_scales(path)
    expected = sorted(s.name for s in found.scales)
    assert sorted(loaded) == expected
    assert len(expected) == 4
    assert all(n.endswith(("k_proj.k_scale", "v_proj.v_scale")) for n in loaded)
    assert found.num_tensors > 40  # weights, weight_scale, input_scale were seen in the headers
    assert found.weight_dtypes.get("F8_E4M3") == 14
    (fp8,) = [f for f in found.findings if f.code == "fp8-weights-modelopt"]
    assert fp8.severity == "warning" and "weight_scale" in fp8.message


def test_modelopt_kv_only_has_no_fp8_weight_finding(tmp_path: Path) -> None:
    found = discover_scales(write_checkpoint(tmp_path / "m", convention="modelopt"))
    assert not any(f.code.startswith("fp8-weights") for f in found.findings)
    assert found.kv_scheme is not None and found.kv_scheme["kv_cache_quant_algo"] == "FP8"


def test_zero_points_and_asymmetric_scheme_are_errors(tmp_path: Path) -> None:
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    path = write_checkpoint(
        tmp_path / "a",
        convention="compressed-tensors",
        weights="none",
        extra_tensors={"model.layers.0.self_attn.k_zero_point": torch.zeros(1)},
        quant_config_updates={"kv_cache_scheme": {**scheme, "symmetric": False}},
    )
    found = discover_scales(path)
    codes = {f.code for f in found.findings if f.severity == "error"}
    assert codes == {"kv-zero-points", "kv-scheme-asymmetric"}
    assert found.has_errors
    assert all("zero_point" not in s.name for s in found.scales)


def test_unsupported_kv_schemes_are_errors(tmp_path: Path) -> None:
    int8 = {"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": True}
    found = discover_scales(
        write_checkpoint(
            tmp_path / "i",
            convention="compressed-tensors",
            weights="none",
            quant_config_updates={"kv_cache_scheme": int8},
        )
    )
    assert "kv-scheme-unsupported" in {f.code for f in found.findings if f.severity == "error"}
    path = write_checkpoint(tmp_path / "n", convention="modelopt", weights="none")
    hq = json.loads((path / "hf_quant_config.json").read_text())
    hq["quantization"]["kv_cache_quant_algo"] = "NVFP4_AFFINE"  # NVFP4 itself is read
    (path / "hf_quant_config.json").write_text(json.dumps(hq))
    found = discover_scales(path)
    assert "kv-scheme-unsupported" in {f.code for f in found.findings if f.severity == "error"}


def test_dynamic_scheme_is_a_note(tmp_path: Path) -> None:
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True}
    drop = [(layer, kind) for layer in range(2) for kind in "kv"]
    found = discover_scales(
        write_checkpoint(
            tmp_path / "d",
            convention="compressed-tensors",
            weights="none",
            drop=drop,
            quant_config_updates={"kv_cache_scheme": scheme},
        )
    )
    codes = {f.code for f in found.findings}
    assert "kv-scheme-dynamic" in codes and "no-kv-scales" not in codes


def test_output_scale_names_without_config_assume_quark(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "q", convention="quark", weights="none")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    found = discover_scales(path)
    assert found.producer == "quark"
    assert all(s.pre_rope is (s.kind == "k") and s.merged_kv for s in found.scales)
    assert any("no quantization_config" in n for n in found.scales[0].notes)


def test_multimodal_text_config(tmp_path: Path) -> None:
    path = write_checkpoint(
        tmp_path / "mm", convention="modelopt", weights="none", multimodal=True, num_layers=3
    )
    found = discover_scales(path)
    assert found.geometry == LayerGeometry(3, 4, 2, 16)
    assert {s.layer for s in found.scales} == {0, 1, 2}


@pytest.mark.parametrize(
    ("model_type", "uses"), [("llama", "top"), ("llava", "text"), ("gemma3", "text"),
                             ("qwen2", "top"), ("not-a-model-type", "text")],
)  # fmt: skip
def test_text_config_is_read_where_transformers_reads_it(model_type: str, uses: str) -> None:
    """A plain model type ignores a leftover text_config; a composite one (and an unknown one)
    reads its language model from text_config, whatever stale fields the top level has."""
    from kvquant.checkpoint.geometry import language_config, leftover_text_config

    top = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16}  # fmt: skip
    text = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
            "head_dim": 32}  # fmt: skip
    config = {"model_type": model_type, **top, "text_config": text}
    want = LayerGeometry(2, 4, 2, 16) if uses == "top" else LayerGeometry(4, 8, 8, 32)
    assert read_geometry(config) == want
    assert (language_config(config) is config) == (uses == "top")
    assert leftover_text_config(config) == (uses == "top")
    # a composite config whose top level has no geometry: text_config, no leftover
    assert read_geometry({"model_type": model_type, "text_config": text}) == LayerGeometry(
        4, 8, 8, 32
    )


def test_read_geometry_defaults() -> None:
    g = read_geometry({"num_hidden_layers": 3, "num_attention_heads": 8, "hidden_size": 256})
    assert g == LayerGeometry(3, 8, 8, 32)
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        read_geometry({"num_attention_heads": 8, "hidden_size": 256})
    with pytest.raises(CheckpointError, match="expected an integer from 1 to"):
        read_geometry({"num_hidden_layers": 0, "num_attention_heads": 8, "hidden_size": 256})
    with pytest.raises(CheckpointError, match="multiple"):
        read_geometry(
            {
                "num_hidden_layers": 1,
                "num_attention_heads": 6,
                "num_key_value_heads": 4,
                "head_dim": 8,
            }
        )


def test_layer_out_of_range_and_duplicates_are_errors(tmp_path: Path) -> None:
    extra = {
        "model.layers.7.self_attn.k_scale": torch.ones(1),
        "model.layers.0.self_attn.k_proj.k_scale": torch.ones(()),
    }
    found = discover_scales(
        write_checkpoint(
            tmp_path / "x", convention="compressed-tensors", weights="none", extra_tensors=extra
        )
    )
    errors = {f.code for f in found.findings if f.severity == "error"}
    assert {"scale-layer-out-of-range", "duplicate-scale"} <= errors
    assert all(s.layer < 2 for s in found.scales)
    assert "mixed-namings" in {f.code for f in found.findings}


@pytest.mark.parametrize(
    "name, expected",
    [
        ("model.layers.3.self_attn.k_scale", (3, "k", "self_attn")),
        ("model.language_model.layers.12.self_attn.v_proj.v_scale", (12, "v", "modelopt")),
        ("model.layers.0.self_attn.k_proj.output_scale", (0, "k", "output_scale")),
        ("model.layers.5.self_attn.kv_scale", (5, "kv", "legacy-kv_scale")),
        ("transformer.layers.2.attention.kv_cache_scaling_factor", (2, "kv", "tensorrt-llm")),
        ("model.layers.0.self_attn.q_scale", None),
        ("model.layers.0.self_attn.q_proj.output_scale", None),
        ("model.layers.0.self_attn.k_proj.weight_scale", None),
        ("model.layers.0.self_attn.k_proj.input_scale", None),
        ("model.layers.0.self_attn.prob_output_scale", None),
        ("model.layers.0.self_attn.k_zero_point", None),
    ],
)
def test_match_scale_name(name: str, expected: tuple[int, str, str] | None) -> None:
    assert match_scale_name(name) == expected


def test_raw_scales_from_state_dict() -> None:
    sd = {
        "model.layers.1.self_attn.k_proj.output_scale": torch.tensor(0.5, dtype=torch.bfloat16),
        "model.layers.1.self_attn.v_proj.output_scale": torch.tensor(0.5, dtype=torch.bfloat16),
        "model.layers.1.self_attn.q_proj.output_scale": torch.tensor(0.5),
        "model.layers.1.mlp.up_proj.weight": torch.zeros(2, 2),
    }
    raws = raw_scales_from_state_dict(sd, quantization_config={"quant_method": "quark"})
    assert [(r.layer, r.kind, r.convention, r.pre_rope, r.merged_kv) for r in raws] == [
        (1, "k", "quark", True, True),
        (1, "v", "quark", False, True),
    ]


# --- not a checkpoint -> CheckpointError ------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        discover_scales(tmp_path / "nope")


def test_file_instead_of_folder(tmp_path: Path) -> None:
    f = tmp_path / "x.txt"
    f.write_text("hi")
    with pytest.raises(CheckpointError, match="is a file"):
        discover_scales(f)


@pytest.mark.parametrize(
    "name", ["config.json", "model.safetensors.index.json", "model-00002-of-00002.safetensors"]
)
def test_a_checkpoint_file_names_its_folder(tmp_path: Path, name: str) -> None:
    """The command line's PATH rule, for every door that reads a path (patch(scales=...))."""
    scales = {(layer, kind): torch.rand(1) * 0.05 + 0.01 for layer in range(2) for kind in "kv"}
    ckpt = write_checkpoint(
        tmp_path / "ckpt", convention="compressed-tensors", shards=2, scales=scales
    )
    got, want = discover_scales(ckpt / name), discover_scales(ckpt)
    assert got.path == want.path == ckpt
    assert [(r.name, r.tensor.tolist()) for r in got.scales] == [
        (r.name, r.tensor.tolist()) for r in want.scales
    ]


def test_no_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        discover_scales(tmp_path)


def test_no_safetensors(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "c", convention="none", weights="none")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors or"):
        discover_scales(path)


def test_bad_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="JSON"):
        discover_scales(tmp_path)


@pytest.mark.parametrize(
    "blob, match",
    [
        # safetensors' own bounds on the header, reported with the fix
        (b"\x01\x02", "header too small"),
        ((10**12).to_bytes(8, "little"), "header too large"),
        ((100).to_bytes(8, "little") + b"{", "invalid header length"),
        ((5).to_bytes(8, "little") + b"nope!", "invalid JSON"),
    ],
)
def test_unreadable_header(tmp_path: Path, blob: bytes, match: str) -> None:
    path = write_checkpoint(tmp_path / "c", convention="modelopt", weights="none")
    (path / "model.safetensors").write_bytes(blob)
    with pytest.raises(CheckpointError, match=match) as info:
        discover_scales(path)
    assert isinstance(info.value, KVQuantError) and isinstance(info.value, ValueError)
    assert "Fix: the file is corrupt" in str(info.value)


def test_index_names_missing_shard(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "c", convention="modelopt", weights="none", shards=2)
    next(path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="not in"):
        discover_scales(path)


def test_scale_tensor_infos_reads_headers_only(tmp_path: Path) -> None:
    from kvquant.checkpoint.discovery import scale_tensor_infos

    path = write_checkpoint(
        tmp_path / "c", convention="compressed-tensors", granularity="per-head", shards=2
    )
    infos = scale_tensor_infos(sorted(path.glob("*.safetensors")))
    assert sorted(infos) == [
        f"model.layers.{layer}.self_attn.{kind}_scale" for layer in (0, 1) for kind in "kv"
    ]
    info = infos["model.layers.1.self_attn.v_scale"]
    assert (info.dtype, info.shape) == ("BF16", (2, 1, 1))
    assert Path(info.file).parent == path
    with pytest.raises(CheckpointError, match="does not exist"):
        scale_tensor_infos([tmp_path / "x.safetensors"])


def test_quant_method_decides_the_convention(tmp_path: Path) -> None:
    saved = discover_scales(
        write_checkpoint(
            tmp_path / "k",
            convention="compressed-tensors",
            weights="none",
            quant_config_updates={"quant_method": "kvquant"},
        )
    )
    assert saved.producer == "kvquant" and {s.convention for s in saved.scales} == {"kvquant"}
    # pre-2024-08 compressed-tensors wrote k_proj.output_scale: the config says it is CT, not Quark
    old = {
        f"model.layers.{layer}.self_attn.{kind}_proj.output_scale": torch.tensor(0.5)
        for layer in (0, 1)
        for kind in "kv"
    }
    drop = [(layer, kind) for layer in (0, 1) for kind in "kv"]
    found = discover_scales(
        write_checkpoint(
            tmp_path / "o",
            convention="compressed-tensors",
            weights="none",
            drop=drop,
            extra_tensors=old,
        )
    )
    assert found.producer == "compressed-tensors"
    assert all(s.convention == "compressed-tensors" and not s.merged_kv for s in found.scales)
    assert len(found.scales) == 4


def test_unknown_quant_method_warns(tmp_path: Path) -> None:
    found = discover_scales(
        write_checkpoint(
            tmp_path / "a",
            convention="legacy-kv_scale",
            weights="none",
            quant_config_updates={"quant_method": "awq"},
        )
    )
    assert found.producer == "legacy-kv_scale"
    assert "unknown-quant-method" in {f.code for f in found.findings}
