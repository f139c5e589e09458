"""Your own algorithms: the chunk-flow language, register_algorithm, algo=name on real processes."""
from __future__ import annotations

import pathlib
import runpy
import subprocess
import sys

import numpy as np
import pytest

import ringcomm
from harness import World
from ringcomm import catalogue
from ringcomm.algorithms import algorithms, check_algorithm, schedules
from ringcomm.schedule.lang import Program, ProgramError, program_builder
from ringcomm.schedule.ring import ring_all_gather, ring_all_reduce
from ringcomm.schedule.simulate import ScheduleError, check
from ringcomm.schedule.step import recv, send

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "bidirectional_ring.py"


def ring_program(n: int) -> Program:
    """NCCL's ring all_reduce as chunk flows: chunk c starts at rank c+1 and goes round twice."""
    p = Program("all_reduce", n, nchunks=n, name="ring_lang")
    for c in range(n):
        v = p.chunk((c + 1) % n, c)
        for k in range(2, n + 1):
            v = p.chunk((c + k) % n, c).reduce(v, output=k == n)
        for k in range(1, n):
            v = v.copy((c + k) % n)
    if n == 1:
        p.chunk(0, 0).output()
    return p


@pytest.mark.parametrize("n", range(1, 10))
def test_lang_ring_compiles_to_ncclS_ring(n):
    """Depth order reproduces ring.py's hand-written steps exactly."""
    scheds = ring_program(n).compile()
    assert [s.steps for s in scheds] == [ring_all_reduce(r, n).steps for r in range(n)]
    check("all_reduce", scheds)


def test_lang_all_gather_and_multi_input_reduce():
    n = 4
    p = Program("all_gather", n, nchunks=n)
    for r in range(n):
        v = p.chunk(r, r).output()
        for k in range(1, n):
            v = v.copy((r + k) % n)
    assert [s.steps for s in p.compile()] == [ring_all_gather(r, n).steps for r in range(n)]
    # a star reduce: rank 0 adds everyone's chunk in one step (one reduce chain, three inputs)
    p = Program("reduce", 4, nchunks=1)
    v = p.chunk(0, 0)
    for r in (1, 2, 3):
        v = v.reduce(p.chunk(r, 0))
    v.output()
    scheds = p.compile()
    assert str(scheds[0].steps[0]) == "recv_reduce_copy(0, from=[1, 2, 3])"
    res = check("reduce", scheds, root=0)
    assert str(res.outputs[0][0]) == "(((x0[0] + x1[0]) + x2[0]) + x3[0])/post"


def _lang_doubling(n):
    """Recursive doubling as chunk flows: each stage reduces the partner's kept sum into one's own."""
    p = Program("all_reduce", n, nchunks=1, name="lang_doubling")
    s = [p.chunk(r, 0) for r in range(n)]
    for j in range(n.bit_length() - 1):
        s = [s[r].reduce(s[r ^ (1 << j)], output=True) for r in range(n)]
    return p


@pytest.mark.parametrize("n", [2, 4, 8])
def test_lang_carries_a_kept_sum_as_the_built_in_doubling_does(n):
    from ringcomm.schedule.recursive import doubling_all_reduce
    scheds = _lang_doubling(n).compile()
    assert [s.steps for s in scheds] == [doubling_all_reduce(r, n).steps for r in range(n)]
    assert str(scheds[0].steps[-1]) == f"recv_reduce_copy(0, from=[{n // 2}], base=out)" or n == 2
    res = check("all_reduce", scheds)
    assert all(v.post and len(v.terms) == n for out in res.outputs for v in out)


def test_lang_explains_what_steps_cannot_do():
    p = Program("all_reduce", 3, nchunks=3)
    with pytest.raises(ProgramError, match="its own index"):
        p.chunk(0, 0).reduce(p.chunk(1, 2))
    with pytest.raises(ProgramError, match="already holds"):
        p.chunk(0, 0).reduce(p.chunk(0, 0))
    v = p.chunk(1, 1).reduce(p.chunk(0, 1))
    v.copy(2)
    with pytest.raises(ProgramError, match="sent but not kept"):
        v.reduce(p.chunk(2, 1))
    kept = p.chunk(2, 2).reduce(p.chunk(1, 2), output=True)
    kept.reduce(p.chunk(0, 2), output=True)
    with pytest.raises(ProgramError, match="carried on already"):
        kept.reduce(p.chunk(0, 2))
    with pytest.raises(ProgramError, match="received copy"):
        p.chunk(0, 0).copy(1).reduce(p.chunk(2, 0))
    with pytest.raises(ProgramError, match="to itself"):
        p.chunk(0, 0).copy(0)
    with pytest.raises(ProgramError, match="out of range"):
        p.chunk(3, 0)
    p2 = Program("all_reduce", 2, nchunks=1)
    p2.chunk(0, 0).reduce(p2.chunk(1, 0))
    with pytest.raises(ProgramError, match="neither keeps nor sends"):
        p2.compile()
    with pytest.raises(ValueError, match="nchunks must be 3"):
        Program("reduce_scatter", 3, nchunks=6)
    with pytest.raises(ProgramError, match="owns only its block"):
        Program("all_gather", 3, nchunks=3).chunk(0, 1)


