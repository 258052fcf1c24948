"""Reduction operators: the names tensor collectives take, and the ones object reductions take."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["OBJECT_OPS", "TENSOR_OPS", "FoldError", "ReduceOpLike", "fold_objects", "fold_tensors", "object_op",
           "op_name", "tensor_op", "tensor_problem"]

TENSOR_OPS = ("sum", "mean", "min", "max", "prod")

ReduceOpLike: TypeAlias = "str | dist.ReduceOp.RedOpType"
"""A reduction: its name, or torch's ``dist.ReduceOp`` member."""

# torch's ReduceOp members under distcomm's names, beside the names themselves: one dict lookup a
# call. The members compare and hash equal to small ints (ReduceOp.SUM == 0), so the lookup is
# keyed by the type too, and 0 or True are not taken for an op.
_REDUCE_OP = type(dist.ReduceOp.SUM) if dist.is_available() else str
_OP_NAMES: dict[tuple[type, Any], str] = {(str, name): name for name in TENSOR_OPS}
if dist.is_available():
    _OP_NAMES.update({(_REDUCE_OP, dist.ReduceOp.SUM): "sum", (_REDUCE_OP, dist.ReduceOp.AVG): "mean",
                      (_REDUCE_OP, dist.ReduceOp.MIN): "min", (_REDUCE_OP, dist.ReduceOp.MAX): "max",
                      (_REDUCE_OP, dist.ReduceOp.PRODUCT): "prod"})


def op_name(op: Any) -> str | None:
    """distcomm's name for a reduction given by name or as torch's ``dist.ReduceOp`` (None: neither)."""
    try:
        return _OP_NAMES.get((op.__class__, op))
    except TypeError:  # unhashable
        return None


def tensor_op(op: Any) -> str:
    """Check a tensor reduction's name or torch ReduceOp (before any communication); its name."""
    name = op_name(op)
    if name is None:
        raise ValueError(f"op must be one of {', '.join(map(repr, TENSOR_OPS))} or torch's dist.ReduceOp "
                         f"SUM, AVG, MIN, MAX, PRODUCT, got {op!r}")
    return name


def tensor_problem(tensor: Any, op: str | None) -> str | None:
    """What makes ``tensor`` unfit for reduction ``op`` on any transport (None: nothing)."""
    if not isinstance(tensor, torch.Tensor):
        return f"got a {type(tensor).__name__}, not a tensor"
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        return f"op='mean' needs a floating point or complex tensor, got {tensor.dtype}"
    if op in ("min", "max") and tensor.is_complex():
        return f"op={op!r} is not defined for complex tensors ({tensor.dtype})"
    if op == "prod" and tensor.is_complex():  # (gloo refuses it, and NCCL has no complex types)
        return f"op='prod' is not supported for complex tensors ({tensor.dtype}): they are reduced as (re, im) pairs"
    return None


def folds_as_ring(dtype: torch.dtype, op: str | None) -> bool:
    """Whether a fold in rank order (``fold_tensors``) gives what gloo's ring reduction gives, but for
    a float sum's last bits (its additions in another order, the same on every rank). Not half
    precision (the ring rounds to it at each addition; a fold adds in float32 and rounds once), and
    not a max or min of floats: with a NaN among the values, the ring returns NaN or a value that
    depends on which rank holds the NaN (the largest of the ranks before it, say), which no fold
    reproduces."""
    return dtype not in (torch.float16, torch.bfloat16) and not (op in ("max", "min") and dtype.is_floating_point)


def fold_tensors(values: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Reduce equal-shaped tensors in rank order (``mean`` sums: the caller divides)."""
    stacked = torch.stack(list(values))
    if op in ("sum", "mean"):
        return stacked.sum(0, dtype=stacked.dtype)
    if op == "prod":
        return stacked.prod(0, dtype=stacked.dtype)
    return stacked.amin(0) if op == "min" else stacked.amax(0)


def _minimum(a: Any, b: Any) -> Any:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.minimum(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.minimum(a, b)
    return b if b < a else a


def _maximum(a: Any, b: Any) -> Any:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.maximum(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.maximum(a, b)
    return b if b > a else a


def _union(a: Any, b: Any) -> Any:
    if isinstance(a, (set, frozenset)) and isinstance(b, (set, frozenset)):
        return a | b
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return {**a, **b}  # a later rank's value wins for a key both hold
    raise TypeError(f"'union' needs sets or dicts, got {type(a).__name__} and {type(b).__name__}")


OBJECT_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "sum": operator.add,
    "min": _minimum,
    "max": _maximum,
    "any": lambda a, b: bool(a) or bool(b),
    "all": lambda a, b: bool(a) and bool(b),
    "union": _union,
}


def object_op(op: Any) -> tuple[str, Callable[[Any, Any], Any]]:
    """An object reduction's name and function: one of OBJECT_OPS, or any callable ``op(a, b)``."""
    if isinstance(op, str):
        if op not in OBJECT_OPS:
            raise ValueError(f"op must be a callable op(a, b) or one of {', '.join(map(repr, OBJECT_OPS))}, "
                             f"got {op!r}")
        return op, OBJECT_OPS[op]
    if not callable(op):
        raise TypeError(f"op must be a callable op(a, b) or an op name, got {type(op).__name__}")
    return getattr(op, "__name__", type(op).__name__), op


def fold_objects(objs: Sequence[Any], fn: Callable[[Any, Any], Any], *, prefixes: bool) -> list[Any]:
    """Fold in rank order: the whole reduction (a list of one), or every prefix's reduction.

    Raises FoldError naming the rank whose object the operator failed on.
    """
    out, acc = [], objs[0]
    if prefixes:
        out.append(acc)
    for r in range(1, len(objs)):
        try:
            acc = fn(acc, objs[r])
        except Exception as e:
            raise FoldError(r, f"{type(e).__name__}: {e}") from e
        if prefixes:
            out.append(acc)
    return out if prefixes else [acc]


class FoldError(Exception):
    def __init__(self, rank: int, text: str) -> None:
        super().__init__(text)
        self.rank = rank
