# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the served tensors a landing writes lived when its views were cut,
and whether they still live there."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.weight_transfer.plan.ops import tensor_place

Target = tuple[Any, str, torch.Tensor]  # (module, parameter name, tensor)


@dataclass
class RecordsPlaces:
    """A landing dataclass's record of its targets' ``tensor_place`` when the
    views into them were cut."""

    _bound_places: list[tuple] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    def record_places(self, targets: Iterable[Target]) -> None:
        self._bound_places = [tensor_place(t) for _, _, t in targets]

    def places_unchanged(self, targets: Iterable[Target]) -> bool:
        return [tensor_place(t) for _, _, t in targets] == self._bound_places
