"""Resources of the decode kernel compiled for sm_90 offline (no GPU needed).

Compiles ``paged_attn_kernel`` ahead of time for a Hopper target with the
specializations Triton's JIT applies at launch (16-byte aligned pointers, strides
divisible by 16, unit strides as constants) for a B32 x 16k decode, and prints per
variant: registers per thread, stack bytes (register spills), shared memory, the
number of asynchronous global-to-shared copies in the IR (software-pipelined loads),
counts of a few PTX instructions, and the SASS instructions of each key loop (one
iteration = one tile; the decode kernel is issue-bound, so this is its cost per tile).
Use it to see what a tile configuration or a kernel change does to register pressure,
pipelining and instruction count before spending GPU time.

The 4-bit formats (``nvfp4``, ``mxfp4``, ``fp8-k-nvfp4-v``) compile with their packed pages
and uint8 block scales token-major, as ``kvquant.kernels.fp4.fp4_page_storage`` allocates them.

Usage (must run without ``TRITON_INTERPRET``)::

    python3 benchmarks/kernel_resources.py                 # default variants
    python3 benchmarks/kernel_resources.py --variant 64,2,6 --variant 64,2,6,group64
    python3 benchmarks/kernel_resources.py --variant 64,2,6,nvfp4 --variant 64,2,6,mxfp4
    python3 benchmarks/kernel_resources.py --shape 32,8,64 --variant 64,2,6,group64 \
        --splits-at 64x2048,64x3088

``--splits-at BxKEYS,...`` adds the split count the launcher would choose on an H200 (132
SMs) for ``B`` sequences and a block table of ``KEYS`` key slots: ``choose_num_splits`` with
the residency ``programs_per_sm`` gives for the compiled registers and shared memory.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvquant.kernels import specialize
from kvquant.kernels.attention import kernel as at
from kvquant.kernels.attention.tuning import choose_num_splits, programs_per_sm

PTX_OPS = ("ld.shared.b8", "ldmatrix", "cp.async.cg", "cp.async.ca", "mma.sync", "griddepcontrol")
FORMATS = {"per-tensor": (False, 1), "group64": (True, 2), "group128": (True, 1)}
# the k-transform format: per-head scales with (HAS_ROT, HAS_OFF, HAS_FIRST); "per-head-kt" is
# the full format (Hadamard rotation, offset, first tokens)
TRANSFORM_FORMATS = {
    "per-head-kt": (True, True, True),
    "per-head-kt-host": (False, True, True),  # offset and first tokens only
    "per-head-kt-rot": (True, False, False),
    "per-head-kt-off": (False, True, False),
    "per-head-kt-first": (False, False, True),
}
# 4-bit formats: (K_FP4, V_FP4), 0 FP8, 1 NVFP4, 2 MXFP4 (per-tensor static scales otherwise)
FP4_FORMATS = {"nvfp4": (1, 1), "mxfp4": (2, 2), "fp8-k-nvfp4-v": (0, 1)}
DEFAULT_VARIANTS = ["64,2,6", "64,2,6,group64", "64,2,6,group128", "128,4,5", "64,2,9"]
H200_SMS = 132


def _compile_sm90(
    fn: Any, pointers: dict[str, str], consts: dict[str, Any], values: dict[str, int],
    options: dict[str, Any],
) -> Any:  # fmt: skip
    """``triton.compile`` of ``fn`` for sm_90 without a GPU: the signature as the launcher's
    call would specialise it (pointers 16-byte aligned, ints equal to 1 constant, multiples of
    16 marked divisible, except where the kernel declares otherwise:
    :data:`kvquant.kernels.specialize.OPTIONS`)."""
    names = list(fn.arg_names)
    consts = dict(consts)
    declared = specialize.OPTIONS.get(fn.__name__, {})
    plain = set(declared.get("do_not_specialize", ()))
    unaligned = set(declared.get("do_not_specialize_on_alignment", ()))
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    constexprs: dict[tuple[int, ...], Any] = {}

    def integer(path: tuple[int, ...], name: str, value: int | None) -> str:
        if value == 1 and name not in plain:
            constexprs[path] = 1
            return "constexpr"
        if value and value % 16 == 0 and name not in unaligned:
            attrs[path] = [["tt.divisibility", 16]]
        return "i32"

    for i, name in enumerate(names):
        value = values.get(name)
        if name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in consts:
            signature[name] = "constexpr"
            constexprs[(i,)] = consts[name]
        elif name.endswith("_ptr"):  # an optional tensor left out: None, a constexpr
            signature[name] = "constexpr"
            constexprs[(i,)] = None
        elif name in ("sm_scale", "softcap"):
            signature[name] = "fp32"
        elif isinstance(value, tuple):  # a tensor's strides
            signature[name] = tuple(integer((i, j), name, v) for j, v in enumerate(value))
        else:
            signature[name] = integer((i,), name, value)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_decode(
    block_n: int, warps: int, loop_stages: int, fmt: str, *, hq: int = 32, hkv: int = 8,
    d: int = 128, page: int = 16, fold: bool = True, pdl: bool = True, prefill: bool = False,
    recent: int = 0,
) -> Any:  # fmt: skip
    """Compile the split decode kernel (bf16 query) for sm_90; returns Triton's compiled kernel.

    With ``prefill`` the one-split prefill kernel instead: 128 query rows per program (the
    launcher's prefill tile), no group-scale folding. ``recent``: a bf16 ring of that many
    newest tokens (``recent_tokens``).
    """
    kt = fmt in TRANSFORM_FORMATS
    has_rot, has_off, has_first = TRANSFORM_FORMATS.get(fmt, (False, False, False))
    k_fp4, v_fp4 = FP4_FORMATS.get(fmt, (0, 0))
    group_scales, ng = FORMATS["per-tensor" if kt or fmt in FP4_FORMATS else fmt]
    fn = at.paged_attn_kernel
    # the pointers given (the others are None: absent optional tensors)
    pointers = {
        "q_ptr": "*bf16", "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "bt_ptr": "*i32",
        "seq_ptr": "*i32", "out_ptr": "*bf16", "part_ptr": "*fp32", "lse_ptr": "*fp32",
    }  # fmt: skip
    if group_scales:
        pointers.update(kg_ptr="*fp32", vg_ptr="*fp32")
    else:
        pointers.update(ks_ptr="*fp32", vs_ptr="*fp32")
    # a 4-bit side: packed uint8 pages [P, S, Hkv, D // 2] and uint8 block scales
    # [P, S, Hkv, D // block], both token-major (kvquant.kernels.fp4.fp4_page_storage)
    fp4_strides = {}
    for side, f in (("k", k_fp4), ("v", v_fp4)):
        if f:
            nb = d // (16 if f == 1 else 32)
            pointers.update({f"{side}_ptr": "*u8", f"{side}b_ptr": "*u8"})
            fp4_strides[f"s_{side}"] = (page * hkv * d // 2, hkv * d // 2, d // 2, 1)
            fp4_strides[f"s_{side}b"] = (page * hkv * nb, hkv * nb, nb)
    if has_rot:
        pointers.update(rot_ptr="*fp32")
    if has_off:
        pointers.update(off_ptr="*fp32")
    if has_first:
        pointers.update(fk_ptr="*bf16", fv_ptr="*bf16", flen_ptr="*i32")
    if recent:
        pointers.update(rkv_ptr="*bf16")
    fold = fold and group_scales and not prefill
    block_m = max(16, triton.next_power_of_2(hq // hkv) * (ng if fold else 1))
    if prefill:
        block_m = 128
    consts: dict[str, Any] = dict(
        GROUP=hq // hkv, QPB=block_m // (hq // hkv) if prefill else 1, BLOCK_M=block_m,
        BLOCK_N=block_n, HEAD_D=d, PAGE=page,
        V_RUNS_DENSE=math.gcd(page, block_n) == page and not v_fp4,
        SCALE_RUNS_DENSE=group_scales,
        FOLD=fold, NG=ng, CAUSAL=True, USE_SOFTCAP=False, USE_WINDOW=False, SPLIT=not prefill,
        USE_WHILE=False, LOOP_STAGES=loop_stages, PDL=pdl,
        # a 4-bit side decoded by inline PTX, as the launcher has it on sm_89 and newer
        K_FP4=k_fp4 + 4 * (k_fp4 > 0), V_FP4=v_fp4 + 4 * (v_fp4 > 0),
    )  # fmt: skip
    # runtime values of the launch: 1 becomes a constant, multiples of 16 get divisibility 16
    gs = (page * hkv * ng, ng, page * ng) if group_scales else (0, 0, 0)
    values = dict(
        # pages from kvquant.kernels.page_storage: K token-major, V keys-fastest
        s_q=(hq * d, hq * d, d, 1), s_k=(page * hkv * d, hkv * d, d, 1),
        s_v=(page * hkv * d, 1, d * page, page), s_bt=1024, s_kvs=(0, 0), n_side=(0, recent),
        # group scales head-major (kvquant.kernels.group_scale_storage)
        s_kg=gs, s_vg=gs, s_kb=(0, 0, 0), s_vb=(0, 0, 0), s_o=(hq * d, hq * d, d, 1),
        Lq=2048 if prefill else 1, Hq=hq,
    )  # fmt: skip
    values.update(fp4_strides)
    options = {"num_warps": warps, "num_stages": 2 if prefill else 3, "launch_pdl": pdl}
    return _compile_sm90(fn, pointers, consts, values, options)


def compile_reduce(*, hq: int = 32, hkv: int = 8, d: int = 128, splits: int = 5,
                   pdl: bool = True) -> Any:  # fmt: skip
    """Compile the split merge (one warp, 32 columns per program, bf16 output) for sm_90."""
    fn = at.reduce_kernel
    pointers = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16"}
    consts: dict[str, Any] = dict(
        SPLITS_P2=max(2, triton.next_power_of_2(splits)), HEAD_D=d, BLOCK_D=min(32, d), PDL=pdl
    )  # fmt: skip
    values = dict(Lq=1, Hq=hq, num_splits=splits, s_ob=hq * d, s_ot=hq * d, s_oh=d, s_od=1)
    options = {"num_warps": 1, "num_stages": 3, "launch_pdl": pdl}
    return _compile_sm90(fn, pointers, consts, values, options)


def _dump(kernel: Any) -> tuple[str, str]:
    """The compiled kernel's resource usage (``cuobjdump``) and SASS (``nvdisasm``)."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        dump, sass = (
            subprocess.run(
                [str(bin_dir / tool), flag, str(cubin)], capture_output=True, text=True, check=True
            ).stdout
            for tool, flag in (("cuobjdump", "--dump-resource-usage"), ("nvdisasm", "-c"))
        )
    return dump, sass


