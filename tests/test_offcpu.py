"""ringcomm.bench.offcpu: stretches off-CPU read from `perf script` sched_switch lines (real lines
from the dev VM, trimmed to what the reader needs)."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from ringcomm.bench import offcpu

TRACE = """\
         python3 27600 [000] 65627.229752:       sched:sched_switch: prev_comm=python3 prev_pid=27600 prev_prio=120 prev_state=R ==> next_comm=kworker/0:1 next_pid=25532 next_prio=120
 kworker/0:1-eve 25532 [000] 65627.229764:       sched:sched_switch: prev_comm=kworker/0:1 prev_pid=25532 prev_prio=120 prev_state=I ==> next_comm=kdamond.0 next_pid=81 next_prio=120
         python3 27601 [001] 65627.229800:       sched:sched_switch: prev_comm=python3 prev_pid=27601 prev_prio=120 prev_state=S ==> next_comm=swapper/1 next_pid=0 next_prio=120
this line is not a switch and is skipped
       swapper/1     0 [001] 65627.229850:       sched:sched_switch: prev_comm=swapper/1 prev_pid=0 prev_prio=120 prev_state=R ==> next_comm=python3 next_pid=27601 next_prio=120
       kdamond.0    81 [000] 65627.230682:       sched:sched_switch: prev_comm=kdamond.0 prev_pid=81 prev_prio=120 prev_state=I ==> next_comm=python3 next_pid=27600 next_prio=120
         python3 27601 [001] 65627.240000:       sched:sched_switch: prev_comm=python3 prev_pid=27601 prev_prio=120 prev_state=R ==> next_comm=python3 next_pid=27600 next_prio=120
         python3 27600 [001] 65627.244000:       sched:sched_switch: prev_comm=python3 prev_pid=27600 prev_prio=120 prev_state=R ==> next_comm=python3 next_pid=27601 next_prio=120
"""


def test_each_stretch_off_cpu_names_its_state_and_what_ran():
    switches = offcpu.parse(TRACE.splitlines())
    assert len(switches) == 7
    assert offcpu.busiest(switches, "python3", 2) == [27600, 27601]
    found = offcpu.stretches(switches, [27600, 27601])
    by = [(st.tid, st.state, round(st.seconds * 1e6), st.cpu, st.back_on, dict(st.ran)) for st in found]
    assert by == [
        (27601, "S", 50, 1, 1, {"swapper/1": 1}),
        (27600, "R", 930, 0, 0, {"kworker/0:1": 1, "kdamond.0": 1}),
        # 27600 came over to CPU 1 and took it from 27601: two ranks on one core
        (27601, "R", 4000, 1, 1, {"RANK": 1}),
    ]
    assert [round(st.seconds * 1e6) for st in offcpu.stretches(switches, [27600, 27601], 500e-6)] == [930, 4000]


def test_the_command_line_prints_the_stretches_and_a_tally(tmp_path, capsys):
    trace = tmp_path / "sched.txt"
    trace.write_text(TRACE)
    assert offcpu.main([str(trace)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "ranks' threads: [27600, 27601]"
    assert "930 us off  left R   cpu 0->0  ran meanwhile: kworker/0:1 x1, kdamond.0 x1" in out[1]
    assert out[-1] == "2 stretches; seen running in them: kworker/0:1 1, kdamond.0 1, RANK 1"
    assert offcpu.main([str(trace), "--comm", "ruby"]) == 1
    assert "no sched_switch of a thread named 'ruby'" in capsys.readouterr().err


def test_named_threads_replace_the_busiest(tmp_path, capsys):
    trace = tmp_path / "sched.txt"
    trace.write_text(TRACE)
    assert offcpu.main([str(trace), "--tid", "27601", "--min-us", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "ranks' threads: [27601]"
    assert out[-1].startswith("2 stretches")   # 27601's: the sleep, then the preemption by 27600 (not a rank now)
    assert "python3 x1" in out[2]


@pytest.mark.timeout(120)
def test_slow_calls_example_times_every_call_and_checks_its_result():
    """examples/slow_calls.py, the probe docs/06 "Slow runs" quotes, under the launcher: each rank's
    summary line, and the result it checked (a wrong one exits non-zero)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-m", "ringcomm.launch", "-n", "2", "examples/slow_calls.py",
                          "--calls", "3000", "--over-us", "0", "--show", "2"],
                         capture_output=True, text=True, timeout=110, cwd=root)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for rank in (0, 1):
        summary = re.search(rf"rank {rank}: 3000 calls of 8 B, median ([\d.]+) us, .*; 3000 over 0 us", out.stdout)
        assert summary and float(summary[1]) > 0, out.stdout
    assert out.stdout.count("major faults") == 4    # --show 2 on each rank
