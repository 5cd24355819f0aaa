# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stand-in for vllm.config.parallel on a machine without vLLM."""


class ParallelConfig:
    pass
