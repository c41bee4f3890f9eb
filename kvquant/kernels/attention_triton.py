"""Launcher of the paged-attention Triton kernels (decode and prefill/extend).

:func:`paged_attention_triton` picks the tile configuration and the split-KV count
(:mod:`kvquant.kernels.tuning`), measures the split kernel's residency once per signature,
and launches :mod:`kvquant.kernels.attention_jit`'s kernels, with programmatic dependent
launch on sm_90 and newer. The kernels' design is described in
:mod:`kvquant.kernels.attention_jit`.

The launcher does no argument validation: :mod:`kvquant.kernels` validates before
dispatching here (restrictions: see :mod:`kvquant.kernels.attention_jit`).
"""

from __future__ import annotations

import math
import os
import weakref
from typing import Any

import torch
import triton

from kvquant.errors import KernelInputError
from kvquant.kernels.attention_jit import _paged_attn_kernel, _reduce_first_kernel, _reduce_kernel
from kvquant.kernels.reference import hadamard
from kvquant.kernels.tuning import (
    _FOLD_MAX_ROWS,
    KT_EARLY_LOADS,
    KT_FIRST_SPLIT,
    KT_LATENCY_CHOICES,
    KT_REG_TRIM,
    KT_ROT_CHOICES,
    KT_ROT_KIND,
    KT_ROT_PRECISION,
    KT_ROT_SLICE,
    KT_ROT_STAGES,
    KT_ROT_WHERE,
    KT_SPLIT_FROM_END,
    _is_decode,
    _num_sms,
    choose_config,
    choose_num_splits,
    programs_per_sm,
    register_cap,
)

__all__ = ["is_interpreted", "paged_attention_triton"]

