"""distcomm: one communicator object for everything a training job's processes say to each other.

    comm = distcomm.from_env()        # whatever started the process: python, torchrun, srun, mpirun
    with comm, distcomm.use(comm):
        results = comm.gather(my_predictions)           # or distcomm.gather(...) via use()

See the README and docs/ for the whole API, the trust model and the performance figures.
"""

from typing import Any as _Any  # (no __future__ import here: it would put `annotations` in the namespace)

from ._api import (
    all_gather,
    all_gather_tensor,
    all_reduce,
    all_reduce_dict,
    all_reduce_object,
    all_to_all,
    barrier,
    broadcast,
    broadcast_tensor,
    create_local_process_group,
    exscan,
    gather,
    gather_in_order,
    get_local_process_group,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    irecv,
    is_main_process,
    isend,
    main_process_first,
    recv,
    reduce,
    reduce_dict,
    reduce_object,
    reduce_scatter_tensor,
    scan,
    scatter,
    send,
    shard,
    shared_random_seed,
    synchronize,
)
from ._calls import OpStats
from ._communicator import DEFAULT_TIMEOUT, Communicator
from ._context import current, use
from ._elastic.loop import ElasticLoop
from ._elastic.membership import Membership
from ._errors import (
    AuthenticationError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicatorStateError,
    DistCommError,
    FrameError,
    PayloadTooLargeError,
    PeerError,
    RankFailedError,
    SerializationError,
    UnsafePayloadError,
    is_rank_loss,
)
from ._handles import Handle
from ._launching.from_env import from_env
from ._launching.launch import free_port, launch
from ._local import LocalCommunicator
from ._torch import GlooCommunicator, NcclCommunicator
from ._wire.serialization import AuthenticatedSerializer, PickleSerializer, SafeSerializer, Serializer

__version__ = "0.1.0"

# Public classes report the package, not the private module they live in: reprs, tracebacks and
# pickles don't change when the code moves between private modules.
for _cls in (Communicator, Handle, LocalCommunicator, GlooCommunicator, NcclCommunicator, OpStats, Serializer,
             PickleSerializer, SafeSerializer, DistCommError, CollectiveError, CollectiveMismatchError,
             CollectiveTimeoutError, CommunicatorStateError, FrameError, PayloadTooLargeError, PeerError,
             RankFailedError, SerializationError, UnsafePayloadError, Membership, AuthenticationError,
             AuthenticatedSerializer, ElasticLoop):
    _cls.__module__ = __name__


def __getattr__(name: str) -> _Any:
    # The reference module's global, read through the active communicator: code that reads
    # ``comm._LOCAL_PROCESS_GROUP`` gets the local group of the communicator in use.
    if name == "_LOCAL_PROCESS_GROUP":  # as the reference: None until launch() or create_local_process_group()
        comm = current()
        return comm.local_group if comm._machines_declared else None
    raise AttributeError(f"module 'distcomm' has no attribute {name!r}")

__all__ = [
    "AuthenticatedSerializer",
    "AuthenticationError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "Communicator",
    "CommunicatorStateError",
    "DEFAULT_TIMEOUT",
    "DistCommError",
    "ElasticLoop",
    "FrameError",
    "GlooCommunicator",
    "Handle",
    "LocalCommunicator",
    "Membership",
    "NcclCommunicator",
    "OpStats",
    "PayloadTooLargeError",
    "PeerError",
    "PickleSerializer",
    "RankFailedError",
    "SafeSerializer",
    "SerializationError",
    "Serializer",
    "UnsafePayloadError",
    "all_gather",
    "all_gather_tensor",
    "all_reduce",
    "all_reduce_dict",
    "all_reduce_object",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_tensor",
    "create_local_process_group",
    "current",
    "exscan",
    "free_port",
    "from_env",
    "gather",
    "gather_in_order",
    "get_local_process_group",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
    "irecv",
    "is_main_process",
    "is_rank_loss",
    "isend",
    "launch",
    "main_process_first",
    "recv",
    "reduce",
    "reduce_dict",
    "reduce_object",
    "reduce_scatter_tensor",
    "scan",
    "scatter",
    "send",
    "shard",
    "shared_random_seed",
    "synchronize",
    "use",
]
