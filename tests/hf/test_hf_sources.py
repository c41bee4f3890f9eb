"""Where patch() and the quantizer get their scales, and what a patched model saves.

Hub ids through the local Hugging Face cache, explicit mappings that name
nothing, .bin-only checkpoints, canonical fp32 scales saved after a dtype
change, and ``remove()`` leaving a model that saves like an unpatched one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import kvquant.integrations.hf as kvhf
from kvquant.checkpoint.discovery import discover_scales
from kvquant.errors import CheckpointError, OptionTypeError, ScaleFormatError
from kvquant.integrations.hf import KVQuantConfig
from kvquant.testing.checkpoints import write_checkpoint, write_hf_cache_entry

transformers = pytest.importorskip("transformers")

COMMIT = "1234567890abcdef1234567890abcdef12345678"


def _installed(model: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(m.self_attn.k_scale, m.self_attn.v_scale) for m in model.model.layers]


def _random_scales() -> dict[tuple[int, str], float]:
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ()).item()))
    return {
        (layer, kind): float(torch.rand((), generator=g) * 0.1 + 0.001)
        for layer in range(2)
        for kind in "kv"
    }


def test_patch_after_hub_id_load_reads_the_cached_checkpoint(
    tmp_path: Path, hf_cache: Path
) -> None:
    src = write_checkpoint(tmp_path / "src", convention="modelopt", scales=_random_scales())
    snapshot = write_hf_cache_entry(hf_cache, "org/tiny-fp8", src, commit=COMMIT)
    model = transformers.AutoModelForCausalLM.from_pretrained("org/tiny-fp8", cache_dir=hf_cache)
    assert model.name_or_path == "org/tiny-fp8"
    handle = kvhf.patch(model, backend="torch")
    assert handle.state.options.source == f"checkpoint {snapshot}"
    found = discover_scales(src)
    expected = {(s.layer, s.kind): s.tensor for s in found.scales}
    for layer, (k, v) in enumerate(_installed(model)):
        assert torch.equal(k, expected[(layer, "k")].float())
        assert torch.equal(v, expected[(layer, "v")].float())


def test_hub_load_through_the_quantizer(tmp_path: Path, hf_cache: Path) -> None:
    src = write_checkpoint(tmp_path / "src", convention="legacy-kv_scale", scales=_random_scales())
    write_hf_cache_entry(hf_cache, "org/tiny-kv", src, commit=COMMIT)
    model = kvhf.from_pretrained(
        "org/tiny-kv", quantization_config=KVQuantConfig(backend="torch"), cache_dir=hf_cache
    )
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(src))
    kvhf.patch(plain, backend="torch")
    for (k, v), (k2, v2) in zip(_installed(model), _installed(plain), strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_hub_model_whose_files_are_gone_is_an_error_when_it_declares_scales(
    tmp_path: Path, hf_cache: Path
) -> None:
    src = write_checkpoint(tmp_path / "src", convention="modelopt")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src))
    model.name_or_path = "org/not-cached"
    model.config._name_or_path = "org/not-cached"
    model.config.quantization_config = {"quant_method": "modelopt"}
    with pytest.raises(CheckpointError, match="scales=<the checkpoint folder>"):
        kvhf.patch(model, backend="torch")
    assert model.config._attn_implementation != "kvquant"
    del model.config.quantization_config
    handle = kvhf.patch(model, backend="torch")  # no declared quantization: warned, dynamic
    assert {s.granularity for s in handle.state.layer_specs} == {"fp32-group"}


@pytest.mark.parametrize(
    "mapping",
    [{}, {"model.layers.0.self_attn.k_scal": torch.tensor(0.1)}, {"lm_head.weight": torch.ones(1)}],
)
def test_explicit_mapping_naming_nothing_is_an_error(tiny_llama: Any, mapping: dict) -> None:
    with pytest.raises(ScaleFormatError, match="names no tensor kvquant recognises"):
        kvhf.patch(tiny_llama, scales=mapping, backend="torch")
    assert not hasattr(tiny_llama, "_kvquant_state")
    # a dynamic format uses no stored scale: scales={} then means "read nothing"
    handle = kvhf.patch(tiny_llama, scales=mapping, scale_format="fp32-group", backend="torch")
    assert handle.state.options.source == "mapping"
    assert {s.granularity for s in handle.state.layer_specs} == {"fp32-group"}


@pytest.mark.parametrize(
    "other", ["self_attn.{k}_proj.{k}_scale", "self_attn.{k}_proj.output_scale"]
)
def test_mapping_with_two_namings_of_one_scale_is_refused(tiny_llama: Any, other: str) -> None:
    """As discovery refuses them in a folder (duplicate-scale), not one picked silently."""
    values = torch.rand(2) * 0.05 + 0.01
    mapping = {
        f"model.layers.{i}.self_attn.{k}_scale": values[:1].clone() for i in range(2) for k in "kv"
    }
    mapping["model.layers.1." + other.format(k="k")] = values[1].clone()  # a second K scale
    with pytest.raises(ScaleFormatError, match="layer 1 has two K scales"):
        kvhf.patch(tiny_llama, scales=mapping, backend="torch")
    assert not hasattr(tiny_llama, "_kvquant_state")


def test_scales_of_the_wrong_type(tiny_llama: Any) -> None:
    with pytest.raises(OptionTypeError):
        kvhf.patch(tiny_llama, scales=42, backend="torch")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        kvhf.patch(tiny_llama, scales=42, backend="torch")  # type: ignore[arg-type]


@pytest.mark.parametrize("key", [0, b"model.layers.0.self_attn.k_scale", ("k", 0)])
def test_scales_mapping_with_a_key_that_is_not_a_name(tiny_llama: Any, key: object) -> None:
    with pytest.raises(OptionTypeError, match=r"kvquant\.patch: scales has the key"):
        kvhf.patch(tiny_llama, scales={key: torch.tensor(0.1)}, backend="torch")
    assert not hasattr(tiny_llama, "_kvquant_state")


def _bin_only(tmp_path: Path) -> Path:
    src = write_checkpoint(tmp_path / "src", convention="none")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src))
    out = tmp_path / "bin"
    out.mkdir()
    (out / "config.json").write_text((src / "config.json").read_text())
    torch.save(model.state_dict(), out / "pytorch_model.bin")
    return out


def test_bin_only_refused_before_unpickling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _bin_only(tmp_path)

    def no_unpickling(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load was reached")

    monkeypatch.setattr(torch, "load", no_unpickling)
    with pytest.raises(CheckpointError, match="safetensors checkpoints only"):
        kvhf.from_pretrained(path, quantization_config=KVQuantConfig(backend="torch"))
    with pytest.raises(CheckpointError, match="safetensors checkpoints only"):
        transformers.AutoModelForCausalLM.from_pretrained(
            str(path), quantization_config=KVQuantConfig(backend="torch")
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_saved_scales_are_canonical_fp32_after_a_dtype_change(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    scales = {(0, "k"): 1e-10, (0, "v"): 0.0123, (1, "k"): 0.0123, (1, "v"): 1e-10}
    path = write_checkpoint(tmp_path / "ckpt", convention="modelopt", scales=scales)
    model = kvhf.from_pretrained(path, quantization_config=KVQuantConfig(backend="torch"))
    canonical = [(k.clone(), v.clone()) for k, v in _installed(model)]
    assert float(canonical[0][0]) == pytest.approx(1e-10, rel=1e-6)
    model.to(dtype)
    model.save_pretrained(tmp_path / "saved")
    stored = load_file(str(tmp_path / "saved" / "model.safetensors"))
    for layer, (k, v) in enumerate(canonical):
        for kind, want in (("k", k), ("v", v)):
            got = stored[f"model.layers.{layer}.self_attn.{kind}_scale"]
            assert got.dtype == torch.float32 and torch.equal(got, want)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    for (k, v), (k2, v2) in zip(_installed(again), canonical, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def _saved(model: Any, out: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    model.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    return load_file(str(out / "model.safetensors")), cfg


def test_remove_leaves_a_model_that_saves_as_if_never_patched(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "ckpt", convention="modelopt", scales=_random_scales())
    model = kvhf.from_pretrained(path, quantization_config=KVQuantConfig(backend="torch"))
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    model._kvquant_state.handle.remove()
    assert getattr(model.config, "quantization_config", None) is None
    assert getattr(model, "hf_quantizer", None) is None
    got, got_cfg = _saved(model, tmp_path / "removed")
    want, want_cfg = _saved(plain, tmp_path / "plain")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert "quantization_config" not in got_cfg
    for key in ("quantization_config", "_attn_implementation"):
        got_cfg.pop(key, None)
        want_cfg.pop(key, None)
    assert got_cfg == want_cfg
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "removed"))
    assert not hasattr(reloaded.model.layers[0].self_attn, "k_scale")


def test_patch_remove_on_a_plain_model_restores_its_state_dict(tiny_llama: Any) -> None:
    before = {k: v.clone() for k, v in tiny_llama.state_dict().items()}
    scales = {
        f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor([0.05])
        for i in range(2)
        for kind in "kv"
    }
    handle = kvhf.patch(tiny_llama, scales=scales, backend="torch")
    assert "model.layers.0.self_attn.k_scale" in tiny_llama.state_dict()
    handle.remove()
    after = tiny_llama.state_dict()
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_name_or_path_folder_without_weights_is_no_scale_source(
    tmp_path: Path, tiny_llama: Any
) -> None:
    folder = tmp_path / "config-only"
    tiny_llama.config.save_pretrained(folder)
    tiny_llama.name_or_path = str(folder)
    handle = kvhf.patch(tiny_llama, backend="torch")  # warned; nothing to read
    assert {s.granularity for s in handle.state.layer_specs} == {"fp32-group"}
    handle.remove()
    tiny_llama.config.quantization_config = {"quant_method": "modelopt"}
    with pytest.raises(CheckpointError, match=r"holds no config\.json and weights"):
        kvhf.patch(tiny_llama, backend="torch")
    del tiny_llama.config.quantization_config
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors checkpoints only"):
        kvhf.patch(tiny_llama, backend="torch")


@pytest.mark.parametrize(
    "other",
    [
        {"num_layers": 3},
        {"num_kv_heads": 4, "convention": "compressed-tensors", "granularity": "per-head"},
        {"head_dim": 32, "hidden_size": 64},  # per-tensor scales: shapes alone would pass
    ],
)
def test_scales_folder_of_another_model_is_refused(
    tiny_llama: Any, tmp_path: Path, other: dict[str, Any]
) -> None:
    """patch(scales=folder) refuses a checkpoint whose config.json describes another
    geometry than the model (tiny_llama: 2 layers, 2 KV heads, head_dim 16)."""
    options = {"convention": "modelopt", **other}
    path = write_checkpoint(tmp_path / "other", **options)  # type: ignore[arg-type]
    with pytest.raises(ScaleFormatError, match="pass the checkpoint the model was loaded from"):
        kvhf.patch(tiny_llama, scales=str(path), backend="torch")
    assert not hasattr(tiny_llama, "_kvquant_state")


def test_variant_weights_are_refused_at_load_time(tmp_path: Path) -> None:
    """transformers loads model.<variant>.safetensors; kvquant would read model.safetensors'
    scales: refused, not read from the other file."""
    import shutil

    path = write_checkpoint(tmp_path / "ckpt", convention="modelopt", scales=_random_scales())
    shutil.copyfile(path / "model.safetensors", path / "model.fp16.safetensors")
    for load in (
        lambda: kvhf.from_pretrained(
            path, variant="fp16", quantization_config=KVQuantConfig(backend="torch")
        ),
        lambda: transformers.AutoModelForCausalLM.from_pretrained(
            str(path), variant="fp16", quantization_config=KVQuantConfig(backend="torch")
        ),
    ):
        with pytest.raises(CheckpointError, match="no variant="):
            load()


A_COMMIT, B_COMMIT = "a" * 40, "b" * 40


def _two_revisions(tmp_path: Path, hf_cache: Path, *, same: bool = False) -> dict[str, float]:
    """org/two in the cache: revision A (tag v1, K/V scales 0.25) and main (B, scales 4.0, or
    0.25 too when ``same``); the weights are the same."""
    values = {"A": 0.25, "B": 0.25 if same else 4.0}
    for rev, commit, ref in (("A", A_COMMIT, "v1"), ("B", B_COMMIT, "main")):
        scales = {(i, k): values[rev] for i in range(2) for k in "kv"}
        src = write_checkpoint(tmp_path / rev, convention="modelopt", scales=scales)
        write_hf_cache_entry(hf_cache, "org/two", src, commit=commit, ref=ref)
    return values


def _k0(model: Any) -> float:
    return float(model.model.layers[0].self_attn.k_scale)


@pytest.mark.parametrize("revision", ["v1", A_COMMIT])
def test_patch_reads_the_revision_the_model_was_loaded_at_or_refuses(
    tmp_path: Path, hf_cache: Path, revision: str
) -> None:
    """transformers 5.17 records the commit (config._commit_hash): revision A's scales;
    5.24 records nothing: the two snapshots differ, so patch refuses; never main's."""
    _two_revisions(tmp_path, hf_cache)
    model = transformers.AutoModelForCausalLM.from_pretrained("org/two", revision=revision)
    if getattr(model.config, "_commit_hash", None):
        kvhf.patch(model, backend="torch")
        assert _k0(model) == 0.25
    else:
        with pytest.raises(CheckpointError, match="does not record the revision") as info:
            kvhf.patch(model, backend="torch")
        assert "2 snapshots" in str(info.value) and "(main)" in str(info.value)
        assert not hasattr(model, "_kvquant_state")
        snapshot = hf_cache / "models--org--two" / "snapshots" / A_COMMIT
        kvhf.patch(model, scales=snapshot, backend="torch")  # the fix the message names
        assert _k0(model) == 0.25


