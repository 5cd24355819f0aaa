# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``ipc`` trainer's walk of a weight source in metadata order, one
tensor alive at a time, each checked against what ``metadata()`` announced
(``_SourceCursor``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    ParamMeta,
    WeightSource,
    materialize_full_tensor,
)
from vllm.distributed.weight_transfer.ipc.wire import dtype_name
from vllm.distributed.weight_transfer.trainer.sharded_gather import is_sharded
from vllm.logger import init_logger

logger = init_logger(__name__)


def _check_yielded(meta: ParamMeta, name: str, tensor: Any) -> torch.Tensor:
    """``tensor`` as the metadata announced it, or ValueError naming it."""
    if name != meta.name:
        raise ValueError(
            f"WeightSource yielded {name!r} where metadata() announced "
            f"{meta.name!r}; iteration must follow metadata() order"
        )
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(
            f"WeightSource yielded {type(tensor).__name__} for {name!r}, not a tensor"
        )
    if tensor.dtype != meta.dtype:
        raise ValueError(
            f"WeightSource yielded {name!r} as {dtype_name(tensor.dtype)} but "
            f"metadata() says {dtype_name(meta.dtype)}"
        )
    shape = meta.shape
    if tensor.shape != (shape if isinstance(shape, tuple) else tuple(shape)):
        raise ValueError(
            f"WeightSource yielded {name!r} with shape {list(tensor.shape)} but "
            f"metadata() says {list(meta.shape)}"
        )
    return tensor


class _SourceCursor:
    """Walks a source in metadata order, one tensor alive at a time.

    A ``ModuleSource``'s parameters are walked as they are, so a sharded one
    (a DTensor) reaches ``next_unmaterialized`` still sharded, for a packer
    that gathers it straight into its slot; ``next`` gathers it as the
    source's own iteration would (``full_tensor()``), at the same point of
    the walk."""

    def __init__(self, source: WeightSource, metas: list[ParamMeta]) -> None:
        self._it: Iterator[tuple[str, torch.Tensor]] = _unmaterialized(source)
        self._metas = metas
        self._index = 0

    def next(self) -> torch.Tensor:
        tensor = self.next_unmaterialized()
        return materialize_full_tensor(tensor) if is_sharded(tensor) else tensor

    def next_unmaterialized(self) -> torch.Tensor:
        meta = self._metas[self._index]
        try:
            name, tensor = next(self._it)
        except StopIteration:
            raise ValueError(
                f"WeightSource stopped before {meta.name!r}; metadata() announced "
                f"{len(self._metas)} tensors, iteration gave {self._index}"
            ) from None
        self._index += 1
        return _check_yielded(meta, name, tensor)

    def finish(self) -> None:
        try:
            name, _ = next(self._it)
        except StopIteration:
            return
        raise ValueError(
            f"WeightSource yielded {name!r} after the {len(self._metas)} tensors "
            "metadata() announced"
        )


def _unmaterialized(source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    """``source``'s items, with a ``ModuleSource``'s DTensors left sharded
    (its iteration would gather each into a new tensor); any other source's
    items as it yields them."""
    module = vars(source).get("_module") if type(source) is ModuleSource else None
    if isinstance(module, torch.nn.Module):
        return iter(module.named_parameters())
    return iter(source)
