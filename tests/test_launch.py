"""ringcomm-run: environment, output prefixes, failure handling, signals and /dev/shm cleanup.

The launcher runs as a real subprocess (`python -m ringcomm.launch`) because what is tested is
process behaviour: exit codes, signals, children left behind. Ranks synchronise through files
that the test polls with a deadline, never through sleeps.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest

from ringcomm import launch

LAUNCH = [sys.executable, "-m", "ringcomm.launch"]


def clean_env(**extra) -> dict:
    """Our environment without the variables the launcher would inherit instead of generating."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RINGCOMM_TOKEN", "RINGCOMM_JOB_ID", "RINGCOMM_TIMEOUT")}
    env.update(extra)
    return env


def write_script(tmp_path, body: str, name: str = "rank.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def run(args, env=None, timeout=50) -> subprocess.CompletedProcess:
    return subprocess.run(LAUNCH + [str(a) for a in args], env=env or clean_env(),
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def wait_for(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)  # polling interval, not synchronisation: the deadline decides


def rank_json(stdout: str) -> dict:
    """{rank: parsed JSON} from lines `[rank R] {...}`."""
    out = {}
    for line in stdout.splitlines():
        prefix, _, rest = line.partition("] ")
        if rest.startswith("{"):
            out[int(prefix.removeprefix("[rank "))] = json.loads(rest)
    return out


ENV_SCRIPT = """
    import json, os
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT", "RINGCOMM_TOKEN", "RINGCOMM_JOB_ID", "PYTHONUNBUFFERED"]
    print(json.dumps({k: os.environ.get(k) for k in keys}))
"""


@pytest.mark.timeout(60)
def test_environment_single_node(tmp_path):
    r = run(["-n", 3, write_script(tmp_path, ENV_SCRIPT)])
    assert r.returncode == 0, r.stderr
    envs = rank_json(r.stdout)
    assert sorted(envs) == [0, 1, 2]
    for rank, e in envs.items():
        assert e["RANK"] == e["LOCAL_RANK"] == str(rank)
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) == ("3", "3", "0")
        assert e["MASTER_ADDR"] == "127.0.0.1" and int(e["MASTER_PORT"]) > 0
        assert e["PYTHONUNBUFFERED"] == "1"
        assert len(e["RINGCOMM_TOKEN"]) == 32 and e["RINGCOMM_JOB_ID"]
    # One job: every rank shares port, token and job id.
    for key in ("MASTER_PORT", "RINGCOMM_TOKEN", "RINGCOMM_JOB_ID"):
        assert len({e[key] for e in envs.values()}) == 1


BIND_SCRIPT = """
    import json, os
    from ringcomm.env import oversubscribed
    print(json.dumps({"cpus": sorted(os.sched_getaffinity(0)), "host_cpus": os.environ.get("RINGCOMM_HOST_CPUS"),
                      "oversubscribed": oversubscribed(int(os.environ["WORLD_SIZE"]))}))
"""


@pytest.mark.timeout(60)
def test_bind_core_deals_the_usable_cpus_out_in_rank_order(tmp_path):
    usable = sorted(os.sched_getaffinity(0))
    script = write_script(tmp_path, BIND_SCRIPT)
    r = run(["-n", 3, "--bind", "core", script])
    assert r.returncode == 0, r.stderr
    got = rank_json(r.stdout)
    assert {rank: g["cpus"] for rank, g in got.items()} == {i: [usable[i % len(usable)]] for i in range(3)}
    # Each rank sees one CPU, yet the oversubscription rules count the CPUs the ranks share.
    assert all(g["host_cpus"] == str(len(usable)) and g["oversubscribed"] == (3 > len(usable))
               for g in got.values())
    r = run(["-n", 3, script])              # the default: no binding, no RINGCOMM_HOST_CPUS
    assert r.returncode == 0, r.stderr
    assert all(g["cpus"] == usable and g["host_cpus"] is None for g in rank_json(r.stdout).values())


@pytest.mark.timeout(60)
def test_environment_second_node(tmp_path):
    env = clean_env(RINGCOMM_TOKEN="sharedsecret", RINGCOMM_JOB_ID="job7")
    r = run(["-n", 3, "--nnodes", 2, "--node-rank", 1, "--master-addr", "10.1.2.3",
             "--master-port", 29555, write_script(tmp_path, ENV_SCRIPT)], env=env)
    assert r.returncode == 0, r.stderr
    envs = rank_json(r.stdout)
    assert sorted(envs) == [3, 4, 5]
    for rank, e in envs.items():
        assert e["RANK"] == str(rank) and e["LOCAL_RANK"] == str(rank - 3)
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) == ("6", "3", "1")
        assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("10.1.2.3", "29555")
        assert (e["RINGCOMM_TOKEN"], e["RINGCOMM_JOB_ID"]) == ("sharedsecret", "job7")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, env, message", [
    (["--master-port", 29555], {}, "RINGCOMM_TOKEN"),
    ([], {"RINGCOMM_TOKEN": "t"}, "--master-port"),
])
def test_multi_node_needs_port_and_token(tmp_path, args, env, message):
    script = write_script(tmp_path, "raise SystemExit('must not start')")
    r = run(["-n", 2, "--nnodes", 2] + args + [script], env=clean_env(**env))
    assert r.returncode == 2
    assert message in r.stderr and "must not start" not in r.stderr


