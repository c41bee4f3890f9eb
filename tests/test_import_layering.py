"""Import layering: one-way tiers, no other module's private names, no harness, no CUDA on import.

The tier table (DESIGN.md): ``kernels`` <- ``cache`` <- ``registry``/``checkpoint`` <-
``integrations`` <- tools (``report``, ``calibrate``, ``export``, ``demo``, ``testing``) <-
``cli``. A module may import its own tier and the tiers below it, never one above; every
``import`` statement of the package counts, including those inside functions. Nothing
under ``kvquant/`` imports the test and benchmark harness (``benchmarks``, ``tests``).

The runtime checks run in a fresh interpreter so that modules imported by other tests
cannot hide an eager import.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvquant

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvquant"

# Longest matching prefix wins. kvquant.types, kvquant.checkpoint and kvquant.tools are
# the homes DESIGN.md plans; they may not exist yet.
TIERS: dict[str, int] = {
    "kvquant.errors": 0,
    "kvquant.log": 0,
    "kvquant.types": 0,
    "kvquant.choices": 0,
    "kvquant.schemes": 0,
    "kvquant.kernels": 1,
    "kvquant.cache": 2,
    "kvquant.registry": 3,
    "kvquant.checkpoint": 3,
    "kvquant.integrations": 4,
    "kvquant.integrations.hf.continuous": 4,
    "kvquant.report": 5,
    "kvquant.calibrate": 5,
    "kvquant.export": 5,
    "kvquant.demo": 5,
    "kvquant.serve": 5,
    "kvquant.testing": 5,
    "kvquant.tools": 5,
    "kvquant.tables": 5,
    "kvquant.cli": 6,
    "kvquant.__main__": 6,
}
TIER_NAMES = ("errors", "kernels", "cache", "registry", "integrations", "tools", "cli")

# what a bare ``import kvquant`` may reach through the lazy facade: its highest tier
FACADE = "kvquant (the lazy public facade)"

HARNESS = {"benchmarks", "tests", "docs"} | {p.stem for p in (ROOT / "tests").rglob("*.py")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _tier(module: str) -> int | None:
    best = None
    for prefix, tier in TIERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best[0])
        ):
            best = (prefix, tier)
    return None if best is None else best[1]


def _facade_tier() -> int:
    tiers = [_tier(m) for m in set(kvquant._LAZY.values())]
    assert None not in tiers, tiers
    return max(t for t in tiers if t is not None)


def _from_base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` reads from, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join([*anchor, node.module] if node.module else anchor)


def _imports(module: str, path: Path) -> list[tuple[int, str, str]]:
    """(line, imported module as resolved, how it was written) for every import statement."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                out.append((node.lineno, FACADE if name == "kvquant" else name, f"import {name}"))
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, path, node)
            for alias in node.names:
                written = f"from {'.' * node.level}{node.module or ''} import {alias.name}"
                full = f"{base}.{alias.name}"
                if full in MODULES:
                    out.append((node.lineno, full, written))
                elif base == "kvquant":  # a name of the facade: where it is defined
                    target = kvquant._LAZY.get(alias.name, "kvquant.errors")
                    out.append((node.lineno, target, written))
                else:
                    out.append((node.lineno, base, written))
    return out


def test_every_module_has_a_tier() -> None:
    unplaced = [m for m in MODULES if m != "kvquant" and _tier(m) is None]
    assert not unplaced, (
        f"{unplaced} are in no tier of TIERS; expected every kvquant module to be. Fix: add "
        "the module's prefix to TIERS in tests/test_import_layering.py (and DESIGN.md)."
    )


