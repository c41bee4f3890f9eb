"""The plan of one continuous-batching step, built once per forward for every layer: the slots
to write, the requests attending at full precision, and the paged-attention launches of the rest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvquant.errors import (
    BatchingError,
)
from kvquant.integrations.hf.continuous.layout import FULL_ATTENTION, BlockLayout

__all__ = [
    "StepPlan",
    "build_plan",
    "decode_plan",
]

# ---------------------------------------------------------------------- step plan


@dataclass
class _Launch:
    """One paged-attention launch over some rows of the step."""

    gather: torch.Tensor  # int64 [Bp, Lq]: the packed token row of each query slot (clamped)
    valid: torch.Tensor | None  # int64 [n]: flat slots of ``gather`` that are real queries
    tokens: torch.Tensor  # int64 [n]: their packed token rows
    block_tables: torch.Tensor  # int32 [Bp, P]
    seq_lens: torch.Tensor  # int32 [Bp]
    q_lens: torch.Tensor | None  # int32 [Bp], None when every row has Lq queries
    first_pages: torch.Tensor | None  # int64 [Bp]: each row's first block (k-transform)
    first_lens: torch.Tensor | None  # int32 [Bp]
    recent_blocks: torch.Tensor | None  # int64 [Bp, R]: the block of each ring slot's position


@dataclass
class StepPlan:
    """What one forward of a continuous batch needs, built once for every layer.

    Attributes:
        tokens: query tokens of the step (the packed batch, padding included).
        slots: int64 ``[1, tokens]``: where each new token's K/V go (negative: nowhere).
        fresh: ``(start, length)`` of the requests with nothing cached before this
            step (their attention runs on their own keys at full precision).
        launches: the paged-attention launches of the other requests.
        first_writes: ``k-transform``: ``(token rows, first blocks, positions)`` of
            the new tokens that are among their request's first tokens, or None.
        recent_writes: with a ring of ``R`` newest tokens per block: ``(token rows,
            blocks, ring slots)`` of the new tokens that stay in their block's ring (the
            newest ``R`` each block gets in this step), or None.
        solo: a decode-path step (:func:`decode_plan`): bool ``[tokens]``, the requests
            whose one query token is their whole prompt (they attend over it alone, at full
            precision, as ``generate`` does); None for a plan of :func:`build_plan`.
        padding: the last query tokens that belong to no request (transformers pads a step
            to a size it has a CUDA graph for); their attention output is zeros.
    """

    tokens: int
    slots: torch.Tensor
    fresh: list[tuple[int, int]]
    launches: list[_Launch]
    first_writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    recent_writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    solo: torch.Tensor | None = None
    padding: int = 0


def _cu_lens(kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Host int64 copies of the step's cumulative query and key lengths (one sync)."""
    cu_q = kwargs.get("cu_seq_lens_q")
    cu_k = kwargs.get("cu_seq_lens_k")
    if isinstance(cu_k, dict):
        cu_k = cu_k.get(FULL_ATTENTION)
    if not isinstance(cu_q, torch.Tensor) or not isinstance(cu_k, torch.Tensor):
        raise BatchingError(
            "kvquant's continuous-batching step got no cu_seq_lens_q / cu_seq_lens_k from "
            "transformers (a forward of the batching cache outside transformers' batching loop?). "
            "Fix: use the cache only through generate_batch / the ContinuousBatchingManager."
        )
    both = torch.cat([cu_q.reshape(-1).long(), cu_k.reshape(-1).long()]).cpu()
    n = cu_q.numel()
    return both[:n], both[n:]


@dataclass
class _Rows:
    """The step's requests with queries, in batch order, as host int64 vectors.

    Attributes:
        q0: each request's first query token in the packed batch.
        q_len: its query tokens.
        kv_len: its tokens after the step.
        past: its tokens cached before the step.
        pages: its pages after the step.
        offset: where its page ids start in the read index.
    """

    q0: torch.Tensor
    q_len: torch.Tensor
    kv_len: torch.Tensor
    past: torch.Tensor
    pages: torch.Tensor
    offset: torch.Tensor