@pytest.mark.timeout(60)
def test_output_is_prefixed_per_stream(tmp_path):
    script = write_script(tmp_path, """
        import os, sys
        r = os.environ["RANK"]
        print(f"out {r}\\nsecond {r}")
        print(f"err {r}", file=sys.stderr)
        sys.stdout.buffer.write(b"garbage \\xff\\xfe partial")  # no newline at the end
    """)
    r = run(["-n", 2, script])
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        out = r.stdout.splitlines()
        assert f"[rank {rank}] out {rank}" in out and f"[rank {rank}] second {rank}" in out
        assert f"[rank {rank}] garbage \ufffd\ufffd partial" in out
        assert f"[rank {rank}] err {rank}" in r.stderr.splitlines()
        assert f"err {rank}" not in r.stdout
    assert all(line.startswith("[rank ") for line in r.stdout.splitlines())


@pytest.mark.timeout(60)
def test_module_form(tmp_path):
    write_script(tmp_path, """
        import json, os, sys
        print(json.dumps({"name": __name__, "argv": sys.argv[1:], "rank": os.environ["RANK"]}))
    """, name="rc_launch_probe.py")
    r = run(["-n", 2, "-m", "rc_launch_probe", "a", "--flag"],
            env=clean_env(PYTHONPATH=os.pathsep.join(
                [str(tmp_path)] + [p for p in [os.environ.get("PYTHONPATH")] if p])))
    assert r.returncode == 0, r.stderr
    envs = rank_json(r.stdout)
    assert sorted(envs) == [0, 1]
    for rank, e in envs.items():
        assert e == {"name": "__main__", "argv": ["a", "--flag"], "rank": str(rank)}


# Ranks 0 and 2 block forever (an Event, a read of a pipe nobody writes); rank 1 waits until
# both are blocked, then fails. Only the launcher can end ranks 0 and 2.
BLOCKED_SCRIPT = """
    import os, pathlib, signal, sys, threading, time
    rank, d = int(os.environ["RANK"]), pathlib.Path(sys.argv[1])
    def on_term(*_):
        print(f"rank {rank} got SIGTERM", flush=True)
        sys.exit(1)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if "--ignore-term" in sys.argv else on_term)
    if rank == 1:
        deadline = time.monotonic() + 20
        while not all((d / f"ready{r}").exists() for r in (0, 2)) and time.monotonic() < deadline:
            time.sleep(0.01)
        sys.exit(3)
    (d / f"ready{rank}").touch()
    if rank == 0:
        threading.Event().wait()
    else:
        r, w = os.pipe()
        os.read(r, 1)
"""


@pytest.mark.timeout(60)
def test_failing_rank_stops_the_others_after_grace(tmp_path):
    start = time.monotonic()
    r = run(["-n", 3, "--grace", 0.5, write_script(tmp_path, BLOCKED_SCRIPT), tmp_path])
    assert r.returncode == 3
    assert "ringcomm-run: rank 1 failed first (exit code 3)" in r.stderr
    # The survivors were stopped politely (SIGTERM) once the grace period ran out.
    assert "[rank 0] rank 0 got SIGTERM" in r.stdout
    assert "[rank 2] rank 2 got SIGTERM" in r.stdout
    assert time.monotonic() - start < 15


