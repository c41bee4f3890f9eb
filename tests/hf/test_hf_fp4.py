"""kvquant.patch(model, kv_format=...) with 4-bit caches on a tiny Llama (head_dim 32).

The patched model's teacher-forced step logits are compared with an independent simulation:
the unpatched model over a plain ``DynamicCache`` whose decode steps attend (SDPA) over K/V
passed through the 4-bit quantize-dequantize of :mod:`kvquant.kernels.fp4` (per token, so
quantizing at attention time equals storing quantized); the prompt step attends over the
exact K/V in both (kvquant's first update returns the prompt's own K/V). The patched logits
must match that simulation far more closely than they match the unpatched model's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_steps import step_logits
from hf_tiny import _COMMON, VOCAB, prompt

import kvquant.integrations.hf as kvhf
from kvquant.errors import OptionError
from kvquant.integrations.hf.cache_layer import KVQuantCache
from kvquant.kernels.fp4 import MXFP4, NVFP4, dequantize_fp4, quantize_fp4
from kvquant.kernels.fp8 import quantize_fp8
from kvquant.schemes import DYNAMIC_NVFP4_GLOBAL_SCALE

transformers = pytest.importorskip("transformers")

SIM = "kvquant_fp4_simulation"


def _tiny(seed: int = 0, head_dim: int = 32) -> Any:
    """A tiny random Llama with head_dim 32 (one MXFP4 block; or ``head_dim``), fp32, SDPA."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON, head_dim=head_dim))
    model.eval()
    model.set_attn_implementation("sdpa")
    return model


def _fake_quant(x: torch.Tensor, fmt: str, k_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, Hkv, T, D]`` through a side's 4-bit (or FP8) quantize-dequantize."""
    t = x.transpose(1, 2).float()
    if fmt == "fp8":
        assert k_scale is not None
        back = quantize_fp8(t, k_scale, torch.float8_e4m3fn).float() * k_scale
    else:
        f = NVFP4 if fmt == "nvfp4" else MXFP4
        g = torch.tensor(DYNAMIC_NVFP4_GLOBAL_SCALE, device=x.device) if f.global_scale else None
        back = dequantize_fp4(*quantize_fp4(t, f, g), f, g)
    return back.transpose(1, 2).to(x.dtype)


def _register_simulation(k_fmt: str, v_fmt: str, k_scale: torch.Tensor | None) -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def attention(module: Any, query: Any, key: Any, value: Any, mask: Any, **kw: Any) -> Any:
        if query.shape[2] == 1:  # a decode step: the cached K/V as the 4-bit cache holds them
            key, value = _fake_quant(key, k_fmt, k_scale), _fake_quant(value, v_fmt)
        return sdpa_attention_forward(module, query, key, value, mask, **kw)

    AttentionInterface.register(SIM, attention)
    AttentionMaskInterface.register(SIM, sdpa_mask)


FORMATS = {"nvfp4": ("nvfp4", "nvfp4"), "mxfp4": ("mxfp4", "mxfp4"),
           "fp8-k-nvfp4-v": ("fp8", "nvfp4")}  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kv_format", list(FORMATS))
def test_patched_decode_matches_a_quantize_dequantize_simulation(
    kv_format: str, backend: str
) -> None:
    # Triton runs on CPU tensors only in its interpreter (set when no GPU is present)
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    model = _tiny().to(dev)
    ids, mask = (t.to(dev) for t in prompt(batch=2, length=10, pad=(3,)))
    cont = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2)).to(dev)
    plain, _ = step_logits(model, ids, mask, cont)
    # fp8-k-nvfp4-v needs static K scales: unit scales (tiny K is well inside FP8's range)
    extra = {"missing_scales": "unit"} if kv_format == "fp8-k-nvfp4-v" else {}
    handle = kvhf.patch(
        model, backend=backend, kv_format=kv_format, cuda_graphs=False, recent_tokens=0, **extra
    )
    got, cache = step_logits(model, ids, mask, cont)
    assert isinstance(cache, KVQuantCache)
    layer = cache.layers[0]
    assert layer.storage.granularity == kv_format
    assert layer.v_pages.dtype == torch.uint8 and layer.v_pages.shape[-1] == 16
    handle.remove()
    k_fmt, v_fmt = FORMATS[kv_format]
    _register_simulation(k_fmt, v_fmt, torch.tensor(1.0, device=dev))
    model.set_attn_implementation(SIM)
    sim, _ = step_logits(model, ids, mask, cont)
    model.set_attn_implementation("sdpa")
    # the prompt step is exact in both; decode steps carry the 4-bit error
    assert torch.allclose(got[:, 0], plain[:, 0], atol=1e-5)
    to_sim = float((got - sim).abs().max())
    to_plain = float((got - plain)[:, 1:].abs().max())
    # measured: to_sim 1.2e-7 (torch), 3e-5..4e-5 (triton, nvfp4 and fp8-k-nvfp4-v: fp16
    # queries and probabilities), 9e-4 (triton, mxfp4); to_plain 0.025 (nvfp4, fp8-k-nvfp4-v)
    # and 0.037 (mxfp4): the 4-bit error itself
    assert to_sim < 5e-3, to_sim
    assert to_plain > 3 * to_sim, (to_plain, to_sim)
    # greedy tokens of the patched model stay those of the unpatched one on most steps
    same = (got.argmax(-1) == plain.argmax(-1)).float().mean()
    assert float(same) >= 0.75, float(same)