def test_tiers_import_only_downward() -> None:
    facade = _facade_tier()
    upward = []
    for module, path in MODULES.items():
        own = _facade_tier() if module == "kvquant" else _tier(module)
        assert own is not None
        for line, target, written in _imports(module, path):
            if not (target == FACADE or target.split(".")[0] == "kvquant"):
                continue
            tier = facade if target == FACADE else _tier(target)
            if tier is None or tier > own:
                where = f"{path.relative_to(ROOT)}:{line}"
                upward.append(
                    f"{where} `{written}` ({TIER_NAMES[own]} imports "
                    f"{'an unknown module' if tier is None else TIER_NAMES[tier]})"
                )
    assert not upward, "imports against the tier table:\n" + "\n".join(upward)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(module: str, path: Path) -> list[str]:
    """Another kvquant module's private names this module reaches: ``from kvquant.x import _y``
    (relative imports too) and ``x._y`` / ``getattr(x, "_y")`` on an imported kvquant module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found, modules = [], {}  # modules: local name -> the kvquant module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kvquant":
                    bound = alias.asname or "kvquant"
                    modules[bound] = alias.name if alias.asname else "kvquant"
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, path, node)
            if base.split(".")[0] != "kvquant":
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    modules[alias.asname or alias.name] = f"{base}.{alias.name}"
                elif _is_private(alias.name) and base != module:
                    found.append(f"{module}:{node.lineno} from {base} import {alias.name}")
    for node in ast.walk(tree):
        owner, name = None, None
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner, name = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
        ):
            owner, name = node.args[0], node.args[1].value
        dotted = ast.unparse(owner) if owner is not None else ""
        head, _, rest = dotted.partition(".")
        target = f"{modules[head]}.{rest}" if head in modules and rest else modules.get(head)
        if target in MODULES and target != module:
            found.append(f"{module}:{node.lineno} {dotted}.{name} (a private name of {target})")
    return found


def test_no_module_imports_another_modules_private_names() -> None:
    """A leading underscore means "this module only": a name another module needs is public
    there (and documented), so moving or changing a private name never breaks a neighbour.
    Every ``from kvquant... import _name`` counts, relative ones and package ``__init__``
    re-exports included, and so does ``module._name`` on an imported kvquant module."""
    bad = [use for module, path in MODULES.items() for use in _private_uses(module, path)]
    assert not bad, "uses of another module's private names:\n" + "\n".join(bad)


def test_package_init_imports_only_errors_eagerly() -> None:
    # kvquant.log too: the ``kvquant`` logger's handler is set up on import.
    imported = {t for _, t, _ in _imports("kvquant", PACKAGE / "__init__.py")}
    allowed = {
        "kvquant.errors",
        "kvquant.log",
        "importlib",
        "logging",
        "sys",
        "typing",
        "__future__",
    }
    assert imported <= allowed, imported
    for name, module in kvquant._LAZY.items():
        assert module in MODULES, (name, module)


def test_package_never_imports_the_harness() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line} `{written}`"
        for module, path in MODULES.items()
        for line, target, written in _imports(module, path)
        if target.split(".")[0] in HARNESS
    ]
    assert not found, "kvquant imports test or benchmark code:\n" + "\n".join(found)
    for path in MODULES.values():
        text = path.read_text(encoding="utf-8")
        assert 'import_module("benchmarks' not in text and 'import_module("tests' not in text


def test_importing_the_whole_package_loads_no_harness() -> None:
    code = textwrap.dedent(
        f"""
        import importlib, json, sys
        for name in {sorted(m for m in MODULES if m != "kvquant.__main__")!r}:
            try:
                importlib.import_module(name)
            except ImportError as exc:  # an optional dependency (e.g. triton off Linux)
                if (exc.name or "").split(".")[0] == "kvquant":
                    raise
        print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}})))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    loaded = set(json.loads(res.stdout.strip().splitlines()[-1]))
    assert not loaded & HARNESS, loaded & HARNESS


