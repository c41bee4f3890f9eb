"""What ``kvquant.patch`` tells the user: its one INFO line, verbosity control, backend check."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_tiny import prompt

import kvquant
from kvquant.errors import BackendError, VerbosityError

ROOT = Path(__file__).resolve().parents[2]


def _patch_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("kvquant.patch:")]


def test_patch_logs_one_info_line_with_its_decision(
    tiny_llama: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="kvquant"):
        handle = kvquant.patch(tiny_llama, max_cache_tokens=96)
    try:
        info = [r for r in caplog.records if r.levelno >= logging.INFO]
        assert [r.getMessage() for r in info] == [r.getMessage() for r in _patch_lines(caplog)]
        (line,) = _patch_lines(caplog)
        text = line.getMessage()
        assert line.levelno == logging.INFO
        assert "2 layers" in text and "fp32-group scales" in text
        assert "backend auto -> torch on cpu" in text
        assert "96 token slots per cache, pages of 16" in text
    finally:
        handle.remove()


def test_patch_line_names_the_checkpoint_and_its_convention(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import AutoModelForCausalLM

    from kvquant.testing.checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path / "ckpt", convention="modelopt")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="kvquant"):
        handle = kvquant.patch(model, backend="torch")
    handle.remove()
    (line,) = _patch_lines(caplog)
    text = line.getMessage()
    assert f"checkpoint {path}" in text and "modelopt convention" in text
    assert "per-tensor scales" in text and "backend torch" in text
    assert "grown on demand" in text and "decode graphs: auto" in text


def test_triton_on_a_cpu_model_fails_at_patch_time(
    tiny_llama: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ids, mask = prompt()
    before = tiny_llama(input_ids=ids, attention_mask=mask).logits
    with pytest.raises(BackendError, match="backend='triton' was requested") as info:
        kvquant.patch(tiny_llama, backend="triton")
    assert isinstance(info.value, RuntimeError)
    assert "kvquant.patch" in str(info.value) and "Fix:" in str(info.value)
    assert getattr(tiny_llama, "_kvquant_state", None) is None  # model untouched
    after = tiny_llama(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_set_verbosity() -> None:
    logger = logging.getLogger("kvquant")
    previous = logger.level
    try:
        kvquant.set_verbosity("warning")
        assert kvquant.get_verbosity() == logging.WARNING
        kvquant.set_verbosity(logging.DEBUG)
        assert kvquant.get_verbosity() == logging.DEBUG
        with pytest.raises(VerbosityError, match="expected one of") as info:
            kvquant.set_verbosity("loud")
        assert isinstance(info.value, ValueError)
        assert kvquant.get_verbosity() == logging.DEBUG  # unchanged by the failed call
    finally:
        logger.setLevel(previous)


_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    {setup}
    import kvquant
    from hf_tiny import build
    kvquant.patch(build("llama"), backend="torch").remove()
    print("done", file=sys.stdout)
    """
)


def _run(setup: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "KVQUANT_VERBOSITY"}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "hf")])
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(setup=setup)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=300,
        check=True,
    )


@pytest.mark.slow
def test_the_line_is_visible_by_default_and_env_var_silences_it() -> None:
    default = _run()
    lines = [ln for ln in default.stderr.splitlines() if ln.startswith("kvquant.patch:")]
    assert len(lines) == 1, default.stderr
    quiet = _run(KVQUANT_VERBOSITY="warning")
    assert "kvquant.patch:" not in quiet.stderr
    bad = _run(KVQUANT_VERBOSITY="loud")
    assert "KVQUANT_VERBOSITY" in bad.stderr and "kvquant.patch:" in bad.stderr
    # An application that configured logging gets the line once, through its own handler.
    app = _run(setup="logging.basicConfig(format='APP %(message)s', level=logging.INFO)")
    lines = [ln for ln in app.stderr.splitlines() if "kvquant.patch:" in ln]
    assert len(lines) == 1 and lines[0].startswith("APP "), app.stderr


def test_the_handle_is_a_context_manager(tiny_llama: Any) -> None:
    ids, mask = prompt()
    before = tiny_llama(input_ids=ids, attention_mask=mask).logits
    with pytest.raises(KeyError, match="inside"):
        with kvquant.patch(tiny_llama, backend="torch") as handle:
            assert handle.active and tiny_llama._kvquant_state is handle.state
            raise KeyError("inside")
    assert not handle.active and getattr(tiny_llama, "_kvquant_state", None) is None
    after = tiny_llama(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)
