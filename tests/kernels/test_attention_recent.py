"""The reference attention with each sequence's newest tokens read from a full-precision ring
(:class:`~kvquant.schemes.RecentTokens`) beside 4-bit pages (CPU)."""

from __future__ import annotations

import pytest
import torch
from test_attention_fp4 import DEV, build

from kvquant.kernels import paged_attention_reference
from kvquant.kernels.fp4 import MXFP4, dequantize_fp4, quantize_fp4
from kvquant.schemes import RecentTokens


def _ring(x: torch.Tensor, lens: list[int], ring: int) -> torch.Tensor:
    """``[B, R, Hkv, D]``: position ``p`` of row ``b`` at ``p % R`` (its newest ``R`` tokens), on
    the device the cases put their pages on."""
    out = torch.full((x.shape[0], ring, *x.shape[2:]), float("nan"), dtype=x.dtype)
    for b, n in enumerate(lens):
        for p in range(max(0, n - ring), n):
            out[b, p % ring] = x[b, p]
    return out.to(DEV)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Decode attention of ``q [B, 1, Hq, D]`` over each row's first ``lens[b]`` keys."""
    rows = []
    k, v = k.to(q.device), v.to(q.device)
    group = q.shape[2] // k.shape[2]
    for b, n in enumerate(lens):
        kb = k[b, :n].repeat_interleave(group, 1).transpose(0, 1)  # [Hq, n, D]
        vb = v[b, :n].repeat_interleave(group, 1).transpose(0, 1)
        qb = q[b].float().transpose(0, 1)  # [Hq, 1, D]
        rows.append(torch.nn.functional.scaled_dot_product_attention(qb, kb, vb).transpose(0, 1))
    return torch.stack(rows)


@pytest.mark.parametrize("ring", [4, 16])
def test_newest_tokens_come_from_the_ring(ring: int) -> None:
    """MXFP4 pages (no global scale): keys and values rounded through the 4-bit codes, but the
    newest ``ring`` of each row exact; a NaN-poisoned ring slot outside them is never read."""
    lens = [37, 9]
    case = build("mxfp4", lens, hq=4, hkv=2, d=64, seed=4)
    key, value = case.key.float(), case.value.float()
    rounded = [dequantize_fp4(*quantize_fp4(x, MXFP4), MXFP4) for x in (key, value)]
    mixed = [r.clone() for r in rounded]
    for b, n in enumerate(lens):
        for m, x in zip(mixed, (key, value), strict=True):
            m[b, max(0, n - ring) : n] = x[b, max(0, n - ring) : n]
    recent = RecentTokens(
        torch.stack(dim=1, tensors=(_ring(key, lens, ring), _ring(value, lens, ring)))
    )
    kw = dict(sm_scale=64**-0.5)
    args = (case.query, case.pages, case.block_tables, case.seq_lens, case.scheme)
    got = paged_attention_reference(*args, recent=recent, **kw).float()
    assert torch.allclose(got, _sdpa(case.query, *mixed, lens), atol=2e-3)
    plain = paged_attention_reference(*args, **kw).float()
    assert torch.allclose(plain, _sdpa(case.query, *rounded, lens), atol=2e-3)
    assert float((got - plain).abs().max()) > 0.05  # the 4-bit error of the newest tokens


def test_a_ring_as_long_as_the_sequence_is_exact_attention() -> None:
    lens = [20, 13]
    case = build("nvfp4", lens, hq=4, hkv=2, d=32, seed=6)
    key, value = case.key.float(), case.value.float()
    recent = RecentTokens(
        torch.stack(dim=1, tensors=(_ring(key, lens, 32), _ring(value, lens, 32)))
    )
    got = paged_attention_reference(
        case.query, case.pages, case.block_tables, case.seq_lens, case.scheme,
        sm_scale=32**-0.5, recent=recent,
    )  # fmt: skip
    assert torch.allclose(got.float(), _sdpa(case.query, key, value, lens), atol=2e-3)


@pytest.mark.parametrize(
    ("kind", "lq", "ring", "extra", "options"),
    [
        ("mxfp4", 1, 4, {"num_splits": 2}, {}),
        ("nvfp4", 1, 16, {}, {}),
        ("fp8-k-nvfp4-v", 1, 8, {}, {}),
        ("nvfp4", 12, 8, {}, {}),
        ("nvfp4", 1, 24, {}, {"softcap": 5.0, "window": 20}),
        ("mxfp4", 12, 16, {}, {"softcap": 5.0, "window": 10}),
    ],
)
def test_triton_reads_the_ring_like_the_reference(
    kind: str, lq: int, ring: int, extra: dict[str, int], options: dict[str, float]
) -> None:
    """The Triton kernel (interpreter here) against the reference, a NaN-poisoned ring slot
    outside each row's newest tokens never read; decode (split or not) and a prefill chunk,
    also with a softcap and a sliding window shorter than the ring."""
    from kvquant.kernels.attention.launch import paged_attention_triton

    lens = [37, 9]
    mask: dict[str, object] = {} if lq == 1 else {"q_lens": [12, 5]}
    mask |= options
    case = build(kind, lens, hq=4, hkv=2, d=64, seed=7, lq=lq, **mask)
    recent = RecentTokens(
        torch.stack(dim=1, tensors=(_ring(case.key, lens, ring), _ring(case.value, lens, ring)))
    )
    args = (case.query, case.pages, case.block_tables, case.seq_lens, case.scheme)
    kw = dict(sm_scale=64**-0.5, mask=case.mask)
    ref = paged_attention_reference(*args, recent=recent, **kw)
    out = torch.full_like(case.query, float("nan"))
    got = paged_attention_triton(*args, recent=recent, out=out, **kw, **extra)
    assert torch.isfinite(got).all()
    assert float((got.float() - ref.float()).abs().max()) < 5e-3
    plain = paged_attention_reference(*args, **kw)
    assert float((got.float() - plain.float()).abs().max()) > 0.05


