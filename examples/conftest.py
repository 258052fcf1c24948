"""The examples' tests share the suite's setting: spawned gloo worlds are reused between tests."""

import tests.conftest  # noqa: F401