@pytest.mark.timeout(60)
def test_rank_ignoring_sigterm_is_killed(tmp_path):
    start = time.monotonic()
    r = run(["-n", 3, "--grace", 0.2, write_script(tmp_path, BLOCKED_SCRIPT), tmp_path,
             "--ignore-term"])
    assert r.returncode == 3
    assert "rank 1 failed first (exit code 3)" in r.stderr
    assert time.monotonic() - start < 5 + 15  # SIGKILL follows SIGTERM after 5 s


@pytest.mark.timeout(60)
def test_survivors_that_notice_keep_the_first_failure(tmp_path):
    # A long grace, but the survivor notices the failure itself, reports it and exits:
    # the launcher must not wait out the grace, and rank 1 (not rank 0) is the one reported.
    script = write_script(tmp_path, """
        import os, pathlib, sys, time
        rank, d = int(os.environ["RANK"]), pathlib.Path(sys.argv[1])
        if rank == 1:
            (d / "pid").write_text(str(os.getpid()))
            os.replace(d / "pid", d / "dead")  # whole or absent: rank 0 never reads a half-written pid
            sys.exit(3)
        deadline = time.monotonic() + 20
        while not (d / "dead").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        # Rank 0 notices only once the launcher has reaped rank 1 (its /proc entry is gone): on a
        # loaded machine two exits a few ms apart may otherwise reach the launcher in either order.
        pid = (d / "dead").read_text()
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.01)
        print("rank 0: peer 1 is gone", file=sys.stderr)
        sys.exit(1)
    """)
    start = time.monotonic()
    r = run(["-n", 2, "--grace", 30, script, tmp_path])
    assert r.returncode == 3
    assert "[rank 0] rank 0: peer 1 is gone" in r.stderr
    assert "rank 1 failed first (exit code 3)" in r.stderr
    assert time.monotonic() - start < 25


