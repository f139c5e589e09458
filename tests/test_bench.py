"""ringcomm-bench: its sizes, its arithmetic, its check data, its table, and two short real runs.

The benchmark's figures themselves are never asserted (benchmarks stay out of the suite); what is
asserted is the instrument: nccl-tests' columns and footer, busbw factors, that every expected
result is exact, and that a corrupted result is counted as wrong and fails the run.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import ringcomm.algorithms
import ringcomm.model
from ringcomm.bench import alternate, jobs, machine, placement, report, runs, spec, verify, worker
from ringcomm.bench.backends import Backend
from ringcomm.bench.cli import parse_args
from ringcomm.kernels import host
from ringcomm.transport.base import pid_alive

# ---- sizes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, nbytes", [("8", 8), ("64K", 65536), ("64k", 65536), ("1M", 1 << 20),
                                          ("64M", 64 << 20), ("1G", 1 << 30), ("1.5K", 1536), ("0", 0),
                                          (" 2m ", 2 << 20), ("4KB", 4096)])
def test_parse_size_follows_nccl_tests(text, nbytes):
    assert spec.parse_size(text) == nbytes


@pytest.mark.parametrize("bad", ["", "K", "12Q", "-4", "1e3", "one"])
def test_parse_size_rejects_junk(bad):
    with pytest.raises(ValueError, match="invalid size"):
        spec.parse_size(bad)


def test_sweep_is_geometric_and_inclusive():
    assert spec.sweep(8, 64 << 20, 4)[-1] == 32 << 20  # 8 * 4^k never hits 64M, as in nccl-tests
    assert spec.sweep(16, 64 << 20, 4) == [16 * 4**k for k in range(12)]
    assert spec.sweep(1024, 1024, 2) == [1024]
    assert spec.sweep(0, 4, 2) == [0, 1, 2, 4]
    with pytest.raises(ValueError):
        spec.sweep(64, 8, 2)
    with pytest.raises(ValueError):
        spec.sweep(8, 64, 1)


def test_cli_rejects_bad_arguments(capsys):
    for argv in (["all_reduce", "-b", "12Q"], ["broadcast", "-n", "2", "-r", "2"],
                 ["all_gather", "--algo", "tree"], ["sendrecv", "-n", "1"], ["all_reduce", "-d", "float8"],
                 ["all_reduce", "--engine", "fast"], ["all_reduce", "--min-row-ms", "-1"]):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2
    from ringcomm.catalogue import ALGOS
    a = parse_args(["reduce", "-d", "float16", "--algo", "all", "-b", "1K", "-e", "4K"])
    assert (a.datatype, a.algos, a.sizes) == ("half", [x for x in ALGOS["reduce"] if x != "read"], [1024, 2048, 4096])
    assert "read" in parse_args(["reduce", "--algo", "all", "--registered"]).algos  # it reads registered buffers
    assert parse_args(["all_reduce", "--algo", "ring,auto"]).algos == ["ring", None]
    assert parse_args(["all_reduce", "--engine", "python"]).engine == "python"
    assert parse_args(["all_reduce", "--min-row-ms", "10"]).min_row_ms == 10.0
    assert parse_args(["all_reduce"]).min_row_ms == 0.0   # nccl-tests' fixed count by default


# ---- arithmetic ----------------------------------------------------------------------------------

@pytest.mark.parametrize("coll, factor", [("all_reduce", 2 * 3 / 4), ("all_gather", 3 / 4),
                                          ("reduce_scatter", 3 / 4), ("broadcast", 1.0),
                                          ("reduce", 1.0), ("sendrecv", 1.0), ("all_to_all", 3 / 4),
                                          ("gather", 3 / 4), ("scatter", 3 / 4)])
def test_busbw_uses_nccl_tests_factors(coll, factor):
    count, send_n, recv_n, size = spec.counts(coll, 4096, 4, 4)
    algbw, busbw = spec.bandwidth(coll, size, 2e-6, 4)
    assert algbw == pytest.approx(size / 1e9 / 2e-6)
    assert busbw == pytest.approx(algbw * factor)
    assert spec.bandwidth(coll, size, 0.0, 4) == (0.0, 0.0)
    if coll == "all_gather":  # count is per rank; the size column is the gathered output
        assert (count, send_n, recv_n, size) == (256, 256, 1024, 4096)
    elif coll in ("reduce_scatter", "scatter"):
        assert (count, send_n, recv_n, size) == (256, 1024, 256, 4096)
    elif coll == "all_to_all":  # count is what goes to each peer
        assert (count, send_n, recv_n, size) == (256, 1024, 1024, 4096)
    elif coll == "gather":
        assert (count, send_n, recv_n, size) == (256, 256, 1024, 4096)
    else:
        assert (count, send_n, recv_n, size) == (1024, 1024, 1024, 4096)


def test_sizes_that_do_not_divide_are_truncated_like_nccl_tests():
    assert spec.counts("all_gather", 100, 4, 3) == (8, 8, 24, 96)
    assert spec.counts("all_reduce", 10, 8, 2) == (1, 1, 1, 8)
    assert spec.counts("scatter", 100, 1, 3) == (32, 96, 32, 96)   # scatter.cu: whole 16 bytes per rank
    assert spec.counts("scatter", 100, 8, 3) == (4, 12, 4, 96)
    assert spec.counts("all_to_all", 100, 4, 3) == (8, 24, 24, 96)


# ---- check data ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(spec.DTYPES))
def test_check_data_is_exact_in_any_order(dtype):
    """ringcomm's own kernels, combining ranks forwards, backwards and pairwise, land on exactly the
    expected table for every op: #wrong can only count real errors."""
    dt = spec.numpy_dtype(dtype)
    for op in spec.OPS:
        for n in (1, 2, 3, 5, 8):
            tables = [verify.input_table(dt, op, n, r) for r in range(n)]
            expected = verify.reduced_table(dt, op, n)
            for order in (list(range(n)), list(range(n))[::-1], list(range(0, n, 2)) + list(range(1, n, 2))):
                acc = tables[order[0]].copy()
                for r in order[1:]:
                    host.reduce(acc, tables[r], op)
                host.postprocess(acc, op, n)
                assert verify.count_wrong(acc, expected) == 0, (dtype, op, n, order)
            if n > 1 and op != "avg":
                assert any(not np.array_equal(tables[0], t) for t in tables[1:]), "ranks must differ"


