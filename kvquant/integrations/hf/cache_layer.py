"""kvquant's transformers cache: FP8 pages behind the ``Cache`` / ``CacheLayerMixin`` seam.

:class:`KVQuantCache` is a :class:`transformers.Cache` made of one
:class:`KVQuantLayer` per decoder layer; the layers share one
:class:`~kvquant.cache.SequenceBook` (one block table serves every layer) and
each stores its K/V in a :class:`~kvquant.cache.PagedLayerStorage`. A layer's
first ``update()`` stores the prompt in FP8 and returns it as given; later ones
return ``(None, None)`` for kvquant's attention function to read the pages, or
dense dequantized K/V ``[B, Hkv, T, D]`` under any other attention
implementation. Sequence bookkeeping follows ``DynamicLayer`` (left-padding
slots included).

Design (update, bookkeeping, padding): docs/dev/cache.md.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers.cache_utils import Cache, CacheLayerMixin

from kvquant import kernels
from kvquant.cache import (
    MAX_PAGE_SIZE,
    PagedLayerStorage,
    SequenceBook,
    total_memory_bytes,
)
from kvquant.errors import CacheUsageError, UnsupportedModelError
from kvquant.integrations.hf.compat import POSITIVE_CROP_KEEPS
from kvquant.integrations.hf.pool_sizing import PoolSizing
from kvquant.schemes import Scheme

__all__ = ["KVQuantCache", "KVQuantLayer", "LayerSpec"]

ATTN_NAME = "kvquant"
"""The name kvquant registers with ``AttentionInterface`` and ``AttentionMaskInterface``."""


_CPU = torch.device("cpu")

KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The K/V dtypes a cache layer accepts (those the write kernels read)."""


@dataclass(frozen=True)
class LayerSpec:
    """What a cache layer needs to know about its attention layer.

    Attributes:
        name: the attention module's path (for messages).
        num_kv_heads: KV heads.
        head_dim: elements per head.
        scheme: the layer's scale scheme class (:class:`~kvquant.schemes.PerTensorScales`,
            :class:`~kvquant.schemes.PerHeadScales`, :class:`~kvquant.schemes.GroupScales`,
            :class:`~kvquant.schemes.KTransformScales`, or a 4-bit one: ``Nvfp4Scales``,
            ``Mxfp4Scales``, ``Fp8KNvfp4VScales``); its ``name`` is :attr:`granularity`.
        k_scale: fp32 ``[]`` or ``[Hkv]`` static K scale (NVFP4's global scale), None for a
            dynamic scheme without one.
        v_scale: fp32 ``[]`` or ``[Hkv]`` static V scale (NVFP4's global scale), None for a
            dynamic scheme without one.
        group_size: ``G`` of the group scales (divides ``head_dim``), None for a static scheme.
        k_offset: fp32 ``[Hkv, D]`` per-channel K offset (``k-transform``), else None.
        rotation: ``"hadamard"`` or None (``k-transform``: the K / query rotation).
        first_tokens: first visible tokens per sequence kept at full precision
            (``k-transform``), else 0.
        recent_tokens: each sequence's newest tokens attended at full precision from a ring
            beside the pages (the ``recent_tokens`` option), else 0.
        kv_reused: later layers attend over this layer's K/V (Gemma 4's KV
            sharing): transformers hands them what this layer's ``update()``
            returns, so it returns dense K/V instead of ``(None, None)``.
    """

    name: str
    num_kv_heads: int
    head_dim: int
    scheme: type[Scheme]
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    group_size: int | None
    k_offset: torch.Tensor | None = None
    rotation: str | None = None
    first_tokens: int = 0
    kv_reused: bool = False
    recent_tokens: int = 0

    @property
    def granularity(self) -> str:
        """The scheme's word (for messages and reports)."""
        return self.scheme.name

    def slot_bytes(self) -> int:
        """Bytes one token slot takes in this layer, K and V together (pages and scales)."""
        return self.scheme.slot_bytes(self.num_kv_heads, self.head_dim, self.group_size)


