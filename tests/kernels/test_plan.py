"""Kernel plans (:mod:`kvquant.kernels.plan`) hold the structural checks' result to cut host
overhead: they must not change results or skip a failing check.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from kvquant.errors import KernelInputError
from kvquant.kernels import PlanCache, plan_attention, plan_write, validate
from kvquant.kernels.attention.validate import check_attention_inputs
from kvquant.schemes import CAUSAL, GroupScales, Mask, Pages, PerHeadScales, PerTensorScales


def _write_args(**over: Any) -> dict[str, Any]:
    """``write_kv``'s arguments (group scales of 8 channels), with ``over`` replacing some."""
    pages = torch.zeros(4, 4, 2, 16, dtype=torch.float8_e4m3fn)
    args: dict[str, Any] = dict(
        key=torch.randn(2, 3, 2, 16),
        value=torch.randn(2, 3, 2, 16),
        pages=Pages(pages, torch.zeros_like(pages), torch.ones(4, 4, 2, 2), torch.ones(4, 4, 2, 2)),
        slot_mapping=torch.tensor([[0, 1, 2], [4, 5, -1]]),
        scheme=GroupScales(head_dim=16, group_size=8),
    )
    args.update(over)
    return args


def _fresh_pages(**changes: Any) -> Pages:
    """New pages and group scales of ``_write_args``, with ``changes``."""
    return dataclasses.replace(_write_args()["pages"], **changes)


def _attn_args(**over: Any) -> dict[str, Any]:
    """``paged_attention``'s arguments (per-tensor scales), with ``over`` replacing some."""
    pages = torch.zeros(4, 4, 2, 16, dtype=torch.float8_e4m3fn)
    args: dict[str, Any] = dict(
        query=torch.randn(2, 4, 1, 16).transpose(1, 2),
        pages=Pages(pages, torch.zeros_like(pages)),
        block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        seq_lens=torch.tensor([5, 8], dtype=torch.int32),
        scheme=PerTensorScales(torch.tensor(0.5), torch.tensor(0.5)),
        sm_scale=0.25,
        mask=CAUSAL,
        out=None,
    )
    args.update(over)
    return args


def _check_attn(args: dict[str, Any]) -> Any:
    return check_attention_inputs(**args)


def _run_attn(plans: PlanCache, args: dict[str, Any]) -> Any:
    return plans.paged_attention(**args, backend="torch")


def test_write_plan_is_reused_for_the_same_pages() -> None:
    plans = PlanCache()
    args = _write_args()
    first = plans.write_plan(**args, backend="torch")
    assert plans.num_write_plans == 1 and first.backend == "torch" and not first.fp4
    # a decode step: new K/V and slots, the same cache tensors
    assert plans.write_plan(**_write_args(pages=args["pages"]), backend="torch") is first
    # other cache tensors of the same shapes: checked again (they must not overlap)
    other = plans.write_plan(**_write_args(), backend="torch")
    assert other is not first and other.geometry == first.geometry
    assert plans.num_write_plans == 2
    first.run(**_write_args(pages=args["pages"]))  # a plan runs calls of its signature
    with pytest.raises(KernelInputError, match="differ from those the plan was built for"):
        first.run(**_write_args())  # ... not those into other tensors


@pytest.mark.parametrize(
    "change",
    [
        "key_dtype",
        "key_shape",
        "slot_dtype",
        "slot_shape",
        "pages_strides",
        "pages_dtype",
        "group_shape",
        "group_strides",
        "slot_device",
        "scale_mix",
    ],
)
def test_write_plans_never_skip_a_failing_structural_check(change: str) -> None:
    plans = PlanCache()
    good = _write_args()
    plan = plans.write_plan(**good)
    pages = good["pages"].k
    bad: dict[str, Any] = {
        "key_dtype": {"key": good["key"].to(torch.float64)},
        "key_shape": {"key": torch.randn(2, 3, 2, 8)},
        "slot_dtype": {"slot_mapping": good["slot_mapping"].to(torch.int32)},
        "slot_shape": {"slot_mapping": good["slot_mapping"][:, :2]},
        # slots share memory
        "pages_strides": {"pages": _fresh_pages(k=pages[:1].expand(4, 4, 2, 16))},
        "pages_dtype": {"pages": _fresh_pages(v=torch.zeros(4, 4, 2, 16, dtype=torch.float8_e5m2))},
        "group_shape": {"pages": _fresh_pages(v_scales=torch.ones(4, 4, 2, 4))},
        "group_strides": {"pages": _fresh_pages(k_scales=torch.ones(4, 4, 2, 4)[..., ::2])},
        "slot_device": {"slot_mapping": good["slot_mapping"].to("meta")},
        "scale_mix": {"scheme": PerTensorScales(torch.tensor(1.0), torch.tensor(1.0))},
    }[change]
    with pytest.raises(KernelInputError):
        plans.write_kv(**_write_args(**bad))
    with pytest.raises(KernelInputError):
        plan.run(**_write_args(**bad))
    plans.write_kv(**_write_args())  # the good signature still passes


