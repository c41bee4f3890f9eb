"""The device side of kvquant's continuous-batching cache: one buffer of blocks, each layer's
storage as views into it, a layer's step, and the number of blocks a memory budget buys."""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

from kvquant import kernels
from kvquant.cache import PagedLayerStorage
from kvquant.errors import (
    BatchingError,
    CacheCapacityError,
    UnsupportedModelError,
)
from kvquant.integrations.hf.compat import memory_breakdown
from kvquant.integrations.hf.continuous.layout import BlockLayout
from kvquant.integrations.hf.continuous.plan import StepPlan, build_plan
from kvquant.schemes import FirstTokens, RecentTokens

__all__ = [
    "LIVE_CACHES",
    "BatchingStorage",
    "LayerStep",
    "allocate_buffer",
    "live_caches",
    "plan_blocks",
    "release",
]

_DEFAULT_BATCH_TOKENS = 8192
"""Tokens per step when the config sets no ``max_batch_tokens`` (transformers 5.24's default)."""

LIVE_CACHES: weakref.WeakSet[Any] = weakref.WeakSet()


def live_caches() -> list[Any]:
    """kvquant's batching caches that still hold their device buffer (tests check none leak)."""
    return [c for c in LIVE_CACHES if c.kvq.buffer is not None]


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


# ---------------------------------------------------------------------- storage


