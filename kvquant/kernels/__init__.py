"""FP8 paged KV-cache kernels: public entry points.

:func:`write_kv` quantizes new K/V tokens into FP8 pages; :func:`paged_attention` attends new
queries over those pages. Both validate every argument before anything runs, then dispatch to
a backend (:mod:`kvquant.kernels.backend`): ``"triton"``, ``"torch"`` (the pure-PyTorch
references :func:`write_kv_reference` and :func:`paged_attention_reference`) or ``"auto"``
(Triton on CUDA, the reference on CPU). Each op is a folder, ``kvquant.kernels.attention`` and
``kvquant.kernels.write`` (kernel, launch, naive reference, validate); this package imports
only torch (Triton at the first Triton dispatch), never transformers. The static K transform
(``k_offset``, ``k_rotation``, :func:`hadamard`; ``first_k``/``first_v``/``first_lens`` for
the first tokens) is described with each function. Layout: pages ``[num_pages, page_size,
Hkv, D]`` FP8, slot ``= page * page_size + offset``, int32 block tables ``[B, max_pages]`` and
sequence lengths ``[B]``; the design: docs/dev/kernels.md.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from kvquant.errors import BackendError, KernelInputError
from kvquant.kernels.attention.naive import paged_attention_reference
from kvquant.kernels.attention.validate import AttentionGeometry, check_attention_inputs
from kvquant.kernels.backend import resolve_backend
from kvquant.kernels.fp8 import hadamard
from kvquant.kernels.validate import check_slot_mapping_inputs
from kvquant.kernels.write.naive import write_kv_reference
from kvquant.kernels.write.validate import check_write_inputs

__all__ = [
    "compute_slot_mapping",
    "group_scale_storage",
    "hadamard",
    "page_storage",
    "paged_attention",
    "slot_mapping",
    "write_kv",
]


_triton_modules: dict[str, ModuleType] = {}


def _triton_module(name: str) -> ModuleType:
    """``kvquant.kernels.<name>`` (a Triton launcher module), imported on first use."""
    mod = _triton_modules.get(name)
    if mod is None:
        mod = _triton_modules[name] = importlib.import_module(f"kvquant.kernels.{name}")
    return mod


def _require_interpreter_for_cpu(device: torch.device, interpreted: bool, op: str) -> None:
    if device.type != "cuda" and not interpreted:
        raise BackendError(
            f"{op}: backend='triton' on {device} needs the Triton interpreter, but kvquant's "
            "Triton kernels were imported before TRITON_INTERPRET=1 was set. Fix: set "
            "TRITON_INTERPRET=1 in the environment before the first kernel call (or start the "
            "process with it), or pass backend='torch'."
        )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_group_scales: torch.Tensor | None = None,
    v_group_scales: torch.Tensor | None = None,
    k_offset: torch.Tensor | None = None,
    k_rotation: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Quantize new K/V tokens to FP8 and store them into their page slots (in place).

    Each value is divided by its scale, clamped to the FP8 format's finite
    range (±448 for e4m3fn, ±57344 for e5m2) and rounded to nearest even.
    Non-finite inputs are stored as NaN, so a bad activation shows up in the
    attention output instead of being clipped. With group scales, the scale
    of each (token, KV head, group of ``G`` elements) is ``amax / fp8_max``,
    1.0 for an all-zero group, NaN for a group holding a non-finite value,
    and is stored beside the token's slot. With a K transform (static scales only) K is
    rotated and offset first: ``fp8((key @ k_rotation - k_offset) / k_scale)``, clamped and
    NaN-marked as above (a non-finite transformed value is stored as NaN); V is unchanged.

    Every argument is validated before anything is written: a call that
    raises leaves the pages and group scales as they were.

    Args:
        key: ``[B, L, Hkv, D]`` float32, float16 or bfloat16, any strides.
        value: ``[B, L, Hkv, D]`` float32, float16 or bfloat16 (may differ
            from ``key``), any strides.
        k_pages: ``[num_pages, page_size, Hkv, D]`` ``float8_e4m3fn`` or
            ``float8_e5m2``, any strides with no two elements sharing memory
            (e.g. from :func:`page_storage`); written in place.
        v_pages: like ``k_pages`` (same dtype); written in place.
        slot_mapping: int64 ``[B, L]``: slot ``page * page_size + offset`` of
            each new token, negative to skip the token. Slots must be
            distinct (duplicates store one of the tokens, unspecified which).
        k_scale: fp32 ``[]`` (per-tensor) or ``[Hkv]`` (per-head) static K
            scale; give it with ``v_scale``, or give group scales instead.
        v_scale: fp32 ``[]`` or ``[Hkv]`` static V scale.
        k_group_scales: fp32 ``[num_pages, page_size, Hkv, D // G]``, last
            dimension contiguous, no two elements sharing memory (e.g. from
            :func:`group_scale_storage`), written in place (dynamic
            ``fp32-group`` format); give it with ``v_group_scales``.
        v_group_scales: like ``k_group_scales``.
        k_offset: fp32 ``[Hkv, D]`` finite K offset in the rotated frame (``k-transform``),
            or None (zeros); needs static scales.
        k_rotation: fp32 ``[D, D]`` orthonormal K rotation (e.g. :func:`hadamard`), or None
            (identity); needs static scales.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Raises:
        KernelInputError: a malformed argument (dtype, shape, device, strides,
            a slot beyond the cache where values are checked: see
            :mod:`kvquant.kernels.validate`).
        BackendError: the requested backend cannot run here.

    Example:
        >>> import torch
        >>> from kvquant.kernels import write_kv
        >>> k_pages = torch.zeros(4, 16, 2, 64, dtype=torch.float8_e4m3fn)
        >>> v_pages = torch.zeros_like(k_pages)
        >>> key = torch.randn(1, 3, 2, 64)
        >>> slots = torch.tensor([[16, 17, 18]])  # page 1, offsets 0..2
        >>> write_kv(key, key, k_pages, v_pages, slots,
        ...          k_scale=torch.tensor(0.01), v_scale=torch.tensor(0.01), backend="torch")
        >>> bool((k_pages[1, :3].float() != 0).any())
        True
    """
    check_write_inputs(
        key,
        value,
        k_pages,
        v_pages,
        slot_mapping,
        k_scale,
        v_scale,
        k_group_scales,
        v_group_scales,
        k_offset=k_offset,
        k_rotation=k_rotation,
    )
    chosen = resolve_backend(backend, k_pages.device, "write_kv")
    if key.numel() == 0:
        return
    if chosen == "torch":
        write_kv_reference(
            key,
            value,
            k_pages,
            v_pages,
            slot_mapping,
            k_scale=k_scale,
            v_scale=v_scale,
            k_group_scales=k_group_scales,
            v_group_scales=v_group_scales,
            k_offset=k_offset,
            k_rotation=k_rotation,
        )
        return
    write_triton = _triton_module("write.launch")
    if k_pages.device.type != "cuda":
        _require_interpreter_for_cpu(k_pages.device, write_triton.is_interpreted(), "write_kv")
    write_triton.write_kv_triton(
        key,
        value,
        k_pages,
        v_pages,
        slot_mapping,
        k_scale,
        v_scale,
        k_group_scales,
        v_group_scales,
        k_offset,
        k_rotation,
    )


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


