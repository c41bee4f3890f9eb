"""The kvquant error hierarchy.

Every public error derives from :class:`KVQuantError` and from the builtin
exception a caller would naturally catch (``ValueError``, ``KeyError``,
``RuntimeError``). Messages name the object (module path, tensor name), what
was found, what was expected, and the fix. They never print tensor contents.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BatchingError",
    "CacheCapacityError",
    "CacheUsageError",
    "CalibrationError",
    "CheckpointError",
    "ConventionError",
    "ExportError",
    "ExportTargetExistsError",
    "FormatRegistrationError",
    "KVQuantError",
    "KernelInputError",
    "OptionError",
    "OptionTypeError",
    "ScaleFormatError",
    "UnknownFormatError",
    "UnsupportedModelError",
    "VerbosityError",
]


class KVQuantError(Exception):
    """Base class of every error kvquant raises on purpose."""


class ScaleFormatError(KVQuantError, ValueError):
    """A checkpoint's KV scales cannot be normalised to a canonical form.

    Raised by discovery and by the registry's normalise-or-reject step: wrong
    shape, non-float dtype, non-finite, zero, negative or underflowing values,
    K without V, layers without scales.
    """


class CheckpointError(KVQuantError, ValueError):
    """A path is not a readable checkpoint (missing folder, no config.json, bad header)."""


class FormatRegistrationError(KVQuantError, ValueError):
    """A scale format cannot be registered: the name is taken or its contract is broken."""


class UnknownFormatError(KVQuantError, KeyError):
    """A scale format name is not registered."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class KernelInputError(KVQuantError, ValueError):
    """A kernel entry point got a tensor of the wrong dtype, shape, device or strides."""


class CacheCapacityError(KVQuantError, RuntimeError):
    """The paged cache has too few free pages (or slots) for a request.

    Raised before anything is written: the cache is left as it was.
    """


class CacheUsageError(KVQuantError, ValueError):
    """A paged cache is built or called with bad arguments, or before it holds anything.

    For example: an unknown or repeated sequence id, a negative token count, a
    layer index out of range, a group size that does not divide the head dim,
    K/V of the wrong shape, a batch size the cache was not built for, a model
    that is not patched.

    Raised before anything changes: the cache is left as it was.
    """


class BackendError(KVQuantError, RuntimeError):
    """An explicitly requested backend cannot run here (e.g. ``triton`` without a GPU)."""


class UnsupportedModelError(KVQuantError, RuntimeError):
    """A model (or one of its features) cannot run on kvquant's attention path."""


class BatchingError(KVQuantError, RuntimeError):
    """A request of transformers' continuous batching failed inside its batching thread.

    Raised in the caller's thread (``generate_batch``, ``generate(cache_implementation=
    "paged")``, the manager's ``get_result``) instead of a result that comes back empty;
    the thread's own exception, when there is one, is chained (``__cause__``).
    """


class ExportError(KVQuantError, ValueError):
    """A checkpoint cannot be exported for the requested engine.

    Raised before anything is written to the output folder: no static scales to
    export, a granularity or producer convention the engine's loader cannot
    take, checkpoint-level errors, or a bad output path.
    """


class ExportTargetExistsError(ExportError, FileExistsError):
    """The output folder already exists (pass ``force=True`` / ``--force`` to replace it)."""


class CalibrationError(KVQuantError, ValueError):
    """Calibration cannot run or its result cannot be written (bad input, option or target)."""


class OptionError(KVQuantError, ValueError):
    """An option of a kvquant entry point (``patch``, ``KVQuantConfig``, the CLI) has a bad value.

    Raised before anything changes: the model is left as it was.
    """


class OptionTypeError(OptionError, TypeError):
    """An option of a kvquant entry point has the wrong type (e.g. ``scales=42``)."""


class ConventionError(KVQuantError, ValueError):
    """An unknown producer convention, or a scale kind / granularity that producer does not store."""


class VerbosityError(KVQuantError, ValueError):
    """An unknown log verbosity (:func:`kvquant.set_verbosity`, ``KVQUANT_VERBOSITY``)."""
