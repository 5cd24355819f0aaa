# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trainer side of LoRA adapter pushes over the ``ipc`` data plane.

``LoRAAdapter`` is an adapter to push: its name and integer id (what a
``LoRARequest`` names), its ``AdapterConfig`` (rank, alpha, target modules)
and its tensors under PEFT's names (``base_model.model.<module>.lora_A.weight``,
``...lora_B.weight``), taken from a PEFT model (``from_peft_model``) or given.
``push_lora_adapter(client, adapter)`` packs the tensors into one buffer the
workers map (shared memory for CPU tensors, CUDA IPC for GPU tensors), sends it
as one ``update_weights`` message with an ``adapter`` header inside a
start/finish pair of the weight-transfer lifecycle, and returns once every
worker has checked the whole adapter and the finish made it the version that
serves. The base weights are not touched and nothing is written to disk. On
any failure the update is aborted and the version before keeps serving; the
error names the cause.

    adapter = LoRAAdapter.from_peft_model(peft_model, name="policy", lora_id=1)
    push_lora_adapter(OfflineLLMWeightSyncClient(llm), adapter, version="step-7")
    # or, every step, with the buffer kept: pusher = LoRAPusher(client);
    # pusher.push(adapter, version=...)
    llm.generate(prompts, lora_request=LoRARequest("policy", 1, "memory://policy"))

Over HTTP (``HTTPVLLMWeightSyncClient``) the push also registers the adapter's
name with the OpenAI server, so ``model="policy"`` requests reach it; the server
needs ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (upstream's
``/v1/load_lora_adapter``, which the server answers with ids of its own).

