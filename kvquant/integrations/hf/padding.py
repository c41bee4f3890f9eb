"""The left-padding check of a decode-graph step's attention mask (:mod:`kvquant.integrations.hf.graphs`).

A static decode step carries the padding as per-row starts (``kv_start``), so
its 2D mask must be pure left padding with a real newest token in every row.
The first decode step of a cache checks the mask on the host
(:func:`left_padding_starts`); the cache keeps the starts in a
:class:`PaddingMemo`, which checks every later step's mask on its device
without a stream sync (:func:`step_padding_check`). Design:
docs/dev/decode-steps.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvquant.integrations.hf.cache_layer import KVQuantCache

__all__ = [
    "PaddingCheck",
    "PaddingMemo",
    "left_padding_starts",
    "step_left_padding_starts",
    "step_padding_check",
]


def left_padding_starts(
    mask: torch.Tensor | None, batch: int, total: int, device: torch.device
) -> torch.Tensor | None:
    """Left-padding starts int32 ``[B]`` of a 2D padding mask ``[B, total]``, or None.

    None means the mask is not pure left padding with a real newest token in
    every row (or has another shape): the step must take the ordinary path,
    which applies or refuses it. Reads the mask's values: one copy to the host,
    where the check runs (a handful of GPU launches and a sync cost more than
    copying a ``[B, total]`` mask at the sizes a decode step has).

    Example:
        >>> import torch
        >>> m = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
        >>> left_padding_starts(m, 2, 4, m.device).tolist()
        [2, 0]
        >>> left_padding_starts(torch.tensor([[1, 0, 1, 1]]), 1, 4, m.device) is None
        True
    """
    if mask is None:
        return torch.zeros(batch, dtype=torch.int32, device=device)
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (batch, total):
        return None
    host = mask.to("cpu")
    real = host if host.dtype == torch.bool else host != 0
    start = (~real).sum(dim=1, dtype=torch.int32)
    cols = torch.arange(total, dtype=torch.int32)
    if not (bool((real == (cols[None, :] >= start[:, None])).all()) and bool(real[:, -1].all())):
        return None
    return start.to(device)


class PaddingMemo:
    """The left-padding starts of a cache's decode steps, and the device check of each step's mask.

    Built from a mask that passed the full check (:func:`left_padding_starts`).
    A later step's mask is served by the same starts when it is still pure left
    padding with those starts: equal to ``pattern`` (row ``b`` is ``starts[b]``
    zeros, then ones) over its length. :meth:`launch` queues that comparison on
    the mask's device and a non-blocking copy of its one-bit result to
    ``flag`` (pinned host memory on CUDA), then records ``event``; :meth:`passed`
    waits for that event only (not for the stream), so a step launches the check
    first, does its host bookkeeping, and reads the result just before the replay.

    Attributes:
        starts: int32 ``[B]`` left-padding starts, on the step's device.
        pattern: ``[B, width]`` in the mask's dtype, on its device (None: the
            steps pass no mask, every start is 0).
        flag: bool ``[]`` on the host, True when the last launched check failed.
        event: CUDA event recorded after the flag's copy (None off CUDA, where
            the copy is done when :meth:`launch` returns).
    """

    def __init__(self, starts: torch.Tensor, mask: torch.Tensor | None, total: int) -> None:
        self.starts = starts
        self.pattern: torch.Tensor | None = None
        self.event: Any = None
        cuda = mask is not None and mask.device.type == "cuda"
        self.flag = torch.zeros((), dtype=torch.bool, pin_memory=cuda)
        if mask is not None:
            self.pattern = self._pattern(mask, max(2 * total, 64))
            if cuda:
                self.event = torch.cuda.Event()

    def _pattern(self, mask: torch.Tensor, width: int) -> torch.Tensor:
        cols = torch.arange(width, dtype=torch.int32, device=mask.device)
        return (cols[None, :] >= self.starts.to(mask.device)[:, None]).to(mask.dtype)

    def fits(self, mask: torch.Tensor | None, batch: int, total: int) -> bool:
        """Whether :meth:`launch` can check ``mask`` (a ``[B, total]`` tensor where the pattern is)."""
        if mask is None or self.pattern is None:
            return mask is None and self.pattern is None
        return (
            isinstance(mask, torch.Tensor)
            and tuple(mask.shape) == (batch, total)
            and mask.device == self.pattern.device
        )

    def launch(self, mask: torch.Tensor | None, total: int) -> None:
        """Queue the check of ``mask`` (:meth:`fits`); its result is :meth:`passed`'s."""
        if mask is None or self.pattern is None:
            return
        if total > self.pattern.shape[1]:
            self.pattern = self._pattern(mask, 2 * total)
        bad = torch.ne(mask, self.pattern[:, :total]).any()
        self.flag.copy_(bad, non_blocking=self.event is not None)
        if self.event is not None:  # on the stream of the mask's device, which ran the check
            self.event.record(torch.cuda.current_stream(mask.device))

    def passed(self) -> bool:
        """Whether the last launched check found the mask pure left padding with :attr:`starts`."""
        if self.pattern is None:
            return True
        if self.event is not None:
            self.event.synchronize()
        return not self.flag.item()  # a host tensor: no device sync


