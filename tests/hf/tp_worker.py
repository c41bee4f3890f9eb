"""One rank of the tensor-parallel tests (tests/hf/test_hf_tensor_parallel.py), under torchrun.

``python -m torch.distributed.run --nproc_per_node 2 tests/hf/tp_worker.py CASES.pt OUT_DIR``
loads each case's checkpoint with ``tp_plan="auto"``, patches it with the case's scales
(or loads a saved patched model through kvquant's quantizer),
runs teacher-forced steps and a greedy ``generate``, and saves what the test compares to
``OUT_DIR/rank{R}.pt``; a refused patch saves its error instead. Without torchrun it runs
the same cases in one process (the reference).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from hf_steps import generate_exactly, step_logits

import kvquant
import kvquant.integrations.hf as kvhf
import kvquant.integrations.hf.rowgroups as rowgroups
from kvquant.errors import KVQuantError


def run_case(case: dict[str, Any], tensor_parallel: bool) -> dict[str, Any]:
    """One case: ``path``, ``scales``, ``scale_format``, ``ids``, ``mask``, ``cont``, ``backend``,
    ``options`` (more of ``kvquant.patch``'s keywords), ``free_bytes`` (per rank, the free
    memory the automatic prefill bound sees)
    and ``device`` (where the one-process run loads the model; None: the CPU); with
    ``saved_patched`` the folder is loaded with :func:`kvquant.from_pretrained` instead.

    Returns what the test compares, or ``{"error": ...}`` for a kvquant error.
    """
    free = case.get("free_bytes")  # per rank: what the row-group bound sees as free memory
    if free is None:
        return _run_case(case, tensor_parallel)
    rank = int(os.environ.get("RANK", 0))
    saved = rowgroups.device_free_bytes
    rowgroups.device_free_bytes = lambda device: free[rank]
    try:
        return _run_case(case, tensor_parallel)
    finally:
        rowgroups.device_free_bytes = saved


def _run_case(case: dict[str, Any], tensor_parallel: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {"tp_plan": "auto"} if tensor_parallel else {}
    if not tensor_parallel and case.get("device") is not None:
        kw["device_map"] = case["device"]
    try:
        if case.get("saved_patched"):  # a patched model's save_pretrained: kvquant's quantizer
            model = kvquant.from_pretrained(case["path"], **kw).eval()
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(case["path"], **kw).eval()
            kvhf.patch(
                model,
                scales=case["scales"],
                scale_format=case["scale_format"],
                backend=case["backend"],
                **case.get("options", {}),
            )
        return _patched_run(model, case)
    except KVQuantError as err:
        return {"error": f"{type(err).__name__}: {err}"}


def _patched_run(model: Any, case: dict[str, Any]) -> dict[str, Any]:
    device = next(model.parameters()).device
    ids, mask, cont = (case[k].to(device) for k in ("ids", "mask", "cont"))
    logits, cache = step_logits(model, ids, mask, cont)
    tokens = generate_exactly(model, ids, mask, 8).sequences[:, ids.shape[1] :]
    layers = []
    for layer in cache.layers:
        k, v = layer.dense_kv(torch.float32)
        layers.append(
            {
                "heads": layer.spec.num_kv_heads,
                "k_scale": None if layer.k_scale is None else layer.k_scale.cpu(),
                "v_scale": None if layer.v_scale is None else layer.v_scale.cpu(),
                "k": k.cpu(),
                "v": v.cpu(),
            }
        )
    # the model's scale buffers (what save_pretrained writes): the whole model's, on every rank
    attns = [layer.self_attn for layer in model.model.layers]
    buffers = [
        a.k_scale.cpu() for a in attns if isinstance(getattr(a, "k_scale", None), torch.Tensor)
    ]
    state = model._kvquant_state
    runner = state.graph_runner
    return {
        "logits": logits.cpu(),
        "tokens": tokens.cpu(),
        "layers": layers,
        "buffers": buffers,
        "graph_stats": {} if runner is None else dict(vars(runner.stats)),
        "row_group_splits": 0 if state.row_groups is None else state.row_groups.stats.split_calls,
    }


def main(cases_file: str, out_dir: str) -> None:
    cases = torch.load(cases_file, weights_only=False)
    tensor_parallel = "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    results = {name: run_case(case, tensor_parallel) for name, case in cases.items()}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    if tensor_parallel:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
