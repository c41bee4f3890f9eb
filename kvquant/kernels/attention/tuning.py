"""Tuning heuristics of the paged-attention launcher: tile configuration, split-KV count.

Pure host-side arithmetic (no kernel here): :func:`choose_config` picks the :class:`Tiles` of
a problem, :func:`choose_num_splits` the flash-decoding split count that fills the GPU,
:func:`programs_per_sm` the residency it assumes. The measurements behind the choices are in
the kernel work log (``docs/dev/kernels.md``, "Tuning choices").
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import torch
import triton

__all__ = ["Tiles", "choose_config", "choose_num_splits", "programs_per_sm"]

FOLD_MAX_ROWS = 32

MAX_SPLIT_WAVES = 2
"""The most waves of resident programs a split count may make (:func:`choose_num_splits`)."""


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile configuration of one attention launch.

    Attributes:
        BLOCK_M: query rows per program (query tokens x heads of a KV head).
        QPB: query tokens per program.
        BLOCK_N: keys per tile.
        num_warps: warps per program.
        num_stages: Triton's pipelining stages of the kernel.
        LOOP_STAGES: software-pipelining depth of the unmasked key loop.
    """

    BLOCK_M: int
    QPB: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    LOOP_STAGES: int

    def replace(self, overrides: Mapping[str, object]) -> Tiles:
        """These tiles with the fields ``overrides`` names (other keys are ignored)."""
        names = {f.name for f in dataclasses.fields(self)}
        return dataclasses.replace(
            self,
            **{k: int(v) for k, v in overrides.items() if k in names},  # type: ignore[call-overload]
        )


_SM_COUNT: dict[int, int] = {}


def device_sm_count(device: torch.device) -> int:
    """Multiprocessor count of a CUDA device (cached); a small constant on CPU."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def is_decode(lq: int, group: int) -> bool:
    """Decode path (one query block, split-KV) when all rows of a KV head fit in 64."""
    return lq * group <= 64


def choose_config(
    lq: int,
    group: int,
    head_dim: int,
    *,
    group_dequant: bool = False,
    fold_groups: int = 0,
    fp4: tuple[int, int] = (0, 0),
) -> Tiles:
    """Tile configuration for a problem: ``BLOCK_M``, ``QPB``, ``BLOCK_N``, warps, stages.

    Args:
        lq: query tokens per sequence (``Lq``).
        group: query heads per KV head.
        head_dim: ``D``.
        group_dequant: K/V tiles are multiplied by fp32 group scales element-wise (group
            scales the kernel does not fold).
        fold_groups: fp32 group scales per head folded into the scores and probabilities
            (decode; the tile holds that many copies of each query row), or 0.
        fp4: the K and V sides' 4-bit codes (0 FP8, 1 NVFP4, 2 MXFP4).

    Returns:
        The :class:`Tiles`.
    """
    if is_decode(lq, group):
        block_m = max(16, triton.next_power_of_2(lq * group) * max(1, fold_groups))
        # The key loop's loads are indirect (block table) and feed dots: Triton gives them
        # LOOP_STAGES - 3 prefetch buffers; the register-heavy dequantizing variants keep none.
        if head_dim > 128:
            block_n, warps, loop_stages = 32, 4, 3 if group_dequant else 5
        elif any(fp4) and fp4 != (1, 1):
            # MXFP4 or FP8 K beside 4-bit V: 32-key tiles on one warp beat the 64-key tiles
            # on 2 (NVFP4 on both sides: the reverse; docs/dev/fp4-formats.md, decode cost)
            block_n, warps, loop_stages = 32, 1, 6
        else:
            # 64-key tiles on 2 warps beat 128-key tiles on 4 (docs/dev/kernels.md, tuning)
            block_n, warps, loop_stages = 64, 2, 3 if group_dequant else 6
        return Tiles(block_m, lq, block_n, warps, 3, loop_stages)
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
    return Tiles(block_m, max(1, block_m // group), block_n, warps, 2, loop_stages)


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
    longest split sets the time). The smallest ``s`` within 95 % of the best efficiency wins,
    among the counts that make at most :data:`MAX_SPLIT_WAVES` waves (else the most efficient
    of those). With wave efficiency alone, B1 x 32k took 28 splits of 10 tiles where 32 splits
    of 8 do; and short contexts stayed unsplit (measurements: ``docs/dev/kernels.md``, tuning).
    Without the wave bound, where many programs fill the GPU already, a large count that
    happens to fill its last wave exactly (B64 x 8 KV heads at 6 programs per SM: 17 to 43
    splits of one or two tiles, 8,704 and more programs) beat every small one, and the count
    jumped with the table's width; but every program pays the kernel's prologue and the merge reads every split, and a
    memory-bound program of a partial wave streams faster than a full wave's.

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
    top = max(1, min(64, tiles))
    cap = max(1, min(top, MAX_SPLIT_WAVES * slots // max(1, programs)))

    def efficiency(s: int) -> float:
        n = programs * s
        return n / (triton.cdiv(n, slots) * slots) * tiles / (s * triton.cdiv(tiles, s))

    best = max(efficiency(s) for s in range(1, top + 1))
    within = [efficiency(s) for s in range(1, cap + 1)]
    good = [s for s, e in enumerate(within, 1) if e >= 0.95 * best]
    return good[0] if good else within.index(max(within)) + 1


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
