# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The JSON form of the plan's frozen dataclasses, written once.

A record's JSON is a dict of its fields by name: tuples go as lists, and a
value with a ``to_json`` of its own (a nested record, a view op) goes as its
JSON. ``from_json`` gives each field back to the class as a tuple where the
JSON holds a list, or through the decoder the class names for that field in
``json_decoders`` (the fields that hold records). The class's own
``__post_init__`` then checks the values as it does for any caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Self


def _to_plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_to_plain(v) for v in value]
    if hasattr(value, "to_json"):
        return value.to_json()
    return value


def _lists_as_tuples(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_lists_as_tuples(v) for v in value)
    return value


def decode_each(decode: Callable[[Any], Any]) -> Callable[[list[Any]], tuple]:
    """A field decoder for a tuple of records: ``decode`` on each item."""
    return lambda items: tuple(decode(item) for item in items)


class JsonRecord:
    """``to_json`` / ``from_json`` for a frozen dataclass; see the module
    docstring."""

    json_decoders: ClassVar[Mapping[str, Callable[[Any], Any]]] = {}

    def to_json(self) -> dict[str, Any]:
        return {
            f.name: _to_plain(getattr(self, f.name))
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        decoders = cls.json_decoders
        return cls(
            **{
                f.name: decoders.get(f.name, _lists_as_tuples)(data[f.name])
                for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            }
        )
