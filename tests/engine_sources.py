"""The serving engines' own KV-scale loading code, fetched from PyPI at test time.

Test harness for ``tests/export/test_engine_loaders.py``; nothing here is part of kvquant,
and no engine code is kept in the repository. For each pinned release
(:data:`RELEASES`) the first use

1. asks PyPI's simple index, the one pip reads (its JSON form, PEP 691;
   ``$KVQUANT_PYPI_SIMPLE``, default ``https://pypi.org/simple``), for the URL of one
   pinned file: vLLM's sdist (47 MB; its wheels are 336 MB) and
   SGLang's CPython 3.11 x86-64 wheel (39 MB; SGLang publishes no sdist and no
   pure-Python wheel, and the Python sources are the same in every wheel);
2. downloads it, refusing any other size or sha256;
3. keeps only the few source files listed in the release (well under 1 MB) under
   ``$KVQUANT_TEST_CACHE/engines/<name>-<version>/`` (default ``.artifacts/`` at the
   root of the checkout, as for the SmolLM2 harness), marks the folder complete and
   deletes the archive; later runs read the folder and never touch the network.

The files are downloaded with ``urllib`` rather than ``pip download``: pip
prepares an sdist's metadata by running its build backend, which for vLLM means
installing its build requirements. Pre-fetch (e.g. before going offline, or as CI
does) with ``python tests/engine_sources.py``, which prints what it fetched, the
bytes and the time.

:func:`load` takes named top-level definitions (``"name"``) or class members
(``"Class.member"``) out of one of those files with :mod:`ast` and executes
exactly those in a namespace the caller fills with stand-ins for the engine's
heavy imports; an import of the engine's own package that the caller did not
provide raises ``ImportError`` naming it, so a new dependency of the engine's
code shows up as a clear failure, never as a silently different code path.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urljoin

INDEX_ENV = "KVQUANT_PYPI_SIMPLE"
DEFAULT_INDEX = "https://pypi.org/simple"
_SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
CHECKOUT = Path(__file__).resolve().parents[1]
if str(CHECKOUT) not in sys.path:  # run as a script: python tests/engine_sources.py
    sys.path.insert(0, str(CHECKOUT))
# one test cache for the model and the engines' sources
from benchmarks.harness.smollm2 import CACHE_ENV, default_cache_dir, file_lock  # noqa: E402

_COMPLETE = ".kvquant-complete"


class EngineSourceUnavailable(RuntimeError):
    """The release could not be fetched (no network, PyPI down, a changed file)."""


@dataclass(frozen=True)
class Release:
    """One pinned file of an engine's release and the source files taken from it.

    Attributes:
        name: the PyPI project.
        version: the pinned version.
        filename: the file of that version to download.
        sha256: its digest; any other content is refused.
        size: its size in bytes.
        root: the folder inside the archive that holds the package (an sdist's
            ``name-version/``; empty for a wheel).
        files: the package's source files to keep, relative to ``root``.
    """

    name: str
    version: str
    filename: str
    sha256: str
    size: int
    root: str
    files: tuple[str, ...]

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"

    def folder(self, cache_dir: Path | None = None) -> Path:
        base = cache_dir if cache_dir is not None else default_cache_dir()
        return base / "engines" / f"{self.name}-{self.version}"

    def marker_text(self) -> str:
        return json.dumps(
            {"file": self.filename, "sha256": self.sha256, "files": list(self.files)},
            indent=1,
        )


VLLM = Release(
    name="vllm",
    version="0.33.0",
    filename="vllm-0.33.0.tar.gz",
    sha256="f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    size=47_101_396,
    root="vllm-0.33.0/",
    files=(
        "vllm/model_executor/layers/attention/attention.py",
        "vllm/model_executor/layers/quantization/base_config.py",
        "vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py",
        "vllm/model_executor/layers/quantization/kv_cache.py",
        "vllm/model_executor/layers/quantization/modelopt.py",
        "vllm/model_executor/model_loader/weight_utils.py",
        "vllm/model_executor/models/llama.py",
        "vllm/model_executor/models/utils.py",
        "vllm/v1/kv_cache_interface.py",
    ),
)

SGLANG = Release(
    name="sglang",
    version="0.5.23",
    filename="sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
    sha256="00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937",
    size=39_063_923,
    root="",
    files=(
        "sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py",
        "sglang/srt/layers/quantization/kv_cache.py",
        "sglang/srt/layers/quantization/modelopt_quant.py",
        "sglang/srt/layers/utils/common.py",
        "sglang/srt/model_loader/weight_utils.py",
        "sglang/srt/models/llama.py",
    ),
)

RELEASES: dict[str, Release] = {"vllm": VLLM, "sglang": SGLANG}


def is_cached(release: Release, cache_dir: Path | None = None) -> bool:
    """Whether ``release``'s source files are already in the cache."""
    marker = release.folder(cache_dir) / _COMPLETE
    return marker.is_file() and marker.read_text(encoding="utf-8") == release.marker_text()


