"""transformers' tensor parallelism (``tp_plan="auto"``) with kvquant: two ranks on CPU (gloo).

transformers 5.x runs its tensor-parallel plan on CPU over torch.distributed's gloo
backend; each rank computes half the KV heads. The two ranks run under torchrun
(tests/hf/tp_worker.py) and are compared with the same cases run in one process:
each rank's cache holds its heads with the matching slices of the scales, and the
greedy tokens equal the one-process run's. A 30B-class model over real GPUs:
benchmarks/multi_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_steps import calibrate
from hf_tiny import VOCAB, build, prompt

import kvquant.integrations.hf as kvhf

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def _three_kv_heads() -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, head_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _cases(tmp: Path, backend: str = "torch", device: str | None = None) -> dict[str, Any]:
    model = build("llama")
    model.save_pretrained(tmp / "llama")
    _three_kv_heads().save_pretrained(tmp / "three")
    ids, mask = prompt(batch=2, length=12, pad=(3, 0))
    cont = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    common = dict(ids=ids, mask=mask, cont=cont, backend=backend, device=device)
    cases = {
        name: dict(
            path=str(tmp / "llama"),
            scales=None if name == "fp32-group" else calibrate(model, ids, mask, name),
            scale_format=name,
            **common,
        )
        for name in ("per-tensor", "per-head", "fp32-group")
    }
    # the static decode step (what a CUDA graph replays), run eagerly on CPU
    cases["static-step"] = dict(cases["per-head"], options=dict(cuda_graphs=True))
    # prefill_tokens="auto" from each rank's free memory: rank 0 would split the prompt in
    # two row groups, rank 1 run it whole (their collectives would not match)
    cases["row-groups"] = dict(cases["per-head"], free_bytes=[0, 10**12])
    handle = kvhf.patch(model, scales=cases["per-head"]["scales"], scale_format="per-head")
    model.save_pretrained(tmp / "saved")
    handle.remove()
    cases["saved"] = dict(path=str(tmp / "saved"), saved_patched=True, **common)
    cases["three-kv-heads"] = dict(
        path=str(tmp / "three"), scales=None, scale_format="fp32-group", **common
    )
    return cases


def _run(tmp: Path, ranks: int, env_extra: dict[str, str]) -> list[dict[str, Any]]:
    out = tmp / f"out{ranks}"
    out.mkdir()
    env = {**os.environ, **env_extra, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")])
    worker = [str(HERE / "tp_worker.py"), str(tmp / "cases.pt"), str(out)]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    cmd = [sys.executable, *(launcher if ranks > 1 else []), *worker]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(ranks)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The cases in one process and on two tensor-parallel ranks (CPU, gloo)."""
    tmp = tmp_path_factory.mktemp("tp")
    torch.save(_cases(tmp), tmp / "cases.pt")
    cpu_only = {"CUDA_VISIBLE_DEVICES": ""}  # transformers picks gloo on CPU
    return {"one": _run(tmp, 1, cpu_only)[0], "ranks": _run(tmp, 2, cpu_only)}


@pytest.mark.parametrize(
    "case", ["per-tensor", "per-head", "fp32-group", "saved", "static-step", "row-groups"]
)
def test_each_rank_caches_its_heads_with_their_scales(runs: dict[str, Any], case: str) -> None:
    one, ranks = runs["one"][case], [r[case] for r in runs["ranks"]]
    for rank, got in enumerate(ranks):
        assert "error" not in got, got.get("error")
        for whole, part in zip(one["layers"], got["layers"], strict=True):
            heads = slice(rank * part["heads"], (rank + 1) * part["heads"])
            assert part["heads"] * 2 == whole["heads"] == 2
            for name in ("k_scale", "v_scale"):
                if case not in ("per-tensor", "fp32-group"):  # per-head: sliced with the heads
                    assert torch.equal(part[name], whole[name][heads])
                elif case == "per-tensor":  # replicated
                    assert torch.equal(part[name], whole[name])
                else:
                    assert part[name] is None and whole[name] is None
            # the rank's FP8 cache holds the whole model's K/V of its heads (one FP8 step
            # where a projection computed on other shapes rounds a boundary value otherwise)
            for kv in ("k", "v"):
                torch.testing.assert_close(part[kv], whole[kv][:, heads], rtol=0.125, atol=1e-3)
        # save_pretrained writes the whole model's scales on every rank
        for buf, whole_buf in zip(got["buffers"], one["buffers"], strict=True):
            assert torch.equal(buf, whole_buf)


def _same_generation(one: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    for got in ranks:
        assert "error" not in got, got.get("error")
        assert torch.equal(got["tokens"], one["tokens"])
        # FP8 rounding of K/V computed by sharded projections: within a rounding step
        torch.testing.assert_close(got["logits"], one["logits"], atol=2e-2, rtol=0)


@pytest.mark.parametrize(
    "case", ["per-tensor", "per-head", "fp32-group", "saved", "static-step", "row-groups"]
)
def test_two_ranks_generate_the_tokens_of_one_process(runs: dict[str, Any], case: str) -> None:
    _same_generation(runs["one"][case], [r[case] for r in runs["ranks"]])
    for got in (runs["one"][case], *(r[case] for r in runs["ranks"])):
        # cuda_graphs=True: the static decode step (eager on CPU) on every rank
        assert (got["graph_stats"]["static_eager"] > 0) == (case == "static-step")
        # the prompts' prefill in row groups on every rank, as the smallest bound asks
        assert (got["row_group_splits"] > 0) == (case == "row-groups")


def test_heads_that_the_ranks_cannot_split_are_refused_with_the_fix(runs: dict[str, Any]) -> None:
    assert "error" not in runs["one"]["three-kv-heads"]
    for got in (r["three-kv-heads"] for r in runs["ranks"]):
        error = got["error"]
        assert error.startswith("UnsupportedModelError")
        assert "3 KV heads" in error and "2 ranks" in error
        assert "Fix:" in error and "device_map='auto'" in error


def _gpu_runs(tmp: Path, names: tuple[str, ...]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The cases ``names`` on one GPU and over two (transformers binds rank r to cuda:r, NCCL)."""
    cases = _cases(tmp, backend="auto", device="cuda:0")
    torch.save({n: cases[n] for n in names}, tmp / "cases.pt")
    return _run(tmp, 1, {})[0], _run(tmp, 2, {})


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_generate_the_tokens_of_one_gpu(tmp_path: Path) -> None:
    names = ("per-tensor", "per-head", "fp32-group", "saved", "three-kv-heads")
    one, ranks = _gpu_runs(tmp_path, names)
    for case in names[:-1]:
        _same_generation(one[case], [r[case] for r in ranks])
        # the default cuda_graphs=None decodes eagerly under tensor parallelism
        assert all(r[case]["graph_stats"]["replays"] == 0 for r in ranks)
    assert all("3 KV heads" in r["three-kv-heads"]["error"] for r in ranks)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_capture_the_decode_step_with_cuda_graphs_true(tmp_path: Path) -> None:
    # each rank's CUDA graph holds its collectives (NCCL): not the default, measured here
    one, ranks = _gpu_runs(tmp_path, ("static-step",))
    _same_generation(one["static-step"], [r["static-step"] for r in ranks])
    assert all(r["static-step"]["graph_stats"]["replays"] > 0 for r in ranks)
