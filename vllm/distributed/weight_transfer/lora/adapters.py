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
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from vllm.distributed.weight_transfer.common.messages import ADAPTER_KEY
from vllm.distributed.weight_transfer.lora.publication import AdapterPublication
from vllm.distributed.weight_transfer.verification import (
    Receipt,
    check_model_version,
    describe_error,
    pop_publication,
)
from vllm.distributed.weight_transfer.verification.wire import _PUBLICATION_ID_RE
from vllm.logger import init_logger

logger = init_logger(__name__)

# The PEFT prefix of adapter tensor names (``base_model.model.<module>...``).
PEFT_PREFIX = "base_model.model."
# An adapter name: a publication id's characters (letters, digits, '_', '-'),
# 1 to 64 of them, so a name cannot forge a log line, a label or a path.
_ADAPTER_NAME_RE = re.compile(_PUBLICATION_ID_RE.pattern.replace("{8,64}", "{1,64}"))
# ``LoRARequest.lora_path`` of an adapter pushed from memory, by name.
MEMORY_SCHEME = "memory://"


# Every refusal of an adapter push starts with this, on every client: a
# refusal that crossed a process boundary as a plain ``Exception`` is raised
# to the pusher's caller as ``AdapterRefused`` again (``lora_trainer``), and
# ``vllm serve`` answers it 400 (``lora_routes``).
REFUSED_MARK = "LoRA adapter refused: "


class AdapterRefused(ValueError):
    """An adapter push refused for what it carries (its header, names, rank,
    shapes or id); nothing changed. The message starts with
    ``REFUSED_MARK``."""

    def __init__(self, message: str) -> None:
        super().__init__(message if REFUSED_MARK in message else REFUSED_MARK + message)


def memory_path(name: str) -> str:
    """The ``LoRARequest.lora_path`` that names a pushed adapter: a request
    with it gets the adapter pushed under ``name`` whatever its int id (a
    server that numbers adapters itself, e.g. ``/v1/load_lora_adapter``)."""
    return f"{MEMORY_SCHEME}{name}"


