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
]

# ---------------------------------------------------------------------- step plan


_Row = tuple[int, int, int, int, int, int]
"""A request of the step: (batch row, first query token, query length, tokens cached
before the step, tokens after it, offset of its page ids in the read index)."""


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


@dataclass
class StepPlan:
    """What one forward of a continuous batch needs, built once for every layer.

    Attributes:
        tokens: query tokens of the step (the packed batch).
        slots: int64 ``[1, tokens]``: where each new token's K/V go.
        fresh: ``(start, length)`` of the requests with nothing cached before this
            step (their attention runs on their own keys at full precision).
        launches: the paged-attention launches of the other requests.
        first_writes: ``k-transform``: ``(token rows, first blocks, positions)`` of
            the new tokens that are among their request's first tokens, or None.
    """

    tokens: int
    slots: torch.Tensor
    fresh: list[tuple[int, int]]
    launches: list[_Launch]
    first_writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


def _cu_lens(kwargs: dict[str, Any]) -> tuple[list[int], list[int]]:
    """Host copies of the step's cumulative query and key lengths (one sync)."""
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
    both = torch.cat([cu_q.reshape(-1).long(), cu_k.reshape(-1).long()]).tolist()
    n = cu_q.numel()
    return both[:n], both[n:]


def build_plan(kwargs: dict[str, Any], layout: BlockLayout) -> StepPlan:
    """The :class:`StepPlan` of a forward from transformers' batching keywords.

    Reads ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (to the host, once), the first
    group's ``write_index`` (kvquant slots) and ``read_index`` (each request's page
    ids, in batch order).

    Raises:
        BatchingError: the keywords do not describe a batch of this cache.
    """
    cu_q, cu_k = _cu_lens(kwargs)
    write_index = kwargs["write_index"][0]
    read_index = kwargs["read_index"][0]
    device = write_index.device
    ps, nf = layout.page_size, layout.first_tokens
    total = cu_q[-1]
    if write_index.numel() != total:
        raise BatchingError(
            f"kvquant's continuous-batching step: {write_index.numel()} write slots for "
            f"{total} query tokens. Fix: run the batching cache without CUDA graphs or input "
            "padding (use_cuda_graph=False)."
        )
    rows: list[_Row] = []
    offset = 0
    for b in range(len(cu_q) - 1):
        q_len, kv_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if q_len <= 0:
            continue
        rows.append((b, cu_q[b], q_len, kv_len - q_len, kv_len, offset))
        offset += -(-kv_len // ps)
    paged = [r for r in rows if r[3] > 0]
    if paged and read_index.numel() != offset:
        raise BatchingError(
            f"kvquant's continuous-batching step: {read_index.numel()} page ids read for "
            f"requests holding {offset} pages. Fix: report this with the transformers version."
        )
    fresh = [(r[1], r[2]) for r in rows if r[3] == 0]
    first_block = None  # k-transform: the first block of every request (its first tokens)
    first_writes = None
    if nf and rows:
        if read_index.numel():
            idx = torch.tensor([r[5] for r in rows], dtype=torch.long).to(device)
            first_block = read_index.index_select(0, idx).long()
        else:  # only prompts: each one's first slot is written now
            idx = torch.tensor([r[1] for r in rows], dtype=torch.long).to(device)
            first_block = write_index.index_select(0, idx).long() // ps
        tok, row, pos = [], [], []
        for i, r in enumerate(rows):
            for p in range(r[3], min(r[3] + r[2], nf)):
                tok.append(r[1] + p - r[3])
                row.append(i)
                pos.append(p)
        if tok:
            host = torch.tensor([tok, row, pos], dtype=torch.long).to(device)
            first_writes = (host[0], first_block.index_select(0, host[1]), host[2])
    position = {r[0]: i for i, r in enumerate(rows)}
    launches = [
        _launch(group, read_index, ps, nf, first_block, position, device)
        for group in _launch_groups(paged)
    ]
    return StepPlan(
        tokens=total,
        slots=write_index.reshape(1, -1),
        fresh=fresh,
        launches=launches,
        first_writes=first_writes,
    )


def _launch_groups(paged: list[_Row]) -> list[list[_Row]]:
    """The paged rows in one launch, or two (one-token rows, longer rows) when padding the
    one-token rows to the longest query would more than double the launch's query slots."""
    if not paged:
        return []
    longest = max(r[2] for r in paged)
    queries = sum(r[2] for r in paged)
    if longest == 1 or len(paged) * longest <= 2 * queries:
        return [paged]
    return [g for g in ([r for r in paged if r[2] == 1], [r for r in paged if r[2] > 1]) if g]


def _launch(
    rows: list[_Row],
    read_index: torch.Tensor,
    ps: int,
    nf: int,
    first_block: torch.Tensor | None,
    position: dict[int, int],
    device: torch.device,
) -> _Launch:
    lq = max(r[2] for r in rows)
    width = max(-(-r[4] // ps) for r in rows)
    gather: list[list[int]] = []
    table: list[list[int]] = []
    valid: list[int] = []
    tokens: list[int] = []
    for i, (_b, q0, q_len, _past, kv_len, off) in enumerate(rows):
        gather.append([q0 + min(j, q_len - 1) for j in range(lq)])
        valid.extend(i * lq + j for j in range(q_len))
        tokens.extend(range(q0, q0 + q_len))
        n_pages = -(-kv_len // ps)
        table.append([off + min(j, n_pages - 1) for j in range(width)])
    long = torch.long
    block_tables = read_index.index_select(
        0, torch.tensor(table, dtype=long).reshape(-1).to(device)
    )
    first_pages = first_lens = None
    if nf and first_block is not None:
        at = torch.tensor([position[r[0]] for r in rows], dtype=long).to(device)
        first_pages = first_block.index_select(0, at)
        first_lens = torch.tensor([min(nf, r[4]) for r in rows], dtype=torch.int32).to(device)
    every = all(r[2] == lq for r in rows)
    return _Launch(
        gather=torch.tensor(gather, dtype=long).to(device),
        valid=None if every else torch.tensor(valid, dtype=long).to(device),
        tokens=torch.tensor(tokens, dtype=long).to(device),
        block_tables=block_tables.view(len(rows), width).to(torch.int32),
        seq_lens=torch.tensor([r[4] for r in rows], dtype=torch.int32).to(device),
        q_lens=None if every else torch.tensor([r[2] for r in rows], dtype=torch.int32).to(device),
        first_pages=first_pages,
        first_lens=first_lens,
    )