def _check_triton_attention_limits(
    geo: AttentionGeometry, block_tables: torch.Tensor, k_group_scales: torch.Tensor | None,
    v_group_scales: torch.Tensor | None, transform: list[tuple[str, torch.Tensor | None]],
) -> None:  # fmt: skip
    """Restrictions of the Triton attention kernel beyond the common contract."""
    d = geo.head_dim
    fix = "Fix: pass backend='torch' (the reference has no such limit)."
    if d < 16 or d & (d - 1):
        raise KernelInputError(
            f"paged_attention: head_dim {d} is not a power of two >= 16, which the Triton "
            f"attention kernel needs. {fix}"
        )
    if geo.group_size is not None:
        ng = d // geo.group_size
        if ng & (ng - 1):
            raise KernelInputError(
                f"paged_attention: group scales have {ng} groups per head (head_dim {d}, "
                f"group_size {geo.group_size}); the Triton attention kernel needs a power of "
                f"two. Fix: choose a power-of-two group_size, or pass backend='torch'."
            )
    for name, gs in (("k_group_scales", k_group_scales), ("v_group_scales", v_group_scales)):
        if gs is not None and gs.shape[-1] > 1 and gs.stride(-1) != 1:
            raise KernelInputError(
                f"paged_attention: {name} has strides {gs.stride()}; the Triton kernel needs "
                "its last dimension (the groups of one head) contiguous. Fix: allocate it with "
                "kvquant.kernels.group_scale_storage, or pass backend='torch'."
            )
    for name, x in transform:
        if x is not None and not x.is_contiguous():
            raise KernelInputError(
                f"paged_attention: {name} has strides {x.stride()} for shape {tuple(x.shape)}; "
                "the Triton kernel needs it contiguous. Fix: pass it .contiguous() once, when "
                "it is created (or backend='torch')."
            )
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise KernelInputError(
            f"paged_attention: block_tables has strides {block_tables.stride()}; the Triton "
            "kernel needs its last dimension contiguous. Fix: pass block_tables.contiguous() "
            "(PageAllocator.block_tables returns a contiguous tensor)."
        )


