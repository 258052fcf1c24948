"""The suite reuses its spawned gloo worlds between tests (distcomm.testing.spawn's reuse=True):
a world is kept only while every rank returns normally with its communicator intact, so tests that
break a communicator still get a fresh one next time."""

import os

os.environ.setdefault("DISTCOMM_SPAWN_REUSE", "1")
