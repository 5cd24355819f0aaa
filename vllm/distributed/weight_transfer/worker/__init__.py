# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A worker's update life, for every backend.

- ``lifecycle``: start, messages, finish and abort around a backend's
  ``receive_weights``; the invariant (old weights, new weights, or fenced
  with a reason) is kept here;
- ``handlers``: message kinds features register, handled apart from base
  weights (LoRA adapters);
- ``staged``: an update staged in memory the worker owns while it serves;
- ``staging_pool``: staging buffers kept from one staged update to the next;
- ``shadows``: staged layers loaded and processed while the engine serves;
- ``kv_scrub``: non-finite KV cache values zeroed at a commit.
"""
