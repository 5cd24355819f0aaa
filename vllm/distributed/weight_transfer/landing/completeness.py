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
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from vllm.distributed.weight_transfer.common.wire_fields import first_few

_EXPERT_NAME_RE = re.compile(
    r"(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)\.(?P<leaf>[^.]+)"
)
_EXPERT_PROJECTIONS: tuple[frozenset[str], ...] = (
    frozenset({"gate_proj", "up_proj", "down_proj"}),
    frozenset({"w1", "w2", "w3"}),
)
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


# ``FusedGroups.of``'s last answer per model.
_GROUPS_OF: weakref.WeakKeyDictionary[object, FusedGroups] = weakref.WeakKeyDictionary()


class IncompleteUpdateError(ValueError):
    """An update carried some members of a fused group but not all."""


@dataclass(frozen=True)
class FusedGroups:
    """The fused groups of one model, as checkpoint-name rules."""

    # member module name -> every member of its group (e.g. q_proj -> q,k,v)
    siblings: Mapping[str, tuple[str, ...]]
    # experts per MoE layer, 0 when the model has none
    num_experts: int
    # The last set of names ``check`` passed: a sync usually carries the
    # same names as the one before, and the answer depends on names alone.
    _passed: list[set[str]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    @classmethod
    def of(cls, model: object, hf_config: object | None) -> FusedGroups:
        """The groups of ``model`` (read each time; the object of an earlier
        call when they are equal, so its memo of passed names carries over)."""
        groups = cls.read(model, hf_config)
        try:
            kept = _GROUPS_OF.get(model)
        except TypeError:  # not weakly referable
            return groups
        if kept == groups:
            return kept
        _GROUPS_OF[model] = groups
        return groups

    @classmethod
    def read(cls, model: object, hf_config: object | None) -> FusedGroups:
        """The groups of ``model``, read from its class and ``hf_config``."""
        mapping = getattr(model, "packed_modules_mapping", None) or {}
        siblings: dict[str, tuple[str, ...]] = {}
        for members in mapping.values():
            group = tuple(members)
            if len(group) > 1:
                for member in group:
                    siblings[member] = group
        num_experts = 0
        for count_field in _EXPERT_COUNT_FIELDS:
            value = getattr(hf_config, count_field, None)
            if isinstance(value, int) and value > 0:
                num_experts = value
                break
        return cls(siblings, num_experts)

    def group_of(self, name: str) -> tuple[str, ...]:
        """Every checkpoint name ``name`` must travel with (itself included)."""
        expert = self._expert_key(name)
        if expert is not None:
            (prefix, leaf, projections), _ = expert
            return tuple(
                f"{prefix}.{e}.{proj}.{leaf}"
                for e in range(self.num_experts)
                for proj in sorted(projections)
            )
        return self._module_group(name)

    def missing(self, names: Iterable[str]) -> dict[str, list[str]]:
        """Per touched group (named by its first member), the members that
        ``names`` lacks; empty when every touched group is whole.

        Linear in the number of names: expert names are counted per MoE
        layer (a layer is whole when all ``num_experts`` x projections are
        there), and a layer's member list is built only when it is not."""
        received = set(names)
        out: dict[str, list[str]] = {}
        seen_groups: set[tuple[str, ...]] = set()
        experts: dict[tuple[str, str, frozenset[str]], set[tuple[int, str]]] = {}
        for name in received:
            expert = self._expert_key(name)
            if expert is not None:
                key, member = expert
                experts.setdefault(key, set()).add(member)
                continue
            group = self._module_group(name)
            if len(group) == 1 or group in seen_groups:
                continue
            seen_groups.add(group)
            lacking = [member for member in group if member not in received]
            if lacking:
                out[group[0]] = lacking
        for (prefix, leaf, projections), members in experts.items():
            in_range = sum(1 for e, _ in members if e < self.num_experts)
            if in_range == self.num_experts * len(projections):
                continue
            order = sorted(projections)
            out[f"{prefix}.0.{order[0]}.{leaf}"] = [
                f"{prefix}.{e}.{proj}.{leaf}"
                for e in range(self.num_experts)
                for proj in order
                if (e, proj) not in members
            ]
        return out

    def _expert_key(
        self, name: str
    ) -> tuple[tuple[str, str, frozenset[str]], tuple[int, str]] | None:
        """``((layer prefix, leaf, projections), (expert, projection))`` for a
        per-expert checkpoint name of a MoE model, else None."""
        if self.num_experts <= 0:
            return None
        match = _EXPERT_NAME_RE.fullmatch(name)
        if match is None:
            return None
        projections = next((p for p in _EXPERT_PROJECTIONS if match["proj"] in p), None)
        if projections is None:
            return None
        return (match["prefix"], match["leaf"], projections), (
            int(match["expert"]),
            match["proj"],
        )

    def _module_group(self, name: str) -> tuple[str, ...]:
        """The members of ``name``'s fused module group (itself if unfused)."""
        module_path, _, leaf = name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        group = self.siblings.get(module)
        if group is None or not parent:
            return (name,)
        return tuple(f"{parent}.{member}.{leaf}" for member in group)

    def check(self, names: Iterable[str], what: str = "the update") -> None:
        """Raise ``IncompleteUpdateError`` naming every incomplete group."""
        names = set(names)
        if self._passed and names == self._passed[0]:
            return
        missing = self.missing(names)
        if missing:
            raise IncompleteUpdateError(describe_missing(missing, what))
        self._passed[:] = [names]


def partly_written(
    writers: Mapping[str, frozenset[str]], received: set[str]
) -> list[str]:
    """``"<layer> (lacks <names>)"`` for each layer of ``writers`` (layer ->
    the names that write it) that ``received`` writes only partly, sorted."""
    return sorted(
        f"{layer} (lacks {', '.join(sorted(names - received)[:3])})"
        for layer, names in writers.items()
        if names & received and not names <= received
    )


def layers_lacking(lacking: Sequence[str], layers: int) -> IncompleteUpdateError:
    """The error for an update that touches ``layers`` layer(s) without all
    of their tensors (``lacking``: the tensors missing, by name)."""
    return IncompleteUpdateError(
        f"the update touches {layers} layer(s) without all of their "
        f"parameters; it lacks {first_few(lacking, 6)}. vLLM rebuilds a layer "
        "from the tensors an update carries, so an update must carry "
        "every tensor of each layer it touches (send them at their "
        "current values where they did not change)"
    )


def describe_missing(missing: Mapping[str, Sequence[str]], what: str) -> str:
    parts = []
    for first, lacking in sorted(missing.items()):
        parts.append(f"the group of {first!r} lacks {first_few(lacking, 4)}")
    return (
        f"{what} carries only part of {len(missing)} fused tensor group(s): "
        + "; ".join(parts)
        + ". vLLM fuses these checkpoint tensors into one kernel tensor, so an "
        "update must carry every member of each group it touches (send the "
        "whole group, at its current values where it did not change)."
    )
