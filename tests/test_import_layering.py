"""Import layering: the kernels and the cache never pull in transformers, and nothing initialises CUDA.

Each check runs in a fresh interpreter so that modules imported by other tests
cannot hide an eager import.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest


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
        "import kvquant.kernels.validate, kvquant.kernels.backend, kvquant.kernels.reference",
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
    seen = _probe("import kvquant.kernels.write_triton")
    assert seen["triton"]
    assert not seen["cuda_initialized"]
    assert not seen["transformers"]


def test_kernels_public_api() -> None:
    import kvquant.kernels as k

    assert sorted(k.__all__) == [
        "compute_slot_mapping",
        "group_scale_storage",
        "page_storage",
        "paged_attention",
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
