"""Numerics helper for kernel tests: relative error, max error and first mismatches.

``assert_close_rel(out, ref, rel_tol=...)`` fails when ``‖out − ref‖ / ‖ref‖`` exceeds
``rel_tol`` or when ``out`` holds any NaN/inf that ``ref`` does not; the message
reports the relative error, the max absolute error and where, and the first
mismatching elements. It never relaxes a tolerance on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ErrorReport", "assert_close_rel", "error_report"]


@dataclass(frozen=True)
class ErrorReport:
    """Summary of ``out`` against ``ref`` (both compared in fp64)."""

    rel_err: float
    max_abs_err: float
    max_abs_index: tuple[int, ...]
    ref_rms: float
    non_finite: int
    first_mismatches: list[tuple[tuple[int, ...], float, float]]

    def __str__(self) -> str:
        lines = [
            f"rel err {self.rel_err:.3e}, max abs err {self.max_abs_err:.3e} at "
            f"{self.max_abs_index}, ref rms {self.ref_rms:.3e}, non-finite in out "
            f"(where ref is finite): {self.non_finite}"
        ]
        for idx, got, want in self.first_mismatches:
            lines.append(f"  at {idx}: got {got:.6g}, want {want:.6g}")
        return "\n".join(lines)


def error_report(
    out: torch.Tensor, ref: torch.Tensor, *, mismatch_rel: float = 0.05, max_items: int = 8
) -> ErrorReport:
    """Compare ``out`` with ``ref`` (same shape).

    Args:
        out: tensor under test.
        ref: reference tensor.
        mismatch_rel: an element is listed as a mismatch when its error exceeds
            ``mismatch_rel * rms(ref)`` (or it is non-finite where ``ref`` is finite).
        max_items: how many mismatches to list.

    Returns:
        An :class:`ErrorReport`.
    """
    if out.shape != ref.shape:
        raise AssertionError(f"shape mismatch: out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    o = out.detach().double().cpu()
    r = ref.detach().double().cpu()
    bad_nf = (~torch.isfinite(o)) & torch.isfinite(r)
    diff = (o - r).abs()
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, float("inf")))
    ref_norm = float(r.norm())
    ref_rms = ref_norm / max(1, r.numel()) ** 0.5
    if bad_nf.any():
        rel = float("inf")
    else:
        rel = float((o - r).norm()) / ref_norm if ref_norm > 0 else float((o - r).norm())
    if diff.numel():
        flat = int(diff.argmax())
        max_err = float(diff.reshape(-1)[flat])
        max_idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    else:
        max_err, max_idx = 0.0, ()
    mism = (diff > mismatch_rel * max(ref_rms, 1e-30)) | bad_nf
    items = []
    for idx in mism.nonzero()[:max_items].tolist():
        items.append((tuple(idx), float(o[tuple(idx)]), float(r[tuple(idx)])))
    return ErrorReport(rel, max_err, max_idx, ref_rms, int(bad_nf.sum()), items)


def assert_close_rel(
    out: torch.Tensor, ref: torch.Tensor, *, rel_tol: float = 5e-3, name: str = ""
) -> ErrorReport:
    """Assert ``‖out − ref‖ / ‖ref‖ <= rel_tol`` and no spurious non-finite values.

    Args:
        out: tensor under test.
        ref: reference tensor (same shape).
        rel_tol: relative error bound.
        name: case label for the failure message.

    Returns:
        The :class:`ErrorReport` (for logging).
    """
    rep = error_report(out, ref)
    if not (rep.rel_err <= rel_tol) or rep.non_finite:
        raise AssertionError(f"{name}: exceeds rel tol {rel_tol:.1e}\n{rep}")
    return rep
