"""The calibration-free simulation modes (benchmarks.harness.dynamic, mode ``"dynamic"``).

Tiny random Llama models only (the real SmolLM2 runs are benchmarks/accuracy_table.py's).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import benchmarks.harness.accuracy as E
import benchmarks.harness.dynamic as D
from kvquant.errors import KVQuantError
from kvquant.kernels import hadamard
from kvquant.kernels.fp8 import quantize_fp8

transformers = pytest.importorskip("transformers")


def _tiny_llama(seed: int = 0) -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a wide K/V spread, so FP8 rounding is visible
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(8.0)
            layer.self_attn.v_proj.weight.mul_(3.0)
    return model


def _ids(n: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed))


def _independent_groups(x: torch.Tensor, group: int, factor: float) -> torch.Tensor:
    """Group rounding one group at a time through the kernels' quantizer."""
    out = torch.empty_like(x, dtype=torch.float32)
    for idx in range(0, x.shape[-1], group):
        seg = x[..., idx : idx + group].float()
        amax = seg.abs().amax(dim=-1, keepdim=True)
        s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)) * factor
        out[..., idx : idx + group] = quantize_fp8(seg, s, torch.float8_e4m3fn).float() * s
    return out


@pytest.mark.parametrize("group", [8, 16])
@pytest.mark.parametrize("factor", [1.0, 1.05])
def test_round_groups_equals_an_independent_quantizer(group: int, factor: float) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 7, 16, generator=g) * 4
    x[0, 0, 0, :8] = 0.0  # an all-zero group
    got = D.round_groups(x, group, factor)
    assert torch.equal(got, _independent_groups(x, group, factor))
    if factor == 1.0:
        assert torch.equal(got, E.fake_quantize_kv(x, None, group_size=group))
    with pytest.raises(KVQuantError, match="does not divide head_dim 16"):
        D.round_groups(x, 6)


def test_dynamic_kv_codes_in_the_rotated_frame_and_first_tokens_exact() -> None:
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, 9, 16, generator=g)
    k = torch.randn(1, 2, 9, 16, generator=g) * 3 + 2
    v = torch.randn(1, 2, 9, 16, generator=g)
    fmt = D.DynamicFormat(k_group=8, v_group=16, rotate_k=True, rotate_v=True, first_tokens=1)
    q2, k2, v2, back = D.dynamic_kv(fmt, q, k, v)
    r = hadamard(16)
    assert torch.equal(q2, q @ r)
    assert torch.equal(k2[:, :, 1:], _independent_groups(k @ r, 8, 1.0)[:, :, 1:])
    assert torch.equal(v2[:, :, 1:], _independent_groups(v @ r, 16, 1.0)[:, :, 1:])
    assert torch.equal(k2[:, :, :1], (k @ r)[:, :, :1])
    assert torch.equal(v2[:, :, :1], (v @ r)[:, :, :1])
    assert back is not None and torch.equal(back, r.T)
    # rotated back, the values are v within e4m3's rounding of the group
    err = (v2 @ back - v).abs().amax()
    assert 0 < float(err) <= float((v @ r).abs().amax()) * 2.0**-4
    nan_k = k.clone()
    nan_k[0, 1, 4, 3] = float("nan")
    _, k3, _, _ = D.dynamic_kv(fmt, q, nan_k, v)
    assert torch.isnan(k3[0, 1, 4]).all() and torch.isfinite(k3[0, 0]).all()


def test_unrotated_dynamic_is_the_fp32_group_mode() -> None:
    model, ids = _tiny_llama(), _ids()
    for group in (8, 16):
        with E.simulate_fp8_kv(model, "fp32-group", group_size=group):
            base = E.teacher_forced(model, ids)
        with E.simulate_fp8_kv(model, "dynamic", D.DynamicFormat(k_group=group, v_group=group)):
            got = E.teacher_forced(model, ids)
        assert torch.equal(got.nll, base.nll) and torch.equal(got.argmax, base.argmax)


def test_rotation_without_rounding_is_the_unrounded_model(monkeypatch: pytest.MonkeyPatch) -> None:
    model, ids = _tiny_llama(), _ids()
    with E.simulate_fp8_kv(model, "none"):
        ref = E.teacher_forced(model, ids)
    monkeypatch.setattr(D, "round_groups", lambda x, group, factor=1.0: x.float())
    fmt = D.DynamicFormat(k_group=8, v_group=8, rotate_k=True, rotate_v=True)
    with E.simulate_fp8_kv(model, "dynamic", fmt):
        got = E.teacher_forced(model, ids)
    assert torch.equal(got.argmax, ref.argmax)
    assert float((got.nll - ref.nll).abs().max()) < 1e-4


