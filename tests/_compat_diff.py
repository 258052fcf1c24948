"""The differential suites' harness: each case runs on the same ranks against the framework's own
module and against distcomm's compat module, and what each left behind is described value by value
and dtype by dtype (return value, the arguments after the call, the error), to compare."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

Case = Callable[[Any, int, int], Any]  # case(module, rank, world) -> what to compare


def describe(x: Any) -> Any:
    """``x`` as plain values, tensors and arrays by dtype, shape and elements, so that == compares dtypes too."""
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype), tuple(x.shape), x.device.type, x.tolist())
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), x.shape, x.tolist())
    if isinstance(x, dict):
        return ("dict", [(describe(k), describe(v)) for k, v in x.items()])
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [describe(v) for v in x])
    if isinstance(x, BaseException):
        return ("raised", type(x).__name__)
    return (type(x).__name__, x if isinstance(x, (int, float, str, bool, type(None))) else repr(x))


def outcome(case: Case, module: Any, rank: int, world: int) -> tuple[Any, BaseException | None]:
    """What ``case`` returns (described), or the exception it raised."""
    try:
        return describe(case(module, rank, world)), None
    except Exception as e:
        return None, e


def compare(cases: dict[str, Case], original: Any, compat: Any, rank: int, world: int) -> dict[str, Any]:
    """Every case against both modules on this rank: per case, None where they agree (the compat
    raising an instance of the original's error type counts), else what each gave."""
    out: dict[str, Any] = {}
    for name, case in cases.items():
        want, want_error = outcome(case, original, rank, world)
        got, got_error = outcome(case, compat, rank, world)
        if want_error is not None:
            agree = got_error is not None and isinstance(got_error, type(want_error))
        else:
            agree = got_error is None and got == want
        out[name] = None if agree else {"original": want if want_error is None else repr(want_error),
                                        "compat": got if got_error is None else repr(got_error)}
    return out


def raised_alike(call: Callable[[], Any], kind: type[BaseException]) -> tuple[str, str] | str:
    """(the error's type, its message) when ``call`` raises a ``kind``; else what happened."""
    try:
        call()
    except kind as e:
        return kind.__name__, str(e)
    except Exception as e:
        return f"raised {type(e).__name__}: {e}"
    return "returned"
