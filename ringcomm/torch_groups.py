"""Sub-groups of a ringcomm process group made with comm.split, registered with torch.

torch's own ``dist.split_group`` is reserved to accelerator groups in torch 2.13 (it refuses a
group without a bound device before asking the backend), and ``dist.new_group`` only calls the
backend on the member ranks, so a collective split of the parent cannot serve it: new_group keeps
its rendezvous through the store. ``split_group`` here is dist.split_group for ringcomm groups:
one comm.split of the parent, no new rendezvous, and a group torch knows by name like any other
(dist collectives with group=, destroy_process_group, DeviceMesh's lookups).
"""
from __future__ import annotations

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def split_group(split_ranks, parent_pg=None, group_desc: str | None = None):
    """Collective over ``parent_pg`` (default: the world): ``split_ranks`` lists disjoint lists of
    the parent's ranks, the same on every rank; each list becomes a group. Returns this rank's
    group, or None where the rank is in no list."""
    parent = parent_pg if parent_pg is not None else c10d._get_default_group()
    if parent.getBackendName() != "ringcomm" or not hasattr(parent, "comm"):
        raise TypeError(f"split_group: the parent must be a ringcomm process group, got {type(parent).__name__}")
    n = parent.size()
    if not split_ranks or not all(isinstance(g, (list, tuple)) and g for g in split_ranks):
        raise ValueError(f"split_group: split_ranks must be a non-empty list of non-empty rank lists, got {split_ranks!r}")
    flat = [r for g in split_ranks for r in g]
    if any(not isinstance(r, int) or not 0 <= r < n for r in flat) or len(set(flat)) != len(flat):
        raise ValueError(f"split_group: {split_ranks!r} must hold distinct ranks of the parent's {n}")
    mine = next((sorted(g) for g in split_ranks if parent.rank() in g), None)
    return parent.split_group(mine, group_desc=group_desc)


def split(parent, ranks, group_name=None, group_desc=None):
    """ProcessGroupRingcomm.split_group: this rank's part of one comm.split of the parent."""
    ranks = sorted(ranks) if ranks else None
    comm = parent.comm.split(ranks[0] if ranks else None, key=parent.rank())  # color: the first member
    if comm is None:
        return None
    globals_ = dist.get_process_group_ranks(parent)
    members = [globals_[r] for r in ranks]
    name = group_name or c10d._process_group_name(members, use_hashed_name=True)
    store = dist.PrefixStore(f"ringcomm-split/{name}/", parent.store) if parent.store is not None else None
    pg = type(parent)(comm, store)  # a ProcessGroupRingcomm (ringcomm.torch imports this module)
    pg._set_group_name(name)
    pg._set_group_desc(group_desc or f"{parent.group_desc}:split")
    c10d._register_pg_in_world(pg, backend_name="ringcomm", store=store, group_name=name,
                               backend_config="cpu:ringcomm,cuda:ringcomm",
                               rank_mapping={g: i for i, g in enumerate(members)})
    return pg
