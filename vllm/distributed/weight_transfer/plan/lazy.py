# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A zero-storage stand-in for a checkpoint tensor that records what a weight
loader does to it.

`LazyWeight` answers metadata questions (shape, dtype, ``size()``, ``dim()``,
``numel()``) like the real tensor would. Each allowlisted view op
(`sharded_rdt_ops.VIEW_OPS`) returns a new `LazyWeight` whose chain has that op
appended; PyTorch computes the new geometry on a meta tensor, so nothing here
re-implements shape rules. ``dest.copy_(lazy)`` ends the chain: the
`CopyRecorder` writes down the slice and the destination region and moves no
data. Every other use of a `LazyWeight` raises `UnplannableLoaderError` naming the
checkpoint tensor, the parameter being loaded and the op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.overrides import get_default_nowrap_functions

from vllm.distributed.weight_transfer.plan.ops import (
    VIEW_OPS,
    OpChain,
    SliceSpec,
    ViewOp,
    dtype_name,
)
from vllm.distributed.weight_transfer.plan.worker_plan import Region, SliceCopy


class UnplannableLoaderError(NotImplementedError):
    """A weight loader did something to a checkpoint tensor that a sharded_rdt
    plan cannot express as a view of that tensor."""


def _view_functions() -> dict[Callable[..., Any], str]:
    table: dict[Callable[..., Any], str] = {}
    for name in VIEW_OPS:
        table[getattr(torch.Tensor, name)] = name
        function = getattr(torch, name, None)
        if callable(function) and name != "view":
            table[function] = name
    return table


_VIEW_FUNCTIONS = _view_functions()

# Functions that only read metadata; they run on the zero-storage wrapper as is.
_METADATA_FUNCTIONS: frozenset[Any] = frozenset(
    [
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.ndimension,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.stride,
        torch.Tensor.element_size,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.is_contiguous,
        torch.Tensor.__len__,
        torch.Tensor.__hash__,
        torch.Tensor.__format__,
        *(
            getattr(torch.Tensor, attr).__get__
            for attr in (
                "shape",
                "dtype",
                "device",
                "ndim",
                "layout",
                "is_meta",
                "is_cpu",
                "is_cuda",
                "is_sparse",
                "is_quantized",
                "requires_grad",
            )
        ),
    ]
)


