"""FP8 paged KV-cache kernels: public entry points.

:func:`write_kv` quantizes new K/V tokens into FP8 pages; :func:`paged_attention` attends new
queries over those pages. Both validate every argument before anything runs (a plan,
:mod:`kvquant.kernels.plan`, holds the structural result and the launch), then dispatch to
a backend (:mod:`kvquant.kernels.backend`): ``"triton"``, ``"torch"`` (the pure-PyTorch
references :func:`write_kv_reference` and :func:`paged_attention_reference`) or ``"auto"``
(Triton on CUDA, the reference on CPU). Both take the pages as a :class:`~kvquant.schemes.Pages`
and the scale scheme as a :mod:`kvquant.schemes` value (checked when it was built); attention
takes a :class:`~kvquant.schemes.Mask`. Each op is a folder, ``kvquant.kernels.attention`` and
``kvquant.kernels.write`` (kernel, launch, naive reference, validate); this package imports
only torch (Triton at the first Triton dispatch), never transformers. Layout: pages
``[num_pages, page_size, Hkv, D]`` FP8, slot ``= page * page_size + offset``, int32 block
tables ``[B, max_pages]`` and sequence lengths ``[B]``; the design: docs/dev/kernels.md.
"""

from __future__ import annotations

import torch

# re-exported for callers of kvquant.kernels.<name> (not in __all__)
from kvquant.kernels.attention.naive import paged_attention_reference as paged_attention_reference
from kvquant.kernels.attention.validate import check_attention_inputs as check_attention_inputs
from kvquant.kernels.fp8 import hadamard
from kvquant.kernels.plan import AttentionPlan, PlanCache, WritePlan, plan_attention, plan_write
from kvquant.kernels.validate import check_slot_mapping_inputs
from kvquant.kernels.write.naive import write_kv_reference as write_kv_reference
from kvquant.kernels.write.naive import write_recent_reference as write_recent_reference
from kvquant.kernels.write.validate import check_write_inputs as check_write_inputs
from kvquant.kernels.write_fp4 import write_fp4 as write_fp4
from kvquant.schemes import CAUSAL, FirstTokens, Mask, Pages, RecentTokens, Scheme