def _from_storage(attr: str, doc: str) -> Any:
    """A read-only property: ``attr`` of the layer's storage, None before the first update.

    None too where the storage's scheme keeps no such tensor (each storage class holds only its
    scheme's: a static scale, or group scales).
    """

    def get(layer: KVQuantLayer) -> Any:
        return getattr(layer.storage, attr, None)

    return property(get, doc=f"{doc} None before the first update.")


class KVQuantLayer(CacheLayerMixin):
    """One decoder layer's FP8 paged K/V cache, backed by a :class:`~kvquant.cache.PagedLayerStorage`.

    The storage is built on the first update, on the device of the first keys;
    the tensor attributes below are read-only views of it.

    Attributes:
        seq_len: positions stored per sequence (left-padding slots included), kept by
            the cache's :class:`~kvquant.cache.SequenceBook`.
        storage: the layer's :class:`~kvquant.cache.PagedLayerStorage` (None before
            the first update).
        k_pages: FP8 ``[num_pages, page_size, Hkv, D]`` (None before the first update).
        v_pages: FP8 ``[num_pages, page_size, Hkv, D]``.
        k_group_scales: fp32 ``[num_pages, page_size, Hkv, D // G]`` for ``fp32-group``.
        v_group_scales: like ``k_group_scales``.
        k_scale: fp32 ``[]`` or ``[Hkv]`` for static granularities, else None.
        v_scale: like ``k_scale``.
        device: where the storage lives (None before the first update).
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True  # through KVQuantCache.crop, which crops every layer at once

    def __init__(self, cache: KVQuantCache, layer_idx: int, spec: LayerSpec) -> None:
        super().__init__()
        self.cache = cache  # held weakly: the cache owns its layers, not the reverse
        self.layer_idx = layer_idx
        self.spec = spec
        self.storage: PagedLayerStorage | None = None
        # k-transform: the K/V of the last update, until kvquant's attention knows each row's
        # first visible position (kv_start) and keeps the first tokens (flush_first_tokens)
        self.pending_first: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.first_end: int | None = None  # one past the last first-token position, once known

    def __repr__(self) -> str:
        return (
            f"KVQuantLayer(layer={self.layer_idx}, {self.spec.granularity}, seq_len={self.seq_len})"
        )

    @property
    def cache(self) -> KVQuantCache:
        """The :class:`KVQuantCache` this layer belongs to.

        A weak reference: a cache and its layers would otherwise form a reference
        cycle, which keeps the pages allocated after the last user reference is
        gone, until Python's cyclic collector runs (GPU memory pressure does not
        run it). The cache holds its layers; a layer alone is of no use.

        Raises:
            CacheUsageError: the cache was freed while this layer was kept.
        """
        cache = self._cache_ref()
        if cache is None:
            raise CacheUsageError(
                f"{self.spec.name}: this KVQuantLayer's KVQuantCache was freed (its pages went "
                "with it). Fix: keep a reference to the cache, not to one of its layers."
            )
        return cache

    @cache.setter
    def cache(self, cache: KVQuantCache) -> None:
        self._cache_ref = weakref.ref(cache)

    @property
    def seq_len(self) -> int:
        """Positions this layer stored per sequence (left-padding slots included)."""
        return self.cache.book.layer_lens[self.layer_idx]

    # ------------------------------------------------------------------ storage

    k_pages = _from_storage("k_pages", "FP8 ``[num_pages, page_size, Hkv, D]`` K pages.")
    v_pages = _from_storage("v_pages", "FP8 ``[num_pages, page_size, Hkv, D]`` V pages.")
    k_group_scales = _from_storage(
        "k_group_scales", "fp32 ``[num_pages, page_size, Hkv, D // G]`` (``fp32-group`` only)."
    )
    v_group_scales = _from_storage("v_group_scales", "Like ``k_group_scales`` for V.")
    k_scale = _from_storage("k_scale", "fp32 ``[]`` or ``[Hkv]`` static K scale, on the device.")
    v_scale = _from_storage("v_scale", "Like ``k_scale`` for V.")
    device = _from_storage("device", "Device of the pages.")

    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor | None:
        """Not available: K is stored in FP8 pages, there is no dense ``keys`` tensor.

        Raises:
            CacheUsageError: always once the layer stores tokens (``None`` before the
                first update, as ``DynamicLayer``); :meth:`dense_kv` returns the
                dequantized K/V.
        """
        self._no_dense("keys")
        return None

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._set_dense("keys", value)

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor | None:
        """Not available, like :attr:`keys`."""
        self._no_dense("values")
        return None

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._set_dense("values", value)

    def _no_dense(self, name: str) -> None:
        if self.storage is None:
            return  # nothing stored yet: None, as an uninitialised DynamicLayer
        raise CacheUsageError(
            f"{self.spec.name}: .{name} of a kvquant cache layer; kvquant stores K/V in FP8 pages, "
            f"so there is no dense {name} tensor (transformers' DynamicLayer has one). Fix: call "
            "layer.dense_kv(torch.bfloat16) for the dequantized (keys, values), or run that code "
            "without kvquant (handle.remove()) and with a DynamicCache."
        )

    def _set_dense(self, name: str, value: torch.Tensor | None) -> None:
        if value is not None:  # transformers' own code only ever clears them (None)
            raise CacheUsageError(
                f"{self.spec.name}: setting .{name} of a kvquant cache layer; its K/V live in "
                "FP8 pages written by update(). Fix: write K/V through update()."
            )

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Build this layer's storage on the device of ``key_states`` [B, Hkv, L, D].

        Raises:
            KVQuantError: bad shapes, or scales that do not fit the granularity.
        """
        self._check_shapes(key_states, value_states)
        device = key_states.device
        num_pages, page_size = self.cache.pool_shape(
            key_states.shape[0], device, first_tokens=key_states.shape[2]
        )
        spec = self.spec
        rotation = None
        if spec.rotation == "hadamard":  # built on the host: the storage checks it there once
            rotation = kernels.hadamard(spec.head_dim)
            if device.type == "cuda":
                rotation = rotation.pin_memory()
        self.storage = PagedLayerStorage(
            num_pages,
            page_size,
            spec.num_kv_heads,
            spec.head_dim,
            granularity=spec.granularity,
            group_size=spec.group_size,
            k_scale=spec.k_scale,
            v_scale=spec.v_scale,
            kv_dtype=self.cache.fp8_dtype,
            device=device,
            backend=self.cache.backend,
            name=spec.name,
            k_offset=spec.k_offset,
            k_rotation=rotation,
            first_tokens=spec.first_tokens,
            plans=self.cache.plans,
            recent_tokens=spec.recent_tokens,
        )
        self.is_initialized = True

    def _check_shapes(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        hkv, d = self.spec.num_kv_heads, self.spec.head_dim
        ks, vs = key_states.shape, value_states.shape
        if (
            len(ks) == 4
            and len(vs) == 4
            and ks[1] == hkv
            and ks[3] == d
            and vs[1] == hkv
            and vs[3] == d
            and ks[:3] == vs[:3]
            and key_states.dtype in KV_DTYPES
            and value_states.dtype in KV_DTYPES
        ):
            return  # the common case; the checks below name what is wrong
        for what, t in (("key_states", key_states), ("value_states", value_states)):
            if t.dtype not in KV_DTYPES:
                raise CacheUsageError(
                    f"{self.spec.name}: cache update got {what} in {t.dtype}; kvquant's FP8 "
                    "cache stores K/V computed in float32, float16 or bfloat16. Nothing was "
                    "written. Fix: run the model in one of them (model.to(torch.float32), "
                    "or torch_dtype=torch.bfloat16 when loading)."
                )
        for what, t in (("key_states", key_states), ("value_states", value_states)):
            if t.dim() != 4 or t.shape[1] != hkv or t.shape[3] != d:
                raise CacheUsageError(
                    f"{self.spec.name}: cache update got {what} of shape {tuple(t.shape)}; "
                    f"expected [batch, {hkv}, new_tokens, {d}] (the layer's KV heads and head_dim)."
                )
        if key_states.shape[:3] != value_states.shape[:3]:
            raise CacheUsageError(
                f"{self.spec.name}: key_states {tuple(key_states.shape)} and value_states "
                f"{tuple(value_states.shape)} disagree on batch or length."
            )

    @torch.compiler.disable  # torch.compile of a patched model breaks its graph here
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args: Any,
        kwargs: dict[str, Any] | None = None,
        **extra: Any,
    ) -> tuple[Any, Any]:
        """Quantize new K/V into this layer's pages.

        Args:
            key_states: ``[B, Hkv, L, D]`` new keys (after RoPE), any float dtype.
            value_states: ``[B, Hkv, L, D]`` new values, any float dtype.
            *args: ignored (transformers passes nothing else positionally).
            kwargs: the attention kwargs dict (transformers 5.24); unused.
            **extra: ignored.

        Returns:
            On the first update (no token stored before: a prompt), ``key_states``
            and ``value_states`` themselves, since they are all there is to
            attend to; later, ``(None, None)`` while kvquant's attention is
            active (it reads the FP8 pages), else (or when other layers reuse
            this layer's K/V, ``spec.kv_reused``) dense dequantized
            ``([B, Hkv, T, D], [B, Hkv, T, D])`` in the dtype of ``key_states``.

        Raises:
            CacheCapacityError: the pages cannot hold the new tokens (nothing is written).
            KVQuantError: the shapes or the batch size do not match the cache.
        """
        if self.layer_idx == 0:  # the first layer a forward updates: before anything is written
            self.cache.check_patch_active()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_shapes(key_states, value_states)
        bsz, _, new, _ = key_states.shape
        cache = self.cache
        book = cache.book
        static = book.static
        if static is not None:
            # A decode step of the graph runner: device-side bookkeeping only; the runner
            # reserved the pages and advances the lengths after the step.
            if new != 1 or bsz != static.lens.shape[0]:
                raise CacheUsageError(
                    f"{self.spec.name}: a CUDA-graph decode step got {new} new tokens for "
                    f"{bsz} sequences; expected 1 token for each of {static.lens.shape[0]}."
                )
            k, v = key_states.transpose(1, 2), value_states.transpose(1, 2)
            storage = self._storage()
            storage.write(k, v, static.slots, step_pos=static.pos)
            return None, None
        start = book.layer_lens[self.layer_idx]
        slots = cache.slots_for(self, bsz, new)
        if new > 0:
            k, v = key_states.transpose(1, 2), value_states.transpose(1, 2)
            storage = self._storage()
            storage.write(k, v, slots)
            storage.keep_recent(k, v, start, rows=book.window, batch=book.batch_size)
            if self.wants_first_tokens() and cache.attention_is_kvquant():
                self.pending_first = (k, v, start)
        book.layer_lens[self.layer_idx] = start + new
        if start == 0:
            # Nothing stored before: attention over exactly these keys, which the caller
            # already holds at full precision (the write above stored them in FP8 for later
            # steps). kvquant's attention runs SDPA on them, as the unpatched model does.
            return key_states, value_states
        if cache.attention_is_kvquant() and not self.spec.kv_reused:
            return None, None
        return self.dense_kv(key_states.dtype)

    def wants_first_tokens(self) -> bool:
        """Whether the next tokens may fall in a row's first-token window (``k-transform``)."""
        return self.spec.first_tokens > 0 and (
            self.first_end is None or self.seq_len < self.first_end
        )

    def flush_first_tokens(self, kv_start: torch.Tensor | None) -> None:
        """Keep the last update's first tokens in the storage's side buffer, now that ``kv_start`` is known.

        Called by kvquant's attention function (on the prompt's dense path too)
        before it attends. Syncs once per call on a GPU, only while the windows
        are incomplete (the prompt, and at most ``first_tokens`` decode steps).
        """
        pending, self.pending_first = self.pending_first, None
        if pending is None or self.storage is None:
            return
        k, v, start = pending
        book = self.cache.book
        self.storage.keep_first(k, v, start, kv_start, rows=book.window, batch=book.batch_size)
        self.first_end = self.storage.first_window_end()

    def _storage(self) -> PagedLayerStorage:
        if self.storage is None:
            raise CacheUsageError(
                f"{self.spec.name}: the kvquant cache layer holds nothing yet (it allocates its "
                "pages on the first update). Fix: run a forward pass with this cache first."
            )
        return self.storage

    def dense_kv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantize everything stored: ``([B, Hkv, seq_len, D], [B, Hkv, seq_len, D])`` in ``dtype``
        (with ``recent_tokens``, the newest from their full-precision ring, as kvquant's
        attention reads them)."""
        storage = self._storage()
        book = self.cache.book
        k, v = storage.dense(book.block_table(storage.device), self.seq_len, dtype)
        storage.overlay_recent(k, v, book.window)
        return k.transpose(1, 2), v.transpose(1, 2)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this layer's pool holds (:meth:`kvquant.cache.PagedLayerStorage.memory_bytes`).

        Returns:
            ``pages``, ``group_scales``, ``static_scales``, ``total``; all 0
            before the first update (nothing is allocated yet).
        """
        return total_memory_bytes([] if self.storage is None else [self.storage])

    # ------------------------------------------------------------------ HF queries

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the mask for ``query_length`` new tokens (as ``DynamicLayer``)."""
        return self.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        """Positions stored per sequence, left-padding slots included."""
        return self.seq_len

    def get_max_length(self) -> int:
        """-1 (no fixed maximum, as ``DynamicLayer``); capacity is enforced by :class:`CacheCapacityError`."""
        return -1

    def reset(self) -> None:
        """Forget every stored token (the pages stay allocated)."""
        self.cache.book.layer_lens[self.layer_idx] = 0
        self.pending_first = None
        self.first_end = None
        if self.storage is not None:
            self.storage.reset_first()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: sequence ``b`` takes the stored tokens of sequence ``beam_idx[b]`` [B]."""
        if self.seq_len == 0 or self.storage is None:
            return
        src, dst = self.cache.book.beam_moves(beam_idx, self.seq_len, self.storage.device)
        self.storage.copy_pages(src, dst)
        self.storage.reorder_first(beam_idx)
        self.storage.reorder_recent(beam_idx)

    def _unsupported(self, what: str) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"{self.spec.name}: {what} is not supported by kvquant's paged FP8 cache. Fix: run "
            "this generation mode without kvquant (handle.remove()), or use greedy / sampling / "
            "beam search / speculative decoding."
        )

    def crop(self, tokens_to_remove: int) -> None:
        """Refused: the layers of a kvquant cache share their pages; crop the whole cache.

        Raises:
            CacheUsageError: always; :meth:`KVQuantCache.crop` crops every layer at once.
        """
        raise CacheUsageError(
            f"{self.spec.name}: crop() of one kvquant cache layer; its layers share one block "
            "table and crop together. Fix: call crop() on the KVQuantCache."
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Not supported (contrastive search): raises :class:`KVQuantError`."""
        raise self._unsupported("batch_repeat_interleave() (contrastive search)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Not supported (contrastive search): raises :class:`KVQuantError`."""
        raise self._unsupported("batch_select_indices() (contrastive search)")

    def offload(self) -> None:
        """Not supported (offloaded caches): raises :class:`KVQuantError`."""
        raise self._unsupported("offload() (offloaded caches)")

    def prefetch(self) -> None:
        """Not supported (offloaded caches): raises :class:`KVQuantError`."""
        raise self._unsupported("prefetch() (offloaded caches)")


@dataclass
class DecodeMaskMemo:
    """The last decode step's padding mask and its left-padding starts (:attr:`KVQuantCache.decode_mask_memo`).

    ``ones[:, :length]`` is a copy of that mask and every later column of ``ones`` is 1, so
    ``ones[:, :length + 1]`` is what the next step's mask is when ``generate`` grew it by a
    column of ones: one comparison checks it.
    """

    ones: torch.Tensor
    length: int
    starts: torch.Tensor


class KVQuantCache(PoolSizing, Cache):
    """A transformers ``Cache`` storing K/V in FP8 pages, one :class:`KVQuantLayer` per layer.

    Built by :func:`kvquant.patch`'s hook when ``generate`` (or a forward call)
    has no cache yet, or explicitly from a patched model and passed as
    ``cache=`` (transformers 5.24) / ``past_key_values=`` (5.17).

    Args:
        model: a model patched with :func:`kvquant.patch`.
        max_cache_tokens: token slots in the whole cache (all sequences of the
            batch together), a hard bound (:class:`~kvquant.errors.CacheCapacityError`
            beyond it); default: the patch's setting, else none: the pools
            grow on demand (:meth:`KVQuantCache.pool_shape`).
        num_pages: pages in the pool, a hard bound (overrides ``max_cache_tokens``).
        page_size: token slots per page (1..4096); default the patch's (16).

    Raises:
        KVQuantError: the model is not patched.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_cache_tokens: int | None = None,
        num_pages: int | None = None,
        page_size: int | None = None,
    ) -> None:
        state = getattr(model, "_kvquant_state", None)
        if state is None:
            raise CacheUsageError(
                f"{type(model).__name__} is not patched by kvquant, so it has no kvquant scales "
                "or attention. Fix: call kvquant.patch(model) first."
            )
        opts = state.options
        self.page_size = int(page_size if page_size is not None else opts.page_size)
        self.max_cache_tokens = (
            max_cache_tokens if max_cache_tokens is not None else opts.max_cache_tokens
        )
        self.num_pages_requested = num_pages if num_pages is not None else opts.num_pages
        if not 1 <= self.page_size <= MAX_PAGE_SIZE:
            raise CacheUsageError(
                f"KVQuantCache: page_size={self.page_size}; expected 1..{MAX_PAGE_SIZE}. Fix: pass "
                "a page size such as 16, 32 or 64."
            )
        self.backend = opts.backend
        self.cuda_graphs: bool | None = opts.cuda_graphs  # None: auto (CUDA devices only)
        self.decode_graph: Any = None  # kvquant.integrations.hf.graphs.DecodeGraph
        # tokens per sequence the current forward's prefill will reach, when known (routing.py)
        self.length_hint: int | None = None
        # the graph runner found every layer's pages on the input's device (graphs.py)
        self.on_one_device = False
        self.fp8_dtype = torch.float8_e4m3fn
        self.config = state.text_config
        self.model_name = state.model_name
        # the patch that built the cache: its layers carry that patch's scales (patch.py refuses
        # the cache in a forward of another patch)
        self.patch_id: str = state.patch_id
        self.patch_state = weakref.ref(state)  # a removed patch's cache is refused (update)
        self.growable = self.max_cache_tokens is None and self.num_pages_requested is None
        self.capacity_version = 0
        # capacity_version of the pools the compiled decode step was captured on (graphs.py)
        self.compiled_capacity: int | None = None
        # under tensor parallelism, this rank's KV heads (kvquant.integrations.hf.sharding)
        specs = state.layer_specs if state.rank_specs is None else state.rank_specs
        self.book = SequenceBook(max(1, len(specs)), self.page_size)
        # the kernel plans of every layer's storage: a step's layers of one geometry share one
        # attention plan (validated and configured once); each layer keeps its write plan
        self.plans = kernels.PlanCache()
        self.kv_start_memo: tuple[Any, int, torch.Tensor] | None = None
        # the last decode step's padding mask (a copy) and its left-padding starts (graphs.py)
        self.decode_mask_memo: DecodeMaskMemo | None = None
        self.first_visible_memo: tuple[Any, int, torch.Tensor | None] | None = None
        self.rollback_point: int | None = None  # set by kvquant.patch's hooks during a forward
        layers: list[Any] = [KVQuantLayer(self, i, spec) for i, spec in enumerate(specs)]
        super().__init__(layers=layers)

    def __deepcopy__(self, memo: dict[int, Any]) -> KVQuantCache:
        """A cache holding the same tokens in pages of its own (``copy.deepcopy``, e.g. to reuse a
        prompt's cache for several continuations).

        The model's config is shared, not copied (the copy follows the model's
        attention implementation, as the original does), and the decode graph is
        left out: it was captured on the original's pages (a CUDA graph cannot be
        copied), so the copy captures its own at its first decode step.
        """
        memo[id(self.config)] = self.config
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for name, value in vars(self).items():
            keep = None if name == "decode_graph" else value
            copied.__dict__[name] = copy.deepcopy(keep, memo)
        for layer in copied.layers:  # a weak reference is copied as itself: point it here
            if isinstance(layer, KVQuantLayer):
                layer.cache = copied
        return copied

    def __repr__(self) -> str:
        return (
            f"KVQuantCache(layers={len(self.layers)}, page_size={self.page_size}, "
            f"pages={self.allocator.num_pages if self.allocator else 'lazy'}, seq_len={self.reserved})"
        )

    def attention_is_kvquant(self) -> bool:
        """Whether the model's active attention implementation is kvquant's."""
        return getattr(self.config, "_attn_implementation", None) == ATTN_NAME

    def check_patch_active(self) -> None:
        """Refuse to store tokens for a model whose kvquant patch (the one that built this cache) is gone.

        Raises:
            CacheUsageError: the patch was removed (``handle.remove()``) or
                replaced; nothing is written.
        """
        state = self.patch_state()
        handle = getattr(state, "handle", None)
        if handle is None or handle.active:
            return
        raise CacheUsageError(
            f"kvquant cache of {self.model_name}: it was built by a kvquant patch that has been "
            "removed (handle.remove()) or replaced, and the model would now store its K/V in "
            "these FP8 pages behind the back of its own attention. Nothing was written. Fix: "
            "pass a new cache (or none) to the unpatched model, or patch it again and use "
            "handle.new_cache()."
        )

    # ------------------------------------------------------------------ whole-cache ops

    def reset(self) -> None:
        """Forget every stored token and free all pages (the pools stay allocated)."""
        for layer in self.layers:
            layer.reset()
        self.book.reset()
        self.kv_start_memo = None
        self.decode_mask_memo = None
        self.first_visible_memo = None
        self.decode_graph = None

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: sequence ``b`` of every layer takes the tokens of sequence ``beam_idx[b]``.

        Args:
            beam_idx: integer ``[B]``, each in ``0..B-1``.

        Raises:
            CacheUsageError: ``beam_idx`` is not an integer tensor of ``B`` sequence
                indices in range (nothing moves).
        """
        if self.allocator is None:
            return  # nothing stored yet
        bsz = self.batch_size_
        ok = (
            isinstance(beam_idx, torch.Tensor)
            and not beam_idx.dtype.is_floating_point
            and beam_idx.dtype != torch.bool
            and tuple(beam_idx.shape) == (bsz,)
        )
        if ok and bsz:
            lo, hi = (int(v) for v in torch.aminmax(beam_idx))
            ok = 0 <= lo and hi < bsz
        if not ok:
            found = (
                f"{beam_idx.dtype} shape {tuple(beam_idx.shape)}"
                if isinstance(beam_idx, torch.Tensor)
                else type(beam_idx).__name__
            )
            raise CacheUsageError(
                f"kvquant cache of {self.model_name}: reorder_cache(beam_idx) got {found}; "
                f"expected an integer tensor [{bsz}] of sequence indices in 0..{bsz - 1}. Nothing "
                "moved."
            )
        for layer in self.layers:
            layer.reorder_cache(beam_idx)  # type: ignore[arg-type]  # any integer tensor

    def crop(self, max_length: int | torch.Tensor) -> None:
        """Roll every layer back (speculative decoding drops rejected draft tokens).

        Follows the installed transformers' ``DynamicCache.crop``: a negative
        ``n`` removes the newest ``-n`` positions, 0 does nothing, and a
        positive ``n`` keeps the first ``n`` on transformers 5.17 (deprecated
        there; no-op when the cache holds no more) and is refused from 5.18 on,
        as ``DynamicCache.crop`` refuses it. One difference: removing more
        positions than the cache holds is refused here (``DynamicCache``
        silently empties itself), since no generation mode asks for it.

        Args:
            max_length: the count, an int or a one-element integer tensor (as
                transformers 5.17 passes it).

        Raises:
            CacheUsageError: ``max_length`` is not an int, is positive on
                transformers >= 5.18, or would remove more positions than the
                cache holds (nothing changes).
        """
        if (
            isinstance(max_length, torch.Tensor)
            and max_length.numel() == 1
            and not max_length.dtype.is_floating_point
            and max_length.dtype != torch.bool
        ):
            max_length = int(max_length)  # transformers 5.17 passes a 0-d tensor
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise CacheUsageError(
                f"kvquant cache of {self.model_name}: crop({max_length!r}); expected an int "
                "(-n removes the newest n positions)."
            )
        have = self.get_seq_length()
        if max_length > 0 and not POSITIVE_CROP_KEEPS:
            raise CacheUsageError(
                f"kvquant cache of {self.model_name}: crop({max_length}) with a positive value; "
                f"transformers {transformers.__version__}'s DynamicCache.crop refuses it too (it "
                "meant 'keep the first n' before 5.18). Nothing changed. Fix: pass -n to remove "
                f"the newest n positions (crop({max_length - have}) keeps {max_length} of {have})."
            )
        keep = have + max_length if max_length < 0 else (max_length if max_length else have)
        if keep < 0:
            raise CacheUsageError(
                f"kvquant cache of {self.model_name}: crop({max_length}) would remove "
                f"{-max_length} positions but the cache holds {have}. Nothing changed. Fix: "
                f"crop at most {have} positions."
            )
        self.truncate(min(keep, have))

    def truncate(self, tokens: int) -> None:
        """Keep the first ``tokens`` positions of every sequence in every layer; free the pages past them.

        Raises:
            CacheUsageError: ``tokens`` is negative or not an int (nothing changes).
        """
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise CacheUsageError(
                f"kvquant cache of {self.model_name}: truncate({tokens!r}); expected an int >= 0."
            )
        for layer in self.layers:
            if isinstance(layer, KVQuantLayer):
                layer.pending_first = None
                if layer.storage is not None:
                    layer.storage.truncate_first(tokens)
                    stored = layer.seq_len
                    if layer.storage.recent is not None and tokens < stored:
                        table = self.book.block_table(layer.storage.device)
                        layer.storage.truncate_recent(tokens, stored, table)
        self.book.truncate(tokens)  # a graph's static table is copied again if pages moved
        self.kv_start_memo = None
        self.decode_mask_memo = None
        self.first_visible_memo = None

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """-1: the cache has no fixed per-sequence length."""
        return -1

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of KV memory over all layers, for comparison with a bf16 ``DynamicCache``.

        The sum of :meth:`kvquant.cache.PagedLayerStorage.memory_bytes` over the
        layers that have allocated their pools: FP8 pages (the whole pool,
        written or not), fp32 group scales, the rings of the newest tokens
        (``recent_tokens``) and static scales.

        Returns:
            ``pages``, ``group_scales``, ``recent``, ``static_scales``, ``k_transform``,
            ``total``.
        """
        return total_memory_bytes(
            layer.storage
            for layer in self.layers
            if isinstance(layer, KVQuantLayer) and layer.storage is not None
        )
