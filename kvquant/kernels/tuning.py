"""Tuning heuristics of the paged-attention launcher: tile configuration, split-KV count.

Pure host-side arithmetic (no kernel here): :func:`choose_config` picks the tile of a
problem, :func:`choose_num_splits` the flash-decoding split count that fills the GPU,
:func:`programs_per_sm` the residency it assumes. The measurements behind the choices are in
the kernel work log (``docs/dev/kernels.md``, "Tuning choices").
"""

from __future__ import annotations

import functools

import torch
import triton

__all__ = ["choose_config", "choose_num_splits", "programs_per_sm", "register_cap"]

_FOLD_MAX_ROWS = 32

# The k-transform's query rotation ``q @ R``: where it happens, ``"kernel"`` (every attention
# program rotates its query tile) or ``"host"`` (one fp32 ``torch.matmul`` before the launch,
# the kernel then sees a query already in the pages' frame), and, in the kernel, the dot's
# ``input_precision``: ``"ieee"`` (fp32 on CUDA cores), ``"tf32x3"`` (three TF32 tensor-core
# products, about fp32 accurate) or ``"tf32"`` (one; its 10-bit mantissa is the fp16 query
# tile's the rotated query is cast to). The launcher's ``config=`` keys ``ROT_WHERE`` and
# ``ROT_PRECISION`` override them per call; ``benchmarks/bench_attention.py --kt-variants``
# times each choice beside per-head.
KT_ROT_WHERE = "kernel"
KT_ROT_PRECISION = "tf32"
KT_ROT_CHOICES = {"ROT_WHERE": ("kernel", "host"), "ROT_PRECISION": ("ieee", "tf32x3", "tf32")}

# The k-transform's fixed per-program latency before the key loop (short decode shapes,
# docs/dev/kernels.md "Query rotation choices"): rows of R per step of the in-kernel
# rotation (``ROT_SLICE``) and the software-pipelining depth of that loop (``ROT_STAGES``, 1 =
# each step waits for its own loads); ``EARLY_LOADS`` issues the transform's independent loads
# (scales, offset, ``first_lens``, the first token's key and value) at the start of the
# program, before the rotation; ``FIRST_SPLIT`` is the split-KV program that attends the
# first tokens (``"first"`` or ``"last"``, the last's key range being the shortest when the
# tiles do not divide evenly), or ``"merge"``: in decode the split merge attends them (their
# scores from the query rows split 0 stores in the pages' frame), so that no key-loop program
# carries them; prefill keeps them in split 0; ``ROT_KIND`` is how the kernel gets R's
# slices: loaded (``"matrix"``), or computed from their indices when R is
# ``kvquant.kernels.hadamard(D)`` (``"auto"``, compared once per tensor; the same result either
# way) or always (``"hadamard"``, any other R refused); ``REG_TRIM`` N > 0 caps the split decode kernel's registers where
# shedding at most N per thread fits one more program per SM (any format; 0 = never);
# ``SPLIT_FROM_END`` counts the split-KV shares back from the last tile, so that split 0
# (which holds the masked tile after the first visible key and attends the first tokens) gets
# the remainder, the shortest share (any format). The launcher's ``config=`` keys of the same
# names override them.
KT_ROT_KIND = "matrix"
KT_ROT_SLICE = 16
KT_ROT_STAGES = 1
KT_EARLY_LOADS = False
KT_FIRST_SPLIT = "first"
KT_REG_TRIM = 0
KT_SPLIT_FROM_END = False
KT_LATENCY_CHOICES: dict[str, tuple[object, ...]] = {
    "ROT_KIND": ("matrix", "auto", "hadamard"),
    "ROT_SLICE": (16, 32, 64),
    "ROT_STAGES": (1, 2, 3),
    "EARLY_LOADS": (False, True),
    "FIRST_SPLIT": ("first", "last", "merge"),
    "REG_TRIM": (0, 8, 16, 24, 32),
    "SPLIT_FROM_END": (False, True),
}