def test_write_plans_see_in_place_metadata_changes_of_the_same_tensor() -> None:
    plans = PlanCache()
    args = _write_args()
    plans.write_kv(**args)
    args["pages"].k.as_strided_((4, 4, 2, 16), (0, 32, 16, 1))  # same object: pages overlap
    with pytest.raises(KernelInputError):
        plans.write_kv(**args)


def test_write_value_check_still_runs_on_a_planned_call() -> None:
    args = _write_args()
    plan = plan_write(**args)
    bad = _write_args(pages=args["pages"], slot_mapping=torch.tensor([[0, 1, 2], [4, 5, 16]]))
    with pytest.raises(KernelInputError, match="slot 16"):  # 16 = beyond the cache
        plan.run(**bad)
    assert not args["pages"].k.float().any()  # nothing written


def test_attention_plan_is_shared_and_value_checks_still_run() -> None:
    plans = PlanCache()
    plan = plans.attention_plan(**_attn_args())
    # other pages and query of the same geometry (another layer of the step): the same plan
    assert plans.attention_plan(**_attn_args()) is plan and plans.num_attention_plans == 1
    assert plan.geometry == _check_attn(_attn_args()) and plan.launch is None
    with pytest.raises(KernelInputError, match="seq_lens holds"):
        plan.run(**_attn_args(seq_lens=torch.tensor([5, 9], dtype=torch.int32)))
    with pytest.raises(KernelInputError, match="page ids"):
        _run_attn(plans, _attn_args(block_tables=torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)))
    with pytest.raises(KernelInputError, match="kv_start"):
        _run_attn(plans, _attn_args(mask=Mask(kv_start=torch.tensor([0, 9], dtype=torch.int32))))
    with pytest.raises(KernelInputError, match="differ from those the plan was built for"):
        plan.run(**_attn_args(sm_scale=0.5))


@pytest.mark.parametrize(
    "over",
    [
        {"sm_scale": math.nan},
        {"sm_scale": math.inf},
        {"sm_scale": torch.tensor(0.25)},
        {"mask": Mask(causal=1)},  # type: ignore[arg-type]
        {"mask": Mask(window=True)},
        {"mask": Mask(window=1.0)},  # type: ignore[arg-type]
        {"mask": Mask(window=-1)},
        {"mask": Mask(softcap=-1.0)},
        {"mask": Mask(softcap=True)},
        {"query": torch.randn(2, 1, 4, 16, dtype=torch.float64)},
        {"query": torch.randn(2, 1, 3, 16)},
        {"block_tables": torch.tensor([[0, 1], [2, 3]])},
        {"seq_lens": torch.tensor([5, 8])},
        {"mask": Mask(kv_start=torch.tensor([0, 0]))},
        {"out": torch.empty(2, 1, 4, 16, dtype=torch.float16)},
        {"scheme": PerHeadScales(torch.ones(3), torch.ones(3))},  # a scheme for 3 KV heads
    ],
)
def test_attention_plans_never_skip_a_failing_check(over: dict[str, Any]) -> None:
    plans = PlanCache()
    plan = plans.attention_plan(**_attn_args())
    plans.attention_plan(**_attn_args(mask=Mask(causal=False, window=3, softcap=2.0)))  # kept too
    with pytest.raises(KernelInputError):
        _run_attn(plans, _attn_args(**over))
    with pytest.raises(KernelInputError):
        plan.run(**_attn_args(**over))
    with pytest.raises(KernelInputError):
        plan_attention(**_attn_args(**over))


def test_plan_cache_is_bounded_and_stays_correct() -> None:
    plans = PlanCache(max_plans=8)
    for n in range(1, 20):
        _run_attn(plans, _attn_args(sm_scale=1.0 / n))
        assert plans.num_attention_plans <= 8
    with pytest.raises(KernelInputError):
        _run_attn(plans, _attn_args(mask=Mask(window=-1)))
    plans.clear()
    assert len(plans) == 0


def test_signature_declines_uncacheable_arguments() -> None:
    assert validate.signature(torch.zeros(2), None, 1, 2.0, True) is not None
    assert validate.signature(torch.zeros(2), "x") is None
    sparse = torch.zeros(2, 2).to_sparse()
    assert validate.signature(sparse) is None


def test_page_id_value_check_reads_only_used_columns_and_names_the_row() -> None:
    # seq_lens 5 and 4 with page_size 4: row 0 uses 2 pages, row 1 uses 1 (column 1 unused).
    lens = torch.tensor([5, 4], dtype=torch.int32)
    ok = torch.tensor([[0, 1], [2, 99]], dtype=torch.int32)  # 99 sits in an unused column
    _check_attn(_attn_args(block_tables=ok, seq_lens=lens))
    bad = torch.tensor([[0, 1], [-3, 99]], dtype=torch.int32)
    with pytest.raises(KernelInputError, match=r"block_tables row 1 uses page ids -3\.\.-3"):
        _check_attn(_attn_args(block_tables=bad, seq_lens=lens))
    both = torch.tensor([[0, 7], [5, 0]], dtype=torch.int32)
    with pytest.raises(KernelInputError, match=r"row 0 uses page ids 0\.\.7"):
        _check_attn(_attn_args(block_tables=both, seq_lens=lens))