def cache_status() -> str:
    """One line for pytest's header: where the engines' sources are, or what will be fetched."""
    missing = [r for r in RELEASES.values() if not is_cached(r)]
    if not missing:
        return f"engine loader sources: cached in {default_cache_dir() / 'engines'}"
    total = sum(r.size for r in missing) / 1e6
    names = ", ".join(f"{r.filename}" for r in missing)
    return (
        f"engine loader sources: the engine-loader tests fetch {names} ({total:.0f} MB) from "
        f"PyPI (pre-fetch: python tests/engine_sources.py; another folder: {CACHE_ENV}=...)"
    )


def _file_url(release: Release) -> str:
    index = os.environ.get(INDEX_ENV, DEFAULT_INDEX).rstrip("/")
    url = f"{index}/{release.name}/"
    request = urllib.request.Request(url, headers={"Accept": _SIMPLE_JSON})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            data = json.load(response)
    except (OSError, ValueError) as exc:  # URLError is an OSError
        raise EngineSourceUnavailable(f"{url}: {exc}") from exc
    for entry in data.get("files", []) if isinstance(data, dict) else []:
        if isinstance(entry, dict) and entry.get("filename") == release.filename:
            return urljoin(url, str(entry["url"]))
    raise EngineSourceUnavailable(f"{url} lists no file {release.filename}")


def _download(release: Release, dest: Path) -> None:
    url = _file_url(release)
    digest = hashlib.sha256()
    size = 0
    try:
        with urllib.request.urlopen(url, timeout=300) as response, open(dest, "wb") as out:
            for chunk in iter(lambda: response.read(1 << 20), b""):
                size += len(chunk)
                if size > release.size:
                    break
                digest.update(chunk)
                out.write(chunk)
    except OSError as exc:
        raise EngineSourceUnavailable(f"{url}: {exc}") from exc
    if size != release.size or digest.hexdigest() != release.sha256:
        raise EngineSourceUnavailable(
            f"{url}: got {size} bytes with sha256 {digest.hexdigest()}, expected "
            f"{release.size} bytes with sha256 {release.sha256}"
        )


def _extract(release: Release, archive: Path, out: Path) -> None:
    wanted = {release.root + f: f for f in release.files}
    found: dict[str, bytes] = {}
    if archive.name.endswith(".whl"):
        with zipfile.ZipFile(archive) as zf:
            for member, rel in wanted.items():
                with contextlib.suppress(KeyError):
                    found[rel] = zf.read(member)
    else:
        with tarfile.open(archive, "r:gz") as tf:
            for info in tf:
                rel = wanted.get(info.name)
                if rel is not None and info.isfile():
                    handle = tf.extractfile(info)
                    if handle is not None:
                        found[rel] = handle.read()
    missing = sorted(set(release.files) - set(found))
    if missing:
        raise EngineSourceUnavailable(f"{release.filename} has no {missing}")
    for rel, data in found.items():
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def fetch(release: Release, cache_dir: Path | None = None, *, quiet: bool = False) -> Path:
    """Return the folder holding ``release``'s source files, fetching them on first use.

    Safe to call from several processes at once (a file lock; the folder appears
    by a rename, marked complete).

    Raises:
        EngineSourceUnavailable: PyPI cannot be reached, or the file differs from the pin.
    """
    folder = release.folder(cache_dir)
    if is_cached(release, cache_dir):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(folder.parent / f".{release.name}.lock"):
        if is_cached(release, cache_dir):
            return folder
        if not quiet:
            print(
                f"kvquant tests: fetching {release.filename} ({release.size / 1e6:.1f} MB) from "
                f"PyPI for its loader sources, kept in {folder}",
                file=sys.stderr,
                flush=True,
            )
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
        staging.chmod(0o755)
        try:
            archive = staging / release.filename
            _download(release, archive)
            _extract(release, archive, staging)
            archive.unlink()
            (staging / _COMPLETE).write_text(release.marker_text(), encoding="utf-8")
            if folder.exists():
                shutil.rmtree(folder)
            staging.rename(folder)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return folder


# ---------------------------------------------------------------------------
# taking definitions out of a source file


