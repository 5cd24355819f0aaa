# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The view ops a sharded_rdt plan may contain, and the replayer that applies them.

A worker learns which bytes of a checkpoint tensor it consumes by recording what its
weight loaders do to a lazy stand-in (`sharded_rdt_lazy`). What they do is written
down as a chain of `ViewOp`s; a `SliceSpec` names the source tensor, the chain and
the geometry the chain must produce. The producer that owns the real tensor calls
`replay_slice` to cut exactly that slice, so recorder and replayer share one
allowlist, `VIEW_OPS`, defined here and nowhere else.

Every op in `VIEW_OPS` selects or rearranges elements without computing new
values, so a replayed slice holds the checkpoint's bits unchanged. `contiguous` is
the one op that copies; it still produces the same values in the same logical
order. Casts (`to`, `float`), arithmetic and data-dependent indexing are not
allowed: the worker would otherwise depend on the producer repeating a
computation bit-for-bit.

Everything here is plain data or a pure function over real tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from math import prod
from types import EllipsisType
from typing import Any, TypeAlias

import torch

from vllm.distributed.weight_transfer.common.wire_fields import (
    dtype_from_name,
    dtype_name,
)
from vllm.distributed.weight_transfer.plan.json_record import JsonRecord, decode_each

# Name of each allowlisted op -> how many tensors it returns ("one" or "many").
VIEW_OPS: Mapping[str, str] = {
    "narrow": "one",
    "view": "one",
    "reshape": "one",
    "__getitem__": "one",
    "unsqueeze": "one",
    "squeeze": "one",
    "transpose": "one",
    "t": "one",
    "permute": "one",
    "flatten": "one",
    "contiguous": "one",
    "chunk": "many",
    "unbind": "many",
}


@dataclass(frozen=True)
class Span:
    """A Python ``slice`` as hashable, JSON-safe data (``slice`` is unhashable
    before Python 3.12)."""

    start: int | None = None
    stop: int | None = None
    step: int | None = None

    def to_slice(self) -> slice:
        return slice(self.start, self.stop, self.step)


# Arguments an op may take: dims, sizes, offsets and indices. Tensors, dtypes and
# memory formats are deliberately absent.
OpArg: TypeAlias = "int | None | EllipsisType | Span | tuple[OpArg, ...]"


def freeze_arg(value: Any, *, where: str) -> OpArg:
    """Turn a Python argument of a view op into an `OpArg`, or raise."""
    if value is None or value is Ellipsis:
        return value
    if isinstance(value, bool):
        raise TypeError(f"{where}: boolean argument {value!r} is not a view index")
    if isinstance(value, int):
        return int(value)
    if isinstance(value, slice):
        for part in (value.start, value.stop, value.step):
            if part is not None and (
                isinstance(part, bool) or not isinstance(part, int)
            ):
                raise TypeError(f"{where}: slice bound {part!r} is not an int")
        return Span(value.start, value.stop, value.step)
    if isinstance(value, Span):
        return value
    if isinstance(value, (tuple, list, torch.Size)):
        return tuple(freeze_arg(v, where=where) for v in value)
    raise TypeError(
        f"{where}: argument {value!r} of type {type(value).__name__} is not "
        "allowed; view ops take ints, slices, None, Ellipsis and tuples of those"
    )


def _thaw_arg(value: OpArg) -> Any:
    if isinstance(value, Span):
        return value.to_slice()
    if isinstance(value, tuple):
        return tuple(_thaw_arg(v) for v in value)
    return value


@dataclass(frozen=True)
class ViewOp:
    """One allowlisted op: ``getattr(tensor, name)(*args, **kwargs)``, then
    ``[pick]`` for ops that return several tensors (``chunk``, ``unbind``)."""

    name: str
    args: tuple[OpArg, ...] = ()
    kwargs: tuple[tuple[str, OpArg], ...] = ()
    pick: int | None = None

    def __post_init__(self) -> None:
        arity = VIEW_OPS.get(self.name)
        if arity is None:
            raise ValueError(
                f"op {self.name!r} is not a sharded_rdt view op; allowed: "
                f"{sorted(VIEW_OPS)}"
            )
        if (arity == "many") != (self.pick is not None):
            raise ValueError(
                f"op {self.name!r} returns {arity} tensor(s) but pick={self.pick!r}; "
                "chunk/unbind need the index of the output they keep, others none"
            )
        where = f"op {self.name!r}"
        object.__setattr__(self, "args", freeze_arg(tuple(self.args), where=where))
        object.__setattr__(
            self,
            "kwargs",
            tuple(sorted((str(k), freeze_arg(v, where=where)) for k, v in self.kwargs)),
        )

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        """Apply this op to a real tensor. Uses the plain ``torch.Tensor`` method,
        so a tensor subclass cannot substitute its own behaviour."""
        if VIEW_OPS.get(self.name) is None:  # guards objects built around __init__
            raise ValueError(f"op {self.name!r} is not a sharded_rdt view op")
        method = getattr(torch.Tensor, self.name)
        args = [_thaw_arg(a) for a in self.args]
        kwargs = {k: _thaw_arg(v) for k, v in self.kwargs}
        out = method(tensor, *args, **kwargs)
        if self.pick is not None:
            out = out[self.pick]
        return out

    def __str__(self) -> str:
        parts = [_format_arg(a) for a in self.args]
        parts += [f"{k}={_format_arg(v)}" for k, v in self.kwargs]
        text = f"{self.name}({', '.join(parts)})"
        if self.name == "__getitem__":
            text = f"[{', '.join(parts)}]"
        return text if self.pick is None else f"{text}[{self.pick}]"

    def to_json(self) -> list[Any]:
        return [
            self.name,
            [_arg_to_json(a) for a in self.args],
            [[k, _arg_to_json(v)] for k, v in self.kwargs],
            self.pick,
        ]

    @classmethod
    def from_json(cls, data: list[Any]) -> ViewOp:
        name, args, kwargs, pick = data
        return cls(
            name=name,
            args=tuple(_arg_from_json(a) for a in args),
            kwargs=tuple((k, _arg_from_json(v)) for k, v in kwargs),
            pick=pick,
        )


