# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the weight-transfer code on both sides of the RL routes shares and
that imports nothing heavy:

- ``messages``: the vocabulary of update messages and the one rule that
  classifies an ``update_weights`` body, used by the API server's
  middlewares and by the worker engines alike;
- ``asgi``: the steps every API-server middleware of the fork takes (the
  route a request is for, its JSON body read once, an error answer);
- ``wire_fields``: checks for the fields of wire messages (dtype names,
  integers, allowed and required fields) and error wording;
- ``owner_lock``: who owns a shared file or directory (a held ``flock``), so
  a reaper removes only what nobody holds (stdlib only).
"""
