# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A worker's sharded_rdt plan as plain data.

The plan says, for one inference worker, which slice of which checkpoint tensor
fills which region of which parameter. It holds no tensors and no module objects:
anyone can print it (`WorkerPlan.dump`), compare it (`WorkerPlan.digest`), send it
as JSON (`to_json` / `from_json`) or size buffers from it (`nbytes`).

Shape of a plan::

    WorkerPlan
      groups: GatherGroup per `layerwise_groups` group of the checkpoint names
              (embeddings before the layers, one per decoder layer, head after)
        copies: SliceCopy = SliceSpec (what to cut) + Region (where it lands)
        completes: modules whose last region lands in this group
      unused_names: checkpoint names this worker's loaders never copy
      partial_modules: modules only part of whose loadable elements are covered

`build_plan` is a pure function from recorded copies to a plan. Recording them
(`sharded_rdt_bake`) and moving the bytes (a transport) live elsewhere.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from math import prod
from typing import Any

from vllm.distributed.weight_transfer.base import layerwise_groups
from vllm.distributed.weight_transfer.plan.json_record import JsonRecord, decode_each
from vllm.distributed.weight_transfer.plan.ops import SliceSpec, dtype_from_name


@dataclass(frozen=True)
class Region(JsonRecord):
    """A strided region of one parameter (or buffer) of one module, in the
    checkpoint format the model's loaders write (before any kernel repacking)."""

    module: str
    param: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "stride", tuple(int(s) for s in self.stride))
        dtype_from_name(self.dtype)
        if len(self.shape) != len(self.stride):
            raise ValueError(
                f"region {self.qualname} has shape {self.shape} but stride "
                f"{self.stride}; they need one entry per dimension"
            )
        if self.offset < 0:
            raise ValueError(f"region {self.qualname} has offset {self.offset}")

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.param}" if self.module else self.param

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def last_element(self) -> int:
        """Index of the last element the region touches, counted from the start
        of its tensor (``offset - 1`` for an empty region)."""
        if self.numel == 0:
            return self.offset - 1
        return self.offset + sum(
            (size - 1) * stride
            for size, stride in zip(self.shape, self.stride, strict=True)
        )


@dataclass(frozen=True)
class SliceCopy(JsonRecord):
    """Land ``slice`` in ``region`` (``region.copy_(slice)``; equal element counts,
    dtype converted by the copy as the model's own loader would)."""

    slice: SliceSpec
    region: Region

    json_decoders = {"slice": SliceSpec.from_json, "region": Region.from_json}

    def __post_init__(self) -> None:
        if self.slice.numel != self.region.numel:
            raise ValueError(
                f"{self.slice.describe()} has {self.slice.numel} elements but its "
                f"region {self.region.qualname} {self.region.shape} has "
                f"{self.region.numel}"
            )


@dataclass(frozen=True)
class ParamCoverage:
    param: str
    covered: int
    expected: int


@dataclass(frozen=True)
class PartialModule:
    """A module whose recorded regions cover fewer elements than its loaders
    normally fill. Landing only the planned regions would leave the rest stale."""

    module: str
    covered: int
    expected: int
    params: tuple[ParamCoverage, ...]

    def describe(self) -> str:
        params = ", ".join(f"{p.param} {p.covered}/{p.expected}" for p in self.params)
        return f"{self.module}: {self.covered}/{self.expected} elements ({params})"


@dataclass(frozen=True)
class GatherGroup(JsonRecord):
    """The copies fed by one gather group of checkpoint names.

    ``index`` is the group's position in `layerwise_groups` over the full
    checkpoint name list, the same index the trainer gathers and frees by; a group
    this worker needs nothing from is kept, with no copies, so indices line up.
    """

    index: int
    names: tuple[str, ...]
    copies: tuple[SliceCopy, ...]
    completes: tuple[str, ...]

    json_decoders = {"copies": decode_each(SliceCopy.from_json)}

    @property
    def slices(self) -> tuple[SliceSpec, ...]:
        """Distinct slices to fetch, in first-use order."""
        return tuple(dict.fromkeys(c.slice for c in self.copies))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slices)


