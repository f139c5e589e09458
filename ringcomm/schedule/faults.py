"""What can be wrong with a schedule, as data: a Failure has a kind, the rank, step and chunk
where it shows, and a sentence.

The kinds are the classes of fault a schedule can have; every check of the simulator and the
verifier reports one of them, so a test (or a tool) can ask *what* is wrong without parsing
prose. ScheduleError carries the list; its message is their prose.
"""
from __future__ import annotations

from dataclasses import dataclass

# A rank's output lacks a contribution (or a final step reduces a partial value).
MISSING = "missing contribution"
# A contribution reaches a reduction, or an output, more than once.
TWICE = "counted twice"
# An output holds data from the wrong place: another chunk's contribution, another rank's block.
MISPLACED = "misplaced block"
# A send without its receive or the other way round, or the two ends disagree on the chunks.
UNMATCHED = "unmatched send or receive"
# The ranks wait for each other forever (with the FIFO shape named in the detail).
DEADLOCK = "deadlock"
# In place, a step reads an input chunk that an earlier step has already overwritten as output.
READ_AFTER_WRITE = "read-after-write"
# In place, a step overwrites part of the buffer that the collective leaves alone on that rank
# (reduce on a non-root rank: its buf is its input, and it may even be read-only).
CLOBBER = "clobbered buffer"
# A rank writes straight into a peer's buffer (write_copy) while another access to the same chunk
# (the owner's, or a third rank's read or write) is not ordered before or after it by syncs.
RACE = "data race"
# The op's post-processing (AVG's division) is applied never, twice, or before a reduction.
POST_OP = "post-op"
# The schedules are not a well-formed set: wrong rank numbers, peers or chunks out of range, a
# builder that fails or returns something other than a Schedule.
MALFORMED = "malformed schedule"

KINDS = (MISSING, TWICE, MISPLACED, UNMATCHED, DEADLOCK, READ_AFTER_WRITE, RACE, CLOBBER, POST_OP, MALFORMED)


@dataclass(frozen=True)
class Failure:
    """One thing wrong with a set of schedules. ``rank``, ``step`` (index into that rank's
    steps) and ``chunk`` say where it shows, None where the fault has no such place (a whole
    connection, a builder). ``form`` is "in place" or "out of place" where the fault shows in
    only one of the forms the API allows; ``fifo`` the (nslots, slices) FIFO shape where a
    deadlock shows only with FIFOs that small (None: at every size)."""

    kind: str
    rank: int | None
    step: int | None
    chunk: int | None
    detail: str
    form: str | None = None
    fifo: tuple[int, int] | None = None

    def __str__(self) -> str:
        where = [f"rank {self.rank}"] if self.rank is not None else []
        where += [f"step {self.step}"] if self.step is not None else []
        where += [f"chunk {self.chunk}"] if self.chunk is not None else []
        at = f" at {', '.join(where)}" if where else ""
        form = f" ({self.form})" if self.form else ""
        if self.fifo:
            form += f" (nslots={self.fifo[0]}, slices={self.fifo[1]})"
        return f"[{self.kind}{at}{form}] {self.detail}"


class ScheduleError(ValueError):
    """A schedule is wrong: it deadlocks, loses or duplicates data, or computes the wrong result.
    ``failures`` lists what is wrong (the message shows the first few)."""

    SHOWN = 6

    def __init__(self, failures, prefix: str = ""):
        if isinstance(failures, str):  # a plain message: no structured kind is known
            failures = [Failure(MALFORMED, None, None, None, failures)]
        self.failures = list(failures)
        lines = [str(f) for f in self.failures[:self.SHOWN]]
        if len(self.failures) > self.SHOWN:
            lines.append(f"... and {len(self.failures) - self.SHOWN} more")
        super().__init__(prefix + "\n".join(lines))

    @property
    def kinds(self) -> set[str]:
        return {f.kind for f in self.failures}