class BatchingStorage:
    """The pages of one batching cache (FP8 or 4-bit): one flat buffer, one :class:`PagedLayerStorage`
    view per layer.

    Args:
        buffer: flat uint8 tensor of ``num_blocks`` blocks of ``layout``.
        layout: the block layout.
        specs: the patch's per-layer :class:`~kvquant.integrations.hf.cache_layer.LayerSpec`.
        num_blocks: blocks in ``buffer`` (transformers' unused trash blocks included).
        backend: kernel backend of the patch.
        trash_block: a block transformers never allocates (where a decode-path step sends the
            side writes a request does not make).

    Attributes:
        layers: one :class:`PagedLayerStorage` per layer, its pages views of ``buffer``.
        first: ``k-transform``: per layer, the ``(first_k, first_v)`` views
            ``[num_blocks, first_tokens, Hkv, D]``; else empty.
        recent: with a ring of newest tokens, per layer, the ``(recent_k, recent_v)``
            views ``[num_blocks, R, Hkv, D]`` (each block's ring); else empty.
        plan: the :class:`StepPlan` of the forward in progress (None between forwards).
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        layout: BlockLayout,
        specs: list[Any],
        num_blocks: int,
        backend: str,
        trash_block: int = 0,
    ) -> None:
        self.buffer: torch.Tensor | None = buffer
        self.layout = layout
        self.trash_block = trash_block
        self.layers: list[PagedLayerStorage] = []
        self.first: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.recent: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.plan: StepPlan | None = None
        plans = kernels.PlanCache()  # the layers' kernel plans (shared: see PlanCache)
        device = buffer.device
        for i, spec in enumerate(specs):
            views = layout.views(buffer, i, num_blocks)
            pages = {k: v for k, v in views.items() if not k.startswith(("first", "recent"))}
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
                    group_size=spec.group_size,
                    k_scale=spec.k_scale,
                    v_scale=spec.v_scale,
                    device=device,
                    backend=backend,
                    name=spec.name,
                    k_offset=spec.k_offset,
                    k_rotation=rotation,
                    first_tokens=spec.first_tokens,
                    pages=pages,
                    plans=plans,
                )
            )
            if layout.first_tokens:
                self.first.append((views["first_k"], views["first_v"]))
            if layout.recent_tokens:
                self.recent.append((views["recent_k"], views["recent_v"]))

    def begin(self, kwargs: dict[str, Any]) -> None:
        """Build the plan of the forward that starts (the decoder's pre-hook calls this)."""
        self.plan = build_plan(kwargs, self.layout, self.trash_block)

    def end(self) -> None:
        """Drop the plan of the forward that ended."""
        self.plan = None

    def release(self) -> None:
        """Drop the buffer and every view of it (:func:`release`)."""
        self.buffer = None
        self.layers = []
        self.first = []
        self.recent = []
        self.plan = None

    def write(
        self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> LayerStep:
        """Store the step's new K/V ``[1, Hkv, T, D]`` of ``layer_idx`` in its pages; the layer's step.

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
        rotation = storage.scheme.kernel_view().k_rotation
        # full-precision copies beside the pages: the k-transform's first tokens, the ring
        for writes, sides in ((plan.first_writes, self.first), (plan.recent_writes, self.recent)):
            if writes is None or not sides:
                continue
            tok, blocks, at = writes
            side_k, side_v = sides[layer_idx]
            kf = k[0].index_select(0, tok)
            if rotation is not None:  # keys in the pages' frame, before any offset
                kf = kf.float() @ rotation
            side_k[blocks, at] = kf.to(side_k.dtype)
            side_v[blocks, at] = v[0].index_select(0, tok).to(side_v.dtype)
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
                "continuous batching; kvquant's quantized cache is for inference. Fix: model.eval()."
            )
        plan = self.plan
        q4 = query.transpose(1, 2)  # [1, T, Hq, D]
        out = torch.empty(q4.shape, dtype=query.dtype, device=query.device)
        if plan.padding:  # query tokens of no request
            out[:, plan.tokens - plan.padding :].zero_()
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
            if (
                launch.first_pages is not None
                and launch.first_lens is not None
                and self.storage.first
            ):
                side_k, side_v = self.storage.first[self.layer_idx]
                options["first"] = FirstTokens(
                    side_k.index_select(0, launch.first_pages),
                    side_v.index_select(0, launch.first_pages),
                    launch.first_lens,
                )
            if launch.recent_blocks is not None and self.storage.recent:
                # each row's ring: slot s from the block that holds its newest position = s mod R
                ring_k, ring_v = self.storage.recent[self.layer_idx]
                slot = torch.arange(ring_k.shape[1], device=ring_k.device)
                options["recent"] = RecentTokens(
                    torch.stack(
                        (ring_k[launch.recent_blocks, slot], ring_v[launch.recent_blocks, slot]), 1
                    )
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
        if plan.solo is not None:
            grouped = out[0].view(plan.tokens, key.shape[1], -1, d)  # [T, Hkv, G, D]
            alone = _alone(q4[0], key, value, sm_scale, softcap, sinks).to(out.dtype)
            grouped.copy_(torch.where(plan.solo[:, None, None, None], alone, grouped))
        return out, None


def _alone(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sm_scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Each token's attention over its own key and value alone (a one-token prompt, at full
    precision): its value, weighted against the head's sink where the model has sinks.

    Args:
        q: ``[T, Hq, D]``; key, value: ``[1, Hkv, T, D]`` (the step's new K/V).

    Returns:
        ``[T, Hkv, G, D]`` (``G = Hq // Hkv`` query heads per KV head): without sinks the
        values broadcast over the group (a view, nothing copied), else fp32.
    """
    t, hkv, d = q.shape[0], key.shape[1], q.shape[2]
    v = value[0].transpose(0, 1)[:, :, None, :]  # [T, Hkv, 1, D]
    if sinks is None:
        return v.expand(t, hkv, q.shape[1] // hkv, d)
    k = key[0].transpose(0, 1)[:, :, None, :].float()
    score = (q.view(t, hkv, -1, d).float() * k).sum(-1) * sm_scale  # [T, Hkv, G]
    if softcap:
        score = softcap * torch.tanh(score / softcap)
    return v.float() * torch.sigmoid(score - sinks.view(hkv, -1))[..., None]


# ---------------------------------------------------------------------- sizing


def _memory_breakdown() -> tuple[int, int, int]:
    """``(total, reserved, allocated)`` bytes of the device, as transformers measures them."""
    _, total, reserved, allocated = memory_breakdown()()
    return int(total), int(reserved), int(allocated)


def plan_blocks(
    cb_config: Any,
    config: Any,
    layout: BlockLayout,
    dtype: torch.dtype,
    logits_to_keep: bool = False,
    page_ids_per_block: int = 1,
) -> tuple[int, int]:
    """``(max_batch_tokens, blocks)`` of a kvquant batching cache: what the budget buys in its
    format (FP8, or 4-bit codes and block scales: ``layout.bytes_per_block``).

    With ``cb_config.num_blocks`` the budget is that many blocks in the model's
    ``dtype`` (transformers' bytes for them), and the cache gets the blocks of
    ``layout`` those bytes hold. Without it, the budget is the device's free memory times
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
            f"kvquant's continuous-batching cache: {source} hold no {layout.pages_name} block of "
            f"{layout.page_size} tokens ({per_block} bytes for {layout.num_layers} layers). "
            "Fix: a larger num_blocks or max_memory_percent, a smaller max_batch_tokens or "
            "page size in the ContinuousBatchingConfig, or free device memory."
        )
    return int(tokens), int(blocks)


def allocate_buffer(nbytes: int, device: Any) -> torch.Tensor:
    try:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    except RuntimeError as err:  # torch.OutOfMemoryError, or a CPU allocation failure
        raise CacheCapacityError(
            f"kvquant's continuous-batching cache: allocating {nbytes} bytes on {device} failed "
            f"({type(err).__name__}). Fix: a smaller num_blocks or max_memory_percent in the "
            "ContinuousBatchingConfig."
        ) from err