@pytest.mark.parametrize("revision", ["v1", A_COMMIT])
def test_load_time_doors_read_the_revision_they_load(
    tmp_path: Path, hf_cache: Path, revision: str
) -> None:
    _two_revisions(tmp_path, hf_cache)
    qc = KVQuantConfig(backend="torch")
    via_kvquant = kvhf.from_pretrained("org/two", revision=revision, quantization_config=qc)
    via_transformers = transformers.AutoModelForCausalLM.from_pretrained(
        "org/two", revision=revision, quantization_config=qc
    )
    assert _k0(via_kvquant) == _k0(via_transformers) == 0.25
    main = kvhf.from_pretrained("org/two", quantization_config=qc)
    assert _k0(main) == 4.0


def test_snapshots_with_the_same_scales_are_not_ambiguous(tmp_path: Path, hf_cache: Path) -> None:
    _two_revisions(tmp_path, hf_cache, same=True)
    model = transformers.AutoModelForCausalLM.from_pretrained("org/two", revision="v1")
    kvhf.patch(model, backend="torch")
    assert _k0(model) == 0.25


def test_only_snapshot_without_refs_main(tmp_path: Path, hf_cache: Path) -> None:
    """A repo downloaded at a tag only (no refs/main): its one snapshot is the loaded one."""
    src = write_checkpoint(tmp_path / "src", convention="modelopt", scales={(0, "k"): 0.5})
    write_hf_cache_entry(hf_cache, "org/tagged", src, commit=A_COMMIT, ref="v1")
    model = transformers.AutoModelForCausalLM.from_pretrained("org/tagged", revision="v1")
    kvhf.patch(model, backend="torch")
    assert _k0(model) == 0.5


