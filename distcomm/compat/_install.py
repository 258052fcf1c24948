"""Putting a framework's own calls on distcomm: every loaded module of the framework that holds one
of its distributed functions (its package, the submodules that define them and call each other
through their globals, and each module that imported them by name, such as
``from mmengine.dist import get_dist_info``) gets the compat module's function in its place. A
module loaded afterwards imports the replacements, the package and its submodules holding them
already. The function ``swap`` returns puts the originals back."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["swap"]

_lock = threading.Lock()
_active: dict[str, Callable[[], None]] = {}  # by framework: what undoes its swap


def swap(prefix: str, package: ModuleType, replacements: ModuleType, names: Sequence[str]) -> Callable[[], None]:
    """Replace ``package``'s functions ``names`` by ``replacements``' of the same names in every
    loaded module of the framework ``prefix``. Returns the function that undoes it; a second call
    while one is in place returns the first's."""
    with _lock:
        if prefix in _active:
            return _active[prefix]
        # by identity: a module's own function of the same name (or an alias) is left alone
        pairs = {id(getattr(package, n)): (getattr(package, n), getattr(replacements, n)) for n in names}
        done: list[tuple[ModuleType, str, Any]] = []
        for name, module in list(sys.modules.items()):
            if (name == prefix or name.startswith(prefix + ".")) and isinstance(module, ModuleType):
                for attr, value in list(vars(module).items()):
                    pair = pairs.get(id(value))
                    if pair is not None and pair[0] is value:
                        setattr(module, attr, pair[1])
                        done.append((module, attr, value))

        def undo() -> None:
            with _lock:
                for module, attr, original in reversed(done):
                    if getattr(module, attr, None) is pairs[id(original)][1]:  # (one the user set stays)
                        setattr(module, attr, original)
                done.clear()
                if _active.get(prefix) is undo:
                    del _active[prefix]

        _active[prefix] = undo
    return undo