def _rows(q: torch.Tensor, k: torch.Tensor, ps: int) -> _Rows:
    """The requests of the step that have query tokens (a request with none holds no pages in
    the read index)."""
    q_lens = q[1:] - q[:-1]
    keep = (q_lens > 0).nonzero().flatten()
    q_len = q_lens.index_select(0, keep)
    kv_len = (k[1:] - k[:-1]).index_select(0, keep)
    pages = -(-kv_len // ps)
    offset = torch.cumsum(pages, 0) - pages
    return _Rows(q[:-1].index_select(0, keep), q_len, kv_len, kv_len - q_len, pages, offset)


class _Transfer:
    """Host int64 vectors bound for the device, sent in one copy per dtype (:meth:`send`)."""

    def __init__(self) -> None:
        self._parts: dict[torch.dtype, list[torch.Tensor]] = {torch.long: [], torch.int32: []}

    def add(self, t: torch.Tensor, dtype: torch.dtype = torch.long) -> int:
        """Queue ``t``; its handle for :meth:`send`'s result."""
        self._parts[dtype].append(t.reshape(-1))
        return len(self._parts[dtype]) - 1

    def send(self, device: torch.device) -> dict[torch.dtype, list[torch.Tensor]]:
        """The queued vectors on ``device``, per dtype in the order added (views of one copy)."""
        out: dict[torch.dtype, list[torch.Tensor]] = {}
        for dtype, parts in self._parts.items():
            if not parts:
                out[dtype] = []
                continue
            flat = torch.cat(parts).to(dtype).to(device)
            out[dtype] = list(flat.split([p.numel() for p in parts]))
        return out


def build_plan(kwargs: dict[str, Any], layout: BlockLayout, trash_block: int = 0) -> StepPlan:
    """The :class:`StepPlan` of a forward from transformers' batching keywords: a decode-path
    step's (:func:`decode_plan`, ``trash_block`` its write-trash block) when transformers
    passes a ``block_table``.

    Reads ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (to the host, once), the first
    group's ``write_index`` (kvquant slots) and ``read_index`` (each request's page
    ids, in batch order). The plan's index vectors are computed on the host and reach the
    device in one copy per dtype. Padded inputs (CUDA graphs): the query tokens past the
    last request's write to the trash slot transformers gives them and attend over nothing,
    requests with no query token are skipped, and the read index's trash entries past the
    requests' pages are never read.

    Raises:
        BatchingError: the keywords do not describe a batch of this cache.
    """
    if kwargs.get("block_table") is not None:
        return decode_plan(kwargs, layout, trash_block)
    cu_q, cu_k = _cu_lens(kwargs)
    write_index = kwargs["write_index"][0]
    read_index = kwargs["read_index"][0]
    device = write_index.device
    ps, nf = layout.page_size, layout.first_tokens
    total = int(cu_q[-1])
    tokens = write_index.numel()
    if tokens < total:
        raise BatchingError(
            f"kvquant's continuous-batching step: {tokens} write slots for {total} query "
            "tokens. Fix: report this with the transformers version."
        )
    rows = _rows(cu_q, cu_k, ps)
    paged = (rows.past > 0).nonzero().flatten()
    held = int(rows.pages.sum())
    if paged.numel() and read_index.numel() < held:
        raise BatchingError(
            f"kvquant's continuous-batching step: {read_index.numel()} page ids read for "
            f"requests holding {held} pages. Fix: report this with the transformers version."
        )
    is_fresh = rows.past == 0
    fresh = list(zip(rows.q0[is_fresh].tolist(), rows.q_len[is_fresh].tolist(), strict=True))
    send = _Transfer()
    first = _first_tokens(rows, nf, read_index.numel() > 0, send)
    recent = _recent_writes(rows, ps, layout.recent_tokens, send)
    groups = [
        (g, _launch_parts(rows, g, nf, layout.recent_tokens, ps, send))
        for g in _launch_groups(rows, paged)
    ]
    sent = send.send(device)
    first_block = first_writes = None
    if first is not None:
        # k-transform: the first block of every request (its first tokens)
        at_first, writes = first
        at = sent[torch.long][at_first]
        if read_index.numel():
            first_block = read_index.index_select(0, at).long()
        else:  # only prompts: each one's first slot is written now
            first_block = write_index.index_select(0, at).long() // ps
        if writes is not None:
            tok, row, pos = (sent[torch.long][h] for h in writes)
            first_writes = (tok, first_block.index_select(0, row), pos)
    recent_writes = None
    if recent is not None:
        tok, slot = (sent[torch.long][h] for h in recent)
        blocks = write_index.reshape(-1).index_select(0, tok).long() // ps
        recent_writes = (tok, blocks, slot)
    launches = [_launch(parts, sent, read_index, first_block) for _g, parts in groups]
    return StepPlan(
        tokens=tokens,
        slots=write_index.reshape(1, -1),
        padding=tokens - total,
        fresh=fresh,
        launches=launches,
        first_writes=first_writes,
        recent_writes=recent_writes,
    )


def decode_plan(kwargs: dict[str, Any], layout: BlockLayout, trash_block: int) -> StepPlan:
    """The :class:`StepPlan` of a step on transformers' decode path (5.24 and later: every
    request has one query token), computed on the device with no host read and shapes that
    depend only on the number of requests.

    transformers passes ``block_table`` ``int32 [groups, requests, width]`` (each request's
    block ids, ``-1`` past its last) and ``cu_seq_lens_k`` (its tokens after the step); its
    write and read indices are not filled. Request ``b`` of length ``n`` writes slot
    ``table[b, (n - 1) // S] * S + (n - 1) % S``; its first tokens and its ring entries come
    from the same table; the writes a request does not make (first tokens it is past) go to
    ``trash_block`` (a block transformers never allocates). A request of length 1 is a
    one-token prompt: the launch computes it over its rounded key too, and
    :attr:`StepPlan.solo` marks it for the attention to replace by its exact value. A row of
    length 0 pads the step to a CUDA graph's size: it writes no slot (``-1``), its side
    writes go to ``trash_block``, and its attention over no key is zeros.

    Raises:
        BatchingError: the keywords do not describe a decode step of this cache.
    """
    table = kwargs["block_table"]
    cu_k = kwargs.get("cu_seq_lens_k")
    if isinstance(cu_k, dict):
        cu_k = cu_k.get(FULL_ATTENTION)
    n = int(table.shape[1])
    if not isinstance(cu_k, torch.Tensor) or cu_k.numel() != n + 1:
        raise BatchingError(
            f"kvquant's continuous-batching decode step: a block table of {n} requests with "
            f"{'no' if not isinstance(cu_k, torch.Tensor) else cu_k.numel() - 1} key lengths. "
            "Fix: report this with the transformers version."
        )
    ps, nf, ring = layout.page_size, layout.first_tokens, layout.recent_tokens
    device = table.device
    pages = table[0].long().clamp(min=0)  # [n, width]
    kv_len = (cu_k[1:] - cu_k[:-1]).long()
    live = kv_len > 0  # padding rows (CUDA graphs) have no token
    last = (kv_len - 1).clamp(min=0)
    rows = torch.arange(n, device=device)
    last_block = pages.gather(1, (last // ps)[:, None]).squeeze(1)
    first_block = first_writes = None
    first_lens = None
    if nf:
        first_block = pages[:, 0]
        first_lens = kv_len.clamp(max=nf).to(torch.int32)
        into = live & (last < nf)
        first_writes = (
            rows,
            torch.where(into, first_block, trash_block),
            torch.where(into, last, 0),
        )
    recent_writes = recent_blocks = None
    if ring:
        recent_writes = (rows, torch.where(live, last_block, trash_block), last % ring)
        oldest = kv_len[:, None] - ring
        pos = oldest + torch.remainder(torch.arange(ring, device=device)[None, :] - oldest, ring)
        recent_blocks = pages.gather(1, pos.clamp(min=0) // ps)
    launch = _Launch(
        gather=rows.view(n, 1),
        valid=None,
        tokens=rows,
        block_tables=pages.to(torch.int32),
        seq_lens=kv_len.to(torch.int32),
        q_lens=None,
        first_pages=first_block,
        first_lens=first_lens,
        recent_blocks=recent_blocks,
    )
    return StepPlan(
        tokens=n,
        slots=torch.where(live, last_block * ps + last % ps, -1).view(1, n),
        fresh=[],
        launches=[launch],
        first_writes=first_writes,
        recent_writes=recent_writes,
        solo=kv_len == 1,
    )


def _recent_writes(rows: _Rows, ps: int, ring: int, send: _Transfer) -> tuple[int, int] | None:
    """With a ring of ``ring`` tokens per block: handles of the ``(token row, ring slot)``
    vectors of the step's new tokens that stay in their block's ring (those with no newer
    token of the step at the same slot of the same block); None without a ring."""
    if not ring or not rows.q0.numel():
        return None
    row, within = _expand(rows.q_len)
    pos = rows.past.index_select(0, row) + within
    newest = torch.minimum(rows.kv_len.index_select(0, row) - 1, (pos // ps) * ps + ps - 1)
    kept = (pos > newest - ring).nonzero().flatten()
    tok = rows.q0.index_select(0, row).index_select(0, kept) + within.index_select(0, kept)
    return send.add(tok), send.add(pos.index_select(0, kept) % ring)


def _expand(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row, within)`` of ``counts.sum()`` items, ``counts[r]`` of them for row ``r``: each
    item's row and its index among its row's items."""
    row = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    return row, torch.arange(row.numel()) - (torch.cumsum(counts, 0) - counts).index_select(0, row)


def _first_tokens(
    rows: _Rows, nf: int, read: bool, send: _Transfer
) -> tuple[int, tuple[int, int, int] | None] | None:
    """``k-transform``: handles of each request's first-block index (its first page's place in
    the read index, or its first token's in the write index when nothing is read) and of the
    ``(token, request, position)`` vectors of the new tokens among the first ``nf``; None
    without first tokens."""
    if not nf or not rows.q0.numel():
        return None
    at_first = send.add(rows.offset if read else rows.q0)
    counts = (torch.clamp(rows.past + rows.q_len, max=nf) - rows.past).clamp(min=0)
    n = int(counts.sum())
    if n == 0:
        return at_first, None
    row, within = _expand(counts)
    tok = rows.q0.index_select(0, row) + within
    pos = rows.past.index_select(0, row) + within
    return at_first, (send.add(tok), send.add(row), send.add(pos))


def _launch_groups(rows: _Rows, paged: torch.Tensor) -> list[torch.Tensor]:
    """The paged rows in one launch, or two (one-token rows, longer rows) when padding the
    one-token rows to the longest query would more than double the launch's query slots."""
    if not paged.numel():
        return []
    q_len = rows.q_len.index_select(0, paged)
    longest, queries = int(q_len.max()), int(q_len.sum())
    if longest == 1 or paged.numel() * longest <= 2 * queries:
        return [paged]
    return [g for g in (paged[q_len == 1], paged[q_len > 1]) if g.numel()]


@dataclass
class _LaunchParts:
    """Handles of one launch's vectors in a :class:`_Transfer` and its shape."""

    rows: int
    lq: int
    width: int
    gather: int
    valid: int | None
    tokens: int
    table: int
    seq_lens: int
    q_lens: int | None
    first_at: int | None
    first_lens: int | None
    recent_at: int | None
    ring: int


def _launch_parts(
    rows: _Rows, idx: torch.Tensor, nf: int, ring: int, ps: int, send: _Transfer
) -> _LaunchParts:
    """A launch over requests ``idx``: query slots ``[Bp, Lq]`` (the last query repeated in a
    shorter row's padding), its pages ``[Bp, P]`` (the last page repeated), and with a ring of
    ``ring`` tokens per block, the page of each ring slot ``s``'s position (the newest
    ``p < kv_len`` with ``p % ring == s``; clamped to 0 where the request is shorter than the
    ring), queued on ``send``."""
    q0, q_len = rows.q0.index_select(0, idx), rows.q_len.index_select(0, idx)
    kv_len, pages = rows.kv_len.index_select(0, idx), rows.pages.index_select(0, idx)
    lq, width = int(q_len.max()), int(pages.max())
    j = torch.arange(lq)
    gather = q0[:, None] + torch.minimum(j[None, :], q_len[:, None] - 1)
    real = j[None, :] < q_len[:, None]
    every = bool(real.all())
    table = rows.offset.index_select(0, idx)[:, None] + torch.minimum(
        torch.arange(width)[None, :], pages[:, None] - 1
    )
    first = nf > 0
    recent_at = None
    if ring:
        oldest = kv_len[:, None] - ring
        pos = oldest + torch.remainder(torch.arange(ring)[None, :] - oldest, ring)
        page = rows.offset.index_select(0, idx)[:, None] + pos.clamp(min=0) // ps
        recent_at = send.add(page)
    return _LaunchParts(
        rows=int(idx.numel()),
        lq=lq,
        width=width,
        gather=send.add(gather),
        valid=None if every else send.add(real.reshape(-1).nonzero().flatten()),
        tokens=send.add(gather[real]),
        table=send.add(table),
        seq_lens=send.add(kv_len, torch.int32),
        q_lens=None if every else send.add(q_len, torch.int32),
        first_at=send.add(idx) if first else None,
        first_lens=send.add(torch.clamp(kv_len, max=nf), torch.int32) if first else None,
        recent_at=recent_at,
        ring=ring,
    )


def _launch(
    parts: _LaunchParts,
    sent: dict[torch.dtype, list[torch.Tensor]],
    read_index: torch.Tensor,
    first_block: torch.Tensor | None,
) -> _Launch:
    i64, i32 = sent[torch.long], sent[torch.int32]
    block_tables = read_index.index_select(0, i64[parts.table])
    first_pages = first_lens = None
    if first_block is not None and parts.first_at is not None and parts.first_lens is not None:
        first_pages = first_block.index_select(0, i64[parts.first_at])
        first_lens = i32[parts.first_lens]
    recent_blocks = None
    if parts.recent_at is not None:
        at = i64[parts.recent_at]
        recent_blocks = read_index.index_select(0, at).long().view(parts.rows, parts.ring)
    return _Launch(
        gather=i64[parts.gather].view(parts.rows, parts.lq),
        valid=None if parts.valid is None else i64[parts.valid],
        tokens=i64[parts.tokens],
        block_tables=block_tables.view(parts.rows, parts.width).to(torch.int32),
        seq_lens=i32[parts.seq_lens],
        q_lens=None if parts.q_lens is None else i32[parts.q_lens],
        first_pages=first_pages,
        first_lens=first_lens,
        recent_blocks=recent_blocks,
    )
