"""kvquant.patch(model, recent_tokens=R): each sequence's newest R tokens at full precision.

The patched model's teacher-forced step logits are compared with an independent simulation:
the unpatched model over a plain ``DynamicCache`` whose decode steps attend (SDPA) over K/V
passed through the 4-bit quantize-dequantize, but for the newest ``R`` positions, which stay
exact. The patched logits must match that simulation far more closely than they match the
same simulation without exact positions (the ring is read), and a ring longer than the
sequence gives the unpatched model's logits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_steps import cache_kwarg, generate_exactly, step_logits
from hf_tiny import _COMMON, VOCAB, prompt

import kvquant.integrations.hf as kvhf
from kvquant.errors import OptionError, OptionTypeError
from kvquant.integrations.hf.cache_layer import KVQuantCache
from kvquant.kernels.fp4 import MXFP4, NVFP4, dequantize_fp4, quantize_fp4
from kvquant.schemes import DYNAMIC_NVFP4_GLOBAL_SCALE

transformers = pytest.importorskip("transformers")

SIM = "kvquant_recent_simulation"


def _tiny(seed: int = 0) -> Any:
    """A tiny random Llama with head_dim 32, fp32, SDPA."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON, head_dim=32))
    model.eval()
    model.set_attn_implementation("sdpa")
    return model


def _fake_quant(x: torch.Tensor, fmt: str, recent: int) -> torch.Tensor:
    """``[B, Hkv, T, D]`` through a 4-bit quantize-dequantize, the last ``recent`` exact."""
    t = x.transpose(1, 2).float()
    f = NVFP4 if fmt == "nvfp4" else MXFP4
    g = torch.tensor(DYNAMIC_NVFP4_GLOBAL_SCALE, device=x.device) if f.global_scale else None
    back = dequantize_fp4(*quantize_fp4(t, f, g), f, g).transpose(1, 2).to(x.dtype)
    if recent:
        back[:, :, -recent:] = x[:, :, -recent:]
    return back


def _simulated_logits(model: Any, fmt: str, recent: int, *args: torch.Tensor) -> torch.Tensor:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def attention(module: Any, query: Any, key: Any, value: Any, mask: Any, **kw: Any) -> Any:
        if query.shape[2] == 1:  # a decode step: the cached K/V as the cache holds them
            key, value = _fake_quant(key, fmt, recent), _fake_quant(value, fmt, recent)
        return sdpa_attention_forward(module, query, key, value, mask, **kw)

    AttentionInterface.register(SIM, attention)
    AttentionMaskInterface.register(SIM, sdpa_mask)
    model.set_attn_implementation(SIM)
    try:
        logits, _ = step_logits(model, *args)
    finally:
        model.set_attn_implementation("sdpa")
    return logits


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, mask = prompt(batch=2, length=10, pad=(3,))
    cont = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    return ids, mask, cont


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kv_format", ["nvfp4", "mxfp4"])
def test_decode_reads_the_newest_tokens_exactly(
    kv_format: str, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Triton runs on CPU tensors only in its interpreter (set when no GPU is present)
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    model = _tiny().to(dev)
    ids, mask, cont = (t.to(dev) for t in _inputs())
    caplog.set_level("INFO", logger="kvquant")
    handle = kvhf.patch(model, backend=backend, kv_format=kv_format, recent_tokens=4,
                        cuda_graphs=False)  # fmt: skip
    got, cache = step_logits(model, ids, mask, cont)
    assert isinstance(cache, KVQuantCache)
    ring = cache.layers[0].storage.recent_kv()
    assert ring is not None and tuple(ring.shape) == (2, 2, 4, 2, 32)
    assert "newest 4 tokens also at full precision" in caplog.text
    handle.remove()
    sim = _simulated_logits(model, kv_format, 4, ids, mask, cont)
    sim_no_ring = _simulated_logits(model, kv_format, 0, ids, mask, cont)
    to_sim = float((got - sim).abs().max())
    to_no_ring = float((got - sim_no_ring)[:, 1:].abs().max())
    # measured: to_sim 1.2e-7 (torch), 3.1e-5 / 3.7e-5 (Triton interpreter, NVFP4 / MXFP4:
    # fp16 tiles); to_no_ring 0.021 / 0.020, the 4-bit error of the four newest tokens
    assert to_sim < 5e-3, to_sim
    assert to_no_ring > 3 * to_sim, (to_no_ring, to_sim)


def test_a_ring_longer_than_the_sequence_gives_the_unpatched_logits() -> None:
    model = _tiny()
    ids, mask, cont = _inputs()
    plain, _ = step_logits(model, ids, mask, cont)
    handle = kvhf.patch(model, backend="torch", kv_format="nvfp4", recent_tokens=32)
    got, _ = step_logits(model, ids, mask, cont)
    handle.remove()
    handle = kvhf.patch(model, backend="torch", kv_format="nvfp4", recent_tokens=0)
    without, _ = step_logits(model, ids, mask, cont)
    handle.remove()
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)
    assert float((without - plain).abs().max()) > 1e-3