A ``LoRARequest`` needs a path. A pushed id is built from memory whatever its
path says; ``memory_path(name)`` (``memory://<name>``) also reaches the adapter
pushed under ``name`` from a request with any other id (a server that numbers
adapters itself, e.g. ``/v1/load_lora_adapter``). The worker never reads it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vllm.distributed.weight_transfer.full_resync import abort_update, commit_update
from vllm.distributed.weight_transfer.ipc_dataplane import (
    ExportedBuffer,
    allocate_buffer,
    device_key,
    sync_device,
)
from vllm.distributed.weight_transfer.lora_adapters import (
    ADAPTER_KEY,
    PEFT_PREFIX,
    AdapterConfig,
    AdapterHeader,
    memory_path,
    module_of,
)
from vllm.distributed.weight_transfer.stale_updates import start_update
from vllm.distributed.weight_transfer.verification import describe_error

__all__ = ["LoRAAdapter", "LoRAPusher", "memory_path", "push_lora_adapter"]

ALIGN = 64


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter to push; see the module docstring."""

    name: str
    lora_id: int
    config: AdapterConfig
    tensors: Mapping[str, torch.Tensor]

    def __post_init__(self) -> None:
        AdapterHeader(self.name, self.lora_id, self.config)  # checks name and id
        for name, tensor in self.tensors.items():
            module_of(name)  # a PEFT LoRA name, or ValueError
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(
                    f"adapter tensor {name!r} is a {type(tensor).__name__}"
                )

    @classmethod
    def from_peft_model(
        cls, model: Any, name: str, lora_id: int, adapter_name: str = "default"
    ) -> LoRAAdapter:
        """The adapter ``adapter_name`` of a PEFT model as it is now (its
        tensors are the model's own, not copies: push before the next
        optimizer step, or copy)."""
        from peft import get_peft_model_state_dict

        peft_config = model.peft_config[adapter_name]
        if (
            getattr(peft_config, "peft_type", None) not in ("LORA", None)
            and str(peft_config.peft_type).rsplit(".", 1)[-1] != "LORA"
        ):
            raise ValueError(f"{adapter_name!r} is a {peft_config.peft_type} adapter")
        targets = peft_config.target_modules
        if isinstance(targets, str):
            raise ValueError(
                f"adapter {adapter_name!r} names its target modules by a pattern "
                f"({targets!r}); give them as a list of module names"
            )
        state = get_peft_model_state_dict(model, adapter_name=adapter_name)
        tensors = {
            _peft_name(key): t.detach() for key, t in state.items() if ".lora_" in key
        }
        return cls(
            name=name,
            lora_id=lora_id,
            config=AdapterConfig(
                rank=int(peft_config.r),
                alpha=float(peft_config.lora_alpha),
                target_modules=tuple(sorted(targets)),
                use_rslora=bool(getattr(peft_config, "use_rslora", False)),
            ),
            tensors=tensors,
        )

    @torch.no_grad()  # the base is often a model's parameters, which need grad
    def merged_into(self, base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Base weights (checkpoint names) with this adapter folded in:
        ``W + scaling * B @ A`` for every module it adapts, computed in fp32
        and cast back; the other weights as they are (the same tensors)."""
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in self.tensors.items():
            module, half = module_of(name)
            halves.setdefault(module, {})[half] = tensor
        out = dict(base)
        for module, ab in halves.items():
            key = f"{module}.weight"
            if key not in base:
                raise ValueError(f"{module} is not a module of the base weights")
            weight = base[key]
            delta = ab["B"].float() @ ab["A"].float()
            out[key] = (weight.float() + self.config.scaling * delta).to(weight.dtype)
        return out


def _peft_name(key: str) -> str:
    """PEFT's state-dict key of a LoRA tensor under the ``base_model.model.``
    prefix adapters are saved with (the adapter name already dropped)."""
    key = re.sub(r"\.lora_([AB])\.[^.]+\.weight$", r".lora_\1.weight", key)
    return key if key.startswith(PEFT_PREFIX) else PEFT_PREFIX + key


def push_lora_adapter(
    client: Any,
    adapter: LoRAAdapter,
    *,
    version: str | None = None,
    rank: int = 0,
    verify_checksums: bool = False,
) -> None:
    """Push ``adapter`` to the engine ``client`` drives, once; see the module
    docstring. A trainer that pushes every step keeps a ``LoRAPusher``,
    which reuses its buffer."""
    pusher = LoRAPusher(client, rank=rank, verify_checksums=verify_checksums)
    try:
        pusher.push(adapter, version=version)
    finally:
        pusher.close()


class LoRAPusher:
    """Pushes adapters to the engine ``client`` drives, keeping the buffer
    they travel in from one push to the next (a new buffer's pages cost more
    than the copy into it). ``rank`` is this trainer rank (it keys the
    buffer's handle). ``close()`` frees the buffer; a failed push frees it
    too, since a worker that timed out may still be reading it."""

    def __init__(
        self, client: Any, *, rank: int = 0, verify_checksums: bool = False
    ) -> None:
        self.client = client
        self.rank = rank
        # Each worker checks the bytes it read against the trainer's checksum.
        self.verify_checksums = verify_checksums
        self._buffer: ExportedBuffer | None = None
        # Names the client's server was told about (``register_lora_adapter``).
        self._registered: set[str] = set()

    def push(self, adapter: LoRAAdapter, *, version: str | None = None) -> None:
        """Push ``adapter``; returns once it serves (see the module docstring)."""
        items = [(n, t.detach()) for n, t in adapter.tensors.items()]
        if not items:
            raise ValueError(f"adapter {adapter.name!r} has no tensors")
        devices = {t.device for _, t in items}
        if len(devices) != 1:
            raise ValueError(
                f"adapter {adapter.name!r} has tensors on "
                f"{sorted(map(str, devices))}; push them from one device"
            )
        device = devices.pop()
        offsets, end = [], 0
        for _, tensor in items:
            offsets.append(end)
            end += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        buffer = self._buffer_for(end, device)
        what = f"LoRA adapter push {adapter.name!r}"
        try:
            flat = buffer.tensor
            assert flat is not None
            with torch.no_grad():
                for (_, tensor), offset in zip(items, offsets, strict=True):
                    nbytes = tensor.numel() * tensor.element_size()
                    place = flat[offset : offset + nbytes].view(tensor.dtype)
                    place.view(tensor.shape).copy_(tensor)
            sync_device(device)
            checksum = None
            if self.verify_checksums:
                from vllm.distributed.weight_transfer.verification.checksum import (
                    payload_checksum,
                )

                last = offsets[-1] + items[-1][1].numel() * items[-1][1].element_size()
                checksum = payload_checksum(flat[:last])
            header = AdapterHeader(
                adapter.name,
                adapter.lora_id,
                adapter.config,
                version=version,
                last=True,
                checksum=checksum,
            )
            message = {
                "names": [n for n, _ in items],
                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in items],
                "shapes": [list(t.shape) for _, t in items],
                "tensor_sizes": [t.numel() * t.element_size() for _, t in items],
                "offsets": offsets,
                "ipc_handles": {device_key(device, self.rank): buffer.handle.to_dict()},
                ADAPTER_KEY: header.to_dict(),
            }
            start_update(self.client, what)
            try:
                self.client.update_weights(message)
                commit_update(self.client, None)
            except BaseException as e:
                abort_update(self.client, f"{what}: {describe_error(e)}")
                raise
        except BaseException:
            self.close()
            raise
        register = getattr(self.client, "register_lora_adapter", None)
        if callable(register) and adapter.name not in self._registered:
            # A server that names adapters for OpenAI requests (``model=name``)
            # learns this one; its requests then reach it by its memory path.
            register(adapter.name, memory_path(adapter.name))
            self._registered.add(adapter.name)

    def _buffer_for(self, nbytes: int, device: torch.device) -> ExportedBuffer:
        buffer = self._buffer
        if buffer is not None and buffer.tensor is not None:
            if buffer.tensor.device == device and buffer.tensor.numel() >= nbytes:
                return buffer
            self.close()
        self._buffer = allocate_buffer(nbytes, device)
        return self._buffer

    def close(self) -> None:
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            buffer.close()
