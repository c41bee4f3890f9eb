"""``kv_format="nvfp4"`` / ``"mxfp4"`` with a k-transform calibration: 4-bit K in the transform's
frame (rotation, offset, first tokens at full precision) beside 4-bit V, through
``kvquant.patch`` (tiny fp32 Llamas with biased keys, CPU).

The patched model's step logits are compared with an independent simulation: the unpatched
model over transformers' own cache whose decode steps attend (SDPA) with the query rotated,
the keys ``round_4bit(k R - c) + c`` and the values ``round_4bit(v)``, each row's first visible
tokens exact (``k R``, ``v``); the prompt step attends over the exact K/V in both. Before this
format was served, ``fp4_spec`` dropped the transform (plain 4-bit K): the simulation then
differs by the 4-bit error itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_kt import biased_llama, k_transform_scales
from hf_steps import min_cosine, step_logits
from hf_tiny import VOCAB, prompt
from test_hf_continuous_batching import alone, assert_same, cb_config, gen_config, prompts, run_of

import kvquant.integrations.hf as kvhf
from kvquant.calibrate.fp8 import fake_quantize_fp4
from kvquant.errors import OptionError, ScaleFormatError
from kvquant.integrations.hf import continuous
from kvquant.kernels import hadamard

transformers = pytest.importorskip("transformers")

SIM = "kvquant_k_transform_fp4_simulation"
FORMATS = [("nvfp4", None), ("mxfp4", 32)]  # (kv_format, head_dim: MXFP4's block is 32)


def _starts(mask: Any, key: torch.Tensor) -> list[int]:
    """Each row's first visible key position, from the decode step's attention mask."""
    if mask is None:
        return [0] * key.shape[0]
    visible = mask[:, 0, -1] if mask.dtype == torch.bool else mask[:, 0, -1] == 0
    return [int(row.float().argmax()) for row in visible]


def _register_simulation(fmt: str, scales: dict[str, Any], d: int, first_tokens: int) -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    rot = hadamard(d)

    def attention(module: Any, query: Any, key: Any, value: Any, mask: Any, **kw: Any) -> Any:
        if query.shape[2] == 1:  # a decode step: K/V as the cache holds them
            c = scales[f"model.layers.{module.layer_idx}.self_attn.k_offset"].to(key.device)
            r = rot.to(key.device)
            kr = key.float() @ r
            k = fake_quantize_fp4(kr - c[None, :, None, :], fmt) + c[None, :, None, :]
            v = fake_quantize_fp4(value, fmt)
            for b, s in enumerate(_starts(mask, key)):  # the side buffer: exact
                k[b, :, s : s + first_tokens] = kr[b, :, s : s + first_tokens]
                v[b, :, s : s + first_tokens] = value[b, :, s : s + first_tokens].float()
            query = (query.float() @ r).to(query.dtype)
            key, value = k.to(key.dtype), v.to(value.dtype)
        return sdpa_attention_forward(module, query, key, value, mask, **kw)

    AttentionInterface.register(SIM, attention)
    AttentionMaskInterface.register(SIM, sdpa_mask)


def _simulated(model: Any, fmt: str, scales: dict[str, Any], first_tokens: int, fn: Any) -> Any:
    """``fn()`` with the model's attention switched to the simulation."""
    _register_simulation(fmt, scales, int(model.config.head_dim), first_tokens)
    model.set_attn_implementation(SIM)
    try:
        return fn()
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(("kv_format", "head_dim"), FORMATS, ids=[f for f, _ in FORMATS])
def test_decode_matches_a_simulation_of_4bit_k_in_the_transforms_frame(
    kv_format: str, head_dim: int | None, backend: str
) -> None:
    """Left padding (each row's first visible tokens kept), two first tokens per row."""
    model = biased_llama(head_dim=head_dim)
    scales = k_transform_scales(model, first_tokens=2)
    ids, mask = prompt(batch=2, length=10, pad=(0, 3), seed=1)
    cont = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    plain, _ = step_logits(model, ids, mask, cont)
    handle = kvhf.patch(model, scales=scales, kv_format=kv_format, backend=backend, recent_tokens=0)
    got, cache = step_logits(model, ids, mask, cont)
    storage = cache.layers[0].storage
    assert type(storage).__name__ == "KTransformFp4Storage"
    assert storage.granularity == f"k-transform-{kv_format}"
    assert storage.k_rotation is not None and storage.k_offset is not None
    assert storage.k_pages.dtype == torch.uint8 and storage.first_tokens == 2
    assert storage.first_tensors()[3].tolist() == [0, 3]  # left padding
    handle.remove()
    sim, _ = _simulated(model, kv_format, scales, 2, lambda: step_logits(model, ids, mask, cont))
    assert torch.allclose(got[:, 0], plain[:, 0], atol=1e-5)  # the prompt step: exact
    to_sim = float((got - sim).abs().max())
    to_plain = float((got - plain)[:, 1:].abs().max())
    # measured: to_sim 9e-8 / 1.2e-7 (torch, nvfp4 / mxfp4), 3.5e-5 / 6.2e-5 (triton: fp16
    # queries and probabilities); to_plain 0.021 / 0.037, the 4-bit error; K stored as plain
    # 4-bit (the transform dropped) is 0.021 / 0.028 from the simulation
    assert to_sim < 5e-4, to_sim
    assert to_plain > 5 * to_sim, (to_plain, to_sim)
    assert bool(torch.isfinite(got).all()) and min_cosine(got, plain) > 0.99


