"""The 4-bit simulation mode (benchmarks.harness.fp4, mode ``"fp4"``).

Tiny random Llama models only (the real SmolLM2 runs are benchmarks/accuracy_table.py's).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import benchmarks.harness.accuracy as E
import benchmarks.harness.fp4 as F
from kvquant.errors import KVQuantError
from kvquant.kernels import hadamard
from kvquant.kernels.fp4 import MXFP4, NVFP4, dequantize_fp4, fp4_page_storage
from kvquant.kernels.write_fp4 import write_fp4
from kvquant.schemes import DYNAMIC_NVFP4_GLOBAL_SCALE, Mxfp4Scales, Nvfp4Scales, Pages

transformers = pytest.importorskip("transformers")


def _tiny_llama(seed: int = 0, head_dim: int = 32) -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a wide K/V spread, so the rounding is visible
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(8.0)
            layer.self_attn.v_proj.weight.mul_(3.0)
    return model


def _ids(n: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed))


def _written(x: torch.Tensor, which: str, backend: str) -> torch.Tensor:
    """``x`` [B, Hkv, T, D] written by kvquant's 4-bit write and read back from the pages."""
    b, h, t, d = x.shape
    fmt, scheme = (
        (NVFP4, Nvfp4Scales(d, torch.tensor(DYNAMIC_NVFP4_GLOBAL_SCALE), torch.tensor(1.0)))
        if which == "nvfp4"
        else (MXFP4, Mxfp4Scales(d))
    )
    kp, ks = fp4_page_storage(b * t, 1, h, d, fmt)
    vp, vs = fp4_page_storage(b * t, 1, h, d, fmt)
    tokens = x.transpose(1, 2).contiguous()
    slots = torch.arange(b * t).reshape(b, t)
    write_fp4(tokens, tokens, Pages(kp, vp, ks, vs), slots, scheme, backend=backend)
    g = torch.tensor(DYNAMIC_NVFP4_GLOBAL_SCALE) if fmt.global_scale else None
    return dequantize_fp4(kp[:, 0], ks[:, 0], fmt, g).reshape(b, t, h, d).transpose(1, 2)


@pytest.mark.parametrize("which", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_round_fp4_reads_what_the_write_stores(which: str, backend: str) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 2, 3, 32, generator=g) * 4
    x[0, 1, 2, :16] *= 300.0  # a block far from the others
    x[0, 0, 1, :] = 0.0
    got = F.round_fp4(x, which)
    assert torch.equal(got, _written(x, which, backend))
    assert not torch.equal(got, x)
    # e2m1's widest step (4 to 6) is 2 block-scale units: NVFP4's scale is amax / 6 rounded to
    # e4m3 (at most 1/16 off), so half a step is amax / 6 * 17 / 16; MXFP4's power-of-two
    # scale leaves half a step, or the clipping of amax above 6 units, within amax / 4
    blocks = x.unflatten(-1, (-1, 16 if which == "nvfp4" else 32))
    amax = blocks.abs().amax(-1, keepdim=True)
    err = (got.unflatten(-1, blocks.shape[-2:]) - blocks).abs()
    bound = amax / 6 * 17 / 16 if which == "nvfp4" else amax / 4
    assert bool((err <= bound + 1e-6).all())


def test_round_fp4_marks_a_non_finite_block() -> None:
    x = torch.randn(1, 2, 3, 32, generator=torch.Generator().manual_seed(6))
    x[0, 1, 2, 20] = float("inf")
    got = F.round_fp4(x, "nvfp4")
    assert torch.isnan(got[0, 1, 2, 16:]).all()
    assert torch.isfinite(got[0, 1, 2, :16]).all() and torch.isfinite(got[0, 0]).all()


