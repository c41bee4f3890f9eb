"""Load-time integration: KVQuantConfig / KVQuantizer, producer checkpoints, save and reload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_tiny import prompt

import kvquant.integrations.hf as kvhf
from kvquant.checkpoint.discovery import discover_scales
from kvquant.errors import CheckpointError
from kvquant.integrations.hf import KVQuantConfig
from kvquant.registry import resolve_scales
from kvquant.testing.checkpoints import write_checkpoint

transformers = pytest.importorskip("transformers")

CONVENTIONS = ["compressed-tensors", "modelopt", "quark", "legacy-kv_scale"]


def _expected(path: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    found = discover_scales(path)
    ms = resolve_scales(list(found.scales), found.geometry)
    return [(layer.k, layer.v) for layer in ms.layers]


def _installed(model: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(m.self_attn.k_scale, m.self_attn.v_scale) for m in model.model.layers]


def _gen(model: Any) -> torch.Tensor:
    ids, mask = prompt(batch=2, length=8, pad=(2, 0))
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_load_time_quantizer(tmp_path: Path, convention: str) -> None:
    path = write_checkpoint(tmp_path / "ckpt", convention=convention)
    model, info = kvhf.from_pretrained(
        path, quantization_config=KVQuantConfig(backend="torch"), output_loading_info=True
    )
    assert info["unexpected_keys"] == set() or not info["unexpected_keys"]
    assert not info["missing_keys"]
    assert model.config._attn_implementation == "kvquant"
    for (k, v), (ek, ev) in zip(_installed(model), _expected(path), strict=True):
        assert k.dtype == torch.float32
        torch.testing.assert_close(k, ek)
        torch.testing.assert_close(v, ev)
    # No producer-named buffer is left behind (e.g. k_proj.output_scale).
    names = [n for n, _ in model.named_buffers() if "scale" in n]
    assert all(n.endswith(("self_attn.k_scale", "self_attn.v_scale")) for n in names)
    out = _gen(model)
    assert out.shape == (2, 14)


def test_plain_load_then_patch_reads_the_folder(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "ckpt", convention="modelopt")
    loaded = kvhf.from_pretrained(path, quantization_config=KVQuantConfig(backend="torch"))
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(path))  # scales UNEXPECTED
    assert not hasattr(plain.model.layers[0].self_attn, "k_scale")
    handle = kvhf.patch(plain, backend="torch")
    assert handle.state.options.source.startswith("checkpoint")
    for (k, v), (lk, lv) in zip(_installed(plain), _installed(loaded), strict=True):
        torch.testing.assert_close(k, lk)
        torch.testing.assert_close(v, lv)
    assert torch.equal(_gen(plain), _gen(loaded))


def test_save_and_reload_round_trip(tmp_path: Path) -> None:
    path = write_checkpoint(
        tmp_path / "ckpt", convention="compressed-tensors", granularity="per-head"
    )
    model = kvhf.from_pretrained(path, quantization_config=KVQuantConfig(backend="torch"))
    assert model.model.layers[0].self_attn.k_scale.shape == (2,)
    before = _gen(model)
    model.save_pretrained(tmp_path / "saved")
    again, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "saved"), output_loading_info=True
    )
    assert not info["unexpected_keys"] and not info["missing_keys"]
    assert again.config._attn_implementation == "kvquant"
    for (k, v), (k2, v2) in zip(_installed(model), _installed(again), strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    assert torch.equal(_gen(again), before)


def test_kv_only_check_refuses_weight_quantization(tmp_path: Path) -> None:
    path = write_checkpoint(
        tmp_path / "ckpt",
        convention="compressed-tensors",
        weights="tiny-random",
        quant_config_updates={"config_groups": {"group_0": {"targets": ["Linear"]}}},
    )
    from kvquant.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="quantizes the weights"):
        kvhf.from_pretrained(path)


def test_fp8_weights_refused(tmp_path: Path) -> None:
    from kvquant.errors import UnsupportedModelError

    path = write_checkpoint(tmp_path / "ckpt", convention="modelopt", fp8_weights=True)
    with pytest.raises(UnsupportedModelError, match="FP8 weight"):
        transformers.AutoModelForCausalLM.from_pretrained(
            str(path), quantization_config=KVQuantConfig()
        )


def test_bf16_folder_without_scales(tmp_path: Path) -> None:
    """The SmolLM2 route: a plain bf16 safetensors folder, then patch(model)."""
    from kvquant.errors import ScaleFormatError

    path = write_checkpoint(tmp_path / "ckpt", convention="none")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    with pytest.raises(ScaleFormatError):
        kvhf.patch(model, missing_scales="error")
    assert model.config._attn_implementation != "kvquant"
    handle = kvhf.patch(model, backend="torch")
    assert {s.granularity for s in handle.state.layer_specs} == {"fp32-group"}
    out = _gen(model)
    assert out.shape == (2, 14)


def test_checkpoint_level_errors_refused(tmp_path: Path) -> None:
    """Zero points (asymmetric KV) are refused by patch and by the quantizer, before any change."""
    from kvquant.errors import ScaleFormatError

    zp = {
        f"model.layers.{i}.self_attn.{k}_zero_point": torch.zeros(1, dtype=torch.int8)
        for i in range(2)
        for k in "kv"
    }
    path = write_checkpoint(tmp_path / "ckpt", convention="compressed-tensors", extra_tensors=zp)
    cfg = transformers.AutoConfig.from_pretrained(str(path))
    del cfg.quantization_config  # compressed-tensors is not installed here
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(path), config=cfg)
    with pytest.raises(ScaleFormatError, match="zero-point"):
        kvhf.patch(plain)
    assert plain.config._attn_implementation != "kvquant"
    with pytest.raises(ScaleFormatError, match="zero-point"):
        kvhf.from_pretrained(path)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_file_inside_the_checkpoint_names_its_folder(tmp_path: Path, name: str) -> None:
    """kvquant.from_pretrained takes a file inside the checkpoint for its folder (the CLI's
    rule); the KVQuantConfig door, where transformers takes config.json for the weights,
    refuses it with the folder named."""
    scales = {(layer, kind): torch.rand(()) * 0.05 + 0.01 for layer in range(2) for kind in "kv"}
    path = write_checkpoint(tmp_path / "ckpt", convention="modelopt", scales=scales)
    model = kvhf.from_pretrained(path / name, quantization_config=KVQuantConfig(backend="torch"))
    for (k, v), (ek, ev) in zip(_installed(model), _expected(path), strict=True):
        torch.testing.assert_close(k, ek)
        torch.testing.assert_close(v, ev)
    if name == "config.json":
        # 5.24 hands config.json to the quantizer as the weights; 5.17 refuses the path itself
        old = tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (5, 24)
        error: type[Exception] = OSError if old else CheckpointError
        with pytest.raises(error, match="repo_name" if old else "expected the checkpoint folder"):
            transformers.AutoModelForCausalLM.from_pretrained(
                str(path / name), quantization_config=KVQuantConfig()
            )


_RELOAD = """
import json, sys
{imports}
model = AutoModelForCausalLM.from_pretrained({saved!r})
print(json.dumps({{
    "patched": hasattr(model, "_kvquant_state"),
    "attn": model.config._attn_implementation,
    "hooks": sum(bool(getattr(f, "kvquant_registration_hook", False)) for f in sys.meta_path),
}}))
"""


@pytest.mark.parametrize(
    "imports",
    [
        "import kvquant\nfrom transformers import AutoModelForCausalLM",
        "from transformers import AutoModelForCausalLM\nimport kvquant",
        "import kvquant, transformers\nAutoModelForCausalLM = transformers.AutoModelForCausalLM",
        "import kvquant\nimport transformers.modeling_utils\n"
        "from transformers import AutoModelForCausalLM",
        "import kvquant.checkpoint\nfrom transformers import AutoModelForCausalLM",
    ],
)
def test_saved_model_reloads_patched_in_a_fresh_process(tmp_path: Path, imports: str) -> None:
    """`import kvquant` (any order with transformers) registers the quantizer: the documented
    plain from_pretrained of a saved kvquant model restores the FP8 cache."""
    import json
    import os
    import subprocess
    import sys

    path = write_checkpoint(tmp_path / "ckpt", convention="modelopt")
    kvhf.from_pretrained(path, quantization_config=KVQuantConfig(backend="torch")).save_pretrained(
        tmp_path / "saved"
    )
    code = _RELOAD.format(imports=imports, saved=str(tmp_path / "saved"))
    root = str(Path(__file__).resolve().parents[2])
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen == {"patched": True, "attn": "kvquant", "hooks": 0}, res.stderr
    assert "Unknown quantization type" not in res.stderr


def test_a_failed_registration_is_a_warning_naming_the_fix(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    code = (
        "import sys, types\n"
        "broken = types.ModuleType('kvquant.integrations.transformers_quantizer')\n"
        "def register(): raise RuntimeError('registry changed')\n"
        "broken.register = register\n"
        "sys.modules['kvquant.integrations.transformers_quantizer'] = broken\n"
        "import kvquant\n"
        "import transformers.quantizers.auto\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert res.returncode == 0, res.stderr
    assert "could not register its quantizer" in res.stderr
    assert "RuntimeError: registry changed" in res.stderr
    assert "kvquant.from_pretrained(path)" in res.stderr


def test_kvquant_from_pretrained_options_replace_a_saved_config(tmp_path: Path) -> None:
    """A folder saved from a patched model holds its KVQuantConfig; kvquant.from_pretrained
    with options of its own uses them (transformers' from_pretrained keeps the saved one and
    warns), and without options the saved ones."""
    path = write_checkpoint(tmp_path / "ckpt", convention="modelopt")
    saved = tmp_path / "saved"
    kvhf.from_pretrained(path, quantization_config=KVQuantConfig(backend="torch")).save_pretrained(
        saved
    )
    again = kvhf.from_pretrained(saved, quantization_config=KVQuantConfig(page_size=8))
    assert again._kvquant_state.options.page_size == 8
    plain = kvhf.from_pretrained(saved)
    assert plain._kvquant_state.options.page_size == 16
    assert plain._kvquant_state.options.backend == "torch"
    for model in (again, plain):
        assert torch.equal(_installed(model)[0][0], _expected(path)[0][0])


def test_transformers_skip_warning_on_a_modelopt_checkpoint_is_explained(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``AutoModelForCausalLM.from_pretrained(modelopt, quantization_config=KVQuantConfig())``."""
    import logging

    path = write_checkpoint(tmp_path / "ckpt", convention="modelopt")
    with caplog.at_level(logging.INFO):
        transformers.AutoModelForCausalLM.from_pretrained(
            str(path), quantization_config=KVQuantConfig(backend="torch")
        )
    said = [r.getMessage() for r in caplog.records if r.name == "kvquant"]
    assert any(
        "names a modelopt quantization_config, which transformers does not load" in m
        and "kvquant.from_pretrained(path)" in m
        for m in said
    ), said
    caplog.clear()
    with caplog.at_level(logging.INFO):
        kvhf.from_pretrained(path, quantization_config=KVQuantConfig(backend="torch"))
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "Unknown quantization type" not in text and "does not load" not in text
