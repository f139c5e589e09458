"""Reading RINGCOMM_* knobs from the environment, with errors that name the variable."""
from __future__ import annotations

import os


def env_number(name, default, kind=float):
    """The positive number in ``$name``, or ``default`` when it is unset or empty."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value