@dataclass(frozen=True)
class WorkerPlan:
    """Everything one worker pulls and where it lands. ``worker`` is a label for
    logs and dumps; it is not part of the digest, so two workers that consume the
    same bytes into the same regions share a digest."""

    worker: str
    groups: tuple[GatherGroup, ...]
    unused_names: tuple[str, ...] = ()
    partial_modules: tuple[PartialModule, ...] = ()

    def __post_init__(self) -> None:
        for position, group in enumerate(self.groups):
            if group.index != position:
                raise ValueError(
                    f"plan group at position {position} has index {group.index}; "
                    "groups must be listed in index order"
                )

    @property
    def copies(self) -> tuple[SliceCopy, ...]:
        return tuple(c for g in self.groups for c in g.copies)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    def bytes_by_source(self) -> dict[str, int]:
        """Bytes this worker fetches from each checkpoint tensor."""
        out: dict[str, int] = {}
        for group in self.groups:
            for spec in group.slices:
                out[spec.source] = out.get(spec.source, 0) + spec.nbytes
        return out

    def _content_json(self) -> dict[str, Any]:
        return {
            "groups": [g.to_json() for g in self.groups],
            "unused_names": list(self.unused_names),
            "partial_modules": [
                {
                    "module": p.module,
                    "covered": p.covered,
                    "expected": p.expected,
                    "params": [[c.param, c.covered, c.expected] for c in p.params],
                }
                for p in self.partial_modules
            ],
        }

    def digest(self) -> str:
        """sha256 (32 hex chars) of the plan's content in canonical JSON."""
        payload = json.dumps(
            self._content_json(), sort_keys=True, separators=(",", ":")
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:32]

    def to_json(self) -> dict[str, Any]:
        return {"worker": self.worker, **self._content_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkerPlan:
        return cls(
            worker=data["worker"],
            groups=tuple(GatherGroup.from_json(g) for g in data["groups"]),
            unused_names=tuple(data["unused_names"]),
            partial_modules=tuple(
                PartialModule(
                    module=p["module"],
                    covered=p["covered"],
                    expected=p["expected"],
                    params=tuple(ParamCoverage(*c) for c in p["params"]),
                )
                for p in data["partial_modules"]
            ),
        )

    def dump(self) -> str:
        """A readable listing: one line per copy, grouped, with byte counts."""
        n_slices = sum(len(g.slices) for g in self.groups)
        lines = [
            f"sharded_rdt plan for {self.worker}: digest {self.digest()}, "
            f"{len(self.groups)} groups, {n_slices} slices, "
            f"{_format_bytes(self.nbytes)}"
        ]
        for group in self.groups:
            lines.append(
                f"group {group.index}: {len(group.names)} names, "
                f"{len(group.slices)} slices, {_format_bytes(group.nbytes)}"
            )
            for copy in group.copies:
                region = copy.region
                lines.append(
                    f"  {copy.slice.describe()} {list(copy.slice.shape)} "
                    f"{copy.slice.dtype} => {region.qualname}"
                    f"[offset {region.offset}, shape {list(region.shape)}, "
                    f"stride {list(region.stride)}] {region.dtype}"
                )
            if group.completes:
                lines.append(f"  completes: {', '.join(group.completes)}")
        if self.unused_names:
            lines.append(f"not needed on this worker: {', '.join(self.unused_names)}")
        for partial in self.partial_modules:
            lines.append(f"PARTLY COVERED {partial.describe()}")
        return "\n".join(lines)


def _format_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 1024**2:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 1024**2:.2f} MiB"


def build_plan(
    *,
    worker: str,
    names: Sequence[str],
    copies: Iterable[SliceCopy],
    partial_modules: Iterable[PartialModule] = (),
) -> WorkerPlan:
    """Group recorded copies by the gather group of their source name.

    ``names`` is the full checkpoint name list in the producer's order; it fixes
    the groups. ``copies`` are in recording order, which is kept within a group:
    when two copies touch the same elements, the later one wins, as it did in the
    loader.
    """
    groups = layerwise_groups(list(names))
    group_of = {name: gi for gi, group in enumerate(groups) for name in group}
    if len(group_of) != len(names):
        raise ValueError("checkpoint names contain duplicates")
    per_group: list[list[SliceCopy]] = [[] for _ in groups]
    copied: set[str] = set()
    for copy in copies:
        gi = group_of.get(copy.slice.source)
        if gi is None:
            raise ValueError(
                f"a copy reads {copy.slice.source!r}, which is not among the "
                f"{len(names)} checkpoint names the plan is built for"
            )
        per_group[gi].append(copy)
        copied.add(copy.slice.source)

    last_group: dict[str, int] = {}
    for gi, group_copies in enumerate(per_group):
        for copy in group_copies:
            last_group[copy.region.module] = gi
    completes: list[list[str]] = [[] for _ in groups]
    for module, gi in last_group.items():
        completes[gi].append(module)

    return WorkerPlan(
        worker=worker,
        groups=tuple(
            GatherGroup(
                index=gi,
                names=tuple(group),
                copies=tuple(per_group[gi]),
                completes=tuple(completes[gi]),
            )
            for gi, group in enumerate(groups)
        ),
        unused_names=tuple(n for n in names if n not in copied),
        partial_modules=tuple(partial_modules),
    )


def with_direct_copies(
    plan: WorkerPlan, names: Sequence[str], copies: Iterable[SliceCopy]
) -> WorkerPlan:
    """``plan`` plus ``copies`` whose bytes go straight into served tensors,
    with no loader and no per-module processing after them (trainer-side FP8
    codes). The copies are grouped with the rest by their source over
    ``names``, the trainer's full name list, and the modules they write are
    in no group's ``completes``, so nothing processes them. A module written
    by both kinds of copy is refused: its processing would redo what the
    direct copies wrote."""
    direct = list(copies)
    written = {c.region.module for c in direct}
    both = written & {c.region.module for c in plan.copies}
    if both:
        raise ValueError(
            f"{len(both)} module(s) would take both processed and direct copies: "
            f"{sorted(both)[:3]}"
        )
    merged = build_plan(
        worker=plan.worker,
        names=names,
        copies=[*plan.copies, *direct],
        partial_modules=plan.partial_modules,
    )
    return leaving_unprocessed(merged, written)


def leaving_unprocessed(plan: WorkerPlan, modules: Iterable[str]) -> WorkerPlan:
    """``plan`` with ``modules`` in no group's ``completes``: their copies
    still land, but nothing materializes or processes them around it (their
    bytes go straight into the served tensors)."""
    skip = set(modules)
    if not skip:
        return plan
    return replace(
        plan,
        groups=tuple(
            replace(g, completes=tuple(m for m in g.completes if m not in skip))
            for g in plan.groups
        ),
    )