def test_dynamic_variants_round_and_differ() -> None:
    model, ids = _tiny_llama(), _ids()
    with E.simulate_fp8_kv(model, "none"):
        ref = E.teacher_forced(model, ids)
    formats = [
        D.DynamicFormat(k_group=16, v_group=16),
        D.DynamicFormat(k_group=16, v_group=16, rotate_k=True),
        D.DynamicFormat(k_group=16, v_group=16, rotate_k=True, rotate_v=True),
        D.DynamicFormat(k_group=16, v_group=16, first_tokens=1),
        D.DynamicFormat(k_group=16, v_group=16, scale_factor=1.05),
    ]
    nlls = []
    for fmt in formats:
        with E.simulate_fp8_kv(model, "dynamic", fmt):
            nlls.append(E.teacher_forced(model, ids).nll)
        assert float((nlls[-1] - ref.nll).abs().mean()) > 0, fmt.label
    for i in range(len(nlls)):
        for j in range(i):
            assert not torch.equal(nlls[i], nlls[j]), (formats[i].label, formats[j].label)


def test_dynamic_format_labels_and_refusals() -> None:
    assert D.DynamicFormat().label == "dynamic G=64"
    assert D.DynamicFormat(rotate_k=True, first_tokens=1).label == "dynamic rot-K G=64 first=1"
    fmt = D.DynamicFormat(k_group=16, v_group=64, rotate_k=True, rotate_v=True)
    assert fmt.label == "dynamic rot-KV K G=16 V G=64"
    assert fmt.scaled(1.1).scaled(1.0).scale_factor == pytest.approx(1.1)
    model = _tiny_llama()
    scales = E.calibrate(model, _ids())
    with pytest.raises(KVQuantError, match="needs a DynamicFormat"):
        with E.simulate_fp8_kv(model, "dynamic", scales):
            E.teacher_forced(model, _ids())


def _assert_window_orders(model: Any, ids: torch.Tensor, simulate: Any) -> None:
    """``simulate(n)`` (a ``simulate_fp8_kv`` context with the newest ``n`` tokens exact): a
    window covering every position is the unrounded model; a window of 0 is the plain row; in
    between, the NLL gap to the unrounded model lies between the two."""
    with E.simulate_fp8_kv(model, "none"):
        ref = E.teacher_forced(model, ids)
    gap = {}
    for n in (0, 8, ids.shape[1]):
        with simulate(n):
            got = E.teacher_forced(model, ids)
        gap[n] = float((got.nll - ref.nll).abs().mean())
        if n == ids.shape[1]:
            assert torch.equal(got.argmax, ref.argmax) and gap[n] < 1e-4
    assert gap[ids.shape[1]] < gap[8] < gap[0], gap


def test_recent_window_of_dynamic_groups() -> None:
    """``recent_tokens`` in a dynamic format (rotated keys included): see
    :func:`_assert_window_orders`."""
    model, ids = _tiny_llama(), _ids()

    def simulate(n: int) -> Any:
        fmt = D.DynamicFormat(k_group=16, v_group=16, rotate_k=True, recent_tokens=n)
        assert fmt.label == "dynamic rot-K G=16" + (f" recent-{n}" if n else "")
        return E.simulate_fp8_kv(model, "dynamic", fmt)

    _assert_window_orders(model, ids, simulate)


@pytest.mark.parametrize("mode", ["per-tensor", "per-head", "k-transform"])
def test_recent_window_of_static_formats(mode: str) -> None:
    """``simulate_fp8_kv(..., recent_tokens=n)`` for static scales (the k-transform's rotated
    frame included): see :func:`_assert_window_orders`."""
    model, ids = _tiny_llama(), _ids()
    with E.simulate_fp8_kv(model, "capture") as captured:
        E.teacher_forced(model, ids)
    k_amax = torch.stack([captured[i][0] for i in range(3)])
    v_amax = torch.stack([captured[i][1] for i in range(3)])
    scales: Any = E.CalibratedScales(k_amax=k_amax / 8, v_amax=v_amax / 8, num_tokens=40)
    if mode == "k-transform":  # coarse scales, an offset and the rotation, no exact first token
        scales = E.KTransformScales(
            k_amax / 448 * 8, v_amax / 448 * 8, torch.randn(3, 2, 16), hadamard(16), 0
        )
    _assert_window_orders(
        model, ids, lambda n: E.simulate_fp8_kv(model, mode, scales, recent_tokens=n)
    )
    with pytest.raises(KVQuantError, match="recent_tokens=4 with mode 'dynamic'"):
        with E.simulate_fp8_kv(model, "dynamic", recent_tokens=4):
            pass
