# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The loader planner and its compiled form, as plain data.

A worker's plan is recorded by dry-running vLLM's own weight loaders on
zero-storage stand-ins; producers replay it, landings execute it.

- ``lazy``: the zero-storage stand-in that records what a loader does;
- ``json_record``: the JSON form of the plan's records, written once;
- ``ops``: the view ops a plan may hold and the replayer that applies them;
- ``bake``: bakes a worker's plan from the model's loaders;
- ``worker_plan``: the plan as plain data (regions, slice copies);
- ``copy_table``: a plan compiled into byte runs (the one-copy data plane);
- ``copy_exec``: executes a copy table on real tensors.
"""
