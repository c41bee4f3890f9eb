"""The 4-bit KV formats for the simulation: ``kvquant.patch(model, kv_format=...)``'s rounding,
optionally in a fixed Hadamard frame.

Test and benchmark harness, not part of the kvquant package. Used by
``simulate_fp8_kv(model, "fp4", Fp4KV(...))`` (:mod:`benchmarks.harness.accuracy`); the
arithmetic is :func:`fp4_kv`'s docstring. The 4-bit codes are those of kvquant's own
reference quantizer (:func:`kvquant.kernels.fp4.quantize_fp4`, which the write kernels match
byte for byte), with the global scale a calibration-free cache uses
(:data:`kvquant.schemes.DYNAMIC_NVFP4_GLOBAL_SCALE`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvquant.errors import CalibrationError, OptionError

__all__ = ["FP4_KV_FORMATS", "Fp4KV", "exact_kv", "fp4_attention", "fp4_kv", "round_fp4"]

FP4_KV_FORMATS = ("nvfp4", "mxfp4", "fp8-k-nvfp4-v")
"""The 4-bit ``kv_format`` words of ``kvquant.patch``."""


@dataclass(frozen=True, eq=False)
class Fp4KV:
    """A 4-bit ``kv_format`` as the cache stores it, optionally in a rotated or offset frame.

    Attributes:
        kv_format: one of :data:`FP4_KV_FORMATS`.
        rotate_k: keys rotated by the Hadamard matrix ``R`` before rounding (the query too).
        rotate_v: values rotated by ``R`` before rounding; the output is rotated back by ``R^T``.
        k_scales: ``fp8-k-nvfp4-v``'s static FP8 K scales
            (:class:`~benchmarks.harness.accuracy.CalibratedScales`, read at ``k_granularity``).
        k_transform: a :class:`~benchmarks.harness.accuracy.KTransformScales` whose frame the
            keys are rounded in: ``k R - c`` (its rotation and offset), its first tokens exact;
            FP8 with its K scales for ``fp8-k-nvfp4-v``, the 4-bit format otherwise.
        k_granularity: ``"per-tensor"`` or ``"per-head"``: how ``k_scales`` are read.
        recent_tokens: each query position's last ``recent_tokens`` keys and values (itself
            included) read exactly, the older ones rounded: what kvquant's cache gives a decode
            step with ``recent_tokens`` (the newest tokens at full precision beside the pages).
    """

    kv_format: str
    rotate_k: bool = False
    rotate_v: bool = False
    k_scales: Any = None
    k_transform: Any = None
    k_granularity: str = "per-tensor"
    recent_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kv_format not in FP4_KV_FORMATS:
            raise OptionError(
                f"Fp4KV: kv_format {self.kv_format!r} is unknown; expected one of "
                f"{FP4_KV_FORMATS}. Fix: pass one of those."
            )
        fp8_k = self.kv_format == "fp8-k-nvfp4-v"
        one = (self.k_scales is None) != (self.k_transform is None)
        if (fp8_k and not one) or (not fp8_k and self.k_scales is not None):
            raise OptionError(
                f"Fp4KV({self.kv_format!r}): k_scales={self.k_scales is not None}, "
                f"k_transform={self.k_transform is not None}; expected exactly one of them for "
                "'fp8-k-nvfp4-v' (its FP8 K side), and no k_scales for the 4-bit-K formats. "
                "Fix: pass the FP8 K side there only."
            )
        if self.recent_tokens < 0:
            raise OptionError(
                f"Fp4KV: recent_tokens={self.recent_tokens}; expected 0 or more. Fix: pass a "
                "count of tokens."
            )
        if self.rotate_k and (fp8_k or self.k_transform is not None):
            raise OptionError(
                f"Fp4KV({self.kv_format!r}): rotate_k with FP8 keys or a k-transform frame; "
                "expected a rotation of plain 4-bit keys only (static K scales were measured "
                "unrotated; the k-transform brings its own). Fix: leave rotate_k False."
            )

    @property
    def label(self) -> str:
        """A short row name, e.g. ``"nvfp4 rot-KV"`` or ``"fp8-k-nvfp4-v (K per-tensor)"``."""
        rot = " rot-KV" if self.rotate_k and self.rotate_v else ""
        rot = rot or (" rot-K" if self.rotate_k else (" rot-V" if self.rotate_v else ""))
        if self.k_transform is not None:
            k = " (K k-transform)"
        elif self.k_scales is not None:
            k = f" (K {self.k_granularity} amax / 448)"
        else:
            k = ""
        recent = f" recent-{self.recent_tokens}" if self.recent_tokens else ""
        return f"{self.kv_format}{rot}{k}{recent}"


def round_fp4(x: torch.Tensor, which: str) -> torch.Tensor:
    """``x`` [B, Hkv, T, D] through ``which`` (``"nvfp4"`` or ``"mxfp4"``) codes and back, fp32.

    The codes of :func:`kvquant.kernels.fp4.quantize_fp4` with NVFP4's calibration-free global
    scale; a block holding a non-finite value reads back as NaN.
    """
    from kvquant.kernels.fp4 import MXFP4, NVFP4, dequantize_fp4, quantize_fp4
    from kvquant.schemes import DYNAMIC_NVFP4_GLOBAL_SCALE

    fmt = NVFP4 if which == "nvfp4" else MXFP4
    g = torch.tensor(DYNAMIC_NVFP4_GLOBAL_SCALE) if fmt.global_scale else None
    tokens = x.float().transpose(1, 2)  # [B, T, Hkv, D]: the layout the pages hold
    packed, scales = quantize_fp4(tokens, fmt, g)
    return dequantize_fp4(packed, scales, fmt, g).transpose(1, 2)


def _hadamard(d: int, device: torch.device) -> torch.Tensor:
    from kvquant.kernels import hadamard

    return hadamard(d, device=device)


def fp4_kv(
    fmt: Fp4KV, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Query, keys and values that SDPA attends for ``fmt``, and the output's back-rotation.

    ``nvfp4`` / ``mxfp4``: ``k_hat = round_fp4(k R)`` and the query ``q R`` (``R = I`` without
    ``rotate_k``), so the scores are ``q R . k_hat``, before rounding ``q . k``. In a
    k-transform's frame (rotation ``R_t``, offset ``c``): ``round_fp4(k R_t - c) + c`` and
    ``q R_t``, the first ``first_tokens`` keys ``k R_t`` exactly.
    ``fp8-k-nvfp4-v``: keys ``fp8(clamp(k / s_k)) * s_k`` with the layer's static scale, or the
    k-transform's FP8 keys and rotated query (its first tokens exact). Values: ``round_fp4(v R)``
    with ``rotate_v`` (``R^T`` returned, to apply to SDPA's output), else ``round_fp4(v)``
    (NVFP4 for ``fp8-k-nvfp4-v``). Every position is rounded, the first included, but in a
    k-transform's frame: there the first ``first_tokens`` values are exact, as the cache keeps
    them (beside their keys, in its side buffer).

    Args:
        fmt: the format.
        layer: the attention layer's index (static K scales are per layer).
        query: [B, Hq, T, D]; key, value: [B, Hkv, S, D] (HF layout, keys post-RoPE).

    Returns:
        ``(query, key, value, back)`` in the input dtypes; ``back`` is ``R^T`` fp32 [D, D]
        or None.
    """
    d = key.shape[-1]
    q = query.float()
    if fmt.rotate_k:
        q = q @ _hadamard(d, q.device)
    k, v = exact_kv(fmt, key, value)
    fp8_k = fmt.kv_format == "fp8-k-nvfp4-v"
    v_side = "nvfp4" if fp8_k else fmt.kv_format
    kt = fmt.k_transform
    if kt is not None:
        from kvquant.calibrate.fp8 import k_transform_keys

        if kt.rotation is not None:
            q = q @ kt.rotation.to(q.device)
        if fp8_k:
            k_hat = k_transform_keys(
                key, kt.k_scale[layer], kt.k_offset[layer], kt.rotation, kt.first_tokens
            )
        else:
            c = kt.k_offset[layer].to(k.device)[None, :, None, :]
            k_hat = round_fp4(k - c, fmt.kv_format) + c
            n = min(kt.first_tokens, k.shape[2])
            k_hat[:, :, :n] = k[:, :, :n]
    elif fp8_k:
        from benchmarks.harness.accuracy import fake_quantize_kv

        k_s, _ = fmt.k_scales.layer(layer, fmt.k_granularity)
        k_hat = fake_quantize_kv(k, k_s)
    else:
        k_hat = round_fp4(k, fmt.kv_format)
    v_hat = round_fp4(v, v_side)
    if kt is not None:  # the cache's side buffer holds the first tokens' V exactly too
        n = min(kt.first_tokens, v.shape[2])
        v_hat[:, :, :n] = v[:, :, :n]
    back = _hadamard(d, v.device).T if fmt.rotate_v else None
    return q.to(query.dtype), k_hat.to(key.dtype), v_hat.to(value.dtype), back


