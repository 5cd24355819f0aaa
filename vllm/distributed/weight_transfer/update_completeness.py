# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which checkpoint tensors an update must carry together.

vLLM fuses several checkpoint tensors into one kernel tensor: ``q_proj``,
``k_proj`` and ``v_proj`` into ``qkv_proj``, ``gate_proj`` and ``up_proj`` into
``gate_up_proj``, every expert's projections into a MoE layer's ``w13`` and
``w2``. A layer is rebuilt from the tensors an update carries, so an update
that carries only some members of a fused group would leave the rest of the
kernel tensor without a defined value. The rule the worker enforces: an update
may carry any subset of the model's tensors, as long as it carries every
member of each fused group it touches.

``FusedGroups.of(model, hf_config)`` reads the groups from the model class's
``packed_modules_mapping`` and the MoE expert count in its Hugging Face
config; ``missing(names)`` lists what a set of checkpoint names lacks. Pure
functions of names: no tensor is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

_EXPERT_NAME_RE = re.compile(
    r"(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)\.(?P<leaf>[^.]+)"
)
_EXPERT_PROJECTIONS: tuple[frozenset[str], ...] = (
    frozenset({"gate_proj", "up_proj", "down_proj"}),
    frozenset({"w1", "w2", "w3"}),
)
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


class IncompleteUpdateError(ValueError):
    """An update carried some members of a fused group but not all."""


@dataclass(frozen=True)
class FusedGroups:
    """The fused groups of one model, as checkpoint-name rules."""

    # member module name -> every member of its group (e.g. q_proj -> q,k,v)
    siblings: Mapping[str, tuple[str, ...]]
    # experts per MoE layer, 0 when the model has none
    num_experts: int

    @classmethod
    def of(cls, model: object, hf_config: object | None) -> FusedGroups:
        mapping = getattr(model, "packed_modules_mapping", None) or {}
        siblings: dict[str, tuple[str, ...]] = {}
        for members in mapping.values():
            group = tuple(members)
            if len(group) > 1:
                for member in group:
                    siblings[member] = group
        num_experts = 0
        for field in _EXPERT_COUNT_FIELDS:
            value = getattr(hf_config, field, None)
            if isinstance(value, int) and value > 0:
                num_experts = value
                break
        return cls(siblings, num_experts)

    def group_of(self, name: str) -> tuple[str, ...]:
        """Every checkpoint name ``name`` must travel with (itself included)."""
        match = _EXPERT_NAME_RE.fullmatch(name)
        if match is not None and self.num_experts > 0:
            projections = next(
                (p for p in _EXPERT_PROJECTIONS if match["proj"] in p), None
            )
            if projections is not None:
                return tuple(
                    f"{match['prefix']}.{e}.{proj}.{match['leaf']}"
                    for e in range(self.num_experts)
                    for proj in sorted(projections)
                )
        module_path, _, leaf = name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        group = self.siblings.get(module)
        if group is None or not parent:
            return (name,)
        return tuple(f"{parent}.{member}.{leaf}" for member in group)

    def missing(self, names: Iterable[str]) -> dict[str, list[str]]:
        """Per touched group (named by its first member), the members that
        ``names`` lacks; empty when every touched group is whole."""
        received = set(names)
        seen_groups: set[tuple[str, ...]] = set()
        out: dict[str, list[str]] = {}
        for name in received:
            group = self.group_of(name)
            if len(group) == 1 or group in seen_groups:
                continue
            seen_groups.add(group)
            lacking = [member for member in group if member not in received]
            if lacking:
                out[group[0]] = lacking
        return out

    def check(self, names: Iterable[str], what: str = "the update") -> None:
        """Raise ``IncompleteUpdateError`` naming every incomplete group."""
        missing = self.missing(names)
        if missing:
            raise IncompleteUpdateError(describe_missing(missing, what))


def describe_missing(missing: Mapping[str, Sequence[str]], what: str) -> str:
    parts = []
    for first, lacking in sorted(missing.items()):
        shown = ", ".join(lacking[:4])
        more = f" and {len(lacking) - 4} more" if len(lacking) > 4 else ""
        parts.append(f"the group of {first!r} lacks {shown}{more}")
    return (
        f"{what} carries only part of {len(missing)} fused tensor group(s): "
        + "; ".join(parts)
        + ". vLLM fuses these checkpoint tensors into one kernel tensor, so an "
        "update must carry every member of each group it touches (send the "
        "whole group, at its current values where it did not change)."
    )