def test_count_wrong_counts_every_corrupted_element():
    dt = np.dtype(np.float32)
    good = np.empty(5000, dt)
    verify.fill_tiled(good, verify.reduced_table(dt, "sum", 4))
    bad = good.copy()
    assert verify.count_wrong(bad, good) == 0
    bad[[0, 1021, 4999]] += 1
    assert verify.count_wrong(bad, good) == 3
    zero = np.flatnonzero(good == 0)[0]
    signed = good.copy()
    signed[zero] = -0.0  # equal as a number, but not what the exact computation gives: bits count
    assert verify.count_wrong(signed, good) == 1
    poisoned = np.empty_like(good)
    verify.poison(poisoned, good)
    assert verify.count_wrong(poisoned, good) == good.size  # an untouched output is all wrong
    with pytest.raises(ValueError):
        verify.count_wrong(good[:10], good)


def test_fill_tiled_matches_the_formula():
    table = np.arange(verify.PERIOD, dtype=np.int64)
    for size, start in ((0, 0), (5, 3), (verify.PERIOD * 3 + 17, 1000), (10000, 2 * verify.PERIOD + 1)):
        dst = np.empty(size, np.int64)
        verify.fill_tiled(dst, table, start)
        assert np.array_equal(dst, (np.arange(size) + start) % verify.PERIOD)


