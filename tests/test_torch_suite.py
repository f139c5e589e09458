"""A fast subset of PyTorch's own DistributedTest suite on ringcomm (the whole run, on ringcomm
and gloo side by side: ``python tests/torch_suite/run.py``; its tables are quoted in the README)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the torch backend needs torch: pip install -e '.[torch]'")
pytest.importorskip("expecttest", reason="torch's test suite imports expecttest: pip install -e '.[test]'")
import ringcomm  # noqa: E402

SUITE = pathlib.Path(__file__).resolve().parent / "torch_suite" / "suite.py"
# One or two tests of each kind the backend gained or fixed, all passing on gloo too.
FAST = ["test_all_reduce_sum", "test_broadcast", "test_all_gather_coalesced_simple", "test_sparse_all_reduce_sum",
        "test_send_recv_with_tag", "test_send_recv_any_source", "test_batch_isend_irecv_gloo", "test_barrier_timeout_full_group",
        "test_accumulate_gradients_no_sync"]
if all(hasattr(ringcomm.Communicator, m) for m in ("gather", "scatter", "all_to_all")):
    FAST += ["test_gather", "test_scatter"]


@pytest.mark.timeout(240)
def test_torch_suite_subset_passes_on_ringcomm(tmp_path):
    out = tmp_path / "results.jsonl"
    env = {**os.environ, "BACKEND": "ringcomm", "WORLD_SIZE": "2", "RINGCOMM_TIMEOUT": "30",
           "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": "60", "PYTORCH_PRINT_REPRO_ON_FAILURE": "0"}
    pattern = "^(" + "|".join(FAST) + ")$"
    r = subprocess.run([sys.executable, str(SUITE), str(out), pattern], env=env, capture_output=True,
                       text=True, timeout=230, stdin=subprocess.DEVNULL)
    results = {d["test"]: d for d in map(json.loads, out.read_text().splitlines())} if out.exists() else {}
    failed = {n: d["why"][-800:] for n, d in results.items() if d["outcome"] != "passed"}
    assert not failed, "\n\n".join(f"{n}:\n{why}" for n, why in failed.items())
    assert sorted(results) == sorted(FAST), f"ran {sorted(results)}; exit {r.returncode}\n{r.stderr[-3000:]}"
