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

# How long the first rank to time out waits for the others' positions: three patrols, so every
# rank stuck in a wait answers, while the error comes at most this long after RINGCOMM_TIMEOUT.
GATHER_SECONDS = 1.5
FAILED = ("failed", "timed out")  # the states whose records say why a rank stopped


def told(watchdog, kind, state: str, msg: str, peer: int | None = None) -> RingcommError:
    """The error ``kind(msg)`` for a rank that failed ("timed out", "aborted" or "failed"), told
    to ``watchdog`` (None: no watchdog): the first rank to time out adds where every rank was.
    A failed wait (executor._explain) and a failed connection (links.Links._connect) end so.

    ``peer`` is the rank this one waited on. If that rank had failed before, the message ends
    with the failure that started it all, passed on from rank to rank: when rank 5 of a ring of
    8 dies, rank 6 sees it die, and rank 7, which only sees rank 6 close its link, still names
    rank 5 (so does every rank after it)."""
    if watchdog is None:
        return kind(msg)
    first = watchdog.first_failure(peer) if peer is not None and state != "aborted" else None
    if first:
        msg = f"{msg}; the first failure: {first}"
    table = watchdog.on_failure(state, msg, first or watchdog.as_cause(msg))
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

    def _publish(self, state: str, detail: str = "", cause: str = "") -> None:
        where = dict(self.position() if self.position else {}, state=state, detail=detail, cause=cause)
        self.store.set(self._key(f"pos/{self.rank}"), json.dumps(where))

    def as_cause(self, msg: str) -> str:
        """This rank's own failure message as another rank quotes it: "rank 6 failed waiting ...
        from rank 5 ...: rank 5 (pid 1234) died while rank 6 waited ..." (no "this process")."""
        me = f"rank {self.rank}"
        return msg.replace(f"{me} (this process)", me).replace("this rank", me)

    def first_failure(self, peer: int) -> str | None:
        """The failure that started it all, as ``peer`` recorded it when it failed (before it
        closed its links, so before this rank can see it gone); None if it recorded none: it
        died, stalled, or left without failing."""
        try:
            where = json.loads(self.store.get(self._key(f"pos/{peer}"), timeout=0.05))
        except (RingcommError, OSError, ValueError):
            return None
        if where.get("state") not in FAILED:
            return None  # a position published for a table, not a failure
        return where.get("cause") or where.get("detail") or None

    def on_failure(self, state: str, detail: str, cause: str = "") -> str:
        """Record this rank's failure (``cause``: the first failure, for the ranks that wait on
        this one); if it is the first timeout, return the table of all ranks."""
        try:
            self._publish(state, detail, cause)
            if self.store.add(self._key("failed"), 1) == self.world_size:
                self.store.set(self._key("settled"), b"1")  # everyone has said where it is
            if state != "timed out" or self.store.add(self._key("timeouts"), 1) != 1:
                return ""
            self.store.add(self._key("dump"), 1)
            table = format_table(self._gather(), self.world_size)
            self.store.set(self._key("settled"), b"1")
        except (RingcommError, OSError) as e:  # a table is owed only by the first rank to time out
            return f"(could not collect the other ranks' positions: {e})" if state == "timed out" else ""
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
