# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The API server's side (``vllm serve``): ASGI middlewares and plugins.

- ``update_guard``: holds generation while an update is open and refuses
  requests that would bypass it (the ASGI middleware);
- ``update_ledger``: the update the guard sees open, and which messages it
  refuses before they reach the workers;
- ``generation_hold``: the guard's hold on generation and how it ends;
- ``metrics``: sync metrics, one log line per sync and Prometheus;
- ``lora_routes``: one id names one adapter, whoever numbered it;
- ``non_finite_outputs``: an output JSON cannot carry is the server's fault;
- ``rpc_replies``: keeps RPC replies in step after a worker fails (plugin).
"""
