"""Drop-in modules for code written against another framework's distributed functions.

- ``import distcomm.compat.mmengine as dist``: every name of ``mmengine.dist`` (0.10.7).
- ``from distcomm.compat.torch import all_gather_object, ...``: torch.distributed's four object
  collectives, with torch's signatures and in-place lists.

Both are adapters: each function translates the framework's signature and conventions (in place
or not, None off the destination, its error types) into calls on the current communicator
(``distcomm.current()``), so objects travel through distcomm's pipeline and tensors through its
checked tensor collectives. What differs from the frameworks: docs/migration.md.
"""

from __future__ import annotations

from ._common import (
    InvalidArgumentError,
    InvalidAssertionError,
    InvalidTypeError,
    InvalidValueError,
    UnsupportedArgumentError,
)

for _cls in (InvalidArgumentError, InvalidAssertionError, InvalidTypeError, InvalidValueError,
             UnsupportedArgumentError):
    _cls.__module__ = __name__

__all__ = [
    "InvalidArgumentError", "InvalidAssertionError", "InvalidTypeError", "InvalidValueError",
    "UnsupportedArgumentError",
]