_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    """Multiprocessor count of a CUDA device (cached); a small constant on CPU."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _is_decode(lq: int, group: int) -> bool:
    """Decode path (one query block, split-KV) when all rows of a KV head fit in 64."""
    return lq * group <= 64


def choose_config(
    lq: int, group: int, head_dim: int, *, group_dequant: bool = False, fold_groups: int = 0
) -> dict[str, int]:
    """Tile configuration for a problem: ``BLOCK_M``, ``QPB``, ``BLOCK_N``, warps, stages.

    Args:
        lq: query tokens per sequence (``Lq``).
        group: query heads per KV head.
        head_dim: ``D``.
        group_dequant: K/V tiles are multiplied by fp32 group scales element-wise (group
            scales the kernel does not fold).
        fold_groups: fp32 group scales per head folded into the scores and probabilities
            (decode; the tile holds that many copies of each query row), or 0.

    Returns:
        A dict with keys ``BLOCK_M``, ``QPB``, ``BLOCK_N``, ``num_warps``, ``num_stages`` and
        ``LOOP_STAGES`` (software-pipelining depth of the key loop).
    """
    if _is_decode(lq, group):
        block_m = max(16, triton.next_power_of_2(lq * group) * max(1, fold_groups))
        # The key loop's loads are indirect (block table) and feed dots: Triton gives them
        # LOOP_STAGES - 3 prefetch buffers; the register-heavy dequantizing variants keep none.
        if head_dim > 128:
            block_n, warps, loop_stages = 32, 4, 3 if group_dequant else 5
        else:
            # 64-key tiles on 2 warps beat 128-key tiles on 4 (docs/dev/kernels.md, tuning)
            block_n, warps, loop_stages = 64, 2, 3 if group_dequant else 6
        return {
            "BLOCK_M": block_m,
            "QPB": lq,
            "BLOCK_N": block_n,
            "num_warps": warps,
            "num_stages": 3,
            "LOOP_STAGES": loop_stages,
        }
    # static scales: 64-key tiles; at head_dim 128, 256-row tiles on 8 warps where there are
    # rows for several of them (128 rows on 4 warps otherwise, and at head_dim 64, where the
    # 256-row tiles were slower); dequantized group scales: 128-key tiles and 8 warps (sweeps
    # with V pages keys-fastest: docs/dev/kernels.md, tuning)
    if head_dim > 128:
        block_m, block_n, warps, loop_stages = 64, 64, 4, 2
    elif group_dequant:
        block_m, block_n, warps, loop_stages = 128, 128, 8, 3
    elif head_dim > 64 and lq * group >= 4 * 256:
        block_m, block_n, warps, loop_stages = 256, 64, 8, 3
    else:
        block_m, block_n, warps, loop_stages = 128, 64, 4, 3
    return {
        "BLOCK_M": block_m,
        "QPB": max(1, block_m // group),
        "BLOCK_N": block_n,
        "num_warps": warps,
        "num_stages": 2,
        "LOOP_STAGES": loop_stages,
    }


@functools.lru_cache(maxsize=1024)
def choose_num_splits(
    programs: int,
    max_keys: int,
    num_sms: int,
    *,
    programs_per_sm: int = 2,
    block_n: int = 128,
) -> int:
    """Split-KV count that fills the GPU in whole waves of whole, balanced tiles.

    With ``slots = programs_per_sm * num_sms`` resident programs and ``tiles =
    ceil(max_keys / block_n)`` key tiles per sequence, ``s`` splits have
    efficiency ``wave(s) * balance(s)``: ``wave(s) = programs * s / (ceil(programs * s /
    slots) * slots)`` (a partial wave costs as much as a full one) and ``balance(s) = tiles /
    (s * ceil(tiles / s))`` (the kernel gives each split ``ceil(tiles / s)`` whole tiles, so the
    longest split sets the time). The smallest ``s`` within 95 % of the best efficiency wins.
    With wave efficiency alone, B1 x 32k took 28 splits of 10 tiles where 32 splits of 8 do;
    and short contexts stayed unsplit (measurements: ``docs/dev/kernels.md``, tuning).

    Args:
        programs: programs without splitting (``B * Hkv * query blocks``).
        max_keys: upper bound of keys per sequence (block-table capacity).
        num_sms: multiprocessors of the device.
        programs_per_sm: programs of the kernel resident on one SM at once.
        block_n: keys per tile of the kernel.

    Returns:
        The number of splits, 1 to ``min(64, tiles)``.
    """
    slots = max(1, programs_per_sm) * num_sms
    tiles = max(1, triton.cdiv(max_keys, max(1, block_n)))
    cap = max(1, min(64, tiles))

    def efficiency(s: int) -> float:
        n = programs * s
        return n / (triton.cdiv(n, slots) * slots) * tiles / (s * triton.cdiv(tiles, s))

    best = max(efficiency(s) for s in range(1, cap + 1))
    return next(s for s in range(1, cap + 1) if efficiency(s) >= 0.95 * best)


def programs_per_sm(
    n_regs: int,
    num_warps: int,
    shared_bytes: int,
    *,
    regs_per_sm: int = 65536,
    shared_per_sm: int = 233472,
    threads_per_sm: int = 2048,
) -> int:
    """Programs of a kernel resident on one SM, limited by registers, shared memory and threads.

    Registers are allocated per warp in units of 256. Defaults: H100/H200 (sm_90).

    Args:
        n_regs: registers per thread of the compiled kernel.
        num_warps: warps per program.
        shared_bytes: shared memory per program.
        regs_per_sm: 32-bit registers per SM.
        shared_per_sm: shared memory per SM in bytes.
        threads_per_sm: resident threads per SM.

    Returns:
        At least 1.
    """
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = regs_per_sm // (regs_per_warp * num_warps)
    by_smem = shared_per_sm // shared_bytes if shared_bytes else by_regs
    by_threads = threads_per_sm // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads))


def register_cap(
    n_regs: int,
    num_warps: int,
    shared_bytes: int,
    trim: int,
    *,
    regs_per_sm: int = 65536,
    shared_per_sm: int = 233472,
    threads_per_sm: int = 2048,
) -> int | None:
    """A register cap (``maxnreg``) that fits one more program per SM, or None.

    The split decode kernel's residency is often set by its registers (9/3/64 k-transform:
    142 registers, 7 programs per SM, where per-head's 128 allow 8). When shedding at most
    ``trim`` registers per thread reaches the next residency, the launcher (config key
    ``REG_TRIM``) compiles the kernel with this cap (ptxas spills what does not fit) and the
    split count follows. Caps are multiples of 8 (registers are allocated per warp in units
    of 256).

    Args:
        n_regs: registers per thread of the uncapped kernel.
        num_warps: warps per program.
        shared_bytes: shared memory per program.
        trim: most registers per thread to shed.
        regs_per_sm: 32-bit registers per SM.
        shared_per_sm: shared memory per SM in bytes.
        threads_per_sm: resident threads per SM.

    Returns:
        The cap, or None where no cap within ``trim`` adds a program (shared memory or
        threads bind, or more registers would have to go).
    """
    limits = {
        "regs_per_sm": regs_per_sm,
        "shared_per_sm": shared_per_sm,
        "threads_per_sm": threads_per_sm,
    }
    res = programs_per_sm(n_regs, num_warps, shared_bytes, **limits)
    cap = regs_per_sm // ((res + 1) * num_warps) // 256 * 256 // 32
    if cap >= n_regs or n_regs - cap > trim:
        return None
    if programs_per_sm(cap, num_warps, shared_bytes, **limits) <= res:
        return None
    return cap
