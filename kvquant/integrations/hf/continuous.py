"""Continuous batching on kvquant's FP8 pages: ``generate_batch``, paged ``generate``, the manager.

transformers serves many requests of different lengths together through its
continuous batching (``model.generate_batch``, ``generate(cache_implementation=
"paged")``, ``model.init_continuous_batching()`` and the ``ContinuousBatchingManager``
behind them, ``transformers serve``). Its paged cache is one buffer in the model's
dtype, cut into blocks of ``page_size`` tokens; a background thread schedules the
requests, prepares each step's inputs (packed query tokens, per-request lengths,
the cache slots to write and the pages to read) and runs the model.

Under a :func:`kvquant.patch` that cache holds kvquant's FP8 pages instead:

* **Storage.** :class:`BlockLayout` lays one block out as, for each layer, its
  FP8 K and V pages (and the fp32 group scales of the ``fp32-group`` format, the
  full-precision first tokens of the ``k-transform`` format), in the layouts the
  kernels read fastest. The cache's buffer is an array of such blocks; each
  layer's :class:`~kvquant.cache.PagedLayerStorage` is a set of strided views into
  it (``pages=``), so the kernels read the batching cache's blocks directly, and
  transformers' own block copies (forks, prefix sharing, CPU offloading on 5.24)
  move every part of a block at once.
* **Sizing.** The buffer holds the blocks the memory budget buys in FP8
  (:func:`plan_blocks`): a ``num_blocks`` of the config is read as the bytes of that
  many blocks in the model's dtype (so a bf16 budget holds about twice as many
  FP8 blocks, group scales counted), and without it the free memory is split the
  way transformers splits it, with kvquant's attention costs (no attention mask,
  no K/V read back from the cache).
* **Attention.** Each step, the rows of the batch are split by what they hold: a
  request with nothing cached yet (a prompt) attends over its own keys and values
  at full precision through the model's previous attention implementation, as
  the patched model's ``generate`` does on a prompt; every other request (decode
  steps, the later chunks of a split prompt, prompts that reuse a shared prefix)
  attends over the FP8 pages with :func:`kvquant.kernels.paged_attention`, all of
  them in one launch where their query lengths allow it. The block tables come
  from the step's own read indices (one page id per page), the slots from its
  write indices: no key or value is gathered or copied.
* **Errors.** A failure in the batching thread is only logged by transformers
  (the request comes back failed, often empty). The wrappers below raise it in
  the caller's thread: the thread's own :class:`~kvquant.errors.KVQuantError`
  as it is, anything else as :class:`~kvquant.errors.BatchingError` naming the fix.

What is wrapped, and why (each undone by ``handle.remove()``):

* ``model.init_continuous_batching`` and ``model.generate_batch`` (instance
  attributes): every entry point goes through the first; it checks what kvquant
  cannot serve before any thread starts, presents the model to transformers'
  manager under an attention name the manager accepts while the manager is built
  (5.24 accepts only ``sdpa``, ``paged|eager`` and flash names; 5.17 would switch
  a model to flash attention when it is installed), and wraps the manager's
  ``get_result``; the second raises the failures ``generate_batch`` only logs.
* The name ``PagedAttentionCache`` in ``transformers.generation.continuous_batching.
  continuous_api``, while a patched model uses continuous batching: transformers
  builds its cache there by that name and offers no other seam to choose the
  cache class. The replacement builds kvquant's cache for the configs of patched
  models only and transformers' own cache for every other model; it is put back
  when the last patched model that used it is unpatched.
* A decoder forward pre-hook and forward hook: the step plan (host-side row
  lengths, block tables, slots) is built once per forward, not once per layer.

Supported: transformers 5.17 (``block_size``, ``paged|<name>`` attention names)
and 5.24 (``page_size``, cache allocators); decoders whose layers all use full
attention with one KV-head count and head dim, on one device.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import nn

from kvquant import kernels
from kvquant.cache import PagedLayerStorage, release_library_workspaces
from kvquant.errors import (
    BatchingError,
    CacheCapacityError,
    KVQuantError,
    OptionError,
    UnsupportedModelError,
)

__all__ = [
    "BATCH_KWARG",
    "BatchingStorage",
    "BlockLayout",
    "StepPlan",
    "install",
    "is_batching_cache",
    "live_caches",
    "plan_blocks",
    "release",
]

_logger = logging.getLogger("kvquant")

STATE_ATTR = "_kvquant_state"
"""Attribute of a patched model holding its :class:`~kvquant.integrations.hf.patch.PatchState`."""

BATCH_KWARG = "_kvq_batch_step"
"""Keyword the batching cache's ``update`` (5.24) adds to the attention call: the layer's step."""

PAGED_NAME = "paged|kvquant"
"""kvquant's attention name while transformers 5.17 runs continuous batching."""

_ALIGN = 128
"""Bytes each part of a block starts on (fp32 and bf16 views need aligned offsets)."""

_DEFAULT_BATCH_TOKENS = 8192
"""Tokens per step when the config sets no ``max_batch_tokens`` (transformers 5.24's default)."""

_FULL = "full_attention"


class _Missing:
    """The mark of a model attribute that was absent before :func:`install` (one object, also
    through ``copy.deepcopy`` and pickling)."""

    def __reduce__(self) -> str:
        return "_MISSING"

    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()

_live: weakref.WeakSet[Any] = weakref.WeakSet()


def live_caches() -> list[Any]:
    """kvquant's batching caches that still hold their device buffer (tests check none leak)."""
    return [c for c in _live if c.kvq.buffer is not None]


def release(cache_obj: Any) -> None:
    """Free a batching cache's device memory: its buffer and every view of it.

    Called when the manager that built the cache stops for good; whatever still
    refers to the cache object afterwards (an exception's traceback, a log record)
    keeps a few small Python objects, not the buffer.
    """
    for name in ("cache_tensor", "kvq_buffer"):
        if hasattr(cache_obj, name):
            setattr(cache_obj, name, None)
    for allocator in getattr(cache_obj, "cache_allocators", {}).values():
        allocator.cache_tensor = None
        allocator._copy_view = None
    if hasattr(cache_obj, "key_cache"):
        cache_obj.key_cache, cache_obj.value_cache = [], []
    cache_obj.kvq.release()


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# ---------------------------------------------------------------------- layout


