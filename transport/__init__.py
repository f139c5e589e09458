"""Transports move slices between two ranks (installed as ringcomm.transport).

One file a transport: shm.py (same host), tcp.py (anywhere). Each implements the
Connection interface of base.py and knows nothing about collectives.
"""