@pytest.mark.parametrize("kv_format", ["nvfp4", "fp8"])
def test_static_and_compiled_decode_steps_equal_the_eager_one(kv_format: str) -> None:
    """cuda_graphs=True on CPU runs the decode steps through the graph runner's static buffers
    (what a CUDA graph captures), compile_step=True through the compiled layers' custom ops:
    the same tokens and logits as eager steps."""
    ids, mask = prompt(batch=2, length=10, pad=(3,))
    runs = []
    for opts in ({"cuda_graphs": False}, {"cuda_graphs": True},
                 {"cuda_graphs": True, "compile_step": True}):  # fmt: skip
        torch._dynamo.reset()
        model = _tiny()
        handle = kvhf.patch(model, backend="torch", kv_format=kv_format, recent_tokens=3,
                            page_size=4, **opts)  # fmt: skip
        compiled = None if handle.state.graph_runner is None else handle.state.graph_runner.compiled
        if compiled is not None:
            compiled.backend = "aot_eager"
        runs.append(generate_exactly(model, ids, mask, 7))
        stats = None if handle.state.graph_runner is None else handle.state.graph_runner.stats
        if opts.get("compile_step"):
            assert stats is not None and stats.compiled_runs >= 5
        elif opts["cuda_graphs"]:
            assert stats is not None and stats.static_eager >= 5
        handle.remove()
    torch._dynamo.reset()
    for other in runs[1:]:
        assert torch.equal(other.sequences, runs[0].sequences)
        torch.testing.assert_close(
            torch.stack(other.logits), torch.stack(runs[0].logits), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("mode", ["beam search", "assisted decoding", "row groups"])
def test_generation_modes_with_a_ring_as_long_as_the_sequence(mode: str) -> None:
    """Beam search (the ring's rows reordered), assisted decoding (crops) and row-group
    prefill (each group's rows of the ring): with every token in the ring, the unpatched
    model's tokens."""
    ids, mask = prompt(batch=3 if mode == "row groups" else 2, length=10, pad=(3,))
    kw: dict[str, Any] = {}
    opts: dict[str, Any] = {}
    if mode == "beam search":
        kw = {"num_beams": 3}
    elif mode == "assisted decoding":
        kw = {"assistant_model": _tiny(seed=1)}
        ids, mask = ids[:1, 3:], mask[:1, 3:]  # assisted decoding takes one sequence
    else:
        opts = {"prefill_tokens": 10}
    model = _tiny()
    want = generate_exactly(model, ids, mask, 8, **kw)
    handle = kvhf.patch(model, backend="torch", kv_format="nvfp4", recent_tokens=32, **opts)
    got = generate_exactly(model, ids, mask, 8, **kw)
    handle.remove()
    assert torch.equal(got.sequences, want.sequences)


def test_crop_keeps_the_newest_tokens_before_the_cut() -> None:
    """After ``crop`` the ring holds the newest positions before the cut; decoding on from
    there equals a cache that was never cropped but for the positions the ring had already
    dropped (read back from the pages, as a ring-less cache reads them)."""
    model = _tiny()
    ids, mask, cont = _inputs()
    kvhf.patch(model, backend="torch", kv_format="nvfp4", recent_tokens=3)
    _, cache = step_logits(model, ids, mask, cont)  # 16 positions
    layer = cache.layers[0]
    stored = layer.storage.dense(cache.book.block_table(layer.storage.device), 16)
    cache.crop(-2)  # keep 14: the ring held 13, 14, 15; it must hold 11, 12, 13
    ring = layer.storage.recent_kv()
    assert ring is not None and cache.get_seq_length() == 14
    for p in (11, 12):
        assert torch.equal(ring[:, 1, p % 3], stored[1][:, p].to(ring.dtype))


def test_memory_counts_the_ring() -> None:
    model = _tiny()
    ids, mask = prompt(batch=2, length=10, pad=(3,))
    kvhf.patch(model, backend="torch", kv_format="nvfp4", recent_tokens=8)
    out = generate_exactly(model, ids, mask, 4)
    cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
    held = cache.memory_bytes()
    # two layers, each a [B, 2, R, Hkv, D] fp32 ring
    assert held["recent"] == 2 * (2 * 2 * 8 * 2 * 32 * 4)
    assert held["total"] == sum(v for k, v in held.items() if k != "total")


def test_options_are_checked() -> None:
    model = _tiny()
    with pytest.raises(OptionError, match=r"recent_tokens=-1; expected 0\.\.1024") as info:
        kvhf.patch(model, recent_tokens=-1)
    assert "Fix:" in str(info.value)
    with pytest.raises(OptionTypeError, match="recent_tokens='8'; expected 'auto' or an int"):
        kvhf.patch(model, recent_tokens="8")
    assert model.config._attn_implementation == "sdpa"
    cfg = kvhf.KVQuantConfig(kv_format="nvfp4", recent_tokens=16)
    assert cfg.to_dict()["recent_tokens"] == 16
    assert "recent_tokens=16" in repr(cfg)
    assert kvhf.KVQuantConfig().to_dict()["recent_tokens"] == "auto"


@pytest.mark.parametrize(("option", "ring"), [({}, 16), ({"recent_tokens": "auto"}, 16),
                                               ({"recent_tokens": 0}, 0),
                                               ({"recent_tokens": 5}, 5)])  # fmt: skip
def test_the_default_keeps_the_16_newest_tokens(option: dict[str, Any], ring: int) -> None:
    """``recent_tokens="auto"``, the default, is a ring of 16 in every layer; the cache's
    storage keeps it; an int is taken as given."""
    model = _tiny()
    handle = kvhf.patch(model, backend="torch", **option)
    assert [s.recent_tokens for s in handle.state.layer_specs] == [ring] * 2
    ids, mask = prompt(batch=2, length=6, pad=(0, 0))
    _, cache = step_logits(model, ids, mask, ids[:, :1])
    storages = [layer.storage for layer in cache.layers]
    assert [0 if st.recent is None else st.recent.length for st in storages] == [ring] * 2
    handle.remove()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["nvfp4", "fp8-k-nvfp4-v", "fp8"])