def _flat_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Arguments plus the items of tuple/list arguments (index tuples, cat lists)."""
    flat: list[Any] = []
    for arg in (*args, *kwargs.values()):
        flat.append(arg)
        if isinstance(arg, (tuple, list)):
            flat.extend(arg)
    return flat


def _function_name(func: Any) -> str:
    """A readable name for a torch function: ``Tensor.float``, ``torch.cat``, or
    ``Tensor.data`` for an attribute read."""
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", None) == "__get__" and hasattr(owner, "__name__"):
        return f"Tensor.{owner.__name__} (attribute)"  # type: ignore[union-attr]
    name = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", func))
    for prefix, readable in (
        ("_TensorBase.", "Tensor."),
        ("TensorBase.", "Tensor."),
        ("_VariableFunctionsClass.", "torch."),
    ):
        if name.startswith(prefix):
            return readable + name.removeprefix(prefix)
    return name


@dataclass
class CopyRecorder:
    """Collects the copies that `LazyWeight`s end in.

    The bake sets ``target`` to ``(module name, parameter name, parameter)``
    around each parameter's weight loader, so every copy is attributed to the
    parameter whose loader made it.
    """

    copies: list[SliceCopy] = field(default_factory=list)
    target: tuple[str, str, torch.Tensor] | None = None
    # The checkpoint tensor handed to the running loader, for error messages.
    source: str | None = None

    def describe_target(self) -> str:
        if self.target is None:
            return "outside any parameter's weight_loader"
        module, param, _ = self.target
        text = f"loading {module + '.' if module else ''}{param}"
        return text if self.source is None else f"{text} from {self.source!r}"

    def record_copy(self, dest: torch.Tensor, src: LazyWeight) -> torch.Tensor:
        if self.target is None:
            raise UnplannableLoaderError(
                f"checkpoint tensor {src.source!r} is copied {self.describe_target()}"
                "; the plan cannot tell which parameter that copy fills. Load this "
                "model with a backend that sends whole tensors."
            )
        module, param_name, param = self.target
        if dest.numel() != src.numel():
            raise UnplannableLoaderError(
                f"checkpoint tensor {src.source!r} ({src.describe_chain()}, "
                f"{tuple(src.shape)}) is broadcast by copy_ into a region of "
                f"{tuple(dest.shape)} while {self.describe_target()}; a plan sends "
                "exactly the elements a region receives, so element counts must "
                "match"
            )
        region = Region(
            module=module,
            param=param_name,
            offset=int(dest.storage_offset() - param.storage_offset()),
            shape=tuple(dest.shape),
            stride=tuple(dest.stride()),
            dtype=dtype_name(dest.dtype),
        )
        last = region.last_element
        if last >= param.numel() or dest.dtype != param.dtype:
            raise UnplannableLoaderError(
                f"checkpoint tensor {src.source!r} is copied into a {region.dtype} "
                f"region ending at element {last} while {self.describe_target()}, "
                f"which holds {param.numel()} {dtype_name(param.dtype)} elements; "
                "the loader wrote into a tensor other than the parameter it was "
                "called for"
            )
        self.copies.append(SliceCopy(slice=src.slice_spec(), region=region))
        return dest


class LazyWeight(torch.Tensor):
    """A checkpoint tensor with geometry but no storage; see the module doc."""

    source: str
    chain: OpChain
    recorder: CopyRecorder | None

    @staticmethod
    def __new__(
        cls,
        source: str,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype,
        *,
        device: torch.device | str = "cpu",
        strides: tuple[int, ...] | None = None,
        chain: OpChain = (),
        recorder: CopyRecorder | None = None,
    ) -> LazyWeight:
        tensor = torch.Tensor._make_wrapper_subclass(
            cls,
            tuple(shape),
            strides=None if strides is None else tuple(strides),
            dtype=dtype,
            device=torch.device(device),
            requires_grad=False,
        )
        tensor.source = source
        tensor.chain = tuple(chain)
        tensor.recorder = recorder
        return tensor

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"LazyWeight({self.source!r}, shape={tuple(self.shape)}, "
            f"dtype={dtype_name(self.dtype)}, chain={self.describe_chain()!r})"
        )

    def describe_chain(self) -> str:
        return ".".join(str(op) for op in self.chain) or "no ops"

    def slice_spec(self) -> SliceSpec:
        return SliceSpec(
            source=self.source,
            chain=self.chain,
            shape=tuple(self.shape),
            dtype=dtype_name(self.dtype),
        )

    def _child(self, meta: torch.Tensor, op: ViewOp) -> LazyWeight:
        return LazyWeight(
            self.source,
            meta.shape,
            meta.dtype,
            device=self.device,
            strides=meta.stride(),
            chain=(*self.chain, op),
            recorder=self.recorder,
        )

    def _unplannable(self, what: str) -> UnplannableLoaderError:
        target = self.recorder.describe_target() if self.recorder else "outside a bake"
        return UnplannableLoaderError(
            f"cannot plan checkpoint tensor {self.source!r}: {what} "
            f"(after {self.describe_chain()}) while {target}. A sharded_rdt plan "
            f"can only hold the view ops {sorted(VIEW_OPS)} ending in copy_ into "
            "the parameter; casts (.to, .float), .item(), .data, arithmetic, "
            "boolean-mask indexing and in-place ops need the data itself. Load "
            "this model with a backend that sends whole tensors."
        )

    def _record_view(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> LazyWeight | tuple[LazyWeight, ...]:
        many = VIEW_OPS[name] == "many"
        try:
            # Validates every argument; tensors, dtypes and masks are refused here.
            op = ViewOp(name, args, tuple(kwargs.items()), pick=0 if many else None)
        except (TypeError, ValueError) as err:
            raise self._unplannable(
                f"Tensor.{name} gets an argument it cannot record: {err}"
            ) from None
        meta = torch.empty_strided(
            self.shape, self.stride(), dtype=self.dtype, device="meta"
        )
        result = getattr(torch.Tensor, name)(meta, *args, **kwargs)
        if not many:
            return self._child(result, op)
        return tuple(
            self._child(part, replace(op, pick=i)) for i, part in enumerate(result)
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            dest = args[0]
            src = args[1] if len(args) > 1 else kwargs.get("src")
            if isinstance(dest, LazyWeight):
                raise dest._unplannable("it is the destination of copy_")
            if isinstance(src, LazyWeight):
                if src.recorder is None:
                    raise src._unplannable("copy_ with no recorder attached")
                return src.recorder.record_copy(dest, src)

        lazies = [a for a in _flat_args(args, kwargs) if isinstance(a, LazyWeight)]
        if not lazies:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)

        name = _VIEW_FUNCTIONS.get(func)
        if name is not None and isinstance(args[0], LazyWeight) and len(lazies) == 1:
            return args[0]._record_view(name, tuple(args[1:]), kwargs)
        if func in _METADATA_FUNCTIONS or func in get_default_nowrap_functions():
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise lazies[0]._unplannable(f"the loader calls {_function_name(func)}")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        # Reached only by code that bypasses __torch_function__; still refuse.
        lazy = next(
            a for a in (*args, *(kwargs or {}).values()) if isinstance(a, LazyWeight)
        )
        raise lazy._unplannable(f"the aten op {func} reached the data")
