"""Tiny calibratable checkpoints for the calibrate and CLI tests (fixtures and helpers).

``tiny`` (head_dim 16) and ``tiny_kt`` (head_dim 64, for the k-transform's
rotation) are a random 2-layer Llama and its folder, with a character-level
tokenizer; the folders' conftest.py files import the fixtures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch


def char_tokenizer(folder: Path) -> None:
    """Save a character-level tokenizer (ids 0..127) into ``folder``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({chr(i): i for i in range(128)}, unk_token="\x00"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="\x00").save_pretrained(folder)


def load_tokenizer(folder: Path) -> Any:
    """The tokenizer saved in ``folder``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def jsonl(path: Path, texts: list[str]) -> Path:
    """A local JSON-lines dataset with a ``text`` and an ``id`` column."""
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def planted(b: int, h: int, t: int, d: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys = a planted per-(head, channel) offset + N(0, 1) noise; the first position far off."""
    g = torch.Generator().manual_seed(seed)
    offset = 20.0 * torch.randn(h, d, generator=g)
    key = offset[None, :, None, :] + torch.randn(b, h, t, d, generator=g)
    key[:, :, 0] = -300.0  # the attention sink: its K lacks the bias
    return key, offset


def _load(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama checkpoint (head_dim 16) with a tokenizer and no KV scales."""
    from kvquant.testing.checkpoints import write_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    folder = write_checkpoint(root / "src", convention="none", num_layers=2, head_dim=16)
    char_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Any:
    """``(model, folder)`` of :func:`tiny_dir`, loaded in fp32."""
    return _load(tiny_dir), tiny_dir


@pytest.fixture(scope="module")
def tiny_kt(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``(model, folder)``: like ``tiny`` with head_dim 64 (the Hadamard rotation needs it)."""
    from kvquant.testing.checkpoints import write_checkpoint

    root = tmp_path_factory.mktemp("tiny-kt")
    folder = write_checkpoint(root / "src", convention="none", num_layers=2, head_dim=64)
    char_tokenizer(folder)
    return _load(folder), folder
