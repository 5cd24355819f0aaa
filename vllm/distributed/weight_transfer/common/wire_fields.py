# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checks for the fields of the fork's wire messages, shared by every module
that parses them (``ipc_wire``, ``verification.wire``, ``sharded_rdt_common``):
dtype names, integers, and which fields a message may and must carry. Each
raises ``ValueError`` naming where the bad value was found. Also the bounded
memo (``remember_newest``) the parsers keep earlier messages in, and its
keys hashed once (``FieldsKey``). Depends on
torch only."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` (or ``"bfloat16"``) -> ``"bfloat16"``."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return dtype


def dtype_from_name(name: object, where: str = "dtype name") -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``, also aliases such as
    ``"half"``); ``ValueError`` naming ``where`` if there is none."""
    if isinstance(name, str) and not name.startswith("_"):
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    raise ValueError(f"{where} is {name!r}, which is not a torch dtype name")


def check_int(value: object, where: str, minimum: int = 0) -> int:
    """``value`` if it is an integer (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where} must be an integer >= {minimum}, got {value!r}")
    return value


def check_fields(
    d: object, allowed: Iterable[str], required: Iterable[str], where: str
) -> dict[str, Any]:
    """``d`` if it is a JSON object with only ``allowed`` fields and every
    ``required`` one."""
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(d).__name__}")
    allowed = set(allowed)
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ValueError(
            f"{where} has unknown field(s) {unknown}; allowed: {sorted(allowed)}"
        )
    missing = sorted(set(required) - set(d))
    if missing:
        raise ValueError(f"{where} is missing field(s) {missing}")
    return d


def remember_newest(memo: dict[Any, Any], key: Any, value: Any, limit: int) -> None:
    """Keep ``value`` under ``key`` in ``memo`` as its newest entry, dropping
    the oldest entries beyond ``limit`` (dicts keep insertion order)."""
    memo.pop(key, None)
    while memo and len(memo) >= limit:
        memo.pop(next(iter(memo)))
    memo[key] = value


class FieldsKey:
    """A memo's dict key made of ``fields`` (a tuple), hashed once: a key may
    stand for thousands of entries and is looked up per message. Equal to a
    key of the same class only when every field is."""

    __slots__ = ("fields", "_hash")

    def __init__(self, fields: tuple[Any, ...]) -> None:
        self.fields = fields
        self._hash = hash(fields)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            type(other) is type(self)
            and self._hash == other._hash
            and self.fields == other.fields
        )


def first_few(items: Sequence[str], n: int, sep: str = ", ") -> str:
    """The first ``n`` of ``items`` joined by ``sep``, and how many more."""
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return sep.join(items[:n]) + more
