"""Run on 2 nodes x 2 ranks: rank 0 (the store's host) SIGKILLs itself; the three others shrink.

Rank 1 shares rank 0's host (its death shows in /proc as well); ranks 2 and 3 learn it only
from the refused connection to its roster socket across the veth pair.
"""
import os
import signal
import sys
import time

import numpy as np

import ringcomm

comm = ringcomm.init()
comm.all_reduce(np.ones(1000))  # every rank is up
if comm.rank == 0:
    # Die only once every rank has finished that call: a rank that returns from a collective may
    # still have its last messages in the tcp link's sender thread (recursive doubling sends to host B
    # last), and a SIGKILL then would fail the peers inside it rather than in the next one.
    for peer in range(1, comm.world_size):
        comm.recv(np.empty(1), peer)
    os.kill(os.getpid(), signal.SIGKILL)
comm.send(np.ones(1), 0)
try:
    comm.all_reduce(np.ones(300_000))
    print(f"rank {comm.rank}: WRONG, no error after rank 0 died")
    sys.exit(1)
except ringcomm.RingcommError:
    pass
t0 = time.monotonic()
new = comm.shrink()
elapsed = time.monotonic() - t0
y = np.full(1001, comm.rank + 1.0)
new.all_reduce(y)
ok = (new.rank, new.world_size) == (comm.rank - 1, 3) and bool((y == 2 + 3 + 4).all())
ok &= elapsed < comm.timeout
print(f"rank {comm.rank}: shrink took {elapsed:.2f} s, now rank {new.rank} of {new.world_size} "
      f"{'OK' if ok else 'WRONG'}")
new.close()
comm.close()
sys.exit(0 if ok else 1)
