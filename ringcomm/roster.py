"""Every rank's meeting address, learnt while the store is alive, for shrink to use after it died.

Each rank of a communicator of several ranks listens on a small TCP socket of its own and
publishes ``{addr, pid, host}`` in the store when the communicator is made; the communicator
is made only once every rank's entry has been read (NCCL's bootstrap all-gathers its ranks'
addresses at init the same way). After that no store is needed to find a peer or to tell
whether it lives:

* a dead process's socket refuses connections (the kernel closes its listening socket when the
  process dies, even while it lingers as a zombie), whichever host it was on;
* a peer on this host is also dead when its pid is gone or a zombie (/proc/PID/stat state Z),
  which guards against its port being reused by some other process.

A rank that is stopped (SIGSTOP) or busy still looks alive: its kernel accepts connections.
Nobody accept()s on the socket except a rank leading a shrink meeting (ringcomm.meet), so a
probe just sits in the backlog until the communicator closes.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time

from ringcomm.transport.base import process_gone
from ringcomm.transport.tcp import local_address

from .errors import StoreError, StoreTimeout

BACKLOG = 512  # probes are never accepted by a follower: room for every probe of a long meeting


class Roster:
    """This rank's listening socket and every rank's entry, once join() has returned."""

    def __init__(self, rank: int, world_size: int, host: str):
        self.rank, self.world_size, self.host = rank, world_size, host
        self.entries: list[dict] = []
        self.uid = ""   # equal on every rank of the communicator: a digest of all entries
        addr = local_address()
        self.sock = socket.create_server((addr, 0), backlog=BACKLOG)
        self.address = f"{addr}:{self.sock.getsockname()[1]}"

    def join(self, store, prefix: str, deadline: float, settings: dict | None = None) -> None:
        """Publish this rank's entry, then read every rank's (waiting for them until ``deadline``).
        ``settings``: this rank's values of what every rank must set alike (assemble.settings)."""
        mine = {"addr": self.address, "pid": os.getpid(), "host": self.host, "settings": settings or {}}
        store.set(f"{prefix}/roster/{self.rank}", json.dumps(mine))
        entries = []
        for r in range(self.world_size):
            try:
                raw = store.get(f"{prefix}/roster/{r}", timeout=max(0.0, deadline - time.monotonic()))
            except StoreTimeout:
                missing = [q for q in range(r, self.world_size) if not _has(store, f"{prefix}/roster/{q}")]
                raise StoreTimeout(f"not every rank joined the communicator in time; still missing: "
                                   f"ranks {missing}") from None
            entries.append(json.loads(raw))
        self.entries = entries
        self.uid = hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:32]

    def peer_address(self, r: int) -> tuple[str, int]:
        host, port = self.entries[r]["addr"].rsplit(":", 1)
        return host, int(port)

    def connect(self, r: int, timeout: float) -> socket.socket:
        """A connection to rank r's socket; ConnectionRefusedError when r is dead."""
        return socket.create_connection(self.peer_address(r), timeout=max(timeout, 1e-3))

    def dead(self, r: int, timeout: float = 1.0) -> bool:
        """Whether rank r is known dead. False also when it cannot be told within ``timeout``
        (an unreachable host): only a refusal or a vanished pid proves death."""
        entry = self.entries[r]
        if entry["host"] == self.host and process_gone(entry["pid"]):
            return True
        try:
            self.connect(r, timeout).close()
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
        return False

    def why_gone(self, r: int) -> str:
        """"" while rank r may live; else why it is known dead, for an error message. Cheap
        enough for every patrol of a wait: a peer on this host is looked up in /proc, one on
        another host probed with a short connect (a refusal proves death, silence does not)."""
        entry = self.entries[r] if r < len(self.entries) else None
        if entry is None:
            return ""
        if entry["host"] == self.host:
            return f"(pid {entry['pid']}) died" if process_gone(entry["pid"]) else ""
        try:
            self.connect(r, 0.2).close()
        except ConnectionRefusedError:
            return f"(on {entry['host']}) died: its socket refuses connections"
        except OSError:
            return ""
        return ""

    def accept(self, timeout: float) -> socket.socket | None:
        """The next connection to this rank's socket, or None after ``timeout`` seconds."""
        self.sock.settimeout(max(timeout, 1e-3))
        try:
            conn, _ = self.sock.accept()
        except TimeoutError:
            return None
        conn.settimeout(None)
        return conn

    def close(self) -> None:
        self.sock.close()


def _has(store, key: str) -> bool:
    try:
        store.get(key, timeout=0)
        return True
    except (StoreError, OSError):
        return False
