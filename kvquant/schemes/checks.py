"""The checks the scheme classes run once, when a scheme is built: fp32 tensors, scale values
in range, finite transforms; the bounds they check against and the fixes their errors name."""

from __future__ import annotations

import torch

from kvquant.errors import ScaleFormatError
from kvquant.types import MAX_FIRST_TOKENS

__all__ = [
    "MIN_ROTATED_HEAD_DIM",
    "ORTHONORMAL_TOL",
    "SCALE_FIX",
    "SCALE_MAX",
    "SCALE_MIN",
    "TRANSFORM_FIX",
    "check_finite",
    "check_scale_values",
    "checked_rotation",
    "checked_tensor",
    "fail",
    "host_copy",
    "own_copy",
]

SCALE_MIN = 2.0**-117
"""Smallest static scale accepted (the registry's ``MIN_SCALE``: 1/scale and the smallest
code times scale stay normal fp32 numbers)."""

SCALE_MAX = 2.0**100
"""Largest static scale accepted (the registry's ``MAX_SCALE``)."""

ORTHONORMAL_TOL = 1e-4
"""Largest ``|R R^T - I|`` element accepted for a K rotation (checked once, at construction)."""

MIN_ROTATED_HEAD_DIM = 16
"""Smallest head_dim of ``fp32-group`` scales with a K rotation (a power of two: the write kernel
rotates K in slices of 16 channels)."""

SCALE_FIX = (
    "Fix: normalise scales with kvquant.registry (it returns fp32 [] or [num_kv_heads] "
    "tensors on the cache's device)."
)
TRANSFORM_FIX = (
    "Fix: build k_offset [num_kv_heads, head_dim] and k_rotation [head_dim, head_dim] as fp32 "
    "tensors (kvquant.kernels.hadamard(head_dim) for the rotation), or pass the K transform "
    "kvquant.registry resolved for the model."
)


def fail(scheme: str, msg: str) -> ScaleFormatError:
    return ScaleFormatError(f"{scheme}: {msg}")


def checked_tensor(scheme: str, label: str, x: object, want: str, fix: str) -> torch.Tensor:
    """``x`` as a detached fp32 tensor (refusing anything else), not yet copied."""
    if not isinstance(x, torch.Tensor):
        raise fail(
            scheme, f"{label} is a {type(x).__name__}; expected an fp32 tensor {want}. {fix}"
        )
    if x.dtype != torch.float32:
        raise fail(scheme, f"{label} has dtype {x.dtype}; expected torch.float32 {want}. {fix}")
    return x.detach()


def host_copy(x: torch.Tensor) -> torch.Tensor:
    """A CPU copy to read values from (the tensor itself when already on the CPU)."""
    return x if x.device.type == "cpu" else x.cpu()


def own_copy(x: torch.Tensor) -> torch.Tensor:
    """The scheme's own contiguous copy (the caller may change theirs later)."""
    return x.clone(memory_format=torch.contiguous_format)


def check_scale_values(
    scheme: str, label: str, scale: torch.Tensor, meaning: str = "amax / 448", fix: str = ""
) -> None:
    flat = host_copy(scale).reshape(-1)
    ok = torch.isfinite(flat) & (flat >= SCALE_MIN) & (flat <= SCALE_MAX)
    if not bool(ok.all()):
        index = int((~ok).nonzero()[0, 0])
        raise fail(
            scheme,
            f"{label} element {index} is {float(flat[index])!r}; expected finite "
            f"dequantization multipliers in [{SCALE_MIN:.3g}, {SCALE_MAX:.3g}] ({meaning}): a "
            "zero, negative, NaN, infinite or subnormal scale stores or reads garbage. "
            f"{fix or SCALE_FIX}",
        )


def check_finite(scheme: str, label: str, host: torch.Tensor) -> None:
    flat = host.reshape(-1)
    ok = torch.isfinite(flat)
    if not bool(ok.all()):
        index = int((~ok).nonzero()[0, 0])
        raise fail(
            scheme,
            f"{label} element {index} is {float(flat[index])!r}; expected finite values. "
            f"{TRANSFORM_FIX}",
        )


def checked_rotation(scheme: str, rotation: object) -> torch.Tensor:
    """A K rotation ``[D, D]``: fp32, finite, orthonormal within :data:`ORTHONORMAL_TOL`; the
    scheme's own contiguous copy."""
    r = checked_tensor(scheme, "k_rotation", rotation, "[head_dim, head_dim]", TRANSFORM_FIX)
    if r.dim() != 2 or r.shape[0] != r.shape[1]:
        raise fail(
            scheme, f"k_rotation has shape {tuple(r.shape)}; expected (head_dim, head_dim). "
            f"{TRANSFORM_FIX}"
        )  # fmt: skip
    d = int(r.shape[0])
    host = host_copy(r)
    check_finite(scheme, "k_rotation", host)
    err = float((host @ host.T - torch.eye(d)).abs().max())
    if err > ORTHONORMAL_TOL:
        raise fail(
            scheme,
            f"k_rotation is not orthonormal (max |R R^T - I| = {err:.3g}, expected <= "
            f"{ORTHONORMAL_TOL:g}); the query would not be rotated back exactly. Fix: "
            "pass kvquant.kernels.hadamard(head_dim), or None.",
        )
    return own_copy(r)


def check_first_tokens(scheme: str, first_tokens: object) -> None:
    """A K transform's ``first_tokens``: an int from 0 to ``MAX_FIRST_TOKENS``.

    Raises:
        ScaleFormatError: anything else, with the fix.
    """
    nf = first_tokens
    if isinstance(nf, bool) or not isinstance(nf, int) or not 0 <= nf <= MAX_FIRST_TOKENS:
        raise fail(
            scheme,
            f"first_tokens is {nf!r}; expected an int from 0 to {MAX_FIRST_TOKENS}. Fix: "
            "pass the first_tokens of the checkpoint's K transform (1 is usual).",
        )


def checked_head_rotation(scheme: str, rotation: object, head_dim: int) -> torch.Tensor:
    """A dynamic format's K rotation for ``head_dim``: :func:`checked_rotation` of shape
    ``[head_dim, head_dim]``, with ``head_dim`` a power of two >= :data:`MIN_ROTATED_HEAD_DIM`.

    Raises:
        ScaleFormatError: another head_dim or shape, or a rotation :func:`checked_rotation`
            refuses.
    """
    d = head_dim
    if d < MIN_ROTATED_HEAD_DIM or d & (d - 1):
        raise fail(
            scheme,
            f"k_rotation was given for head_dim {d}; expected a power-of-two head_dim >= "
            f"{MIN_ROTATED_HEAD_DIM} (the Hadamard matrix's sizes; the kernels rotate K in "
            "slices of 16 channels). Fix: drop k_rotation for this model.",
        )
    r = checked_rotation(scheme, rotation)
    if r.shape[0] != d:
        raise fail(
            scheme,
            f"k_rotation has shape {tuple(r.shape)}; expected ({d}, {d}) (head_dim {d}). "
            f"Fix: pass kvquant.kernels.hadamard({d}), or None.",
        )
    return r
