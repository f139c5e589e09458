"""The words of a rank's control segment for the read steps (read_engine.py, read_native.py).

Each rank's control segment (int64 words, written only by its owner, read by its peers; each
word is stored after what it announces, which x86's store order makes visible first, as
transport/shm.py explains and checks) holds:

    PID, CLOSED  liveness, as in transport/shm.py; MAPPED: allocations whose peers this rank mapped
    CALLS        registered calls this rank has entered; the descriptor below belongs to the last
    DESC..+3     where this call's input and output are: (allocation index, byte offset) each;
                 for a plain buffer (-1, its address in this process), read by CMA (plain_read.py)
    DESC+4, +5   the input's and the output's byte counts
    SYNC + p     syncs this rank has reached with rank p (step kind "sync"), counted for the whole run
    sleep_flag(n, p)  set while this rank sleeps on one of rank p's words (p's publish wakes it only
                 then); ctl_words(n) words in all

Words are grouped by who writes them how often, a 64-byte cache line each: a line a peer has just
written costs a reader a transfer between cores (~0.1-0.2 us in these VMs), so the words of one
call's handshake share a line (CALLS with its descriptor: one transfer where two lines took two),
the liveness words that a call reads but no call writes have their own, and so do the sleep
flags, which every publish reads and only a sleeping rank writes (on the SYNC words' line, which
every call stores to, each of those reads cost a transfer).
"""
from __future__ import annotations

PID, CLOSED, MAPPED = 1, 2, 3     # int64 word indices (word 0: magic); the first line
CALLS, DESC = 8, 9                # the second line: a call's handshake
SYNC = 16                         # from the third line: SYNC + p for every rank p
LINE_WORDS = 8


def sleep_flag(n: int, p: int) -> int:
    """The word set while this rank (of n) sleeps on rank p's words: on lines after the SYNC words."""
    return -(-(SYNC + n) // LINE_WORDS) * LINE_WORDS + p


def ctl_words(n: int) -> int:
    """Words in the control segment of a rank among n."""
    return sleep_flag(n, n)