def _simulate(coll, n, root, ins):
    """What each rank's output holds after a correct collective (numpy, from every rank's input)."""
    red = host.reference_reduce(ins, "sum") if coll in spec.REDUCING else None
    c = ins[0].size // n if coll == "reduce_scatter" else ins[0].size
    return {"all_reduce": lambda r: red, "reduce": lambda r: red,
            "reduce_scatter": lambda r: red[r * c:(r + 1) * c],
            "all_gather": lambda r: np.concatenate(ins), "broadcast": lambda r: ins[root],
            "sendrecv": lambda r: ins[(r - 1) % n],
            "all_to_all": lambda r: np.concatenate([x[r * (c // n):(r + 1) * (c // n)] for x in ins]),
            "gather": lambda r: np.concatenate(ins),  # what the root gets (only the root is checked)
            "scatter": lambda r: ins[root][r * (c // n):(r + 1) * (c // n)]}[coll]


@pytest.mark.parametrize("coll", spec.COLLECTIVES)
def test_expected_output_of_every_collective(coll):
    """The worker's in-place / out-of-place views and expected tables agree with a numpy model of the
    collective, on 3 ranks and a count that is not a multiple of the period."""
    n, root, dt = 3, 1, np.dtype(np.int32)
    tables = {"inputs": [verify.input_table(dt, "sum", n, r) for r in range(n)],
              "reduced": verify.reduced_table(dt, "sum", n)}
    count, send_n, recv_n, _ = spec.counts(coll, 4 * 2500 * n, 4, n)
    ins = []
    for r in range(n):
        send, recv = np.zeros(send_n + recv_n, dt), np.zeros(send_n + recv_n, dt)
        inp, _, _ = worker.views(coll, False, r, n, root, send, recv, count, recv_n, send_n)
        worker.fill_input(inp, dict(tables, input=tables["inputs"][r]))
        ins.append(inp.copy())
    truth = _simulate(coll, n, root, ins)
    for r in range(n):
        exp = np.zeros(recv_n, dt)
        worker.fill_expected(coll, exp, tables, r, n, root, count)
        assert verify.count_wrong(exp, truth(r)) == 0


# ---- the table -----------------------------------------------------------------------------------

def _event(size, count, seconds, wrong, in_place):
    return {"size": size, "count": count, "in_place": in_place, "rank_seconds": seconds,
            "rank_wrong": wrong}


def test_table_has_nccl_tests_columns_and_footer():
    row = report.make_row("all_reduce", 2, "float", "sum", 0,
                          _event(1 << 20, 1 << 18, [0.9e-3, 1e-3], [0, 0], False),
                          _event(1 << 20, 1 << 18, [2e-3, 1e-3], [0, 2], True))
    peer = report.make_row("all_reduce", 2, "float", "sum", 0,
                           _event(1 << 20, 1 << 18, [2e-3, 2e-3], [0, 0], False),
                           _event(1 << 20, 1 << 18, [2e-3, 2e-3], None, True))
    head = report.header(["mpi"])
    assert head[1].split() == ["#", "size", "count", "type", "redop", "root", "time", "algbw", "busbw",
                               "#wrong", "time", "algbw", "busbw", "#wrong", "time", "busbw", "ratio"]
    assert "out-of-place" in head[0] and "in-place" in head[0] and "mpi (out-of-place)" in head[0]
    fields = report.row_line(row, [peer]).split()
    # size count type redop root | time algbw busbw #wrong (oop) | (ip) | peer time busbw ratio
    assert fields == ["1048576", "262144", "float", "sum", "-1", "1000.0", "1.05", "1.05", "0",
                      "2000.0", "0.52", "0.52", "2", "2000.0", "0.52", "2.00"]
    assert row["oop"]["seconds"] == 1e-3  # the slowest rank's mean
    assert row["oop"]["busbw"] == pytest.approx((1 << 20) / 1e9 / 1e-3 * 2 * 1 / 2)
    assert report.row_line(row, [None]).split()[-3:] == ["N/A"] * 3
    assert report.footer([row]) == ["# Out of bounds values : 1 FAILED",
                                    "# Avg bus bandwidth    : %g " % ((row["oop"]["busbw"] + row["ip"]["busbw"]) / 2),
                                    "#"]
    assert report.footer([peer])[0] == "# Out of bounds values : 0 OK"
    assert report.row_line(peer).split()[-1] == "N/A"  # an unchecked placement, as nccl-tests prints
    assert [report.fmt_time(t) for t in (3.14159, 314.159, 31415.9)] == ["   3.14", "  314.2", "  31416"]


def test_missing_peer_reason_is_one_line(monkeypatch):
    monkeypatch.setattr(jobs, "_importable", lambda name: False)
    for peer, module in (("mpi", "mpi4py"), ("gloo", "torch")):
        why = jobs.missing_reason(peer)
        assert why.startswith(f"{module} is not installed") and "ringcomm[bench]" in why and "\n" not in why
    monkeypatch.setattr(jobs, "_importable", lambda name: True)
    monkeypatch.setattr(jobs, "find_mpiexec", lambda: None)
    assert "no mpiexec" in jobs.missing_reason("mpi")


def test_a_ringcomm_job_meets_through_a_store_the_bench_already_serves():
    # The port is bound before any rank starts (no window in which another process could take it),
    # and the ranks are told to join it as clients; torch's ranks still get a port of their own.
    from ringcomm.store import TCPStore
    cfg, token = {"timeout": 30.0, "job_id": "t1"}, "a" * 32
    store = jobs.host_store(cfg, token)
    try:
        _, envs = jobs._commands("ringcomm", 2, cfg, token, store)
        assert [e["MASTER_PORT"] for e in envs] == [str(store.port)] * 2
        assert all(e[jobs.STORE_HOSTED_ENV] == "1" and e["RINGCOMM_TOKEN"] == token for e in envs)
        client = TCPStore("127.0.0.1", store.port, is_server=False, token=token, timeout=5)
        client.set("k", b"v")
        assert store.get("k") == b"v"
        client.close()
    finally:
        store.close()
    _, envs = jobs._commands("gloo", 2, cfg, token, None)
    assert all(jobs.STORE_HOSTED_ENV not in e and int(e["MASTER_PORT"]) > 0 for e in envs)


def test_progress_on_stderr_that_is_not_a_terminal():
    """A log or a pipe gets the bar as a line at each quarter of the sweep, not a stream of redraws."""
    import io
    from ringcomm.bench.machine import Progress
    err = io.StringIO()
    bar = Progress(10, stream=err)
    for i in range(10):
        bar.step(f"ringcomm auto {8 << i} B out-of-place")
    lines = err.getvalue().splitlines()
    assert [l.split("]")[1].split()[0] for l in lines] == ["3/10", "5/10", "8/10", "10/10"], lines
    assert lines[-1].startswith("ringcomm-bench: [" + "#" * 30 + "]") and "\r" not in err.getvalue()
    quiet = io.StringIO()
    Progress(10, stream=quiet, enabled=False).step("x")
    assert quiet.getvalue() == ""


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs the bench extra's matplotlib")
    from ringcomm.bench import plot
    out = tmp_path / "p.png"
    plot.draw(str(out), "all_reduce", {"ringcomm (auto)": [(8, 0.0), (1 << 20, 1.5)],
                                       "mpi": [(8, 0.0), (1 << 20, 2.5)]}, 8.0)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- two short real runs -------------------------------------------------------------------------

def _run_cli(args, env_extra=None, prelude=""):
    """The CLI in a child process (its ranks are grandchildren); stopped with SIGTERM on a timeout,
    which makes it stop its ranks before it exits."""
    code = f"import sys; {prelude}from ringcomm.bench.cli import main; sys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, RINGCOMM_TIMEOUT="30", **(env_extra or {}))
    before = set(glob.glob("/dev/shm/rc-b*"))
    p = subprocess.Popen([sys.executable, "-c", code] + args + ["--timeout", "60"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        p.terminate()
        out, err = p.communicate(timeout=30)
        pytest.fail(f"ringcomm-bench did not finish:\n{out}\n{err}")
    assert not _left_segments(before), "the run left shared-memory segments"
    return p.returncode, out, err


@pytest.mark.timeout(120)
def test_a_plot_that_cannot_be_drawn_is_one_line_not_a_traceback(tmp_path):
    """matplotlib missing (or one of its own dependencies): the table is printed, the plot's failure is
    one line naming why, and the exit status says the file was not written."""
    png = tmp_path / "p.png"
    rc, out, err = _run_cli(["all_reduce", "-n", "2", "-b", "1K", "-e", "4K", "-f", "4", "--iters", "2",
                             "--warmup", "1", "--check", "--no-progress", "--plot", str(png)],
                            prelude="sys.modules['matplotlib'] = None; ")
    assert rc == 1 and "Traceback" not in err, err
    assert "# Out of bounds values : 0 OK" in out.splitlines()
    assert [l for l in err.splitlines() if "plot" in l] == [
        "ringcomm-bench: the plot was not drawn: --plot needs matplotlib, which did not import "
        "(import of matplotlib halted; None in sys.modules): pip install 'ringcomm[bench]'"], err
    assert not png.exists()


def _left_segments(before) -> list:
    """Benchmark segments (rc-b<job>-<pid>-...) new since ``before`` whose creating rank has exited.
    A segment of a rank still running belongs to another job: the other test worker may be running
    a benchmark at the same time (test_reproducible.py's, say)."""
    new = set(glob.glob("/dev/shm/rc-b*")) - before
    return sorted(path for path in new if not pid_alive(int(os.path.basename(path).split("-")[2])))


def _rows(out):
    return [line.split() for line in out.splitlines() if line and not line.startswith("#")]


@pytest.mark.timeout(120)
def test_real_run_prints_the_table_and_one_line_for_a_missing_peer():
    # mpi4py hidden from this process: the peer must be skipped with one line, not a traceback.
    rc, out, err = _run_cli(["all_reduce", "-n", "2", "-b", "1K", "-e", "16K", "-f", "4", "--iters", "2",
                             "--warmup", "1", "--check", "--peer", "mpi", "--no-progress", "--engine", "python"],
                            prelude="sys.modules['mpi4py'] = None; ")
    assert rc == 0, err
    assert "Traceback" not in err
    mpi_lines = [l for l in err.splitlines() if "mpi" in l]
    assert mpi_lines == ["ringcomm-bench: peer mpi skipped: mpi4py is not installed "
                         "(pip install 'ringcomm[bench]')"]
    rows = _rows(out)
    assert [int(r[0]) for r in rows] == [1024, 4096, 16384]
    for r in rows:
        assert len(r) == 13 and r[2:5] == ["float", "sum", "-1"] and r[8] == "0" and r[12] == "0"
    assert "# Out of bounds values : 0 OK" in out.splitlines()
    assert any(l.startswith("# Avg bus bandwidth    : ") for l in out.splitlines())
    assert "#  ringcomm engine: python" in out.splitlines()
    if placement.cpu_pair() is not None:  # the round trip before and after the one sweep that ran
        # n/a: a probe's thread got no answer within its limit (a busy machine: seen once with the
        # suite and the Soft-RoCE guest sharing the 2 cores); the line says so rather than a number.
        line = next((l for l in out.splitlines() if l.startswith("# Placement: ")),
                    "# Placement: ...: ringcomm n/a / n/a")
        trips = re.fullmatch(r".*: ringcomm (\d+|n/a) / (\d+|n/a)", line).groups()
        assert all(t == "n/a" or 0 < int(t) < 100000 for t in trips), line


def test_round_trip_between_two_cpus_is_measured_or_says_why_not(monkeypatch):
    if placement.cpu_pair() is None:
        assert placement.round_trip_ns() is None   # one usable CPU: nothing to measure
        return
    # Short: the suite's other worker may share a CPU. A number, not a fast one: where that worker
    # holds one of the two CPUs, each round trip waits for a scheduler slice (460 us was seen on this
    # 2-core VM, one run in four). Up to three tries: a probe whose thread got no answer for seconds
    # says None, as documented (seen once in a CI rehearsal, the Soft-RoCE guest sharing the cores).
    tries = (placement.round_trip_ns(rounds=200, repeat=1) for _ in range(3))
    first = next((t for t in tries if t is not None), None)
    assert first is not None and 1 < first < 50e6, first
    assert os.sched_getaffinity(0) >= set(placement.cpu_pair())  # the caller's own CPUs are untouched
    monkeypatch.setattr(placement, "cpu_pair", lambda: None)
    assert placement.round_trip_ns() is None


def test_no_placement_leaves_the_line_out():
    rc, out, err = _run_cli(["broadcast", "-n", "2", "-b", "1K", "-e", "1K", "--iters", "1", "--warmup", "0",
                             "--no-progress", "--no-placement"])
    assert rc == 0, err
    assert not any(l.startswith("# Placement") for l in out.splitlines()), out
    # and says that broadcast's two columns time the same one-buffer call
    assert any(l.startswith("# broadcast takes one buffer a rank") for l in out.splitlines()), out


@pytest.mark.timeout(120)
def test_a_corrupted_result_is_counted_wrong_and_fails_the_run():
    rc, out, err = _run_cli(["reduce_scatter", "-n", "2", "-b", "2K", "-e", "8K", "-f", "4", "--iters", "1",
                             "--warmup", "0", "--check", "--no-progress"],
                            env_extra={worker.CORRUPT_ENV: "1"})
    assert rc == 1, err
    rows = _rows(out)
    assert len(rows) == 2 and all(r[8] == "1" and r[12] == "1" for r in rows), out
    assert "# Out of bounds values : 4 FAILED" in out.splitlines()


@pytest.mark.timeout(120)
def test_registered_buffers_run_the_read_algorithm_and_check_out():
    rc, out, err = _run_cli(["all_gather", "-n", "2", "-b", "1K", "-e", "16K", "-f", "4", "--iters", "2",
                             "--warmup", "1", "--check", "--registered", "--algo", "read,ring", "--no-progress"])
    assert rc == 0, err
    assert "# Buffers: ringcomm's from comm.alloc (registered: peers read them directly); peers' plain numpy" in out
    rows = _rows(out)
    assert len(rows) == 6 and all(r[8] == "0" and r[12] == "0" for r in rows), out


@pytest.mark.parametrize("env", [{"LOCAL_RANK": "1"}, {"MPI_LOCALRANKID": "1", "PMI_RANK": "1"}])
def test_bind_puts_a_rank_of_any_library_on_its_cpu(env):
    """--bind: a worker binds itself by its local rank, torchrun's or MPICH's hydra's (in a child
    process, so this one keeps its CPUs)."""
    usable = sorted(os.sched_getaffinity(0))
    code = ("import json, os; from ringcomm.bench import worker; worker.bind({'bind': True}); "
            "print(json.dumps([sorted(os.sched_getaffinity(0)), os.environ['RINGCOMM_HOST_CPUS']]))")
    clean = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "MPI_LOCALRANKID", "PMI_RANK")}
    out = subprocess.run([sys.executable, "-c", code], env=dict(clean, **env), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [[usable[1 % len(usable)]], str(len(usable))]


class _CountingBackend(Backend):
    """One rank that counts its calls and times nothing but what measure() asks of it."""
    world_size, rank, name = 1, 0, "fake"

    def __init__(self):
        self.calls = 0

    def upload(self, arr):
        pass

    def call(self, coll, inp, out, op, root, in_place):
        def fn():
            self.calls += 1
        return fn, out

    def sync(self):
        pass

    def barrier(self):
        pass

    def gather_f64(self, values):
        return np.asarray([values], np.float64)


def test_a_first_row_warms_up_for_its_time_and_later_rows_for_their_calls():
    cfg = {"root": 0, "op": "sum", "warmup": 2, "iters": 3, "check": False}
    bufs = (np.zeros(64, np.float32),) * 3
    tables = {"input": verify.input_table(np.dtype(np.float32), "sum", 1, 0)}
    later, first = _CountingBackend(), _CountingBackend()
    worker.measure(later, cfg, tables, bufs, "all_reduce", 256, False)
    assert later.calls == 2 + 3                      # nccl-tests' warm-up calls, then the timed ones
    t0 = time.perf_counter()
    worker.measure(first, cfg, tables, bufs, "all_reduce", 256, False, warm_s=0.02)
    assert time.perf_counter() - t0 >= 0.02 and first.calls > 2 + 3 + 2   # calls until 20 ms had passed


def test_min_row_ms_times_enough_calls_to_last_that_long(monkeypatch):
    """--min-row-ms: at the pace of the probe calls (their median), enough calls for the row to last
    that long; never fewer than --iters; without it, exactly --iters (nccl-tests). A fake clock: each
    call takes 100 us of it, one probe call 5 ms (a preemption), which the median ignores."""
    clock = {"now": 0.0}
    monkeypatch.setattr(worker.time, "perf_counter", lambda: clock["now"])

    class Slow(_CountingBackend):
        def call(self, coll, inp, out, op, root, in_place):
            def fn():
                self.calls += 1
                clock["now"] += 5e-3 if self.calls == 4 else 1e-4
            return fn, out
    tables = {"input": verify.input_table(np.dtype(np.float32), "sum", 1, 0)}
    bufs = (np.zeros(64, np.float32),) * 3
    cfg = {"root": 0, "op": "sum", "warmup": 2, "iters": 3, "check": False, "min_row_s": 0.02}
    ev = worker.measure(Slow(), cfg, tables, bufs, "all_reduce", 256, False)
    assert ev["iters"] == 200 and ev["rank_seconds"][0] == pytest.approx(1e-4), ev   # 20 ms of 100 us calls
    assert worker.measure(Slow(), dict(cfg, min_row_s=1e-6), tables, bufs, "all_reduce", 256, False)["iters"] == 3
    assert worker.measure(Slow(), dict(cfg, min_row_s=0.0), tables, bufs, "all_reduce", 256, False)["iters"] == 3
    row = report.make_row("all_reduce", 1, "float", "sum", 0, ev, ev)
    assert row["oop"]["iters"] == ev["iters"]


def test_all_to_all_has_no_in_place_row():
    """nccl-tests leaves its in-place alltoall unchecked; ringcomm refuses overlapping buffers, so the
    worker never runs it and the table says N/A there, out of the average."""
    class Three:
        world_size, rank = 3, 0
    bufs = (np.zeros(64, np.float32),) * 3
    ev = worker.measure(Three(), {"root": 0, "op": "sum"}, None, bufs, "all_to_all", 96, True)
    assert ev == {"size": 96, "count": 8, "in_place": True, "rank_seconds": [0.0] * 3, "rank_wrong": None,
                  "skipped": "all_to_all has no in-place form"}
    oop = _event(96, 8, [1e-5] * 3, [0] * 3, False)
    row = report.make_row("all_to_all", 3, "float", "sum", 0, oop, ev)
    line = report.row_line(row)
    assert line.split()[-4:] == ["N/A"] * 4 and row["root"] == -1 and row["redop"] == "none"
    assert report.avg_busbw([row]) == row["oop"]["busbw"]


@pytest.mark.timeout(120)
def test_copy_ceiling_prints_one_row_of_positive_rates_per_size():
    """examples/copy_ceiling.py, the ceiling the issue-12 note quotes for host copy collectives."""
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "copy_ceiling.py")
    r = subprocess.run([sys.executable, script, "--sizes", "64K,1M", "--reps", "3"], capture_output=True,
                       text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]
    header, *rows = r.stdout.strip().splitlines()
    assert "1 core" in header and "2 cores" in header and "memset" in header
    assert [row.split()[0] for row in rows] == ["65536", "1048576"]
    for row in rows:
        one, halves, each, unread = (float(row.split()[i]) for i in (1, 2, 4, 6))
        assert min(one, halves, each, unread) > 0, row


# ---- --alternate: every library's ranks at once, rows taking turns --------------------------------

@pytest.mark.timeout(150)
def test_alternate_runs_every_row_in_both_libraries_and_checks_out(tmp_path):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: no gloo peer to take turns with")
    js = tmp_path / "alt.json"
    rc, out, err = _run_cli(["all_reduce", "-n", "2", "-b", "1K", "-e", "16K", "-f", "4", "--iters", "2",
                             "--warmup", "1", "--check", "--peer", "gloo", "--alternate", "--no-progress",
                             "--no-placement", "--json", str(js)])
    assert rc == 0, err
    assert "# Rows: alternating (every library's ranks started at once; each row ran in every library " \
           "before the next)" in out
    rows = _rows(out)
    assert [int(r[0]) for r in rows] == [1024, 4096, 16384]
    assert all(r[8] == "0" and r[12] == "0" for r in rows), out   # ringcomm's #wrong, both placements
    doc = json.loads(js.read_text())
    assert [r["size"] for r in doc["peers"]["gloo"]["rows"]["auto"]] == [1024, 4096, 16384]
    assert report.out_of_bounds([r for rs in doc["peers"]["gloo"]["rows"].values() for r in rs]) == 0
    assert doc["ringcomm"]["round_trip_ns_by_size"] == {"1024": None, "4096": None, "16384": None}
    # automatic choice's rows say what ran, so that ringcomm.fit can use them; a peer's say nothing
    ran = [r["oop"]["ran"] for r in doc["ringcomm"]["rows"]["auto"]]
    assert all(a in ringcomm.algorithms.algorithms("all_reduce") for a in ran), ran
    assert {r["oop"]["ran"] for r in doc["peers"]["gloo"]["rows"]["auto"]} == {None}
    assert len(ringcomm.model.load_bench(js)) == 3


def test_alternate_takes_one_algorithm():
    with pytest.raises(SystemExit) as e:
        parse_args(["all_reduce", "--alternate", "--algo", "ring,tree"])
    assert e.value.code == 2


def test_a_gate_lets_one_rank_through_per_byte_and_an_abandoned_gate_is_an_error():
    gate = alternate.Gate(ranks=2)
    cfg = {"gate": gate.path}
    passed = []
    readers = [threading.Thread(target=lambda: (worker.gate(cfg, rank=1), passed.append(1))) for _ in range(3)]
    for t in readers:
        t.start()
    gate.open()                       # two bytes: two of the three readers pass
    for t in readers:
        t.join(0.5)
    assert len(passed) == 2 and sum(t.is_alive() for t in readers) == 1
    gate.open()
    for t in readers:
        t.join(5)
    assert len(passed) == 3 and not any(t.is_alive() for t in readers)
    worker.gate(cfg, rank=1)          # the second opening's other byte: it passes at once
    gate.close()                      # the parent's end gone: a waiting rank must not wait forever
    with pytest.raises(RuntimeError, match="closed the gate"):
        worker.gate(cfg, rank=1)
    os.close(worker._GATE.pop(gate.path))


# ---- --runs: the sweep several times, rows by median -------------------------------------------------

def _result(seconds_oop, seconds_ip, wrong=0):
    """A one-row sweep result as cli.run_job gives it (2 ranks, all_reduce of 1 MiB)."""
    def placed(s):
        return {"seconds": s, "rank_seconds": [s, s * 0.9], "algbw": 0.0, "busbw": 0.0, "wrong": wrong,
                "rank_wrong": [wrong, 0], "skipped": None, "span": [7.0, 7.0 + s]}
    row = {"size": 1 << 20, "count": 1 << 18, "type": "float", "redop": "sum", "root": -1,
           "oop": placed(seconds_oop), "ip": placed(seconds_ip)}
    return {"facts": {}, "pids": [1, 2], "rows": {"auto": [row]}, "round_trip_ns": [100.0, 120.0]}


def test_runs_combine_rows_by_median_and_keep_every_run():
    got = runs.combine("all_reduce", 2, [_result(5e-4, 2e-4), _result(1e-4, 9e-4, wrong=5), _result(2e-4, 1e-4)])
    row = got["rows"]["auto"][0]
    assert row["oop"]["seconds"] == 2e-4 and row["ip"]["seconds"] == 2e-4
    assert row["oop"]["run_seconds"] == [5e-4, 1e-4, 2e-4]      # the median, not the mean
    assert row["oop"]["run_spans"] == [[7.0, 7.0 + t] for t in (5e-4, 1e-4, 2e-4)]   # each run's when
    assert (row["oop"]["algbw"], row["oop"]["busbw"]) == spec.bandwidth("all_reduce", 1 << 20, 2e-4, 2)
    assert row["oop"]["rank_seconds"] == [2e-4, 2e-4 * 0.9]      # the median run's ranks
    assert row["oop"]["wrong"] == 5 and report.out_of_bounds([row]) == 2   # a wrong run is never hidden
    assert runs.spread(row["oop"]) == pytest.approx(2.5) and runs.spread(row["ip"]) == pytest.approx(4.5)
    assert got["runs"] == 3 and got["round_trip_ns"] == [100.0, 120.0]
    lines = runs.spread_lines(3, got["rows"], {})
    assert lines[-2].split() == ["#", "1048576", "2.50x", "4.50x"] and lines[-1].endswith("4.50x")
    two = runs.spread_lines(3, {"ring": got["rows"]["auto"], "tree": got["rows"]["auto"]}, {})
    assert [line for line in two if line.startswith("# Algorithm:")] == ["# Algorithm: ring", "# Algorithm: tree"]


def test_runs_over_twice_their_median_are_listed_with_steal_and_the_ranks_time_on_a_cpu():
    slow, steady = _result(9e-4, 1e-4), _result(1e-4, 1e-4)
    slow["rows"]["auto"][0]["oop"].update(steal_s=0.62, on_cpu=[0.31, 0.994])
    steady["rows"]["auto"][0]["oop"].update(steal_s=0.0, on_cpu=[1.0, 1.0])
    got = runs.combine("all_reduce", 2, [steady, slow, steady])
    row = got["rows"]["auto"][0]
    assert row["oop"]["run_steal_s"] == [0.0, 0.62, 0.0] and row["ip"]["run_steal_s"] == [None] * 3
    assert row["oop"]["run_on_cpu"] == [[1.0, 1.0], [0.31, 0.994], [1.0, 1.0]]
    lines = runs.slow_lines(got["rows"], {"mpi": got})
    assert lines[0].startswith("# Runs over 2x their row's median")
    assert lines[1:] == [
        "#   1048576 ringcomm out of place, run 2: 9.0x (900 us a call, median 100 us; the run took 900 us); "
        "steal 620 ms; on CPU 31% 99%",
        "#   1048576 mpi out of place, run 2: 9.0x (900 us a call, median 100 us; the run took 900 us); "
        "steal 620 ms; on CPU 31% 99%"]
    assert runs.slow_lines(runs.combine("all_reduce", 2, [steady] * 3)["rows"], {}) == []   # none that slow
    unknown = runs.combine("all_reduce", 2, [_result(1e-4, 1e-4), _result(1e-4, 3e-4), _result(1e-4, 1e-4)])
    assert [line.split("; steal ")[-1] for line in runs.slow_lines(unknown["rows"], {})[1:]] == [
        "unknown; on CPU unknown"]


def test_steal_is_read_from_proc_stat_in_seconds(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  4980342 81659 1389333 9687502 10014 0 41462 10212 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert machine.steal_seconds(str(stat)) == pytest.approx(10212 * machine._TICK_S)
    stat.write_text("cpu  1 2 3 4\n")              # a kernel without the column
    assert machine.steal_seconds(str(stat)) is None
    assert machine.steal_seconds(str(tmp_path / "none")) is None
    here = machine.steal_seconds()                    # this machine's, if Linux: a count that only grows
    assert here is None or (here >= 0 and machine.steal_seconds() >= here)


def test_runs_must_be_positive_and_alone_with_reproducible():
    for bad in (["--runs", "0"], ["--runs", "2", "--reproducible"]):
        with pytest.raises(SystemExit) as e:
            parse_args(["all_reduce"] + bad)
        assert e.value.code == 2


@pytest.mark.timeout(150)
def test_runs_print_medians_and_each_rows_spread(tmp_path):
    js = tmp_path / "runs.json"
    rc, out, err = _run_cli(["all_gather", "-n", "2", "-b", "1K", "-e", "4K", "-f", "4", "--iters", "2",
                             "--warmup", "1", "--check", "--runs", "3", "--no-progress", "--no-placement",
                             "--json", str(js)])
    assert rc == 0, err
    assert [int(r[0]) for r in _rows(out)] == [1024, 4096]
    spread = [line.split() for line in out.splitlines() if re.match(r"# +\d+ +\d+\.\d\dx", line)]
    assert [int(s[1]) for s in spread] == [1024, 4096], out
    doc = json.loads(js.read_text())
    assert doc["config"]["runs"] == 3
    for row in doc["ringcomm"]["rows"]["auto"]:
        for key in ("oop", "ip"):
            assert len(row[key]["run_seconds"]) == 3
            assert row[key]["seconds"] == sorted(row[key]["run_seconds"])[1]
            spans = row[key]["run_spans"]   # each run's timed calls on CLOCK_MONOTONIC, later runs later
            assert all(a <= b for a, b in spans) and spans[0][1] <= spans[1][0] <= spans[2][0] <= time.monotonic()
            stolen = row[key]["run_steal_s"]   # the hypervisor's take while each ran, where /proc/stat says
            assert len(stolen) == 3 and all(t is None or t >= 0 for t in stolen)
            assert (None in stolen) == (machine.steal_seconds() is None)
            shares = row[key]["run_on_cpu"]   # each rank's calling thread: on a CPU for part of the run
            assert [len(s) for s in shares] == [2, 2, 2] and all(0 < x < 1.5 for s in shares for x in s)


def test_damon_monitors_that_run_are_named_and_stopped_ones_are_not(tmp_path):
    def monitor(k, state, ops, actions):
        ctx = tmp_path / str(k) / "contexts" / "0"
        (ctx / "schemes").mkdir(parents=True)
        (tmp_path / str(k) / "state").write_text(state + "\n")
        (tmp_path / str(k) / "contexts" / "nr_contexts").write_text("1\n")
        (ctx / "operations").write_text(ops + "\n")
        (ctx / "schemes" / "nr_schemes").write_text(f"{len(actions)}\n")
        for i, action in enumerate(actions):
            (ctx / "schemes" / str(i)).mkdir()
            (ctx / "schemes" / str(i) / "action").write_text(action + "\n")

    (tmp_path / "nr_kdamonds").write_text("3\n")
    monitor(0, "on", "paddr", ["pageout"])
    monitor(1, "off", "vaddr", ["hugepage"])
    monitor(10, "on", "vaddr", ["stat", "lru_prio"])
    assert machine.damon_schemes(str(tmp_path)) == ["paddr pageout", "vaddr stat lru_prio"]
    assert machine.damon_schemes(str(tmp_path / "absent")) == []
