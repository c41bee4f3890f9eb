"""The CUDA-graph decode path of a kvquant-patched model, run on CPU with the replay stubbed.

On a CPU model the :class:`~kvquant.integrations.hf.graphs.DecodeGraphRunner`
runs its static step eagerly; on CUDA it captures the step once and then only
replays it. :func:`stubbed_replay` makes a CPU model take the CUDA branch: the
"capture" runs the static step eagerly once (its output becomes the record's
output, as a capture's does) and installs a :class:`StubGraph`, whose
``replay()`` either does nothing (host-cost measurements: what remains of a
step is the runner's host work, as on a GPU) or runs the static step again
eagerly and copies its output into the captured one (tests: the logits stay
right). Used by ``tests/hf/test_hf_graph_host.py`` and
``benchmarks/host_overhead.py --graph``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvquant.integrations.hf import graphs


class StubGraph:
    """Stands for a captured CUDA graph: ``replay()`` calls ``step`` (None: does nothing)."""

    def __init__(self, step: Callable[[], None] | None) -> None:
        self.step = step
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        if self.step is not None:
            self.step()


def _copy_into(dst: Any, src: Any) -> None:
    """Copy the tensors of output ``src`` into the matching tensors of ``dst``."""
    items = (
        zip(dst, src, strict=True)
        if isinstance(dst, tuple)
        else ((dst[k], src[k]) for k in dst.keys())
    )
    for d, s in items:
        if isinstance(d, torch.Tensor):
            d.copy_(s)


@contextlib.contextmanager
def stubbed_replay(
    compute: bool, around_replay: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
) -> Iterator[list[StubGraph]]:
    """Decode steps of CPU models take the graph runner's CUDA branch, with stub graphs.

    Args:
        compute: whether a replay runs the static step eagerly (correct outputs)
            or does nothing (the step's host work only).
        around_replay: a context manager entered around each computing replay
            (e.g. to pause an operator counter).

    Yields:
        the stub graphs installed so far (one per capture).
    """
    runner = graphs.DecodeGraphRunner
    made: list[StubGraph] = []

    def capture(self: Any, cache: Any, rec: Any, compiled: bool) -> None:
        out = self._run(cache, rec, compiled)
        rec.output = graphs._without_cache(out, cache)
        step = None
        if compute:

            def step() -> None:
                with around_replay() if around_replay is not None else contextlib.nullcontext():
                    _copy_into(
                        rec.output, graphs._without_cache(self._run(cache, rec, compiled), cache)
                    )

        rec.graph = StubGraph(step)
        made.append(rec.graph)
        self.stats.captures += 1

    saved = {name: runner.__dict__[name] for name in ("_replays", "_capture")}
    runner._replays = lambda self, device: True  # type: ignore[method-assign]
    runner._capture = capture  # type: ignore[method-assign]
    try:
        yield made
    finally:
        for name, fn in saved.items():
            setattr(runner, name, fn)
