"""Accuracy harness: perplexity and top-1 agreement of a causal LM with an FP8 KV cache.

Test and benchmark harness, not part of the kvquant package.

Two ways to put FP8 into the KV path are measured the same way:

* **simulated** (independent of :func:`kvquant.patch`): a custom attention
  function registered with transformers' ``AttentionInterface`` (plus
  ``sdpa_mask`` in ``AttentionMaskInterface``) quantizes and dequantizes the
  post-RoPE K/V it receives, then runs SDPA. Static scales (per-tensor,
  per-KV-head) come from :func:`calibrate`; ``fp32-group`` computes
  ``amax / 448`` per token, KV head and group of ``G`` head_dim elements.
  The ``k-transform`` mode (:class:`KTransformScales`) rounds
  ``(k R - c) / s_k`` and hands attention the rotated query ``q R`` with the
  keys ``k_hat * s_k + c`` (``R`` Hadamard or identity), the first tokens exact.
  The ``dynamic`` mode (:class:`~benchmarks.harness.dynamic.DynamicFormat`) is
  calibration-free: fp32-group scales, optionally in a fixed Hadamard frame.
  The ``fp4`` mode (:class:`~benchmarks.harness.fp4.Fp4KV`) rounds through the 4-bit
  ``kv_format`` codes (NVFP4, MXFP4, FP8 K beside NVFP4 V), optionally rotated too.
* **kvquant**: any model whose forward already goes through kvquant's cache
  (patched, or loaded with ``KVQuantConfig``); :func:`teacher_forced` then only
  needs a factory for the cache object to pass to ``forward``.

Evaluation is teacher-forced: one forward over the whole evaluation text (at
least 1500 tokens), negative log-likelihood of every next token, perplexity
``exp(mean NLL)``, and top-1 agreement = the fraction of positions whose argmax
equals the unquantized model's argmax.

Run ``python -m benchmarks.harness.accuracy --help`` from the checkout's root for
the command line (it reproduces docs/accuracy.md). Transformers is imported lazily.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.dynamic import DynamicFormat, dynamic_attention
from benchmarks.harness.fp4 import Fp4KV, fp4_attention
from kvquant.errors import CalibrationError, OptionError, UnsupportedModelError

__all__ = [
    "FP8_E4M3_MAX",
    "SIMULATED_ATTENTION",
    "CalibratedScales",
    "EvalResult",
    "KTransformScales",
    "TokenStats",
    "calibrate",
    "evaluate",
    "fake_quantize_kv",
    "format_table",
    "main",
    "run_kvquant",
    "run_kvquant_checkpoints",
    "run_simulated",
    "simulate_fp8_kv",
    "teacher_forced",
    "tokenize",
]

FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value: a static scale is ``amax / 448``."""

SIMULATED_ATTENTION = "kvquant_sim"
"""Name under which the simulation attention function is registered."""

_SIM_ATTR = "_kvquant_sim"
_MODES = (
    "none",
    "capture",
    "per-tensor",
    "per-head",
    "fp32-group",
    "k-transform",
    "dynamic",
    "fp4",
)


