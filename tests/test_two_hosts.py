"""Two hosts for real: two network namespaces joined by a veth pair, two ranks on each.

Processes in different network namespaces count as different hosts (ringcomm.links.host_id),
so ranks across the pair talk TCP over the veth while ranks on one side use shared memory.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys

import pytest

import jobs

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "two_hosts.py")
DEVICE_SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "two_hosts_device.py")
SHRINK = os.path.join(os.path.dirname(__file__), "scripts", "shrink_two_hosts.py")
MIXED = os.path.join(os.path.dirname(__file__), "scripts", "mixed_links.py")
SUBNET = "10.250.{}.{}"  # addresses live only on this test's own veth pair


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def two_hosts():
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    tag = secrets.token_hex(3)
    a, b = f"rca{tag}", f"rcb{tag}"
    net = secrets.randbelow(200) + 20
    made = []
    try:
        for ns in (a, b):
            r = _ip("netns", "add", ns, check=False)
            if r.returncode != 0:
                pytest.skip(f"cannot create network namespaces here: {r.stderr.strip()}")
            made.append(ns)
        _ip("link", "add", f"va{tag}", "netns", a, "type", "veth", "peer", "name", f"vb{tag}", "netns", b)
        for ns, dev, host in ((a, f"va{tag}", 1), (b, f"vb{tag}", 2)):
            _ip("-n", ns, "addr", "add", SUBNET.format(net, host) + "/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield (a, f"va{tag}", SUBNET.format(net, 1)), (b, f"vb{tag}", SUBNET.format(net, 2))
    finally:
        for ns in made:
            _ip("netns", "delete", ns, check=False)


DEVICE = {"NUMBA_ENABLE_CUDASIM": "1", "RINGCOMM_CUDA_BUFFSIZE": "4096", "RINGCOMM_NSLOTS": "4"}


@pytest.mark.netns
@pytest.mark.timeout(120)
@pytest.mark.parametrize("buffers", ["host", "device"])
def test_two_hosts_over_veth(two_hosts, buffers):
    """Host buffers, and device buffers under numba's CUDA simulator (staged over tcp between the hosts)."""
    (_, dev_a, _), _ = two_hosts
    script = SCRIPT if buffers == "host" else DEVICE_SCRIPT
    # One side finds its interface by name, the other by the route to the store.
    procs, text = _two_node_job(two_hosts, script, "veth", "29517", "5", RINGCOMM_TIMEOUT="30",
                                **(DEVICE if buffers == "device" else {}), _first={"RINGCOMM_SOCKET_IFNAME": dev_a})
    assert [p.returncode for p in procs] == [0, 0], text
    assert text.count("OK") == 4, text


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_cut_link_between_hosts(two_hosts, tmp_path):
    """`ip link set down` on the veth mid-collective: both ranks time out naming each other."""
    (ns_a, dev_a, addr_a), (ns_b, _, _) = two_hosts
    token = secrets.token_hex(8)
    procs = []
    for node, ns in enumerate((ns_a, ns_b)):
        env = dict(os.environ, RINGCOMM_TOKEN=token, RINGCOMM_TIMEOUT="5", PID_DIR=str(tmp_path),
                   RINGCOMM_JOB_ID=f"cut{node}{token[:6]}")
        procs.append(jobs.launch(1, env, "--nnodes", "2", "--node-rank", str(node), "--master-addr", addr_a,
                                 "--master-port", "29518", "--grace", "5", prefix=("ip", "netns", "exec", ns)))
    with jobs.running(procs):
        jobs.wait_for_ranks(tmp_path, (0, 1), procs, timeout=60)
        _ip("-n", ns_a, "link", "set", dev_a, "down")
        outs, elapsed = jobs.finish(procs, timeout=40)
    text = "\n".join(outs)
    assert [p.returncode != 0 for p in procs] == [True, True], text
    assert elapsed < 25, f"{elapsed:.1f} s to notice the cut link\n{text}"
    for r, peer in ((0, 1), (1, 0)):
        assert re.search(rf"\[rank {r}\] ERROR rank {r} \(this process\) .*all_reduce #\d+ .*rank {peer} over tcp",
                         text), text


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_shrink_across_hosts_after_rank_0_died(two_hosts):
    """Rank 0 (the store's host, on host A) is SIGKILLed: rank 1 beside it and ranks 2, 3 on host B
    shrink to three ranks and all_reduce."""
    procs, text = _two_node_job(two_hosts, SHRINK, "shr", "29519", "60", RINGCOMM_TIMEOUT="10")
    assert "rank 0 failed first (killed by SIGKILL)" in text, text
    assert procs[1].returncode == 0, text
    for r in (1, 2, 3):
        line = re.search(rf"\[rank {r}\] rank {r}: shrink took [\d.]+ s, now rank {r - 1} of 3 OK", text)
        assert line, text
        print(line.group(0))


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_ranks_with_only_shm_links_and_ranks_with_tcp_cut_alike(two_hosts):
    """3 ranks a host, default FIFO and slice: a rank whose ring or tree neighbours are all on its host
    runs a call in the native engine, its neighbour with a tcp link in the reference engine. Both cut
    the call in the same slices (they did not: "expected 524288 bytes for slice 2 ... but got 262144")."""
    procs, text = _two_node_job(two_hosts, MIXED, "mix", "29520", "5", per_node=3, buffsize=None,
                                RINGCOMM_TIMEOUT="30")
    assert [p.returncode for p in procs] == [0, 0], text
    assert text.count("OK") == 6, text


def _two_node_job(two_hosts, script, tag, port, grace, _first=None, per_node=2, buffsize="65536", **env_extra):
    """``ringcomm-run -n per_node`` of ``script`` on each of the two hosts (node 0 in host A, whose
    address is the store's), FIFOs of ``buffsize`` bytes (None: the default); waits up to 90 s and
    kills what is left. (procs, their output)."""
    (ns_a, _, addr_a), (ns_b, _, _) = two_hosts
    token = secrets.token_hex(8)
    procs = []
    fifo = {} if buffsize is None else {"RINGCOMM_BUFFSIZE": buffsize}
    for node, ns in enumerate((ns_a, ns_b)):
        env = dict(os.environ, RINGCOMM_TOKEN=token, RINGCOMM_JOB_ID=f"{tag}{node}{token[:6]}",
                   **fifo, **env_extra, **((_first or {}) if node == 0 else {}))
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "ringcomm.launch", "-n", str(per_node), "--nnodes", "2",
               "--node-rank", str(node), "--master-addr", addr_a, "--master-port", port, "--grace", grace, script]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=90)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return procs, "\n".join(outs)