def reduce_resources(kernel: Any) -> dict[str, Any]:
    """Registers, stack and SASS of the split merge: instructions, global loads, and those
    after the ``griddepcontrol.wait`` (the part that waits for the attention kernel)."""
    dump, sass = _dump(kernel)
    usage = re.search(r"REG:(\d+) STACK:(\d+)", dump)
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)[^;]*;", sass)
    loads = [op.split(".")[0] in ("LDG", "LDGSTS") for op in ops]
    # griddepcontrol.wait is ACQBULK in sm_90 SASS; without PDL the whole kernel counts
    wait = next((i for i, op in enumerate(ops) if op.startswith("ACQBULK")), -1)
    return {
        "registers": int(usage.group(1)) if usage else None,
        "stack_bytes": int(usage.group(2)) if usage else None,
        "sass_instructions": len(ops),
        "global_loads": sum(loads),
        "sass_after_wait": len(ops) - wait - 1,
    }


def loop_sizes(sass: str) -> list[int]:
    """SASS instructions in each loop (a backward branch to a label), in program order."""
    return [size for _, size in loops(sass)]


def loops(sass: str) -> list[tuple[int, int]]:
    """(first instruction, instructions) of each loop (a backward branch), in program order."""
    labels: dict[str, int] = {}
    found: list[tuple[int, int]] = []
    count = 0
    for line in sass.splitlines():
        label = re.match(r"\s*\.(L\w+):", line)
        if label:
            labels[label.group(1)] = count
            continue
        instr = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", line)
        if not instr:
            continue
        count += 1
        target = re.search(r"\.(L\w+)", instr.group(2)) if instr.group(1) == "BRA" else None
        if target and labels.get(target.group(1), count) < count - 1:
            found.append((labels[target.group(1)], count - labels[target.group(1)]))
    return found


