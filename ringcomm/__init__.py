"""ringcomm: collective communication built from small, visible pieces.

    import ringcomm
    comm = ringcomm.init()            # reads torchrun / mpirun / Slurm's environment
    comm.all_reduce(x, ringcomm.SUM)  # in place
"""
from .algorithms import register_algorithm, unregister_algorithm, verify
from .model import cost, cost_breakdown, fit
from .comm import Communicator
from .errors import (CollectiveTimeout, CommunicatorClosed, PeerFailure, RingcommError, StoreError,
                     StoreTimeout)
from .init import init
from .ops import AVG, MAX, MIN, PROD, SUM, ReduceOp
from .work import Work

__version__ = "0.1.0"
__all__ = ["init", "Communicator", "ReduceOp", "SUM", "PROD", "MIN", "MAX", "AVG", "RingcommError",
           "CollectiveTimeout", "PeerFailure", "CommunicatorClosed", "StoreError", "StoreTimeout",
           "register_algorithm", "unregister_algorithm", "verify", "cost", "cost_breakdown", "fit", "Work"]
