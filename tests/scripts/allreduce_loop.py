"""Runs 64 MiB all_reduces until stopped; writes its pid to $PID_DIR/rank<R> once the first one is done.

Used by the failure tests: one rank is SIGKILLed mid-collective and the others must
report it and exit rather than hang.
"""
import os
import sys

import numpy as np

import ringcomm

comm = ringcomm.init()
x = np.ones(int(os.environ.get("COUNT", 16 << 20)), dtype=np.float32)  # 64 MiB unless COUNT says
comm.all_reduce(x)
# Written whole, then renamed into place: a reader that sees the name sees the pid (a file opened
# for writing exists, empty, before its write lands).
path = os.path.join(os.environ["PID_DIR"], f"rank{comm.rank}")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
try:
    for _ in range(int(os.environ.get("ITERATIONS", "1000"))):
        comm.all_reduce(x)
except ringcomm.RingcommError as e:
    print(f"ERROR {e}", file=sys.stderr, flush=True)
    sys.exit(1)
comm.close()