def test_register_validates_and_refuses():
    with pytest.raises(ValueError, match="algorithm name"):
        ringcomm.register_algorithm("no spaces", "all_reduce", ring_all_reduce)
    with pytest.raises(ValueError, match="collective must be"):
        ringcomm.register_algorithm("x", "allreduce", ring_all_reduce)
    with pytest.raises(TypeError, match="callable"):
        ringcomm.register_algorithm("x", "all_reduce", 42)
    with pytest.raises(ValueError, match="built-in"):
        ringcomm.register_algorithm("ring", "all_reduce", ring_all_reduce, replace=True)

    def swapped(rank, n):  # rank 1 sends a chunk index its peer does not expect
        s = ring_all_reduce(rank, n)
        if rank == 1 and n > 2:
            steps = list(s.steps)
            steps[0] = send((steps[0].chunk + 1) % n, steps[0].dst)
            return type(s)(**{**s.__dict__, "steps": tuple(steps)})
        return s
    with pytest.raises(ScheduleError, match="'swapped' for all_reduce at world size 3"):
        ringcomm.register_algorithm("swapped", "all_reduce", swapped)
    assert "swapped" not in algorithms("all_reduce"), "a failed check registers nothing"


def test_register_lazy_check_at_new_world_size():
    calls = []

    def only_small_ok(rank, n):
        calls.append(n)
        if n == 11:  # wrong only at a size registration did not try
            return ring_all_reduce(rank, n) if rank else ring_all_reduce(rank, n).__class__(
                "all_reduce", "x", 0, n, n, "split", "split", (recv(0, n - 1),))
        return ring_all_reduce(rank, n)
    ringcomm.register_algorithm("lazy_demo", "all_reduce", only_small_ok, sizes=(2, 3))
    try:
        assert set(calls) == {2, 3}
        sched = catalogue.build_schedule("all_reduce", "lazy_demo", 0, 4, None)  # first use at n=4: checked
        assert sched.steps == ring_all_reduce(0, 4).steps and 4 in calls
        with pytest.raises(ScheduleError, match="world size 11"):
            catalogue.build_schedule("all_reduce", "lazy_demo", 0, 11, None)
        with pytest.raises(ValueError, match="already has"):
            ringcomm.register_algorithm("lazy_demo", "all_reduce", ring_all_reduce)
        ringcomm.register_algorithm("lazy_demo", "all_reduce", ring_all_reduce, replace=True)
        assert catalogue.build_schedule("all_reduce", "lazy_demo", 0, 11, None).steps == ring_all_reduce(0, 11).steps
    finally:
        ringcomm.unregister_algorithm("lazy_demo", "all_reduce")
    assert "lazy_demo" not in algorithms("all_reduce")


def test_rooted_builder_checked_for_every_root():
    from ringcomm.schedule.tree import tree_broadcast
    scheds = check_algorithm("broadcast", tree_broadcast, 5, 3)
    assert len(scheds) == 5
    with pytest.raises(ScheduleError, match="root 2"):
        check_algorithm("broadcast", lambda r, n, root: tree_broadcast(r, n, 0), 5, 2)
    assert len(schedules("broadcast", "tree", 4, root=1)) == 4


def _run_registered(comm, count):
    """In a spawned rank: register the example's algorithm and the lang ring, run them."""
    ns = runpy.run_path(str(EXAMPLE))
    ringcomm.register_algorithm("bidir_ring", "all_reduce", program_builder(ns["bidirectional_ring"]),
                                replace="bidir_ring" in algorithms("all_reduce"))
    ringcomm.register_algorithm("ring_lang", "all_reduce", program_builder(ring_program),
                                replace="ring_lang" in algorithms("all_reduce"))
    n, r = comm.world_size, comm.rank
    xs = [np.random.default_rng([3, k]).integers(-99, 99, count).astype(np.int32) for k in range(n)]
    out = []
    for algo in ("bidir_ring", "ring_lang"):
        x = xs[r].copy()
        comm.all_reduce(x, algo=algo)
        out.append(bool((x == sum(xs)).all()))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_registered_algorithms_run_on_real_processes(n):
    env = {"RINGCOMM_BUFFSIZE": "4096", "RINGCOMM_NSLOTS": "4"}  # 1 KiB slots: many rounds
    with World(n, env, timeout=60) as w:
        assert w.run(_run_registered, 10_007, timeout=90) == [[True, True]] * n


@pytest.mark.timeout(120)
def test_example_runs_under_ringcomm_run():
    out = subprocess.run([sys.executable, "-m", "ringcomm.launch", "-n", "3", str(EXAMPLE)],
                         capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.count("bidir_ring all_reduce of 100003 int64 OK") == 3
    assert "postcondition: holds" in out.stdout


def test_lang_stage_groups_sends_into_one_message():
    """all_gather on 3 ranks where rank 1 relays rank 0's block to rank 2: rank 1 sends rank 2 its
    own block at depth 0 and the relayed one at depth 1, two messages; stage=1 on its own block's
    send makes them one (the cost model's message = same sender, receiver and stage)."""
    from ringcomm.schedule.cost import messages

    def prog(stage):
        p = Program("all_gather", 3, nchunks=3)
        p.chunk(0, 0).output().copy(1).copy(2)
        own = p.chunk(1, 1).output()
        own.copy(2, stage=stage)
        own.copy(0)
        v = p.chunk(2, 2).output()
        v.copy(0)
        v.copy(1)
        return p.compile()
    plain, staged = prog(None), prog(1)
    for s in (plain, staged):
        check("all_gather", s)
    assert not plain[1].stages and staged[1].stages
    assert sorted(k for k in messages(plain, 300).size if k[:2] == (1, 2)) == [(1, 2, 0), (1, 2, 1)]
    grouped = messages(staged, 300).size
    assert [k for k in grouped if k[:2] == (1, 2)] == [(1, 2, 1)] and grouped[1, 2, 1] == 200
