"""Collective algorithms as data: steps, schedules and the functions that build them."""
from .step import BLOCK, FROM, OWN, SPLIT, TO, KINDS, Schedule, Step  # noqa: F401
