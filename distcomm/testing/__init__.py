"""Test doubles for code that uses distcomm: no cluster needed.

- ``FakeCommunicator``: one rank under test, the other ranks scripted with ``peers=``.
- ``run_threaded``: N ranks as threads in this process, exchanging real serialized bytes.
- ``spawn``: N real processes over gloo on 127.0.0.1.
- A pytest plugin (installed with distcomm) with the fixtures ``fake_comm``, ``threaded_world``
  and ``spawn_world``.

All three run the same serialize / transfer / deserialize pipeline as GlooCommunicator.
"""

from __future__ import annotations

from .._errors import RankFailedError
from ._fake import Call, FakeCommunicator
from ._spawn import spawn
from ._threaded import ThreadedCommunicator, run_threaded

__all__ = ["Call", "FakeCommunicator", "RankFailedError", "ThreadedCommunicator", "run_threaded", "spawn"]

for _cls in (Call, FakeCommunicator, ThreadedCommunicator):
    _cls.__module__ = __name__
