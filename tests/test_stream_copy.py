"""stream_copy: large local copies with non-temporal stores give numpy's bytes, at every alignment."""
import numpy as np
import pytest

from ringcomm import stream_copy

pytestmark = pytest.mark.skipif(not stream_copy.enabled(), reason="streamed copies are x86-64 only (numpy copies elsewhere), "
                                "and RINGCOMM_STREAM_COPY=0 turns them off")


@pytest.mark.parametrize("dst_off", [0, 1, 7, 63])
@pytest.mark.parametrize("src_off", [0, 3, 32])
@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 65, 200, 4096 + 17])
def test_compiled_copy_gives_the_bytes_at_any_alignment(dst_off, src_off, nbytes):
    rng = np.random.default_rng(nbytes + 7 * dst_off + src_off)
    src_all = rng.integers(0, 256, nbytes + 128, dtype=np.uint8)
    dst_all = np.zeros(nbytes + 128, np.uint8)
    src, dst = src_all[src_off:src_off + nbytes], dst_all[dst_off:dst_off + nbytes]
    stream_copy.kernel()(dst, src)
    np.testing.assert_array_equal(dst, src)
    assert not dst_all[:dst_off].any() and not dst_all[dst_off + nbytes:].any()   # nothing outside


def test_large_copy_streams_and_matches_numpy(monkeypatch):
    calls = []
    compiled = stream_copy.kernel()
    monkeypatch.setattr(stream_copy, "_kernel", lambda d, s: calls.append(d.size) or compiled(d, s))
    src = np.random.default_rng(1).standard_normal(stream_copy.STREAM_MIN_BYTES // 8 + 5)
    out = np.full_like(src, np.nan)
    stream_copy.copy(np.empty(100), src[:100])   # small: numpy's copy
    stream_copy.copy(out[1:], src[:-1])          # unaligned by 8 bytes: a head and a tail
    assert calls == [out[1:].nbytes]
    assert np.array_equal(out[1:].view(np.uint64), src[:-1].view(np.uint64)) and np.isnan(out[0])


def test_overlapping_or_strided_copies_fall_back_to_numpy():
    n = stream_copy.STREAM_MIN_BYTES // 4 + 100
    buf = np.arange(n + 50, dtype=np.int32)
    want = buf[:n].copy()
    stream_copy.copy(buf[50:], buf[:n])          # overlapping: numpy's copy is overlap-safe
    np.testing.assert_array_equal(buf[50:], want)
    a = np.arange(2 * n, dtype=np.int32)
    out = np.zeros(n, np.int32)
    stream_copy.copy(out, a[::2])                # a strided source
    np.testing.assert_array_equal(out, a[::2])


def test_knob_rejects_nonsense(monkeypatch):
    monkeypatch.setenv("RINGCOMM_STREAM_COPY", "sometimes")
    with pytest.raises(ValueError, match="RINGCOMM_STREAM_COPY"):
        stream_copy.enabled()
    monkeypatch.setenv("RINGCOMM_STREAM_COPY", "0")
    assert not stream_copy.enabled()


@pytest.mark.parametrize("dst_off", [0, 1, 63])
@pytest.mark.parametrize("src_off", [0, 3])
@pytest.mark.parametrize("nbytes", [0, 1, 64, 65, 200, 4096 + 17])
def test_the_compiled_read_calls_copy_streams_the_same_bytes_by_address(dst_off, src_off, nbytes):
    """read_native's local copy (its copy rows), by address: memmove below consts[STREAM_MIN], lines
    streamed from it; here the threshold is 1 byte, so every case streams what it can."""
    from ringcomm import read_native as rn
    rn.kernel()
    consts = rn.constants(2, 0, 0)
    consts[rn.STREAM_MIN] = 1
    rng = np.random.default_rng(nbytes + 7 * dst_off + src_off)
    src_all = rng.integers(0, 256, nbytes + 128, dtype=np.uint8)
    dst_all = np.zeros(nbytes + 128, np.uint8)
    rn._copy(dst_all.ctypes.data + dst_off, src_all.ctypes.data + src_off, nbytes, nbytes, consts)
    np.testing.assert_array_equal(dst_all[dst_off:dst_off + nbytes], src_all[src_off:src_off + nbytes])
    assert not dst_all[:dst_off].any() and not dst_all[dst_off + nbytes:].any()   # nothing outside


def test_the_compiled_read_calls_copy_of_overlapping_bytes_is_a_memmove():
    from ringcomm import read_native as rn
    rn.kernel()
    consts = rn.constants(2, 0, 0)
    consts[rn.STREAM_MIN] = 1
    buf = np.arange(5000, dtype=np.uint8)
    want = buf[:4000].copy()
    rn._copy(buf.ctypes.data + 100, buf.ctypes.data, 4000, 4000, consts)   # forward overlap: streaming would smear it
    np.testing.assert_array_equal(buf[100:4100], want)
    assert rn.constants(2, 0, 0)[rn.STREAM_MIN] == stream_copy.STREAM_MIN_BYTES


def test_the_compiled_pieces_of_a_big_block_stream_as_pythons_do():
    """A registered all_gather's block goes in 1 MiB pieces (memmoves into the peer, then the copy
    here); each piece row carries the whole block's bytes (WHOLE), on which streaming is decided,
    as Python's path passes ``whole`` to stream_copy.copy: a 32 MiB block's pieces stream."""
    from ringcomm import read_native as rn
    from ringcomm.read_engine import step_spans
    from ringcomm.schedule.onecopy import read_all_gather
    block = 4 * stream_copy.STREAM_MIN_BYTES
    sched = read_all_gather(0, 2)
    rows, _ = rn.plan(sched, step_spans(sched, block // 4), 4, 0, by_cma=False)   # its input: one block
    pieces = rows[(rows[:, rn.KIND] == rn.WRITE) | (rows[:, rn.KIND] == rn.COPY)]
    assert len(pieces) == 2 * block // rn.WRITE_PIECE_BYTES
    assert (pieces[:, rn.NBYTES] == rn.WRITE_PIECE_BYTES).all() and (pieces[:, rn.WHOLE] == block).all()
