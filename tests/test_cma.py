"""transport/cma.py: single-copy reads and writes of another process's memory (process_vm_readv)."""
import errno
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

from ringcomm.transport import cma

pytestmark = pytest.mark.skipif(not cma.available(), reason="no process_vm_readv in this libc (not Linux)")

PEER = r"""
import sys, numpy as np
x = np.arange(1 << 18, dtype=np.uint32)          # 1 MiB, private memory of this process
print(x.ctypes.data, flush=True)
sys.stdin.readline()                              # the test reads and writes, then lets us go
print(int(x[7]), int(x[-1]), flush=True)
"""


@pytest.fixture
def peer():
    p = subprocess.Popen([sys.executable, "-c", PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield p, int(p.stdout.readline())
    finally:
        p.kill()
        p.wait(30)


def test_read_and_write_another_process(peer):
    p, addr = peer
    got = np.zeros(1 << 18, np.uint32)
    cma.read(p.pid, addr, got.ctypes.data, got.nbytes)
    assert np.array_equal(got, np.arange(1 << 18, dtype=np.uint32))
    mine = np.array([99], np.uint32)
    cma.write(p.pid, addr + 7 * 4, mine.ctypes.data, 4)
    cma.write(p.pid, addr + (got.size - 1) * 4, mine.ctypes.data, 4)
    p.stdin.write("go\n")
    p.stdin.flush()
    assert p.stdout.readline().split() == ["99", "99"]


def test_partial_transfer_continues_then_names_the_failing_address():
    # Two pages, the second unmapped: the kernel copies the first, then the next call fails.
    page = mmap.PAGESIZE
    m = mmap.mmap(-1, 2 * page)
    src = np.frombuffer(m, np.uint8)
    src[:] = 7
    base = src.ctypes.data
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.munmap(ctypes.c_void_p(base + page), ctypes.c_size_t(page)) == 0
    dst = np.zeros(2 * page, np.uint8)
    with pytest.raises(cma.CmaError) as e:
        cma.read(os.getpid(), base, dst.ctypes.data, 2 * page)
    assert e.value.errno == errno.EFAULT and f"({page} of {2 * page} bytes done)" in str(e.value)
    assert (dst[:page] == 7).all() and (dst[page:] == 0).all()   # the first page did arrive
    cma.read(os.getpid(), base, dst.ctypes.data, page)           # within the mapping: fine


def test_a_peer_that_is_gone_is_esrch(peer):
    p, addr = peer
    p.kill()
    p.wait(30)
    buf = np.zeros(4, np.uint8)
    with pytest.raises(cma.CmaError) as e:
        cma.read(p.pid, addr, buf.ctypes.data, 4)
    assert e.value.errno == errno.ESRCH and "peer is gone" in str(e.value)


def test_probe_says_why_a_target_is_not_permitted():
    # A real refusal: an unprivileged process probing one it may not ptrace (as root: a child that
    # drops to nobody probes this process; else: this process probes pid 1, which root owns).
    word = np.frombuffer(b"ringcma!", np.uint8).copy()
    if os.geteuid() == 0:
        code = (f"import os; from ringcomm.transport import cma; os.setgid(65534); os.setuid(65534); "
                f"print(cma.probe({os.getpid()}, {word.ctypes.data}, b'ringcma!'))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        why = r.stdout + r.stderr
    else:
        why = str(cma.probe(1, 0x1000, b"ringcma!"))
    assert "not permitted" in why, why
    assert cma.probe(os.getpid(), word.ctypes.data, b"ringcma!") is None
    assert "other bytes" in cma.probe(os.getpid(), word.ctypes.data, b"RINGCMA!")


def test_the_crossover_grows_with_ranks_per_core(monkeypatch):
    from ringcomm import plain_read
    monkeypatch.delenv("RINGCOMM_CMA_MIN", raising=False)
    monkeypatch.setattr(plain_read, "CORES", 2)
    mib = 1 << 20
    for collective, least in (("broadcast", 64 << 10), ("all_gather", 32 << 10)):   # with a core a rank
        assert plain_read.wanted(collective, least, 2) and not plain_read.wanted(collective, least - 1, 2)
        # stacked: 128 KiB a rank per core, rounded up
        assert not plain_read.wanted(collective, mib // 4 - 1, 3) and plain_read.wanted(collective, mib // 4, 4)
        assert not plain_read.wanted(collective, 3 * mib // 8 - 1, 5) and plain_read.wanted(collective, 3 * mib // 8, 6)
    for collective, least in (("all_reduce", mib // 8), ("reduce_scatter", mib)):   # of input, a core a rank
        assert plain_read.wanted(collective, least, 2) and not plain_read.wanted(collective, least - 1, 2)
        assert plain_read.wanted(collective, 1 << 40, 1)
    for collective, least in (("all_reduce", 2 * mib), ("reduce_scatter", 8 * mib)):   # stacked: a rank per core
        assert not plain_read.wanted(collective, 2 * least - 1, 3) and plain_read.wanted(collective, 2 * least, 4)
        assert not plain_read.wanted(collective, 3 * least - 1, 5) and plain_read.wanted(collective, 3 * least, 6)
    assert not plain_read.wanted("reduce", 1 << 40, 2)  # a rooted reduce keeps the FIFOs
    monkeypatch.setenv("RINGCOMM_CMA_MIN", "4096")           # the knob, as given, whatever the ranks
    assert plain_read.wanted("broadcast", 4096, 8) and not plain_read.wanted("broadcast", 4095, 2)
    assert plain_read.wanted("all_reduce", 4096, 8)          # nor a core a rank, then
