"""The k-transform format on a transformers model (tiny Llama, torch reference backend).

The model's keys carry large near-constant channels (a random k_proj bias, rotated by RoPE
only in the fast channels, as in real models); the transform (per-channel K offset,
Hadamard rotation, first tokens at full precision) is calibrated from a prompt of its own.
Logits are compared with the unpatched model (FP8 tolerance) and with runs that must give
the same numbers (a padded row against the same row unpadded, a reordered cache against the
row it copied), and the first-token side buffer against the unpatched model's keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_kt import HKV, D, biased_llama, k_transform_scales, unpatched_kv
from hf_steps import cache_kwarg, min_cosine, returned_cache, step_logits
from hf_tiny import VOCAB, prompt

import kvquant.integrations.hf as kvhf
from kvquant.checkpoint.producers import KV_TRANSFORM_FILE
from kvquant.errors import ScaleFormatError
from kvquant.kernels import hadamard

transformers = pytest.importorskip("transformers")


def _continuation(batch: int = 2, steps: int = 6) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, steps), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize(
    ("rotation", "first_tokens"), [("hadamard", 1), (None, 2), ("hadamard", 0)]
)
def test_logits_within_fp8_of_the_unpatched_model(rotation: str | None, first_tokens: int) -> None:
    ids, mask = prompt(batch=2, length=10, pad=(0, 3), seed=1)
    cont = _continuation()
    want, _ = step_logits(biased_llama(), ids, mask, cont)
    model = biased_llama()
    handle = kvhf.patch(
        model, scales=k_transform_scales(model, rotation, first_tokens), backend="torch"
    )
    assert handle.scales.granularity == "k-transform"
    assert handle.scales.k_transform.rotation == rotation
    got, cache = step_logits(model, ids, mask, cont)
    assert bool(torch.isfinite(got).all())
    assert min_cosine(got, want) > 0.999
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())
    storage = cache.layers[0].storage
    assert storage.granularity == "k-transform" and storage.first_tokens == first_tokens
    assert (storage.k_rotation is not None) == (rotation is not None)


def test_first_tokens_are_the_first_visible_keys_of_each_row() -> None:
    """Left padding: row b's first tokens are at kv_start[b], rotated, at full precision."""
    ids, mask = prompt(batch=2, length=10, pad=(0, 3), seed=1)
    ref = biased_llama()
    kv = unpatched_kv(ref, ids, mask)
    model = biased_llama()
    kvhf.patch(model, scales=k_transform_scales(model, first_tokens=2), backend="torch")
    _, cache = step_logits(model, ids, mask, _continuation(steps=3))
    for layer, (k, _v) in zip(cache.layers, kv, strict=True):
        storage = layer.storage
        assert storage.first_start.tolist() == [0, 3] and storage.first_lens.tolist() == [2, 2]
        for b, start in enumerate((0, 3)):
            want = k[b, :, start : start + 2].transpose(0, 1) @ hadamard(D)  # [2, Hkv, D]
            torch.testing.assert_close(storage.first_k[b], want, rtol=1e-5, atol=1e-5)
    # the keys dense() gives back are in the model's frame, within FP8 rounding
    dense_k, _ = cache.layers[1].dense_kv(torch.float32)
    assert min_cosine(dense_k[:, :, :10].flatten(2), kv[1][0].flatten(2)) > 0.999


