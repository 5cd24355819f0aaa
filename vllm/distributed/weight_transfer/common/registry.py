# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Registries by name: a lazy "import a module, take one attribute" loader and
a name -> value table that refuses taken names and lists the known ones when
a lookup misses. The engine factories and the pull transports use both; each
caller words its own errors."""

from __future__ import annotations

import importlib
from collections.abc import Callable, MutableMapping
from typing import Any, Generic, TypeVar

V = TypeVar("V")


def import_attribute(
    module_path: str, attr: str, missing: Callable[[], BaseException]
) -> Any:
    """Import ``module_path`` (a lookup in Python's module cache after the first
    call) and return its ``attr``; raise ``missing()`` when it has none."""
    module = importlib.import_module(module_path)
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise missing() from e


class NameRegistry(Generic[V]):
    """A view over ``entries`` (kept as the caller's own mapping, so that code
    reading, copying or replacing that mapping keeps working) that adds a name
    once and looks one up. ``taken(name)`` and ``unknown(name, known_names)``
    word the `ValueError` each raises."""

    def __init__(
        self,
        entries: MutableMapping[str, V],
        *,
        taken: Callable[[str], str],
        unknown: Callable[[str, list[str]], str],
    ) -> None:
        self.entries = entries
        self._taken = taken
        self._unknown = unknown

    def check_free(self, name: str) -> None:
        if name in self.entries:
            raise ValueError(self._taken(name))

    def add(self, name: str, value: V) -> None:
        self.check_free(name)
        self.entries[name] = value

    def names(self) -> list[str]:
        return sorted(self.entries)

    def get(self, name: str) -> V:
        if name not in self.entries:
            raise ValueError(self._unknown(name, self.names()))
        return self.entries[name]