def test_fp4_kv_rotated_frames() -> None:
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 9, 32, generator=g)
    k = torch.randn(1, 2, 9, 32, generator=g) * 3 + 2
    v = torch.randn(1, 2, 9, 32, generator=g)
    r = hadamard(32)
    q2, k2, v2, back = F.fp4_kv(F.Fp4KV("nvfp4", rotate_k=True, rotate_v=True), 0, q, k, v)
    assert torch.equal(q2, q @ r)
    assert torch.equal(k2, F.round_fp4(k @ r, "nvfp4"))
    assert torch.equal(v2, F.round_fp4(v @ r, "nvfp4"))
    assert back is not None and torch.equal(back, r.T)
    q3, k3, v3, back3 = F.fp4_kv(F.Fp4KV("mxfp4"), 0, q, k, v)
    assert torch.equal(q3, q) and back3 is None
    assert torch.equal(k3, F.round_fp4(k, "mxfp4")) and torch.equal(v3, F.round_fp4(v, "mxfp4"))
    # the k-transform's frame: k R - c rounded, c added back, its first token exact
    offset = torch.randn(2, 2, 32, generator=g)
    kt = E.KTransformScales(
        torch.full((2, 2), 0.05), torch.full((2, 2), 0.01), offset, r, first_tokens=1
    )
    q4, k4, v4, _ = F.fp4_kv(F.Fp4KV("nvfp4", k_transform=kt), 1, q, k, v)
    c = offset[1][None, :, None, :]
    assert torch.equal(q4, q @ r)
    assert torch.equal(k4[:, :, 1:], (F.round_fp4(k @ r - c, "nvfp4") + c)[:, :, 1:])
    assert torch.equal(k4[:, :, :1], (k @ r)[:, :, :1])
    # its first token's value exact too: the cache keeps both in its side buffer (the HF
    # tests of 4-bit pages in the k-transform's frame match the cache to such a simulation)
    assert torch.equal(v4[:, :, 1:], F.round_fp4(v, "nvfp4")[:, :, 1:])
    assert torch.equal(v4[:, :, :1], v[:, :, :1])
    _, _, v5, _ = F.fp4_kv(F.Fp4KV("fp8-k-nvfp4-v", k_transform=kt), 1, q, k, v)
    assert torch.equal(v5[:, :, 1:], F.round_fp4(v, "nvfp4")[:, :, 1:])
    assert torch.equal(v5[:, :, :1], v[:, :, :1])


def test_fp8_k_nvfp4_v_keys() -> None:
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 4, 9, 32, generator=g)
    k = torch.randn(1, 2, 9, 32, generator=g) * 3
    v = torch.randn(1, 2, 9, 32, generator=g)
    amax = torch.tensor([[9.0, 8.0], [7.0, 6.0]])
    static = E.CalibratedScales(k_amax=amax, v_amax=amax, num_tokens=9)
    fmt = F.Fp4KV("fp8-k-nvfp4-v", k_scales=static)
    assert fmt.label == "fp8-k-nvfp4-v (K per-tensor amax / 448)"
    q2, k2, v2, back = F.fp4_kv(fmt, 1, q, k, v)
    assert torch.equal(q2, q) and back is None
    assert torch.equal(k2, E.fake_quantize_kv(k, torch.tensor(7.0 / 448)))
    assert torch.equal(v2, F.round_fp4(v, "nvfp4"))


def test_rotation_without_rounding_is_the_unrounded_model(monkeypatch: pytest.MonkeyPatch) -> None:
    model, ids = _tiny_llama(), _ids()
    with E.simulate_fp8_kv(model, "none"):
        ref = E.teacher_forced(model, ids)
    monkeypatch.setattr(F, "round_fp4", lambda x, which: x.float())
    with E.simulate_fp8_kv(model, "fp4", F.Fp4KV("nvfp4", rotate_k=True, rotate_v=True)):
        got = E.teacher_forced(model, ids)
    assert torch.equal(got.argmax, ref.argmax)
    assert float((got.nll - ref.nll).abs().max()) < 1e-4


def test_fp4_variants_round_and_differ() -> None:
    model, ids = _tiny_llama(), _ids()
    with E.simulate_fp8_kv(model, "none"):
        ref = E.teacher_forced(model, ids)
    static = E.calibrate(model, ids)
    formats = [
        F.Fp4KV("nvfp4"),
        F.Fp4KV("nvfp4", rotate_k=True),
        F.Fp4KV("nvfp4", rotate_k=True, rotate_v=True),
        F.Fp4KV("mxfp4"),
        F.Fp4KV("fp8-k-nvfp4-v", k_scales=static),
    ]
    nlls = []
    for fmt in formats:
        with E.simulate_fp8_kv(model, "fp4", fmt):
            nlls.append(E.teacher_forced(model, ids).nll)
        assert float((nlls[-1] - ref.nll).abs().mean()) > 0, fmt.label
    for i in range(len(nlls)):
        for j in range(i):
            assert not torch.equal(nlls[i], nlls[j]), (formats[i].label, formats[j].label)


