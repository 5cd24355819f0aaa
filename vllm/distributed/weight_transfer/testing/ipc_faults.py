# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fault injection for the ``ipc`` backend's verified-publication tests.

* ``ByteFlippingClient(inner, message)`` wraps a sync client and flips one
  byte of the first tensor of update message number ``message`` (from 0) in
  its shared-memory buffer, after the trainer packed (and checksummed) it and
  before the workers read it: a fault in transit.
* ``fail_load_once(worker, call)`` and ``worker_fence_status(worker)`` run in
  the worker processes through ``llm.collective_rpc`` (which pickles the
  function: set ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` before creating the
  ``LLM``). The first makes the worker's ``call``-th load (from 1) raise once,
  after the weights of that chunk were handed to the loader; the second reads
  the worker engine's fence state. ``fail_stage_once(worker, call)`` is the
  first for a staged update (``staging`` on): the ``call``-th message's
  tensors are staged, then it raises. ``worker_staging(worker)`` reports
  what the worker holds for staging and its resident memory.
* ``push_then_die(base_url, model_dir, seed, chunk_bytes)`` is the body of a
  trainer process that pushes seeded weights to a ``vllm serve`` in chunks of
  ``chunk_bytes`` and SIGKILLs itself as soon as the first chunk was accepted:
  a trainer that dies in the middle of a sync.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

import torch

INJECTED_FAILURE = "injected worker failure"


class ByteFlippingClient:
    """A sync client that corrupts one byte in transit; see the module docstring."""

    def __init__(self, inner: Any, message: int = 0) -> None:
        self.inner = inner
        self.message = message
        self.flipped: str | None = None  # the tensor whose byte was flipped
        self._seen = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def update_weights(self, update_info: Any) -> None:
        if isinstance(update_info, dict) and "abort" not in update_info:
            if self._seen == self.message:
                self._flip(update_info)
            self._seen += 1
        self.inner.update_weights(update_info)

    def _flip(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.buffers.dataplane import BufferImporter
        from vllm.distributed.weight_transfer.ipc.wire import (
            IPCWeightTransferUpdateInfo,
        )
        from vllm.distributed.weight_transfer.verification import pop_publication

        _, _, rest = pop_publication(update_info)
        # (A LoRA adapter push's header is not part of the ipc wire.)
        rest = {k: v for k, v in rest.items() if k != "adapter"}
        info = IPCWeightTransferUpdateInfo.from_dict(rest)
        view = next(v for v in info.views() if v.nbytes)
        importer = BufferImporter(torch.device("cpu"), local_rank=0, writable=True)
        try:
            _, handle = importer.select(info.buffers()[view.buffer], "ipc_handles")
            buf = importer.open(handle)
            buf[view.offset] ^= 0x01
            del buf
        finally:
            importer.close()
        self.flipped = view.name


def fail_load_once(worker: Any, call: int) -> None:
    """For ``llm.collective_rpc``: the worker's ``call``-th load raises, once."""
    from vllm.distributed.weight_transfer.landing.layerwise import (
        LayerwiseReloadSession,
    )

    _land_then_fail(LayerwiseReloadSession, call, "load")


def fail_stage_once(worker: Any, call: int) -> None:
    """For ``llm.collective_rpc``: the worker's ``call``-th staged load (from
    1) stages its tensors, then raises, once."""
    from vllm.distributed.weight_transfer.worker.staged import StagedUpdate

    _land_then_fail(StagedUpdate, call, "staged load")


def _land_then_fail(session_cls: Any, call: int, what: str) -> None:
    """``session_cls.load``'s ``call``-th call (from 1) does its work, then
    raises, once: the engine is past its first write. The method is put
    back at that call."""
    original = session_cls.load
    calls = [0]

    def load(session: Any, *args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] < call:
            return original(session, *args, **kwargs)
        session_cls.load = original
        original(session, *args, **kwargs)
        raise RuntimeError(f"{INJECTED_FAILURE} on {what} {call}")

    session_cls.load = load


def worker_staging(worker: Any) -> dict[str, Any]:
    """For ``llm.collective_rpc``: the bytes the worker engine holds in
    staging, whether an update is open, the process's resident bytes (after
    `_return_free_heap`: what is held, not what the allocator keeps for
    reuse), what the last staged commit did (``StagedUpdate.committed``:
    layers swapped in from their shadows, tensors landed through the
    reload), and the staging pool's state (``staging_pool.StagingPool``)."""
    import psutil

    engine = worker.weight_transfer_engine
    session = engine._session
    pool = engine.staging_pool
    _return_free_heap()
    rss = psutil.Process().memory_info().rss
    return {
        "staged_bytes": getattr(session, "staged_bytes", 0) if session else 0,
        "open": bool(session is not None and session.is_open),
        "rss": rss,
        "committed": dict(getattr(engine, "last_staged_commit", {})),
        "pool": {
            "reserved_bytes": pool.reserved_bytes,
            "reuses": pool.reuses,
            "held_back": pool.held_back,
        },
    }


def _return_free_heap() -> None:
    """Ask glibc to give the heap's free pages back to the system
    (``malloc_trim``; nothing elsewhere). Freed buffers otherwise stay
    resident for reuse, by an amount that depends on what the process ran
    before: 20 failed staged syncs grew the resident size by 13.7-19.6 MiB
    without trimming and by less than 1 MiB with it, with no tensor or
    Python object left behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def worker_fence_status(worker: Any) -> dict[str, Any]:
    """For ``llm.collective_rpc``: the worker engine's ``fence_status``."""
    return dict(worker.weight_transfer_engine.fence_status)


class _DiesAfterFirstChunk:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def update_weights(self, update_info: Any) -> None:
        import os
        import signal

        self.inner.update_weights(update_info)
        os.kill(os.getpid(), signal.SIGKILL)


def push_then_die(base_url: str, model_dir: str, seed: int, chunk_bytes: int) -> None:
    """See the module docstring."""
    from vllm.distributed.weight_transfer import (
        ModuleSource,
        WeightTransferTrainerFactory,
    )
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.testing import (
        load_hf_model,
        randomize_weights_,
    )

    model = load_hf_model(model_dir, "float32")
    randomize_weights_(model, seed)
    engine = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(
            rank=0,
            packed=True,
            packed_buffer_size_bytes=chunk_bytes,
            overlap_chunks=False,
        ),
        client=_DiesAfterFirstChunk(HTTPVLLMWeightSyncClient(base_url, timeout=120)),
        source=ModuleSource(model),
    )
    engine.send_weights()
