# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What every trainer engine shares, whatever the backend.

- ``lifecycle``: the end of every full-resync sync (prepare, verify, commit,
  abort on failure);
- ``start_update``: starting an update when a dead trainer left one open;
- ``group``: coordination among the ranks of a multi-process trainer;
- ``sources``: weight sources for models whose in-memory names are not the
  checkpoint's;
- ``sharded_gather``: full values of sharded (DTensor) parameters.
"""
