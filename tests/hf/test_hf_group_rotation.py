"""``k_rotation="hadamard"`` on a transformers model: fp32-group scales of Hadamard-rotated keys.

A tiny fp32 Llama of head_dim 64 whose keys carry large near-constant channels (a random
k_proj bias, as hf_kt's). kvquant's logits must equal those of simulated rounding on HF's own
attention path (decode steps attend over ``fp8(k H / s) s H^T`` with group scales of ``k H``,
and V rounded as plain fp32-group), and differ from the unrotated simulation; greedy
``generate`` matches the unpatched model; the option's values and conflicts are refused
before any change.
"""

from __future__ import annotations

import json
from typing import Any

import hf_kt
import pytest
import torch
from hf_steps import min_cosine, step_logits
from hf_tiny import VOCAB, build, prompt

import kvquant
import kvquant.integrations.hf as kvhf
from kvquant.errors import OptionError, OptionTypeError
from kvquant.integrations.hf.quantizer import KVQuantConfig
from kvquant.kernels import hadamard

transformers = pytest.importorskip("transformers")

D = 64


def biased_llama(seed: int = 0, head_dim: int = D) -> Any:
    """:func:`hf_kt.biased_llama` at this file's head_dim."""
    return hf_kt.biased_llama(seed, head_dim)


def _round(x: torch.Tensor, group: int) -> torch.Tensor:
    """``fp8(x / s) * s`` with ``s = amax / 448`` per group of ``group`` channels (``[..., D]``)."""
    xg = x.float().unflatten(-1, (-1, group))
    amax = xg.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    codes = (xg / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (codes.float() * scale).flatten(-2)


def _simulated_logits(model: Any, ids: Any, mask: Any, cont: Any, group: int, rotate: bool) -> Any:
    """Logits with HF's sdpa attention over K/V rounded as kvquant stores them (decode steps)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attend = ALL_ATTENTION_FUNCTIONS["sdpa"]
    h = hadamard(D)

    def simulated(mod, query, key, value, attention_mask, **kw):  # type: ignore[no-untyped-def]
        if query.shape[2] > 1:  # the prompt: no cached prefix, exact K/V
            return attend(mod, query, key, value, attention_mask, **kw)
        k = _round(key.float() @ h, group) @ h.T if rotate else _round(key, group)
        return attend(mod, query, k.to(key.dtype), _round(value, group).to(value.dtype),
                      attention_mask, **kw)  # fmt: skip

    AttentionInterface.register("kvquant_test_rotated", simulated)
    AttentionMaskInterface.register("kvquant_test_rotated", sdpa_mask)
    model.set_attn_implementation("kvquant_test_rotated")
    try:
        logits, _ = step_logits(model, ids, mask, cont, cache=None)
    finally:
        model.set_attn_implementation("sdpa")
    return logits


@pytest.mark.parametrize("group", [32, 64])
def test_logits_equal_simulated_rotated_rounding(group: int) -> None:
    ids, mask = prompt(batch=2, length=10, pad=(0, 3), seed=1)
    cont = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    model = biased_llama()
    rotated = _simulated_logits(model, ids, mask, cont, group, rotate=True)
    plain = _simulated_logits(model, ids, mask, cont, group, rotate=False)
    handle = kvhf.patch(
        model, group_size=group, k_rotation="hadamard", backend="torch", recent_tokens=0
    )
    assert handle.scales.granularity == "fp32-group"
    got, cache = step_logits(model, ids, mask, cont, cache=None)
    storage = cache.layers[0].storage
    assert storage.group_size == group and storage.k_rotation is not None
    assert min_cosine(got, rotated) >= 0.99999
    # the rotation shows: the unrotated rounding gives other logits
    assert float((got - plain).abs().max()) > 20 * float((got - rotated).abs().max())
    handle.remove()


def test_greedy_generate_is_close_to_the_unpatched_model() -> None:
    ids, mask = prompt(batch=1, length=10, pad=(0,))
    kw: dict[str, Any] = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)
    with torch.no_grad():
        want = biased_llama().generate(input_ids=ids, attention_mask=mask, **kw)
    model = biased_llama()
    kvquant.patch(model, KVQuantConfig(group_size=32, k_rotation="hadamard", backend="torch"))
    with torch.no_grad():
        got = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(got, want)


def test_triton_kernels_give_the_torch_backends_logits() -> None:
    """The Triton write and attention (interpreter on CPU) behind the patch: the logits of the
    torch reference backend, left padding included, within the interpreter's rounding (its
    fp8-cast bug: plain fp32-group scales measure the same 0.9996 cosine)."""
    ids, mask = prompt(batch=2, length=8, pad=(0, 2), seed=3)
    cont = torch.randint(3, VOCAB, (2, 3), generator=torch.Generator().manual_seed(6))
    runs = []
    for backend in ("torch", "triton"):
        model = biased_llama()
        kvhf.patch(model, group_size=32, k_rotation="hadamard", backend=backend, page_size=4)
        runs.append(step_logits(model, ids, mask, cont, cache=None)[0])
    assert min_cosine(runs[1], runs[0]) >= 0.999


def test_the_option_round_trips_through_a_saved_config() -> None:
    cfg = KVQuantConfig(group_size=32, k_rotation="hadamard")
    saved = json.loads(json.dumps(cfg.to_dict()))
    assert saved["k_rotation"] == "hadamard"
    assert KVQuantConfig.from_dict(saved) == cfg
    assert repr(cfg) == "KVQuantConfig(group_size=32, k_rotation='hadamard')"
    assert KVQuantConfig().to_dict()["k_rotation"] is None


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"k_rotation": "walsh"}, OptionError, r"k_rotation='walsh'; expected None or one of"),
        ({"k_rotation": True}, OptionTypeError, r"k_rotation=True; expected None or one of"),
        ({"k_rotation": "hadamard", "scale_format": "per-head"}, OptionError,
         r"scale_format='per-head'; the rotation applies to the dynamic fp32-group"),
        ({"k_rotation": "hadamard", "missing_scales": "unit"}, OptionError,
         r"missing_scales='unit'"),
        ({"k_rotation": "hadamard", "kv_format": "fp8-k-nvfp4-v"}, OptionError,
         r"k_rotation='hadamard' with kv_format 'fp8-k-nvfp4-v'"),
    ],
)  # fmt: skip
def test_bad_values_and_conflicts_are_refused_when_built(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match) as info:
        KVQuantConfig(**options)
    assert "Fix:" in str(info.value)


def _state(model: Any) -> tuple[Any, ...]:
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return model.config._attn_implementation, hooks, sorted(n for n, _ in model.named_buffers())


def test_checkpoint_scales_and_odd_head_dims_are_refused_before_any_change() -> None:
    model = build("llama")
    before = _state(model)
    scales = {
        f"model.layers.{i}.self_attn.{n}": torch.tensor(0.01)
        for i in range(2)
        for n in ("k_scale", "v_scale")
    }
    with pytest.raises(OptionError, match=r"layers\.0\.self_attn: .*resolved to 'per-tensor'"):
        kvquant.patch(model, scales=scales, k_rotation="hadamard", backend="torch")
    assert _state(model) == before
    odd = biased_llama(head_dim=24)
    before = _state(odd)
    with pytest.raises(OptionError, match=r"power-of-two head_dim >= 16.*head_dim is 24"):
        kvquant.patch(odd, k_rotation="hadamard", backend="torch")
    assert _state(odd) == before


def test_static_decode_step_equals_the_ordinary_step() -> None:
    """``cuda_graphs=True`` on CPU: the graph runner's static step (its flattened scheme holds
    the rotation) gives the ordinary step's logits bit for bit."""
    ids, mask = prompt(batch=2, length=12, pad=(3, 0), seed=2)
    cont = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    got = {}
    for graphs in (False, True):
        model = biased_llama()
        handle = kvhf.patch(
            model, group_size=32, k_rotation="hadamard", backend="torch", page_size=4,
            cuda_graphs=graphs,
        )  # fmt: skip
        got[graphs], _ = step_logits(model, ids, mask, cont, cache=None)
        if graphs:
            assert handle.state.graph_runner.stats.static_eager > 0
    assert torch.equal(got[True], got[False])