def test_gpu_generate_with_graphs_and_compiled_step(kv_format: str) -> None:
    """On CUDA (bf16, Triton, decode graphs and the compiled step on by default): logits close
    to the torch backend's and to eager decoding's over every common prefix, and a ring as long
    as the sequence gives the unpatched model's tokens."""
    ids, mask = (t.cuda() for t in prompt(batch=2, length=10, pad=(3,)))
    extra: dict[str, Any] = {"missing_scales": "unit"} if kv_format == "fp8-k-nvfp4-v" else {}
    outs = []
    for opts in ({"cuda_graphs": False, "backend": "torch"}, {"cuda_graphs": False}, {}):
        model = _tiny().to("cuda", torch.bfloat16)
        handle = kvhf.patch(model, kv_format=kv_format, recent_tokens=4, **opts, **extra)
        outs.append(generate_exactly(model, ids, mask, 12))
        if not opts:
            assert handle.state.graph_runner is not None
            assert handle.state.graph_runner.stats.replays >= 8
    for out, ref in ((outs[1], outs[0]), (outs[2], outs[0]), (outs[2], outs[1])):
        same = (out.sequences == ref.sequences).all(dim=0)[ids.shape[1] :]
        steps = int(same.long().cumprod(0).sum()) + 1
        for a, b in list(zip(out.logits, ref.logits, strict=True))[:steps]:
            assert float((a.float() - b.float()).abs().max()) < 5e-2
    model = _tiny().to("cuda", torch.bfloat16)
    want = generate_exactly(model, ids, mask, 12)
    kvhf.patch(model, kv_format=kv_format, recent_tokens=32, **extra)
    got = generate_exactly(model, ids, mask, 12)
    steps = int((got.sequences == want.sequences).all(dim=0).long().cumprod(0).sum())
    assert steps >= ids.shape[1] + 8, (got.sequences, want.sequences)


