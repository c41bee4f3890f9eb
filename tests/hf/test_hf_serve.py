"""``kvquant serve``: transformers' OpenAI-compatible server over kvquant's FP8 cache.

The server runs in its own process on 127.0.0.1 (a tiny fp32 Llama whose checkpoint
carries coarse per-tensor KV scales, CPU, the torch backend). Concurrent chat requests
go through a real HTTP client (the standard library's); each answer must be what the
patched model's own ``generate`` says for that conversation alone. A malformed request
gets the server's usual error and the server keeps serving. Needs transformers'
serving extras (FastAPI, Uvicorn, pydantic, openai): skipped without them.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_tiny import build, tokenizer

import kvquant.integrations.hf as kvhf

transformers = pytest.importorskip("transformers")
from transformers.utils.import_utils import is_serve_available  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not is_serve_available(), reason="transformers' serving extras missing"),
]

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
QUESTIONS = [
    ("What is FP8?", 8),
    ("hello there", 5),
    ("Tell me about paged attention, please.", 9),
    ("x", 7),
]


def _checkpoint(folder: Path) -> Path:
    """A tiny Llama saved with coarse per-tensor KV scales (as a patched model saves them)."""
    model = build("llama")
    scale = torch.tensor(48.0)
    names = [f"model.layers.{i}.self_attn.{n}" for i in range(2) for n in ("k_scale", "v_scale")]
    kvhf.patch(model, scales=dict.fromkeys(names, scale), backend="torch")
    model.save_pretrained(folder)
    tok = tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: Any, timeout: float = 120) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        text = err.read().decode(errors="replace")
        try:
            return err.code, json.loads(text)
        except ValueError:
            return err.code, {"text": text}


def _expected(
    folder: Path, question: str, max_tokens: int, patched: bool = True, recent: int = 0
) -> tuple[str, int]:
    """The patched model's own greedy ``generate`` for the conversation, decoded as the server
    does (``patched=False``: the same model without kvquant; ``recent``: the patch's
    ``recent_tokens``)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model.eval()
    if patched:  # the checkpoint's own scales, as the server finds them
        kvhf.patch(model, backend="torch", recent_tokens=recent)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": [{"type": "text", "text": question}]}]
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    prompt = torch.tensor([ids["input_ids"]])
    out = model.generate(prompt, max_new_tokens=max_tokens, do_sample=False)
    new = out[0, prompt.shape[1] :].tolist()
    return tok.decode(new, skip_special_tokens=True), len(new)


@pytest.mark.parametrize("recent", [0, 4])
def test_kvquant_serve_answers_concurrent_chats_like_generate(tmp_path: Path, recent: int) -> None:
    """``recent``: ``--recent-tokens`` (each request's newest tokens also at full precision)."""
    folder = _checkpoint(tmp_path / "tiny")
    port = _free_port()
    log = (tmp_path / "server.log").open("w")
    options = "--host 127.0.0.1 --device cpu --backend torch --page-size 16 --num-blocks 64"
    options += f" --recent-tokens {recent}"
    command = [sys.executable, "-m", "kvquant", "serve", str(folder), *options.split()]
    command += ["--max-batch-tokens", "256", "--port", str(port)]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise AssertionError((tmp_path / "server.log").read_text()[-4000:])
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not come up in 180 s"
            time.sleep(0.5)

        def chat(item: tuple[str, int]) -> tuple[int, dict[str, Any]]:
            question, max_tokens = item
            body = {
                "messages": [{"role": "user", "content": question}],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            return _post(f"{base}/v1/chat/completions", body)

        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            answers = list(pool.map(chat, QUESTIONS))
        # a malformed request gets the server's error; the server then keeps serving
        status, _ = _post(f"{base}/v1/chat/completions", b'{"messages": 3}')
        assert 400 <= status < 600
        again = chat(QUESTIONS[1])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
    server_log = (tmp_path / "server.log").read_text()
    assert "kvquant: continuous-batching cache of" in server_log  # the FP8 cache served them
    for (question, max_tokens), (status, body) in zip(QUESTIONS, answers, strict=True):
        assert status == 200, body
        text, count = _expected(folder, question, max_tokens, recent=recent)
        assert body["choices"][0]["message"]["content"] == text
        assert body["usage"]["completion_tokens"] == count
    # FP8 changed some answer, so the equality above is not the unpatched model's
    contents = [body["choices"][0]["message"]["content"] for _, body in answers]
    assert contents != [_expected(folder, q, n, patched=False)[0] for q, n in QUESTIONS]
    if recent:  # the ring changed some answer too
        assert contents != [_expected(folder, q, n)[0] for q, n in QUESTIONS]
    assert again[0] == 200
    assert again[1]["choices"] == answers[1][1]["choices"]


def test_kvquant_serve_reports_a_refused_checkpoint_as_kvquant_s_error(tmp_path: Path) -> None:
    """A checkpoint whose KV scales kvquant refuses: ``kvquant serve`` exits with the refusal
    code and kvquant's own error, also where transformers loads the model in a process of
    its own (5.25), which reports a failed load as a plain ``RuntimeError``."""
    from safetensors.torch import load_file, save_file

    folder = _checkpoint(tmp_path / "tiny")
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor(-48.0)
    weights.unlink()
    save_file(tensors, weights, metadata={"format": "pt"})
    options = "--host 127.0.0.1 --device cpu --backend torch --page-size 16 --num-blocks 64"
    command = [sys.executable, "-m", "kvquant", "serve", str(folder), *options.split()]
    command += ["--port", str(_free_port()), "--json"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-4000:]
    payload = json.loads(done.stdout)
    assert payload["error"] == "ScaleFormatError", payload
    assert "model.layers.1" in payload["message"] and "Fix" in payload["message"], payload


def test_serve_refuses_non_blocking_where_the_server_cannot_run_from_a_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """transformers 5.25's server runs in the calling thread: ``non_blocking=True`` is refused
    before anything starts, naming the fix."""
    from kvquant.errors import OptionError
    from kvquant.integrations.hf import compat
    from kvquant.serve import serve

    monkeypatch.setattr(compat, "serve_loads_in_engine_process", lambda: True)
    with pytest.raises(OptionError, match="Fix: run the server in a process of its own"):
        serve("no/such-model", non_blocking=True)


def test_only_kvquant_s_errors_are_raised_again_from_the_model_s_process() -> None:
    """The model's process reports a failed load as ``RuntimeError("<Class>: <message>")``:
    kvquant's classes come back as themselves, anything else is left to the caller."""
    from kvquant.errors import CacheUsageError
    from kvquant.serve import reraise_from_model_process

    report = RuntimeError("CacheUsageError: layer 3: bad\nFix: this.")
    with pytest.raises(CacheUsageError, match=r"^layer 3: bad\nFix: this\.$") as raised:
        reraise_from_model_process(report)
    assert raised.value.__cause__ is report
    for other in ("OSError: no such file", "ValueError: nope", "the process stopped"):
        assert reraise_from_model_process(RuntimeError(other)) is None
