# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``ipc`` backend: a colocated trainer shares its buffers with the
workers (CUDA IPC or shared memory).

- ``trainer``: ``IPCTrainerInitInfo`` and the trainer engine;
- ``chunk_sender``: how the trainer sends one sync's chunks (packed or
  named in place, overlapped);
- ``whole_sync``: resending a whole sync by its layout id while nothing
  moved;
- ``source_walk``: the trainer's walk of a source in metadata order;
- ``worker``: ``IPCWeightTransferEngine``, which maps and lands messages;
- ``wire``: the init and update messages;
- ``upstream_wire``: upstream 0.32's form of the messages, both sides;
- ``layout_memo``: a worker's memory of committed layouts and per-layout
  values;
- ``reads``: the buffers one message reads on a worker, mapped;
- ``packing``: which tensors travel in which chunk;
- ``shared_params``: a trainer's parameters in shared allocations;
- ``chunk_programs``: planned landing of chunks that stay mapped.

``ipc_engine`` (upstream's import path) re-exports the engines.
"""
