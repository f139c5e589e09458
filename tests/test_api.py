"""The API's contract on one process: bad input is refused before any byte moves."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ringcomm
from ringcomm.init import from_environment


@pytest.fixture
def comm():
    with ringcomm.init() as c:
        yield c


def test_world_of_one_without_environment(comm):
    assert (comm.rank, comm.world_size, comm.local_rank) == (0, 1, 0)
    x = np.arange(5, dtype=np.float32)
    assert comm.all_reduce(x, "avg") is x and (x == np.arange(5)).all()


@pytest.mark.parametrize("env,want", [
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, (3, 8, 1)),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, (2, 4, 0)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, (1, 2, 1)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2"}, (5, 6, 2)),
    ({}, (0, 1, 0)),
])
def test_environment_of_each_launcher(monkeypatch, env, want):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert from_environment() == want


def test_ops_by_name_and_constant(comm):
    for op in (ringcomm.SUM, "sum", "SUM", ringcomm.MAX, "prod", "min", "avg"):
        comm.all_reduce(np.ones(3, np.int32), op)
    with pytest.raises(ValueError, match="unknown reduction op 'mean'"):
        comm.all_reduce(np.ones(3), "mean")


@pytest.mark.parametrize("bad,exc,match", [
    ([1.0, 2.0], TypeError, "must be a numpy array"),
    (np.ones(4, np.complex64), TypeError, "dtype complex64"),
    (np.ones(4, np.bool_), TypeError, "dtype bool"),
    (np.ones((4, 4), np.float32)[:, ::2], ValueError, "not C-contiguous"),
])
def test_bad_buffers(comm, bad, exc, match):
    with pytest.raises(exc, match=match):
        comm.all_reduce(bad)


def test_read_only_buffer(comm):
    x = np.ones(4, np.float32)
    x.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        comm.all_reduce(x)
    comm.all_reduce(x, out=np.empty(4, np.float32))  # reading it is fine


def test_out_of_the_wrong_size_or_dtype(comm):
    with pytest.raises(ValueError, match="all_gather out has 3 elements, expected 4"):
        comm.all_gather(np.ones(4, np.float32), np.empty(3, np.float32))
    with pytest.raises(TypeError, match="dtypes differ"):
        comm.all_reduce(np.ones(4, np.float32), out=np.empty(4, np.float64))
    with pytest.raises(ValueError, match="reduce_scatter buf"):
        comm.reduce_scatter(np.ones(5, np.float32), np.empty(4, np.float32))


def test_partial_overlap_is_refused(comm):
    x = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="overlap"):
        comm.all_reduce(x[:6], out=x[2:8])


def test_root_and_peer_out_of_range(comm):
    with pytest.raises(ValueError, match="broadcast root 1 is out of range for world_size 1"):
        comm.broadcast(np.ones(2), root=1)
    with pytest.raises(ValueError, match="reduce root -1"):
        comm.reduce(np.ones(2), root=-1)
    with pytest.raises(ValueError, match="send peer 0 is this rank itself"):
        comm.send(np.ones(2), 0)


def test_unknown_algorithm(comm):
    with pytest.raises(ValueError, match="all_gather has no algorithm 'tree'"):
        comm.all_gather(np.ones(2), np.empty(2), algo="tree")


def test_closed_communicator_refuses_calls():
    comm = ringcomm.init()
    comm.close()
    with pytest.raises(ringcomm.CommunicatorClosed, match="closed"):
        comm.barrier()
    with pytest.raises(ValueError, match="closed"):  # bad input, as a closed file's I/O is
        comm.all_reduce(np.ones(4, np.float32))


def test_any_shape_and_bfloat16(comm):
    x = np.arange(24, dtype=ml_dtypes.bfloat16).reshape(2, 3, 4)
    out = np.empty_like(x)
    assert comm.all_reduce(x, "max", out=out) is out
    assert out.shape == (2, 3, 4) and (out == x).all()


def test_bad_knobs(monkeypatch):
    monkeypatch.setenv("RINGCOMM_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="RINGCOMM_TIMEOUT='soon' is not a number"):
        ringcomm.init()
    monkeypatch.setenv("RINGCOMM_TIMEOUT", "5")
    monkeypatch.setenv("RINGCOMM_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ValueError, match="RINGCOMM_TRANSPORT='carrier-pigeon'"):
        ringcomm.init()