def test_generate_with_nvfp4_counts_4bit_bytes() -> None:
    model = _tiny()
    ids, mask = prompt(batch=2, length=10, pad=(3,))
    handle = kvhf.patch(model, backend="torch", kv_format="nvfp4")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                             do_sample=False, return_dict_in_generate=True)  # fmt: skip
    cache = getattr(out, "cache", None) or out.past_key_values
    assert isinstance(cache, KVQuantCache)
    # two layers of 2 KV heads x head_dim 32: K and V each 16 code bytes + 2 scale bytes
    assert cache.slot_bytes() == 2 * 2 * 2 * (16 + 2)
    held = cache.memory_bytes()
    slots = sum(layer.storage.num_pages * layer.storage.page_size for layer in cache.layers)
    assert held["pages"] + held["group_scales"] == slots * 2 * 2 * (16 + 2)
    assert handle.state.options.kv_format == "nvfp4"
    handle.remove()


def test_kv_format_options_are_checked_before_any_change() -> None:
    model = _tiny()
    with pytest.raises(OptionError, match="kv_format='fp5'; expected one of"):
        kvhf.patch(model, kv_format="fp5")
    with pytest.raises(OptionError, match="group_size=16 with kv_format='nvfp4'"):
        kvhf.patch(model, kv_format="nvfp4", group_size=16)
    with pytest.raises(OptionError, match="scale_format='per-tensor' with kv_format='mxfp4'"):
        kvhf.patch(model, kv_format="mxfp4", scale_format="per-tensor")
    with pytest.raises(OptionError, match="no static K scale"):
        kvhf.patch(model, kv_format="fp8-k-nvfp4-v")  # no checkpoint scales: fp32-group
    assert model.config._attn_implementation == "sdpa"
    small = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON))  # head_dim 16
    with pytest.raises(OptionError, match="block of 32 channels, but the layer's head_dim is 16"):
        kvhf.patch(small, kv_format="mxfp4")
    assert kvhf.KVQuantConfig(kv_format="nvfp4").to_dict()["kv_format"] == "nvfp4"


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                              do_sample=False, output_logits=True,
                              return_dict_in_generate=True)  # fmt: skip


@pytest.mark.parametrize("kv_format", ["nvfp4", "fp8-k-nvfp4-v"])
def test_static_decode_step_equals_the_eager_one(kv_format: str) -> None:
    """cuda_graphs=True on CPU runs the decode steps through the graph runner's static
    buffers (the path a CUDA graph captures): the same tokens and logits as eager steps."""
    ids, mask = prompt(batch=2, length=10, pad=(3,))
    extra = {"missing_scales": "unit"} if kv_format == "fp8-k-nvfp4-v" else {}
    outs = []
    for graphs in (False, True):
        model = _tiny()
        handle = kvhf.patch(model, backend="torch", kv_format=kv_format, cuda_graphs=graphs,
                            **extra)  # fmt: skip
        assert (handle.state.graph_runner is not None) == graphs
        outs.append(_generate(model, ids, mask))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].logits, outs[1].logits, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("kv_format", "k_rotation", "head_dim"),
    [("nvfp4", None, 32), ("mxfp4", None, 32), ("fp8-k-nvfp4-v", None, 32),
     ("nvfp4", "hadamard", 32), ("mxfp4", "hadamard", 32), ("nvfp4", None, 16),
     ("nvfp4", "hadamard", 16)],
)  # fmt: skip
def test_gpu_generate_with_graphs_and_compiled_step(
    kv_format: str, k_rotation: str | None, head_dim: int
) -> None:
    """On CUDA (bf16, Triton, decode graphs and the compiled step on by default): logits
    close to the torch backend's and to eager decoding's over every common prefix; also with
    rotated 4-bit keys, and NVFP4 at head_dim 16 (one block per row: NVFP4 keys in the
    k-transform's frame failed their GPU test at that size)."""
    ids, mask = (t.cuda() for t in prompt(batch=2, length=10, pad=(3,)))
    extra: dict[str, Any] = {"missing_scales": "unit"} if kv_format == "fp8-k-nvfp4-v" else {}
    if k_rotation is not None:
        extra["k_rotation"] = k_rotation
    outs = []
    for opts in ({"cuda_graphs": False, "backend": "torch"}, {"cuda_graphs": False}, {}):
        model = _tiny(head_dim=head_dim).to("cuda", torch.bfloat16)
        kvhf.patch(model, kv_format=kv_format, **opts, **extra)
        outs.append(_generate(model, ids, mask))
    # logits over the same prefix: up to the first step whose token differs (bf16 rounds
    # differently in the two backends and in the compiled step; a near tie may flip a token
    # of this random model)
    for out, ref in ((outs[1], outs[0]), (outs[2], outs[0]), (outs[2], outs[1])):
        same = (out.sequences == ref.sequences).all(dim=0)[ids.shape[1] :]
        steps = int(same.long().cumprod(0).sum()) + 1
        for a, b in list(zip(out.logits, ref.logits, strict=True))[:steps]:
            assert float((a.float() - b.float()).abs().max()) < 5e-2


