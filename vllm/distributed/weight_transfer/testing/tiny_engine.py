# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine every test, example and benchmark starts on a tiny model.

``TINY_ENGINE_ARGS`` are the settings that keep a CPU engine small and
deterministic (eager mode, a short context, a few sequences, a small KV cache,
a fixed seed);
``tiny_llm(model_dir, ...)`` starts an offline ``LLM`` with them, a weight
transfer backend, and the fresh-load oracle's worker methods
(``testing.fresh_load``). ``testing.server.serve`` passes the same settings to
``vllm serve``.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.distributed.weight_transfer.testing.fresh_load import WORKER_EXTENSION

# 64 MiB of KV cache holds tens of thousands of the tiny models' tokens, far
# more than max_model_len x max_num_seqs. vLLM CPU spends about 10 s of every
# engine start setting up a 1 GiB cache on a 2-core machine and well under a
# second for this one. VLLM_CPU_KVCACHE_SPACE, when set, wins over it (the
# benchmarks set it for their larger models).
TINY_KV_CACHE_BYTES = 64 * 2**20

TINY_ENGINE_ARGS: dict[str, Any] = {
    "enforce_eager": True,
    "max_model_len": 256,
    "max_num_seqs": 4,
    "kv_cache_memory_bytes": TINY_KV_CACHE_BYTES,
    "seed": 0,
}


def tiny_llm(
    model_dir: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    tensor_parallel_size: int = 1,
    backend: str | None = "ipc",
    **overrides: Any,
) -> Any:
    """An offline ``vllm.LLM`` on ``model_dir`` with ``TINY_ENGINE_ARGS``;
    ``backend=None`` starts it without weight transfer. ``overrides`` win."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    kwargs: dict[str, Any] = dict(
        TINY_ENGINE_ARGS,
        model=str(model_dir),
        dtype=dtype,
        tensor_parallel_size=tensor_parallel_size,
        worker_extension_cls=WORKER_EXTENSION,
    )
    if backend is not None:
        kwargs["weight_transfer_config"] = WeightTransferConfig(backend=backend)
    kwargs.update(overrides)
    return LLM(**kwargs)
