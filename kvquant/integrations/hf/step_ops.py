"""kvquant's decode-step write and attention as PyTorch custom ops, for compiled decode steps.

``kvquant::step_write`` stores the new token's K/V at the static step's slots (and, with
``recent_tokens``, in the ring of the newest tokens);
``kvquant::step_attention`` attends the query over the pages and returns the
output. They take only tensors and plain scalars (one :func:`layer_step`
dictionary per layer, passed as the keyword :data:`STEP_KWARG`; the scale scheme flattened by
:meth:`kvquant.schemes.Scheme.flatten`), so dynamo traces each compiled decoder layer as one
graph, without a graph break, and inductor calls them as extern kernels. Their real
implementations unflatten the scheme and call :func:`kvquant.kernels.write_kv` and
:func:`kvquant.kernels.paged_attention`; their fake ones only give the output's shape.

Design (why custom ops, what is dynamic): docs/dev/decode-steps.md.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from kvquant.cache import StaticStep
from kvquant.errors import CacheUsageError
from kvquant.integrations.hf.cache_layer import KVQuantLayer
from kvquant.kernels import paged_attention, write_kv
from kvquant.schemes import FirstTokens, Mask, Pages, RecentTokens, Scheme

__all__ = [
    "STEP_KWARG",
    "converted_sinks",
    "layer_step",
    "step_attention",
    "step_attention_call",
    "step_write",
]

STEP_KWARG = "kvquant_step"
"""Keyword argument of a decoder layer in a compiled decode step: its :func:`layer_step`."""

_MUTATED = ("k_pages", "v_pages", "k_group_scales", "v_group_scales", "recent_kv")


@torch.library.custom_op("kvquant::step_write", mutates_args=_MUTATED)
def step_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k_group_scales: torch.Tensor | None,
    v_group_scales: torch.Tensor | None,
    slots: torch.Tensor,
    scheme_name: str,
    scheme_ints: list[int],
    scheme_tensors: list[torch.Tensor | None],
    backend: str,
    recent_kv: torch.Tensor | None = None,
    pos: torch.Tensor | None = None,
) -> None:
    """Store the step's new K/V ``[B, Hkv, 1, D]`` (the attention module's layout) at ``slots``.

    :func:`kvquant.kernels.write_kv` on ``key.transpose(1, 2)`` and ``value.transpose(1, 2)``;
    the pages and group scales are the :class:`~kvquant.schemes.Pages`, the ``scheme_*``
    arguments the layer's flattened scheme (:meth:`~kvquant.schemes.Scheme.flatten`). With
    ``recent_kv`` (the ring of the newest tokens ``[B, 2, R, Hkv, D]``) and ``pos`` (the
    static step's int64 ``[1]`` position) the same write keeps the token in the ring.
    """
    recent = None if recent_kv is None or pos is None else RecentTokens(recent_kv)
    write_kv(
        key.transpose(1, 2),
        value.transpose(1, 2),
        Pages(k_pages, v_pages, k_group_scales, v_group_scales),
        slots,
        Scheme.unflatten(scheme_name, scheme_ints, scheme_tensors),
        backend=backend,
        recent=recent,
        recent_start=None if recent is None else pos,
    )


@step_write.register_fake
def _step_write_fake(*args: Any) -> None:
    return None


_sinks_fp32: dict[tuple[object, ...], tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
_SINKS_MAX = 256


def converted_sinks() -> list[torch.Tensor]:
    """The fp32 sink logits the ops keep now, one per model sink tensor and version (a diagnostic:
    a step converts each layer's sinks once, never inside a CUDA graph capture)."""
    return [converted for _, converted in _sinks_fp32.values()]


def _sinks(s_aux: torch.Tensor) -> torch.Tensor:
    """The model's sink logits as the kernels take them (fp32, contiguous), one copy per tensor version.

    The same converted tensor serves every step while the parameter is
    unchanged, so the kernels' value check reads it once (never inside a CUDA
    graph capture, where a read would fail).
    """
    try:
        version = int(s_aux._version)
    except RuntimeError:  # an inference tensor
        version = -1
    key = (id(s_aux), s_aux.data_ptr(), version, s_aux.device, s_aux.dtype)
    hit = _sinks_fp32.get(key)
    if hit is not None and hit[0]() is s_aux:
        return hit[1]
    sinks = s_aux.detach().to(torch.float32).contiguous()
    if len(_sinks_fp32) >= _SINKS_MAX:
        _sinks_fp32.clear()
    _sinks_fp32[key] = (weakref.ref(s_aux), sinks)
    return sinks


@torch.library.custom_op("kvquant::step_attention", mutates_args=())
def step_attention(
    query: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k_group_scales: torch.Tensor | None,
    v_group_scales: torch.Tensor | None,
    block_table: torch.Tensor,
    lens: torch.Tensor,
    kv_start: torch.Tensor,
    scheme_name: str,
    scheme_ints: list[int],
    scheme_tensors: list[torch.Tensor | None],
    first_k: torch.Tensor | None,
    first_v: torch.Tensor | None,
    first_lens: torch.Tensor | None,
    first_start: torch.Tensor | None,
    sinks: torch.Tensor | None,
    sm_scale: float,
    softcap: float,
    window: int,
    backend: str,
    recent_kv: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``query [B, Hq, Lq, D]`` over the pages: a new ``[B, Lq, Hq, D]`` tensor.

    :func:`kvquant.kernels.paged_attention` with ``block_table`` / ``lens`` /
    ``kv_start`` and the layer's flattened scheme. ``first_k`` / ``first_v`` / ``first_lens`` /
    ``first_start`` are the storage's first-token side buffer (``k-transform``): a row whose
    buffer was filled for another start than ``kv_start`` reads its keys from
    the pages (as :meth:`~kvquant.cache.PagedLayerStorage.first_buffer`).
    ``sinks`` are the model's sink logits in any float dtype. ``recent_kv`` is the ring of the
    newest tokens (:class:`~kvquant.schemes.RecentTokens`), or None.
    """
    b, hq, lq, d = query.shape
    out = torch.empty((b, lq, hq, d), dtype=query.dtype, device=query.device)
    first = None
    if first_k is not None and first_v is not None and first_lens is not None:
        if first_start is None:
            raise CacheUsageError(
                "kvquant::step_attention: first_k was given without first_start; expected all "
                "five first-token tensors of the layer's storage (layer_step passes them)."
            )
        lens_now = torch.where(
            kv_start.to(first_start.device, first_start.dtype) == first_start,
            first_lens,
            torch.zeros_like(first_lens),
        )
        first = FirstTokens(first_k, first_v, lens_now)
    mask = Mask(
        causal=True, window=window, softcap=softcap, kv_start=kv_start,
        sinks=None if sinks is None else _sinks(sinks),
    )  # fmt: skip
    paged_attention(
        query.transpose(1, 2),
        Pages(k_pages, v_pages, k_group_scales, v_group_scales),
        block_table,
        lens,
        Scheme.unflatten(scheme_name, scheme_ints, scheme_tensors),
        sm_scale=sm_scale,
        mask=mask,
        first=first,
        out=out,
        backend=backend,
        recent=None if recent_kv is None else RecentTokens(recent_kv),
    )
    return out


@step_attention.register_fake
def _step_attention_fake(query: torch.Tensor, *args: Any) -> torch.Tensor:
    b, hq, lq, d = query.shape
    return query.new_empty((b, lq, hq, d))


def layer_step(layer: KVQuantLayer, static: StaticStep) -> dict[str, Any]:
    """The tensors (and the backend name) a compiled decode step of ``layer`` passes to the ops.

    Marks the page count of the pools and the block table's width dynamic
    for dynamo (see the module docstring).

    Raises:
        CacheUsageError: the layer holds no pages yet.
    """
    storage = layer.storage
    if storage is None:
        raise CacheUsageError(
            f"{layer.spec.name}: a compiled decode step reached a kvquant cache layer that holds "
            "nothing yet. Fix: run the prompt through the cache first (generate does)."
        )
    pages = storage.pages
    pools = (pages.k, pages.v, pages.k_scales, pages.v_scales)
    for pool in pools:
        if pool is not None:
            torch._dynamo.maybe_mark_dynamic(pool, 0)
    torch._dynamo.maybe_mark_dynamic(static.block_table, 1)
    name, ints, tensors = storage.scheme.flatten()
    first_k, first_v, first_lens, first_start = storage.first_tensors()
    return {
        "k_pages": pages.k,
        "v_pages": pages.v,
        "k_group_scales": pages.k_scales,
        "v_group_scales": pages.v_scales,
        "scheme_name": name,
        "scheme_ints": ints,
        "scheme_tensors": tensors,
        "first_k": first_k,
        "first_v": first_v,
        "first_lens": first_lens,
        "first_start": first_start,
        "slots": static.slots,
        "block_table": static.block_table,
        "lens": static.lens,
        "kv_start": static.kv_start,
        "backend": storage.backend,
        "recent_kv": storage.recent_kv(),
        "pos": static.pos,
    }


def step_attention_call(
    module: nn.Module,
    step: dict[str, Any],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    s_aux: torch.Tensor | None,
) -> tuple[torch.Tensor, None]:
    """kvquant's attention in a compiled decode step: write the new K/V, attend (traced by dynamo).

    Args:
        module: the attention module (its ``scaling`` when ``scaling`` is None).
        step: the layer's :func:`layer_step`.
        query: ``[B, Hq, 1, D]`` after RoPE.
        key: ``[B, Hkv, 1, D]`` the new token's keys (the layer got no cache).
        value: ``[B, Hkv, 1, D]``.
        scaling: softmax scale, or None.
        sliding_window: the layer's window, or None.
        softcap: logit softcap, or None.
        s_aux: ``[Hq]`` learned sink logits, or None.

    Returns:
        ``(attn_output [B, 1, Hq, D] in the query dtype, None)``.
    """
    sm_scale = float(scaling if scaling is not None else getattr(module, "scaling", 0.0))
    if sm_scale <= 0:
        sm_scale = query.shape[-1] ** -0.5
    torch.ops.kvquant.step_write(
        key,
        value,
        step["k_pages"],
        step["v_pages"],
        step["k_group_scales"],
        step["v_group_scales"],
        step["slots"],
        step["scheme_name"],
        step["scheme_ints"],
        step["scheme_tensors"],
        step["backend"],
        step["recent_kv"],
        step["pos"],
    )
    out = torch.ops.kvquant.step_attention(
        query,
        step["k_pages"],
        step["v_pages"],
        step["k_group_scales"],
        step["v_group_scales"],
        step["block_table"],
        step["lens"],
        step["kv_start"],
        step["scheme_name"],
        step["scheme_ints"],
        step["scheme_tensors"],
        step["first_k"],
        step["first_v"],
        step["first_lens"],
        step["first_start"],
        s_aux,
        sm_scale,
        float(softcap or 0.0),
        int(sliding_window or 0),
        step["backend"],
        step["recent_kv"],
    )
    return out, None