# Triton reads TRITON_INTERPRET when the kernels are decorated: fixed for this process.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def is_interpreted() -> bool:
    """Whether the attention kernels run in the Triton interpreter (``TRITON_INTERPRET=1``)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_paged_attn_kernel, InterpretedFunction)


_PDL: dict[int, bool] = {}


def _supports_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: NVIDIA devices of compute capability 9.0 and newer (cached)."""
    if _INTERPRETED or device.type != "cuda" or torch.version.hip is not None:
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PDL:
        _PDL[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _PDL[idx]


_KERNEL_USE: dict[tuple[Any, ...], tuple[int, int, int]] = {}

# k_rotation tensors compared with hadamard(D): id -> (weak reference, tensor version when
# compared, largest difference)
_HADAMARD_SEEN: dict[int, tuple[weakref.ref[torch.Tensor], int, float]] = {}
_HADAMARD_TOL = 1e-6


def _hadamard_diff(rotation: torch.Tensor) -> float | None:
    """Largest ``|R - hadamard(D)|``, computed once per tensor and version (memoised).

    An in-place change of the tensor bumps its version and compares again. An inference
    tensor (made under ``torch.inference_mode``) has no version counter: it is compared at
    every call. The comparison synchronises, so a tensor not yet compared inside a CUDA graph
    capture is not compared: None.
    """
    inference = rotation.is_inference()
    seen = _HADAMARD_SEEN.get(id(rotation))
    if (
        not inference
        and seen is not None
        and seen[0]() is rotation
        and seen[1] == rotation._version
    ):
        return seen[2]
    if rotation.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    diff = float((rotation - hadamard(rotation.shape[-1], device=rotation.device)).abs().max())
    if not inference:
        key = id(rotation)
        ref = weakref.ref(rotation, lambda _: _HADAMARD_SEEN.pop(key, None))
        _HADAMARD_SEEN[key] = (ref, rotation._version, diff)
    return diff


def _rotation_is_hadamard(rotation: torch.Tensor, kind: str) -> bool:
    """Whether the kernel computes R's slices (``ROT_KIND``) instead of loading them.

    ``"matrix"``: never. ``"auto"``: when R is ``hadamard(D)`` (within 1e-6; the same result
    either way, so a tensor first seen inside a graph capture takes the products with R).
    ``"hadamard"``: always; the kernel then never reads R, so any other R is refused.
    """
    if kind == "matrix":
        return False
    diff = _hadamard_diff(rotation)
    if kind == "auto":
        return diff is not None and diff <= _HADAMARD_TOL
    d = rotation.shape[-1]
    if diff is None:
        raise KernelInputError(
            "paged_attention_triton: config['ROT_KIND'] is 'hadamard' and this k_rotation "
            "tensor is first seen inside a CUDA graph capture, where it cannot be checked; "
            "fix: call once with it before capturing, or use ROT_KIND 'auto'"
        )
    if not diff <= _HADAMARD_TOL:
        raise KernelInputError(
            f"paged_attention_triton: config['ROT_KIND'] is 'hadamard' but k_rotation differs "
            f"from kvquant.kernels.hadamard({d}) by up to {diff:.3g} (expected <= "
            f"{_HADAMARD_TOL:g}); fix: pass k_rotation=hadamard({d}), or use ROT_KIND 'auto' "
            "or 'matrix' (products with R)"
        )
    return True


def _device_limits(device: torch.device) -> dict[str, int]:
    """Registers, shared memory and threads per SM (keywords of :func:`programs_per_sm`)."""
    props = torch.cuda.get_device_properties(device)
    return {
        "regs_per_sm": int(getattr(props, "regs_per_multiprocessor", 65536)),
        "shared_per_sm": int(getattr(props, "shared_memory_per_multiprocessor", 233472)),
        "threads_per_sm": int(getattr(props, "max_threads_per_multi_processor", 2048)),
    }


def _split_kernel_use(
    args: list[Any], consts: dict[str, Any], device: torch.device
) -> tuple[int, int, int]:
    """Registers per thread, warps and shared memory of the split decode kernel (memoised).

    The first call of a signature compiles the kernel (``warmup``, no launch).
    """
    dtypes = tuple(a.dtype if isinstance(a, torch.Tensor) else None for a in args[:14])
    if consts["HAS_FIRST"]:  # the first-token buffers' dtypes (args[-5:-3]) compile apart too
        dtypes += (args[-5].dtype, args[-4].dtype)
    key: tuple[Any, ...] = (device, dtypes, *sorted(consts.items()))
    use = _KERNEL_USE.get(key)
    if use is None:
        kernel = _paged_attn_kernel.warmup(*args, grid=(1,), **{**consts, "SPLIT": True})
        _ = kernel.run  # loads the binary, which sets n_regs (Triton loads kernels lazily)
        use = _KERNEL_USE[key] = (
            int(kernel.n_regs), int(kernel.metadata.num_warps), int(kernel.metadata.shared)
        )  # fmt: skip
    return use


def _decode_residency(args: list[Any], consts: dict[str, Any], device: torch.device) -> int:
    """Resident programs per SM of the split decode kernel for this launch.

    From its compiled register and shared-memory use; the interpreter (CPU) assumes 2.
    """
    if _INTERPRETED or device.type != "cuda":
        return 2
    return programs_per_sm(*_split_kernel_use(args, consts, device), **_device_limits(device))


def _register_cap(
    args: list[Any], consts: dict[str, Any], device: torch.device, trim: int
) -> int | None:
    """``REG_TRIM``: :func:`kvquant.kernels.tuning.register_cap` of the split decode kernel."""
    if trim <= 0 or _INTERPRETED or device.type != "cuda":
        return None
    return register_cap(*_split_kernel_use(args, consts, device), trim, **_device_limits(device))


def paged_attention_triton(
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
    num_splits: int | None = None,
    config: dict[str, Any] | None = None,
    k_offset: torch.Tensor | None = None,
    k_rotation: torch.Tensor | None = None,
    first_k: torch.Tensor | None = None,
    first_v: torch.Tensor | None = None,
    first_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of new query tokens over the paged FP8 cache (Triton); no validation.

    Semantics are those of
    :func:`kvquant.kernels.reference.paged_attention_reference`.

    Args:
        query: ``[B, Lq, Hq, D]`` fp16, bf16 or fp32, any strides.
        k_pages: ``[num_pages, page_size, Hkv, D]`` FP8, any strides (fastest with the head
            dim contiguous).
        v_pages: ``[num_pages, page_size, Hkv, D]`` FP8, any strides (fastest with keys
            contiguous within a page: :func:`kvquant.kernels.page_storage`).
        block_tables: int32 ``[B, max_pages]``, last dimension contiguous.
        seq_lens: int32 ``[B]`` tokens in the cache, the ``Lq`` new ones included.
        sm_scale: softmax scale applied to ``q·k``.
        k_scale: fp32 ``[]`` or ``[Hkv]`` static scale, or None with group scales.
        v_scale: fp32 ``[]`` or ``[Hkv]`` static scale, or None with group scales.
        k_group_scales: fp32 ``[num_pages, page_size, Hkv, D // G]`` or None.
        v_group_scales: fp32 ``[num_pages, page_size, Hkv, D // G]`` or None.
        q_lens: int32 ``[B]`` valid query tokens per sequence, or None (all ``Lq``).
        kv_start: int32 ``[B]`` first visible key per sequence, or None (0).
        causal: mask keys after each query's position.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
        window: if > 0, a query sees only the last ``window`` positions up to itself.
        out: optional ``[B, Lq, Hq, D]`` output in the query dtype (any strides).
        sinks: fp32 ``[Hq]`` contiguous attention-sink logits, or None.
        num_splits: split-KV count override for the decode path (tests, tuning).
        config: tile configuration override (keys of :func:`choose_config`; ``USE_WHILE``
            forces while-loops on or off, default on in the interpreter; ``FOLD`` forces the
            folding of group scales in decode on or off; ``PDL`` 0 turns programmatic
            dependent launches off; with ``k_rotation``, ``ROT_WHERE`` ``"kernel"`` |
            ``"host"`` and ``ROT_PRECISION`` ``"ieee"`` | ``"tf32x3"`` | ``"tf32"`` choose how
            the query is rotated: :data:`kvquant.kernels.tuning.KT_ROT_WHERE`; with a K
            transform, ``ROT_KIND`` ``"matrix"`` | ``"auto"`` | ``"hadamard"`` (R's slices
            loaded, computed when R is ``hadamard(D)``, or always computed: R must then be
            ``hadamard(D)``; compared once per tensor), ``ROT_SLICE`` 16 | 32 | 64 (capped at
            ``D``), ``ROT_STAGES`` 1 | 2 | 3,
            ``EARLY_LOADS`` and ``FIRST_SPLIT`` ``"first"`` | ``"last"`` | ``"merge"`` (the
            split merge attends the first tokens, in decode, also unsplit) order its
            per-program work: :data:`kvquant.kernels.tuning.KT_ROT_SLICE`; any format:
            ``REG_TRIM`` 0 | 8 | 16 | 24 | 32 caps the split decode kernel's registers where
            that fits one more program per SM, :func:`kvquant.kernels.tuning.register_cap`;
            ``SPLIT_FROM_END`` gives split 0 the remainder of the key tiles).
        k_offset: fp32 ``[Hkv, D]`` contiguous K offset (static scales only), or None.
        k_rotation: fp32 ``[D, D]`` contiguous K rotation (static scales only), or None.
        first_k: ``[B, NF, Hkv, D]`` contiguous first-token keys (rotated frame), or None.
        first_v: ``[B, NF, Hkv, D]`` contiguous first-token values, or None.
        first_lens: int32 ``[B]`` first tokens per sequence (with ``first_k``/``first_v``).

    Returns:
        ``[B, Lq, Hq, D]`` in the query dtype (``out`` when given).
    """
    bsz, lq, hq, d = query.shape
    page_size, hkv = k_pages.shape[1], k_pages.shape[2]
    group = hq // hkv
    if out is None:
        out = torch.empty(bsz, lq, hq, d, dtype=query.dtype, device=query.device)
    if bsz == 0 or lq == 0:
        return out

    kt: dict[str, Any] = {
        "ROT_KIND": KT_ROT_KIND,
        "ROT_WHERE": KT_ROT_WHERE,
        "ROT_PRECISION": KT_ROT_PRECISION,
        "ROT_SLICE": KT_ROT_SLICE,
        "ROT_STAGES": KT_ROT_STAGES,
        "EARLY_LOADS": KT_EARLY_LOADS,
        "FIRST_SPLIT": KT_FIRST_SPLIT,
        "REG_TRIM": KT_REG_TRIM,
        "SPLIT_FROM_END": KT_SPLIT_FROM_END,
    }
    if config:
        for key, choices in (*KT_ROT_CHOICES.items(), *KT_LATENCY_CHOICES.items()):
            value = config.get(key, kt[key])
            if value not in choices or isinstance(value, bool) != isinstance(choices[0], bool):
                raise KernelInputError(
                    f"paged_attention_triton: config[{key!r}] is {value!r}, expected one of "
                    f"{choices}; fix: pass one of them or leave the key out"
                )
            kt[key] = value
    rot_where, rot_prec = kt["ROT_WHERE"], kt["ROT_PRECISION"]
    if k_rotation is not None and rot_where == "host":
        # one fp32 matmul for every (token, head) instead of one rotation per program (the
        # split decode kernel has several programs per (sequence, KV head)); the kernel reads
        # the rotated fp32 query like any query
        query = torch.matmul(query.to(torch.float32), k_rotation)
        k_rotation = None
    rot_hadamard = k_rotation is not None and _rotation_is_hadamard(k_rotation, kt["ROT_KIND"])
    group_scales = k_group_scales is not None and v_group_scales is not None
    ng = k_group_scales.shape[-1] if k_group_scales is not None else 1
    # Decode folds group scales into the scores and probabilities (no per-element multiply,
    # no range limit) while the tile's row copies stay within _FOLD_MAX_ROWS (timings:
    # docs/performance.md).
    if config and "FOLD" in config:
        fold_wanted = bool(config["FOLD"])
    else:
        fold_wanted = triton.next_power_of_2(lq * group) * ng <= _FOLD_MAX_ROWS
    fold = group_scales and _is_decode(lq, group) and fold_wanted
    pdl = _supports_pdl(query.device)
    if config and "PDL" in config:
        pdl = pdl and bool(config["PDL"])
    cfg = choose_config(
        lq, group, d, group_dequant=group_scales and not fold, fold_groups=ng if fold else 0
    )
    if config:
        launch_keys = ("FOLD", "PDL", *KT_ROT_CHOICES, *KT_LATENCY_CHOICES)
        cfg.update({k: v for k, v in config.items() if k not in launch_keys})
    qpb = int(cfg["QPB"])
    n_qblocks = triton.cdiv(lq, qpb)

    dummy = seq_lens  # placeholder pointer for absent optional tensors (never read)
    kg: torch.Tensor = dummy
    vg: torch.Tensor = dummy
    ks_t: torch.Tensor = dummy
    vs_t: torch.Tensor = dummy
    s_ks, s_vs = 0, 0
    kg_strides: tuple[int, ...] = (0, 0, 0)
    vg_strides: tuple[int, ...] = (0, 0, 0)
    if k_group_scales is not None and v_group_scales is not None:
        kg, vg = k_group_scales, v_group_scales
        kg_strides = (kg.stride(0), kg.stride(1), kg.stride(2))
        vg_strides = (vg.stride(0), vg.stride(1), vg.stride(2))
    elif k_scale is not None and v_scale is not None:
        ks_t, vs_t = k_scale, v_scale
        s_ks = k_scale.stride(0) if k_scale.dim() else 0
        s_vs = v_scale.stride(0) if v_scale.dim() else 0

    # arguments after the pointers out, part, lse (args[11:14]) and num_splits (args[20])
    args: list[Any] = [
        query, k_pages, v_pages, block_tables, seq_lens,
        q_lens if q_lens is not None else dummy,
        kv_start if kv_start is not None else dummy,
        ks_t, vs_t, kg, vg, out, out, out,
        float(sm_scale), float(softcap) if softcap > 0 else 1.0, int(window),
        lq, hq, n_qblocks, 2,
        *query.stride(),
        *k_pages.stride(), *v_pages.stride(),
        block_tables.stride(0), s_ks, s_vs, *kg_strides, *vg_strides, *out.stride(),
        sinks if sinks is not None else dummy,
        k_rotation if k_rotation is not None else dummy,
        k_offset if k_offset is not None else dummy,
        first_k if first_k is not None else dummy,
        first_v if first_v is not None else dummy,
        first_lens if first_lens is not None else dummy,
        first_k.shape[1] if first_k is not None else 0,
        dummy,  # the rotated query rows for the split merge (FIRST_SPLIT "merge")
    ]  # fmt: skip
    tp = math.gcd(page_size, int(cfg["BLOCK_N"]))
    has_first = first_k is not None and first_v is not None and first_lens is not None
    # the K transform's options apply only with one (static scales: the validation refuses
    # a transform with group scales); the other formats compile to the code they had
    transform = not group_scales and (k_rotation is not None or k_offset is not None or has_first)
    consts: dict[str, Any] = {
        "HAS_QLEN": q_lens is not None,
        "HAS_START": kv_start is not None,
        "GROUP": group,
        "QPB": qpb,
        "BLOCK_M": int(cfg["BLOCK_M"]),
        "BLOCK_N": int(cfg["BLOCK_N"]),
        "HEAD_D": d,
        "PAGE": page_size,
        # keys per run of a tile that stays inside one page (tiles start at multiples of it)
        "TP": tp,
        # V stored keys-fastest with runs of whole pages: a run's [D, TP] block is contiguous
        "V_RUNS_DENSE": v_pages.stride(1) == 1 and v_pages.stride(3) == tp,
        # group scales stored head-major: a run's [TP, NG] scales are contiguous. Loaded so
        # where they fold (decode) or with one group per head (per-key loads were faster for
        # several groups per head in prefill: docs/dev/kernels.md, tuning)
        "SCALE_RUNS_DENSE": kg_strides[1] == ng and vg_strides[1] == ng and (fold or ng == 1),
        "GROUP_SCALES": group_scales,
        # one group per head: the scales fold into the scores and the probabilities
        "FOLD": fold,
        "NG": ng,
        "CAUSAL": bool(causal),
        "USE_SOFTCAP": softcap > 0,
        "USE_WINDOW": window > 0,
        "USE_WHILE": bool(cfg.get("USE_WHILE", _INTERPRETED)),
        "LOOP_STAGES": int(cfg.get("LOOP_STAGES", cfg["num_stages"])),
        "PDL": pdl,
        "HAS_SINKS": sinks is not None,
        "HAS_ROT": k_rotation is not None,
        "HAS_OFF": k_offset is not None,
        "HAS_FIRST": has_first,
        "ROT_PREC": rot_prec if k_rotation is not None else "ieee",
        "ROT_SLICE": min(int(kt["ROT_SLICE"]), d) if k_rotation is not None else 16,
        "ROT_STAGES": int(kt["ROT_STAGES"]) if k_rotation is not None else 1,
        "ROT_HADAMARD": rot_hadamard,
        "SPLIT_FROM_END": bool(kt["SPLIT_FROM_END"]),
        "EARLY_LOADS": bool(kt["EARLY_LOADS"]) and transform,
        "FIRST_SPLIT_LAST": kt["FIRST_SPLIT"] == "last" and has_first,
        # decode only: the split merge attends the first tokens (prefill keeps them in split 0)
        "FIRST_IN_MERGE": kt["FIRST_SPLIT"] == "merge" and has_first and n_qblocks == 1,
        "num_warps": int(cfg["num_warps"]),
        "num_stages": int(cfg["num_stages"]),
        "launch_pdl": pdl,
    }
    if kt["REG_TRIM"] and n_qblocks == 1:
        cap = _register_cap(args, consts, query.device, int(kt["REG_TRIM"]))
        if cap is not None:
            consts["maxnreg"] = cap
    if num_splits is None:
        num_splits = 1
        if n_qblocks == 1:  # decode: split the keys to fill the GPU
            num_splits = choose_num_splits(
                bsz * hkv,
                block_tables.shape[1] * page_size,
                _num_sms(query.device),
                programs_per_sm=_decode_residency(args, consts, query.device),
                block_n=int(cfg["BLOCK_N"]),
            )
    first_merge = bool(consts["FIRST_IN_MERGE"])
    split = num_splits > 1 or first_merge  # the merge attends the first tokens even unsplit
    if split:
        # one workspace: partial outputs [B, Lq, Hq, S, D], their log2-sum-exp [B, Lq, Hq, S],
        # then for the merge's first tokens the rotated query rows [B, Lq, Hq, D]
        rows = bsz * lq * hq * num_splits
        q_rows = bsz * lq * hq * d if first_merge and k_rotation is not None else 0
        work = torch.empty(rows * (d + 1) + q_rows, dtype=torch.float32, device=query.device)
        args[12], args[13] = work[: rows * d], work[rows * d : rows * (d + 1)]
        if q_rows:
            args[-1] = work[rows * (d + 1) :]
    args[20] = num_splits
    _paged_attn_kernel[(n_qblocks * num_splits, hkv, bsz)](*args, SPLIT=split, **consts)
    if split:
        # one-warp programs of 32 columns: the merge is latency-bound, and at B1 x 32k it had
        # only 32 programs (one per row); the graph table of bench_attention.py times it
        block_d = min(32, d)
        # the merge that attends the first tokens takes the query rows in the pages' frame
        # (the rotated rows split 0 stores, or the query: rotated on the host, or no rotation)
        # and their strides, first_k, first_v, first_lens, n_first_max, seq_lens, q_lens,
        # kv_start, sm_scale, softcap, window
        merge: Any = _reduce_kernel
        first_args: list[Any] = []
        first_consts: dict[str, Any] = {}
        if first_merge:
            merge = _reduce_first_kernel
            q_src = args[-1] if k_rotation is not None else query
            q_strides = (lq * hq * d, hq * d, d, 1) if k_rotation is not None else query.stride()
            first_args = [q_src, *q_strides, *args[-5:-1], *args[4:7], *args[14:17]]
            first_consts = {
                "FIRST_P2": max(2, triton.next_power_of_2(int(args[-2]))), "GROUP": group,
                "HAS_QLEN": q_lens is not None, "HAS_START": kv_start is not None,
                "CAUSAL": bool(causal), "USE_SOFTCAP": softcap > 0, "USE_WINDOW": window > 0,
            }  # fmt: skip
        merge[(bsz * lq * hq, d // block_d)](
            args[12],
            args[13],
            out,
            lq,
            hq,
            num_splits,
            *out.stride(),
            sinks if sinks is not None else dummy,
            *first_args,
            SPLITS_P2=max(2, triton.next_power_of_2(num_splits)),
            HEAD_D=d,
            BLOCK_D=block_d,
            PDL=pdl,
            HAS_SINKS=sinks is not None,
            **first_consts,
            num_warps=1,
            launch_pdl=pdl,
        )
    return out
