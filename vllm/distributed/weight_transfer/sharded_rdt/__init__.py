# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``sharded_rdt`` backend: a planner records vLLM's own loaders, trainer
producers replay it, and workers pull only their bytes.

- ``wire``: the init and update messages;
- ``trainer``: the trainer engine;
- ``worker``: the worker engine (init, updates, landing checks);
- ``consumer``: a worker's transport choice and consumer plan (pure);
- ``pulls``: a worker's pull loop (a puller thread, landing as chunks arrive);
- ``lander``: lands pulled chunks into a model.

``sharded_rdt_engine``, ``sharded_rdt_trainer`` and ``sharded_rdt_common``
(upstream's import paths) re-export them.
"""
