"""What the forkserver of tests/harness.py imports once, so that every rank forked from it starts
with it: numpy, ringcomm, numba, and the native engine's compiled loop loaded from numba's disk cache
(together ~1 s of CPU per rank on this machine, measured: a 2-rank World cost 1.9 s of CPU). Not
the loop where harness.start_forkserver(engine=False) says so: in CI's Soft-RoCE guest, whose
emulated CPU makes each rank's imports cost ~10x more, no link runs it and compiling it would take
minutes."""
import os

import numba  # noqa: F401  (numba.cuda is left to the ranks: harness.SET_AFTER_FORK)
import numpy  # noqa: F401

import ringcomm  # noqa: F401
from harness import PRELOAD_ENGINE

if os.environ.get(PRELOAD_ENGINE, "1") == "1":
    from ringcomm.engine_native import warm
    warm()
