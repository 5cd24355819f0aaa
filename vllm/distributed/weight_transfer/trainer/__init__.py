# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What every trainer engine shares, whatever the backend.

- ``sync``: one sync of any trainer (start, send, prepare, verify, commit;
  abort and fence on failure), which ``ipc``, ``sharded_rdt`` and LoRA
  pushes call;
- ``lifecycle``: the base of the full-resync trainer engines;
- ``start_update``: starting an update when a dead trainer left one open;
- ``group``: coordination among the ranks of a multi-process trainer;
- ``sources``: weight sources for models whose in-memory names are not the
  checkpoint's;
- ``sharded_gather``: full values of sharded (DTensor) parameters.
"""
