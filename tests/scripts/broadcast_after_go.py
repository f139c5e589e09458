"""Writes its pid to $PID_DIR/rank<R> right after init, waits for $PID_DIR/go, then broadcasts from
rank 0 (ring: 0 -> 1 -> 2 -> ...) until stopped. The failure tests kill a rank before "go": it dies
before it published or wrote anything on its links, and the others must report it, not wait out
their timeout."""
import os
import sys
import time

import numpy as np

import ringcomm

comm = ringcomm.init()
path = os.path.join(os.environ["PID_DIR"], f"rank{comm.rank}")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(os.environ["PID_DIR"], "go")) and time.monotonic() < deadline:
    time.sleep(0.05)    # polling for a file the test writes, with a deadline
x = np.ones(1 << 14, dtype=np.float32)
try:
    for _ in range(100):
        comm.broadcast(x, 0, algo="ring")
except ringcomm.RingcommError as e:
    print(f"ERROR {e}", file=sys.stderr, flush=True)
    sys.exit(1)
comm.close()