def test_fp4_labels_and_refusals() -> None:
    assert F.Fp4KV("nvfp4").label == "nvfp4"
    assert F.Fp4KV("mxfp4", rotate_k=True, rotate_v=True).label == "mxfp4 rot-KV"
    assert F.Fp4KV("nvfp4", rotate_k=True).label == "nvfp4 rot-K"
    amax = torch.ones(3, 2)
    static = E.CalibratedScales(k_amax=amax, v_amax=amax, num_tokens=1)
    kt = E.KTransformScales(amax, amax, torch.zeros(3, 2, 32), None, 1)
    assert F.Fp4KV("nvfp4", k_transform=kt).label == "nvfp4 (K k-transform)"
    assert F.Fp4KV("fp8-k-nvfp4-v", rotate_v=True, k_transform=kt).label == (
        "fp8-k-nvfp4-v rot-V (K k-transform)"
    )
    with pytest.raises(KVQuantError, match="unknown"):
        F.Fp4KV("fp4")
    with pytest.raises(ValueError, match="exactly one of them"):
        F.Fp4KV("fp8-k-nvfp4-v")
    with pytest.raises(KVQuantError, match="exactly one of them"):
        F.Fp4KV("fp8-k-nvfp4-v", k_scales=static, k_transform=kt)
    with pytest.raises(KVQuantError, match="no k_scales"):
        F.Fp4KV("nvfp4", k_scales=static)
    with pytest.raises(KVQuantError, match="rotate_k"):
        F.Fp4KV("nvfp4", rotate_k=True, k_transform=kt)
    model = _tiny_llama()
    with pytest.raises(KVQuantError, match="needs static scales"):
        with E.simulate_fp8_kv(model, "fp4"):
            pass
    with pytest.raises(KVQuantError, match="needs an Fp4KV"):
        with E.simulate_fp8_kv(model, "fp4", static):
            E.teacher_forced(model, _ids())


def test_recent_window_reads_the_newest_tokens_exactly() -> None:
    """``recent_tokens``: a window covering every position is the unrounded model (rotated
    frames included); a window of 0 is the plain row; in between, each position's nearest keys
    are exact and the NLL lies between the two."""
    model, ids = _tiny_llama(), _ids()
    with E.simulate_fp8_kv(model, "none"):
        ref = E.teacher_forced(model, ids)
    nll = {}
    for n in (0, 8, ids.shape[1]):
        fmt = F.Fp4KV("nvfp4", rotate_k=True, rotate_v=True, recent_tokens=n)
        assert fmt.label == "nvfp4 rot-KV" + (f" recent-{n}" if n else "")
        with E.simulate_fp8_kv(model, "fp4", fmt):
            got = E.teacher_forced(model, ids)
        nll[n] = float((got.nll - ref.nll).abs().mean())
        if n == ids.shape[1]:
            assert torch.equal(got.argmax, ref.argmax) and nll[n] < 1e-4
    with E.simulate_fp8_kv(model, "fp4", F.Fp4KV("nvfp4", rotate_k=True, rotate_v=True)):
        plain = E.teacher_forced(model, ids)
    assert nll[0] == float((plain.nll - ref.nll).abs().mean())
    assert nll[ids.shape[1]] < nll[8] < nll[0], nll
    with pytest.raises(KVQuantError, match="recent_tokens=-1"):
        F.Fp4KV("nvfp4", recent_tokens=-1)


def test_recent_window_attention_by_hand() -> None:
    """One query at the last position, window 2: the last two keys exact, the rest rounded."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 1, 32, generator=g)
    k, v = (torch.randn(1, 1, 5, 32, generator=g) for _ in range(2))
    fmt = F.Fp4KV("nvfp4", recent_tokens=2)
    _, kq, vq, _ = F.fp4_kv(fmt, 0, q, k, v)
    module = torch.nn.Module()
    module.scaling = 32**-0.5  # type: ignore[assignment]
    out, _ = F.fp4_attention(fmt, module, q, k, v, None)
    kk = torch.cat([kq[:, :, :3], k[:, :, 3:]], 2).repeat_interleave(2, 1)
    vv = torch.cat([vq[:, :, :3], v[:, :, 3:]], 2).repeat_interleave(2, 1)
    want = ((q @ kk.transpose(-1, -2)) * 32**-0.5).softmax(-1) @ vv
    assert torch.allclose(out, want.transpose(1, 2), atol=1e-6)
