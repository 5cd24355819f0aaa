# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``ipc`` weight-transfer backend: a trainer on the same host as the vLLM
workers shares its weights' bytes with them in place, chunk by chunk.

Data planes (chosen from the device of the tensors the source yields):
CUDA tensors travel through CUDA IPC, CPU tensors through POSIX shared memory,
so vLLM CPU workers receive updates too. Wire format, device keys and rejection
rules: ``ipc_wire``. Chunk planning: ``ipc_packing``. The trainer side is
``ipc_trainer`` (its protocol is described there), the worker side
``ipc_worker``; this module keeps upstream's import path for both.

Packed mode (the default) reuses one buffer per trainer rank for every chunk,
sized from the metadata: the model's aligned size capped at
``packed_buffer_size_bytes``, but at least the largest tensor. With
``overlap_chunks`` (default on) a model larger than the buffer travels in
chunks that alternate between the buffer's two halves, so packing overlaps the
workers' loading; a tensor larger than half the buffer travels alone. CPU
buffers are kept from one sync to the next (``keep_packed_buffer``). Unpacked mode
exports each tensor separately and keeps every exported tensor alive until all
workers have read it (the barrier after its chunk).

The worker lands each chunk through ``LayerwiseReloadSession``
(``layerwise_session``): start -> load per chunk -> finish, so fused and
quantized layers are processed after loading. It maps each buffer once per
update and releases it at finish. With ``WeightTransferConfig.staging`` the
chunks are copied into worker-owned memory instead and land in one call at
finish (``staged_update``).

Verified publication (``verification``, on by default): the sender opens a
``TrainerPublication`` whose header rides in every update message; each worker
checks the header's manifest against the served checkpoint's shapes and every
tensor against the manifest before it touches a weight. After the last chunk
the sender sends ``{"prepare": publication_id}``: each worker checks what it
holds and writes a receipt into a shared-memory directory the trainer reads,
and nothing is committed yet. The sender verifies every worker's receipt and
only then commits (``full_resync.commit_update``):
``finish_weight_update(weight_version)`` with generation held for just that
call, then a prefix-cache reset. On any failure it aborts the update on the
server, sets the served version to ``fenced:<publication id>: <reason>``
unless every worker reported its weights intact, and re-raises. With
``verify_checksums=True`` every rank checksums each chunk it exported, the
sender checks that the ranks agree, and each worker checksums the bytes it
mapped before loading them. A worker whose weights were touched by a failed
update is fenced: it refuses ``update_weights`` and ``finish_weight_update``
until a full resync completes. See ``docs/training/weight_transfer/
verification.md``.

Failures: a malformed update is rejected with ``ValueError`` before any weight
is touched. Any failure inside ``update_weights`` puts every layer that did not
complete back on its resident weights before re-raising, so the server keeps
serving. When the trainer fails after ``start_weight_update`` it sends
``{"abort": reason}`` and then finishes, with the same effect. Waits among
trainer ranks are bounded by ``timeout_s`` (or the caller's group timeout); the
HTTP and Ray clients bound every call to the server.
"""

from vllm.distributed.weight_transfer.ipc.trainer import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_TIMEOUT_S,
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)
from vllm.distributed.weight_transfer.ipc.wire import (
    IPCWeightTransferInitInfo,
    IPCWeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.ipc.worker import IPCWeightTransferEngine

__all__ = [
    "DEFAULT_PACKED_BUFFER_SIZE_BYTES",
    "DEFAULT_TIMEOUT_S",
    "IPCTrainerInitInfo",
    "IPCTrainerWeightTransferEngine",
    "IPCWeightTransferEngine",
    "IPCWeightTransferInitInfo",
    "IPCWeightTransferUpdateInfo",
]