def test_paged_attention_takes_the_ring_on_both_backends() -> None:
    """The public entry point: plans keyed by the ring's presence; torch and Triton agree."""
    from kvquant.kernels import paged_attention

    lens = [30, 12]
    case = build("nvfp4", lens, hq=4, hkv=2, d=64, seed=9)
    recent = RecentTokens(
        torch.stack(dim=1, tensors=(_ring(case.key, lens, 8), _ring(case.value, lens, 8)))
    )
    args = (case.query, case.pages, case.block_tables, case.seq_lens, case.scheme)
    kw = dict(sm_scale=64**-0.5, mask=case.mask)
    ref = paged_attention(*args, recent=recent, backend="torch", **kw)
    got = paged_attention(*args, recent=recent, backend="triton", **kw)
    plain = paged_attention(*args, backend="triton", **kw)
    assert float((got.float() - ref.float()).abs().max()) < 5e-3
    assert float((got.float() - plain.float()).abs().max()) > 0.05


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("not-a-ring", "recent is a tuple"),
        ("shape", r"recent_kv has shape"),
        ("dtype", "recent_kv has dtype"),
        ("strides", "recent_kv has strides"),
    ],
)
def test_a_malformed_ring_is_refused(change: str, match: str) -> None:
    from kvquant.errors import KernelInputError
    from kvquant.kernels import paged_attention

    case = build("nvfp4", [20], hq=2, hkv=1, d=32, seed=2)
    dev = case.query.device
    kv = torch.zeros(1, 2, 4, 1, 32, device=dev)
    recent: object = RecentTokens(kv)
    if change == "not-a-ring":
        recent = (kv[:, 0], kv[:, 1])
    elif change == "shape":
        recent = RecentTokens(torch.zeros(1, 2, 4, 2, 32, device=dev))
    elif change == "dtype":
        recent = RecentTokens(kv.to(torch.int32))
    elif change == "strides":
        recent = RecentTokens(torch.zeros(1, 2, 4, 1, 64, device=dev)[..., ::2])
    with pytest.raises(KernelInputError, match=match) as info:
        paged_attention(case.query, case.pages, case.block_tables, case.seq_lens, case.scheme,
                        sm_scale=0.1, recent=recent, backend="torch")  # type: ignore[arg-type]  # fmt: skip
    assert "Fix:" in str(info.value)


@pytest.mark.parametrize(
    ("kind", "config"),
    [("per-tensor", {}), ("fp32-group", {}), ("fp32-group", {"FOLD": True}),
     ("fp32-group", {"FOLD": False}), ("fp32-group-rotated", {}), ("k-transform", {})],
)  # fmt: skip
def test_triton_reads_the_ring_over_fp8_pages(kind: str, config: dict[str, bool]) -> None:
    """FP8 pages of every scheme (static, group scales folded or not, a rotation, the
    k-transform's offset with first tokens): the ring's keys and values join the tiles in the
    tiles' units. The Triton kernel against the reference, NaN-filled output."""
    from paged_cases import build_case

    from kvquant.kernels.attention.launch import paged_attention_triton

    lens, ring = [37, 9], 8
    kw: dict[str, object] = {"hq": 4, "hkv": 2, "d": 64, "seed": 3, "device": DEV}
    if kind.startswith("fp32-group"):
        kw |= {"granularity": "fp32-group", "group_size": 32}  # two groups: folded, 2 copies
        if kind.endswith("rotated"):
            kw["k_transform"] = "rotation"
    elif kind == "k-transform":
        kw |= {"granularity": "per-head", "k_transform": "both", "first_lens": [1, 1],
               "n_first": 1}  # fmt: skip
    case = build_case(lens, **kw)  # type: ignore[arg-type]
    assert case.key is not None and case.value is not None
    rot = case.scheme.kernel_view().k_rotation
    key = case.key.float()
    keys = key if rot is None else key @ rot.float().to(key.device)
    recent = RecentTokens(
        torch.stack(dim=1, tensors=(_ring(keys, lens, ring), _ring(case.value.float(), lens, ring)))
    )
    ref = case.attend(paged_attention_reference, recent=recent).float()
    out = torch.full_like(case.query, float("nan"))
    got = case.attend(paged_attention_triton, recent=recent, out=out, config=config).float()
    assert torch.isfinite(got).all()
    err = float((got - ref).abs().max())
    plain = float((case.attend(paged_attention_reference).float() - ref).abs().max())
    assert err < 5e-3, err
    assert plain > 3 * err, (plain, err)
