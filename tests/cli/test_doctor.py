"""inspect_checkpoint / `kvquant doctor` / `kvquant demo`, end to end from checkpoints on disk.

Each normalise-or-reject row of the registry's policy is checked through the
whole chain (write a producer checkpoint -> discovery -> analysis -> report).
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvquant import demo
from kvquant.cli import main
from kvquant.demo import DEMO_STEPS, DemoContext, add_demo_step, run_demo
from kvquant.errors import CheckpointError, ScaleFormatError, UnknownFormatError
from kvquant.report import CheckpointReport, inspect_checkpoint
from kvquant.testing.checkpoints import write_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _ckpt(tmp_path: Path, name: str = "c", **kwargs: object) -> Path:
    kwargs.setdefault("weights", "none")
    return write_checkpoint(tmp_path / name, **kwargs)  # type: ignore[arg-type]


def _actions(report: CheckpointReport) -> list[tuple[int, str, str]]:
    return [(r.layer, r.kind, r.action) for r in report.rows]


# --- the policy table, row by row, through inspect_checkpoint ---------------------------


def test_bf16_per_tensor_is_cast(tmp_path: Path) -> None:
    report = inspect_checkpoint(_ckpt(tmp_path, convention="compressed-tensors"))
    assert report.ok and report.exit_code == 0
    assert report.granularity == "per-tensor"
    assert {r.action for r in report.rows} == {"convert"}
    row = report.rows[0]
    assert (row.tensor, row.raw_shape, row.raw_dtype) == (
        "model.layers.0.self_attn.k_scale",
        (1,),
        "bfloat16",
    )
    assert row.format == "per-tensor" and "bfloat16" in row.reason
    assert row.raw_min == pytest.approx(0.02, rel=1e-2)
    assert report.scales[0].k is not None and report.scales[0].k.dtype == torch.float32


def test_fp32_scalar_is_used_as_stored(tmp_path: Path) -> None:
    report = inspect_checkpoint(_ckpt(tmp_path, convention="modelopt"))
    assert report.ok and {r.action for r in report.rows} == {"use"}
    assert [r.convention for r in report.rows] == ["modelopt"] * 4
    assert float(report.scales[1].v) == pytest.approx(0.02)  # type: ignore[arg-type]


def test_attn_head_is_per_head(tmp_path: Path) -> None:
    report = inspect_checkpoint(
        _ckpt(tmp_path, convention="compressed-tensors", granularity="per-head")
    )
    assert report.ok and report.granularity == "per-head"
    assert report.rows[0].raw_shape == (2, 1, 1) and report.rows[0].format == "per-head"
    k = report.scales[0].k
    assert k is not None and tuple(k.shape) == (2,)


def test_per_head_reduced_to_per_tensor_on_request(tmp_path: Path) -> None:
    path = _ckpt(tmp_path, convention="compressed-tensors", granularity="per-head")
    report = inspect_checkpoint(path, scale_format="per-tensor")
    assert report.ok and report.granularity == "per-tensor"
    assert all(r.action == "convert" for r in report.rows)
    assert any("per-tensor" in n for n in report.notes)
    assert report.options["scale_format"] == "per-tensor"


def test_per_tensor_broadcast_to_per_head(tmp_path: Path) -> None:
    report = inspect_checkpoint(_ckpt(tmp_path, convention="modelopt"), scale_format="per-head")
    assert report.ok and report.granularity == "per-head"
    assert all(r.action == "convert" for r in report.rows)


def test_quark_pre_rope_widened_or_kept(tmp_path: Path) -> None:
    path = _ckpt(tmp_path, convention="quark")
    widened = inspect_checkpoint(path)
    kept = inspect_checkpoint(path, rope_policy="keep")
    k_w, k_k = widened.scales[0].k, kept.scales[0].k
    assert k_w is not None and k_k is not None
    assert float(k_w) == pytest.approx(float(k_k) * math.sqrt(2.0), rel=1e-6)
    assert "RoPE" in widened.rows[0].reason
    assert "RoPE" not in widened.rows[1].reason  # V is not rotated
    assert "quark-pre-rope-merged" in {f.code for f in widened.findings}
    post = inspect_checkpoint(_ckpt(tmp_path, "p", convention="quark", post_rope=True))
    assert "RoPE" not in post.rows[0].reason
    assert float(post.scales[0].v) == pytest.approx(0.01, rel=1e-2)  # type: ignore[arg-type]


def test_legacy_kv_scale_serves_both(tmp_path: Path) -> None:
    report = inspect_checkpoint(_ckpt(tmp_path, convention="legacy-kv_scale"))
    assert report.ok
    assert [r.tensor for r in report.rows[:2]] == ["model.layers.0.self_attn.kv_scale"] * 2
    assert all("kv_scale" in r.reason for r in report.rows)


@pytest.mark.parametrize(
    "value, words",
    [
        (torch.tensor([math.nan]), "nan"),
        (torch.tensor([math.inf]), "inf"),
        (torch.tensor([0.0]), "zero"),
        (torch.tensor([-0.02]), "negative"),
        (torch.tensor([1], dtype=torch.int32), "int32"),
        (torch.full((4,), 0.02), "(4,)"),  # per query head, 2 KV heads
        (torch.full((2, 16), 0.02), "(2, 16)"),  # per channel
    ],
)
def test_bad_values_and_shapes_are_rejected(
    tmp_path: Path, value: torch.Tensor, words: str
) -> None:
    path = _ckpt(tmp_path, convention="compressed-tensors", scales={(1, "k"): value})
    report = inspect_checkpoint(path)
    assert not report.ok and report.exit_code == 1
    assert report.rejected_layers == (1,)
    (row,) = [r for r in report.rows if r.layer == 1 and r.kind == "k"]
    assert row.action == "reject"
    assert words in row.reason.lower() and "Fix:" in row.reason
    assert "model.layers.1.self_attn.k_scale" in row.reason
    assert all(r.action == "convert" for r in report.rows if r.layer == 0)


def test_query_head_vector_reduced_when_asked(tmp_path: Path) -> None:
    path = _ckpt(
        tmp_path, convention="compressed-tensors", scales={(1, "k"): torch.full((4,), 0.5)}
    )
    report = inspect_checkpoint(path, scale_format="per-tensor")
    assert report.ok
    assert float(report.scales[1].k) == pytest.approx(0.5)  # type: ignore[arg-type]


def test_only_k_in_a_layer(tmp_path: Path) -> None:
    path = _ckpt(tmp_path, convention="modelopt", drop=[(1, "v")])
    report = inspect_checkpoint(path)
    assert not report.ok and report.rejected_layers == (1,)
    (v_row,) = [r for r in report.rows if (r.layer, r.kind) == (1, "v")]
    assert v_row.action == "reject" and "missing_kv" in v_row.reason
    reused = inspect_checkpoint(path, missing_kv="reuse")
    assert reused.ok
    assert float(reused.scales[1].v) == pytest.approx(0.04)  # type: ignore[arg-type]


def test_layer_without_scales_is_rejected(tmp_path: Path) -> None:
    report = inspect_checkpoint(_ckpt(tmp_path, convention="modelopt", drop=[(1, "k"), (1, "v")]))
    assert not report.ok
    assert 1 in report.rejected_layers
    assert any("1" in p for p in report.problems)


@pytest.mark.parametrize(
    "missing, ok, actions, granularity",
    [
        ("dynamic", True, {"default"}, "fp32-group"),
        ("unit", True, {"default"}, "per-tensor"),
        ("error", False, {"reject"}, None),
    ],
)
def test_no_scales_policies(
    tmp_path: Path, missing: str, ok: bool, actions: set[str], granularity: str | None
) -> None:
    report = inspect_checkpoint(_ckpt(tmp_path, convention="none"), missing_scales=missing)
    assert report.ok is ok
    assert {r.action for r in report.rows} == actions
    assert report.granularity == granularity
    assert report.producer == "none"


def test_fp32_group_ignores_stored_scales(tmp_path: Path) -> None:
    report = inspect_checkpoint(_ckpt(tmp_path, convention="modelopt"), scale_format="fp32-group")
    assert report.ok and report.granularity == "fp32-group"
    assert {r.action for r in report.rows} == {"ignore"}
    assert report.scales.group_size == 16  # 64 capped at head_dim 16


def test_checkpoint_level_errors_reject(tmp_path: Path) -> None:
    path = _ckpt(
        tmp_path,
        convention="compressed-tensors",
        extra_tensors={"model.layers.0.self_attn.k_zero_point": torch.zeros(1)},
    )
    report = inspect_checkpoint(path)
    assert all(r.action == "convert" for r in report.rows)  # the scales themselves are fine
    assert not report.ok and report.exit_code == 1
    assert "kv-zero-points" in report.summary


def test_modelopt_fp8_weights_warning_does_not_reject(tmp_path: Path) -> None:
    report = inspect_checkpoint(
        write_checkpoint(tmp_path / "f", convention="modelopt", fp8_weights=True)
    )
    assert report.ok
    (finding,) = [f for f in report.findings if f.code == "fp8-weights-modelopt"]
    assert "silently broken" in finding.message
    assert "fp8-weights-modelopt" in report.render()


def test_bad_options_raise(tmp_path: Path) -> None:
    path = _ckpt(tmp_path, convention="modelopt")
    with pytest.raises(UnknownFormatError):
        inspect_checkpoint(path, scale_format="per-channel")
    with pytest.raises(ScaleFormatError):
        inspect_checkpoint(path, missing_kv="guess")
    with pytest.raises(CheckpointError):
        inspect_checkpoint(tmp_path / "missing")


def test_render_and_json(tmp_path: Path) -> None:
    path = _ckpt(
        tmp_path, convention="compressed-tensors", scales={(0, "v"): torch.tensor([math.nan])}
    )
    report = inspect_checkpoint(path)
    text = report.render()
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("layer"))
    assert set(lines[header + 1]) <= {"-", " "}  # the rule under the header
    table = [lines[header], *lines[header + 2 : header + 6]]
    # aligned: every column after "layer" starts at the same offset on every line
    col = table[0].index("action")
    assert all(line[col:].split()[0] in ("action", "convert", "reject") for line in table)
    assert max(len(line) for line in lines) <= 100
    assert "REJECTED" in text and "model.layers.0.self_attn.v_scale" in text
    data = json.loads(report.to_json())
    assert data["ok"] is False and data["exit_code"] == 1
    assert data["rows"][1]["raw_min"] == "nan"
    assert data["rejected_layers"] == [0]
    assert data["geometry"] == {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    assert str(report) == text


# --- the CLI ----------------------------------------------------------------------------


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_doctor_exit_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["doctor", str(_ckpt(tmp_path, convention="modelopt"))], capsys)
    assert code == 0
    assert "verdict:    OK" in out and "k_proj.k_scale" in out


def test_doctor_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _ckpt(tmp_path, convention="modelopt", drop=[(0, "v")])
    code, out, _ = _cli(["doctor", str(path)], capsys)
    assert code == 1 and "REJECTED" in out
    code, _, _ = _cli(["doctor", str(path), "--missing-kv", "reuse"], capsys)
    assert code == 0


def test_doctor_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(["doctor", str(tmp_path / "nope")], capsys)
    assert code == 2 and "does not exist" in err
    code, _, err = _cli(["doctor", str(tmp_path)], capsys)
    assert code == 2 and "config.json" in err
    path = _ckpt(tmp_path, convention="modelopt")
    code, _, err = _cli(["doctor", str(path), "--scale-format", "nonsense"], capsys)
    assert code == 2 and "nonsense" in err
    code, _, _ = _cli(["doctor", str(path), "--missing-scales", "maybe"], capsys)
    assert code == 2
    code, _, _ = _cli(["doctor"], capsys)
    assert code == 2
    code, _, _ = _cli([], capsys)
    assert code == 2


def test_doctor_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _ckpt(tmp_path, convention="none")
    code, out, _ = _cli(["doctor", str(path), "--json", "--missing-scales", "error"], capsys)
    data = json.loads(out)
    assert code == 1 and data["ok"] is False
    assert data["options"]["missing_scales"] == "error"
    code, out, _ = _cli(["doctor", str(path), "--json", "--group-size", "8"], capsys)
    data = json.loads(out)
    assert code == 0 and data["granularity"] == "fp32-group" and data["group_size"] == 8


def test_python_m_kvquant_help() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "kvquant", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "doctor" in done.stdout and "demo" in done.stdout
    done = subprocess.run(
        [sys.executable, "-m", "kvquant", "doctor", "/nonexistent/ckpt"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "does not exist" in done.stderr


def test_demo_runs_and_tells_the_story(tmp_path: Path) -> None:
    out = io.StringIO()
    ctx = run_demo(out, workdir=tmp_path)
    text = out.getvalue()
    verdicts = {key: report.ok for key, report in ctx.reports.items()}
    assert verdicts == {
        "ct-tensor": True,
        "ct-attn_head": True,
        "modelopt": True,
        "modelopt-fp8": True,
        "quark": True,
        "legacy": True,
        "broken-shape": False,
        "broken-nan": False,
    }
    assert "fp8-weights-modelopt" in text
    assert [k for k, (c, _) in ctx.checkpoints.items() if not c.plain_loadable] == ["modelopt-fp8"]
    for needle in ("Step 1/4", "compressed-tensors", "modelopt", "quark", "kv_scale", "REJECTED"):
        assert needle in text
    # load, patch, generate: close to the unpatched model, half the KV bytes, undone by remove()
    gen = ctx.extra["generate"]
    assert gen["min_logit_cosine"] >= 0.999
    assert gen["token_agreement"] >= 0.9
    assert gen["fp8_bytes"] / gen["bf16_bytes"] <= 0.52
    assert gen["recent_bytes"] > 0 and "16 newest tokens are also kept" in " ".join(text.split())
    assert gen["restored"] is True
    assert gen["load_time_granularity"] == "per-tensor"
    # the checkpoints it wrote are real transformers checkpoints with weights
    assert (tmp_path / "modelopt" / "model.safetensors").stat().st_size > 10_000


def test_demo_steps_can_be_appended(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvquant.demo.DEMO_STEPS", list(DEMO_STEPS))
    seen: list[int] = []

    def extra(ctx: DemoContext) -> None:
        seen.append(len(ctx.reports))
        ctx.say("extra step ran")

    add_demo_step("Extra", extra, before="Summary")

    assert [s.title for s in demo.DEMO_STEPS][-2:] == ["Extra", "Summary"]
    with pytest.raises(ValueError, match="no demo step"):
        add_demo_step("x", extra, before="missing")
    out = io.StringIO()
    run_demo(out, steps=demo.DEMO_STEPS)
    assert seen == [8] and "extra step ran" in out.getvalue()


def test_a_healthy_row_of_a_rejected_layer_gives_its_own_reason(tmp_path: Path) -> None:
    path = _ckpt(tmp_path, convention="modelopt", scales={(1, "v"): torch.tensor(math.nan)})
    report = inspect_checkpoint(path)
    k_row, v_row = (r for r in report.rows if r.layer == 1)
    assert (k_row.action, v_row.action) == ("reject", "reject")  # the layer is unusable
    assert "not a number" in v_row.reason and "v_proj.v_scale" in v_row.reason
    assert "not a number" not in k_row.reason and "v_proj.v_scale" not in k_row.reason
    assert "fine on its own" in k_row.reason and "its V scale" in k_row.reason
    assert report.rejected_layers == (1,)


def test_doctor_shows_each_layers_kv_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--kv-format takes kvquant.patch's kv_format (a word or LAYER=FORMAT entries) and shows
    each layer's format; a layer that cannot store its format rejects the checkpoint."""
    path = _ckpt(tmp_path, convention="modelopt", num_layers=4)  # head_dim 16
    code, out, _ = _cli(["doctor", str(path)], capsys)
    assert code == 0 and "kv format:" not in out  # not asked
    code, out, _ = _cli(["doctor", str(path), "--kv-format", "0=fp8,-1=fp8,default=nvfp4"], capsys)
    assert code == 0
    assert "kv format:  fp8: layers 0, 3; nvfp4: layers 1-2\n" in out
    code, out, _ = _cli(["doctor", str(path), "--kv-format", "mxfp4", "--json"], capsys)
    data = json.loads(out)
    assert code == 1 and data["kv_formats"] == ["mxfp4"] * 4
    assert "layer 0: kv_format 'mxfp4' stores one scale per block of 32" in data["problems"][0]
    # fp8-k-nvfp4-v keeps the static K scale: refused where the scales resolve to fp32-group
    dynamic = ["--scale-format", "fp32-group", "--kv-format", "1=fp8-k-nvfp4-v,default=fp8"]
    code, out, _ = _cli(["doctor", str(path), *dynamic], capsys)
    assert code == 1 and "layer 1: kv_format 'fp8-k-nvfp4-v' stores K in FP8" in out
    for bad, why in (("5=fp8", "names layer 5, but the model has 4 layers"),
                     ("0=fp8", "no format for layers 1-3"), ("0=fp8,nvfp4", "not LAYER=FORMAT"),
                     ("bf16", "no unquantized layer")):  # fmt: skip
        code, _, err = _cli(["doctor", str(path), "--kv-format", bad], capsys)
        assert code == 2 and why in err, err
    report = inspect_checkpoint(path, kv_format={0: "fp8", "default": "nvfp4"})
    assert report.ok and report.layer_formats == ("fp8", "nvfp4", "nvfp4", "nvfp4")
