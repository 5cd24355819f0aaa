# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Adapters held in a worker process's memory, and how vLLM's LoRA manager
reaches them: one version per adapter (`AdapterVersion`, which builds the
manager's ``LoRAModel``), the process's registry of them by LoRA id with the
ids' bookkeeping (`MemoryAdapters`: aliases, ids loaded from a path, each
name's version order) and the loader that makes the LoRA manager answer
from memory for pushed ids (``install_memory_loader``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vllm.distributed.weight_transfer.lora.wire import (
    MEMORY_SCHEME,
    AdapterHeader,
    AdapterRefused,
    memory_path,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclass
class AdapterVersion:
    """One version of an adapter, held in memory: what the LoRA manager
    builds its ``LoRAModel`` from whenever it needs the adapter."""

    header: AdapterHeader
    tensors: dict[str, torch.Tensor]
    # The model version of the publication that pushed it (None: unverified).
    model_version: int | None = None

    @property
    def name(self) -> str:
        return self.header.name

    @property
    def lora_id(self) -> int:
        return self.header.lora_id

    def build(self, manager: Any, lora_id: int | None = None) -> Any:
        """The ``LoRAModel`` of this version for vLLM's worker LoRA manager
        ``manager`` (its dtype, vocabulary and name mapping), under
        ``lora_id`` (default: the id it was pushed under)."""
        from vllm.lora.peft_helper import PEFTHelper

        peft = PEFTHelper.from_dict(
            {
                **self.header.config.peft_config(),
                "vllm_max_position_embeddings": manager.max_position_embeddings,
            }
        )
        peft.validate_legal(manager.lora_config)
        model = manager._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is not None:
            mapper = mapper.get_rename_mapper()
        # Copies: the LoRA manager folds the scaling into lora_B in place when
        # it loads an adapter, and it loads this one again after every
        # base-weight update or eviction.
        return manager._lora_model_cls.from_lora_tensors(
            lora_model_id=self.lora_id if lora_id is None else lora_id,
            tensors={name: t.clone() for name, t in self.tensors.items()},
            peft_helper=peft,
            device="cpu",
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )


class MemoryAdapters:
    """The adapters pushed into this worker process, by LoRA id: the version
    serving now. One registry per process (``memory_adapters()``), as there
    is one LoRA manager per worker process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, AdapterVersion] = {}
        # Other ids the LoRA manager built a pushed adapter under (requests
        # that named it by ``memory_path``), by adapter name.
        self._aliases: dict[str, set[int]] = {}
        # Each adapter name's version order: the model version of its last
        # verified push (unverified pushes carry none and leave it).
        self._model_versions: dict[str, int] = {}
        # Adapters the LoRA manager loaded from their path, by id: their name.
        self._from_path: dict[int, str] = {}

    def get(self, lora_id: int) -> AdapterVersion | None:
        with self._lock:
            return self._live.get(lora_id)

    def by_name(self, name: str) -> AdapterVersion | None:
        with self._lock:
            return next((v for v in self._live.values() if v.name == name), None)

    def note_built(self, name: str, lora_id: int) -> None:
        """The LoRA manager holds ``name`` under ``lora_id`` too."""
        with self._lock:
            self._aliases.setdefault(name, set()).add(lora_id)

    def note_loaded_from_path(self, name: str, lora_id: int) -> None:
        """The LoRA manager loaded adapter ``name`` from its path under
        ``lora_id`` (``/v1/load_lora_adapter``, ``add_lora``, a request)."""
        with self._lock:
            self._from_path[lora_id] = name

    def ids_of(self, name: str, lora_id: int) -> set[int]:
        """Every id the LoRA manager may hold adapter ``name`` under."""
        with self._lock:
            return {lora_id, *self._aliases.get(name, ())}

    def names(self) -> dict[str, int]:
        with self._lock:
            return {v.name: lora_id for lora_id, v in self._live.items()}

    def model_version(self, name: str) -> int | None:
        """The model version adapter ``name`` committed last (None when no
        verified push of it committed): no push of it may be older."""
        with self._lock:
            return self._model_versions.get(name)

    def versions(self) -> dict[str, str | None]:
        """Adapter name -> the version label serving now."""
        with self._lock:
            return {v.name: v.header.version for v in self._live.values()}

    def check_ids(
        self, header: AdapterHeader, held_ids: Iterable[int] = ()
    ) -> list[str]:
        """An id already serving another name, whatever loaded it (a push, a
        path, or one of ``held_ids``, the ids the LoRA manager holds now), or
        a name serving under another id, as messages."""
        with self._lock:
            errors = []
            lora_id = header.lora_id
            held = self._live.get(lora_id)
            aliases = {i for ids in self._aliases.values() for i in ids}
            alias_of = [n for n, ids in self._aliases.items() if lora_id in ids]
            if held is not None and held.name != header.name:
                errors.append(f"lora_id {lora_id} already serves adapter {held.name!r}")
            elif alias_of and alias_of[0] != header.name:
                errors.append(
                    f"lora_id {lora_id} already serves the pushed adapter "
                    f"{alias_of[0]!r} (a server's id for its memory path)"
                )
            elif self._from_path.get(lora_id, header.name) != header.name:
                errors.append(
                    f"lora_id {lora_id} already serves adapter "
                    f"{self._from_path[lora_id]!r}, loaded from its path "
                    "(/v1/load_lora_adapter or add_lora); push under an id "
                    "nothing else uses, e.g. from 1000"
                )
            elif (
                lora_id in set(held_ids)
                and held is None
                and lora_id not in aliases
                and lora_id not in self._from_path
            ):
                errors.append(
                    f"lora_id {lora_id} already serves an adapter this engine "
                    "loaded from a path; push under an id nothing else uses, "
                    "e.g. from 1000"
                )
            for lora_id, version in self._live.items():
                if version.name == header.name and lora_id != header.lora_id:
                    errors.append(
                        f"adapter {header.name!r} already serves under lora_id "
                        f"{lora_id}"
                    )
            return errors

    def commit(self, version: AdapterVersion) -> AdapterVersion | None:
        """Make ``version`` the one serving; the one it replaces, if any."""
        with self._lock:
            old = self._live.get(version.lora_id)
            self._live[version.lora_id] = version
            if version.model_version is not None:
                self._model_versions[version.name] = version.model_version
            return old

    def remove(self, lora_id: int) -> None:
        """Forget the adapter serving under ``lora_id`` and its version order."""
        with self._lock:
            gone = self._live.pop(lora_id, None)
            if gone is not None:
                self._model_versions.pop(gone.name, None)


_registry = MemoryAdapters()
_install_lock = threading.Lock()
_installed = False
# Set while this thread's LoRA manager activates a step's adapters: a raise
# there stops the engine, so nothing about an adapter may raise then.
_engine_step = threading.local()


def in_engine_step() -> bool:
    """Whether this thread is activating an engine step's adapters."""
    return bool(getattr(_engine_step, "active", False))


@contextlib.contextmanager
def engine_step() -> Iterator[None]:
    """Marks this thread as activating an engine step's adapters."""
    _engine_step.active = True
    try:
        yield
    finally:
        _engine_step.active = False


def memory_adapters() -> MemoryAdapters:
    """This process's registry of adapters pushed from memory."""
    return _registry


def install_memory_loader() -> None:
    """Make vLLM's worker LoRA manager build adapters pushed from memory
    instead of loading them from their path (once per process), and note
    every id it loads from a path (``MemoryAdapters.check_ids``). A load
    whose id was pushed here under another name is refused when it is a
    preload (``add_lora``, ``/v1/load_lora_adapter``); inside an engine step,
    where a raise stops the engine, the pushed adapter serves the id and the
    clash is logged."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from vllm.lora.worker_manager import WorkerLoRAManager

        from_path = WorkerLoRAManager._load_adapter
        activate = WorkerLoRAManager.set_active_adapters

        def load_adapter(self: Any, lora_request: Any) -> Any:
            name, lora_id = lora_request.lora_name, lora_request.lora_int_id
            path = getattr(lora_request, "lora_path", "") or ""
            held = _registry.get(lora_id)
            if held is None and path.startswith(MEMORY_SCHEME):
                held = _registry.by_name(path.removeprefix(MEMORY_SCHEME))
                if held is None:
                    raise _never_pushed(name, path)
            if held is None:
                model = from_path(self, lora_request)
                _registry.note_loaded_from_path(name, lora_id)
                return model
            if held.name != name and path != memory_path(held.name):
                clash = (
                    f"lora_id {lora_id} serves the adapter {held.name!r} pushed "
                    f"by a trainer, not {name!r}"
                )
                if not in_engine_step():
                    raise AdapterRefused(f"{clash}; load {name!r} under another id")
                logger.warning("%s: the pushed adapter serves the request", clash)
            if lora_id != held.lora_id:
                _registry.note_built(held.name, lora_id)
            return held.build(self, lora_id)

        def set_active_adapters(self: Any, requests: Any, mapping: Any) -> None:
            with engine_step():
                activate(self, requests, mapping)

        WorkerLoRAManager._load_adapter = load_adapter  # type: ignore[method-assign]
        WorkerLoRAManager.set_active_adapters = set_active_adapters  # type: ignore[method-assign]
        _installed = True


def _never_pushed(name: str, path: str) -> Exception:
    """Upstream's not-found error, which the OpenAI server answers with 404,
    saying that no push filled the memory path."""
    from vllm.exceptions import LoRAAdapterNotFoundError

    error = LoRAAdapterNotFoundError(name, path)
    error.message += (
        "; no LoRA adapter was pushed to this engine under the name "
        f"{path.removeprefix(MEMORY_SCHEME)!r}: push it with push_lora_adapter "
        "first"
    )
    return error


def lora_model_manager(model: torch.nn.Module) -> Any:
    """The LoRA model manager serving ``model`` (vLLM sets it on the model),
    or None when the engine runs without LoRA."""
    return getattr(model, "lora_manager", None)
