"""``kvquant calibrate``: static FP8 KV scales for a checkpoint that has none, chosen by their error.

:func:`calibrate` runs the model over calibration text, keeps bounded K/V
statistics (:mod:`~kvquant.calibrate.statistics`, :mod:`~kvquant.calibrate.collection`),
chooses per-tensor or per-head scales by the expected FP8 error of every clipping
ratio (:mod:`~kvquant.calibrate.search`) or the k-transform
(:mod:`~kvquant.calibrate.k_transform`), and measures every candidate format on
held-out windows (:mod:`~kvquant.calibrate.evaluate`, :mod:`~kvquant.calibrate.report`);
given a byte budget, :mod:`~kvquant.calibrate.layer_map` proposes a K/V format per layer.
:func:`write_calibrated_checkpoint` writes a copy carrying the scales
(:mod:`~kvquant.calibrate.writing`); :mod:`~kvquant.calibrate.data` reads the text.
How it works and why: docs/dev/calibration.md. Transformers is imported lazily.
"""

from __future__ import annotations

from kvquant.calibrate.collection import collect_statistics
from kvquant.calibrate.data import (
    MAX_TEXT_BYTES,
    CalibrationData,
    check_text_file,
    load_dataset_samples,
    load_text_files,
)
from kvquant.calibrate.evaluate import candidate_formats, evaluate_formats
from kvquant.calibrate.fp8 import FP8_E4M3_MAX
from kvquant.calibrate.k_transform import choose_k_transform
from kvquant.calibrate.layer_map import LayerFormat, LayerFormatMap, propose_layer_formats
from kvquant.calibrate.options import (
    CENTRES,
    CONVENTIONS,
    OBJECTIVES,
    ROTATIONS,
    Centre,
    Convention,
    Granularity,
    Objective,
    Rotation,
)
from kvquant.calibrate.pipeline import calibrate
from kvquant.calibrate.report import CalibrationReport
from kvquant.calibrate.result import CalibrationResult, LayerCalibration
from kvquant.calibrate.search import DEFAULT_RATIOS, choose_scales, expected_mse, search_ratios
from kvquant.calibrate.statistics import (
    BINS_PER_OCTAVE,
    LOG2_MAX,
    LOG2_MIN,
    ChannelStatistics,
    KVStatistics,
    attention_weights,
)
from kvquant.calibrate.writing import write_calibrated_checkpoint

__all__ = [
    "BINS_PER_OCTAVE",
    "CENTRES",
    "CONVENTIONS",
    "DEFAULT_RATIOS",
    "FP8_E4M3_MAX",
    "LOG2_MAX",
    "LOG2_MIN",
    "MAX_TEXT_BYTES",
    "OBJECTIVES",
    "ROTATIONS",
    "CalibrationData",
    "CalibrationReport",
    "CalibrationResult",
    "Centre",
    "ChannelStatistics",
    "Convention",
    "Granularity",
    "KVStatistics",
    "LayerCalibration",
    "LayerFormat",
    "LayerFormatMap",
    "Objective",
    "Rotation",
    "attention_weights",
    "calibrate",
    "candidate_formats",
    "check_text_file",
    "choose_k_transform",
    "choose_scales",
    "collect_statistics",
    "evaluate_formats",
    "expected_mse",
    "load_dataset_samples",
    "load_text_files",
    "propose_layer_formats",
    "search_ratios",
    "write_calibrated_checkpoint",
]