def paged_attention(
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    k_group_scales: torch.Tensor | None = None,
    v_group_scales: torch.Tensor | None = None,
    q_lens: torch.Tensor | None = None,
    kv_start: torch.Tensor | None = None,
    causal: bool = True,
    softcap: float = 0.0,
    window: int = 0,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_offset: torch.Tensor | None = None,
    k_rotation: torch.Tensor | None = None,
    first_k: torch.Tensor | None = None,
    first_v: torch.Tensor | None = None,
    first_lens: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of new query tokens over the paged FP8 KV cache.

    The ``Lq`` query tokens of sequence ``b`` are its newest ``q_lens[b]``
    tokens, whose K/V are already written (:func:`write_kv`): query ``i`` sits
    at position ``seq_lens[b] - q_lens[b] + i``. Key ``j`` is visible when
    ``kv_start[b] <= j < seq_lens[b]``, ``j <= position`` (if ``causal``) and
    ``j > position - window`` (if ``window > 0``). Rows of padding queries,
    and rows that see no key, are zeros; a slot no query of the call sees
    never reaches the output, whatever it holds. Static scales must be finite
    and in ``[SCALE_MIN, SCALE_MAX]`` (:mod:`kvquant.kernels.validate`). Semantics:
    :func:`kvquant.kernels.paged_attention_reference`.

    Args:
        query: ``[B, Lq, Hq, D]`` float16, bfloat16 or float32, any strides
            (HF's ``[B, Hq, Lq, D]`` tensor ``.transpose(1, 2)`` is fine);
            ``Hq`` a multiple of ``Hkv``.
        k_pages: ``[num_pages, page_size, Hkv, D]`` FP8, any strides (fastest
            from :func:`page_storage`).
        v_pages: like ``k_pages``.
        block_tables: int32 ``[B, max_pages]``.
        seq_lens: int32 ``[B]``, tokens in the cache including the new ones.
        sm_scale: softmax scale applied to ``q·k``.
        k_scale: fp32 ``[]`` or ``[Hkv]`` static K scale (with ``v_scale``).
        v_scale: fp32 ``[]`` or ``[Hkv]`` static V scale.
        k_group_scales: fp32 ``[num_pages, page_size, Hkv, D // G]`` (with
            ``v_group_scales``), instead of static scales; the Triton backend
            needs the last dimension contiguous.
        v_group_scales: like ``k_group_scales``.
        q_lens: int32 ``[B]`` valid query tokens per sequence (default ``Lq``).
        kv_start: int32 ``[B]`` first visible key (left padding; default 0).
        causal: mask keys after each query's position.
        softcap: if > 0 (finite), scores become ``softcap * tanh(scores / softcap)``;
            0 disables it.
        window: if > 0, each query sees only the last ``window`` positions.
        out: optional ``[B, Lq, Hq, D]`` output in the query dtype, any strides
            with no two elements sharing memory.
        sinks: fp32 ``[Hq]`` learned attention-sink logits (gpt-oss), contiguous and
            finite, or None: each head's softmax denominator gets ``exp(sinks[h])``.
        k_offset: fp32 ``[Hkv, D]`` K offset the pages were written with (``k-transform``),
            or None: the logical key is ``code * k_scale + k_offset``; static scales only.
        k_rotation: fp32 ``[D, D]`` K rotation the pages were written with, or None: the
            query is rotated alike (``query @ k_rotation``) inside the kernel.
        first_k: ``[B, NF, Hkv, D]`` float16/bfloat16/float32 keys of the first tokens in
            the rotated frame (``k @ k_rotation``, no offset), or None; with ``first_v``
            and ``first_lens``, static scales only.
        first_v: ``[B, NF, Hkv, D]`` their values, as the model produced them.
        first_lens: int32 ``[B]``, ``0..NF``: keys ``kv_start[b]`` ..
            ``kv_start[b] + first_lens[b] - 1`` are attended from ``first_k[b]`` /
            ``first_v[b]`` (same masks) instead of their slots, which are never read.
            The Triton backend needs ``k_offset``, ``k_rotation``, ``first_k`` and
            ``first_v`` contiguous.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        ``[B, Lq, Hq, D]`` in the query dtype (``out`` when given).

    Raises:
        KernelInputError: a malformed argument.
        BackendError: the requested backend cannot run here.
    """
    options: dict[str, Any] = {
        "k_scale": k_scale,
        "v_scale": v_scale,
        "k_group_scales": k_group_scales,
        "v_group_scales": v_group_scales,
        "q_lens": q_lens,
        "kv_start": kv_start,
        "causal": causal,
        "softcap": softcap,
        "window": window,
        "out": out,
        "sinks": sinks,
        "k_offset": k_offset,
        "k_rotation": k_rotation,
        "first_k": first_k,
        "first_v": first_v,
        "first_lens": first_lens,
    }
    geo = check_attention_inputs(
        query, k_pages, v_pages, block_tables, seq_lens, sm_scale=sm_scale, **options
    )
    options.update(sm_scale=float(sm_scale), softcap=float(softcap), window=int(window))
    chosen = resolve_backend(backend, k_pages.device, "paged_attention")
    if chosen == "torch":
        return paged_attention_reference(query, k_pages, v_pages, block_tables, seq_lens, **options)
    transform = [
        ("k_offset", k_offset),
        ("k_rotation", k_rotation),
        ("first_k", first_k),
        ("first_v", first_v),
    ]
    _check_triton_attention_limits(geo, block_tables, k_group_scales, v_group_scales, transform)
    attention_triton = _triton_module("attention.launch")
    if k_pages.device.type != "cuda":
        _require_interpreter_for_cpu(
            k_pages.device, attention_triton.is_interpreted(), "paged_attention"
        )
    return attention_triton.paged_attention_triton(
        query, k_pages, v_pages, block_tables, seq_lens, **options
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