def _importer(modules: Mapping[str, Any], engines: Sequence[str]) -> Any:
    """An ``__import__`` that serves ``modules`` and refuses the engines' other modules."""

    def _import(
        name: str,
        globals: Mapping[str, Any] | None = None,
        locals: Mapping[str, Any] | None = None,
        fromlist: Sequence[str] = (),
        level: int = 0,
    ) -> Any:
        if level == 0 and name in modules:
            return modules[name]
        if level != 0 or name.split(".")[0] in engines:
            raise ImportError(
                f"the engine code imports {name!r} (fromlist {list(fromlist)}), which the test "
                "did not provide; add a stand-in for it"
            )
        return builtins.__import__(name, globals, locals, fromlist, level)

    return _import


def module(name: str, **attrs: Any) -> ModuleType:
    """A stand-in module ``name`` with ``attrs``."""
    mod = ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def namespace(
    globals_: Mapping[str, Any] | None = None,
    modules: Mapping[str, Any] | None = None,
    engines: Sequence[str] = ("vllm", "sglang"),
) -> dict[str, Any]:
    """A globals dict for engine code: ``globals_`` plus an import hook serving ``modules``."""
    ns: dict[str, Any] = dict(globals_ or {})
    ns["__builtins__"] = {
        **builtins.__dict__,
        "__import__": _importer(dict(modules or {}), tuple(engines)),
    }
    ns.setdefault("__name__", "kvquant_engine_extract")
    return ns


def _defines(node: ast.stmt, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    return False


def _future_flags(tree: ast.Module) -> int:
    import __future__

    flags = 0
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            for alias in node.names:
                flags |= getattr(__future__, alias.name).compiler_flag
    return flags


def load(folder: Path, relpath: str, names: Sequence[str], ns: dict[str, Any]) -> dict[str, Any]:
    """Execute the definitions ``names`` of ``folder/relpath`` in ``ns``; return them by name.

    A plain name is a top-level function, class or assignment, executed as written
    (decorators included). ``"Class.member"`` is a method or class attribute of a
    top-level class, taken out of the class: a method becomes a plain function
    (``staticmethod`` / ``classmethod`` decorators dropped, so ``self`` is passed
    explicitly), an attribute is the value of its expression. Definitions run in
    the order given, so list a name before the definitions that use it at import time.

    Raises:
        LookupError: a name is not defined in the file (the pinned release changed).
    """
    path = folder / relpath
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text, filename=str(path))
    flags = _future_flags(tree)
    out: dict[str, Any] = {}
    for name in names:
        owner, _, member = name.rpartition(".")
        scope: list[ast.stmt] = tree.body
        if owner:
            classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner]
            if not classes:
                raise LookupError(f"{relpath}: no class {owner}")
            scope = classes[0].body
        nodes = [n for n in scope if _defines(n, member)]
        if not nodes:
            raise LookupError(f"{relpath}: no definition of {name}")
        node = nodes[-1]
        if owner and isinstance(node, (ast.Assign, ast.AnnAssign)):
            value = node.value
            if value is None:
                raise LookupError(f"{relpath}: {name} has no value")
            expr = ast.Expression(body=value)
            code = compile(expr, str(path), "eval", flags=flags, dont_inherit=True)
            out[name] = eval(code, ns)
            continue
        if owner and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.decorator_list = [
                d
                for d in node.decorator_list
                if not (isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod"))
            ]
        code = compile(
            ast.Module(body=[node], type_ignores=[]),
            str(path),
            "exec",
            flags=flags,
            dont_inherit=True,
        )
        exec(code, ns)
        out[name] = ns[member]
    return out


def class_members(folder: Path, relpath: str) -> dict[str, set[str]]:
    """The methods and attributes each top-level class of ``folder/relpath`` defines itself."""
    path = folder / relpath
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names = out.setdefault(node.name, set())
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
    return out


def _main() -> int:
    cache = default_cache_dir()
    for release in RELEASES.values():
        if is_cached(release, cache):
            print(f"{release.spec}: cached in {release.folder(cache)}")
            continue
        start = time.perf_counter()
        try:
            folder = fetch(release, cache, quiet=True)
        except EngineSourceUnavailable as exc:
            print(f"{release.spec}: could not fetch {release.filename}: {exc}", file=sys.stderr)
            return 1
        kept = sum(p.stat().st_size for p in folder.rglob("*.py"))
        print(
            f"{release.spec}: fetched {release.filename} ({release.size / 1e6:.1f} MB) in "
            f"{time.perf_counter() - start:.1f} s; kept {len(release.files)} files "
            f"({kept / 1e3:.0f} kB) in {folder}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