def test_a_padded_row_gives_the_same_logits_as_the_row_alone() -> None:
    ids, mask = prompt(batch=2, length=10, pad=(0, 3), seed=1)
    cont = _continuation()
    model = biased_llama()
    kvhf.patch(model, scales=k_transform_scales(model), backend="torch")
    batch, _ = step_logits(model, ids, mask, cont)
    alone, _ = step_logits(model, ids[1:, 3:], mask[1:, 3:], cont[1:])
    torch.testing.assert_close(batch[1:], alone, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_keeps_the_first_tokens_of_a_row_padded_past_the_first_chunk() -> None:
    """Row 1 is all padding in the first chunk: its window starts in the second one."""
    ids, mask = prompt(batch=2, length=12, pad=(0, 7), seed=2)
    ref = biased_llama()
    kv = unpatched_kv(ref, ids, mask)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
    model = biased_llama()
    kvhf.patch(model, scales=k_transform_scales(model, first_tokens=2), backend="torch")
    key = cache_kwarg(model)
    cache = None
    with torch.no_grad():
        for lo, hi in ((0, 6), (6, 12)):
            out = model(
                input_ids=ids[:, lo:hi],
                attention_mask=mask[:, :hi],
                position_ids=pos[:, lo:hi],
                **{key: cache},
            )
            cache = returned_cache(out)
    got = out.logits[:, -1]
    assert min_cosine(got, want) > 0.999
    for layer, (k, _v) in zip(cache.layers, kv, strict=True):
        storage = layer.storage
        assert storage.first_start.tolist() == [0, 7] and storage.first_lens.tolist() == [2, 2]
        expect = k[1, :, 7:9].transpose(0, 1) @ hadamard(D)
        torch.testing.assert_close(storage.first_k[1], expect, rtol=1e-5, atol=1e-5)


def test_beam_reorder_moves_pages_and_first_tokens_together() -> None:
    ids, mask = prompt(batch=2, length=10, pad=(0, 3), seed=1)
    cont = _continuation(steps=2)
    model = biased_llama()
    kvhf.patch(model, scales=k_transform_scales(model, first_tokens=2), backend="torch")
    ref, _ = step_logits(model, ids, mask, cont)
    _, cache = step_logits(model, ids, mask, cont[:, :1])
    cache.reorder_cache(torch.tensor([1, 1]))
    # both rows now hold row 1's context (left padding 3): feed row 1's next token to both
    mask2 = torch.cat([mask[[1, 1]], torch.ones(2, 2, dtype=mask.dtype)], dim=1)
    pos = (mask2.cumsum(-1) - 1)[:, -1:]
    with torch.no_grad():
        out = model(
            input_ids=cont[[1, 1], 1:2],
            attention_mask=mask2,
            position_ids=pos,
            **{cache_kwarg(model): cache},
        )
    torch.testing.assert_close(out.logits[:, -1], ref[[1, 1], 2], rtol=1e-5, atol=1e-5)


def test_greedy_generate_and_assisted_decoding_crop() -> None:
    ids, mask = prompt(batch=1, length=10, pad=(0,))
    kw: dict[str, Any] = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)
    with torch.no_grad():
        want = biased_llama().generate(input_ids=ids, attention_mask=mask, **kw)
    model = biased_llama()
    kvhf.patch(model, scales=k_transform_scales(model), backend="torch", page_size=4)
    with torch.no_grad():
        greedy = model.generate(input_ids=ids, attention_mask=mask, **kw)
        assisted = model.generate(
            input_ids=ids, attention_mask=mask, assistant_model=biased_llama(seed=7), **kw
        )
    assert torch.equal(greedy, want)
    assert torch.equal(assisted, want)
    ids, mask = prompt(batch=2, length=10, pad=(0, 3), seed=1)
    with torch.no_grad():
        beams = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, num_beams=3
        )
    assert beams.shape == (2, 18) and torch.equal(beams[:, :10], ids)  # FP8 may flip beams


def test_decode_steps_through_the_static_buffers_match_eager_steps() -> None:
    """cuda_graphs=True on CPU runs the graph runner's static step (once the first tokens are in)."""
    ids, mask = prompt(batch=2, length=10, pad=(0, 3), seed=1)
    kw: dict[str, Any] = dict(max_new_tokens=6, do_sample=False)
    outs = []
    for graphs in (False, True):
        model = biased_llama()
        handle = kvhf.patch(
            model, scales=k_transform_scales(model, first_tokens=2), backend="torch",
            cuda_graphs=graphs,
        )  # fmt: skip
        with torch.no_grad():
            outs.append(model.generate(input_ids=ids, attention_mask=mask, **kw))
        if graphs:
            assert handle.state.graph_runner.stats.static_eager >= 4
    assert torch.equal(outs[0], outs[1])


def test_remove_restores_the_unpatched_model_exactly() -> None:
    ids, mask = prompt(batch=2, length=10, pad=(0, 3), seed=1)
    with torch.no_grad():
        want = biased_llama()(input_ids=ids, attention_mask=mask).logits
    model = biased_llama()
    before = sorted(name for name, _ in model.named_buffers())
    handle = kvhf.patch(model, scales=k_transform_scales(model), backend="torch")
    assert "model.layers.0.self_attn.k_offset" in dict(model.named_buffers())
    step_logits(model, ids, mask, _continuation(steps=2))
    handle.remove()
    assert sorted(name for name, _ in model.named_buffers()) == before
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, want)