class PaddingCheck:
    """A decode step's left-padding starts, pending its mask's device check (:class:`PaddingMemo`).

    Made by :func:`step_padding_check`. Without a memo that fits the mask, the
    full check (:func:`left_padding_starts`, which copies the mask to the host)
    runs at once; otherwise :meth:`starts` reads the launched check and, should
    the mask have failed it, runs the full check then.
    """

    def __init__(
        self,
        cache: KVQuantCache,
        mask: torch.Tensor | None,
        total: int,
        device: torch.device,
        launched: PaddingMemo | None,
    ) -> None:
        self.cache, self.mask, self.total, self.device = cache, mask, total, device
        self.launched = launched
        self.result = None if launched is not None else self._full_check()

    @property
    def refused(self) -> bool:
        """Whether the full check ran already and found the mask not pure left padding."""
        return self.launched is None and self.result is None

    def _full_check(self) -> torch.Tensor | None:
        cache, mask = self.cache, self.mask
        checked = left_padding_starts(mask, cache.batch_size_, self.total, self.device)
        cache.decode_mask_memo = None if checked is None else PaddingMemo(checked, mask, self.total)
        return checked

    def starts(self) -> torch.Tensor | None:
        """The step's int32 ``[B]`` starts, or None (not pure left padding: the ordinary path)."""
        memo, self.launched = self.launched, None
        if memo is not None:
            self.result = memo.starts if memo.passed() else self._full_check()
        return self.result


def step_padding_check(
    cache: KVQuantCache, mask: torch.Tensor | None, total: int, device: torch.device
) -> PaddingCheck:
    """The :class:`PaddingCheck` of a decode step's mask, launched on the device when it can be.

    ``generate`` grows the mask by a column of ones each step, so the starts of
    the first decode step (found by the full check) serve every later one; the
    cache keeps them in its :class:`PaddingMemo` (``decode_mask_memo``), which
    checks each later mask on its device (two kernels and a one-bit copy to the
    host, no stream sync). A mask the memo cannot check (another shape or
    device, no memo yet) takes the full check at once.
    """
    memo = cache.decode_mask_memo
    if isinstance(memo, PaddingMemo) and memo.fits(mask, cache.batch_size_, total):
        memo.launch(mask, total)
        return PaddingCheck(cache, mask, total, device, memo)
    return PaddingCheck(cache, mask, total, device, None)


def step_left_padding_starts(
    cache: KVQuantCache, mask: torch.Tensor | None, total: int, device: torch.device
) -> torch.Tensor | None:
    """:func:`left_padding_starts` of a decode step, checked against the cache's memo
    (:func:`step_padding_check`, read at once): the memo's starts when the mask is still
    pure left padding with them, else the full check's (None: not pure left padding)."""
    return step_padding_check(cache, mask, total, device).starts()
