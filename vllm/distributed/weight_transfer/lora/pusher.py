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

Verified publication (``verify_publication``, on by default as for base
weights): the message also carries a publication header whose manifest lists
the adapter's tensors; after it, the prepare message has every worker (every
TP rank of every engine the client drives) write a receipt of what it staged
(names, bytes, the checksums it verified), and the pusher commits only once
every receipt verified; ``last_publication`` then holds what was verified.
The publication's ``model_version`` orders this adapter's versions only (per
adapter name, apart from the base weights'): ``model_version=None`` numbers
pushes by the wall clock in microseconds, an int numbers each adapter's
pushes from it; a worker refuses a push older than the one its adapter
serves. A client without ``get_world_size`` (which says whose receipts to
wait for) pushes unverified, with a warning.

    adapter = LoRAAdapter.from_peft_model(peft_model, name="policy", lora_id=1)
    push_lora_adapter(OfflineLLMWeightSyncClient(llm), adapter, version="step-7")
    # or, every step, with the buffer kept: pusher = LoRAPusher(client);
    # pusher.push(adapter, version=...)
    llm.generate(prompts, lora_request=LoRARequest("policy", 1, "memory://policy"))

Across machines (``transport="nixl"``): the packed buffer is served by a
``sharded_rdt`` producer over NIXL instead of mapped, and every worker pulls
it (``lora_pull``); receipts come back through the producer. The trainer must
reach no shared path or handle, only the workers its NIXL endpoint
(``producer_host``), and every wait is bounded by ``stall_timeout_s``. Any
backend's engine takes these pushes.

Adapter versions on outputs (``label_outputs=True``): each commit also sets
the engine's weight version label, which vLLM puts on every output token, to
the base weights' label followed by the version of every adapter pushed that
way (``adapter_labels``); a request reads its adapter's version from the
spans of its output.

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

import concurrent.futures
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.buffers.dataplane import (
    ExportedBuffer,
    allocate_buffer,
    device_key,
    sync_device,
)
from vllm.distributed.weight_transfer.lora.labels import (
    label_with_adapters,
    split_adapter_label,
)
from vllm.distributed.weight_transfer.lora.pull import (
    ADAPTER_PULL_KEY,
    AdapterPull,
    AdapterServer,
    served_workers,
)
from vllm.distributed.weight_transfer.lora.wire import (
    ADAPTER_KEY,
    PEFT_PREFIX,
    REFUSED_MARK,
    AdapterConfig,
    AdapterHeader,
    AdapterRefused,
    memory_path,
    module_of,
)
from vllm.distributed.weight_transfer.trainer.lifecycle import ModelVersions
from vllm.distributed.weight_transfer.trainer.settings import check_verified_sync
from vllm.distributed.weight_transfer.trainer.start_update import DEFAULT_WAIT_S
from vllm.distributed.weight_transfer.trainer.sync import run_sync
from vllm.distributed.weight_transfer.verification import (
    DEFAULT_RECEIPT_TIMEOUT_S,
    TrainerPublication,
    VerifiedPublication,
    device_identity,
    expected_workers,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["LoRAAdapter", "LoRAPusher", "memory_path", "push_lora_adapter"]

ALIGN = 64
# How long each wait of a pull over NIXL may last: workers register within
# moments of the message, and an adapter reads in well under a second.
DEFAULT_PULL_STALL_TIMEOUT_S = 60.0
# How long a push waits for an update someone else holds open (a base sync
# of a live trainer) to close before it gives up; it never abandons it.
DEFAULT_START_WAIT_S = DEFAULT_WAIT_S


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


def _as_refusal(error: BaseException) -> AdapterRefused | None:
    """A worker's refusal of the adapter that reached the pusher as another
    type (an engine in another process answers its calls' failures as plain
    ``Exception``) as the documented ``AdapterRefused``; None for anything
    else, an HTTP error included (its answer, 4xx, already names the cause)."""
    if isinstance(error, ValueError) or getattr(error, "response", None) is not None:
        return None
    text = str(error)
    return AdapterRefused(text) if REFUSED_MARK in text else None


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
    **options: Any,
) -> VerifiedPublication | None:
    """Push ``adapter`` to the engine ``client`` drives, once; see the module
    docstring. ``options`` are ``LoRAPusher``'s keywords. Returns what the
    receipts verified (None when unverified). A trainer that pushes every
    step keeps a ``LoRAPusher``, which reuses its buffer (and, with
    ``transport="nixl"``, its producer)."""
    pusher = LoRAPusher(client, **options)
    try:
        return pusher.push(adapter, version=version)
    finally:
        pusher.close()


class LoRAPusher:
    """Pushes adapters to the engine ``client`` drives, keeping the buffer
    they travel in from one push to the next (a new buffer's pages cost more
    than the copy into it). ``rank`` is this trainer rank (it keys the
    buffer's handle). ``verify_publication``, ``model_version`` (the first
    model version of each adapter name; None: the wall clock) and
    ``receipt_timeout_s`` (the wait for every receipt) are described in the
    module docstring. ``transport``: ``"ipc"`` (workers map the buffer:
    colocated) or ``"nixl"`` (workers pull it from a producer this pusher
    serves at ``producer_host``: any machine; ``stall_timeout_s`` bounds each
    wait of a pull). ``label_outputs``: each push's commit also sets the
    engine's weight version label to the base weights' label followed by the
    version of every adapter pushed this way (``adapter_labels``), so every
    output token names the adapter versions it was sampled with; each push
    then needs a ``version=``. ``start_wait_s``: while another update is
    open on the engine (a base-weight sync of a trainer that is alive), a
    push waits at most this long for it to close and then raises, naming
    it; a push never abandons another's update. ``close()`` frees the
    buffer and the producer; a failed push frees them too, since a worker
    that timed out may still be reading the buffer."""

    def __init__(
        self,
        client: Any,
        *,
        rank: int = 0,
        verify_checksums: bool = False,
        verify_publication: bool = True,
        model_version: int | None = None,
        receipt_timeout_s: float = DEFAULT_RECEIPT_TIMEOUT_S,
        transport: Literal["ipc", "nixl"] = "ipc",
        producer_host: str = "127.0.0.1",
        stall_timeout_s: float = DEFAULT_PULL_STALL_TIMEOUT_S,
        label_outputs: bool = False,
        start_wait_s: float = DEFAULT_START_WAIT_S,
    ) -> None:
        if not start_wait_s >= 0:
            raise ValueError(f"start_wait_s must be >= 0, got {start_wait_s}")
        self.start_wait_s = start_wait_s
        check_verified_sync(
            type(self).__name__,
            verify_publication=verify_publication,
            verify_checksums=verify_checksums,
            model_version=model_version,
            receipt_timeout_s=receipt_timeout_s,
            checksums_need_publication=False,
        )
        if transport not in ("ipc", "nixl"):
            raise ValueError(
                f"transport must be 'ipc' (colocated) or 'nixl' (across "
                f"machines), got {transport!r}"
            )
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
        has_world_size = callable(getattr(client, "get_world_size", None))
        if transport == "nixl" and not has_world_size:
            raise ValueError(
                f"transport='nixl' needs a client with get_world_size() (how many "
                f"workers pull); {type(client).__name__} has none. Use a client "
                "from vllm.distributed.weight_transfer.clients"
            )
        if label_outputs and not callable(getattr(client, "get_weight_version", None)):
            raise ValueError(
                f"label_outputs=True reads the engine's weight version label, "
                f"and {type(client).__name__} has no get_weight_version(). Use "
                "a client from vllm.distributed.weight_transfer.clients"
            )
        self.label_outputs = label_outputs
        self.transport = transport
        self.producer_host = producer_host
        self.stall_timeout_s = stall_timeout_s
        self._server: AdapterServer | None = None
        self._payload: torch.Tensor | None = None
        self.client = client
        self.rank = rank
        # Each worker checks the bytes it read against the trainer's checksum.
        self.verify_checksums = verify_checksums
        # What this pusher does, which can be less than asked (see above).
        self.verify_publication = verify_publication
        if verify_publication and not has_world_size:
            logger.warning(
                "LoRA adapter pushes through %s go unverified (no receipts): it "
                "has no get_world_size(), which says whose receipts to wait "
                "for. Use a client from vllm.distributed.weight_transfer.clients",
                type(client).__name__,
            )
            self.verify_publication = False
        self.receipt_timeout_s = receipt_timeout_s
        self._first_version = model_version
        # Each adapter name's version order (``ModelVersions``), by name.
        self._versions: dict[str, ModelVersions] = {}
        # The publication of the last push whose receipts all verified.
        self.last_publication: TrainerPublication | None = None
        self._buffer: ExportedBuffer | None = None
        # Names the client's server was told about (``register_lora_adapter``).
        self._registered: set[str] = set()

    def push(
        self, adapter: LoRAAdapter, *, version: str | None = None
    ) -> VerifiedPublication | None:
        """Push ``adapter``; returns once it serves (see the module
        docstring), with what the receipts verified (None when unverified)."""
        items = [(n, t.detach()) for n, t in adapter.tensors.items()]
        if not items:
            raise ValueError(f"adapter {adapter.name!r} has no tensors")
        if self.label_outputs and not (isinstance(version, str) and version):
            raise ValueError(
                f"adapter {adapter.name!r}: label_outputs=True names each "
                "push's version on the outputs, so push(..., version=...) needs "
                f"a non-empty string, got {version!r}"
            )
        commit_label = (
            (lambda: self._label_with(adapter.name, version))
            if self.label_outputs and version is not None
            else None
        )
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
        what = f"LoRA adapter push {adapter.name!r}"
        try:
            flat = self._packing_buffer(end, device)
            with torch.no_grad():
                for (_, tensor), offset in zip(items, offsets, strict=True):
                    nbytes = tensor.numel() * tensor.element_size()
                    place = flat[offset : offset + nbytes].view(tensor.dtype)
                    place.view(tensor.shape).copy_(tensor)
            sync_device(device)
            last = offsets[-1] + items[-1][1].numel() * items[-1][1].element_size()
            checksum = None
            if self.verify_checksums:
                from vllm.distributed.weight_transfer.verification.checksum import (
                    payload_checksum,
                )

                checksum = payload_checksum(flat[:last])
            pull = None
            if self.transport == "nixl":
                pull = self._adapter_server(device).open_push(last)
            pub = self._open_publication(adapter, items, device)
            header = AdapterHeader(
                adapter.name,
                adapter.lora_id,
                adapter.config,
                version=version,
                last=True,
                # A verified push's checksum travels in its publication.
                checksum=checksum if pub is None else None,
            )
            message: dict[str, Any] = {
                "names": [n for n, _ in items],
                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in items],
                "shapes": [list(t.shape) for _, t in items],
                "tensor_sizes": [t.numel() * t.element_size() for _, t in items],
                "offsets": offsets,
                ADAPTER_KEY: header.to_dict(),
            }
            if pull is not None:
                message[ADAPTER_PULL_KEY] = pull.to_dict()
            else:
                assert self._buffer is not None
                handle = self._buffer.handle.to_dict()
                message["ipc_handles"] = {device_key(device, self.rank): handle}
            if pub is not None:
                message = pub.attach(
                    message, checksums=[checksum] if checksum is not None else ()
                )
            try:
                if pull is not None:
                    self._send_pulled(
                        message, pub, what, pull, flat[:last], commit_label
                    )
                else:
                    self._send(message, pub, what, commit_label=commit_label)
            finally:
                if pub is not None:
                    pub.close()
        except BaseException as e:
            self.close()
            refused = _as_refusal(e)
            if refused is None:
                raise
            raise refused from e
        register = getattr(self.client, "register_lora_adapter", None)
        if callable(register) and adapter.name not in self._registered:
            # A server that names adapters for OpenAI requests (``model=name``)
            # learns this one; its requests then reach it by its memory path.
            register(adapter.name, memory_path(adapter.name))
            self._registered.add(adapter.name)
        return pub.verified if pub is not None else None

    def _open_publication(
        self,
        adapter: LoRAAdapter,
        items: list[tuple[str, torch.Tensor]],
        device: torch.device,
    ) -> TrainerPublication | None:
        """The publication of this push (None when unverified): the
        adapter's tensors as its manifest, the next version of the adapter's
        own order, receipts through shared memory (or, when pulled, the
        producer)."""
        if not self.verify_publication:
            return None
        versions = self._versions.get(adapter.name)
        if versions is None:
            versions = self._versions[adapter.name] = ModelVersions(self._first_version)
        if self.transport == "nixl":
            assert self._server is not None  # made by open_push, before this
            # Pulled from another machine: receipts come back through the
            # producer, not a shared-memory directory.
            channel = {"channel": "producer", "inbox": self._server.receipts}
        else:
            channel = {"channel": "shm"}
        return TrainerPublication.open(
            backend="sharded_rdt" if self.transport == "nixl" else "ipc",
            model_version=versions.next(),
            metas=[ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in items],
            trainer_devices=[device_identity(device)],
            checksums=self.verify_checksums,
            **channel,
        )

    def _send_pulled(
        self,
        message: dict[str, Any],
        pub: TrainerPublication | None,
        what: str,
        pull: AdapterPull,
        payload: torch.Tensor,
        commit_label: Callable[[], str] | None,
    ) -> None:
        """``_send`` with the producer serving ``payload`` while the workers
        handle the message: they register, then pull it."""
        server = self._server
        assert server is not None
        workers = served_workers(expected_workers(self.client))
        stop = threading.Event()

        def update(message: dict[str, Any]) -> None:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                serving = pool.submit(server.serve, pull, payload, workers, stop)
                try:
                    self.client.update_weights(message)
                except BaseException as e:
                    stop.set()
                    server.fail(pull, f"a worker refused the adapter: {e}")
                    raise
                serving.result()

        self._send(message, pub, what, update=update, commit_label=commit_label)

    def _send(
        self,
        message: dict[str, Any],
        pub: TrainerPublication | None,
        what: str,
        update: Callable[[dict[str, Any]], None] | None = None,
        commit_label: Callable[[], str] | None = None,
    ) -> None:
        """One update (``trainer.sync``) whose send step is the message
        (through ``update`` when given); the commit sets the label
        ``commit_label()`` names (read right before it; None: the label is
        left as it is). The push waits for another's open update, never
        abandoning it; on a failure the version before keeps serving, and
        the served weight version is left as it is (only an adapter
        failed)."""
        run_sync(
            self.client,
            lambda: (update or self.client.update_weights)(message),
            who=what,
            pub=pub,
            expected=lambda: expected_workers(self.client),
            receipt_timeout_s=self.receipt_timeout_s,
            weight_version=commit_label,
            take_over=False,
            wait_s=self.start_wait_s,
            fence=False,
        )
        if pub is not None:
            self.last_publication = pub

    def _label_with(self, name: str, version: str) -> str:
        """The engine's label now, with adapter ``name`` at ``version``."""
        base, adapters = split_adapter_label(self.client.get_weight_version())
        return label_with_adapters(base, {**adapters, name: version})

    def _packing_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The uint8 buffer the adapter is packed in: exported (shared memory
        or CUDA IPC) for ``ipc``, plain memory the producer reads for
        ``nixl``."""
        if self.transport == "ipc":
            flat = self._buffer_for(nbytes, device).tensor
            assert flat is not None
            return flat
        payload = self._payload
        if payload is None or payload.device != device or payload.numel() < nbytes:
            payload = self._payload = torch.empty(
                nbytes, dtype=torch.uint8, device=device
            )
        return payload

    def _adapter_server(self, device: torch.device) -> AdapterServer:
        if self._server is None:
            self._server = AdapterServer(
                host=self.producer_host,
                stall_timeout_s=self.stall_timeout_s,
                device=device,
            )
        return self._server

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
        server, self._server = self._server, None
        if server is not None:
            server.close()
        self._payload = None