@pytest.mark.gpu
@pytest.mark.parametrize("group", [32, 64])
def test_cuda_graphs_and_compiled_step_on_gpu(group: int) -> None:
    """Triton kernels on CUDA: the eager step, the decode graph and the compiled decode graph
    against simulated rotated rounding (bf16 model)."""
    ids, mask = prompt(batch=3, length=40, pad=(5, 0, 9))
    cont = torch.randint(3, VOCAB, (3, 20), generator=torch.Generator().manual_seed(5))
    model = biased_llama().to(device="cuda", dtype=torch.bfloat16)
    ids, mask, cont = ids.cuda(), mask.cuda(), cont.cuda()
    want, _ = step_logits(model, ids, mask, cont, cache=None)
    got = {}
    for graphs, compiled in ((False, False), (True, False), (True, None)):
        handle = kvhf.patch(
            model, group_size=group, k_rotation="hadamard", cuda_graphs=graphs,
            compile_step=compiled,
        )  # fmt: skip
        got[(graphs, compiled)], _ = step_logits(model, ids, mask, cont, cache=None)
        handle.remove()
    eager = got[(False, False)]
    assert min_cosine(eager, want) >= 0.995
    assert min_cosine(got[(True, False)], eager) >= 0.9999
    assert min_cosine(got[(True, None)], eager) >= 0.999


def test_from_pretrained_with_the_option_and_a_saved_patched_model(tmp_path: Any) -> None:
    """The option loads through ``from_pretrained``; a model patched with it saves it in its
    config, and loading that folder rotates K again."""
    biased_llama().save_pretrained(tmp_path / "plain")
    cfg = KVQuantConfig(group_size=32, k_rotation="hadamard", backend="torch")
    model = kvhf.from_pretrained(tmp_path / "plain", quantization_config=cfg, dtype=torch.float32)
    assert all(s.rotation == "hadamard" for s in model._kvquant_state.layer_specs)
    model.save_pretrained(tmp_path / "patched")
    saved = json.loads((tmp_path / "patched" / "config.json").read_text())
    assert saved["quantization_config"]["k_rotation"] == "hadamard"
    again = kvhf.from_pretrained(tmp_path / "patched", dtype=torch.float32)
    assert again._kvquant_state.options.k_rotation == "hadamard"
    assert all(s.rotation == "hadamard" for s in again._kvquant_state.layer_specs)