def test_greedy_generate_equals_the_simulation_and_remove_restores() -> None:
    model = biased_llama()
    scales = k_transform_scales(model)
    ids, mask = prompt(batch=2, length=10, pad=(0, 3), seed=2)
    kw: dict[str, Any] = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)

    def generate() -> Any:
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, **kw)

    unpatched = generate()
    sim = _simulated(model, "nvfp4", scales, 1, generate)
    handle = kvhf.patch(
        model, scales=scales, kv_format="nvfp4", backend="torch", page_size=4, recent_tokens=0
    )
    assert handle.scales.granularity == "k-transform"
    assert [s.granularity for s in handle.state.layer_specs] == ["k-transform-nvfp4"] * 2
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, sim)
    storage = out.past_key_values.layers[0].storage
    assert type(storage).__name__ == "KTransformFp4Storage"
    assert storage.first_tokens == 1 and storage.first_tensors()[2].tolist() == [1, 1]
    handle.remove()
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(generate(), unpatched)


@pytest.mark.parametrize(("kv_format", "head_dim"), FORMATS, ids=[f for f, _ in FORMATS])
def test_static_decode_step_equals_the_eager_one(kv_format: str, head_dim: int | None) -> None:
    """cuda_graphs=True on CPU runs the decode steps through the graph runner's static
    buffers (the path a CUDA graph captures; the scheme and side buffer as step kwargs):
    the same tokens and logits as eager steps."""
    ids, mask = prompt(batch=2, length=10, pad=(0, 3), seed=4)
    outs = []
    for graphs in (False, True):
        model = biased_llama(head_dim=head_dim)
        handle = kvhf.patch(model, scales=k_transform_scales(model, first_tokens=2),
                            kv_format=kv_format, backend="torch", cuda_graphs=graphs)  # fmt: skip
        assert (handle.state.graph_runner is not None) == graphs
        with torch.no_grad():
            outs.append(
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                               do_sample=False, output_logits=True, return_dict_in_generate=True)
            )  # fmt: skip
    assert outs[1].past_key_values.layers[0].storage.granularity == f"k-transform-{kv_format}"
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].logits, outs[1].logits, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kv_format", ["nvfp4", "fp8-k-nvfp4-v"])
def test_a_saved_patched_model_holds_the_offsets_and_is_refused_without_its_settings_file(
    kv_format: str, tmp_path: Path
) -> None:
    """As with FP8 K in the k-transform's frame: the 4-bit layers hold their K offsets, so a
    saved copy is refused (not reloaded with K scales calibrated for the transformed K and no
    transform); the state dict round-trips; remove() drops the buffers."""
    model = biased_llama()
    before = sorted(name for name, _ in model.named_buffers())
    scales = k_transform_scales(model)
    handle = kvhf.patch(model, scales=scales, kv_format=kv_format, backend="torch")
    held = dict(model.named_buffers())
    offset = held["model.layers.0.self_attn.k_offset"]
    assert torch.equal(offset, scales["model.layers.0.self_attn.k_offset"])
    model.load_state_dict(model.state_dict())
    model.save_pretrained(tmp_path)
    copy = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    with pytest.raises(ScaleFormatError, match="k-offset-without-transform"):
        kvhf.patch(copy, scales=tmp_path, kv_format=kv_format, backend="torch")
    handle.remove()
    assert sorted(name for name, _ in model.named_buffers()) == before