__all__ = [
    "AttentionPlan",
    "PlanCache",
    "WritePlan",
    "compute_slot_mapping",
    "group_scale_storage",
    "hadamard",
    "page_storage",
    "paged_attention",
    "plan_attention",
    "plan_write",
    "slot_mapping",
    "write_kv",
]


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    pages: Pages,
    slot_mapping: torch.Tensor,
    scheme: Scheme,
    *,
    backend: str = "auto",
    recent: RecentTokens | None = None,
    recent_start: torch.Tensor | None = None,
) -> None:
    """Quantize new K/V tokens to FP8 and store them into their page slots (in place).

    Each value is divided by its scale, clamped to the FP8 format's finite
    range (±448 for e4m3fn, ±57344 for e5m2) and rounded to nearest even.
    Non-finite inputs are stored as NaN, so a bad activation shows up in the
    attention output instead of being clipped. With a :class:`~kvquant.schemes.GroupScales`
    scheme, the scale of each (token, KV head, group of ``G`` elements) is ``amax / fp8_max``,
    1.0 for an all-zero group, NaN for a group holding a non-finite value, and is stored
    beside the token's slot (``pages.k_scales`` / ``pages.v_scales``). With a
    :class:`~kvquant.schemes.KTransformScales` scheme K is rotated and offset first:
    ``fp8((key @ k_rotation - k_offset) / k_scale)``, clamped and NaN-marked as above; V is
    unchanged. With a 4-bit scheme (:class:`~kvquant.schemes.Fp4Scales`: NVFP4, MXFP4, FP8 K
    with NVFP4 V) a 4-bit side stores e2m1 codes and one block scale per block of head_dim,
    computed from the token (:func:`kvquant.kernels.write_fp4.write_fp4`); K in the
    k-transform's frame is rotated and offset first there too. With ``recent`` (a ring of
    each sequence's newest tokens, as :func:`paged_attention` reads it) the tokens are also
    copied there at full precision: token ``l`` of sequence ``b`` to slot
    ``(recent_start + l) % R`` of ``recent.kv[b]``, its key rotated by the scheme's K
    rotation (no offset), its value as given, whatever its slot (:func:`write_recent_reference`);
    the FP8 Triton kernel does it in the same launch.

    Every argument is validated before anything is written: a call that
    raises leaves the pages and group scales as they were.

    Args:
        key: ``[B, L, Hkv, D]`` float32, float16 or bfloat16, any strides.
        value: ``[B, L, Hkv, D]`` float32, float16 or bfloat16 (may differ
            from ``key``), any strides.
        pages: ``k`` and ``v``: ``[num_pages, page_size, Hkv, D]`` ``float8_e4m3fn`` or
            ``float8_e5m2`` (one dtype), any strides with no two elements sharing memory
            (e.g. from :func:`page_storage`), written in place; for a dynamic scheme
            ``k_scales`` and ``v_scales``: fp32 ``[num_pages, page_size, Hkv, D // G]``, last
            dimension contiguous (e.g. from :func:`group_scale_storage`), written in place.
        slot_mapping: int64 ``[B, L]``: slot ``page * page_size + offset`` of
            each new token, negative to skip the token. Slots must be
            distinct (duplicates store one of the tokens, unspecified which).
        scheme: the pages' scale scheme (:mod:`kvquant.schemes`), its tensors on the pages'
            device.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        recent: a :class:`~kvquant.schemes.RecentTokens` ring ``[B, 2, R, Hkv, D]`` with
            ``R >= L``, written in place, or None.
        recent_start: with ``recent``: int64 ``[1]`` on the pages' device, the position of
            every sequence's first new token (a device tensor: a CUDA graph replays it).

    Raises:
        KernelInputError: a malformed argument (dtype, shape, device, strides,
            a slot beyond the cache where values are checked: see
            :mod:`kvquant.kernels.validate`).
        BackendError: the requested backend cannot run here.

    Example:
        >>> import torch
        >>> from kvquant.kernels import write_kv
        >>> from kvquant.schemes import Pages, PerTensorScales
        >>> pages = Pages(*page_storage(4, 16, 2, 64))
        >>> key = torch.randn(1, 3, 2, 64)
        >>> slots = torch.tensor([[16, 17, 18]])  # page 1, offsets 0..2
        >>> scheme = PerTensorScales(torch.tensor(0.01), torch.tensor(0.01))
        >>> write_kv(key, key, pages, slots, scheme, backend="torch")
        >>> bool((pages.k[1, :3].float() != 0).any())
        True
    """
    plan = plan_write(
        key, value, pages, slot_mapping, scheme, backend=backend, recent=recent,
        recent_start=recent_start,
    )  # fmt: skip
    plan.execute(key, value, pages, slot_mapping, scheme, recent, recent_start)


