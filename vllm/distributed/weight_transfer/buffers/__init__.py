# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Colocated byte buffers behind one seam: what an ``ipc`` trainer exports and
a worker maps.

- ``dataplane``: the seam (``allocate_buffer``, ``BufferImporter``) over the
  two data planes;
- ``shm``: POSIX shared-memory buffers (CPU) and the reaper of dead trainers'
  segments;
- ``cuda_ipc``: CUDA IPC buffers;
- ``handles``: the buffer handle formats (``ShmHandle``, ``CudaIpcHandle``)
  and the device keys they travel under.
"""