def test_dense_reads_take_the_newest_tokens_from_the_ring() -> None:
    """``dense_kv`` (what a layer that reuses another's K/V, or a caller, reads): the newest
    positions as the model produced them, the older ones rounded."""
    from transformers import DynamicCache

    model = _tiny()
    ids, mask, cont = _inputs()
    _, plain = step_logits(model, ids, mask, cont, cache=DynamicCache())
    handle = kvhf.patch(model, backend="torch", kv_format="nvfp4", recent_tokens=3)
    _, cache = step_logits(model, ids, mask, cont)
    handle.remove()
    # the first layer's K/V (later layers' depend on the rounded attention before them)
    keys, values = cache.layers[0].dense_kv(torch.float32)
    want_k, want_v = plain.layers[0].keys, plain.layers[0].values
    torch.testing.assert_close(keys[:, :, -3:], want_k[:, :, -3:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values[:, :, -3:], want_v[:, :, -3:], rtol=1e-5, atol=1e-5)
    assert float((keys[:, :, -4] - want_k[:, :, -4]).abs().max()) > 1e-3


def test_a_copied_cache_keeps_its_own_ring() -> None:
    """``copy.deepcopy(cache)`` (a prompt's cache reused for two continuations): the copy's
    ring is its own, and both continue exactly as one cache would."""
    import copy

    model = _tiny()
    ids, mask, cont = _inputs()
    kvhf.patch(model, backend="torch", kv_format="nvfp4", recent_tokens=3)
    _, cache = step_logits(model, ids, mask, cont[:, :3])
    twin = copy.deepcopy(cache)
    ring, twin_ring = cache.layers[0].storage.recent_kv(), twin.layers[0].storage.recent_kv()
    assert ring is not None and twin_ring is not None
    assert twin_ring.data_ptr() != ring.data_ptr() and torch.equal(twin_ring, ring)
    runs = []
    for c in (cache, twin):
        m = torch.cat([mask, torch.ones_like(cont[:, :3])], dim=1)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -1:] + 3
        logits = []
        for s in range(3, cont.shape[1]):
            m, pos = torch.cat([m, torch.ones_like(m[:, :1])], dim=1), pos + 1
            with torch.no_grad():
                out = model(input_ids=cont[:, s : s + 1], attention_mask=m, position_ids=pos,
                            use_cache=True, **{cache_kwarg(model): c})  # fmt: skip
            logits.append(out.logits[:, -1])
        runs.append(torch.stack(logits))
    assert torch.equal(runs[0], runs[1])
