# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stand-in for vllm.logger on a machine without vLLM (see tools/fork/device)."""

import logging


def init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)
