# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Weight version labels that also name the LoRA adapters' versions.

vLLM stamps every output token with the engine's weight version label
(``CompletionOutput.weight_versions`` spans offline, and the last chunk of
``/inference/v1/generate`` under ``vllm serve --enable-scale-out``). The label
is one string per engine step, set when an update commits; outputs have no
field of their own for adapters. A LoRA push made with
``label_outputs=True`` (``lora_trainer``) therefore sets the engine's label,
at the same commit that swaps the adapter in, to the base weights' label
followed by the version of every adapter pushed that way::

    step-40+lora:{"critic":"v7","policy":"v12"}

``split_adapter_label`` reads a span's label back into the base label and the
adapters' versions; a request reads the version of the adapter it named. The
part after ``ADAPTERS_MARK`` is JSON (an object of names to version labels,
keys sorted), so names and labels may hold any characters. A label without a
well-formed suffix is all base label.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

# Between the base label and the JSON object of adapter versions.
ADAPTERS_MARK = "+lora:"


def label_with_adapters(base: str, adapters: Mapping[str, str]) -> str:
    """``base`` followed by the adapters' versions (just ``base`` when
    ``adapters`` is empty)."""
    if not adapters:
        return base
    for name, version in adapters.items():
        if not isinstance(name, str) or not isinstance(version, str):
            raise TypeError(
                "adapter names and version labels must be strings, got "
                f"{name!r}: {version!r}"
            )
    versions = json.dumps(dict(sorted(adapters.items())), separators=(",", ":"))
    return f"{base}{ADAPTERS_MARK}{versions}"


def split_adapter_label(label: str) -> tuple[str, dict[str, str]]:
    """The base label and the adapters' versions ``label`` names (no
    adapters when it has no well-formed suffix)."""
    at = label.rfind(ADAPTERS_MARK + "{")
    while at >= 0:
        try:
            versions = json.loads(label[at + len(ADAPTERS_MARK) :])
        except ValueError:
            versions = None
        if isinstance(versions, dict) and all(
            isinstance(v, str) for v in versions.values()
        ):
            return label[:at], versions
        # The mark inside a version label: look further left.
        at = label.rfind(ADAPTERS_MARK + "{", 0, at)
    return label, {}
