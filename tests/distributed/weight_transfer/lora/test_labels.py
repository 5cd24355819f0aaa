# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Weight version labels naming the LoRA adapters' versions
(``adapter_labels``)."""

from __future__ import annotations

import pytest

from vllm.distributed.weight_transfer.lora.labels import (
    label_with_adapters,
    split_adapter_label,
)


def test_a_label_names_the_base_and_every_adapter_sorted():
    label = label_with_adapters("step-40", {"policy": "v12", "critic": "v7"})
    assert label == 'step-40+lora:{"critic":"v7","policy":"v12"}'
    assert split_adapter_label(label) == ("step-40", {"critic": "v7", "policy": "v12"})


def test_without_adapters_the_label_is_the_base():
    assert label_with_adapters("step-3", {}) == "step-3"
    assert split_adapter_label("step-3") == ("step-3", {})
    assert split_adapter_label("default") == ("default", {})


@pytest.mark.parametrize(
    "base, adapters",
    [
        ("a+lora:b", {"p": "q"}),  # the mark in the base label
        ("x", {'na"me': "v+lora:{1}"}),  # quotes, and the mark in a version
        ("", {"p": ""}),
        ("step-1", {"é": "ü ß"}),
    ],
)
def test_any_characters_read_back(base, adapters):
    assert split_adapter_label(label_with_adapters(base, adapters)) == (
        base,
        adapters,
    )


@pytest.mark.parametrize(
    "label",
    ["step+lora:{", "step+lora:{not json}", 'step+lora:{"p":1}', "step+lora:[]"],
)
def test_a_malformed_suffix_is_part_of_the_base_label(label):
    assert split_adapter_label(label) == (label, {})


def test_names_and_versions_must_be_strings():
    with pytest.raises(TypeError, match="must be strings"):
        label_with_adapters("b", {"p": 3})  # type: ignore[dict-item]
