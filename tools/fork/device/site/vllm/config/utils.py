# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stand-in for vllm.config.utils on a machine without vLLM: `config` is a plain
dataclass decorator."""

from dataclasses import dataclass


def config(cls):
    return dataclass(cls)