def test_a_saved_patched_model_is_refused_without_its_settings_file(tmp_path: Path) -> None:
    """save_pretrained writes the canonical K offsets; without the settings file the copy is refused."""
    model = biased_llama()
    kvhf.patch(model, scales=k_transform_scales(model), backend="torch")
    model.save_pretrained(tmp_path)
    copy = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    with pytest.raises(ScaleFormatError, match="k-offset-without-transform"):
        kvhf.patch(copy, scales=tmp_path, backend="torch")
    assert not hasattr(copy, "_kvquant_state")


def test_patch_from_a_k_transform_checkpoint_folder(tmp_path: Path) -> None:
    """Auto-detection from a folder written in kvquant's convention (patch(scales=folder))."""
    from safetensors.torch import save_file

    model = biased_llama()
    mapping = k_transform_scales(model)
    model.save_pretrained(tmp_path)
    tensors = {k: v.contiguous() for k, v in mapping.items() if isinstance(v, torch.Tensor)}
    save_file(tensors, str(tmp_path / "kv.safetensors"))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "model.safetensors"))
    save_file({**state, **tensors}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text((tmp_path / "config.json").read_text())
    (folder / KV_TRANSFORM_FILE).write_text(json.dumps(mapping[KV_TRANSFORM_FILE]))
    loaded = kvhf.from_pretrained(folder, quantization_config=kvhf.KVQuantConfig(backend="torch"))
    scales = loaded._kvquant_state.model_scales
    assert scales.granularity == "k-transform"
    for layer in range(2):
        offset = mapping[f"model.layers.{layer}.self_attn.k_offset"]
        assert torch.equal(scales[layer].k_offset, offset)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: m.pop(KV_TRANSFORM_FILE), "no 'kvquant_kv_transform.json' entry"),
        (
            lambda m: [m.pop(f"model.layers.{i}.self_attn.k_offset") for i in range(2)],
            "holds no model.layers.N.self_attn.k_offset",
        ),
        (lambda m: m[KV_TRANSFORM_FILE].update(head_dim=64), "head_dim is 64"),
        (
            lambda m: m.update({"model.layers.1.self_attn.k_offset": torch.zeros(HKV, 8)}),
            r"k_offset has shape \(2, 8\)",
        ),
    ],
)
def test_broken_k_transform_mappings_are_refused_before_any_change(edit: Any, match: str) -> None:
    model = biased_llama()
    mapping = k_transform_scales(model)
    edit(mapping)
    with pytest.raises(ScaleFormatError, match=match):
        kvhf.patch(model, scales=mapping, backend="torch")
    assert not hasattr(model, "_kvquant_state")
    assert model.config._attn_implementation == "sdpa"


def test_a_static_format_without_the_transform_is_refused() -> None:
    model = biased_llama()
    with pytest.raises(ScaleFormatError, match='scale_format="per-head" resolves per-head'):
        kvhf.patch(
            model, scales=k_transform_scales(model), scale_format="per-head", backend="torch"
        )
    handle = kvhf.patch(
        model, scales=k_transform_scales(model), scale_format="fp32-group", backend="torch"
    )
    assert handle.scales.granularity == "fp32-group"
    assert any("K transform" in n for n in handle.scales.notes)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernels_and_cuda_graphs_on_gpu(dtype: torch.dtype) -> None:
    """CUDA, backend="triton", decode graphs: the unpatched model within FP8, the reference closer."""
    ids, mask = prompt(batch=3, length=40, pad=(5, 0, 9), seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    cont = torch.randint(3, VOCAB, (3, 24), generator=torch.Generator().manual_seed(5)).cuda()
    model = biased_llama().to(device="cuda", dtype=dtype)
    scales = k_transform_scales(model, first_tokens=2)
    want, _ = step_logits(model, ids, mask, cont)
    handle = kvhf.patch(model, scales=scales, backend="triton", cuda_graphs=True)
    got, cache = step_logits(model, ids, mask, cont)
    runner = handle.state.graph_runner
    assert runner.stats.replays > 0 and cache.layers[0].k_pages.is_cuda
    assert cache.layers[0].storage.first_start.tolist() == [5, 0, 9]
    assert bool(torch.isfinite(got).all())
    assert min_cosine(got, want) >= (0.995 if dtype == torch.bfloat16 else 0.999)
    handle.remove()
    kvhf.patch(model, scales=scales, backend="torch", cuda_graphs=False)
    ref, _ = step_logits(model, ids, mask, cont)
    assert min_cosine(got, ref) >= 0.9999