@dataclass(frozen=True)
class CalibratedScales:
    """Post-RoPE K/V amax per layer and KV head, measured on a calibration text.

    Attributes:
        k_amax: fp32 [num_layers, num_kv_heads], max |K| after RoPE.
        v_amax: fp32 [num_layers, num_kv_heads], max |V|.
        num_tokens: calibration tokens seen.
    """

    k_amax: torch.Tensor
    v_amax: torch.Tensor
    num_tokens: int

    @property
    def num_layers(self) -> int:
        """Decoder layers calibrated."""
        return int(self.k_amax.shape[0])

    @property
    def num_kv_heads(self) -> int:
        """KV heads per layer."""
        return int(self.k_amax.shape[1])

    def per_tensor(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-tensor dequantization scales ``amax / 448``.

        Returns:
            ``(k, v)``, each fp32 [num_layers].
        """
        return _to_scale(self.k_amax.amax(dim=1)), _to_scale(self.v_amax.amax(dim=1))

    def per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-KV-head dequantization scales ``amax / 448``.

        Returns:
            ``(k, v)``, each fp32 [num_layers, num_kv_heads].
        """
        return _to_scale(self.k_amax), _to_scale(self.v_amax)

    def layer(self, index: int, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Canonical scales of one layer.

        Args:
            index: decoder layer.
            granularity: ``"per-tensor"`` (fp32 []) or ``"per-head"`` (fp32 [num_kv_heads]).

        Returns:
            ``(k_scale, v_scale)`` in the canonical shape of ``granularity``.

        Raises:
            KVQuantError: unknown granularity or layer out of range.
        """
        if not 0 <= index < self.num_layers:
            raise CalibrationError(
                f"CalibratedScales.layer: layer {index} requested but {self.num_layers} layers "
                f"were calibrated; expected 0..{self.num_layers - 1}. Fix: calibrate the same "
                "model that is evaluated."
            )
        if granularity == "per-tensor":
            k, v = self.per_tensor()
        elif granularity == "per-head":
            k, v = self.per_head()
        else:
            raise CalibrationError(
                f"CalibratedScales.layer: granularity {granularity!r} has no static scales; "
                "expected 'per-tensor' or 'per-head'. Fix: fp32-group scales are dynamic."
            )
        return k[index], v[index]


@dataclass(frozen=True)
class KTransformScales:
    """The static K transform of every layer (``kvquant calibrate --format k-transform``).

    Attributes:
        k_scale: fp32 [num_layers, num_kv_heads], scales of ``k R - c``.
        v_scale: fp32 [num_layers, num_kv_heads], per-head V scales.
        k_offset: fp32 [num_layers, num_kv_heads, head_dim], ``c`` in the rotated frame.
        rotation: fp32 [head_dim, head_dim] orthonormal ``R``, or None (identity).
        first_tokens: first positions of every sequence attended exactly.
    """

    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_offset: torch.Tensor
    rotation: torch.Tensor | None
    first_tokens: int

    @classmethod
    def from_result(cls, result: Any) -> KTransformScales:
        """From a ``kvquant.calibrate.CalibrationResult`` of granularity ``"k-transform"``."""
        from kvquant.calibrate.fp8 import hadamard_matrix

        if result.granularity != "k-transform" or result.k_offset is None:
            raise CalibrationError(
                f"KTransformScales.from_result: a {result.granularity} result; expected a "
                "k-transform one. Fix: calibrate with granularity='k-transform'."
            )
        d = int(result.k_offset.shape[-1])
        rot = hadamard_matrix(d) if result.rotation == "hadamard" else None
        return cls(result.k_scales, result.v_scales, result.k_offset, rot, result.first_tokens)

    def scaled(self, factor: float) -> KTransformScales:
        """The same transform with both scales multiplied by ``factor`` (the jitter control)."""
        return KTransformScales(
            self.k_scale * factor,
            self.v_scale * factor,
            self.k_offset,
            self.rotation,
            self.first_tokens,
        )


def _to_scale(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448``; an all-zero tensor gets 1.0 (any positive scale encodes zeros)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))


def fake_quantize_kv(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    *,
    group_size: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> torch.Tensor:
    """Round K or V through FP8 and back, the way kvquant's cache stores them.

    Values are clamped to the format's finite range before the cast (like the
    kernels); non-finite inputs stay NaN.

    Args:
        x: [B, Hkv, T, D] keys or values (HF layout, post-RoPE for keys).
        scale: fp32 [] (per-tensor), fp32 [Hkv] (per-head), or ``None`` for
            dynamic fp32 group scales (``amax / fp8_max`` per token, head and group).
        group_size: G for the dynamic scales; must divide D. Default 64 capped at D.
        fp8_dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.

    Returns:
        [B, Hkv, T, D] in ``x.dtype``: ``fp8(x / s) * s``.

    Raises:
        KVQuantError: a per-head scale with the wrong length, or G not dividing D.
    """
    limit = float(torch.finfo(fp8_dtype).max)
    xf = x.float()
    if scale is None:
        d = x.shape[-1]
        if group_size is None:
            group_size = min(64, d)
        if group_size <= 0 or d % group_size:
            raise OptionError(
                f"fake_quantize_kv: group_size {group_size} does not divide head_dim {d}; "
                "expected a positive divisor. Fix: pick G in the divisors of head_dim."
            )
        xg = xf.unflatten(-1, (d // group_size, group_size))
        amax = xg.abs().amax(dim=-1, keepdim=True)
        s = torch.where(amax > 0, amax / limit, torch.ones_like(amax))
        q = (xg / s).clamp(-limit, limit).to(fp8_dtype).float() * s
        out = q.flatten(-2)
    else:
        s = scale.float().to(x.device)
        if s.dim() == 1:
            if s.shape[0] != x.shape[1]:
                raise CalibrationError(
                    f"fake_quantize_kv: per-head scale has {s.shape[0]} entries but K/V have "
                    f"{x.shape[1]} heads; expected one per KV head. Fix: calibrate this model."
                )
            s = s.view(1, -1, 1, 1)
        out = (xf / s).clamp(-limit, limit).to(fp8_dtype).float() * s
    out = torch.where(torch.isfinite(xf), out, torch.nan)
    return out.to(x.dtype)


def _simulated_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """Attention function: fake-quantize K/V per the module's spec, then SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    spec: _SimSpec | None = getattr(module, _SIM_ATTR, None)
    fresh = key.shape[2] == query.shape[2]  # no cached prefix: the keys are this call's own
    if spec is not None and spec.mode != "none" and not (spec.exact_prompt and fresh):
        layer = int(getattr(module, "layer_idx", 0))
        exact = (key.float(), value.float())
        if spec.mode == "capture":
            k_amax = key.detach().float().abs().amax(dim=(0, 2, 3))
            v_amax = value.detach().float().abs().amax(dim=(0, 2, 3))
            prev = spec.captured.get(layer)
            if prev is not None:
                k_amax = torch.maximum(prev[0], k_amax)
                v_amax = torch.maximum(prev[1], v_amax)
            spec.captured[layer] = (k_amax, v_amax)
        elif spec.mode == "fp32-group":
            key = fake_quantize_kv(key, None, group_size=spec.group_size)
            value = fake_quantize_kv(value, None, group_size=spec.group_size)
        elif spec.mode == "k-transform":
            query, key, value = _k_transform(spec, layer, query, key, value)
        elif spec.mode == "dynamic":
            fmt = spec.scales if spec.scales is not None else DynamicFormat()
            return dynamic_attention(fmt, module, query, key, value, attention_mask, **kwargs)
        elif spec.mode == "fp4":
            return fp4_attention(spec.scales, module, query, key, value, attention_mask, **kwargs)
        else:
            if not isinstance(spec.scales, CalibratedScales):
                raise CalibrationError(
                    f"simulated attention: layer {layer} in mode {spec.mode!r} has "
                    f"{type(spec.scales).__name__} scales; expected CalibratedScales. Fix: pass "
                    "scales=calibrate(...)."
                )
            k_s, v_s = spec.scales.layer(layer, spec.mode)
            key = fake_quantize_kv(key, k_s)
            value = fake_quantize_kv(value, v_s)
        if spec.recent_tokens and spec.mode != "capture":
            from benchmarks.harness.fp4 import recent_window_attention

            kt = spec.scales if spec.mode == "k-transform" else None
            rotation = getattr(kt, "rotation", None)
            if rotation is not None:  # the ring holds keys in the transform's frame, no offset
                exact = (exact[0] @ rotation.to(exact[0].device), exact[1])
            return recent_window_attention(
                module, query, (key, value), exact, spec.recent_tokens, None
            )
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _k_transform(
    spec: _SimSpec, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, keys and values of the k-transform, in the rotated frame (see the module doc)."""
    from kvquant.calibrate.fp8 import fake_quantize_static, k_transform_keys

    kt = spec.scales
    if not isinstance(kt, KTransformScales):
        raise CalibrationError(
            f"simulated attention: layer {layer} in mode 'k-transform' needs KTransformScales; "
            f"got {type(kt).__name__}. Fix: pass scales=KTransformScales.from_result(...)."
        )
    q = query.float()
    if kt.rotation is not None:
        q = q @ kt.rotation.to(q.device)
    k = k_transform_keys(key, kt.k_scale[layer], kt.k_offset[layer], kt.rotation, kt.first_tokens)
    v = fake_quantize_static(value, kt.v_scale[layer])
    n = min(kt.first_tokens, v.shape[2])
    if n:
        v[:, :, :n] = value[:, :, :n].float()
    v = torch.where(torch.isfinite(value), v, torch.nan)
    return q.to(query.dtype), k.to(key.dtype), v.to(value.dtype)


@dataclass
class _SimSpec:
    mode: str
    scales: CalibratedScales | KTransformScales | DynamicFormat | Fp4KV | None = None
    group_size: int | None = None
    exact_prompt: bool = False
    recent_tokens: int = 0
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _register_simulation() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(SIMULATED_ATTENTION, _simulated_attention)
    AttentionMaskInterface.register(SIMULATED_ATTENTION, sdpa_mask)


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]
    if not mods:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no attention module with `layer_idx` and `k_proj` found; "
            "expected a Llama-style decoder. Fix: use a model whose attention calls "
            "transformers' AttentionInterface."
        )
    return mods


@contextlib.contextmanager
def simulate_fp8_kv(
    model: torch.nn.Module,
    mode: str,
    scales: CalibratedScales | KTransformScales | DynamicFormat | Fp4KV | None = None,
    *,
    group_size: int | None = None,
    exact_prompt: bool = False,
    recent_tokens: int = 0,
) -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Route the model's attention through simulated FP8 K/V rounding for a ``with`` block.

    The model's attention implementation is switched to :data:`SIMULATED_ATTENTION`
    and restored afterwards, together with every attribute set here.

    Args:
        model: a transformers causal LM (Llama-style attention modules).
        mode: ``"none"`` (same code path, no rounding), ``"capture"`` (record
            amax, no rounding), ``"per-tensor"``, ``"per-head"``, ``"fp32-group"``
            ``"k-transform"``, ``"dynamic"`` or ``"fp4"``.
        scales: calibrated scales, required by ``"per-tensor"`` and ``"per-head"``
            (:class:`CalibratedScales`) and ``"k-transform"`` (:class:`KTransformScales`);
            for ``"dynamic"`` a :class:`~benchmarks.harness.dynamic.DynamicFormat`
            (default: G = 64, no rotation); for ``"fp4"`` an
            :class:`~benchmarks.harness.fp4.Fp4KV`.

    Exactness contract: the static modes and ``fp32-group`` round every value as
    kvquant's write kernels do (same scales, same fp32 division, same clamp),
    so the stored codes are equal; attention then runs in SDPA on the
    dequantized values. ``k-transform`` computes the codes of
    ``write_kv`` with ``KTransformScales(s_k, s_v, k_offset=c, k_rotation=R)``
    (``fp8(clamp((k R - c) / s_k))``)
    and gives SDPA the rotated query ``q R`` and the keys ``k_hat * s_k + c``
    (the first ``first_tokens`` positions: ``k R`` and ``v`` exactly), so the
    scores are ``q R . (k_hat s_k + c)``: the kernels' ``q'.(k_hat s_k) + q'.c``
    in another summation order (equal within fp32 rounding, not bit for bit).
    The first tokens are the first positions of the key tensor, i.e. of the
    sequence (every window starts at position 0; a cached prefix starts there too).
    ``dynamic`` rounds ``k R`` and ``v`` (or ``v R``) with fp32-group scales exactly as
    ``fp32-group`` does (equal codes in the unrotated frame; in the rotated frame the codes
    of a write that rotates first), gives SDPA ``q R`` and multiplies its output by ``R^T``
    when V is rotated: the kernels' arithmetic within fp32 rounding. ``fp4`` rounds through
    the codes of kvquant's 4-bit reference quantizer (``quantize_fp4``, the codes the write
    kernels store) with ``kv_format``'s calibration-free scales (:mod:`benchmarks.harness.fp4`).
        group_size: G of ``"fp32-group"`` (default 64 capped at head_dim).
        exact_prompt: leave a call with no cached prefix unrounded, as kvquant does
            (a prompt attends over its own K/V; later calls read every key from
            FP8). Without it every call rounds.
        recent_tokens: with ``"per-tensor"``, ``"per-head"``, ``"fp32-group"`` or
            ``"k-transform"``: each query position reads its last ``recent_tokens`` keys and
            values unrounded (keys in the k-transform's rotated frame, without its offset),
            the older ones rounded, as a decode step of a cache patched with
            ``recent_tokens`` does (eager fp32 attention, no padding; ``"dynamic"`` and
            ``"fp4"`` take it from their format).

    Yields:
        In ``"capture"`` mode, a dict filled during forwards: layer ->
        (k_amax fp32 [Hkv], v_amax fp32 [Hkv]); otherwise an empty dict.

    Raises:
        KVQuantError: unknown mode, or static mode without scales.
        UnsupportedModelError: the model switched to another attention implementation.
    """
    if mode not in _MODES:
        raise OptionError(
            f"simulate_fp8_kv: mode {mode!r} is unknown; expected one of {_MODES}. "
            "Fix: pass one of those names."
        )
    if mode in ("per-tensor", "per-head", "k-transform", "fp4") and scales is None:
        raise OptionError(
            f"simulate_fp8_kv: mode {mode!r} needs static scales but scales=None. "
            "Fix: pass scales=calibrate(model, calibration_ids)."
        )
    _register_simulation()
    hf_model: Any = model
    config = hf_model.config
    previous = config._attn_implementation
    if recent_tokens and mode not in ("per-tensor", "per-head", "fp32-group", "k-transform"):
        raise OptionError(
            f"simulate_fp8_kv: recent_tokens={recent_tokens} with mode {mode!r}; expected one "
            "of 'per-tensor', 'per-head', 'fp32-group', 'k-transform'. Fix: pass it in the "
            "DynamicFormat / Fp4KV of the other modes."
        )
    spec = _SimSpec(
        mode=mode, scales=scales, group_size=group_size, exact_prompt=exact_prompt,
        recent_tokens=recent_tokens,
    )  # fmt: skip
    mods = _attention_modules(model)
    hf_model.set_attn_implementation(SIMULATED_ATTENTION)
    try:
        if config._attn_implementation != SIMULATED_ATTENTION:
            raise UnsupportedModelError(
                f"{type(model).__name__}: attention implementation stayed "
                f"{config._attn_implementation!r} after set_attn_implementation"
                f"({SIMULATED_ATTENTION!r}); expected the switch to take. Fix: use a model "
                "whose source calls ALL_ATTENTION_FUNCTIONS.get_interface."
            )
        for mod in mods:
            setattr(mod, _SIM_ATTR, spec)
        yield spec.captured
    finally:
        for mod in mods:
            if hasattr(mod, _SIM_ATTR):
                delattr(mod, _SIM_ATTR)
        hf_model.set_attn_implementation(previous)


@dataclass(frozen=True)
class TokenStats:
    """Per-position results of a teacher-forced forward.

    Attributes:
        nll: fp32 [T - 1], negative log-likelihood of token t + 1 given tokens <= t.
        argmax: int64 [T - 1], the model's top-1 prediction at each position.
    """

    nll: torch.Tensor
    argmax: torch.Tensor

    @property
    def perplexity(self) -> float:
        """``exp(mean NLL)``."""
        return math.exp(float(self.nll.double().mean()))


@torch.no_grad()
def teacher_forced(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    cache_factory: Callable[[], Any] | None = None,
    chunk: int = 512,
) -> TokenStats:
    """One teacher-forced forward; next-token NLL and argmax at every position.

    Logits are computed through the output head in chunks of ``chunk`` positions
    (in fp32), so the full [T, vocab] matrix never exists at once.

    Args:
        model: a transformers causal LM with ``.model`` (decoder) and ``.lm_head``.
        input_ids: int64 [B, T], T >= 2: B independent windows of equal length
            (no padding); their positions are pooled.
        cache_factory: when given, a fresh cache object is passed to the forward
            (``cache=`` or ``past_key_values=``, by feature test) with
            ``use_cache=True``, in two calls: the first position alone, then every
            later one as a chunk over it. A kvquant cache hands a prompt with no
            cached prefix its own unquantized K/V, so one call would measure no
            FP8 at all; the chunk attends over the FP8 pages (its own keys
            included), the regime of every decode step. Otherwise the forward
            runs once with ``use_cache=False``.
        chunk: positions per output-head chunk.

    Returns:
        :class:`TokenStats` over B * (T - 1) positions (window after window).

    Raises:
        KVQuantError: ``input_ids`` is not [B, T] with T >= 2.
        UnsupportedModelError: the model has no ``.model`` / ``.lm_head``.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 2:
        raise OptionError(
            f"teacher_forced: input_ids has shape {tuple(input_ids.shape)}; expected [B, T] "
            "with T >= 2. Fix: tokenize a text (see benchmarks.harness.accuracy.tokenize)."
        )
    decoder = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if decoder is None or head is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no `.model` decoder or `.lm_head`; expected a "
            "*ForCausalLM model. Fix: pass the causal-LM wrapper, not the bare decoder."
        )
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    if cache_factory is None:
        hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
    else:
        from kvquant.integrations.hf.compat import cache_keyword

        kwargs = {"use_cache": True, cache_keyword(decoder): cache_factory()}
        first = decoder(input_ids=ids[:, :1], **kwargs).last_hidden_state
        rest = decoder(input_ids=ids[:, 1:], **kwargs).last_hidden_state
        hidden = torch.cat([first, rest], dim=1)
    hidden = hidden[:, :-1].flatten(0, 1)
    targets = ids[:, 1:].flatten()
    nll = []
    argmax = []
    for start in range(0, hidden.shape[0], chunk):
        logits = head(hidden[start : start + chunk]).float()
        softcap = getattr(model.config, "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        logp = torch.log_softmax(logits, dim=-1)
        nll.append(-logp.gather(-1, targets[start : start + chunk, None])[:, 0])
        argmax.append(logits.argmax(dim=-1))
    return TokenStats(nll=torch.cat(nll).cpu(), argmax=torch.cat(argmax).cpu())


@torch.no_grad()
def calibrate(model: torch.nn.Module, input_ids: torch.Tensor) -> CalibratedScales:
    """Measure post-RoPE K/V amax per layer and KV head on a calibration text.

    Args:
        model: an unpatched transformers causal LM.
        input_ids: int64 [1, T] calibration tokens.

    Returns:
        :class:`CalibratedScales` (static scales are ``amax / 448``).

    Raises:
        UnsupportedModelError: some layer's attention never ran through the hook.
    """
    with simulate_fp8_kv(model, "capture") as captured:
        teacher_forced(model, input_ids)
    layers = len(_attention_modules(model))
    missing = [i for i in range(layers) if i not in captured]
    if missing:
        raise UnsupportedModelError(
            f"calibrate: layers {missing[:8]} never called the simulation attention function; "
            "expected every attention layer to. Fix: use a model whose attention calls "
            "transformers' AttentionInterface."
        )
    k = torch.stack([captured[i][0] for i in range(layers)]).cpu()
    v = torch.stack([captured[i][1] for i in range(layers)]).cpu()
    return CalibratedScales(k_amax=k, v_amax=v, num_tokens=int(input_ids.shape[1]))


@dataclass(frozen=True)
class EvalResult:
    """One row of an accuracy table.

    Attributes:
        label: what was measured, e.g. ``"simulated per-tensor"``.
        perplexity: ``exp(mean NLL)`` on the evaluation text.
        delta_pct: perplexity change vs the reference, in percent (0 for the reference).
        top1_agreement: fraction of positions whose argmax equals the reference's.
        num_tokens: evaluated positions (T - 1).
        seconds: wall time of the forward.
    """

    label: str
    perplexity: float
    delta_pct: float
    top1_agreement: float
    num_tokens: int
    seconds: float


def evaluate(
    label: str,
    stats: TokenStats,
    reference: TokenStats,
    seconds: float = 0.0,
) -> EvalResult:
    """Compare a run's token statistics with the reference run.

    Args:
        label: row label.
        stats: the run under test.
        reference: the unquantized run on the same tokens.
        seconds: wall time to record.

    Returns:
        An :class:`EvalResult`.

    Raises:
        KVQuantError: the two runs cover different numbers of positions.
    """
    if stats.argmax.shape != reference.argmax.shape:
        raise OptionError(
            f"evaluate({label!r}): {stats.argmax.shape[0]} positions vs the reference's "
            f"{reference.argmax.shape[0]}; expected the same evaluation tokens. Fix: reuse "
            "the same input_ids."
        )
    ppl = stats.perplexity
    ref = reference.perplexity
    return EvalResult(
        label=label,
        perplexity=ppl,
        delta_pct=100.0 * (ppl / ref - 1.0),
        top1_agreement=float((stats.argmax == reference.argmax).double().mean()),
        num_tokens=int(stats.argmax.shape[0]),
        seconds=seconds,
    )


def tokenize(
    tokenizer: Any,
    text: str,
    max_tokens: int,
    *,
    min_tokens: int = 2,
    windows: int = 1,
) -> torch.Tensor:
    """Tokenize a document and cut it into consecutive windows of equal length.

    Args:
        tokenizer: a transformers tokenizer.
        text: the document.
        max_tokens: tokens per window (the single window may be shorter, down to ``min_tokens``).
        min_tokens: raise if the single window would be shorter.
        windows: number of consecutive, non-overlapping windows of exactly
            ``max_tokens`` tokens each (``windows > 1`` needs ``windows * max_tokens`` tokens).

    Returns:
        int64 [windows, T].

    Raises:
        KVQuantError: the text is too short.
    """
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0].long()
    if windows > 1:
        need = windows * max_tokens
        if ids.shape[0] < need:
            raise OptionError(
                f"tokenize: the text gives {ids.shape[0]} tokens; expected at least {need} for "
                f"{windows} windows of {max_tokens}. Fix: fewer windows or a longer document."
            )
        return ids[:need].view(windows, max_tokens)
    ids = ids[:max_tokens]
    if ids.shape[0] < min_tokens:
        raise OptionError(
            f"tokenize: the text gives {ids.shape[0]} tokens; expected at least {min_tokens}. "
            "Fix: use a longer document."
        )
    return ids.view(1, -1)


def format_table(results: Sequence[EvalResult]) -> str:
    """A Markdown table of results (perplexity, change, top-1 agreement, tokens, time).

    Args:
        results: rows, the reference first.

    Returns:
        The table as text.
    """
    lines = [
        "| KV cache | perplexity | Δ vs bf16 KV | top-1 agreement | tokens | time (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.label} | {r.perplexity:.4f} | {r.delta_pct:+.2f}% | "
            f"{100 * r.top1_agreement:.1f}% | {r.num_tokens} | {r.seconds:.1f} |"
        )
    return "\n".join(lines)


def run_simulated(
    model: torch.nn.Module,
    calibration_ids: torch.Tensor,
    evaluation_ids: torch.Tensor,
    *,
    group_size: int = 64,
) -> tuple[list[EvalResult], CalibratedScales, TokenStats]:
    """Reference + simulated FP8 K/V rounding in the three granularities.

    Args:
        model: an unpatched transformers causal LM.
        calibration_ids: int64 [1, Tc] for :func:`calibrate`.
        evaluation_ids: int64 [B, Te] for the teacher-forced runs.
        group_size: G of ``fp32-group``.

    Returns:
        ``(rows, scales, reference_stats)``; rows: reference, per-tensor,
        per-head, fp32-group.
    """
    scales = calibrate(model, calibration_ids)
    t0 = time.perf_counter()
    with simulate_fp8_kv(model, "none"):
        reference = teacher_forced(model, evaluation_ids)
    rows = [evaluate("bf16 KV (reference)", reference, reference, time.perf_counter() - t0)]
    for mode in ("per-tensor", "per-head", "fp32-group"):
        t0 = time.perf_counter()
        with simulate_fp8_kv(model, mode, scales, group_size=group_size):
            stats = teacher_forced(model, evaluation_ids)
        label = f"simulated FP8 {mode}" + (f" (G={group_size})" if mode == "fp32-group" else "")
        rows.append(evaluate(label, stats, reference, time.perf_counter() - t0))
    return rows, scales, reference


def run_kvquant(
    model: torch.nn.Module,
    evaluation_ids: torch.Tensor,
    reference: TokenStats,
    *,
    label: str,
    scales: Any = None,
    scale_format: str = "auto",
    group_size: int | None = None,
    backend: str = "torch",
    page_size: int = 16,
) -> tuple[EvalResult, Any]:
    """Patch ``model`` with kvquant, run the teacher-forced forward, then unpatch.

    Args:
        model: an unpatched transformers causal LM.
        evaluation_ids: int64 [B, T].
        reference: the unquantized run on the same tokens.
        label: row label.
        scales: what :func:`kvquant.patch` takes as ``scales=`` (a checkpoint
            folder, a ``{tensor_name: tensor}`` mapping, or None).
        scale_format: registry format (``"auto"``, ``"fp32-group"``, ...).
        group_size: G of ``fp32-group``.
        backend: kernel backend (``"torch"`` on CPU).
        page_size: token slots per page.

    Returns:
        ``(row, resolved ModelScales)`` — the scales the patch installed.
    """
    import kvquant

    handle = kvquant.patch(
        model,
        scales=scales,
        scale_format=scale_format,
        group_size=group_size,
        backend=backend,
        page_size=page_size,
    )
    tokens = int(evaluation_ids.numel()) + int(evaluation_ids.shape[0]) * page_size
    try:
        t0 = time.perf_counter()
        stats = teacher_forced(
            model,
            evaluation_ids,
            cache_factory=lambda: handle.new_cache(max_cache_tokens=tokens),
        )
        seconds = time.perf_counter() - t0
        resolved = handle.scales
    finally:
        handle.remove()
    return evaluate(label, stats, reference, seconds), resolved


def run_kvquant_checkpoints(
    model: torch.nn.Module,
    checkpoint: str | Path,
    scales: CalibratedScales,
    evaluation_ids: torch.Tensor,
    reference: TokenStats,
    workdir: str | Path,
    *,
    variants: Sequence[str] | None = None,
    group_size: int = 64,
    backend: str = "torch",
) -> list[EvalResult]:
    """kvquant on checkpoint copies carrying the calibrated scales in each producer convention.

    For every variant of :data:`benchmarks.harness.smollm2.SCALE_CONVENTIONS`, a
    copy of ``checkpoint`` with the scales is written under ``workdir`` and
    ``kvquant.patch(model, scales=copy)`` runs the evaluation; a last row runs
    the dynamic ``fp32-group`` format (no stored scales).

    Args:
        model: the unpatched model loaded from ``checkpoint``.
        checkpoint: its single-file checkpoint folder.
        scales: calibrated on another text.
        evaluation_ids: int64 [B, T].
        reference: the unquantized run on the same tokens.
        workdir: where the copies go (weights are symlinked, not copied).
        variants: subset of the variants (default: all).
        group_size: G of the ``fp32-group`` row.
        backend: kernel backend.

    Returns:
        One row per variant, then the ``fp32-group`` row.
    """
    from benchmarks.harness.smollm2 import SCALE_CONVENTIONS, write_scaled_copy

    k, v = scales.per_head()
    rows = []
    for variant in variants if variants is not None else list(SCALE_CONVENTIONS):
        folder = write_scaled_copy(checkpoint, Path(workdir) / variant, variant, k, v)
        granularity = SCALE_CONVENTIONS[variant][1]
        row, _ = run_kvquant(
            model,
            evaluation_ids,
            reference,
            label=f"kvquant {granularity} ({variant} checkpoint)",
            scales=folder,
            backend=backend,
        )
        rows.append(row)
    row, _ = run_kvquant(
        model,
        evaluation_ids,
        reference,
        label=f"kvquant fp32-group (G={group_size}, dynamic)",
        scales={},
        scale_format="fp32-group",
        group_size=group_size,
        backend=backend,
    )
    rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: measure simulated FP8 K/V rounding on SmolLM2-135M (and kvquant if present).

    Args:
        argv: arguments (default ``sys.argv[1:]``).

    Returns:
        Exit status 0.
    """
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.harness.accuracy",
        description="Perplexity and top-1 agreement of SmolLM2-135M with a simulated and a "
        "real (kvquant) FP8 KV cache, teacher-forced on the pinned evaluation texts "
        "(benchmarks/data/texts/evaluation, one window per text).",
    )
    parser.add_argument(
        "--tokens", type=int, default=1024, help="evaluation tokens per text (one window each)"
    )
    parser.add_argument(
        "--calibration-tokens",
        type=int,
        default=1024,
        help="calibration tokens per text (benchmarks/data/texts/calibration, concatenated)",
    )
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument(
        "--kvquant", action="store_true", help="also run kvquant.patch on checkpoint copies"
    )
    parser.add_argument("--backend", default="torch", help="kvquant kernel backend")
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the model runs (e.g. cuda, with --backend triton or auto)",
    )
    parser.add_argument("--json", metavar="PATH", default=None, help="write the rows as JSON")
    args = parser.parse_args(argv)

    from benchmarks.harness.smollm2 import load_smollm2
    from benchmarks.harness.texts import (
        TEXTS_DIR,
        calibration_ids,
        calibration_texts,
        evaluation_ids,
        evaluation_texts,
    )

    torch.manual_seed(0)
    model, tokenizer = load_smollm2()
    model.to(args.device)
    calib_ids = calibration_ids(tokenizer, args.calibration_tokens)
    eval_ids = evaluation_ids(tokenizer, args.tokens)
    calib_names = ", ".join(t.name for t in calibration_texts())
    eval_names = ", ".join(t.name for t in evaluation_texts())
    rows, scales, reference = run_simulated(model, calib_ids, eval_ids, group_size=args.group_size)
    if args.kvquant:
        import tempfile

        from benchmarks.harness.smollm2 import smollm2_path

        with tempfile.TemporaryDirectory(prefix="kvquant-eval-") as workdir:
            rows += run_kvquant_checkpoints(
                model,
                smollm2_path(),
                scales,
                eval_ids,
                reference,
                workdir,
                group_size=args.group_size,
                backend=args.backend,
            )
    header = (
        f"SmolLM2-135M-Instruct (fp32 compute on {args.device}, bf16 weights, kvquant "
        f"backend {args.backend}), calibration: {calib_names} "
        f"({calib_ids.shape[1]} tokens), evaluation: {eval_names} "
        f"({eval_ids.shape[0]} x {eval_ids.shape[1]} tokens)"
    )
    print(header)
    print(format_table(rows))
    if args.json:
        payload = {
            "header": header,
            "texts": str(TEXTS_DIR.relative_to(TEXTS_DIR.parents[2])),
            "calibration_texts": calib_names,
            "evaluation_texts": eval_names,
            "rows": [asdict(r) for r in rows],
        }
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