def page_storage(
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed K and V pages ``[num_pages, page_size, Hkv, D]`` in the layouts the kernels read fastest.

    Both have the logical shape every kernel and the reference take. K pages are
    contiguous (head dim fastest). V pages are stored keys-fastest,
    ``[num_pages, Hkv, D, page_size]`` in memory: ``P @ V`` contracts over keys, and an
    FP8 tile with keys contiguous reaches the tensor cores through ``ldmatrix``, where
    the token-major tile was gathered byte by byte (docs/performance.md).

    Args:
        num_pages: pages in the cache.
        page_size: slots per page.
        num_kv_heads: ``Hkv``.
        head_dim: ``D``.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        device: where to allocate.

    Returns:
        ``(k_pages, v_pages)``; ``v_pages`` has strides
        ``(Hkv * D * page_size, 1, D * page_size, page_size)``.
    """
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_pages = torch.zeros(shape, dtype=dtype, device=device)
    # not a view (a view made under no_grad could not be written in place with grad enabled)
    v_strides = (num_kv_heads * head_dim * page_size, 1, head_dim * page_size, page_size)
    v_pages = torch.empty_strided(shape, v_strides, dtype=dtype, device=device).zero_()
    return k_pages, v_pages


def group_scale_storage(
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    n_groups: int,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """fp32 group scales ``[num_pages, page_size, Hkv, n_groups]``, all 1.0, stored head-major.

    The logical shape is the one every kernel takes; the memory order is
    ``[num_pages, Hkv, page_size, n_groups]``, so that the scales of one
    (page, KV head) are one contiguous run. The decode kernel reads them per
    KV head; on the H200 this layout made fp32-group decode at ``G = 64``
    about 7 % faster than the slot-major order (``benchmarks/probe_scale_layout.py``).

    Args:
        num_pages: pages in the cache.
        page_size: slots per page.
        num_kv_heads: ``Hkv``.
        n_groups: ``D // G``.
        device: where to allocate.

    Returns:
        A ``[num_pages, page_size, Hkv, n_groups]`` float32 tensor with strides
        ``(Hkv * page_size * n_groups, n_groups, page_size * n_groups, 1)``.
    """
    shape = (num_pages, page_size, num_kv_heads, n_groups)
    strides = (num_kv_heads * page_size * n_groups, n_groups, page_size * n_groups, 1)
    # not a view (a view made under no_grad could not be written in place with grad enabled)
    return torch.empty_strided(shape, strides, dtype=torch.float32, device=device).fill_(1.0)


def paged_attention(
    query: torch.Tensor,
    pages: Pages,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scheme: Scheme,
    *,
    sm_scale: float,
    mask: Mask = CAUSAL,
    first: FirstTokens | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    recent: RecentTokens | None = None,
) -> torch.Tensor:
    """Attention of new query tokens over the paged FP8 KV cache.

    The ``Lq`` query tokens of sequence ``b`` are its newest ``mask.q_lens[b]``
    tokens, whose K/V are already written (:func:`write_kv`): query ``i`` sits
    at position ``seq_lens[b] - q_lens[b] + i``. Key ``j`` is visible when
    ``kv_start[b] <= j < seq_lens[b]``, ``j <= position`` (if ``causal``) and
    ``j > position - window`` (if ``window > 0``). Rows of padding queries,
    and rows that see no key, are zeros; a slot no query of the call sees
    never reaches the output, whatever it holds. Semantics:
    :func:`kvquant.kernels.paged_attention_reference`.

    Args:
        query: ``[B, Lq, Hq, D]`` float16, bfloat16 or float32, any strides
            (HF's ``[B, Hq, Lq, D]`` tensor ``.transpose(1, 2)`` is fine);
            ``Hq`` a multiple of ``Hkv``.
        pages: FP8 ``k`` / ``v`` ``[num_pages, page_size, Hkv, D]``, any strides (fastest
            from :func:`page_storage`), and for a dynamic scheme fp32 ``k_scales`` /
            ``v_scales`` ``[num_pages, page_size, Hkv, D // G]`` (the Triton backend needs
            their last dimension contiguous).
        block_tables: int32 ``[B, max_pages]``.
        seq_lens: int32 ``[B]``, tokens in the cache including the new ones.
        scheme: the pages' scale scheme (:mod:`kvquant.schemes`), its tensors on the pages'
            device; a K transform rotates the query alike inside the kernel.
        sm_scale: softmax scale applied to ``q·k``.
        mask: :class:`~kvquant.schemes.Mask`: ``causal``, ``window``, ``softcap``,
            ``kv_start``, ``q_lens``, ``sinks`` (default :data:`~kvquant.schemes.CAUSAL`).
        first: a K transform's first tokens (:class:`~kvquant.schemes.FirstTokens`), or
            None: keys ``kv_start[b]`` .. ``kv_start[b] + first.lens[b] - 1`` are attended from
            ``first.k[b]`` / ``first.v[b]`` (same masks) instead of their slots, which are
            never read. The Triton backend needs ``first.k`` and ``first.v`` contiguous.
        out: optional ``[B, Lq, Hq, D]`` output in the query dtype, any strides
            with no two elements sharing memory.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        recent: each sequence's newest tokens at full precision
            (:class:`~kvquant.schemes.RecentTokens`: K and V rings, one contiguous
            ``[B, 2, R, Hkv, D]`` tensor, position ``p`` in slot ``p % R``), or None: keys ``max(kv_start[b] + first
            tokens, seq_lens[b] - R)`` .. ``seq_lens[b] - 1`` are attended from the ring
            (same masks) instead of their slots.

    Returns:
        ``[B, Lq, Hq, D]`` in the query dtype (``out`` when given).

    Raises:
        KernelInputError: a malformed argument.
        BackendError: the requested backend cannot run here.
    """
    plan = plan_attention(
        query, pages, block_tables, seq_lens, scheme, sm_scale=sm_scale, mask=mask, first=first,
        out=out, backend=backend, recent=recent,
    )  # fmt: skip
    return plan.execute(
        query, pages, block_tables, seq_lens, scheme, sm_scale, mask, first, out, recent
    )


def compute_slot_mapping(
    block_tables: torch.Tensor, positions: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Slots of token positions, from block tables (pure torch, no GPU sync).

    ``slot = block_tables[b, pos // page_size] * page_size + pos % page_size``;
    a negative position (padding) gives slot -1, which :func:`write_kv` skips.
    Positions must lie inside the pages the block table lists (checked where
    values are cheap to read: see :mod:`kvquant.kernels.validate`).

    Args:
        block_tables: int32 or int64 ``[B, max_pages]``.
        positions: integer ``[B, L]`` token positions within each sequence.
        page_size: token slots per page.

    Returns:
        int64 ``[B, L]`` slot mapping on the block table's device.

    Raises:
        KernelInputError: a malformed argument (``page_size`` < 1, shapes,
            dtypes, a position beyond the block table).

    Example:
        >>> import torch
        >>> bt = torch.tensor([[3, 1]], dtype=torch.int32)
        >>> compute_slot_mapping(bt, torch.tensor([[0, 17, -1]]), 16).tolist()
        [[48, 17, -1]]
    """
    check_slot_mapping_inputs(block_tables, positions, page_size)
    pos = positions.to(torch.int64)
    valid = pos >= 0
    safe = torch.where(valid, pos, torch.zeros_like(pos))
    slots = slot_mapping(block_tables.to(torch.int64) * page_size, safe, page_size)
    return torch.where(valid, slots, torch.full_like(slots, -1))


def slot_mapping(
    page_base: torch.Tensor, positions: int | torch.Tensor, page_size: int
) -> torch.Tensor:
    """Slots of token positions: the one implementation of ``slot = page * page_size + offset``.

    Unchecked (callers own the index tensors): every slot kvquant's caches write
    to comes from here (:func:`compute_slot_mapping`, which checks its inputs,
    :meth:`kvquant.cache.PageAllocator.reserve`, :meth:`kvquant.cache.SequenceBook.slots`,
    :meth:`kvquant.cache.StaticStep.derive`).

    Args:
        page_base: int64 ``[B, max_pages]``: a block table times ``page_size``.
        positions: one position for every row (an int: a column slice, no gather),
            or int64 ``[B, L]`` positions ``>= 0`` inside the pages the table lists.
        page_size: token slots per page.

    Returns:
        int64 ``[B, 1]`` (an int position) or ``[B, L]`` on ``page_base``'s device.

    Example:
        >>> import torch
        >>> base = torch.tensor([[3, 1]]) * 16
        >>> slot_mapping(base, torch.tensor([[0, 17]]), 16).tolist(), slot_mapping(base, 17, 16).tolist()
        ([[48, 17]], [[17]])
    """
    if isinstance(positions, int):
        col = positions // page_size
        return page_base[:, col : col + 1] + positions % page_size
    return page_base.gather(1, positions // page_size) + positions % page_size
