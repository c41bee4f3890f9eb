"""Real English texts found on the machine, for calibration and evaluation runs.

No text is written for the tests: the helpers read licence documents that a
Linux machine or a Python installation already carries (the Debian/Ubuntu
``/usr/share/common-licenses`` folder, the CPython licence next to the standard
library, licence files shipped inside installed distributions). Calibration and
evaluation always use two *different* documents, so scales are never fitted on
the text they are judged on.

Lookup order (first readable, long-enough candidate wins):

* calibration: ``$KVQUANT_CALIBRATION_TEXT``, then ``common-licenses/Apache-2.0``,
  ``MPL-2.0``, ``Artistic``, the CPython ``LICENSE.txt``, licence files of
  installed distributions;
* evaluation: ``$KVQUANT_EVALUATION_TEXT``, then ``common-licenses/GPL-3``,
  ``GPL-2``, ``LGPL-2.1``, ``GFDL-1.3``, the CPython ``LICENSE.txt``, licence
  files of installed distributions.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvquant.errors import TextNotFoundError

__all__ = [
    "MIN_CALIBRATION_CHARS",
    "MIN_EVALUATION_CHARS",
    "Text",
    "TextNotFoundError",
    "calibration_text",
    "evaluation_text",
    "text_pair",
]

MIN_CALIBRATION_CHARS = 4_000
"""Shortest calibration document accepted (about 1000 tokens)."""

MIN_EVALUATION_CHARS = 10_000
"""Shortest evaluation document accepted (comfortably more than 1500 tokens)."""

_COMMON_LICENSES = Path("/usr/share/common-licenses")
_CALIBRATION_NAMES = ("Apache-2.0", "MPL-2.0", "Artistic")
_EVALUATION_NAMES = ("GPL-3", "GPL-2", "LGPL-2.1", "GFDL-1.3")
# Distributions that kvquant's test environment installs, in a fixed order.
_DISTRIBUTIONS = ("numpy", "hypothesis", "transformers", "torch", "sympy", "safetensors")


@dataclass(frozen=True)
class Text:
    """A real document read from disk.

    Attributes:
        name: short label, e.g. ``"GPL-3"`` or ``"cpython/LICENSE.txt"``.
        path: where it was read.
        text: the full content (UTF-8).
    """

    name: str
    path: Path
    text: str

    @property
    def digest(self) -> str:
        """sha256 of the content (two candidates with equal digests are the same text)."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def _stdlib_license_paths() -> list[Path]:
    paths = []
    for key in ("stdlib", "platstdlib"):
        try:
            paths.append(Path(sysconfig.get_paths()[key]) / "LICENSE.txt")
        except KeyError:
            continue
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    paths += [
        Path(sys.base_prefix) / "lib" / version / "LICENSE.txt",
        Path("/usr/lib") / version / "LICENSE.txt",
    ]
    return paths


def _distribution_license_paths() -> Iterator[tuple[str, Path]]:
    for dist_name in _DISTRIBUTIONS:
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for entry in sorted(dist.files or (), key=str):
            parts = str(entry).lower()
            if ".dist-info" in parts and ("licen" in parts or "copying" in parts):
                yield f"{dist_name}/{Path(str(entry)).name}", Path(str(dist.locate_file(entry)))


def _candidates(env_var: str, common_names: Iterable[str]) -> Iterator[tuple[str, Path]]:
    override = os.environ.get(env_var)
    if override:
        yield f"${env_var}", Path(override).expanduser()
    for name in common_names:
        yield name, _COMMON_LICENSES / name
    for path in _stdlib_license_paths():
        yield "cpython/LICENSE.txt", path
    yield from _distribution_license_paths()


def _read(name: str, path: Path, min_chars: int) -> Text | None:
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if len(content) < min_chars:
        return None
    return Text(name=name, path=path, text=content)


def _find(
    env_var: str, common_names: Iterable[str], min_chars: int, exclude: str | None, role: str
) -> Text:
    tried = []
    for name, path in _candidates(env_var, common_names):
        found = _read(name, path, min_chars)
        tried.append(str(path))
        if found is not None and found.digest != exclude:
            return found
    raise TextNotFoundError(
        f"no {role} text found: none of {len(tried)} candidates ({', '.join(tried[:6])}, ...) "
        f"is a readable UTF-8 document of at least {min_chars} characters"
        + (" different from the calibration text" if exclude else "")
        + f". Fix: install the `base-files` licences (/usr/share/common-licenses) or set "
        f"{env_var} to a plain-text English document."
    )


def calibration_text(min_chars: int = MIN_CALIBRATION_CHARS) -> Text:
    """The calibration document (``Apache-2.0`` on Debian/Ubuntu machines).

    Args:
        min_chars: shortest acceptable document.

    Returns:
        The first readable candidate of the calibration lookup order.

    Raises:
        TextNotFoundError: no candidate is readable and long enough.
    """
    return _find("KVQUANT_CALIBRATION_TEXT", _CALIBRATION_NAMES, min_chars, None, "calibration")


def evaluation_text(min_chars: int = MIN_EVALUATION_CHARS, *, exclude: Text | None = None) -> Text:
    """The evaluation document (``GPL-3`` on Debian/Ubuntu machines).

    Args:
        min_chars: shortest acceptable document.
        exclude: a document this one must differ from (the calibration text).

    Returns:
        The first readable candidate of the evaluation lookup order that differs
        from ``exclude``.

    Raises:
        TextNotFoundError: no candidate is readable, long enough and different.
    """
    digest = exclude.digest if exclude is not None else None
    return _find("KVQUANT_EVALUATION_TEXT", _EVALUATION_NAMES, min_chars, digest, "evaluation")


def text_pair() -> tuple[Text, Text]:
    """A calibration and an evaluation document, guaranteed to differ.

    Returns:
        ``(calibration, evaluation)``.

    Raises:
        TextNotFoundError: either document is missing.
    """
    calibration = calibration_text()
    return calibration, evaluation_text(exclude=calibration)
