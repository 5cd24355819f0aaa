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

``in_process=True`` runs a TP 1 engine's core and worker inside the calling
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni`` executor). On a
2-core machine such a start takes 5-8 s instead of 25-45 s: no interpreter is
spawned to import vLLM again. The price: the engine steps in the caller's
thread, so generation and updates must not run concurrently from two threads,
and a worker's exception reaches the caller as itself rather than wrapped by
the executor; tests that need either keep the default. At TP 2 and above the
flag is ignored: the workers are processes anyway, and keeping only the core
here saved little when measured.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
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
    in_process: bool = False,
    **overrides: Any,
) -> Any:
    """An offline ``vllm.LLM`` on ``model_dir`` with ``TINY_ENGINE_ARGS``;
    ``backend=None`` starts it without weight transfer; ``in_process`` as the
    module says. ``overrides`` win."""
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
    in_process = in_process and tensor_parallel_size == 1
    if in_process:
        kwargs["distributed_executor_backend"] = "uni"
    kwargs.update(overrides)
    if not in_process:
        return LLM(**kwargs)
    with _env(VLLM_ENABLE_V1_MULTIPROCESSING="0"):
        llm = LLM(**kwargs)
    # The engine core froze vLLM's environment settings in this process when
    # it started (``envs.enable_envs_cache``); a later engine here must read
    # its own (a TP 2 engine's thread binding, the multiprocessing switch).
    from vllm import envs

    envs.disable_envs_cache()
    return llm


@contextmanager
def _env(**values: str) -> Iterator[None]:
    """Set environment variables for the block, then restore them (vLLM reads
    its multiprocessing switch while the engine is built)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