@dataclass(frozen=True)
class AdapterConfig:
    """The part of a PEFT LoRA config an adapter push carries: ``rank`` (r),
    ``alpha`` (lora_alpha), ``target_modules`` (module name suffixes, e.g.
    ``q_proj``) and ``use_rslora`` (scale by alpha / sqrt(r))."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"adapter rank must be a positive int, got {self.rank!r}")
        if not isinstance(self.alpha, int | float) or not math.isfinite(self.alpha):
            raise ValueError(
                f"adapter alpha must be a finite number, got {self.alpha!r}"
            )
        if not self.target_modules or not all(
            isinstance(m, str) and m for m in self.target_modules
        ):
            raise ValueError(
                "adapter target_modules must be non-empty module names, got "
                f"{self.target_modules!r}"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def peft_config(self) -> dict[str, Any]:
        """As an ``adapter_config.json`` of PEFT's LoRA."""
        return {
            "peft_type": "LORA",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": list(self.target_modules),
            "bias": "none",
            "use_rslora": self.use_rslora,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "target_modules": list(self.target_modules),
            "use_rslora": self.use_rslora,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AdapterConfig:
        if not isinstance(d, Mapping):
            raise ValueError(f"adapter config must be an object, got {d!r}")
        unknown = set(d) - {"rank", "alpha", "target_modules", "use_rslora"}
        if unknown:
            raise ValueError(f"adapter config has unknown fields {sorted(unknown)}")
        modules = d.get("target_modules")
        if isinstance(modules, str) or not isinstance(modules, list | tuple):
            raise ValueError(
                f"adapter target_modules must be a list of names, got {modules!r}"
            )
        return cls(
            rank=d.get("rank"),  # type: ignore[arg-type]
            alpha=d.get("alpha"),  # type: ignore[arg-type]
            target_modules=tuple(modules),
            use_rslora=bool(d.get("use_rslora", False)),
        )


@dataclass(frozen=True)
class AdapterHeader:
    """What every message of an adapter push says: which adapter (``name``,
    ``lora_id``: the ``LoRARequest``'s name and int id), its ``version``
    label, its ``config``, and ``last`` on the push's final message."""

    name: str
    lora_id: int
    config: AdapterConfig
    version: str | None = None
    last: bool = False
    # The ``ws1`` checksum (``verification.checksum``) of the bytes of the
    # message's buffer its tensors span, when the trainer verifies pushes.
    checksum: str | None = None

    def __post_init__(self) -> None:
        # Names reach log lines, the status route and OpenAI model names.
        if not isinstance(self.name, str) or not _ADAPTER_NAME_RE.fullmatch(self.name):
            raise ValueError(
                f"adapter name {self.name!r} must be 1-64 characters of letters, "
                "digits, '_' or '-' (the publication id's characters)"
            )
        if isinstance(self.lora_id, bool) or not isinstance(self.lora_id, int):
            raise ValueError(f"adapter lora_id must be an int, got {self.lora_id!r}")
        if self.lora_id < 1:
            raise ValueError(f"adapter lora_id must be >= 1, got {self.lora_id}")
        if self.version is not None and not isinstance(self.version, str):
            raise ValueError(f"adapter version must be a string, got {self.version!r}")
        if self.checksum is not None and not isinstance(self.checksum, str):
            raise ValueError(
                f"adapter checksum must be a string, got {self.checksum!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "lora_id": self.lora_id,
            "config": self.config.to_dict(),
            "last": self.last,
        }
        if self.version is not None:
            out["version"] = self.version
        if self.checksum is not None:
            out["checksum"] = self.checksum
        return out

    @classmethod
    def from_dict(cls, d: Any) -> AdapterHeader:
        if not isinstance(d, Mapping):
            raise ValueError(f"update_info.adapter must be an object, got {d!r}")
        unknown = set(d) - {"name", "lora_id", "config", "version", "last", "checksum"}
        if unknown:
            raise ValueError(
                f"update_info.adapter has unknown fields {sorted(unknown)}"
            )
        return cls(
            name=d.get("name"),  # type: ignore[arg-type]
            lora_id=d.get("lora_id"),  # type: ignore[arg-type]
            config=AdapterConfig.from_dict(d.get("config")),  # type: ignore[arg-type]
            version=d.get("version"),
            last=bool(d.get("last", False)),
            checksum=d.get("checksum"),
        )


def adapter_header(update_info: Any) -> AdapterHeader | None:
    """The adapter header of an update message, or None for base weights."""
    if isinstance(update_info, Mapping) and ADAPTER_KEY in update_info:
        try:
            return AdapterHeader.from_dict(update_info[ADAPTER_KEY])
        except ValueError as e:
            raise AdapterRefused(f"malformed adapter header: {e}") from e
    return None


def module_of(tensor_name: str) -> tuple[str, str]:
    """``(module, "A" | "B")`` of a PEFT LoRA tensor name
    (``base_model.model.<module>.lora_A.weight``); ValueError otherwise."""
    name = tensor_name.removeprefix(PEFT_PREFIX)
    parts = name.split(".")
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise ValueError(
            f"{tensor_name!r} is not a LoRA tensor name "
            "('base_model.model.<module>.lora_A.weight' or '.lora_B.weight')"
        )
    return ".".join(parts[:-2]), parts[-2][-1]


def rank_errors(config: AdapterConfig, max_rank: int | None) -> list[str]:
    """The adapter's rank against the engine's ``max_lora_rank``."""
    if max_rank is not None and config.rank > max_rank:
        return [f"rank {config.rank} is above the engine's max_lora_rank {max_rank}"]
    return []


def tensor_errors(
    config: AdapterConfig,
    name: str,
    shape: tuple[int, ...],
    base_shapes: Mapping[str, tuple[int, ...]] | None,
) -> list[str]:
    """What is wrong with one tensor of an adapter, alone: a LoRA name of a
    module in ``target_modules``, ``lora_A`` ``[rank, in]`` and ``lora_B``
    ``[out, rank]`` with ``in`` and ``out`` the served weight's (when
    ``base_shapes``, the checkpoint's tensor shapes, are known). A tensor
    that passes has the size the header allows it, so a message is checked
    with this before any of its bytes is copied."""
    try:
        module, half = module_of(name)
    except ValueError as e:
        return [str(e)]
    if module.rsplit(".", 1)[-1] not in config.target_modules:
        return [f"{module} is not among target_modules {list(config.target_modules)}"]
    shape = tuple(shape)
    rank_at = 0 if half == "A" else 1
    if len(shape) != 2 or shape[rank_at] != config.rank:
        return [
            f"{name} is {list(shape)} and does not have rank {config.rank} "
            "(lora_A [r, in], lora_B [out, r])"
        ]
    if base_shapes is None:
        return []
    base = base_shapes.get(f"{module}.weight")
    if base is None:
        return [f"{module} is not a module of the served model"]
    # lora_A's columns are the weight's inputs, lora_B's rows its outputs.
    served = base[1 - rank_at] if len(base) == 2 else None
    if served != shape[1 - rank_at]:
        return [
            f"{name} is {list(shape)} but the served weight {module} is "
            f"{list(base)} (lora_B @ lora_A must have its shape)"
        ]
    return []


def check_adapter(
    header: AdapterHeader,
    shapes: Mapping[str, tuple[int, ...]],
    base_shapes: Mapping[str, tuple[int, ...]] | None,
    max_rank: int | None,
) -> list[str]:
    """What is wrong with a whole adapter (tensor name -> shape), as
    messages; empty when nothing is: the rank, each tensor
    (``tensor_errors``), and each module having both halves."""
    config = header.config
    errors = rank_errors(config, max_rank)
    if not shapes:
        errors.append("it has no tensors")
    modules: dict[str, set[str]] = {}
    for name, shape in shapes.items():
        found = tensor_errors(config, name, tuple(shape), base_shapes)
        errors.extend(found)
        with contextlib.suppress(ValueError):  # named by tensor_errors
            module, half = module_of(name)
            modules.setdefault(module, set()).add(half)
    for module, halves in sorted(modules.items()):
        if halves != {"A", "B"}:
            missing = "lora_B" if "A" in halves else "lora_A"
            errors.append(f"{module} has no {missing}")
    return errors


def refusal(header: AdapterHeader, errors: list[str]) -> AdapterRefused:
    """The error that refuses ``header``'s push for ``errors`` (at most
    eight named)."""
    return AdapterRefused(
        f"adapter {header.name!r} (lora_id {header.lora_id}), nothing changed: "
        f"{'; '.join(errors[:8])}"
        + (f"; and {len(errors) - 8} more" if len(errors) > 8 else "")
    )


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