@pytest.mark.timeout(60)
def test_rank_killed_by_signal(tmp_path):
    script = write_script(tmp_path, """
        import os, signal
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = run(["-n", 2, "--grace", 5, script])
    assert r.returncode == 137
    assert "ringcomm-run: rank 1 failed first (killed by SIGKILL)" in r.stderr


def test_a_rank_killed_by_a_signal_outranks_the_errors_its_peers_exit_with(capsys):
    # Each rank's exit reaches the launcher from a thread of its own, in whatever order those run:
    # survivors that saw a peer die and exited with an error may come before the peer killed by
    # SIGKILL. The killed rank is the one reported -- unless the launcher had signalled the ranks.
    def supervisor():
        return launch.Supervisor(types.SimpleNamespace(node_rank=0, nproc_per_node=4, grace=5.0), {})
    sup = supervisor()
    for rank, code in ((3, 1), (2, -signal.SIGKILL), (1, 1), (0, -signal.SIGTERM)):
        sup._on_exit(rank, code)
    assert sup.result() == 137
    assert "ringcomm-run: rank 2 failed first (killed by SIGKILL)" in capsys.readouterr().err
    sup = supervisor()
    sup._on_exit(3, 1)
    sup.term_at = time.monotonic() - 1
    sup._tick()   # the grace is over: the launcher sends SIGTERM (to no process here)
    sup._on_exit(2, -signal.SIGTERM)
    assert sup.result() == 1
    assert "ringcomm-run: rank 3 failed first (exit code 1)" in capsys.readouterr().err


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_launcher_stops_all_ranks(tmp_path, sig):
    script = write_script(tmp_path, """
        import os, pathlib, sys, threading
        d = pathlib.Path(sys.argv[1])
        tmp = d / f"pid{os.environ['RANK']}.tmp"
        tmp.write_text(str(os.getpid()))
        tmp.rename(d / f"pid{os.environ['RANK']}")  # rename: the reader never sees half a pid
        threading.Event().wait()
    """)
    files = [tmp_path / f"pid{r}" for r in range(3)]
    proc = subprocess.Popen(LAUNCH + ["-n", "3", script, str(tmp_path)], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        wait_for(lambda: all(f.exists() for f in files), what="every rank's pid file")
        pids = [int(f.read_text()) for f in files]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 128 + sig
        assert f"stopped by {sig.name}" in err
        # The launcher reaps its ranks before it exits, so they must already be gone.
        assert not [p for p in pids if pid_alive(p)]
    finally:
        proc.kill()
        proc.wait()
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this system")
def test_shm_segments_removed(tmp_path):
    # Rank 1 dies by SIGKILL, as a crashed rank would, without cleaning up its segment.
    script = write_script(tmp_path, """
        import os, signal
        name = f"/dev/shm/rc-{os.environ['RINGCOMM_JOB_ID']}-x{os.environ['RANK']}"
        with open(name, "wb") as f:
            f.write(b"segment")
        print(name)
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    job = f"t{os.getpid()}"
    other = f"/dev/shm/rc-{job}0-keep"  # another job whose id merely starts with ours
    open(other, "wb").close()
    try:
        r = run(["-n", 2, "--grace", 5, script], env=clean_env(RINGCOMM_JOB_ID=job))
        assert r.returncode == 137
        names = [line.split("] ", 1)[1] for line in r.stdout.splitlines()]
        assert sorted(names) == [f"/dev/shm/rc-{job}-x0", f"/dev/shm/rc-{job}-x1"]
        assert not [n for n in names if os.path.exists(n)]
        assert os.path.exists(other)
    finally:
        os.unlink(other)


def test_default_grace_follows_ringcomm_timeout(monkeypatch):
    monkeypatch.delenv("RINGCOMM_TIMEOUT", raising=False)
    assert launch.default_grace() == launch.GRACE_UNSET_S == 10.0
    monkeypatch.setenv("RINGCOMM_TIMEOUT", "12.5")
    assert launch.default_grace() == 17.5


@pytest.mark.parametrize("argv", [
    ["-n", "0", "x.py"],
    ["--nnodes", "2", "--node-rank", "2", "x.py"],
    ["--grace", "-1", "x.py"],
    ["--bind", "socket", "x.py"],
    [],
])
def test_bad_command_lines(argv):
    with pytest.raises(SystemExit) as e:
        launch.parse_args(argv)
    assert e.value.code == 2


def test_bad_job_id_refused(monkeypatch, capsys):
    # The job id is part of the prefix of files we delete: nothing like "../" may get in.
    monkeypatch.setenv("RINGCOMM_JOB_ID", "../x")
    assert launch.main(["x.py"]) == 2
    assert "RINGCOMM_JOB_ID" in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("knob, value, named", [
    ("RINGCOMM_ENGINE", "python", "RINGCOMM_ENGINE, RINGCOMM_SLICE (rank 0: slices of 524288 bytes on shm; rank 1: "
     "slices of 262144 bytes on shm); engines: rank 0 python, rank 1 native"),
    ("RINGCOMM_BUFFSIZE", "65536", "RINGCOMM_BUFFSIZE, RINGCOMM_NSLOTS (rank 0: 8 slots of 8192 bytes"),
    ("RINGCOMM_DEBUG", "check", "RINGCOMM_DEBUG=check (rank 0: on; rank 1: off)"),
])
def test_ranks_set_differently_fail_at_init_naming_the_setting(tmp_path, knob, value, named):
    # Before, the first collective failed with "mmap length is greater than file size" (buffsize),
    # blamed "different collectives or sizes" (slices), or ran a check only one rank took part in.
    script = write_script(tmp_path, f"""
        import os
        if os.environ["RANK"] == "0":
            os.environ[{knob!r}] = {value!r}
        import ringcomm
        try:
            ringcomm.init()
        except ValueError as e:
            print(e)
    """)
    r = run(["-n", 2, script])
    for rank in (0, 1):
        said = [line for line in r.stdout.splitlines() if line.startswith(f"[rank {rank}]")]
        assert said and "every rank of a communicator must set these alike, and rank 1 does not" in said[0] \
            and named in said[0], r.stdout + r.stderr


@pytest.mark.timeout(60)
def test_a_python_and_a_native_rank_that_cut_alike_work_together(tmp_path):
    # The check compares the slices the settings give, not the engines' names.
    script = write_script(tmp_path, """
        import os
        if os.environ["RANK"] == "0":
            os.environ["RINGCOMM_ENGINE"] = "python"
        else:
            os.environ["RINGCOMM_SLICE"] = "524288"   # the python engine's slice: one whole slot
        import numpy as np, ringcomm
        with ringcomm.init() as comm:
            x = np.arange(3 << 20, dtype=np.float32) * (comm.rank + 1)
            comm.all_reduce(x)
            print(comm._executor.engine, np.array_equal(x, np.arange(3 << 20, dtype=np.float32) * 3))
    """)
    r = run(["-n", 2, script])
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(line.split("] ", 1)[1] for line in r.stdout.splitlines()) == ["native True", "python True"]
