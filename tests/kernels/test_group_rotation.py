"""fp32-group scales of Hadamard-rotated keys (``GroupScales(k_rotation=...)``, "rot-K").

K is stored as ``fp8(k @ R / s)`` with ``s = amax(group of k @ R) / fp8_max`` exactly (no
headroom: docs/dev/accuracy-history.md), V as without the rotation; the attention rotates the
query alike, so scores are ``q·k`` up to rounding. The torch reference is checked against that
algebra; the Triton write (interpreter) against the reference as in test_write.py, its K group
scales within fp32 rounding (numpy's and torch's fp32 matmuls sum in different orders). The
attention kernels' cases are test_attention.py's fp32-group cases with ``-rotated-k``, and
test_sinks.py's.
"""

from __future__ import annotations

import pytest
import torch
from numerics import assert_close_rel
from paged_cases import build_case
from test_write import _poisoned_cache_pages, _shuffled_slots, _strided, assert_codes_match

from kvquant.errors import KernelInputError, ScaleFormatError
from kvquant.kernels import (
    group_scale_storage,
    hadamard,
    paged_attention,
    write_kv,
    write_kv_reference,
)
from kvquant.kernels.fp8 import dequantize_pages, fp8_max, gather_kv
from kvquant.schemes import GroupScales, Pages, Scheme

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"


def test_scheme_keeps_a_checked_copy_of_the_rotation() -> None:
    rot = hadamard(64)
    scheme = GroupScales(head_dim=64, group_size=32, k_rotation=rot)
    rot.zero_()  # the caller's tensor: the scheme kept its own copy
    assert scheme.has_rotation and torch.equal(scheme.kernel_view().k_rotation, hadamard(64))
    assert not GroupScales(head_dim=64, group_size=32).has_rotation
    name, ints, tensors = scheme.flatten()
    back = Scheme.unflatten(name, ints, tensors)
    assert isinstance(back, GroupScales) and back.group_size == 32 and back.has_rotation
    assert GroupScales.for_head_dim(128, k_rotation=hadamard(128)).group_size == 64


@pytest.mark.parametrize(
    "d, rotation, match",
    [
        (64, torch.eye(64) * 2, "not orthonormal"),
        (64, hadamard(32), r"k_rotation has shape \(32, 32\); expected \(64, 64\)"),
        (64, hadamard(64).double(), "dtype torch.float64"),
        (64, torch.full((64, 64), float("nan")), "expected finite"),
        (8, hadamard(8), "power-of-two head_dim >= 16"),
        (48, torch.eye(48), "power-of-two head_dim >= 16"),
    ],
    ids=["not-orthonormal", "wrong-size", "fp64", "nan", "head-dim-8", "head-dim-48"],
)
def test_scheme_refuses_a_bad_rotation(d: int, rotation: torch.Tensor, match: str) -> None:
    with pytest.raises(ScaleFormatError, match=match) as info:
        GroupScales(head_dim=d, group_size=8, k_rotation=rotation)
    assert "Fix:" in str(info.value)