def test_public_api_is_pinned() -> None:
    assert kvquant.__all__ == [
        "BackendError",
        "BatchingError",
        "CacheCapacityError",
        "CacheUsageError",
        "CalibrationError",
        "CheckpointError",
        "ConventionError",
        "ExportError",
        "ExportTargetExistsError",
        "FormatRegistrationError",
        "KVQuantError",
        "KernelInputError",
        "OptionError",
        "OptionTypeError",
        "ScaleFormatError",
        "UnknownFormatError",
        "UnsupportedModelError",
        "VerbosityError",
        "__version__",
        "get_verbosity",
        "set_verbosity",
        "LayerGeometry",
        "LayerScales",
        "ModelScales",
        "RawScale",
        "ResolveOptions",
        "ScaleFormat",
        "ScaleRecord",
        "analyze_scales",
        "get_scale_format",
        "register_scale_format",
        "resolve_scales",
        "temporary_format",
        "discover_scales",
        "CheckpointReport",
        "inspect_checkpoint",
        "KVQuantCache",
        "KVQuantConfig",
        "KVQuantHandle",
        "from_pretrained",
        "patch",
        "export_checkpoint",
    ]
    assert len(set(kvquant.__all__)) == len(kvquant.__all__)
    assert sorted(dir(kvquant)) == sorted(kvquant.__all__)


def _probe(imports: str) -> dict[str, bool]:
    code = textwrap.dedent(
        f"""
        import json, sys
        {imports}
        import torch
        print(json.dumps({{
            "transformers": "transformers" in sys.modules,
            "triton": "triton" in sys.modules,
            "cuda_initialized": torch.cuda.is_initialized(),
        }}))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "imports",
    [
        "import kvquant.kernels",
        "import kvquant.kernels.validate, kvquant.kernels.backend, kvquant.kernels.fp8, "
        "kvquant.kernels.attention.naive, kvquant.kernels.attention.validate, "
        "kvquant.kernels.write.naive, kvquant.kernels.write.validate",
        "import kvquant.kernels.fp4, kvquant.kernels.write_fp4, kvquant.kernels.write_fp4.naive, "
        "kvquant.kernels.write_fp4.validate",
        "import kvquant.cache",
    ],
)
def test_kernels_and_cache_import_only_torch(imports: str) -> None:
    seen = _probe(imports)
    assert not seen["transformers"], f"{imports!r} imported transformers"
    assert not seen["triton"], f"{imports!r} imported triton eagerly (it is imported at dispatch)"
    assert not seen["cuda_initialized"], f"{imports!r} initialised CUDA"


def test_kvquant_import_is_lazy() -> None:
    seen = _probe("import kvquant")
    assert not seen["transformers"], "import kvquant imported transformers eagerly"
    assert not seen["cuda_initialized"], "import kvquant initialised CUDA"


def test_triton_kernel_module_does_not_initialise_cuda() -> None:
    seen = _probe("import kvquant.kernels.write.launch")
    assert seen["triton"]
    assert not seen["cuda_initialized"]
    assert not seen["transformers"]


def test_kernels_public_api() -> None:
    import kvquant.kernels as k

    assert sorted(k.__all__) == [
        "AttentionPlan",
        "PlanCache",
        "WritePlan",
        "compute_slot_mapping",
        "group_scale_storage",
        "hadamard",
        "page_storage",
        "paged_attention",
        "plan_attention",
        "plan_write",
        "slot_mapping",
        "write_kv",
    ]
    for name in k.__all__:
        assert callable(getattr(k, name))


def test_checkpoint_package_imports_neither_registry_nor_transformers() -> None:
    code = textwrap.dedent(
        """
        import json, sys
        import kvquant.checkpoint, kvquant.checkpoint.discovery, kvquant.checkpoint.producers
        import kvquant.checkpoint.sources
        print(json.dumps({
            "transformers": "transformers" in sys.modules,
            "registry": any(m.startswith("kvquant.registry") for m in sys.modules),
            "integrations": any(m.startswith("kvquant.integrations") for m in sys.modules),
        }))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen == {"transformers": False, "registry": False, "integrations": False}
