"""The pinned calibration and evaluation texts in ``benchmarks/data/texts/``.

Test and benchmark harness, not part of the kvquant package. Every machine reads
the same files from the checkout, so results computed on them do not depend on
the operating system or the Python installation.

Two disjoint sets, each of several kinds of text (``benchmarks/data/texts/README.md``
says where each file comes from and under which licence):

* ``evaluation/``: ``code.txt`` (Python source), ``dialogue.txt`` (a chat
  transcript), ``reference.txt`` (language-reference prose), ``story.txt``
  (narrative prose);
* ``calibration/``: ``code.txt``, ``prose.txt`` (an essay), ``reference.txt``.

Scales are never fitted on the text they are judged on: no file appears in both sets.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "TEXTS_DIR",
    "Text",
    "calibration_ids",
    "calibration_texts",
    "evaluation_ids",
    "evaluation_texts",
]

TEXTS_DIR = Path(__file__).resolve().parents[1] / "data" / "texts"
"""Folder of the pinned texts (``calibration/`` and ``evaluation/``)."""


@dataclass(frozen=True)
class Text:
    """One pinned document.

    Attributes:
        name: ``"<set>/<file stem>"``, e.g. ``"evaluation/story"``.
        path: where it was read.
        text: the full content (UTF-8).
    """

    name: str
    path: Path
    text: str

    @property
    def digest(self) -> str:
        """sha256 of the content."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def _read_set(role: str) -> tuple[Text, ...]:
    folder = TEXTS_DIR / role
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(
            f"no {role} texts in {folder}; expected the *.txt files committed with kvquant's "
            "benchmarks. Fix: run from a complete checkout (git restore benchmarks/data)."
        )
    return tuple(
        Text(name=f"{role}/{f.stem}", path=f, text=f.read_text(encoding="utf-8")) for f in files
    )


def calibration_texts() -> tuple[Text, ...]:
    """The calibration set, one :class:`Text` per file, sorted by name.

    Raises:
        FileNotFoundError: the folder holds no texts (an incomplete checkout).
    """
    return _read_set("calibration")


def evaluation_texts() -> tuple[Text, ...]:
    """The evaluation set, one :class:`Text` per file, sorted by name.

    Raises:
        FileNotFoundError: the folder holds no texts (an incomplete checkout).
    """
    return _read_set("evaluation")


def _prefixes(tokenizer: Any, texts: tuple[Text, ...], tokens: int) -> list[torch.Tensor]:
    out = []
    for text in texts:
        ids = tokenizer(text.text, return_tensors="pt")["input_ids"][0].long()
        if ids.shape[0] < tokens:
            raise ValueError(
                f"{text.path} gives {ids.shape[0]} tokens; expected at least {tokens}. "
                f"Fix: ask for at most {ids.shape[0]} tokens per text."
            )
        out.append(ids[:tokens])
    return out


def evaluation_ids(tokenizer: Any, tokens_per_text: int) -> torch.Tensor:
    """The first ``tokens_per_text`` tokens of every evaluation text, one window each.

    Args:
        tokenizer: a transformers tokenizer.
        tokens_per_text: window length.

    Returns:
        int64 [number of evaluation texts, tokens_per_text], in :func:`evaluation_texts` order.

    Raises:
        ValueError: a text is shorter than ``tokens_per_text`` tokens.
    """
    return torch.stack(_prefixes(tokenizer, evaluation_texts(), tokens_per_text))


def calibration_ids(tokenizer: Any, tokens_per_text: int) -> torch.Tensor:
    """The first ``tokens_per_text`` tokens of every calibration text, concatenated.

    Args:
        tokenizer: a transformers tokenizer.
        tokens_per_text: tokens taken from each text.

    Returns:
        int64 [1, number of calibration texts * tokens_per_text].

    Raises:
        ValueError: a text is shorter than ``tokens_per_text`` tokens.
    """
    return torch.cat(_prefixes(tokenizer, calibration_texts(), tokens_per_text)).view(1, -1)
