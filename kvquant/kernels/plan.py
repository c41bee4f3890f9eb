"""Plans of the kernel ops: validate and configure once per call geometry, then run.

As FlashInfer's plan/run: :func:`plan_attention` / :func:`plan_write` run the structural
checks (metadata only), resolve the backend, check the Triton kernel's limits and choose its
launch (tiles, constexprs, split count) for the arguments' geometry, and return a frozen
:class:`AttentionPlan` / :class:`WritePlan`; ``plan.run(...)`` checks that its arguments have
that geometry (their signature), runs the value checks and launches. :class:`PlanCache` keeps
the plans of a caller that makes many calls (a model's layers and steps: an attention plan
has no addresses in its signature, so all layers of one geometry share it).
:func:`kvquant.kernels.paged_attention` and :func:`kvquant.kernels.write_kv` plan and run.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import torch

from kvquant.errors import BackendError, KernelInputError
from kvquant.kernels.attention.naive import paged_attention_reference
from kvquant.kernels.attention.validate import (
    AttentionGeometry,
    attention_signature,
    check_attention_structure,
    check_attention_values,
)
from kvquant.kernels.backend import resolve_backend
from kvquant.kernels.validate import address, check_recent_write, signature
from kvquant.kernels.write.naive import write_kv_reference, write_recent_reference
from kvquant.kernels.write.validate import (
    WriteGeometry,
    check_write_structure,
    check_write_values,
    write_signature,
)
from kvquant.kernels.write_fp4.naive import write_fp4_reference
from kvquant.kernels.write_fp4.validate import (
    Fp4WriteGeometry,
    check_write_fp4_structure,
    check_write_fp4_values,
    write_fp4_signature,
)
from kvquant.schemes import CAUSAL, FirstTokens, Fp4Scales, Mask, Pages, RecentTokens, Scheme

if TYPE_CHECKING:
    from kvquant.kernels.attention.launch import AttentionLaunch

__all__ = ["AttentionPlan", "PlanCache", "WritePlan", "plan_attention", "plan_write"]

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


def _mismatch(op: str, builder: str) -> KernelInputError:
    return KernelInputError(
        f"{op}: the arguments differ from those the plan was built for (a shape, stride, "
        "dtype, device or option, or, for a write, the written tensors); expected arguments "
        f"of the plan's geometry. Fix: build a plan for them ({builder}, or a PlanCache, "
        "which finds or builds one)."
    )


# ------------------------------------------------------------------ attention


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """A validated :func:`~kvquant.kernels.paged_attention` geometry and its launch.

    Attributes:
        geometry: the sizes the structural checks read.
        backend: ``"triton"`` or ``"torch"`` (``"auto"`` resolved for the pages' device).
        signature: what the checks read from the arguments (None: the plan serves only the
            call it was built for, :meth:`run` refuses every call).
        launch: the Triton launch (tiles, constexprs, split count), or None (the torch
            backend, or an empty call).
    """

    geometry: AttentionGeometry
    backend: Literal["triton", "torch"]
    signature: tuple[object, ...] | None
    launch: AttentionLaunch | None = None

    def run(
        self,
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
        recent: RecentTokens | None = None,
    ) -> torch.Tensor:
        """:func:`~kvquant.kernels.paged_attention` of arguments of the plan's geometry.

        Raises:
            KernelInputError: the arguments' signature is not the plan's, or a value check
                failed (lengths, page ids, sinks).
        """
        sig = attention_signature(
            query, pages, block_tables, seq_lens, scheme, sm_scale=sm_scale, mask=mask,
            first=first, out=out, recent=recent,
        )  # fmt: skip
        if sig is None or sig != self.signature:
            raise _mismatch("paged_attention", "plan_attention")
        return self.execute(
            query, pages, block_tables, seq_lens, scheme, sm_scale, mask, first, out, recent
        )

    def execute(
        self,
        query: torch.Tensor,
        pages: Pages,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scheme: Scheme,
        sm_scale: float,
        mask: Mask,
        first: FirstTokens | None,
        out: torch.Tensor | None,
        recent: RecentTokens | None = None,
    ) -> torch.Tensor:
        """:meth:`run` for arguments known to have the plan's signature (value checks, launch)."""
        check_attention_values(pages, block_tables, seq_lens, mask, first, self.geometry)
        sm = float(sm_scale)
        if self.backend == "torch":
            return paged_attention_reference(
                query, pages, block_tables, seq_lens, scheme, sm_scale=sm, mask=mask,
                first=first, out=out, recent=recent,
            )  # fmt: skip
        return _triton_module("attention.launch").paged_attention_triton(  # type: ignore[no-any-return]
            query, pages, block_tables, seq_lens, scheme, sm_scale=sm, mask=mask, first=first,
            out=out, launch=self.launch, recent=recent,
        )  # fmt: skip


def _check_triton_attention_limits(
    geo: AttentionGeometry, block_tables: torch.Tensor, pages: Pages, scheme: Scheme,
    first: FirstTokens | None,
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
    for name, gs in (("k_group_scales", pages.k_scales), ("v_group_scales", pages.v_scales)):
        if gs is not None and gs.shape[-1] > 1 and gs.stride(-1) != 1:
            raise KernelInputError(
                f"paged_attention: {name} has strides {gs.stride()}; the Triton kernel needs "
                "its last dimension (the groups of one head) contiguous. Fix: allocate it with "
                "kvquant.kernels.group_scale_storage, or pass backend='torch'."
            )
    view = scheme.kernel_view()
    for side, kv, fmt in (("k_pages", pages.k, view.k_fp4), ("v_pages", pages.v, view.v_fp4)):
        if fmt is not None and (kv.data_ptr() % 4 or any(st % 4 for st in kv.stride()[:3])):
            raise KernelInputError(
                f"paged_attention: 4-bit {side} has strides {kv.stride()} at byte address "
                f"{kv.data_ptr()}; the Triton kernel reads its rows as int32 words, so the "
                "address and the strides but the last must be multiples of 4. Fix: allocate "
                "the pages with kvquant.kernels.fp4.fp4_page_storage, or pass backend='torch'."
            )
    for side, bs, fmt in (("k_block_scales", pages.k_scales, view.k_fp4),
                          ("v_block_scales", pages.v_scales, view.v_fp4)):  # fmt: skip
        if fmt is None or bs is None or fmt.block_size != 16:  # NVFP4 sides only
            continue
        row = bs.shape[-1]
        if bs.data_ptr() % row or any(st % row for st in bs.stride()[:3]):
            raise KernelInputError(
                f"paged_attention: NVFP4 {side} has strides {bs.stride()} at byte address "
                f"{bs.data_ptr()}; the Triton kernel reads each token's {row} block scales as "
                f"one load, so the address and the strides but the last must be multiples of "
                f"{row}. Fix: allocate the scales with kvquant.kernels.fp4.fp4_page_storage, or "
                "pass backend='torch'."
            )
    # the scheme's own tensors are contiguous copies (kvquant.schemes)
    for name, x in (("first_k", None if first is None else first.k),
                    ("first_v", None if first is None else first.v)):  # fmt: skip
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


def _build_attention(
    sig: tuple[object, ...] | None, query: torch.Tensor, pages: Pages, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scheme: Scheme, sm_scale: float, mask: Mask,
    first: FirstTokens | None, out: torch.Tensor | None, backend: str,
    recent: RecentTokens | None = None,
) -> AttentionPlan:  # fmt: skip
    geo = check_attention_structure(
        query, pages, block_tables, seq_lens, scheme, sm_scale=sm_scale, mask=mask,
        first=first, out=out, recent=recent,
    )  # fmt: skip
    chosen = resolve_backend(backend, pages.k.device, "paged_attention")
    launch = None
    if chosen == "triton":
        _check_triton_attention_limits(geo, block_tables, pages, scheme, first)
        mod = _triton_module("attention.launch")
        _require_interpreter_for_cpu(pages.k.device, mod.is_interpreted(), "paged_attention")
        if geo.batch and geo.q_len:
            launch = mod.attention_launch(
                query, pages, block_tables, seq_lens, scheme, sm_scale=float(sm_scale),
                mask=mask, first=first, out=out, recent=recent,
            )  # fmt: skip
    return AttentionPlan(geo, chosen, sig, launch)


def plan_attention(
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
) -> AttentionPlan:
    """Validate :func:`~kvquant.kernels.paged_attention` arguments' structure and plan the launch.

    The arguments are :func:`~kvquant.kernels.paged_attention`'s; the plan's :meth:`~AttentionPlan.run`
    takes any arguments of the same signature (the same shapes, strides, dtypes, devices and
    options; other values).

    Raises:
        KernelInputError: a malformed argument, or a limit of the Triton kernel.
        BackendError: the requested backend cannot run here.
    """
    sig = attention_signature(
        query, pages, block_tables, seq_lens, scheme, sm_scale=sm_scale, mask=mask,
        first=first, out=out, recent=recent,
    )  # fmt: skip
    return _build_attention(
        sig, query, pages, block_tables, seq_lens, scheme, sm_scale, mask, first, out, backend,
        recent,
    )  # fmt: skip


# ---------------------------------------------------------------------- write


@dataclass(frozen=True, eq=False)
class WritePlan:
    """A validated :func:`~kvquant.kernels.write_kv` geometry (FP8 or 4-bit pages).

    Attributes:
        geometry: the sizes the structural checks read.
        backend: ``"triton"`` or ``"torch"``.
        signature: what the checks read, with the addresses of the written tensors (a
            plan writes into one cache's tensors); None: :meth:`run` refuses every call.
        fp4: whether the scheme stores 4-bit pages (:mod:`kvquant.kernels.write_fp4`).
    """

    geometry: WriteGeometry | Fp4WriteGeometry
    backend: Literal["triton", "torch"]
    signature: tuple[object, ...] | None
    fp4: bool

    def run(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        pages: Pages,
        slot_mapping: torch.Tensor,
        scheme: Scheme,
        recent: RecentTokens | None = None,
        recent_start: torch.Tensor | None = None,
    ) -> None:
        """:func:`~kvquant.kernels.write_kv` of arguments of the plan's geometry.

        Raises:
            KernelInputError: the arguments' signature is not the plan's, or a slot beyond
                the cache (where values are checked); nothing is written then.
        """
        sig = _write_sig(key, value, pages, slot_mapping, scheme, recent, recent_start)
        if sig is None or sig != self.signature:
            raise _mismatch("write_kv", "plan_write")
        self.execute(key, value, pages, slot_mapping, scheme, recent, recent_start)

    def execute(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        pages: Pages,
        slot_mapping: torch.Tensor,
        scheme: Scheme,
        recent: RecentTokens | None = None,
        recent_start: torch.Tensor | None = None,
    ) -> None:
        """:meth:`run` for arguments known to have the plan's signature (slot check, launch).

        With ``recent`` the FP8 Triton kernel copies the tokens into the ring as it writes
        them; every other path writes the pages, then the ring (:func:`write_recent_reference`).
        """
        if self.fp4:
            check_write_fp4_values(pages, slot_mapping, self.geometry)  # type: ignore[arg-type]
        else:
            check_write_values(pages, slot_mapping, self.geometry)  # type: ignore[arg-type]
        if key.numel() == 0:
            return
        ring = None if recent is None or recent_start is None else (recent, recent_start)
        if self.backend == "torch":
            reference = write_fp4_reference if self.fp4 else write_kv_reference
            reference(key, value, pages, slot_mapping, scheme)
        elif self.fp4:
            _triton_module("write_fp4.launch").write_fp4_triton(
                key, value, pages, slot_mapping, scheme
            )
        else:
            _triton_module("write.launch").write_kv_triton(
                key, value, pages, slot_mapping, scheme, ring
            )
            return
        if ring is not None:
            write_recent_reference(key, value, scheme, *ring)


def _build_write(
    sig: tuple[object, ...] | None, key: torch.Tensor, value: torch.Tensor, pages: Pages,
    slot_mapping: torch.Tensor, scheme: Scheme, backend: str, recent: object = None,
    recent_start: object = None,
) -> WritePlan:  # fmt: skip
    fp4 = isinstance(scheme, Fp4Scales)
    op = "write_fp4" if fp4 else "write_kv"
    check = check_write_fp4_structure if fp4 else check_write_structure
    geo = check(key, value, pages, slot_mapping, scheme)
    written = [
        (name, x)
        for name, x in (("k_pages", pages.k), ("v_pages", pages.v), ("k_scales", pages.k_scales),
                        ("v_scales", pages.v_scales))
        if x is not None
    ]  # fmt: skip
    shape = (int(key.shape[0]), int(key.shape[1]), int(key.shape[2]), int(key.shape[3]))
    check_recent_write("write_kv", recent, recent_start, shape, pages.k.device, written)
    chosen = resolve_backend(backend, pages.k.device, op)
    if chosen == "triton":
        mod = _triton_module("write_fp4.launch" if fp4 else "write.launch")
        _require_interpreter_for_cpu(pages.k.device, mod.is_interpreted(), op)
    return WritePlan(geo, chosen, sig, fp4)


def _write_sig(
    key: object, value: object, pages: object, slot_mapping: object, scheme: object,
    recent: object = None, recent_start: object = None,
) -> tuple[object, ...] | None:  # fmt: skip
    sign = write_fp4_signature if isinstance(scheme, Fp4Scales) else write_signature
    sig = sign(key, value, pages, slot_mapping, scheme)
    if sig is None or (recent is None and recent_start is None):
        return sig
    ring = recent.kv if isinstance(recent, RecentTokens) else recent
    extra = signature(ring, recent_start)
    if extra is None:
        return None
    return (*sig, *extra, address(ring))


def plan_write(
    key: torch.Tensor,
    value: torch.Tensor,
    pages: Pages,
    slot_mapping: torch.Tensor,
    scheme: Scheme,
    *,
    backend: str = "auto",
    recent: RecentTokens | None = None,
    recent_start: torch.Tensor | None = None,
) -> WritePlan:
    """Validate :func:`~kvquant.kernels.write_kv` arguments' structure and plan the write.

    The plan's :meth:`~WritePlan.run` takes any arguments of the same signature, into the
    same page tensors (new K/V and slots each step), and the same ring if one is given.

    Raises:
        KernelInputError: a malformed argument.
        BackendError: the requested backend cannot run here.
    """
    sig = _write_sig(key, value, pages, slot_mapping, scheme, recent, recent_start)
    return _build_write(sig, key, value, pages, slot_mapping, scheme, backend, recent, recent_start)


# ---------------------------------------------------------------------- cache


class PlanCache:
    """The plans of recent call geometries, for a caller that makes many kernel calls.

    A model's cache keeps one for all its layers: a decode step's layers of one geometry
    share one attention plan (its signature holds no addresses); each layer keeps its write
    plan (whose signature holds its pages' addresses) across steps. A call whose signature
    no plan has builds one (every structural check); at ``max_plans`` plans of an op, that
    op's plans are dropped. Value checks run on every call.

    Args:
        max_plans: plans kept per op (attention, write).
    """

    def __init__(self, max_plans: int = 64) -> None:
        self.max_plans = max_plans
        self._attention: dict[tuple[object, ...], AttentionPlan] = {}
        self._write: dict[tuple[object, ...], WritePlan] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> PlanCache:
        """An empty cache (a copied model cache writes into pages of its own: new plans)."""
        return PlanCache(self.max_plans)

    def __len__(self) -> int:
        """Plans kept now (attention and write)."""
        return len(self._attention) + len(self._write)

    @property
    def num_attention_plans(self) -> int:
        """Attention plans kept now."""
        return len(self._attention)

    @property
    def num_write_plans(self) -> int:
        """Write plans kept now."""
        return len(self._write)

    def clear(self) -> None:
        """Drop every plan: the next calls build theirs (every structural check again)."""
        self._attention.clear()
        self._write.clear()

    def _find_or_build(
        self,
        plans: dict[tuple[object, ...], Any],
        sig: tuple[object, ...] | None,
        backend: str,
        build: Callable[[], Any],
    ) -> Any:
        """The plan kept for ``(sig, backend)``, or ``build()``'s (kept unless ``sig`` is None)."""
        key = None if sig is None else (sig, backend)
        plan = None if key is None else plans.get(key)
        if plan is None:
            plan = build()
            if key is not None:
                if len(plans) >= self.max_plans:
                    plans.clear()
                plans[key] = plan
        return plan

    def attention_plan(
        self,
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
    ) -> AttentionPlan:
        """The plan of these arguments' signature: a kept one, or a new one (then kept)."""
        sig = attention_signature(
            query, pages, block_tables, seq_lens, scheme, sm_scale=sm_scale, mask=mask,
            first=first, out=out, recent=recent,
        )  # fmt: skip
        return self._find_or_build(  # type: ignore[no-any-return]
            self._attention, sig, backend,
            lambda: _build_attention(
                sig, query, pages, block_tables, seq_lens, scheme, sm_scale, mask, first, out,
                backend, recent,
            ),
        )  # fmt: skip

    def paged_attention(
        self,
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
        """:func:`kvquant.kernels.paged_attention` through :meth:`attention_plan`."""
        plan = self.attention_plan(
            query, pages, block_tables, seq_lens, scheme, sm_scale=sm_scale, mask=mask,
            first=first, out=out, backend=backend, recent=recent,
        )  # fmt: skip
        return plan.execute(
            query, pages, block_tables, seq_lens, scheme, sm_scale, mask, first, out, recent
        )

    def write_plan(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        pages: Pages,
        slot_mapping: torch.Tensor,
        scheme: Scheme,
        *,
        backend: str = "auto",
        recent: RecentTokens | None = None,
        recent_start: torch.Tensor | None = None,
    ) -> WritePlan:
        """The plan of these arguments' signature: a kept one, or a new one (then kept)."""
        sig = _write_sig(key, value, pages, slot_mapping, scheme, recent, recent_start)
        return self._find_or_build(  # type: ignore[no-any-return]
            self._write, sig, backend,
            lambda: _build_write(
                sig, key, value, pages, slot_mapping, scheme, backend, recent, recent_start
            ),
        )  # fmt: skip

    def write_kv(
        self,
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
        """:func:`kvquant.kernels.write_kv` through :meth:`write_plan`."""
        plan = self.write_plan(
            key, value, pages, slot_mapping, scheme, backend=backend, recent=recent,
            recent_start=recent_start,
        )  # fmt: skip
        plan.execute(key, value, pages, slot_mapping, scheme, recent, recent_start)
