"""shrink's meeting: the surviving ranks agree on who is in the new communicator, with no store.

Every caller walks the ranks not excluded in order and connects to the roster socket of each
(ringcomm.roster): a refusal (or a vanished pid on this host) proves that rank dead, so it tries
the next. The first rank that answers is the lowest one alive and leads; a caller that reaches
itself first is that leader. Followers send JOIN and wait; the leader accept()s JOINs and probes
the ranks that have not come, until each has joined or is proved dead. It then decides the
member list once (itself and who joined, in the old order), starts the new communicator's
store through ``serve(members)`` and sends every follower the same DECISION.

Deaths are permanent, so all callers converge on the same leader: if the leader dies while a
follower waits, the follower's connection breaks and it walks on to the next rank. A rank that
is alive but never comes (stopped by SIGSTOP, or not calling shrink) is NOT declared dead: we
cannot tell it from a slow one, and a stopped rank that wakes up later must not find itself in
a communicator the others have given up. The leader then fails the meeting shortly before its
deadline, telling every follower which ranks did not come (kill them or exclude them and call
shrink again); a follower whose leader is the stopped one times out naming it.

Frames are a 4-byte big-endian length and a JSON object.
"""
from __future__ import annotations

import hmac
import json
import select
import socket
import struct
import time

from ringcomm.transport.base import PATROL_PERIOD, process_gone

from .errors import CollectiveTimeout, RingcommError
from .roster import Roster

FRAME = struct.Struct("!I")
MAX_FRAME = 1 << 20
HELLO_TIMEOUT = 1.0    # an accepted connection must say JOIN within this (probes just close)
CONNECT_TIMEOUT = 2.0  # per attempt to reach a rank that may lead
PROBE_MAX = 2.0        # longest pause between a leader's probes of a rank that has not come


DEAD, RETRY = "dead", "retry"  # what _try_follow learnt about a rank that gave no decision


class _Problem(Exception):
    """Why the leader ended a meeting, worded for every rank; ``timeout`` picks the error kind."""

    def __init__(self, text: str, timeout: bool = False):
        super().__init__(text)
        self.timeout = timeout


def ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def send_msg(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(FRAME.pack(len(data)) + data)


def recv_msg(sock: socket.socket, deadline: float) -> dict:
    """One frame; TimeoutError at ``deadline``, EOFError/OSError when the other end went away."""
    (n,) = FRAME.unpack(_exact(sock, FRAME.size, deadline))
    if n > MAX_FRAME:
        raise EOFError(f"frame of {n} bytes")
    return json.loads(_exact(sock, n, deadline))


def _exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = b""
    while len(buf) < n:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return buf


def meet(roster: Roster, exclude: frozenset, token: str, deadline: float, serve) -> tuple[list[int], str]:
    """(the new communicator's members in old ranks, its store's "host:port") on every caller."""
    me = roster.rank
    join = {"uid": roster.uid, "rank": me, "exclude": sorted(exclude), "token": token}
    candidates = [r for r in range(roster.world_size) if r not in exclude]
    while True:
        for c in candidates:
            if c == me:
                return Leader(roster, join, candidates, deadline).run(serve)
            got = _try_follow(roster, c, join, deadline)
            if got is DEAD:
                continue
            if got is RETRY:
                break  # c lives but did not lead us: start over from the lowest rank
            return got


def _try_follow(roster: Roster, c: int, join: dict, deadline: float):
    """The decision of leader c, DEAD when c is proved dead, RETRY when it lives but gave none
    (yet); raises at the deadline."""
    me, what = roster.rank, f"shrink(exclude={join['exclude']})"
    entry = roster.entries[c]
    if entry["host"] == roster.host and process_gone(entry["pid"]):
        return DEAD
    left = deadline - time.monotonic()
    if left <= 0:
        raise CollectiveTimeout(f"rank {me} (this process) could not reach rank {c}, the lowest rank "
                                f"that may be alive (it leads the meeting), within the {what} deadline")
    try:
        sock = roster.connect(c, min(left, CONNECT_TIMEOUT))
    except ConnectionRefusedError:
        return DEAD
    except OSError:
        return _pause_then_retry(deadline)  # unreachable for now: not proof of death
    try:
        send_msg(sock, join)
        answer = recv_msg(sock, deadline)
    except TimeoutError:
        raise CollectiveTimeout(
            f"rank {me} (this process) timed out in {what} after waiting for rank {c}, the lowest "
            f"rank alive, which leads the meeting: it accepts connections but did not answer "
            f"(stopped, or not calling shrink) over tcp") from None
    except (EOFError, OSError, ValueError):
        return DEAD if roster.dead(c) else _pause_then_retry(deadline)
    finally:
        sock.close()
    if answer.get("error"):
        kind = CollectiveTimeout if answer.get("timeout") else RingcommError
        raise kind(f"rank {me} (this process): {what} failed; rank {c}, which led it, says: {answer['error']}")
    return answer["members"], answer["store"]


def _pause_then_retry(deadline: float):
    # A leader that dropped us but lives, or a host we cannot reach yet: try again shortly
    # rather than in a tight loop of connections.
    time.sleep(max(0.0, min(PATROL_PERIOD, deadline - time.monotonic())))
    return RETRY


class Leader:
    """The lowest live rank: collects JOINs and probes the rest until every rank is accounted for."""

    def __init__(self, roster: Roster, join: dict, candidates: list[int], deadline: float):
        self.roster, self.join, self.deadline = roster, join, deadline
        me = roster.rank
        self.what = f"shrink(exclude={join['exclude']})"
        self.dead = {r for r in candidates if r < me}  # each refused us on the way here
        self.expected = [r for r in candidates if r > me]
        self.joined: dict[int, socket.socket] = {}
        # Stop waiting a little before our deadline, so followers hear why before theirs.
        self.started = time.monotonic()
        self.give_up = deadline - min(2.0, 0.2 * (deadline - self.started))

    def run(self, serve) -> tuple[list[int], str]:
        try:
            self._collect()
            members = sorted([self.roster.rank, *self.joined])
            address = serve(members)
            self._tell_all({"members": members, "store": address})
            return members, address
        except _Problem as e:
            self._tell_all({"error": str(e), "timeout": e.timeout})
            kind = CollectiveTimeout if e.timeout else RingcommError
            raise kind(f"rank {self.roster.rank} (this process) led {self.what}: {e}") from None
        except BaseException as e:  # e.g. serve() could not start the store
            self._tell_all({"error": f"{type(e).__name__}: {e}"})
            raise
        finally:
            for s in self.joined.values():
                s.close()

    def _tell_all(self, msg: dict) -> None:
        for s in self.joined.values():
            _send_quietly(s, msg)

    def _missing(self) -> list[int]:
        return [r for r in self.expected if r not in self.joined and r not in self.dead]

    def _collect(self) -> None:
        # Probes of a rank that has not come sit in its backlog (only a leader accepts), so they
        # grow apart: a death still shows within PROBE_MAX, and a long wait fills no backlog.
        next_probe, period = time.monotonic(), PATROL_PERIOD
        while True:
            self._drop_departed()
            missing = self._missing()
            if not missing:
                return
            now = time.monotonic()
            if now >= next_probe:
                self.dead.update(r for r in missing if self.roster.dead(r, min(1.0, PATROL_PERIOD)))
                next_probe, period = time.monotonic() + period, min(period * 1.5, PROBE_MAX)
                continue
            if now >= self.give_up:
                they = "it" if len(missing) == 1 else "them"
                raise _Problem(
                    f"{ranks_text(missing)} {'is' if len(missing) == 1 else 'are'} alive (connections are "
                    f"accepted) but did not come to the meeting within {now - self.started:.1f} s: stopped, "
                    f"or not calling shrink; kill {they} or pass {they} in exclude and call shrink again",
                    timeout=True)
            conn = self.roster.accept(min(next_probe, self.give_up) - now)
            if conn is not None:
                self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        try:
            msg = recv_msg(conn, time.monotonic() + HELLO_TIMEOUT)
        except (EOFError, OSError, ValueError):
            conn.close()  # a liveness probe, or not one of ours
            return
        if not hmac.compare_digest(str(msg.get("token", "")).encode(), self.join["token"].encode()):
            conn.close()  # another job: it gets nothing from us
            return
        r = msg.get("rank")
        problem, fatal = self._disagreement(msg)
        if problem:
            _send_quietly(conn, {"error": problem})
            conn.close()
            if fatal:
                raise _Problem(problem)
            return
        old = self.joined.pop(r, None)
        if old is not None:
            old.close()  # the same rank came back (it lost its first connection)
        self.joined[r] = conn
        self.dead.discard(r)

    def _disagreement(self, msg: dict) -> tuple[str, bool]:
        """(what is wrong with this JOIN, or ""; whether it fails the whole meeting). A stranger
        (another communicator reaching a reused port) is only turned away; callers of this
        communicator that disagree on exclude fail it: the program has a bug."""
        r, mine = msg.get("rank"), self.join
        if msg.get("uid") != mine["uid"]:
            return f"rank {self.roster.rank}'s socket belongs to another communicator now", False
        if r not in self.expected:
            return f"rank {r} came to rank {self.roster.rank}, which leads {self.what} without it", False
        if msg.get("exclude") != mine["exclude"]:
            return (f"the ranks disagree: rank {r} called shrink(exclude={msg.get('exclude')}), "
                    f"rank {self.roster.rank} called shrink(exclude={mine['exclude']})"), True
        return "", False

    def _drop_departed(self) -> None:
        """Forget joined ranks whose connection closed: one that gave up (a JOIN left in our
        backlog from an attempt that timed out) or died after joining. A rank that gave up
        and lives is missing again: it may come back, or be the reason the meeting fails."""
        for r, s in list(self.joined.items()):
            readable, _, _ = select.select([s], [], [], 0)
            try:
                gone = bool(readable) and s.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                gone = True
            if gone:
                self.joined.pop(r).close()


def _send_quietly(sock: socket.socket, obj: dict) -> None:
    try:
        sock.settimeout(HELLO_TIMEOUT)
        send_msg(sock, obj)
    except OSError:
        pass  # that follower is gone; its own deadline or the next collective tells it
