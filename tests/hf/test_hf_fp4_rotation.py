"""``kvquant.patch(model, kv_format="nvfp4" | "mxfp4", k_rotation="hadamard")``: 4-bit pages of
Hadamard-rotated keys on a tiny fp32 Llama of head_dim 32 whose keys carry large near-constant
channels (a random k_proj bias, what the rotation spreads over a block).

The patched model's step logits must equal a simulation on HF's own attention path (decode
steps attend over ``dequant(quant(k H)) H^T``, V through the plain 4-bit rounding; the prompt
step over the exact K/V in both) and differ from the unrotated simulation; greedy ``generate``
and transformers' continuous batching run on it; what the option does not apply to is refused
before any change.
"""

from __future__ import annotations

from typing import Any

import hf_kt
import pytest
import torch
from hf_steps import min_cosine, step_logits
from hf_tiny import VOCAB, prompt

import kvquant.integrations.hf as kvhf
from kvquant.errors import OptionError
from kvquant.integrations.hf.quantizer import KVQuantConfig
from kvquant.kernels import hadamard
from kvquant.kernels.fp4 import MXFP4, NVFP4, dequantize_fp4, quantize_fp4
from kvquant.schemes import DYNAMIC_NVFP4_GLOBAL_SCALE

transformers = pytest.importorskip("transformers")

D = 32
SIM = "kvquant_test_rotated_fp4"


def biased_llama(seed: int = 0, head_dim: int = D) -> Any:
    """:func:`hf_kt.biased_llama` at this file's head_dim."""
    return hf_kt.biased_llama(seed, head_dim)