def _write_case(
    hkv: int, d: int, g: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, Pages, torch.Tensor, GroupScales]:
    """Biased K (a large near-constant channel, NaN in one row), bf16 V, cache-layout pages and
    NaN-filled group scales, shuffled slots (two skipped), the rotated scheme."""
    torch.manual_seed(seed)
    bsz, seq, num_pages, page = 2, 5, 4, 16
    key = _strided(torch.randn(bsz, seq, hkv, d, device=DEV) * 2)
    key[..., 1] += 30.0
    key[1, 2, 0, 3] = float("nan")  # the whole rotated row of (token, head 0) turns NaN
    value = (torch.randn(bsz, seq, hkv, d, device=DEV) * 3).to(torch.bfloat16)
    kp, vp = _poisoned_cache_pages((num_pages, page, hkv, d), torch.float8_e4m3fn, DEV)
    groups = [group_scale_storage(num_pages, page, hkv, d // g, device=DEV) for _ in "kv"]
    pages = Pages(kp, vp, *(x.fill_(float("nan")) for x in groups))
    slots = _shuffled_slots(bsz, seq, num_pages * page).to(DEV)
    return key, value, pages, slots, GroupScales(d, g, hadamard(d, device=DEV))


@pytest.mark.parametrize("g", [32, 64])
def test_reference_groups_the_rotated_key_with_scale_amax_over_fp8_max(g: int) -> None:
    """Codes ``fp8(k @ R / s)``, ``s = amax / 448`` of each group of ``k @ R`` exactly; V as
    without the rotation; dequantized and rotated back, K within FP8's rounding."""
    key, value, pages, slots, scheme = _write_case(2, 64, g, seed=g)
    write_kv_reference(key, value, pages, slots, scheme)
    keep = slots.reshape(-1) >= 0
    page, off = slots.reshape(-1)[keep] // 16, slots.reshape(-1)[keep] % 16
    rotated = key.reshape(-1, 2, 64)[keep].float() @ hadamard(64, device=DEV)
    amax = rotated.unflatten(-1, (-1, g)).abs().amax(-1)
    want = amax / torch.full_like(amax, fp8_max(torch.float8_e4m3fn))
    assert pages.k_scales is not None and pages.v_scales is not None
    torch.testing.assert_close(pages.k_scales[page, off], want, rtol=0, atol=0, equal_nan=True)
    plain = Pages(pages.k.clone(), pages.v.clone(), pages.k_scales.clone(), pages.v_scales.clone())
    write_kv_reference(key, value, plain, slots, GroupScales(64, g))
    assert torch.equal(plain.v.view(torch.uint8), pages.v.view(torch.uint8))
    torch.testing.assert_close(plain.v_scales, pages.v_scales, rtol=0, atol=0, equal_nan=True)
    back = dequantize_pages(
        pages.k[page, off], None, pages.k_scales[page, off], k_rotation=scheme.k_rotation
    )
    finite = torch.isfinite(key.reshape(-1, 2, 64)[keep]).all(-1)  # [N, Hkv]
    assert bool(back[~finite].isnan().all()) and bool(back[finite].isfinite().all())
    err = (back - key.reshape(-1, 2, 64)[keep].float())[finite]
    assert float(err.norm() / key.reshape(-1, 2, 64)[keep][finite].norm()) < 0.03


SHAPES = [(2, 64, 32), (2, 64, 64), (1, 128, 32), (8, 32, 16), (3, 16, 8)]


@pytest.mark.parametrize("hkv, d, g", SHAPES, ids=[f"hkv{h}-d{d}-g{g}" for h, d, g in SHAPES])
def test_triton_write_matches_reference(hkv: int, d: int, g: int) -> None:
    key, value, pages, slots, scheme = _write_case(hkv, d, g, seed=hkv * d + g)
    assert pages.k_scales is not None and pages.v_scales is not None
    ref = Pages(*(t.clone() for t in (pages.k, pages.v, pages.k_scales, pages.v_scales)))
    write_kv(key, value, pages, slots, scheme, backend="triton")
    write_kv_reference(key, value, ref, slots, scheme)
    # codes: the interpreter's fp8-cast bug, and one ulp where the group scale rounds apart
    n_k = assert_codes_match(pages.k, ref.k, exact=False, what="k_pages")
    n_v = assert_codes_match(pages.v, ref.v, exact=HAS_CUDA, what="v_pages")
    written = int((slots >= 0).sum()) * hkv * d
    assert n_k + n_v <= 0.1 * 2 * written
    torch.testing.assert_close(pages.k_scales, ref.k_scales, rtol=1e-6, atol=0, equal_nan=True)
    torch.testing.assert_close(pages.v_scales, ref.v_scales, rtol=0, atol=0, equal_nan=True)
    assert int(pages.k_scales.isfinite().sum()) == int((slots >= 0).sum()) * hkv * (d // g) - (
        d // g if int(slots[1, 2]) >= 0 else 0
    )  # every written group (but the NaN row's), nothing else


def _model_frame_attention(case: object) -> torch.Tensor:
    """fp32 SDPA per sequence over the keys the pages dequantize to in the model frame
    (``(code * s) @ R^T``): no query rotation here."""
    view = case.scheme.kernel_view()  # type: ignore[attr-defined]
    query, pages = case.query, case.pages  # type: ignore[attr-defined]
    bt, lens, start = case.block_tables, case.seq_lens, case.mask.kv_start  # type: ignore[attr-defined]
    bsz, lq, hq, d = query.shape
    group = hq // pages.k.shape[2]
    out = torch.zeros(bsz, lq, hq, d)
    for b in range(bsz):
        n, s0 = int(lens[b]), 0 if start is None else int(start[b])
        k = dequantize_pages(
            gather_kv(pages.k, bt, n, b), None, gather_kv(pages.k_scales, bt, n, b),
            k_rotation=view.k_rotation,
        )  # fmt: skip
        v = dequantize_pages(
            gather_kv(pages.v, bt, n, b), None, gather_kv(pages.v_scales, bt, n, b)
        )
        pos_q, pos_k = torch.arange(n - lq, n)[:, None], torch.arange(n)[None, :]
        mask = (pos_k >= s0) & (pos_k <= pos_q)
        o = torch.nn.functional.scaled_dot_product_attention(
            query[b].float().transpose(0, 1),
            k.repeat_interleave(group, dim=1).transpose(0, 1),
            v.repeat_interleave(group, dim=1).transpose(0, 1),
            attn_mask=mask,
            scale=case.sm_scale,  # type: ignore[attr-defined]
        )
        out[b] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("g", [32, 64])
@pytest.mark.parametrize("lq", [1, 3])
def test_reference_scores_are_q_dot_k(g: int, lq: int) -> None:
    """The reference's rotated query against the rotated pages equals attention over the keys
    rotated back (model frame), with left padding."""
    case = build_case(
        [37, 50], hq=8, hkv=2, d=64, lq=lq, kv_start=[0, 9], granularity="fp32-group",
        group_size=g, k_transform="rotation", qdtype=torch.float32, seed=g + lq,
    )  # fmt: skip
    assert_close_rel(case.reference(), _model_frame_attention(case), rel_tol=2e-5)


def test_entry_points_refuse_a_rotation_for_other_pages() -> None:
    """A scheme built for head_dim 64 against pages of head_dim 32: refused by shape."""
    case = build_case([20], hq=4, hkv=2, d=32, granularity="fp32-group", group_size=16)
    wrong = GroupScales(head_dim=64, group_size=32, k_rotation=hadamard(64))
    with pytest.raises(KernelInputError, match=r"k_rotation has shape \(64, 64\); expected \(32"):
        paged_attention(case.query, case.pages, case.block_tables, case.seq_lens, wrong,
                        sm_scale=0.1)  # fmt: skip
    odd = Scheme.unflatten("fp32-group", [32, 16], [torch.eye(16)])  # not checked again
    with pytest.raises(KernelInputError, match=r"k_rotation has shape \(16, 16\)"):
        paged_attention(case.query, case.pages, case.block_tables, case.seq_lens, odd,
                        sm_scale=0.1)  # fmt: skip
    key = torch.randn(1, 2, 2, 32)
    with pytest.raises(KernelInputError, match=r"k_rotation has shape \(16, 16\)"):
        write_kv(key, key, case.pages, torch.tensor([[0, 1]]), odd)