OpChain: TypeAlias = tuple[ViewOp, ...]


def _format_arg(value: OpArg) -> str:
    if isinstance(value, Span):
        text = ":".join("" if p is None else str(p) for p in (value.start, value.stop))
        return text if value.step is None else f"{text}:{value.step}"
    if value is Ellipsis:
        return "..."
    if isinstance(value, tuple):
        return "(" + ", ".join(_format_arg(v) for v in value) + ")"
    return repr(value)


def _arg_to_json(value: OpArg) -> Any:
    if isinstance(value, Span):
        return {"slice": [value.start, value.stop, value.step]}
    if value is Ellipsis:
        return {"ellipsis": True}
    if isinstance(value, tuple):
        return {"tuple": [_arg_to_json(v) for v in value]}
    return value


def _arg_from_json(value: Any) -> OpArg:
    if isinstance(value, dict):
        if "slice" in value:
            return Span(*value["slice"])
        if "ellipsis" in value:
            return Ellipsis
        if "tuple" in value:
            return tuple(_arg_from_json(v) for v in value["tuple"])
        raise ValueError(f"unknown op argument encoding {value!r}")
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ValueError(f"op argument {value!r} is not an int, None or encoded object")


def replay(tensor: torch.Tensor, chain: Iterable[ViewOp]) -> torch.Tensor:
    """Apply ``chain`` to ``tensor`` in order and return the result."""
    for op in chain:
        tensor = op.apply(tensor)
    return tensor


class ShapedTensor:
    """``numel`` and ``nbytes`` of a tensor described by ``shape`` and a dtype
    name; the dataclasses that inherit it declare both fields."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True)
class SliceSpec(ShapedTensor, JsonRecord):
    """One slice a worker consumes: checkpoint tensor ``source`` after ``chain``.

    ``shape`` and ``dtype`` are what the chain produces from a source of the
    planned geometry; ``replay_slice`` checks both, so a producer whose tensor does
    not match the worker's view of the checkpoint fails instead of sending other
    bytes.
    """

    source: str
    chain: OpChain
    shape: tuple[int, ...]
    dtype: str

    json_decoders = {"chain": decode_each(ViewOp.from_json)}

    def __post_init__(self) -> None:
        object.__setattr__(self, "chain", tuple(self.chain))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        dtype_from_name(self.dtype)
        if any(s < 0 for s in self.shape):
            raise ValueError(f"slice of {self.source!r} has shape {self.shape}")

    def describe(self) -> str:
        ops = ".".join(str(op) for op in self.chain)
        return repr(self.source) + (f" -> {ops}" if ops else "")


def replay_slice(tensor: torch.Tensor, spec: SliceSpec) -> torch.Tensor:
    """Cut ``spec``'s slice out of ``tensor`` (the real ``spec.source``)."""
    out = replay(tensor, spec.chain)
    if tuple(out.shape) != spec.shape or dtype_name(out.dtype) != spec.dtype:
        raise ValueError(
            f"replaying {spec.describe()} on a {dtype_name(tensor.dtype)} tensor of "
            f"shape {tuple(tensor.shape)} gave {dtype_name(out.dtype)} "
            f"{tuple(out.shape)}, but the plan expects {spec.dtype} {spec.shape}; "
            "the producer's tensor does not match the metadata the plan was "
            "baked from"
        )
    return out


def replay_slices(
    tensors: Mapping[str, torch.Tensor], specs: Iterable[SliceSpec]
) -> Iterator[torch.Tensor]:
    """Yield the slice of each spec, in order, cut from ``tensors[spec.source]``."""
    for spec in specs:
        tensor = tensors.get(spec.source)
        if tensor is None:
            raise KeyError(
                f"no tensor named {spec.source!r} to replay {spec.describe()}; "
                "the producer must hold every source the plan names"
            )
        yield replay_slice(tensor, spec)


# Integer dtypes by item size: bit-for-bit comparisons view floats as these
# (``torch.equal`` on floats treats -0.0 as 0.0 and a NaN as unequal).
_BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_pattern(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed as integers of its element size when it holds
    floats, for bit-for-bit comparisons; other tensors as they are."""
    if tensor.is_floating_point() and tensor.element_size() in _BITS_OF_SIZE:
        return tensor.view(_BITS_OF_SIZE[tensor.element_size()])
    return tensor


def tensor_place(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Where ``tensor``'s elements are: its address, shape and strides. The
    same tensor object after ``param.data = ...``, ``Module.to`` or
    ``torch.utils.swap_tensors`` answers differently, so a binding that
    recorded it can tell its views were cut from memory no longer served."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride()