def _round(x: torch.Tensor, fmt: str, rotation: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, Hkv, T, D]`` through the 4-bit quantize-dequantize (rotated by ``rotation`` and
    back when given)."""
    f = NVFP4 if fmt == "nvfp4" else MXFP4
    g = torch.tensor(DYNAMIC_NVFP4_GLOBAL_SCALE) if f.global_scale else None
    t = x.float() if rotation is None else x.float() @ rotation
    back = dequantize_fp4(*quantize_fp4(t, f, g), f, g)
    return (back if rotation is None else back @ rotation.T).to(x.dtype)


def _simulated(model: Any, ids: Any, mask: Any, cont: Any, fmt: str, rotate: bool) -> Any:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    h = hadamard(D) if rotate else None

    def attention(module: Any, query: Any, key: Any, value: Any, am: Any, **kw: Any) -> Any:
        if query.shape[2] == 1:  # a decode step: the cached K/V as the 4-bit pages hold them
            key, value = _round(key, fmt, h), _round(value, fmt)
        return sdpa_attention_forward(module, query, key, value, am, **kw)

    AttentionInterface.register(SIM, attention)
    AttentionMaskInterface.register(SIM, sdpa_mask)
    model.set_attn_implementation(SIM)
    try:
        return step_logits(model, ids, mask, cont)[0]
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_logits_equal_simulated_rotated_4bit_rounding(fmt: str, backend: str) -> None:
    # Triton runs on CPU tensors only in its interpreter (set when no GPU is present)
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    ids, mask = prompt(batch=2, length=10, pad=(0, 3), seed=1)
    cont = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    model = biased_llama()
    rotated = _simulated(model, ids, mask, cont, fmt, rotate=True)
    plain = _simulated(model, ids, mask, cont, fmt, rotate=False)
    model = model.to(dev)
    handle = kvhf.patch(model, kv_format=fmt, k_rotation="hadamard", backend=backend,
                        cuda_graphs=False, recent_tokens=0)  # fmt: skip
    got, cache = step_logits(model, *(t.to(dev) for t in (ids, mask, cont)))
    got = got.cpu()
    storage = cache.layers[0].storage
    assert storage.granularity == fmt and storage.k_rotation is not None
    assert "K rotated" in repr(storage)
    assert storage.memory_bytes()["k_transform"] == D * D * 4
    handle.remove()
    # measured max |got - rotated|: 9e-8 (torch), 5e-5 / 8e-4 (triton nvfp4 / mxfp4: fp16
    # queries and probabilities); |got - plain| 0.03 / 0.027 (the rotation changes the rounding)
    to_sim = float((got - rotated).abs().max())
    to_plain = float((got - plain).abs().max())
    assert min_cosine(got, rotated) >= 0.9999, to_sim
    assert to_plain > 5 * to_sim, (to_plain, to_sim)


def test_greedy_generate_and_the_keys_read_back() -> None:
    """Greedy tokens close to the unpatched model's; ``dense()`` reads K in the model's frame."""
    ids, mask = prompt(batch=2, length=10, pad=(0, 3), seed=2)
    kw: dict[str, Any] = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False,
                              return_dict_in_generate=True)  # fmt: skip
    with torch.no_grad():
        want = biased_llama().generate(input_ids=ids, attention_mask=mask, **kw).sequences
    model = biased_llama()
    kvhf.patch(model, KVQuantConfig(kv_format="nvfp4", k_rotation="hadamard", backend="torch"))
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
    same = (out.sequences[:, 10:] == want[:, 10:]).float().mean()
    assert float(same) >= 0.75, float(same)
    k = out.past_key_values.layers[0].dense_kv(torch.float32)[0][:, :, :10]
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        exact = biased_llama()(input_ids=ids, attention_mask=mask, position_ids=pos,
                               use_cache=True)  # fmt: skip
    want_k = exact.past_key_values.layers[0].keys  # [B, Hkv, T, D]
    rel = float((k[1, :, 3:] - want_k[1, :, 3:]).norm() / want_k[1, :, 3:].norm())
    assert rel < 0.15, rel


def test_a_layer_map_rotates_its_4bit_and_fp32_group_layers() -> None:
    handle = kvhf.patch(biased_llama(), kv_format={0: "mxfp4", "default": "fp8"},
                        k_rotation="hadamard", backend="torch")  # fmt: skip
    specs = handle.state.layer_specs
    assert [s.granularity for s in specs] == ["mxfp4", "fp32-group"]
    assert all(s.rotation == "hadamard" for s in specs)
    handle.remove()


def _state(model: Any) -> tuple[Any, ...]:
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return model.config._attn_implementation, hooks


@pytest.mark.parametrize(
    ("options", "head_dim", "match"),
    [
        ({"kv_format": "fp8-k-nvfp4-v", "missing_scales": "unit"}, D,
         r"k_rotation='hadamard' with kv_format 'fp8-k-nvfp4-v'.*Fix:"),
        ({"kv_format": {0: "nvfp4", "default": "fp8-k-nvfp4-v"}}, D,
         r"with kv_format 'fp8-k-nvfp4-v'"),
        ({"kv_format": "nvfp4"}, 48, r"power-of-two head_dim >= 16.*head_dim is 48"),
    ],
)  # fmt: skip
def test_what_the_rotation_does_not_apply_to_is_refused_before_any_change(
    options: dict[str, Any], head_dim: int, match: str
) -> None:
    model = biased_llama(head_dim=head_dim)
    before = _state(model)
    with pytest.raises(OptionError, match=match):
        kvhf.patch(model, k_rotation="hadamard", backend="torch", **options)
    assert _state(model) == before


@pytest.mark.parametrize("recent", [0, 8])
def test_continuous_batching_equals_each_requests_own_generate(recent: int) -> None:
    """transformers' paged ``generate`` over rotated NVFP4 pages: every request's tokens those
    of the patched model's own ``generate`` (also with a ring of 8 newest tokens, which holds
    the keys rotated)."""
    from test_hf_continuous_batching import alone, cb_config, gen_config, prompts, tokens

    model = biased_llama()
    kvhf.patch(
        model, kv_format="nvfp4", k_rotation="hadamard", backend="torch", recent_tokens=recent
    )
    reqs = prompts((11, 11, 11), seed=3)
    out = model.generate(torch.tensor(reqs), generation_config=gen_config(),
                         cache_implementation="paged",
                         continuous_batching_config=cb_config())  # fmt: skip
    got = [row[11:].tolist() for row in out.reshape(len(reqs), -1)]
    assert got == tokens([alone(model, r) for r in reqs])


def test_static_decode_step_equals_the_ordinary_step() -> None:
    """``cuda_graphs=True`` on CPU: the graph runner's static step (its flattened scheme holds
    the rotation) gives the ordinary step's logits bit for bit."""
    ids, mask = prompt(batch=2, length=12, pad=(3, 0), seed=2)
    cont = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    got = {}
    for graphs in (False, True):
        model = biased_llama()
        handle = kvhf.patch(model, kv_format="nvfp4", k_rotation="hadamard", backend="torch",
                            page_size=4, cuda_graphs=graphs)  # fmt: skip
        got[graphs], _ = step_logits(model, ids, mask, cont)
        if graphs:
            assert handle.state.graph_runner.stats.static_eager > 0
    assert torch.equal(got[True], got[False])
