"""Calibration-free FP8 K/V formats for the simulation: dynamic fp32-group scales, optionally
in a fixed rotated frame and with the first tokens kept at full precision.

Test and benchmark harness, not part of the kvquant package. Used by
``simulate_fp8_kv(model, "dynamic", DynamicFormat(...))``
(:mod:`benchmarks.harness.accuracy`); the arithmetic is :func:`dynamic_kv`'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from kvquant.errors import CalibrationError, OptionError

__all__ = ["DynamicFormat", "dynamic_attention", "dynamic_kv", "round_groups"]

_FP8 = torch.float8_e4m3fn
_LIMIT = float(torch.finfo(_FP8).max)


@dataclass(frozen=True)
class DynamicFormat:
    """A calibration-free format: every scale is computed from the values being written.

    Attributes:
        k_group: G of the keys, ``s = amax / 448`` per token, KV head and group of G channels.
        v_group: G of the values.
        rotate_k: keys rotated by the Hadamard matrix ``R`` before rounding (the query too).
        rotate_v: values rotated by ``R`` before rounding; the output is rotated back by ``R^T``.
        first_tokens: first positions of every sequence attended at full precision.
        recent_tokens: each query position's last ``recent_tokens`` keys and values (itself
            included) read exactly, the older ones rounded: what kvquant's cache gives a
            decode step with ``recent_tokens``.
        scale_factor: every dynamic scale multiplied by it (>= 1 clips nothing: the jitter
            control of a calibration-free format).
    """

    k_group: int = 64
    v_group: int = 64
    rotate_k: bool = False
    rotate_v: bool = False
    first_tokens: int = 0
    scale_factor: float = 1.0
    recent_tokens: int = 0

    def scaled(self, factor: float) -> DynamicFormat:
        """The same format with every dynamic scale multiplied by ``factor``."""
        return replace(self, scale_factor=self.scale_factor * factor)

    @property
    def label(self) -> str:
        """A short row name, e.g. ``"rot-K G=64 first=1"``."""
        rot = "rot-KV " if self.rotate_v else ("rot-K " if self.rotate_k else "")
        groups = (
            f"G={self.k_group}"
            if self.k_group == self.v_group
            else f"K G={self.k_group} V G={self.v_group}"
        )
        first = f" first={self.first_tokens}" if self.first_tokens else ""
        recent = f" recent-{self.recent_tokens}" if self.recent_tokens else ""
        return f"dynamic {rot}{groups}{first}{recent}"


def round_groups(x: torch.Tensor, group_size: int, scale_factor: float = 1.0) -> torch.Tensor:
    """``fp8(clamp(x / s, +-448)) * s`` with ``s = amax / 448 * scale_factor`` per group.

    The groups are G consecutive channels of the last dim of ``x`` (per token and head);
    ``amax / 448`` is computed in fp32 first and then multiplied by the factor, so a factor
    of 1 gives the codes of kvquant's fp32-group write. An all-zero group gets ``s = 1``.

    Args:
        x: [..., D] any float dtype, D a multiple of ``group_size``.
        group_size: G.
        scale_factor: multiplier of every scale.

    Returns:
        fp32 [..., D].

    Raises:
        OptionError: G does not divide D.
    """
    d = x.shape[-1]
    if group_size <= 0 or d % group_size:
        raise OptionError(
            f"round_groups: group_size {group_size} does not divide head_dim {d}; expected a "
            "positive divisor. Fix: pick G in the divisors of head_dim."
        )
    xg = x.float().unflatten(-1, (d // group_size, group_size))
    amax = xg.abs().amax(dim=-1, keepdim=True)
    s = torch.where(amax > 0, amax / _LIMIT, torch.ones_like(amax))
    if scale_factor != 1.0:
        s = s * scale_factor
    q = (xg / s).clamp(-_LIMIT, _LIMIT).to(_FP8).float() * s
    return q.flatten(-2)


def _hadamard(d: int, device: torch.device) -> torch.Tensor:
    from kvquant.kernels import hadamard

    return hadamard(d, device=device)


def dynamic_kv(
    fmt: DynamicFormat, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Query, keys and values that SDPA attends for ``fmt``, and the output's back-rotation.

    Keys: ``k_hat = round_groups(k R)`` (``R = I`` without ``rotate_k``), the query ``q R``,
    so the scores are ``q R . k_hat``, before rounding ``q . k`` (``R`` orthonormal). Values:
    ``v_hat = round_groups(v R)`` with ``rotate_v``, and SDPA's output ``o`` is returned with
    ``R^T`` to apply (``o R^T`` = attention over ``v_hat R^T``); else ``round_groups(v)``. The
    first ``first_tokens`` positions of dim 2 (the sequence's first tokens) are ``k R`` and
    ``v R`` (or ``v``) in fp32, unrounded. Non-finite inputs stay NaN.

    Args:
        fmt: the format.
        query: [B, Hq, T, D]; key, value: [B, Hkv, S, D] (HF layout, keys post-RoPE).

    Returns:
        ``(query, key, value, back)`` in the input dtypes; ``back`` is ``R^T`` fp32 [D, D]
        or None.
    """
    d = key.shape[-1]
    rot = _hadamard(d, key.device) if (fmt.rotate_k or fmt.rotate_v) else None
    q, k, v = query.float(), key.float(), value.float()
    if fmt.rotate_k and rot is not None:
        q, k = q @ rot, k @ rot
    if fmt.rotate_v and rot is not None:
        v = v @ rot
    k_hat = round_groups(k, fmt.k_group, fmt.scale_factor)
    v_hat = round_groups(v, fmt.v_group, fmt.scale_factor)
    n = min(fmt.first_tokens, k.shape[2])
    if n:
        k_hat[:, :, :n] = k[:, :, :n]
        v_hat[:, :, :n] = v[:, :, :n]
    k_hat = torch.where(torch.isfinite(k), k_hat, torch.nan)
    v_hat = torch.where(torch.isfinite(v), v_hat, torch.nan)
    back = rot.T if (fmt.rotate_v and rot is not None) else None
    return q.to(query.dtype), k_hat.to(key.dtype), v_hat.to(value.dtype), back