def prologue(sass: str) -> dict[str, int]:
    """SASS before the key loops (the last three loops): instructions and global loads.

    What every program runs before its first key tile (query load and rotation, scales,
    first tokens, split bounds), counted statically (both sides of every branch); the global
    loads are ``LDG`` (to registers) and ``LDGSTS`` (asynchronous, to shared memory).
    """
    starts = [start for start, _ in loops(sass)]
    end = starts[-3] if len(starts) >= 3 else 0
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)[^;]*;", sass)
    head = ops[:end]
    return {
        "prologue_instructions": len(head),
        "prologue_global_loads": sum(op.split(".")[0] in ("LDG", "LDGSTS") for op in head),
    }


def resources(kernel: Any) -> dict[str, Any]:
    """Registers, stack, shared memory, async copies, PTX counts and key-loop SASS sizes."""
    dump, sass = _dump(kernel)
    usage = re.search(r"REG:(\d+) STACK:(\d+)", dump)
    ptx = kernel.asm["ptx"]
    counts = collections.Counter(
        op for op in PTX_OPS for _ in re.finditer(re.escape(op), ptx)
    )  # fmt: skip
    return {
        "registers": int(usage.group(1)) if usage else None,
        "stack_bytes": int(usage.group(2)) if usage else None,
        "shared_bytes": int(kernel.metadata.shared),
        "async_copies_in_ir": kernel.asm["ttgir"].count("async_copy_global_to_local"),
        "ptx_instructions": len(re.findall(r"^\s+[a-z]", ptx, re.M)),
        "ptx": {op: counts.get(op, 0) for op in PTX_OPS},
        # the key loops: masked first tile, unmasked (software-pipelined) interior, masked rest
        "sass_loop_instructions": loop_sizes(sass),
        **prologue(sass),
    }