@dataclass(frozen=True)
class BlockLayout:
    """Where each layer's pages live inside one block of the batching cache.

    A block holds ``page_size`` tokens of every layer. For each layer it holds, in
    order, each part starting on a multiple of 128 bytes: the FP8 K page
    ``[page_size, Hkv, D]`` (head dim fastest), the FP8 V page (keys fastest,
    ``[Hkv, D, page_size]`` in memory), for ``fp32-group`` the fp32 K and V group
    scales (head-major ``[Hkv, page_size, D // G]``), and for ``k-transform`` the
    first tokens' keys and values ``[first_tokens, Hkv, D]`` in the model's dtype
    (meaningful in a request's first block only). These are the layouts of
    :func:`kvquant.kernels.page_storage` and :func:`kvquant.kernels.group_scale_storage`,
    with the block size as the page stride.

    Attributes:
        num_layers: layers in a block.
        page_size: tokens per block.
        num_kv_heads: ``Hkv`` (every layer).
        head_dim: ``D`` (every layer).
        n_groups: ``D // G`` for ``fp32-group``, else 0.
        first_tokens: ``k-transform``'s first tokens kept at full precision, else 0.
        side_dtype: the dtype of those first tokens (the model's).
    """

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    n_groups: int = 0
    first_tokens: int = 0
    side_dtype: torch.dtype = torch.bfloat16

    @property
    def offsets(self) -> dict[str, int]:
        """Byte offset of each part inside one layer's share of a block, and its ``end``."""
        codes = self.page_size * self.num_kv_heads * self.head_dim
        scales = 4 * self.page_size * self.num_kv_heads * self.n_groups
        side = self.first_tokens * self.num_kv_heads * self.head_dim * self.side_dtype.itemsize
        out: dict[str, int] = {}
        pos = 0
        for name, size in (
            ("k_pages", codes),
            ("v_pages", codes),
            ("k_group_scales", scales),
            ("v_group_scales", scales),
            ("first_k", side),
            ("first_v", side),
        ):
            if size:
                out[name] = pos
                pos = _align(pos + size)
        out["end"] = pos
        return out

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one layer's share of a block (all its parts)."""
        return self.offsets["end"]

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block (every layer)."""
        return self.num_layers * self.bytes_per_page

    def dense_block_bytes(self, dtype: torch.dtype) -> int:
        """Bytes transformers' own cache spends on a block of the same tokens in ``dtype``."""
        return (
            2
            * self.num_layers
            * self.page_size
            * self.num_kv_heads
            * self.head_dim
            * dtype.itemsize
        )

    def views(self, buffer: torch.Tensor, layer: int, num_blocks: int) -> dict[str, torch.Tensor]:
        """The parts of ``layer`` in every block of ``buffer`` (a flat uint8 tensor), as strided views.

        Returns:
            ``k_pages`` / ``v_pages`` FP8 ``[num_blocks, page_size, Hkv, D]``, and where
            the layout has them ``k_group_scales`` / ``v_group_scales`` fp32
            ``[num_blocks, page_size, Hkv, D // G]`` and ``first_k`` / ``first_v``
            ``[num_blocks, first_tokens, Hkv, D]`` in ``side_dtype``.
        """
        ps, hkv, d, ng, nf = (
            self.page_size,
            self.num_kv_heads,
            self.head_dim,
            self.n_groups,
            self.first_tokens,
        )
        block = self.bytes_per_block
        base = layer * self.bytes_per_page
        off = self.offsets
        codes = buffer.view(torch.float8_e4m3fn)
        out = {
            "k_pages": codes.as_strided(
                (num_blocks, ps, hkv, d), (block, hkv * d, d, 1), base + off["k_pages"]
            ),
            "v_pages": codes.as_strided(
                (num_blocks, ps, hkv, d), (block, 1, d * ps, ps), base + off["v_pages"]
            ),
        }
        if ng:
            f32 = buffer.view(torch.float32)
            for name in ("k_group_scales", "v_group_scales"):
                out[name] = f32.as_strided(
                    (num_blocks, ps, hkv, ng),
                    (block // 4, ng, ps * ng, 1),
                    (base + off[name]) // 4,
                )
        if nf:
            side = buffer.view(self.side_dtype)
            isz = self.side_dtype.itemsize
            for name in ("first_k", "first_v"):
                out[name] = side.as_strided(
                    (num_blocks, nf, hkv, d),
                    (block // isz, hkv * d, d, 1),
                    (base + off[name]) // isz,
                )
        return out


def layout_for(specs: list[Any], page_size: int, dtype: torch.dtype) -> BlockLayout:
    """The :class:`BlockLayout` of a patched model's layer specs (checked to be uniform).

    Raises:
        UnsupportedModelError: layers of different KV heads, head dims or granularities,
            or layers that share K/V.
    """
    first = specs[0]
    keys = {
        (s.num_kv_heads, s.head_dim, s.granularity, s.group_size, s.first_tokens) for s in specs
    }
    if len(keys) != 1 or any(s.kv_reused for s in specs):
        raise UnsupportedModelError(
            f"{first.name}: kvquant's continuous-batching cache needs every layer to have the same "
            "KV heads, head dim and scale format, and no layer attending over another's K/V; "
            f"this model's layers differ ({len(keys)} kinds). Fix: run generate() per request "
            "(the FP8 cache serves it), or handle.remove() for transformers' own batching."
        )
    group = first.granularity == "fp32-group"
    g = (first.group_size or first.head_dim) if group else None
    return BlockLayout(
        num_layers=len(specs),
        page_size=page_size,
        num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim,
        n_groups=first.head_dim // g if g else 0,
        first_tokens=first.first_tokens,
        side_dtype=dtype
        if dtype in (torch.float32, torch.float16, torch.bfloat16)
        else torch.float32,
    )


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
        cu_k = cu_k.get(_FULL)
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


# ---------------------------------------------------------------------- storage


class BatchingStorage:
    """The FP8 pages of one batching cache: one flat buffer, one :class:`PagedLayerStorage` view per layer.

    Args:
        buffer: flat uint8 tensor of ``num_blocks`` blocks of ``layout``.
        layout: the block layout.
        specs: the patch's per-layer :class:`~kvquant.integrations.hf.cache_layer.LayerSpec`.
        num_blocks: blocks in ``buffer`` (transformers' unused trash blocks included).
        backend: kernel backend of the patch.

    Attributes:
        layers: one :class:`PagedLayerStorage` per layer, its pages views of ``buffer``.
        first: ``k-transform``: per layer, the ``(first_k, first_v)`` views
            ``[num_blocks, first_tokens, Hkv, D]``; else empty.
        plan: the :class:`StepPlan` of the forward in progress (None between forwards).
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        layout: BlockLayout,
        specs: list[Any],
        num_blocks: int,
        backend: str,
    ) -> None:
        self.buffer: torch.Tensor | None = buffer
        self.layout = layout
        self.layers: list[PagedLayerStorage] = []
        self.first: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.plan: StepPlan | None = None
        device = buffer.device
        for i, spec in enumerate(specs):
            views = layout.views(buffer, i, num_blocks)
            pages = {k: v for k, v in views.items() if not k.startswith("first")}
            group = spec.granularity == "fp32-group"
            rotation = None
            if spec.rotation == "hadamard":
                rotation = kernels.hadamard(spec.head_dim)
            self.layers.append(
                PagedLayerStorage(
                    num_blocks,
                    layout.page_size,
                    spec.num_kv_heads,
                    spec.head_dim,
                    granularity=spec.granularity,
                    group_size=(spec.group_size or spec.head_dim) if group else None,
                    k_scale=None if group else spec.k_scale,
                    v_scale=None if group else spec.v_scale,
                    device=device,
                    backend=backend,
                    name=spec.name,
                    k_offset=spec.k_offset,
                    k_rotation=rotation,
                    first_tokens=spec.first_tokens,
                    pages=pages,
                )
            )
            if layout.first_tokens:
                self.first.append((views["first_k"], views["first_v"]))

    def begin(self, kwargs: dict[str, Any]) -> None:
        """Build the plan of the forward that starts (the decoder's pre-hook calls this)."""
        self.plan = build_plan(kwargs, self.layout)

    def end(self) -> None:
        """Drop the plan of the forward that ended."""
        self.plan = None

    def release(self) -> None:
        """Drop the buffer and every view of it (:func:`release`)."""
        self.buffer = None
        self.layers = []
        self.first = []
        self.plan = None

    def write(
        self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> LayerStep:
        """Store the step's new K/V ``[1, Hkv, T, D]`` of ``layer_idx`` in FP8; the layer's step.

        Raises:
            BatchingError: no plan for this forward, or one for another number of tokens.
        """
        plan = self.plan
        if self.buffer is None:
            raise BatchingError(
                "kvquant's continuous-batching cache was released when its manager stopped. "
                "Fix: start a new manager (model.init_continuous_batching()) for new requests."
            )
        if plan is None or key_states.shape[2] != plan.tokens or key_states.shape[0] != 1:
            raise BatchingError(
                f"kvquant's continuous-batching cache got K/V of shape {tuple(key_states.shape)} "
                f"with no step plan for it (planned: "
                f"{'none' if plan is None else plan.tokens} tokens); the decoder's pre-hook that "
                "kvquant.patch installs did not run for this forward. Fix: run the model through "
                "transformers' batching loop (generate_batch / the manager), not layer by layer."
            )
        storage = self.layers[layer_idx]
        k, v = key_states.transpose(1, 2), value_states.transpose(1, 2)
        storage.write(k, v, plan.slots)
        if plan.first_writes is not None and self.first:
            tok, blocks, pos = plan.first_writes
            side_k, side_v = self.first[layer_idx]
            kf = k[0].index_select(0, tok)
            if storage.k_rotation is not None:
                kf = kf.float() @ storage.k_rotation
            side_k[blocks, pos] = kf.to(side_k.dtype)
            side_v[blocks, pos] = v[0].index_select(0, tok).to(side_v.dtype)
        return LayerStep(self, layer_idx, plan)


class LayerStep:
    """One layer's attention over a step of the batch (what the attention function runs)."""

    __slots__ = ("layer_idx", "plan", "storage")

    def __init__(self, storage: BatchingStorage, layer_idx: int, plan: StepPlan) -> None:
        self.storage = storage
        self.layer_idx = layer_idx
        self.plan = plan

    def attend(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        scaling: float | None,
        dropout: float,
        sliding_window: int | None,
        softcap: float | None,
        s_aux: torch.Tensor | None,
    ) -> tuple[torch.Tensor, None]:
        """``(attn_output [1, T, Hq, D], None)`` for ``query [1, Hq, T, D]`` and the new ``key`` / ``value``.

        Raises:
            UnsupportedModelError: attention dropout in training mode.
        """
        from kvquant.integrations.hf.attention import fallback_attention, fallback_kwargs

        if dropout and module.training:
            raise UnsupportedModelError(
                f"layer {self.layer_idx}: attention dropout {dropout} in training mode under "
                "continuous batching; kvquant's FP8 cache is for inference. Fix: model.eval()."
            )
        plan = self.plan
        q4 = query.transpose(1, 2)  # [1, T, Hq, D]
        out = torch.empty(q4.shape, dtype=query.dtype, device=query.device)
        extra = fallback_kwargs(0.0, scaling, sliding_window, softcap, s_aux)
        for start, length in plan.fresh:
            sl = slice(start, start + length)
            dense, _ = fallback_attention(
                module, query[:, :, sl], key[:, :, sl], value[:, :, sl], None, **extra
            )
            out[:, sl] = dense
        if not plan.launches:
            return out, None
        storage = self.storage.layers[self.layer_idx]
        sm_scale = float(scaling if scaling is not None else getattr(module, "scaling", 0.0))
        if sm_scale <= 0:
            sm_scale = 1.0 / math.sqrt(query.shape[-1])
        sinks = None if s_aux is None else s_aux.detach().to(torch.float32).contiguous()
        hq, d = q4.shape[2], q4.shape[3]
        rows = q4[0]
        for launch in plan.launches:
            bsz, lq = launch.gather.shape
            q = rows.index_select(0, launch.gather.reshape(-1)).view(bsz, lq, hq, d)
            options: dict[str, Any] = {}
            if launch.q_lens is not None:
                options["q_lens"] = launch.q_lens
            if launch.first_pages is not None and self.storage.first:
                side_k, side_v = self.storage.first[self.layer_idx]
                options.update(
                    first_k=side_k.index_select(0, launch.first_pages),
                    first_v=side_v.index_select(0, launch.first_pages),
                    first_lens=launch.first_lens,
                )
            res = storage.attend(
                q,
                launch.block_tables,
                launch.seq_lens,
                sm_scale=sm_scale,
                causal=True,
                softcap=float(softcap or 0.0),
                window=int(sliding_window or 0),
                sinks=sinks,
                **options,
            ).reshape(bsz * lq, hq, d)
            if launch.valid is not None:
                res = res.index_select(0, launch.valid)
            out[0].index_copy_(0, launch.tokens, res)
        return out, None


# ---------------------------------------------------------------------- sizing


def _memory_breakdown() -> tuple[int, int, int]:
    """``(total, reserved, allocated)`` bytes of the device, as transformers measures them."""
    try:
        from transformers.generation.continuous_batching.utils import (
            get_device_and_memory_breakdown,
        )
    except ImportError:  # transformers 5.17 keeps it in requests.py
        from transformers.generation.continuous_batching.requests import (  # type: ignore[no-redef]
            get_device_and_memory_breakdown,
        )
    _, total, reserved, allocated = get_device_and_memory_breakdown()
    return int(total), int(reserved), int(allocated)


def plan_blocks(
    cb_config: Any,
    config: Any,
    layout: BlockLayout,
    dtype: torch.dtype,
    logits_to_keep: bool = False,
    page_ids_per_block: int = 1,
) -> tuple[int, int]:
    """``(max_batch_tokens, blocks)`` of a kvquant batching cache: what the budget buys in FP8.

    With ``cb_config.num_blocks`` the budget is that many blocks in the model's
    ``dtype`` (transformers' bytes for them), and the cache gets the FP8 blocks
    those bytes hold. Without it, the budget is the device's free memory times
    ``max_memory_percent`` (as transformers measures it), less what a step of
    ``max_batch_tokens`` tokens needs (the larger of the LM head's and the
    attention's activations, and the step's index tensors) and transformers' two
    trash blocks; each block costs its bytes plus one page id of the read index.

    Raises:
        CacheCapacityError: the budget holds no block.
    """
    tokens = cb_config.max_batch_tokens or _DEFAULT_BATCH_TOKENS
    per_block = layout.bytes_per_block
    if cb_config.num_blocks is not None:
        budget = int(cb_config.num_blocks) * layout.dense_block_bytes(dtype)
        blocks = budget // per_block
        source = f"num_blocks={cb_config.num_blocks} blocks in {dtype} ({budget} bytes)"
    else:
        total, reserved, allocated = _memory_breakdown()
        percent = cb_config.max_memory_percent or 0.9
        available = int((total - max(allocated, reserved)) * percent)
        a = dtype.itemsize
        hidden, vocab = int(config.hidden_size), int(config.vocab_size)
        hq = int(config.num_attention_heads)
        hkv, d = layout.num_kv_heads, layout.head_dim
        lm_head = 0 if logits_to_keep else hidden * a + vocab * 4
        # hidden states, query, new K/V, the paged rows' gathered queries and outputs
        attention = a * (hidden + hq * d + 2 * hkv * d + 2 * hq * d)
        io = 7 * 4 + 2 * 4 + 8 + 8  # packed inputs, outputs, write and read index
        fixed = 2 * per_block
        if logits_to_keep:
            fixed += (cb_config.max_requests_per_batch or 1024) * (hidden * a + vocab * 4)
        blocks = (available - fixed - tokens * (max(lm_head, attention) + io)) // (
            per_block + 8 * page_ids_per_block
        )
        source = f"{available} bytes free ({percent:.0%} of the device's free memory)"
    if blocks < 1:
        raise CacheCapacityError(
            f"kvquant's continuous-batching cache: {source} hold no FP8 block of "
            f"{layout.page_size} tokens ({per_block} bytes for {layout.num_layers} layers). "
            "Fix: a larger num_blocks or max_memory_percent, a smaller max_batch_tokens or "
            "page size in the ContinuousBatchingConfig, or free device memory."
        )
    return int(tokens), int(blocks)


def _allocate(nbytes: int, device: Any) -> torch.Tensor:
    try:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    except RuntimeError as err:  # torch.OutOfMemoryError, or a CPU allocation failure
        raise CacheCapacityError(
            f"kvquant's continuous-batching cache: allocating {nbytes} bytes on {device} failed "
            f"({type(err).__name__}). Fix: a smaller num_blocks or max_memory_percent in the "
            "ContinuousBatchingConfig."
        ) from err


# ---------------------------------------------------------------------- transformers adapters


def flavour() -> str | None:
    """Which continuous-batching code this transformers has: ``"allocators"`` (5.24),
    ``"groups"`` (5.17), or None (another layout kvquant does not know)."""
    try:
        from transformers.generation.continuous_batching import cache as cbc
    except ImportError:
        return None
    params = list(inspect.signature(cbc.PagedAttentionCache.__init__).parameters)
    known = ["self", "config", "continuous_batching_config", "device", "distributed_helper"]
    if params == [*known, "dtype", "model_supports_logits_to_keep"] and hasattr(
        cbc, "ATTN_TYPE_TO_ALLOCATOR"
    ):
        return "allocators"
    if params == [*known, "tp_plan", "dtype"] and hasattr(cbc, "BlockManager"):
        return "groups"
    return None


_registry: dict[int, tuple[weakref.ref[Any], weakref.ref[Any]]] = {}
_registry_lock = threading.Lock()


def _register(config: Any, state: Any) -> None:
    with _registry_lock:
        _registry[id(config)] = (weakref.ref(config), weakref.ref(state))


def _unregister(config: Any) -> None:
    with _registry_lock:
        entry = _registry.get(id(config))
        if entry is not None and entry[0]() is config:
            del _registry[id(config)]
        for key, (cfg, st) in list(_registry.items()):
            if cfg() is None or st() is None:
                del _registry[key]
        if not _registry:
            _uninstall_factory()


def _state_for(config: Any) -> Any:
    with _registry_lock:
        entry = _registry.get(id(config))
    if entry is None or entry[0]() is not config:
        return None
    state = entry[1]()
    handle = getattr(state, "handle", None)
    return state if handle is not None and handle.active else None


class _CacheFactory:
    """Stands for ``PagedAttentionCache`` in transformers' ``continuous_api`` module (module docstring):
    kvquant's cache for the config of a patched model, transformers' own for any other."""

    def __init__(self, original: type) -> None:
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("config", args[0] if args else None)
        state = _state_for(config)
        if state is None:
            return self.original(*args, **kwargs)
        return _cache_class()(*args, **kwargs)


def _install_factory() -> None:
    from transformers.generation.continuous_batching import continuous_api

    current = continuous_api.PagedAttentionCache
    if not isinstance(current, _CacheFactory):
        continuous_api.PagedAttentionCache = _CacheFactory(current)  # type: ignore[misc, assignment]


def _uninstall_factory() -> None:
    try:
        from transformers.generation.continuous_batching import continuous_api
    except ImportError:  # pragma: no cover - installed only where it imports
        return
    current = continuous_api.PagedAttentionCache
    if isinstance(current, _CacheFactory):
        continuous_api.PagedAttentionCache = current.original  # type: ignore[misc, assignment]


def _specs_and_backend(config: Any) -> tuple[list[Any], str]:
    state = _state_for(config)
    if state is None:  # pragma: no cover - the factory checked
        raise BatchingError("kvquant's batching cache was built for a model that is not patched.")
    return list(state.layer_specs), str(state.options.backend)


def _refuse_tp(helper: Any) -> None:
    if getattr(helper, "tp_size", 1) > 1:
        raise UnsupportedModelError(
            "kvquant's continuous-batching cache runs on one device; this model is sharded "
            f"over {helper.tp_size} ranks (tensor parallelism). Fix: load the model on one "
            "device, or handle.remove() for transformers' own batching."
        )


@cache
def _cache_class() -> type:
    """kvquant's subclass of this transformers' ``PagedAttentionCache``."""
    kind = flavour()
    if kind == "allocators":
        return _allocator_cache_class()
    if kind == "groups":
        return _group_cache_class()
    raise UnsupportedModelError(_VERSION_MESSAGE)  # pragma: no cover - checked before


_VERSION_MESSAGE = (
    "kvquant's continuous batching knows the batching caches of transformers 5.17 and 5.24; "
    "this transformers lays its cache out otherwise. Fix: install transformers 5.17 or 5.24, "
    "or run generate() per request (kvquant's FP8 cache serves it)."
)


def _refuse_sliding(groups: Any) -> None:
    kinds = sorted(set(groups))
    if kinds != [_FULL]:
        raise UnsupportedModelError(
            f"kvquant's continuous-batching cache serves full-attention layers only; this "
            f"model's layers are {kinds} (sliding-window layers keep a ring of blocks kvquant "
            "does not manage). Fix: run generate() per request (kvquant's FP8 cache serves "
            "sliding windows there), or handle.remove() for transformers' own batching."
        )


def _allocator_cache_class() -> type:
    """transformers 5.24: a cache allocator over kvquant's blocks, and the cache that holds it."""
    from transformers.generation.continuous_batching import cache as cbc
    from transformers.generation.continuous_batching.cache_allocators import (
        CachePool,
        FullAttentionCacheAllocator,
    )

    class FP8BlockAllocator(FullAttentionCacheAllocator):  # type: ignore[misc, valid-type]
        """Full-attention allocator whose indices are kvquant slots and page ids.

        Write indices are slots (``block * page_size + offset``); read indices are
        one page id per page of the request (the block table), not one index per
        token: kvquant's kernels read the pages, nothing is gathered.
        """

        def __init__(
            self, index: int, layer_indices: list[int], layout: BlockLayout, sharing: bool
        ) -> None:
            self.head_dim = layout.head_dim
            self.num_key_value_heads = layout.num_kv_heads
            self.cache_dtype = torch.uint8
            self._before_cache_tensor_init(
                index=index,
                layer_indices=layer_indices,
                tokens_per_page=layout.page_size,
                bytes_per_page=layout.bytes_per_block // len(layer_indices),
                allow_block_sharing=sharing,
            )

        def register_cache_tensor(
            self, bytes_per_sector: int, non_trash_bytes: int, cache_tensor: Any, pool: Any
        ) -> None:
            self.bytes_per_sector = bytes_per_sector
            self._copy_view = cache_tensor.view(-1, self.bytes_per_block)
            self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, cache_tensor, pool)
            self.read_trash_index = 0
            # the write-trash sector's first slot (transformers never allocates it)
            self.write_trash_index = self.blocks_per_sector * self.tokens_per_page

        def _table(self, request_id: str) -> list[int]:
            table = self.block_table.get(request_id)
            if table is None:
                raise ValueError(f"No block table found for request {request_id}")
            return table

        def get_read_indices(self, request_id: str, past_length: int, query_length: int) -> Any:
            pages = -(-(past_length + query_length) // self.tokens_per_page)
            return self._table(request_id)[:pages]

        def get_write_indices(self, request_id: str, past_length: int, query_length: int) -> Any:
            table, ps = self._table(request_id), self.tokens_per_page
            return [
                table[p // ps] * ps + p % ps for p in range(past_length, past_length + query_length)
            ]

        def fill_block_table(
            self, request_id: str, past_length: int, query_length: int, block_table: Any
        ) -> None:
            ids = self._table(request_id)
            block_table[: len(ids)].copy_(torch.tensor(ids, dtype=block_table.dtype))

        def update(self, *args: Any, **kwargs: Any) -> Any:
            raise BatchingError(_READ_ONLY_MESSAGE)

        def get_cache_for_block_table(self, layer_idx: int) -> Any:
            raise BatchingError(_READ_ONLY_MESSAGE)

    class KVQuantBatchingCache(cbc.PagedAttentionCache):  # type: ignore[misc, valid-type]
        """transformers 5.24's batching cache over kvquant's FP8 blocks (module docstring)."""

        def __init__(
            self,
            config: Any,
            continuous_batching_config: Any,
            device: Any,
            distributed_helper: Any,
            dtype: torch.dtype = torch.float16,
            model_supports_logits_to_keep: bool = False,
        ) -> None:
            cb = continuous_batching_config
            specs, backend = _specs_and_backend(config)
            _refuse_tp(distributed_helper)
            groups = cbc.group_layers_by_attn_type(config)
            _refuse_sliding(groups)
            layers = groups[_FULL]
            self.config, self.dtype, self.device = config, dtype, device
            self.max_blocks_per_request = 0
            layout = layout_for(specs, int(cb.page_size), dtype)
            allocator = FP8BlockAllocator(0, layers, layout, bool(cb.allow_block_sharing))
            self.cache_allocators = {_FULL: allocator}
            self.layer_to_allocator = dict.fromkeys(layers, allocator)
            self.bytes_per_sector = math.lcm(allocator.bytes_per_block, _ALIGN)
            blocks_per_sector = self.bytes_per_sector // allocator.bytes_per_block
            self.tokens_per_sector = blocks_per_sector * layout.page_size
            tokens, blocks = plan_blocks(cb, config, layout, dtype, model_supports_logits_to_keep)
            self.max_batch_tokens = tokens
            self.num_sectors = max(1, blocks // blocks_per_sector)
            non_trash = self.num_sectors * self.bytes_per_sector
            self.cache_tensor = _allocate(non_trash + 2 * self.bytes_per_sector, device)
            self.pool = CachePool(self.num_sectors, 1)
            allocator.register_cache_tensor(
                self.bytes_per_sector, non_trash, self.cache_tensor, self.pool
            )
            self.allow_block_sharing = bool(cb.allow_block_sharing)
            self.use_prefix_sharing = allocator.use_block_sharing and self.allow_block_sharing
            self.num_blocks = non_trash // allocator.bytes_per_block
            self.read_cache_limit = None
            self.max_decode_fast_path_length = 0
            self.max_tokens_read = allocator.tokens_per_page * allocator.num_blocks
            total_blocks = (self.num_sectors + 2) * blocks_per_sector
            self.kvq = BatchingStorage(self.cache_tensor, layout, specs, total_blocks, backend)
            _live.add(self)
            _logger.info(
                "kvquant: continuous-batching cache of %d FP8 blocks of %d tokens (%d bytes), "
                "%d tokens per step",
                self.num_blocks,
                layout.page_size,
                non_trash,
                tokens,
            )

        @torch.compiler.disable
        def update(
            self,
            key_states: torch.Tensor,
            value_states: torch.Tensor,
            layer_idx: int,
            kwargs: dict[str, Any],
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """Store the layer's new K/V in FP8; hand kvquant's attention the layer's step."""
            kwargs[BATCH_KWARG] = self.kvq.write(layer_idx, key_states, value_states)
            return key_states, value_states

    return KVQuantBatchingCache


_READ_ONLY_MESSAGE = (
    "kvquant's continuous-batching cache holds FP8 pages that only kvquant's attention reads; "
    "another attention implementation was switched on while it runs. Fix: leave the attention "
    "implementation as kvquant.patch set it while the manager runs."
)


def _group_cache_class() -> type:
    """transformers 5.17: the batching cache (one layer group of full attention) over kvquant's blocks."""
    from transformers.generation.continuous_batching import cache as cbc
    from transformers.generation.continuous_batching.cache_manager import (
        FullAttentionCacheAllocator,
    )

    class FP8GroupAllocator(FullAttentionCacheAllocator):  # type: ignore[misc, valid-type]
        """Its write indices are already kvquant slots; its read indices become page ids."""

        def get_read_indices(self, request_id: str, past_length: int, query_length: int) -> Any:
            table = self.block_table.get(request_id)
            if table is None:
                raise ValueError(f"No block table found for request {request_id}")
            return table[: -(-(past_length + query_length) // self.block_size)]

    class KVQuantBatchingCache(cbc.PagedAttentionCache):  # type: ignore[misc, valid-type]
        """transformers 5.17's batching cache over kvquant's FP8 blocks (module docstring)."""

        def __init__(
            self,
            config: Any,
            continuous_batching_config: Any,
            device: Any,
            distributed_helper: Any,
            tp_plan: Any,
            dtype: torch.dtype = torch.float16,
        ) -> None:
            cb = continuous_batching_config
            specs, backend = _specs_and_backend(config)
            _refuse_tp(distributed_helper)
            layer_groups, group_types = cbc.group_layers_by_attn_type(config)
            _refuse_sliding(group_types)
            self.config, self.dtype, self.device = config, dtype, device
            layout = layout_for(specs, int(cb.block_size), dtype)
            self.num_key_value_heads, self.head_dim = layout.num_kv_heads, layout.head_dim
            self.block_size = layout.page_size
            least = int(getattr(cbc.PagedAttentionCache, "_min_block_size", 4))
            if self.block_size < least:
                raise OptionError(
                    f"ContinuousBatchingConfig(block_size={self.block_size}); transformers needs "
                    f"at least {least}. Fix: block_size=16 or more."
                )
            self.num_groups = 1
            self.sliding_windows = dict.fromkeys(layer_groups[0], 1)
            self.layer_index_to_group_indices = {
                layer: (0, j) for j, layer in enumerate(layer_groups[0])
            }
            tokens, blocks = plan_blocks(cb, config, layout, dtype)
            self.max_batch_tokens, self.num_blocks = tokens, blocks
            self.num_pages = blocks * self.block_size
            total = blocks + 2  # transformers' read and write trash blocks come last
            self.kvq_buffer = _allocate(total * layout.bytes_per_block, device)
            self.cache_shape = (total * self.block_size, layout.num_kv_heads, layout.head_dim)
            self.read_trash_index = blocks * self.block_size
            self.sentinel_index = self.read_trash_index + 1
            self.write_trash_index = (blocks + 1) * self.block_size
            self.kvq = BatchingStorage(self.kvq_buffer, layout, specs, total, backend)
            # transformers counts layers through these (its CPU offloading, refused here, reads them)
            self.key_cache = [s.k_pages for s in self.kvq.layers]
            self.value_cache = [s.v_pages for s in self.kvq.layers]
            self.allow_block_sharing = bool(cb.allow_block_sharing)
            self.group_cache_managers = [
                FP8GroupAllocator(0, self.block_size, allow_block_sharing=self.allow_block_sharing)
            ]
            self.num_full_attention_groups = 1
            self.num_sliding_attention_groups = 0
            self.max_sliding_window_blocks_per_request = 0
            cb.max_blocks_per_request = 0
            self.max_blocks_per_request = 0
            self.use_prefix_sharing = self.allow_block_sharing
            self._block_manager = cbc.BlockManager(  # type: ignore[attr-defined]  # 5.17
                blocks, self.block_size, tp_on=False
            )
            self._total_prefix_length = 0
            self._block_table_key = None  # type: ignore[assignment]
            _live.add(self)
            _logger.info(
                "kvquant: continuous-batching cache of %d FP8 blocks of %d tokens (%d bytes), "
                "%d tokens per step",
                blocks,
                self.block_size,
                total * layout.bytes_per_block,
                tokens,
            )

        def copy_cache(self, list_source_blocks: list[int], list_forked_blocks: list[int]) -> None:
            """Copy whole blocks (every layer's pages and scales) for forked requests."""
            rows = self.kvq_buffer.view(-1, self.kvq.layout.bytes_per_block)
            src = torch.tensor(list_source_blocks, dtype=torch.long, device=rows.device)
            dst = torch.tensor(list_forked_blocks, dtype=torch.long, device=rows.device)
            rows.index_copy_(0, dst, rows.index_select(0, src))

        def update(self, *args: Any, **kwargs: Any) -> Any:
            raise BatchingError(_READ_ONLY_MESSAGE)

    return KVQuantBatchingCache


def is_batching_cache(obj: Any) -> bool:
    """Whether ``obj`` is one of kvquant's continuous-batching caches."""
    return isinstance(getattr(obj, "kvq", None), BatchingStorage)


# ---------------------------------------------------------------------- attention (5.17)


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """kvquant's attention under transformers 5.17's continuous batching (``"paged|kvquant"``).

    transformers 5.17 hands the batching cache to a ``paged|`` attention function,
    which stores the new K/V itself: this one stores them in FP8 and attends.

    Raises:
        UnsupportedModelError: called without kvquant's batching cache.
    """
    cache_obj = kwargs.pop("cache", None)
    if not is_batching_cache(cache_obj):
        raise UnsupportedModelError(
            f"{PAGED_NAME!r} is kvquant's attention for transformers' continuous batching over "
            f"its FP8 cache; it got {type(cache_obj).__name__}. Fix: leave the attention "
            "implementation to kvquant.patch (it switches it for the batching run only)."
        )
    step = cache_obj.kvq.write(int(getattr(module, "layer_idx", -1)), key, value)
    return step.attend(
        module,
        query,
        key,
        value,
        scaling=scaling,
        dropout=dropout,
        sliding_window=sliding_window,
        softcap=softcap,
        s_aux=s_aux,
    )


paged_attention_forward = torch.compiler.disable(paged_attention_forward)


# ---------------------------------------------------------------------- model wrappers


class _Bound:
    """A callable of this integration that holds its model and patch state as attributes
    (``copy.deepcopy`` of the model copies it with the model)."""

    def __init__(self, model: nn.Module, state: Any, previous: Any = _MISSING) -> None:
        self.model = model
        self.state = state
        self.previous = previous

    def active(self) -> bool:
        return getattr(self.model, STATE_ATTR, None) is self.state

    def original(self, name: str) -> Callable[..., Any]:
        if self.previous is not _MISSING:
            fn: Callable[..., Any] = self.previous
            return fn
        return getattr(type(self.model), name).__get__(self.model)


_runs = threading.local()
"""The :class:`_Run` of the ``generate_batch`` call in progress in this thread, if any."""


@dataclass
class _Run:
    """What one ``generate_batch`` call saw: its managers, and the requests whose failure
    ``manager.get_result`` raised inside transformers' loop (which logs it and goes on)."""

    managers: list[Any]
    failures: dict[str, str]


def _cb_config_of(call: inspect.BoundArguments) -> Any:
    cfg = call.arguments.get("continuous_batching_config")
    if cfg is None:
        gen = call.arguments.get("generation_config")
        cfg = getattr(gen, "continuous_batching_config", None)
    if cfg is None:
        from transformers import ContinuousBatchingConfig

        cfg = ContinuousBatchingConfig()
    return cfg


def check_batching(model: nn.Module, state: Any, cb_config: Any) -> str:
    """Refuse, before any thread starts, what kvquant's batching cannot serve; the flavour.

    Raises:
        UnsupportedModelError: an unknown transformers layout, layers kvquant's cache
            cannot hold, or a model sharded over several devices.
        OptionError: a ContinuousBatchingConfig option kvquant cannot honour.
    """
    kind = flavour()
    if kind is None:
        raise UnsupportedModelError(_VERSION_MESSAGE)
    specs = list(state.layer_specs)
    page = getattr(cb_config, "page_size" if kind == "allocators" else "block_size", None)
    layout_for(specs, int(page or 16), torch.float32)
    from transformers.generation.continuous_batching import cache as cbc

    groups: Any = cbc.group_layers_by_attn_type(state.text_config)
    _refuse_sliding(groups if kind == "allocators" else groups[1])
    if getattr(model, "_device_mesh", None) is not None:
        raise UnsupportedModelError(
            f"{state.model_name}: kvquant's continuous batching runs on one device; the model is "
            "sharded (tensor parallelism). Fix: load it on one device."
        )
    name = state.model_name
    graphs = cb_config.use_cuda_graph
    if graphs is True or (isinstance(graphs, tuple) and any(graphs)):
        raise OptionError(
            f"{name}: ContinuousBatchingConfig(use_cuda_graph={graphs!r}); kvquant's batching "
            "step plans each step on the host and is not captured in CUDA graphs. Fix: "
            "use_cuda_graph=False (or leave it None)."
        )
    for field_name in ("varlen_compile_config", "decode_compile_config"):
        if getattr(cb_config, field_name, None) is not None:
            raise OptionError(
                f"{name}: ContinuousBatchingConfig({field_name}=...); kvquant's batching step "
                f"runs eagerly. Fix: {field_name}=None."
            )
    if kind == "groups" and cb_config.cpu_offload_space != 0:
        raise OptionError(
            f"{name}: ContinuousBatchingConfig(cpu_offload_space={cb_config.cpu_offload_space}); "
            "on transformers 5.17 the CPU swap pool copies caches in the model's dtype, not "
            "kvquant's FP8 blocks. Fix: cpu_offload_space=0 (requests that do not fit are "
            "recomputed), or transformers 5.24."
        )
    nf = max(s.first_tokens for s in specs)
    if page is not None and nf > int(page):
        raise OptionError(
            f"{name}: the k-transform keeps {nf} first tokens per request at full precision, "
            f"in the request's first block of {page} tokens. Fix: a page size of at least {nf}."
        )
    return kind


@contextmanager
def _presented(model: nn.Module, kind: str) -> Iterator[str]:
    """The attention name transformers' manager is built under (module docstring).

    5.24 accepts ``paged|eager`` without switching to flash attention, and with it
    plans no CUDA graph (kvquant's runtime name ``kvquant`` is restored after).
    5.17 runs ``paged|<name>`` functions, handed the batching cache: kvquant's
    ``paged|kvquant`` is set here and restored by the manager when it stops.
    """
    config: Any = model.config
    setter: Any = model.set_attn_implementation
    if kind == "groups":
        from transformers import AttentionInterface

        AttentionInterface.register(PAGED_NAME, paged_attention_forward)
        before = str(config._attn_implementation)
        setter(PAGED_NAME)
        try:
            yield before
        except BaseException:
            setter(before)
            raise
        return
    before = config._attn_implementation_internal
    config._attn_implementation_internal = "paged|eager"
    try:
        yield str(before)
    finally:
        config._attn_implementation_internal = before


class _InitBatching(_Bound):
    """``model.init_continuous_batching``: every continuous-batching entry point comes here."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        original = self.original("init_continuous_batching")
        if not self.active():
            return original(*args, **kwargs)
        cls: Any = type(self.model)
        sig = inspect.signature(cls.init_continuous_batching)
        call = sig.bind(self.model, *args, **kwargs)
        cb_config = _cb_config_of(call)
        kind = check_batching(self.model, self.state, cb_config)
        _register(self.state.text_config, self.state)
        _install_factory()
        with _presented(self.model, kind) as before:
            manager = original(*args, **kwargs)
        if kind == "groups" and manager._original_attn_impl is None:
            manager._original_attn_impl = before  # the manager switches it back when it stops
        resolved = manager.continuous_batching_config
        resolved.use_cuda_graph = (False, False)
        resolved.use_async_batching = False
        resolved.varlen_compile_config = None
        resolved.decode_compile_config = None
        resolved.max_blocks_per_request = 0
        if not isinstance(manager.__dict__.get("get_result"), _GetResult):
            manager.get_result = _GetResult(manager)
            manager.stop = _Stop(manager)
        hooks = _hooks_of(self.state)
        if hooks is not None:
            hooks.managers.add(manager)
        run = getattr(_runs, "current", None)
        if run is not None:
            run.managers.append(manager)
        return manager


class _GetResult:
    """``manager.get_result``: a failed request raises instead of coming back as a result."""

    def __init__(self, manager: Any) -> None:
        self.manager = weakref.ref(manager)

    def __call__(self, request_id: str | None = None, timeout: float | None = None) -> Any:
        manager = self.manager()
        if manager is None:  # pragma: no cover - called through the manager
            raise BatchingError("the continuous-batching manager is gone.")
        result = type(manager).get_result(manager, request_id=request_id, timeout=timeout)
        fatal = manager.background_thread_status.fatal_error
        if result is not None and result.error is not None:
            run = getattr(_runs, "current", None)
            if run is not None:
                run.failures[result.request_id] = result.error
            raise _failure({result.request_id: result.error}, fatal, result)
        if result is None and fatal is not None:
            raise _failure({}, fatal, None)
        return result


class _Stop:
    """``manager.stop``: a manager that stops for good frees its cache's device memory
    (:func:`release`), whatever still refers to the cache object, and the cuBLAS workspace
    its batching thread's handle allocated (held for the life of the process otherwise)."""

    def __init__(self, manager: Any) -> None:
        self.manager = weakref.ref(manager)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        manager = self.manager()
        if manager is None:  # pragma: no cover - called through the manager
            return None
        cache_obj = getattr(manager.batch_processor, "cache", None)
        result = type(manager).stop(manager, *args, **kwargs)
        if (
            is_batching_cache(cache_obj)
            and manager.batch_processor is None
            and not manager.is_running()
        ):
            release(cache_obj)
            release_library_workspaces()
        return result


def _fix_for(error: BaseException | None, texts: list[str]) -> str:
    text = " ".join([str(error or ""), *texts])
    if "can be scheduled" in text or "offloaded" in text or isinstance(error, MemoryError):
        return (
            "give the cache more room (a larger num_blocks or max_memory_percent in the "
            "ContinuousBatchingConfig), or send shorter requests (prompt + max_new_tokens)"
        )
    if isinstance(error, torch.OutOfMemoryError):
        return (
            "a smaller max_memory_percent, num_blocks or max_batch_tokens in the "
            "ContinuousBatchingConfig"
        )
    return "see the error chained below; generate() per request runs the same FP8 cache"


def _release_frames(error: BaseException | None) -> None:
    """Drop the local variables of the frames an error from the batching thread carries.

    The traceback stays (transformers also logged it); its frames' locals held the
    batching cache and its device buffer, which a kept exception (a notebook's
    ``sys.last_value``, a log handler's record) would otherwise keep alive.
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _failure(failed: dict[str, str], fatal: BaseException | None, output: Any) -> KVQuantError:
    """The error the caller gets: the thread's own KVQuantError, else a BatchingError."""
    _release_frames(fatal)
    if isinstance(fatal, KVQuantError):
        return fatal
    first = next(iter(failed.items()), None)
    what = f"request {first[0]!r} failed: {first[1]}" if first else "the batching thread died"
    more = f" ({len(failed)} requests failed)" if len(failed) > 1 else ""
    cause = f" ({type(fatal).__name__}: {fatal})" if fatal is not None and not first else ""
    err = BatchingError(
        f"continuous batching on kvquant's FP8 cache: {what}{cause}{more}. Fix: "
        f"{_fix_for(fatal, list(failed.values()))}."
    )
    err.output = output  # type: ignore[attr-defined]
    if fatal is not None:
        err.__cause__ = fatal
    return err


class _GenerateBatch(_Bound):
    """``model.generate_batch``: raises what transformers' ``generate_batch`` only logs."""

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        original = self.original("generate_batch")
        if not self.active():
            return original(inputs, *args, **kwargs)
        outer = getattr(_runs, "current", None)
        run = _Run(managers=[], failures={})
        _runs.current = run
        try:
            results = original(inputs, *args, **kwargs)
        finally:
            _runs.current = outer
            _drop_stale_caches(self.state)
        fatal = next(
            (
                m.background_thread_status.fatal_error
                for m in run.managers
                if m.background_thread_status.fatal_error
            ),
            None,
        )
        failed = {**run.failures}
        failed.update({rid: r.error for rid, r in results.items() if r.error is not None})
        if fatal is not None or failed:
            raise _failure(failed, fatal, None)
        # one result per prompt at least (transformers 5.24 adds the num_return_sequences
        # copies, 5.17 returns the prompts' own requests only)
        own = sum(1 for rid in results if "__child#" not in rid)
        if own < len(inputs):
            raise BatchingError(
                f"continuous batching on kvquant's FP8 cache: {len(inputs) - own} of "
                f"{len(inputs)} requests came back without a result (the batching thread "
                f"stopped). Fix: {_fix_for(None, [])}."
            )
        return results


def _drop_stale_caches(state: Any) -> None:
    """Forget a batching cache a failed forward left on the attention modules (memory)."""
    for site in state.sites:
        held = site.module.__dict__.get("_kvq_cache")
        if held is not None and is_batching_cache(held):
            site.module.__dict__["_kvq_cache"] = None


class _BeginStep(_Bound):
    """Decoder forward pre-hook: plans a continuous-batching step once for every layer."""

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        obj: Any = kwargs.get("cache")
        if self.active() and is_batching_cache(obj):
            obj.kvq.begin(kwargs)


class _EndStep(_Bound):
    """Decoder forward hook (always called): drops the step's plan."""

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        obj: Any = kwargs.get("cache")
        if is_batching_cache(obj):
            obj.kvq.end()


class BatchingHooks:
    """What :func:`install` put on a model; ``remove()`` takes it all off (``handle.remove()`` calls it).

    Attributes:
        managers: the continuous-batching managers built on the model under this patch.
    """

    def __init__(self, model: nn.Module, state: Any) -> None:
        self.model = model
        self.state = state
        self.managers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.saved: dict[str, Any] = {}
        decoder = getattr(model, "base_model", model)
        self.handles = [
            decoder.register_forward_pre_hook(_BeginStep(model, state), with_kwargs=True),
            decoder.register_forward_hook(
                _EndStep(model, state), with_kwargs=True, always_call=True
            ),
        ]
        for name, cls in (
            ("init_continuous_batching", _InitBatching),
            ("generate_batch", _GenerateBatch),
        ):
            if not callable(getattr(type(model), name, None)):
                continue
            previous = model.__dict__.get(name, _MISSING)
            self.saved[name] = previous
            model.__dict__[name] = cls(model, state, previous)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its managers (a loaded model has none running)."""
        state = dict(self.__dict__)
        state["managers"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.managers = weakref.WeakSet()

    def __deepcopy__(self, memo: dict[int, Any]) -> BatchingHooks:
        """A copied model's hooks: the same attributes copied, no managers."""
        copied = BatchingHooks.__new__(BatchingHooks)
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            if name != "managers":
                copied.__dict__[name] = copy.deepcopy(value, memo)
        copied.managers = weakref.WeakSet()
        return copied

    def remove(self) -> None:
        """Stop the managers still running, drop a kept one, restore the model (idempotent)."""
        model = self.model
        for manager in list(self.managers):
            if manager.is_running():
                _logger.warning(
                    "kvquant: handle.remove() stops a continuous-batching manager still running "
                    "on kvquant's FP8 cache (its unfinished requests fail)."
                )
                manager.stop(block=True, timeout=10, hard_stop=True)
        kept = model.__dict__.get("_cached_continuous_batching_manager")
        if kept is not None and kept in self.managers:
            model.destroy_cached_continuous_batching_manager()  # type: ignore[operator]
        self.managers = weakref.WeakSet()
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for name, previous in self.saved.items():
            current = model.__dict__.get(name)
            if isinstance(current, _Bound) and current.state is self.state:
                if previous is _MISSING:
                    del model.__dict__[name]
                else:
                    model.__dict__[name] = previous
        self.saved = {}
        _drop_stale_caches(self.state)
        _unregister(self.state.text_config)


def _hooks_of(state: Any) -> BatchingHooks | None:
    return next((h for h in state.handles if isinstance(h, BatchingHooks)), None)


def install(model: nn.Module, state: Any) -> BatchingHooks:
    """Make the patched ``model``'s continuous batching run on kvquant's FP8 pages.

    Called by :func:`kvquant.patch` after its own hooks; what it installs is listed
    in the module docstring. Nothing process-wide changes until the model's first
    ``init_continuous_batching``.

    Returns:
        The hooks; their ``remove()`` undoes everything (the patch's handle calls it).
    """
    return BatchingHooks(model, state)
