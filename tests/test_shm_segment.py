"""The shm transport's segments: pages reserved when made, mapped when attached, and a full /dev/shm
refused at connection time with the fix in the message (transport/shm.py, _Segment)."""
from __future__ import annotations

import errno
import os
import resource
import secrets

import numpy as np
import pytest

from ringcomm.transport import shm

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this system")
NSLOTS, SLOT = 4, 256 * 1024


def _name() -> str:
    return f"rc-tseg{secrets.token_hex(4)}-{os.getpid()}-1"


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_new_segment_owns_its_pages_and_both_ends_write_every_slot_without_faulting():
    name = _name()
    made = shm._Segment(name, NSLOTS, SLOT, create=True)
    try:
        size = shm.HDR + NSLOTS * SLOT
        assert os.stat(made.path).st_blocks * 512 >= size, "posix_fallocate did not reserve the pages"
        attached = shm._Segment(name, NSLOTS, SLOT, create=False)
        try:
            for seg in (made, attached):
                before = _minor_faults()
                for slot in seg.slots:
                    slot[::4096] = 1           # one store per page, as a first slice through it
                # MAP_POPULATE mapped every page: a handful of faults at most (numpy's own), not one per page
                assert _minor_faults() - before < NSLOTS * SLOT // 4096 // 4
            assert all(np.all(s[::4096] == 1) for s in attached.slots)
        finally:
            attached.close()
    finally:
        made.unlink()
        made.close()


def test_a_full_dev_shm_is_an_error_that_says_what_to_do_and_leaves_nothing(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    name = _name()
    with pytest.raises(OSError) as info:
        shm._Segment(name, NSLOTS, SLOT, create=True)
    assert info.value.errno == errno.ENOSPC
    assert "/dev/shm has no room" in str(info.value) and "--shm-size" in str(info.value)
    assert "RINGCOMM_BUFFSIZE" in str(info.value)
    assert not os.path.exists(f"/dev/shm/{name}"), "the half-made segment stayed in /dev/shm"


def test_a_file_system_without_fallocate_still_gets_a_segment(monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    seg = shm._Segment(_name(), NSLOTS, SLOT, create=True)
    try:
        seg.slots[-1][-1] = 7
        assert seg.slots[-1][-1] == 7
    finally:
        seg.unlink()
        seg.close()


def test_a_forked_child_leaves_the_parents_names_in_dev_shm():
    # A name stays until the peer maps its segment. A child forked meanwhile did not make it, and its
    # exit (unlink_named runs at exit) must not take it from the peer that has yet to open it.
    path = f"/dev/shm/{_name()}"
    open(path, "w").close()
    shm.track(path)
    try:
        pid = os.fork()
        if pid == 0:
            shm.unlink_named()
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.path.exists(path)
    finally:
        shm.unlink_tracked(path)
    assert not os.path.exists(path)
