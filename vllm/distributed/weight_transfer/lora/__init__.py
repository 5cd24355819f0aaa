# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LoRA adapters pushed from a trainer's memory into running engines.

- ``pusher``: the trainer side (``LoRAPusher``, ``push_lora_adapter``);
- ``trainer``: the same pushes in the trainer-engine shape of base syncs;
- ``wire``: the adapter header and the checks of what a push carries;
- ``adapters``: the worker side of a push (staging, commit);
- ``memory``: adapters held in memory, their ids, the LoRA manager's loader;
- ``worker_handler``: the worker lifecycle's handler of adapter messages;
- ``publication``: the receipt a worker writes for a verified push;
- ``pull``: pushes across machines, pulled over NIXL;
- ``labels``: weight version labels that also name adapter versions.
"""