def test_the_decision_line_says_k_is_in_the_transforms_frame(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = biased_llama()
    with caplog.at_level("INFO", logger="kvquant"):
        kvhf.patch(
            model, scales=k_transform_scales(model), kv_format="nvfp4", backend="torch"
        ).remove()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvquant.patch")]
    assert any("K in the k-transform's frame" in line for line in lines), lines
    # its static scales serve K's frame: no warning that they go unused
    assert not any("does not use" in r.getMessage() for r in caplog.records)


def test_a_layer_map_keeps_the_transform_for_each_4bit_layer() -> None:
    ids, mask = prompt(batch=1, length=8, pad=(0,))
    model = biased_llama(head_dim=32)
    handle = kvhf.patch(
        model,
        scales=k_transform_scales(model),
        kv_format={0: "mxfp4", 1: "nvfp4"},
        backend="torch",
    )
    assert [s.granularity for s in handle.state.layer_specs] == [
        "k-transform-mxfp4",
        "k-transform-nvfp4",
    ]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
            return_dict_in_generate=True,
        )  # fmt: skip
    formats = [layer.storage.scheme.k_format.name for layer in out.past_key_values.layers]
    assert formats == ["mxfp4", "nvfp4"]
    handle.remove()


def test_k_rotation_beside_the_transform_is_refused_before_any_change() -> None:
    model = biased_llama()
    with pytest.raises(OptionError, match=r"k_rotation='hadamard'.*k-transform.*Fix:"):
        kvhf.patch(
            model, scales=k_transform_scales(model), kv_format="nvfp4", k_rotation="hadamard",
            backend="torch",
        )  # fmt: skip
    assert model.config._attn_implementation == "sdpa"
    kvhf.patch(model, kv_format="nvfp4", k_rotation="hadamard", backend="torch").remove()


@pytest.mark.parametrize("recent", [0, 8])
def test_continuous_batching_equals_each_requests_own_generate(recent: int) -> None:
    """Also with a ring of 8 newest tokens (keys in the transform's frame, before its offset)."""
    model = biased_llama()
    kvhf.patch(
        model, scales=k_transform_scales(model), kv_format="nvfp4", backend="torch",
        recent_tokens=recent,
    )  # fmt: skip
    reqs = prompts((3, 9, 17, 30))
    out = model.generate_batch(
        reqs, generation_config=gen_config(), continuous_batching_config=cb_config(), warmup=False
    )
    got = [run_of(out[f"req_{i}"]) for i in range(len(reqs))]
    assert_same(got, [alone(model, ids) for ids in reqs])
    assert continuous.live_caches() == []


@pytest.mark.gpu
@pytest.mark.parametrize(("kv_format", "head_dim"), FORMATS, ids=[f for f, _ in FORMATS])
def test_triton_kernels_and_cuda_graphs_on_gpu(kv_format: str, head_dim: int | None) -> None:
    """CUDA, backend="triton", decode graphs: within the reference's logits."""
    ids, mask = prompt(batch=3, length=40, pad=(5, 0, 9), seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    cont = torch.randint(3, VOCAB, (3, 24), generator=torch.Generator().manual_seed(5)).cuda()
    model = biased_llama(head_dim=head_dim).to(device="cuda", dtype=torch.bfloat16)
    scales = k_transform_scales(model, first_tokens=2)
    handle = kvhf.patch(
        model, scales=scales, kv_format=kv_format, backend="triton", cuda_graphs=True
    )
    got, cache = step_logits(model, ids, mask, cont)
    assert handle.state.graph_runner.stats.replays > 0
    assert cache.layers[0].storage.first_start.tolist() == [5, 0, 9]
    handle.remove()
    kvhf.patch(model, scales=scales, kv_format=kv_format, backend="torch", cuda_graphs=False)
    ref, _ = step_logits(model, ids, mask, cont)
    assert bool(torch.isfinite(got).all())
    assert min_cosine(got, ref) >= 0.999
