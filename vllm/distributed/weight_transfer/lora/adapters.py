# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LoRA adapters pushed from a trainer's memory into a worker's LoRA manager.

An adapter push is an update of the weight-transfer lifecycle whose messages
carry an ``adapter`` header (``AdapterHeader``) instead of base weights: the
worker copies the adapter's tensors out of the trainer's buffer into memory it
owns (``AdapterStaging``) and, at ``finish_weight_update``, makes it the
version that serves under its name and integer id (``MemoryAdapters.commit``).
The base weights are not touched, nothing is written to disk, and a push that
fails or is aborted before the finish leaves the version before it serving.
Each message is checked against the header before any of its bytes is copied
(names, rank, shapes against the served checkpoint, a name sent twice;
``tensor_errors``), so a push stages at most what its header allows; its first
message is checked for an id another adapter holds, whatever loaded it
(``MemoryAdapters.check_ids``); the last, for the whole adapter
(``check_adapter``). A refusal is an ``AdapterRefused``.
A verified push (the trainer's default) also carries a publication header:
each worker admits every tensor against its manifest, writes a receipt of
what it staged at the trainer's prepare message, and refuses a version older
than the one its adapter name serves (``lora_publication``).

Serving reads adapters through vLLM's own LoRA manager, which loads an adapter
when a request names an id it does not hold, and drops all of them after every
base-weight update. ``install_memory_loader`` makes that load answer from
memory for the ids pushed here (building the adapter with
``LoRAModel.from_lora_tensors``); every other id still loads from its path,
noted so that no push takes its id. While an engine step activates its
adapters, where a raise stops the engine, a request naming a pushed id with
another name raises nothing: the pushed adapter serves it and the clash is
logged (a preload of it, ``add_lora``, is refused instead). A
commit drops the id from the LoRA manager, so the next engine step loads the
new version: requests switch between two steps, never inside one, and never
see a half-written adapter. Each worker of a TP group receives the whole
adapter and vLLM's LoRA layers take their own slices, as for an adapter read
from disk.

This module holds a push's staging (`AdapterStaging`) and a worker engine's
side of pushes (`AdapterPushes`); ``lora.wire`` holds the header and its
checks, ``lora.memory`` the adapters in memory and the LoRA manager's loader.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from vllm.distributed.weight_transfer.lora.memory import (
    AdapterVersion,
    MemoryAdapters,
    install_memory_loader,
    lora_model_manager,
    memory_adapters,
)
from vllm.distributed.weight_transfer.lora.publication import AdapterPublication
from vllm.distributed.weight_transfer.lora.wire import (
    AdapterHeader,
    AdapterRefused,
    check_adapter,
    rank_errors,
    refusal,
    tensor_errors,
)
from vllm.distributed.weight_transfer.verification import (
    Receipt,
    check_model_version,
    describe_error,
    pop_publication,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


class AdapterStaging:
    """The adapter one push is bringing in: its tensors copied into memory the
    worker owns, until the push is checked and committed, or dropped."""

    def __init__(self) -> None:
        self.header: AdapterHeader | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.complete = False

    def message_errors(
        self,
        header: AdapterHeader,
        shapes: list[tuple[str, tuple[int, ...]]],
        base_shapes: Mapping[str, tuple[int, ...]] | None,
        max_rank: int | None,
    ) -> list[str]:
        """What refuses one message (tensor names and shapes) before any of
        its bytes is copied: a message after the last, a header other than
        the push's first, the rank, each tensor (``tensor_errors``) and a
        name staged before. What passes is at most the bytes the header
        allows, whatever the message announces."""
        if self.complete:
            return ["a message after the push's last one"]
        if self.header is not None and (
            self.header.name,
            self.header.lora_id,
            self.header.config,
            self.header.version,
        ) != (header.name, header.lora_id, header.config, header.version):
            return [
                f"one update carries two adapters ({self.header.name!r} id "
                f"{self.header.lora_id}, then {header.name!r} id "
                f"{header.lora_id}); push each in an update of its own"
            ]
        errors = rank_errors(header.config, max_rank)
        seen = set(self.tensors)
        for name, shape in shapes:
            if name in seen:
                errors.append(f"{name} arrived twice")
                continue
            seen.add(name)
            errors.extend(tensor_errors(header.config, name, shape, base_shapes))
        return errors

    def add(
        self, header: AdapterHeader, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Copy one message's tensors (views of the trainer's buffer) in,
        after ``message_errors`` found nothing."""
        self.header = header
        for name, tensor in tensors:
            self.tensors[name] = tensor.detach().to("cpu", copy=True)
        if header.last:
            self.complete = True


@dataclass
class AdapterPushes:
    """A worker engine's side of adapter pushes: the staging of the open
    update, its publication when the push is verified (``begin``,
    ``prepare``), and the commit at its finish. ``worker_rank`` and
    ``worker_device`` name this worker in receipts; ``receipt_root`` is where
    it may write them (``WorkerPublication``'s)."""

    model: torch.nn.Module
    base_shapes: Mapping[str, tuple[int, ...]] | None
    max_rank: int | None
    registry: MemoryAdapters = field(default_factory=memory_adapters)
    staging: AdapterStaging | None = None
    publication: AdapterPublication | None = None
    worker_rank: int = 0
    worker_device: str = "cpu"
    receipt_root: str | Path | None = None
    # Pushes committed by this engine (a counter for tests and metrics).
    committed: int = 0

    def __post_init__(self) -> None:
        # From now on every id the LoRA manager loads is known to check_ids.
        install_memory_loader()

    def held_ids(self) -> set[int]:
        """The ids the LoRA manager holds now, whatever loaded them."""
        manager = lora_model_manager(self.model)
        list_adapters = getattr(manager, "list_adapters", None)
        return set(list_adapters()) if callable(list_adapters) else set()

    def begin(
        self, header: AdapterHeader, update_info: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Take a message's publication header off it; returns the rest. At
        the push's first message, a verified push older than the version its
        adapter name serves is refused here, before anything is staged; a
        later message must name the same publication."""
        publication, checksums, rest = pop_publication(dict(update_info))
        if self.staging is not None or self.publication is not None:
            if self.publication is None:
                if publication is not None:
                    raise ValueError(
                        f"adapter {header.name!r}: a message with a publication "
                        "header in a push whose first message had none"
                    )
            else:
                self.publication.next_message(publication, checksums)
            return rest
        if publication is not None:
            check_model_version(
                publication,
                self.registry.model_version(header.name),
                f" of adapter {header.name!r}",
            )
            self.publication = AdapterPublication(
                publication,
                header.name,
                worker_rank=self.worker_rank,
                worker_device=self.worker_device,
                receipt_root=self.receipt_root,
            )
            self.publication.message_checksums = checksums
        return rest

    def expected_checksum(self, header: AdapterHeader) -> str | None:
        """The trainer's checksum of the message's buffer: the publication's
        when the push is verified, else the adapter header's (None: none)."""
        if self.publication is not None:
            return self.publication.expected_checksum()
        return header.checksum

    def check_checksum(self, header: AdapterHeader, expected: str, got: str) -> None:
        """Refuse the message when the bytes this worker read do not have the
        trainer's checksum; a match counts in the receipt."""
        if got != expected:
            raise ValueError(
                f"adapter {header.name!r}: checksum mismatch (the trainer sent "
                f"{expected}, this worker read {got}); nothing changed"
            )
        if self.publication is not None:
            self.publication.checksum_verified(expected, got)

    def receive(
        self, header: AdapterHeader, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Stage one message; on the last, check the whole adapter, so that
        every worker has refused a bad one before any commits."""
        if lora_model_manager(self.model) is None:
            raise AdapterRefused(
                f"adapter {header.name!r}: this engine runs without LoRA; start "
                "it with enable_lora=True (and max_lora_rank at least the "
                "adapter's rank)"
            )
        tensors = list(tensors)
        self._refuse_message(header, [(n, tuple(t.shape)) for n, t in tensors])
        staging = self.staging
        if staging is None:
            staging = self.staging = AdapterStaging()
        if self.publication is not None:
            self.publication.admit(tensors)
        staging.add(header, tensors)
        if self.publication is not None:
            self.publication.staged(tensors)
        if staging.complete:
            shapes_now = {n: tuple(t.shape) for n, t in staging.tensors.items()}
            errors = self.registry.check_ids(header, self.held_ids()) + check_adapter(
                header, shapes_now, self.base_shapes, self.max_rank
            )
            if not errors:
                errors = self.build_errors(AdapterVersion(header, staging.tensors))
            if errors:
                self.staging = None
                raise refusal(header, errors)

    def build_errors(self, version: AdapterVersion) -> list[str]:
        """vLLM's own refusal of building ``version`` (its PEFT config
        against the engine's LoRA config, its tensors against the model's
        LoRA modules), met here rather than in the engine step that would
        first load it, where a raise stops the engine. Empty when it builds,
        or when the engine's LoRA manager is not vLLM's."""
        manager = lora_model_manager(self.model)
        lora_config = getattr(manager, "lora_config", None)
        if lora_config is None or not hasattr(manager, "vocab_size"):
            return []
        from vllm.lora.lora_model import LoRAModel

        # What ``AdapterVersion.build`` reads of a worker's LoRA manager.
        worker_manager = SimpleNamespace(
            max_position_embeddings=None,
            lora_config=lora_config,
            _adapter_manager=manager,
            _lora_model_cls=LoRAModel,
            vocab_size=manager.vocab_size,
        )
        try:
            version.build(worker_manager)
        except Exception as e:
            return [f"vLLM cannot build it: {describe_error(e)}"]
        return []

    def check_layout(
        self,
        header: AdapterHeader,
        message: Mapping[str, Any],
        payload_bytes: int | None = None,
    ) -> None:
        """Refuse a message by the tensors it announces (``names``,
        ``shapes``, ``offsets``, ``tensor_sizes``) before any byte of it is
        mapped, pulled or copied; ``payload_bytes``, the size of a payload to
        pull, may not exceed the end of its last tensor."""
        fields = ("names", "shapes", "offsets", "tensor_sizes")
        lists = [message.get(key) for key in fields]
        if (
            not all(isinstance(v, list) for v in lists)
            or len({len(v) for v in lists if isinstance(v, list)}) != 1
        ):
            self.staging = None
            raise refusal(header, [f"{', '.join(fields)} must be lists of one length"])
        names, shapes, offsets, sizes = (v for v in lists if isinstance(v, list))
        self._refuse_message(
            header,
            [
                (str(n), tuple(s) if isinstance(s, list) else (-1,))
                for n, s in zip(names, shapes, strict=True)
            ],
        )
        ends = [
            o + z
            for o, z in zip(offsets, sizes, strict=True)
            if isinstance(o, int) and isinstance(z, int)
        ]
        end = max(ends, default=0)
        if payload_bytes is not None and payload_bytes > end:
            self.staging = None
            raise refusal(
                header,
                [f"the payload is {payload_bytes} B but its tensors end at {end} B"],
            )

    def _refuse_message(
        self, header: AdapterHeader, shapes: list[tuple[str, tuple[int, ...]]]
    ) -> None:
        """Refuse one message by its tensors' names and shapes
        (``AdapterStaging.message_errors``) and, at the push's first, by its
        id (``MemoryAdapters.check_ids``); the push is dropped."""
        staging = self.staging or AdapterStaging()
        errors = staging.message_errors(header, shapes, self.base_shapes, self.max_rank)
        if self.staging is None:
            errors = self.registry.check_ids(header, self.held_ids()) + errors
        if errors:
            self.staging = None
            raise refusal(header, errors)

    def check_complete(self) -> None:
        """Refuse a finish that would commit a push cut short."""
        staging = self.staging
        if staging is not None and not staging.complete:
            name = staging.header.name if staging.header is not None else "?"
            self.staging = None
            raise AdapterRefused(
                f"adapter {name!r}: the update finished before the push's last "
                "message; nothing changed"
            )

    def prepare(self) -> Receipt | None:
        """Before the commit (the trainer's prepare message, or the finish):
        refuse a push cut short, then write this worker's receipt of a
        verified push (once)."""
        self.check_complete()
        if self.staging is None or self.publication is None:
            return None
        return self.publication.prepare()

    def commit(self) -> AdapterVersion | None:
        """At the finish, after ``prepare``: the staged adapter becomes the
        version serving, and the LoRA manager drops the one it holds, so the
        next step loads the new one."""
        staging, self.staging = self.staging, None
        publication, self.publication = self.publication, None
        if staging is None:
            return None
        header = staging.header
        assert header is not None and staging.complete  # check_complete
        install_memory_loader()
        version = AdapterVersion(
            header,
            staging.tensors,
            model_version=(
                publication.header.model_version if publication is not None else None
            ),
        )
        self.registry.commit(version)
        manager = lora_model_manager(self.model)
        if manager is not None:
            for lora_id in self.registry.ids_of(header.name, header.lora_id):
                manager.remove_adapter(lora_id)
        self.committed += 1
        logger.info(
            "LoRA adapter %r (id %d) version %s now serves (%d tensors)",
            header.name,
            header.lora_id,
            header.version,
            len(version.tensors),
        )
        return version

    def discard(self, reason: str | None = None) -> None:
        """Drop the open push; a verified one tells the trainer why."""
        self.staging = None
        publication, self.publication = self.publication, None
        if publication is not None:
            publication.fail(reason or "the update closed before the adapter's commit")
