"""The command line's shared rules: --json errors, PATH rules, the doctor's summary view,
export's progress and copies, the shared table renderer."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from kvquant.cli import checkpoint_dir, main
from kvquant.report import inspect_checkpoint
from kvquant.tables import render_table
from kvquant.testing.checkpoints import write_checkpoint


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "code", "kind"),
    [
        (["doctor", "{missing}"], 2, "CheckpointError"),
        (["doctor", "{ckpt}", "--scale-format", "nonsense"], 2, "UnknownFormatError"),
        (["doctor", "{ckpt}", "--missing-scales", "maybe"], 2, "UsageError"),
        (["export", "{missing}", "--engine", "vllm", "--out", "{out}"], 2, "CheckpointError"),
        (
            ["export", "{ckpt}", "--engine", "tensorrt-llm", "--per-head", "--out", "{out}"],
            1,
            "ExportError",
        ),
        (["calibrate", "{ckpt}", "--out", "{out}"], 2, "CalibrationError"),
        (["export", "{ckpt}", "--out", "{out}"], 2, "UsageError"),
        (
            ["export", "{ckpt}", "--engine", "vllm", "--out", "{file}/out"],
            2,
            "ExportTargetExistsError",
        ),
        (["demo", "--keep", "{file}"], 2, "ExportTargetExistsError"),
        # --out is checked before the model is loaded (these weights would not load)
        (
            ["calibrate", "{ckpt}", "--out", "{ckpt}", "--force", "--text", "{file}"],
            1,
            "ExportError",
        ),
        (
            ["calibrate", "{ckpt}", "--out", "{file}/out", "--text", "{file}"],
            2,
            "ExportTargetExistsError",
        ),
    ],
)
def test_json_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], code: int, kind: str
) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", convention="modelopt", weights="none")
    (tmp_path / "file").write_text("a file where a folder is expected\n")
    names = {
        "missing": str(tmp_path / "nope"),
        "ckpt": str(ckpt),
        "out": str(tmp_path / "out"),
        "file": str(tmp_path / "file"),
    }
    args = [a.format(**names) for a in argv]
    files_before = sorted(p.name for p in ckpt.iterdir())
    got, out, _ = _cli([*args, "--json"], capsys)
    data = json.loads(out)
    assert got == code == data["exit_code"]
    assert data["error"] == kind and data["message"] and data["command"] == args[0]
    assert not (tmp_path / "out").exists() and (tmp_path / "file").is_file()
    assert sorted(p.name for p in ckpt.iterdir()) == files_before
    text_code, text_out, text_err = _cli(args, capsys)
    assert text_code == code and text_out == "" and text_err  # same exit code as text


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_file_inside_a_checkpoint_names_its_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", convention="quark", weights="none")
    assert (ckpt / name).is_file()
    assert checkpoint_dir(ckpt / name) == str(ckpt)
    code, out, _ = _cli(["doctor", str(ckpt / name), "--json"], capsys)
    assert code == 0 and json.loads(out)["path"] == str(ckpt)
    code, out, _ = _cli(
        ["export", str(ckpt / name), "--engine", "vllm", "--out", str(tmp_path / "o"), "--json"],
        capsys,
    )
    assert code == 0 and json.loads(out)["source"] == str(ckpt)
    assert checkpoint_dir("org/model-id") == "org/model-id"  # not a path here: passed on


def test_doctor_summary_view_for_many_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = write_checkpoint(
        tmp_path / "big",
        convention="modelopt",
        weights="none",
        num_layers=12,
        scales={(5, "v"): torch.tensor(float("nan"))},
    )
    code, out, _ = _cli(["doctor", str(ckpt)], capsys)
    assert code == 1
    assert "summary: one row per distinct decision" in out
    assert max(len(line) for line in out.splitlines()) <= 100
    rows = [line for line in out.splitlines() if line[:1].isdigit()]
    # healthy layers collapse into one row per kind; layer 5 (V rejected, K with it) apart
    assert len(rows) == 4
    assert [r.split()[:3] for r in rows] == [
        ["0-4,", "6-11", "K"],
        ["0-4,", "6-11", "V"],
        ["5", "K", "self_attn.k_proj.k_scale"],
        ["5", "V", "self_attn.v_proj.v_scale"],
    ]
    assert all("used as stored" in r for r in rows[:2]) and "0.02..0.04" not in rows[2]
    code, full, _ = _cli(["doctor", str(ckpt), "--full"], capsys)
    assert code == 1 and "summary:" not in full
    assert len([line for line in full.splitlines() if line[:1].isdigit()]) == 24
    report = inspect_checkpoint(ckpt)
    assert report.render(full=True) == full.rstrip("\n")


def test_export_progress_and_copies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write_checkpoint(tmp_path / "src", convention="modelopt", weights="none")
    (src / "tokenizer.json").write_text("{}", encoding="utf-8")
    code, _, err = _cli(
        ["export", str(src), "--engine", "sglang", "--out", str(tmp_path / "o")], capsys
    )
    assert code == 0 and "writing o" in err and "100%" in err
    for name in ("tokenizer.json", "config.json"):
        assert (tmp_path / "o" / name).stat().st_ino != (src / name).stat().st_ino
    (tmp_path / "o" / "tokenizer.json").write_text('{"edited": 1}', encoding="utf-8")
    assert (src / "tokenizer.json").read_text(encoding="utf-8") == "{}"


def test_render_table_fits_and_wraps() -> None:
    long = "word " * 60
    text = render_table(["layer", "why"], [["0", long.strip()], ["12", "short"]], wrap={"why"})
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100 and len(lines) > 4
    assert " ".join(text.split()).count("word") == 60  # nothing cut
    assert lines[0].split() == ["layer", "why"] and lines[-1].split() == ["12", "short"]
    with pytest.raises(ValueError, match="one cell per column"):
        render_table(["a", "b"], [["1"]])


def test_demo_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["demo", "--json", "--keep", str(tmp_path)], capsys)
    data = json.loads(out)
    assert code == 0
    verdicts = {key: entry["ok"] for key, entry in data["checkpoints"].items()}
    assert verdicts["modelopt"] is True and verdicts["broken-nan"] is False
    assert all(Path(entry["path"]).is_dir() for entry in data["checkpoints"].values())
    assert data["generate"]["restored"] is True


@pytest.mark.parametrize("entry", ["quark/model.safetensors", "modelopt", "legacy-link"])
def test_demo_keep_never_writes_over_a_users_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], entry: str
) -> None:
    """--keep DIR may exist, but the demo's checkpoint folders in it must be new: an existing
    one (a user's file inside it, a folder, a symlink) is refused before anything is written."""
    from kvquant.demo import DEMO_CHECKPOINTS, run_demo
    from kvquant.errors import ExportTargetExistsError

    keep = tmp_path / "keep"
    keep.mkdir()
    mine = tmp_path / "mine.safetensors"
    mine.write_bytes(b"the user's weights")
    if entry == "legacy-link":
        (keep / DEMO_CHECKPOINTS[-1].key).symlink_to(tmp_path)
    elif "/" in entry:
        (keep / "quark").mkdir()
        (keep / entry).write_bytes(mine.read_bytes())
    else:
        (keep / entry).mkdir()
    before = sorted(p.relative_to(keep).as_posix() for p in keep.rglob("*"))
    code, _, err = _cli(["demo", "--keep", str(keep)], capsys)
    assert code == 2 and "never writes over" in err, err
    with pytest.raises(ExportTargetExistsError):
        run_demo(io.StringIO(), workdir=keep)
    assert sorted(p.relative_to(keep).as_posix() for p in keep.rglob("*")) == before
    if "/" in entry:
        assert (keep / entry).read_bytes() == b"the user's weights"


def test_an_unexpected_exception_exits_3_not_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug must not read as "refused" (exit 1) and must keep --json parseable."""
    import kvquant.report

    ckpt = write_checkpoint(tmp_path / "ckpt", convention="modelopt", weights="none")
    marker = f"unexpected-{torch.randint(10**6, ()).item()}"

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError(marker)

    monkeypatch.setattr(kvquant.report, "inspect_checkpoint", broken)
    code, out, err = _cli(["doctor", str(ckpt), "--json"], capsys)
    data = json.loads(out)
    assert code == data["exit_code"] == 3 and data["error"] == "InternalError"
    assert marker in data["message"] and data["command"] == "doctor"
    assert "Traceback" in err and marker in err
    code, out, err = _cli(["doctor", str(ckpt)], capsys)
    assert code == 3 and out == "" and "internal error" in err and marker in err


def test_run_demo_refuses_a_workdir_under_a_file_before_writing(tmp_path: Path) -> None:
    from kvquant.demo import run_demo
    from kvquant.errors import ExportTargetExistsError

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ExportTargetExistsError, match="is a file, not a folder"):
        run_demo(io.StringIO(), workdir=blocker / "demo")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert blocker.read_text() == "not a folder"


def test_serve_without_the_serving_extras_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """kvquant serve runs transformers' server: without FastAPI & co it names the install."""
    pytest.importorskip("transformers")
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_serve_available", lambda: False)
    assert main(["serve", "some/model", "--json"]) == 2
    payload = json.loads(capsys.readouterr().out)
    assert payload["error"] == "BackendError" and payload["command"] == "serve"
    assert 'pip install "transformers[serving]"' in payload["message"]


def test_serve_hands_the_patch_its_kv_format_and_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """--kv-format and --recent-tokens reach kvquant.serve.serve (which patches with them); a
    word outside the formats or a negative ring is a usage error before anything starts."""
    pytest.importorskip("transformers")
    import kvquant.serve

    seen: dict[str, Any] = {}
    monkeypatch.setattr(kvquant.serve, "serve", lambda model, **kw: seen.update(kw, model=model))
    assert main(["serve", "m", "--kv-format", "nvfp4", "--recent-tokens", "16"]) == 0
    assert (seen["model"], seen["kv_format"], seen["recent_tokens"]) == ("m", "nvfp4", 16)
    seen.clear()
    assert main(["serve", "m"]) == 0
    assert (seen["kv_format"], seen["recent_tokens"]) == ("fp8", "auto")
    assert main(["serve", "m", "--recent-tokens", "auto"]) == 0 and seen["recent_tokens"] == "auto"
    assert main(["serve", "m", "--recent-tokens", "0"]) == 0 and seen["recent_tokens"] == 0
    assert main(["serve", "m", "--kv-format", "int4"]) == 2
    assert main(["serve", "m", "--recent-tokens", "-1", "--json"]) == 2
    assert main(["serve", "m", "--recent-tokens", "some"]) == 2


def _per_head(tmp_path: Path, layers: int = 30) -> Path:
    """A per-head checkpoint whose layers' head scales differ (so do their max/min ratios)."""
    g = torch.Generator().manual_seed(0)
    scales = {
        (layer, kind): (torch.rand(3, 1, 1, generator=g) * 0.05 + 0.01).to(torch.bfloat16)
        for layer in range(layers)
        for kind in "kv"
    }
    return write_checkpoint(
        tmp_path / "per-head",
        convention="compressed-tensors",
        granularity="per-head",
        num_layers=layers,
        num_heads=9,
        num_kv_heads=3,
        weights="none",
        scales=scales,
    )


def test_a_summary_summarises_rows_that_differ_only_in_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _per_head(tmp_path)
    code, out, _ = _cli(["doctor", str(ckpt), "--scale-format", "per-tensor"], capsys)
    assert code == 0
    rows = [line for line in out.splitlines() if line[:1].isdigit()]
    assert [r.split()[:2] for r in rows] == [["0-29", "K"], ["0-29", "V"]]
    notes = [line for line in out.splitlines() if line.startswith("[")]
    assert len(notes) <= 2 and len(out.splitlines()) < 30  # was 127 lines, 51 notes
    k_ratios = [
        float(m)
        for r in inspect_checkpoint(ckpt, scale_format="per-tensor").rows
        if r.kind == "k"
        for m in re.findall(r"max/min ([\d.]+)", r.reason)
    ]
    assert len(k_ratios) == 30
    want = f"max/min {min(k_ratios):.4g}..{max(k_ratios):.4g}"
    assert want in out.replace("\n", " ")
    # --full still has one row per layer and K/V, each with its own ratio
    code, full, _ = _cli(["doctor", str(ckpt), "--scale-format", "per-tensor", "--full"], capsys)
    assert len([line for line in full.splitlines() if line[:1].isdigit()]) == 60


def test_doctor_honours_the_terminal_width(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _per_head(tmp_path, layers=4)
    quark = write_checkpoint(tmp_path / "quark", convention="quark", weights="none")
    for columns in (80, 64):
        monkeypatch.setenv("COLUMNS", str(columns))
        for argv in (["doctor", str(ckpt), "--scale-format", "per-tensor"], ["doctor", str(quark)]):
            code, out, _ = _cli(argv, capsys)
            assert code == 0
            lines = [line for line in out.splitlines() if not line.startswith("checkpoint:")]
            assert max(len(line) for line in lines) <= columns, out  # the path is printed whole
    monkeypatch.delenv("COLUMNS")  # a pipe without COLUMNS: the 100-column layout
    code, out, _ = _cli(["doctor", str(quark)], capsys)
    assert max(len(line) for line in out.splitlines()) > 80


def test_cli_text_spells_options_as_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    quark = write_checkpoint(tmp_path / "quark", convention="quark", weights="none")
    big = write_checkpoint(tmp_path / "big", convention="modelopt", weights="none", num_layers=12)
    out = "".join(_cli(["doctor", str(p)], capsys)[1] for p in (quark, big))
    assert "(--rope-policy widen)" in out and "--full lists all 24 rows" in out
    assert "rope_policy=" not in out and "render(full=True)" not in out
    assert "producer: modelopt (from" in out and "producer: producer" not in out
    # Python keeps Python's spelling
    assert "rope_policy='widen'" in inspect_checkpoint(quark).render()
    out_dir = tmp_path / "o"
    out_dir.mkdir()
    code, _, err = _cli(["export", str(quark), "--engine", "vllm", "--out", str(out_dir)], capsys)
    assert code == 2 and "--force to replace it" in err and "force=True" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["doctor", "{ckpt}", "--json"],
        ["doctor", "{missing}", "--json"],
        ["export", "{ckpt}", "--engine", "vllm", "--out", "{out}", "--json"],
    ],
)
def test_every_json_object_has_a_schema_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    from kvquant.cli import JSON_SCHEMA_VERSION

    ckpt = write_checkpoint(tmp_path / "ckpt", convention="modelopt", weights="none")
    names = {"ckpt": ckpt, "missing": tmp_path / "missing", "out": tmp_path / "out"}
    _, out, _ = _cli([a.format(**names) for a in argv], capsys)
    data = json.loads(out)
    assert JSON_SCHEMA_VERSION == 1 and next(iter(data)) == "schema_version"
    assert data["schema_version"] == 1


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """``kvquant doctor ... --json | head``: no traceback, exit 141 (128 + SIGPIPE)."""
    import subprocess
    import sys

    ckpt = write_checkpoint(tmp_path / "big", convention="modelopt", weights="none", num_layers=300)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvquant", "doctor", str(ckpt), "--json", "--full"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.read(10)
    proc.stdout.close()  # the reader goes away before the output (> 64 kB) is written
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141
    assert first.startswith(b"{") and "Traceback" not in err and "BrokenPipe" not in err


def test_demo_at_80_columns_without_transformers_load_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import logging

    from transformers.utils import logging as hf_logging

    monkeypatch.setenv("COLUMNS", "80")
    before = (hf_logging.get_verbosity(), logging.getLogger("kvquant").level)
    code, out, err = _cli(["demo", "--keep", str(tmp_path / "d")], capsys)
    assert code == 0 and "Step 4/4: Summary" in out
    assert "Loading weights" not in err and "UNEXPECTED" not in err + out
    assert (hf_logging.get_verbosity(), logging.getLogger("kvquant").level) == before
    paths = ("checkpoint:", "$ kvquant doctor")  # a path is printed whole
    assert max(len(line) for line in out.splitlines() if not line.startswith(paths)) <= 80
