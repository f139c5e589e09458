"""Who waits for whom: when a rank times out, every rank says where it is.

Each rank's executor always knows its position (collective, sequence number,
step, slice, the peer it waits on). Nothing is sent while things go well. When
a wait times out, the rank publishes its position in the store and, if it is
the first to time out, raises a flag there; every rank that is itself stuck in
a wait notices the flag at its next patrol (transport.base.PATROL_PERIOD) and
publishes its own position. The first rank then prints one table of all ranks,
so the stuck one is visible at once: it is the rank whose row says "no answer"
(stopped, dead, or busy outside ringcomm) or the one everybody waits for.
"""
from __future__ import annotations

import json
import sys
import time

from .errors import RingcommError

GATHER_SECONDS = 3.0  # how long the first rank waits for the others' positions


def told(watchdog, kind, state: str, msg: str) -> RingcommError:
    """The error ``kind(msg)`` for a rank that failed ("timed out", "aborted" or "failed"), told
    to ``watchdog`` (None: no watchdog): the first rank to time out adds where every rank was.
    A failed wait (executor._explain) and a failed connection (links.Links._connect) end so."""
    table = watchdog.on_failure(state, msg) if watchdog is not None else ""
    return kind(f"{msg}\nwhere every rank was:\n{table}" if table else msg)


class Watchdog:
    def __init__(self, rank: int, world_size: int, store, prefix: str):
        self.rank, self.world_size, self.store = rank, world_size, store
        self.prefix = prefix
        self.position = None  # set by the executor: a callable returning a dict
        self._answered = 0

    def _key(self, name: str) -> str:
        return f"{self.prefix}/watchdog/{name}"

    def __call__(self) -> None:
        """Patrol, from inside a slow wait: answer a dump request once."""
        try:
            flag = self.store.add(self._key("dump"), 0)
            if flag > self._answered:
                self._answered = flag
                self._publish("waiting")
        except (RingcommError, OSError):
            pass  # the store may be gone with rank 0; the wait's own deadline still holds

    def _publish(self, state: str, detail: str = "") -> None:
        where = dict(self.position() if self.position else {}, state=state, detail=detail)
        self.store.set(self._key(f"pos/{self.rank}"), json.dumps(where))

    def on_failure(self, state: str, detail: str) -> str:
        """Record this rank's failure; if it is the first timeout, return the table of all ranks."""
        try:
            self._publish(state, detail)
            if self.store.add(self._key("failed"), 1) == self.world_size:
                self.store.set(self._key("settled"), b"1")  # everyone has said where it is
            if state != "timed out" or self.store.add(self._key("timeouts"), 1) != 1:
                return ""
            self.store.add(self._key("dump"), 1)
            table = format_table(self._gather(), self.world_size)
            self.store.set(self._key("settled"), b"1")
        except (RingcommError, OSError) as e:
            return f"(could not collect the other ranks' positions: {e})"
        sys.stderr.write(f"ringcomm: rank {self.rank} timed out first; where every rank is:\n{table}\n")
        sys.stderr.flush()
        return table

    def _gather(self) -> dict[int, dict]:
        """Every rank's published position, waiting up to GATHER_SECONDS for the stragglers
        (a rank answers at its next patrol); the ranks still missing then have no answer."""
        deadline = time.monotonic() + GATHER_SECONDS
        found: dict[int, dict] = {}
        while len(found) < self.world_size:
            for r in range(self.world_size):
                if r not in found:
                    try:
                        found[r] = json.loads(self.store.get(self._key(f"pos/{r}"), timeout=0.05))
                    except RingcommError:
                        pass
            if time.monotonic() > deadline:
                break
        return found

    def linger(self) -> None:
        """On the rank that hosts the store, after a failure: give the other ranks a few
        seconds to publish and read positions before this process (and the store) goes."""
        try:
            self.store.wait([self._key("settled")], timeout=GATHER_SECONDS + 2)
        except (RingcommError, OSError):
            pass


def format_table(positions: dict[int, dict], world_size: int) -> str:
    lines = [f"  {'rank':>4}  {'state':<10} {'collective':<22} {'step':>7} {'slice':>6}  waiting for"]
    for r in range(world_size):
        p = positions.get(r)
        if p is None:
            lines.append(f"  {r:>4}  no answer: stopped, dead, or busy outside ringcomm")
            continue
        coll = f"{p.get('collective', '-')} #{p.get('seq', '-')}"
        step = f"{p.get('step', '-')}/{p.get('nsteps', '-')}"
        peer = p.get("peer")
        if peer is None:
            waits = "-"
        else:
            what = "a free slot at" if p.get("direction") == "send" else "data from"
            waits = f"{what} rank {peer} for {p.get('for', 0):.1f} s"
        lines.append(f"  {r:>4}  {p['state']:<10} {coll:<22} {step:>7} {p.get('slice', '-'):>6}  {waits}")
    return "\n".join(lines)
