"""The exceptions ringcomm raises. Messages name this rank, the peer, the collective and the transport."""
from __future__ import annotations


class RingcommError(RuntimeError):
    """Base class of every runtime failure of a communicator."""


class CollectiveTimeout(RingcommError, TimeoutError):
    """A wait inside a collective passed its deadline (RINGCOMM_TIMEOUT)."""


class PeerFailure(RingcommError):
    """A peer died, closed its link, or broke the protocol."""


class CommunicatorClosed(RingcommError, ValueError):
    """The communicator was closed, or an earlier error made it unusable. A call on it is bad
    input, refused before any communication: a ValueError too, as Python's own "I/O operation
    on closed file" is (and a RuntimeError, as every RingcommError)."""


class StoreError(RingcommError):
    """The rendezvous store refused us or broke."""


class StoreTimeout(StoreError, TimeoutError):
    """A store operation passed its deadline."""
