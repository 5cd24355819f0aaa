# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LoRA adapters pushed from a trainer's memory into running engines.

- ``pusher``: the trainer side (``LoRAPusher``, ``push_lora_adapter``);
- ``trainer``: the same pushes in the trainer-engine shape of base syncs;
- ``adapters``: the worker side, into the LoRA manager;
- ``publication``: the receipt a worker writes for a verified push;
- ``pull``: pushes across machines, pulled over NIXL;
- ``labels``: weight version labels that also name adapter versions.
"""
