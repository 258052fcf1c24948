"""Torch's own tables of process groups, for the groups distcomm makes in Python (a group that
follows a mesh's memberships, a group over a threaded communicator): torch's Python API finds a
group's backend and ranks there, and functional collectives (DTensor's) find it by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch._C._distributed_c10d import _register_process_group, _unregister_process_group
from torch.distributed import distributed_c10d as c10d
from torch.distributed.distributed_c10d import GroupName

__all__ = ["enter", "leave"]


def enter(group: Any, name: GroupName, global_ranks: Sequence[int], backend: Any, config: str) -> None:
    """Enter ``group`` under ``name``: its ranks (``global_ranks[r]`` is its rank r's rank in the
    default group), its backend and its backend's config, as torch's ``new_group`` would."""
    world: Any = c10d._world  # (torch's tables, typed for torch's own groups)
    world.pg_map[group] = (backend, None)
    world.pg_names[group] = name
    world.pg_group_ranks[group] = {g: r for r, g in enumerate(global_ranks)}
    world.pg_backend_config[group] = config
    world.tags_to_pg.setdefault(name, []).append(group)
    world.pg_to_tag[group] = name
    _register_process_group(name, group)


def leave(group: Any, name: GroupName) -> None:
    """Take ``group`` out of torch's tables again."""
    world = c10d._world
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag,
                  world.pg_coalesce_state):
        table.pop(group, None)
    world.tags_to_pg.pop(name, None)
    _unregister_process_group(name)