@pytest.mark.gpu
def test_gpu_patch_warns_that_4bit_is_experimental_on_cuda(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _tiny().to("cuda", torch.bfloat16)
    with caplog.at_level("WARNING", logger="kvquant"):
        handle = kvhf.patch(model, kv_format="nvfp4")
    handle.remove()
    assert any("experimental on CUDA" in r.getMessage() for r in caplog.records)
    with caplog.at_level("WARNING", logger="kvquant"):
        caplog.clear()
        kvhf.patch(model).remove()
    assert not any("experimental" in r.getMessage() for r in caplog.records)


def test_a_head_dim_the_block_does_not_divide_is_refused_per_format() -> None:
    """The block size comes from the format: 48 channels take NVFP4's blocks of 16, not
    MXFP4's blocks of 32."""
    from dataclasses import replace

    from kvquant.integrations.hf.scale_source import fp4_spec
    from kvquant.schemes import Nvfp4Scales

    handle = kvhf.patch(_tiny(), backend="torch")
    spec = replace(handle.state.layer_specs[0], head_dim=48)
    handle.remove()
    assert fp4_spec(spec, "nvfp4").scheme is Nvfp4Scales
    with pytest.raises(OptionError, match=r"one scale per block of 32 channels.*head_dim is 48"):
        fp4_spec(spec, "mxfp4")
    with pytest.raises(OptionError, match=r"block of 16 channels.*head_dim is 40"):
        fp4_spec(replace(spec, head_dim=40), "fp8-k-nvfp4-v")


@pytest.mark.parametrize("kv_format", ["nvfp4", "mxfp4", "fp8-k-nvfp4-v", "fp8"])
def test_static_scales_a_4bit_format_does_not_use_are_named_in_a_warning(
    kv_format: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint's static FP8 scales with ``nvfp4`` / ``mxfp4`` (block scales computed on
    write) are not used: the patch says so once; formats that use them, and a model without
    scales or with ``missing_scales="unit"``, stay silent."""
    model = _tiny()
    layers = model.config.num_hidden_layers
    scales = {
        f"model.layers.{i}.self_attn.{n}": torch.tensor(0.01)
        for i in range(layers)
        for n in ("k_scale", "v_scale")
    }
    with caplog.at_level("WARNING", logger="kvquant"):
        kvhf.patch(model, scales=scales, kv_format=kv_format, backend="torch").remove()
        unused = [r.getMessage() for r in caplog.records if "does not use" in r.getMessage()]
    if kv_format in ("nvfp4", "mxfp4"):
        assert len(unused) == 1
        assert f"{layers} layer(s) (first model.layers.0.self_attn)" in unused[0]
        assert "kv_format='fp8'" in unused[0]
    else:
        assert unused == []
    with caplog.at_level("WARNING", logger="kvquant"):
        caplog.clear()
        if kv_format != "fp8-k-nvfp4-v":  # needs a static K scale
            kvhf.patch(model, kv_format=kv_format, backend="torch").remove()
        # missing_scales="unit": the 1.0 scales are nobody's, nothing to warn about
        kvhf.patch(model, kv_format=kv_format, missing_scales="unit", backend="torch").remove()
    assert not any("does not use" in r.getMessage() for r in caplog.records)