def test_hub_id_not_cached_is_refused_at_once_without_network(
    hf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvquant never downloads: online mode, no socket may be opened, the refusal is immediate."""
    import socket
    import time

    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("kvquant.from_pretrained opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="hf download org/absent --revision v2"):
        kvhf.from_pretrained("org/absent", revision="v2")
    with pytest.raises(CheckpointError, match=r"\(hf download org/absent\)"):
        kvhf.from_pretrained("org/absent", quantization_config=KVQuantConfig(backend="torch"))
    assert time.monotonic() - start < 2.0


def test_cached_hub_id_loads_with_local_files_only(
    tmp_path: Path, hf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cached id loads in online mode without touching the network."""
    import socket

    from huggingface_hub import constants

    src = write_checkpoint(tmp_path / "src", convention="modelopt", scales={(0, "k"): 0.5})
    write_hf_cache_entry(hf_cache, "org/cached", src, commit=COMMIT)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("kvquant.from_pretrained opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    model = kvhf.from_pretrained("org/cached", quantization_config=KVQuantConfig(backend="torch"))
    assert float(model.model.layers[0].self_attn.k_scale) == 0.5


@pytest.mark.parametrize("bad", [None, 3, b"path", ["a"]])
def test_from_pretrained_path_of_the_wrong_type(bad: object) -> None:
    with pytest.raises(OptionTypeError, match="from_pretrained: path is a"):
        kvhf.from_pretrained(bad)  # type: ignore[arg-type]


def test_from_pretrained_quantization_config_of_the_wrong_type(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "c", convention="modelopt")
    with pytest.raises(OptionTypeError, match=r"expected a kvquant\.KVQuantConfig"):
        kvhf.from_pretrained(path, quantization_config={"quant_method": "kvquant"})  # type: ignore[arg-type]


def test_from_pretrained_of_another_file_names_the_folder(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "c", convention="modelopt")
    (path / "notes.json").write_text("{}")
    with pytest.raises(CheckpointError, match="expected a checkpoint folder"):
        kvhf.from_pretrained(path / "notes.json")


def test_a_draft_model_with_fewer_layers_gets_its_layers_scales(tmp_path: Path) -> None:
    """from_pretrained(folder, num_hidden_layers=M) loads the checkpoint's first M layers (a
    draft model for assisted decoding): every door gives it those layers' scales."""
    scales = {(i, k): 0.01 * (i + 1) + (0.001 if k == "v" else 0.0) for i in range(3) for k in "kv"}
    path = write_checkpoint(tmp_path / "ckpt", convention="modelopt", num_layers=3, scales=scales)
    qc = KVQuantConfig(backend="torch")
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(path), num_hidden_layers=1)
    kvhf.patch(plain, backend="torch")
    loaded = [
        plain,
        kvhf.from_pretrained(path, num_hidden_layers=2, quantization_config=qc),
        transformers.AutoModelForCausalLM.from_pretrained(
            str(path), num_hidden_layers=2, quantization_config=qc
        ),
    ]
    for model in loaded:
        got = [float(t) for pair in _installed(model) for t in pair]
        want = [scales[(i, k)] for i in range(len(got) // 2) for k in "kv"]
        assert got == pytest.approx(want, rel=1e-6)
    # more layers than the checkpoint has: refused, naming the real mismatch
    longer = transformers.AutoModelForCausalLM.from_pretrained(str(path), num_hidden_layers=4)
    with pytest.raises(ScaleFormatError, match="the checkpoint config has 3 layers"):
        kvhf.patch(longer, backend="torch")
    assert not hasattr(longer, "_kvquant_state")


def test_subfolder_loads_are_read_from_the_subfolder_or_refused(tmp_path: Path) -> None:
    """transformers does not record from_pretrained(path, subfolder=...): patch reads the
    subfolder when it is the only checkpoint there, refuses when the folder and a subfolder
    both fit the model with different scales, and ignores subfolders of another geometry."""
    import shutil

    def ckpt(path: Path, value: float, **kw: Any) -> Path:
        scales = {(i, k): value for i in range(2) for k in "kv"}
        return write_checkpoint(path, convention="modelopt", scales=scales, seed=1, **kw)

    only_sub = tmp_path / "only-sub"
    ckpt(only_sub / "sub", 0.25)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(only_sub), subfolder="sub")
    kvhf.patch(model, backend="torch")
    assert _k0(model) == 0.25

    both = ckpt(tmp_path / "both", 4.0)
    shutil.copytree(only_sub / "sub", both / "sub")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(both), subfolder="sub")
    with pytest.raises(CheckpointError, match=r"does not record a subfolder= load") as info:
        kvhf.patch(model, backend="torch")
    assert "(., sub:" in str(info.value) and not hasattr(model, "_kvquant_state")
    kvhf.patch(model, scales=both / "sub", backend="torch")
    assert _k0(model) == 0.25
    qc = KVQuantConfig(backend="torch")
    assert _k0(kvhf.from_pretrained(both, subfolder="sub", quantization_config=qc)) == 0.25
    assert _k0(kvhf.from_pretrained(both, quantization_config=qc)) == 4.0

    with_draft = ckpt(tmp_path / "draft-beside", 4.0)
    ckpt(with_draft / "draft", 0.25, num_layers=1)  # another geometry: not a candidate
    model = transformers.AutoModelForCausalLM.from_pretrained(str(with_draft))
    kvhf.patch(model, backend="torch")
    assert _k0(model) == 4.0