def exact_kv(
    fmt: Fp4KV, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unrounded keys and values in the frame :func:`fp4_kv` rounds them in (fp32): ``k R``
    (``rotate_k``) or ``k R_t`` (a k-transform's rotation, before its offset), else ``k``;
    ``v R`` with ``rotate_v``, else ``v``."""
    d = key.shape[-1]
    k, v = key.float(), value.float()
    kt = fmt.k_transform
    if kt is not None and kt.rotation is not None:
        k = k @ kt.rotation.to(k.device)
    elif fmt.rotate_k:
        k = k @ _hadamard(d, k.device)
    if fmt.rotate_v:
        v = v @ _hadamard(d, v.device)
    return k, v


def recent_window_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    rounded: tuple[torch.Tensor, torch.Tensor],
    exact: tuple[torch.Tensor, torch.Tensor],
    recent: int,
    back: torch.Tensor | None,
) -> tuple[torch.Tensor, None]:
    """Causal attention (fp32, eager) in which query position ``t`` reads keys and values
    ``t - recent + 1 .. t`` from ``exact`` and the older ones from ``rounded`` (``[B, Hkv, S,
    D]``, the query ``[B, Hq, T, D]`` at the last ``T`` positions; no padding)."""
    rep = query.shape[1] // rounded[0].shape[1]
    (kr, vr), (ke, ve) = (
        (x.float().repeat_interleave(rep, 1) for x in p) for p in (rounded, exact)
    )
    t_len, s_len = query.shape[2], kr.shape[2]
    t = torch.arange(t_len, device=query.device)[:, None] + (s_len - t_len)
    s = torch.arange(s_len, device=query.device)[None, :]
    near = (t - s < recent) & (s <= t)
    q = query.float()
    scores = torch.where(near, q @ ke.transpose(-1, -2), q @ kr.transpose(-1, -2))
    scores = (scores * float(module.scaling)).masked_fill(s > t, float("-inf"))
    p = scores.softmax(-1)
    out = (p * near) @ ve + (p * ~near) @ vr
    if back is not None:
        out = out @ back.to(out.device)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def fp4_attention(
    fmt: object,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """SDPA over :func:`fp4_kv`'s operands, the output rotated back when V is rotated.

    Raises:
        CalibrationError: ``fmt`` is not an :class:`Fp4KV`.
    """
    from benchmarks.harness.dynamic import sdpa_rotated_back

    if not isinstance(fmt, Fp4KV):
        raise CalibrationError(
            f"simulated attention: mode 'fp4' needs an Fp4KV; got {type(fmt).__name__}. "
            "Fix: pass scales=Fp4KV(...)."
        )
    layer = int(getattr(module, "layer_idx", 0))
    q, k, v, back = fp4_kv(fmt, layer, query, key, value)
    if fmt.recent_tokens:
        exact = exact_kv(fmt, key, value)
        return recent_window_attention(module, q, (k, v), exact, fmt.recent_tokens, back)
    return sdpa_rotated_back(module, q, k, v, attention_mask, back, **kwargs)
