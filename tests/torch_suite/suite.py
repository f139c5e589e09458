"""PyTorch's DistributedTest suite (torch/testing/_internal/distributed/distributed_test.py) on one backend.

    BACKEND=ringcomm WORLD_SIZE=2 python tests/torch_suite/suite.py RESULTS.jsonl [NAME_REGEX]

The suite gloo, NCCL, MPI and UCC run (torch's test/distributed/test_distributed_spawn.py), with two
changes that keep the comparison fair and fast:
- The test module is imported as if BACKEND were gloo, then told the real backend. Its skip
  decorators are evaluated at import, so the tests torch gates to gloo by name (``BACKEND != "gloo"``)
  run on ringcomm too, and both backends run exactly the same set; the test bodies read the real name.
- Its test bodies see a name equal to both "ringcomm" and "gloo" (GlooTwin), so the branches
  written for gloo (``if BACKEND == "gloo":``) run too.
- The ranks are forked, not spawned: each test then costs no fresh ``import torch`` per rank.
A third-party backend joins through DistTestCases.backend_feature ("plugin", "ddp", "subgroup").
One JSON line per test goes to RESULTS.jsonl as it ends, so a run cut short keeps what it did.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
import unittest

REAL = os.environ["BACKEND"]
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")
os.environ["BACKEND"] = "gloo"  # for the import only: see the docstring
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402
from torch.testing._internal.distributed import distributed_test as dt  # noqa: E402



class GlooTwin(str):
    """The name "ringcomm" that also compares equal to "gloo": test bodies that branch on
    ``BACKEND == "gloo"`` (DDP's CPU paths, gloo's tags and timeouts) take gloo's branch, while
    init_process_group(backend=BACKEND) still gets "ringcomm" (Backend() lower()s it to a plain str)."""

    def __eq__(self, other):
        return other == "gloo" or str.__eq__(self, other)

    def __ne__(self, other):
        return not self == other

    __hash__ = str.__hash__


os.environ["BACKEND"] = REAL
dt.BACKEND = GlooTwin(REAL) if REAL == "ringcomm" else REAL
if REAL == "ringcomm":
    import ringcomm.torch  # noqa: E402,F401  (registers the backend)
    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add("ringcomm")


class TorchSuite(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)


class JsonResult(unittest.TextTestResult):
    """unittest's result, also writing {"test", "outcome", "seconds", "why"} per test."""
    sink = None

    def startTest(self, test):
        self._t0 = time.monotonic()
        super().startTest(test)

    def _emit(self, test, outcome, why=""):
        name = test.id().rsplit(".", 1)[-1]
        line = {"test": name, "outcome": outcome, "seconds": round(time.monotonic() - self._t0, 2),
                "why": why[-600:]}
        self.sink.write(json.dumps(line) + "\n")
        self.sink.flush()

    def addSuccess(self, test):
        super().addSuccess(test)
        self._emit(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._emit(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._emit(test, "failed", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._emit(test, "skipped", str(reason))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._emit(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._emit(test, "failed", "unexpected success")


def main(argv) -> int:
    out, pattern = argv[1], re.compile(argv[2] if len(argv) > 2 else "")
    loader = unittest.TestLoader()
    names = [n for n in loader.getTestCaseNames(TorchSuite) if pattern.search(n)]
    suite = unittest.TestSuite(TorchSuite(n) for n in names)
    with open(out, "a") as sink:
        JsonResult.sink = sink
        runner = unittest.TextTestRunner(resultclass=JsonResult, verbosity=1, stream=sys.stderr)
        runner.run(suite)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