def splits_at(
    record: dict[str, Any], at: list[tuple[int, int]], hkv: int, num_warps: int, block_n: int
) -> dict[str, Any]:
    """The H200 residency of a compiled variant and the launcher's split count for each
    ``(batch, table keys)`` of ``at``."""
    pps = programs_per_sm(record["registers"], num_warps, record["shared_bytes"])
    return {
        "programs_per_sm": pps,
        "splits_at": {
            f"{b}x{keys}": choose_num_splits(
                b * hkv, keys, H200_SMS, programs_per_sm=pps, block_n=block_n
            )
            for b, keys in at
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--variant",
        action="append",
        help="BLOCK_N,num_warps,LOOP_STAGES[,per-tensor|group64|group128|per-head-kt"
        "[-rot|-off|-first]|nvfp4|mxfp4|fp8-k-nvfp4-v] (repeatable)",
    )
    ap.add_argument("--no-fold", action="store_true", help="dequantize group-scale tiles")
    ap.add_argument(
        "--prefill", action="store_true", help="the prefill kernel (128-row tiles, one split)"
    )
    ap.add_argument("--shape", default="32,8,128", help="Hq,Hkv,D of the compiled kernel")
    ap.add_argument(
        "--recent", type=int, default=0, metavar="R", help="with a ring of the R newest tokens"
    )
    ap.add_argument(
        "--reduce",
        metavar="SPLITS",
        type=int,
        default=0,
        help="the split merge of SPLITS partials instead",
    )
    ap.add_argument(
        "--splits-at",
        default="",
        metavar="BxKEYS,...",
        help="also the launcher's split count for B sequences and tables of KEYS key slots",
    )
    args = ap.parse_args()
    at = [(int(b), int(k)) for b, k in (s.split("x") for s in args.splits_at.split(",") if s)]
    hq, hkv, d = (int(x) for x in args.shape.split(","))
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("unset TRITON_INTERPRET: this tool compiles for sm_90")
    if args.reduce:
        kernel = compile_reduce(hq=hq, hkv=hkv, d=d, splits=args.reduce)
        print(json.dumps({"reduce": args.reduce, "shape": args.shape, **reduce_resources(kernel)}))
        return
    for spec in args.variant or DEFAULT_VARIANTS:
        parts = spec.split(",")
        bn, warps, ls = (int(x) for x in parts[:3])
        fmt = parts[3] if len(parts) > 3 else "per-tensor"
        kernel = compile_decode(
            bn, warps, ls, fmt, hq=hq, hkv=hkv, d=d, fold=not args.no_fold, prefill=args.prefill,
            recent=args.recent,
        )  # fmt: skip
        record = {"variant": spec, "shape": args.shape, "recent": args.recent, **resources(kernel)}
        if at and not args.prefill:
            record |= splits_at(record, at, hkv, warps, bn)
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
