"""The words of a rank's control segment for the read steps (read_engine.py, read_native.py).

Each rank's control segment (int64 words, written only by its owner, read by its peers; each
word is stored after what it announces, which x86's store order makes visible first, as
transport/shm.py explains and checks) holds:

    CALLS        registered calls this rank has entered; the descriptor below belongs to the last
    DESC..+3     where this call's input and output are: (allocation index, byte offset) each;
                 for a plain buffer (-1, its address in this process), read by CMA (plain_read.py)
    DESC+4, +5   the input's and the output's byte counts
    SYNC + p     syncs this rank has reached with rank p (step kind "sync"), counted for the whole run
    SYNC + n + p set while this rank sleeps on one of rank p's words (p's publish wakes it only then);
                 ctl_words(n) = SYNC + 2n words in all
    PID, CLOSED  liveness, as in transport/shm.py; MAPPED: allocations whose peers this rank mapped
"""
from __future__ import annotations

PID, CLOSED, CALLS, MAPPED, DESC, SYNC = 1, 2, 3, 4, 8, 16  # int64 word indices (word 0: magic)


def ctl_words(n: int) -> int:
    """Words in the control segment of a rank among n: SYNC + p, then SYNC + n + p, for every rank p."""
    return SYNC + 2 * n