def dynamic_attention(
    fmt: object,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """SDPA over :func:`dynamic_kv`'s operands, the output rotated back when V is rotated.

    Raises:
        CalibrationError: ``fmt`` is not a :class:`DynamicFormat`.
    """
    if not isinstance(fmt, DynamicFormat):
        raise CalibrationError(
            f"simulated attention: mode 'dynamic' needs a DynamicFormat; got "
            f"{type(fmt).__name__}. Fix: pass scales=DynamicFormat(...)."
        )
    q, k_hat, v_hat, back = dynamic_kv(fmt, query, key, value)
    if fmt.recent_tokens:
        from benchmarks.harness.fp4 import recent_window_attention

        exact = _exact_frame(fmt, key, value)
        return recent_window_attention(module, q, (k_hat, v_hat), exact, fmt.recent_tokens, back)
    return sdpa_rotated_back(module, q, k_hat, v_hat, attention_mask, back, **kwargs)


def _exact_frame(
    fmt: DynamicFormat, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values unrounded, in the frame :func:`dynamic_kv` rounds them in (fp32)."""
    k, v = key.float(), value.float()
    if fmt.rotate_k or fmt.rotate_v:
        rot = _hadamard(key.shape[-1], key.device)
        k = k @ rot if fmt.rotate_k else k
        v = v @ rot if fmt.rotate_v else v
    return k, v


def sdpa_rotated_back(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    back: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers' SDPA attention, its output times ``back`` (a rotated V's inverse) if given."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if back is not None:
        out = (out.float() @ back.to(out.device)).to(out.dtype)
    return out, weights
