"""Routes: how each kind of collective's objects travel after the first exchange's slots.

A collective's op names its route; the pipeline runs the route's steps (see ``base.Route``).
"""

from __future__ import annotations

from ..._calls import Op
from .base import Incoming, Outgoing, Route, Segment, build_slot, check_receivable, over_max_bytes, status_outgoing
from .broadcast import BroadcastRoute
from .direct import AllGatherRoute
from .gather import GatherRoute
from .scatter import ScatterRoute

__all__ = ["ALL_GATHER", "BROADCAST", "GATHER", "ROUTES", "SCATTER", "Incoming", "Outgoing", "Route", "Segment",
           "build_slot", "check_receivable", "over_max_bytes", "status_outgoing"]

ALL_GATHER, GATHER, BROADCAST, SCATTER = AllGatherRoute(), GatherRoute(), BroadcastRoute(), ScatterRoute()

ROUTES: dict[Op, Route] = {op: ALL_GATHER for op in Op}
"""How each op's objects travel: like an all_gather, a gather to the root, a broadcast from it, or a
scatter from it. The slot carries the op itself, so ranks that call different ops still disagree."""
ROUTES.update({Op.GATHER: GATHER, Op.REDUCE_OBJECT: GATHER, Op.ALL_REDUCE_OBJECT: GATHER, Op.SCAN: GATHER,
               Op.EXSCAN: GATHER, Op.BROADCAST: BROADCAST, Op.RESULT: BROADCAST, Op.SHARED_RANDOM_SEED: BROADCAST,
               Op.ADMIT: BROADCAST,
               Op.SCATTER: SCATTER, Op.RESULTS: SCATTER})
