"""The 4-bit cache write: Triton (interpreted on CPU) and torch backends against the reference.

The kernel computes every code with integer and compare operations, so it must match the
reference byte for byte (pages and block scales) on every backend: fresh random data with
values past the calibrated range and non-finite values, shuffled and skipped slots, strided
inputs. Slots that are not written must keep their poison (random bytes, NaN scale codes);
a refused call must leave every written tensor as it was.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvquant.errors import BackendError, KernelInputError
from kvquant.kernels.fp4 import (
    MXFP4,
    NVFP4,
    Fp4Format,
    dequantize_fp4,
    fp4_page_storage,
)
from kvquant.kernels.write_fp4 import write_fp4
from kvquant.kernels.write_fp4.naive import write_fp4_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = [NVFP4, MXFP4]


def _poisoned(fmt: Fp4Format, num_pages: int, page: int, hkv: int, d: int) -> dict[str, Any]:
    """Pages of random bytes and block scales of the NaN code (untouched slots are detectable)."""
    out: dict[str, Any] = {}
    for side in ("k", "v"):
        pages, scales = fp4_page_storage(num_pages, page, hkv, d, fmt, device=DEV)
        pages.copy_(torch.randint(0, 256, pages.shape, dtype=torch.uint8))
        scales.view(torch.uint8).fill_(fmt.nan_scale_code)
        out[f"{side}_pages"], out[f"{side}_block_scales"] = pages, scales
    return out


def _globals(fmt: Fp4Format, hkv: int, per_head: bool) -> dict[str, Any]:
    if not fmt.global_scale:
        return {}
    if per_head:
        return {
            "k_global_scale": torch.rand(hkv, device=DEV) * 0.004 + 0.001,
            "v_global_scale": torch.rand(hkv, device=DEV) * 0.004 + 0.001,
        }
    return {
        "k_global_scale": torch.tensor(4.0 / 2688, device=DEV),
        "v_global_scale": torch.tensor(9.0 / 2688, device=DEV),
    }


def _new_tokens(bsz: int, seq: int, hkv: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(bsz, seq, hkv, d, generator=g) * 3
    key = key.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous
    value = (torch.randn(bsz, seq, hkv, d, generator=g) * 5).to(torch.bfloat16)
    key[0, 0, 0, :3] = torch.tensor([1e3, -1e5, 7.0])  # past the calibrated range
    key[1, 1, 1, 20] = float("nan")
    value[0, 1, 0, 33] = float("inf")
    key[1, 2, 0] = 0.0  # an all-zero token
    return key.to(DEV), value.to(DEV)


def _slots(bsz: int, seq: int, num_slots: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[: bsz * seq].reshape(bsz, seq).clone()
    slots.view(-1)[torch.randperm(bsz * seq, generator=g)[:2]] = -1
    return slots.to(DEV)


def _written(args: dict[str, Any]) -> dict[str, torch.Tensor]:
    names = ("k_pages", "v_pages", "k_block_scales", "v_block_scales")
    return {n: args[n].view(torch.uint8).clone() for n in names}


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    ("fmt", "per_head"),
    [(NVFP4, False), (NVFP4, True), (MXFP4, False)],
    ids=["nvfp4-per-tensor", "nvfp4-per-head", "mxfp4"],
)
def test_write_matches_reference_byte_for_byte(
    fmt: Fp4Format, per_head: bool, backend: str
) -> None:
    bsz, seq, hkv, d, num_pages, page = 2, 5, 2, 64, 4, 8
    seed = hash((fmt.name, per_head, backend)) % 2**31
    key, value = _new_tokens(bsz, seq, hkv, d, seed)
    slots = _slots(bsz, seq, num_pages * page, seed)
    got = _poisoned(fmt, num_pages, page, hkv, d)
    want = {k: v.clone() for k, v in got.items()}
    scales = _globals(fmt, hkv, per_head)
    write_fp4(key, value, slot_mapping=slots, fmt=fmt, backend=backend, **got, **scales)
    write_fp4_reference(key, value, slot_mapping=slots, fmt=fmt, **want, **scales)
    for name in want:
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name
    # slots never written keep their poison: random page bytes, NaN scale codes
    written = torch.zeros(num_pages * page, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    untouched = (~written).reshape(num_pages, page)
    assert (got["k_block_scales"].view(torch.uint8)[untouched] == fmt.nan_scale_code).all()
    # the written slots decode close to the input (NaN exactly where a block held a non-finite)
    flat = slots.reshape(-1).cpu()
    keep = flat >= 0
    pg, off = flat[keep] // page, flat[keep] % page
    back = dequantize_fp4(
        got["k_pages"][pg, off], got["k_block_scales"][pg, off], fmt, scales.get("k_global_scale")
    )
    k = key.reshape(-1, hkv, d)[keep.to(DEV)].float()
    nan_blocks = ~torch.isfinite(k).unflatten(-1, (-1, fmt.block_size)).all(-1)
    want_nan = nan_blocks.repeat_interleave(fmt.block_size, dim=-1)
    assert torch.equal(back.isnan(), want_nan)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_odd_geometry_and_large_pages(fmt: Fp4Format) -> None:
    """Three KV heads, a head_dim of three blocks (rows padded to powers of two), one token."""
    hkv, d = 3, 3 * fmt.block_size
    key, value = (torch.randn(1, 1, hkv, d, device=DEV) * 2 for _ in range(2))
    slots = torch.tensor([[37]], device=DEV)
    got = _poisoned(fmt, 2, 32, hkv, d)
    want = {k: v.clone() for k, v in got.items()}
    scales = _globals(fmt, hkv, per_head=True)
    write_fp4(key, value, slot_mapping=slots, fmt=fmt, backend="triton", **got, **scales)
    write_fp4_reference(key, value, slot_mapping=slots, fmt=fmt, **want, **scales)
    for name in want:
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name


def _valid_args(fmt: Fp4Format = NVFP4) -> dict[str, Any]:
    key, value = (torch.randn(1, 2, 2, 32, device=DEV) for _ in range(2))
    args: dict[str, Any] = {"key": key, "value": value, "fmt": fmt}
    args |= _poisoned(fmt, 2, 4, 2, 32) | _globals(fmt, 2, per_head=False)
    args["slot_mapping"] = torch.tensor([[0, 5]], device=DEV)
    return args


def _broken(change: str) -> dict[str, Any]:
    a = _valid_args()
    if change == "slot-out-of-range":
        a["slot_mapping"] = torch.tensor([[0, 8]], device=DEV)
    elif change == "int32-slots":
        a["slot_mapping"] = a["slot_mapping"].int()
    elif change == "fp8-pages":
        a["k_pages"] = a["k_pages"].view(torch.float8_e4m3fn)
    elif change == "fp32-block-scales":
        a["v_block_scales"] = a["v_block_scales"].float()
    elif change == "wrong-head-dim":
        a["key"] = torch.randn(1, 2, 2, 48, device=DEV)
    elif change == "missing-global-scale":
        a["k_global_scale"] = None
    elif change == "zero-global-scale":
        a["v_global_scale"] = torch.tensor(0.0, device=DEV)
    elif change == "nan-global-scale":
        a["k_global_scale"] = torch.tensor([0.1, float("nan")], device=DEV)
    elif change == "bf16-global-scale":
        a["k_global_scale"] = a["k_global_scale"].bfloat16()
    elif change == "shared-memory":
        a["v_pages"] = a["k_pages"]
    elif change == "not-a-format":
        a["fmt"] = "nvfp4"
    return a


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("slot-out-of-range", "slot 8"),
        ("int32-slots", "slot_mapping has dtype torch.int32"),
        ("fp8-pages", "k_pages has dtype torch.float8_e4m3fn"),
        ("fp32-block-scales", "v_block_scales has dtype torch.float32"),
        ("wrong-head-dim", r"key has shape \(1, 2, 2, 48\)"),
        ("missing-global-scale", "k_global_scale is a NoneType"),
        ("zero-global-scale", "v_global_scale element 0 is 0.0"),
        ("nan-global-scale", "k_global_scale element 1 is nan"),
        ("bf16-global-scale", "k_global_scale has dtype torch.bfloat16"),
        ("shared-memory", "share memory"),
        ("not-a-format", "fmt is 'nvfp4'"),
    ],
)
def test_a_refused_write_leaves_every_tensor_untouched(
    change: str, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVQUANT_CHECK_VALUES", "1")  # value checks (slots, scales) on a GPU too
    a = _broken(change)
    before = _written(a)
    with pytest.raises(KernelInputError, match=match):
        write_fp4(**a, backend="torch")
    for name, old in before.items():
        assert torch.equal(a[name].view(torch.uint8), old), name


def test_mxfp4_refuses_a_global_scale_and_odd_blocks() -> None:
    a = _valid_args(MXFP4)
    write_fp4(**a, backend="torch")  # valid
    with pytest.raises(KernelInputError, match="k_global_scale was given for mxfp4"):
        write_fp4(**a, k_global_scale=torch.tensor(1.0, device=DEV), backend="torch")
    pages, _ = fp4_page_storage(2, 4, 2, 48, NVFP4)  # head_dim 48: three NVFP4 blocks
    x = torch.randn(1, 2, 2, 48, device=DEV)
    scales = torch.zeros(2, 4, 2, 1, dtype=torch.uint8, device=DEV)
    with pytest.raises(KernelInputError, match="multiple of mxfp4's block size 32"):
        write_fp4(
            x, x, pages, pages.clone(), scales, scales.clone(), a["slot_mapping"],
            fmt=MXFP4, backend="torch",
        )  # fmt: skip


def test_unknown_backend_is_refused_before_writing() -> None:
    a = _valid_args()
    before = _written(a)
    with pytest.raises(BackendError, match="backend='cuda' is not a backend"):
        write_fp4(**a, backend="cuda")
    for name, old in before.items():
        assert torch.equal(a[name].view(torch.uint8), old), name
