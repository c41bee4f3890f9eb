"""The host work of a CUDA-graph decode step, pinned on CPU: no device sync, few operators.

A step that replays a captured graph is host bound at chat shapes: everything
the runner does between ``generate``'s per-step sync and the replay is time
the GPU waits. On CPU, :func:`benchmarks.harness.graph_stub.stubbed_replay`
sends the steps of a CPU model down the runner's CUDA branch with a stub graph
(its replay runs the static step eagerly, with the counters paused), so what
is counted is the runner's own host work per step: eligibility, the mask
check, page reservation, the static inputs, the output copy.

Syncs are the host reads of tensor values (``item``, ``tolist``, ``bool``,
``int``, ``float``, ``index``): each one waits for the device's stream on a
GPU. The one read the step keeps is the mask check's one-bit flag in pinned
host memory, which on CUDA is read after waiting for the check's own event
(recorded right after the two check kernels), not for the stream.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hf_steps import cache_kwarg
from hf_tiny import build, prompt
from torch.utils._python_dispatch import TorchDispatchMode

import kvquant.integrations.hf as kvhf
from benchmarks.harness.graph_stub import stubbed_replay
from kvquant.integrations.hf import graphs, padding

_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")

MAX_OPS_PER_STEP = 9
"""aten operators of one replayed step, but steps that take a new page (measured: 9 = the
mask check's compare, reduction, view and flag copy and read, the position fill, the two input
copies, the logits copy; before the device-side mask check: 15, with a clone of the mask and
a comparison of five kernels)."""


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.paused = False

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if not self.paused:
            self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self.paused, was = True, self.paused
        try:
            yield
        finally:
            self.paused = was


class _Steps:
    """Per replayed step: aten operators and host reads inside the runner's ``__call__``."""

    def __init__(self) -> None:
        self.ops = _Ops()
        self.reads: Counter[str] = Counter()
        self.counting = False
        self.cache: Any = None
        self.rows: list[tuple[Counter[str], Counter[str], int]] = []  # ops, reads, book version

    def flag(self) -> Any:
        memo = None if self.cache is None else self.cache.decode_mask_memo
        return getattr(memo, "flag", None)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        runner = graphs.DecodeGraphRunner
        call = runner.__call__
        steps = self

        @functools.wraps(call)
        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            before = (self.stats.captures, self.stats.replays)
            steps.cache = kwargs.get("cache", kwargs.get("past_key_values"))
            steps.reads.clear()
            steps.ops.counts.clear()
            steps.counting = True
            try:
                with steps.ops:
                    out = call(self, *args, **kwargs)
            finally:
                steps.counting = False
            replayed = self.stats.replays == before[1] + 1 and self.stats.captures == before[0]
            if replayed:
                version = steps.cache.book.version
                steps.rows.append((Counter(steps.ops.counts), Counter(steps.reads), version))
            return out

        saved = {name: getattr(torch.Tensor, name) for name in _READS}

        def reader(name: str) -> Any:
            original = saved[name]

            def read(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
                if steps.counting and not steps.ops.paused and tensor is not steps.flag():
                    steps.reads[name] += 1
                return original(tensor, *a, **k)

            return read

        runner.__call__ = counted  # type: ignore[method-assign]
        for name in _READS:
            setattr(torch.Tensor, name, reader(name))
        try:
            yield
        finally:
            runner.__call__ = call  # type: ignore[method-assign]
            for name, fn in saved.items():
                setattr(torch.Tensor, name, fn)


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
        )
    return out


@pytest.mark.parametrize("growable", [True, False])
def test_replayed_steps_do_not_sync_and_launch_few_ops(growable: bool) -> None:
    model = build("llama")
    ids, mask = prompt(batch=3, length=9, pad=(4, 0, 2))
    handle = kvhf.patch(model, backend="torch", page_size=4, cuda_graphs=False)
    want = _generate(model, ids, mask, 14)
    handle.remove()
    handle = kvhf.patch(
        model,
        backend="torch",
        page_size=4,
        cuda_graphs=True,
        max_cache_tokens=None if growable else 3 * 32,
    )
    counter = _Steps()
    with stubbed_replay(compute=True, around_replay=counter.ops.pause), counter.installed():
        got = _generate(model, ids, mask, 14)
    assert torch.equal(got, want)  # the stubbed graph path decodes what the eager path does
    stats = handle.state.graph_runner.stats
    assert stats.replays == 13 and stats.ordinary == 1  # the prefill
    rows = counter.rows
    assert len(rows) == 13 - stats.captures
    assert all(not reads for _, reads, _ in rows), [dict(r) for _, r, _ in rows]
    # steps that keep the block table: a bound on the operators (each a launch on a GPU)
    same_table = [
        ops for (ops, _, v), (_, _, prev) in zip(rows[1:], rows, strict=False) if v == prev
    ]
    assert same_table
    worst = max(same_table, key=lambda c: sum(c.values()))
    assert sum(worst.values()) <= MAX_OPS_PER_STEP, dict(worst)
    handle.remove()


def test_a_changed_mask_on_the_device_check_takes_the_full_check() -> None:
    """The device check of a step's mask fails when a row's padding changes: the step then
    runs the full check and, for a mask that is not left padding, the ordinary path."""
    model = build("llama")
    handle = kvhf.patch(model, backend="torch", page_size=4, cuda_graphs=True)
    stats = handle.state.graph_runner.stats
    ids, mask = prompt(batch=2, length=8, pad=(3, 0))
    key = cache_kwarg(model)
    cache = handle.new_cache()
    with torch.no_grad(), stubbed_replay(compute=True):
        model(input_ids=ids, attention_mask=mask, **{key: cache})
        grown = mask
        for t in range(8, 11):
            grown = torch.cat([grown, torch.ones(2, 1, dtype=grown.dtype)], dim=1)
            model(
                input_ids=ids[:, :1],
                attention_mask=grown,
                position_ids=torch.full((2, 1), t),
                **{key: cache},
            )
        memo = cache.decode_mask_memo
        assert isinstance(memo, padding.PaddingMemo) and memo.starts.tolist() == [3, 0]
        # row 1 gains a left pad (still pure left padding): new starts from the full check
        moved = torch.cat([grown, torch.ones(2, 1, dtype=grown.dtype)], dim=1)
        moved[1, 0] = 0
        model(
            input_ids=ids[:, :1],
            attention_mask=moved,
            position_ids=torch.full((2, 1), 11),
            **{key: cache},
        )
        assert cache.decode_mask_memo is not memo
        assert cache.decode_mask_memo.starts.tolist() == [3, 1]
        assert stats.replays == 4 and stats.ordinary == 1
