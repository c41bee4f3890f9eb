"""Continuous batching on kvquant's pages: ``generate_batch``, paged ``generate``, the manager.

Under a :func:`kvquant.patch`, transformers' continuous-batching cache holds kvquant's FP8
or 4-bit pages (:mod:`.layout`, :mod:`.storage`), each step's plan is built once for every layer
(:mod:`.plan`), kvquant's cache classes stand in for transformers' (:mod:`.caches`), and the
model's entry points raise what the batching thread only logs (:mod:`.wrappers`).
How and why: ``docs/dev/continuous-batching.md``. Supported: transformers 5.17 and 5.24.
"""

from __future__ import annotations

from kvquant.integrations.hf.continuous.caches import is_batching_cache
from kvquant.integrations.hf.continuous.layout import BATCH_KWARG, BlockLayout, layout_for
from kvquant.integrations.hf.continuous.plan import StepPlan, build_plan
from kvquant.integrations.hf.continuous.storage import (
    BatchingStorage,
    live_caches,
    plan_blocks,
    release,
)
from kvquant.integrations.hf.continuous.wrappers import install

__all__ = [
    "BATCH_KWARG",
    "BatchingStorage",
    "BlockLayout",
    "StepPlan",
    "build_plan",
    "install",
    "is_batching_cache",
    "layout_for",
    "live_caches",
    "plan_blocks",
    "release",
]
