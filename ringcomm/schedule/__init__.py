"""Collective algorithms as data: steps, schedules and the functions that build them."""
from .step import BLOCK, OWN, SPLIT, KINDS, Schedule, Step  # noqa: F401
