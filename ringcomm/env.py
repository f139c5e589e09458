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


def env_switch(name: str) -> bool:
    """An on/off knob that is on unless ``$name`` says off: 1, on, yes, true or empty (on); 0, off,
    no or false (off); anything else is an error that names the variable."""
    raw = os.environ.get(name, "1").strip().lower()
    if raw not in ("0", "1", "off", "on", "no", "yes", "false", "true", ""):
        raise ValueError(f"{name}={raw!r}: use 1 (on, the default) or 0 (off)")
    return raw not in ("0", "off", "no", "false")


HOST_CPUS_ENV = "RINGCOMM_HOST_CPUS"   # the CPUs a host's bound ranks share (ringcomm-run --bind core)


def oversubscribed(world_size: int) -> bool:
    """Whether this host's ranks (LOCAL_WORLD_SIZE, else ``world_size``) outnumber the cores they
    share (RINGCOMM_HOST_CPUS, which `ringcomm-run --bind core` sets, else the cores this process
    may use): then ranks share cores and preempt each other (assemble.spins,
    engine_native.slot_stores)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    cpus = int(os.environ.get(HOST_CPUS_ENV) or 0) or len(os.sched_getaffinity(0))
    return local > cpus
