# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Received checkpoint tensors into the served tensors, for every backend.

- ``layerwise``: one update landed through vLLM's layerwise reload;
- ``planned``: planned landing (``landing="planned"``), checkpoint bytes
  copied straight into served tensors where that is proven equal;
- ``codes``: trainer-side FP8 codes landed into an online-quantized engine;
- ``completeness``: which checkpoint tensors an update must carry together;
- ``update_calls``: the call timer both update sessions share;
- ``checkpoint_structure``: the served model's checkpoint structure, for
  checking a manifest;
- ``cpu_linear``: the ``cpu_linear="plain"`` plugin.
"""
