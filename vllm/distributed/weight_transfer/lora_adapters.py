# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LoRA adapters pushed from a trainer's memory into a worker's LoRA manager.

An adapter push is an update of the weight-transfer lifecycle whose messages
carry an ``adapter`` header (``AdapterHeader``) instead of base weights: the
worker copies the adapter's tensors out of the trainer's buffer into memory it
owns (``AdapterStaging``), checks the whole adapter once the last message
arrived (names, rank, shapes against the served checkpoint, the engine's LoRA
limits; ``check_adapter``) and, at ``finish_weight_update``, makes it the
version that serves under its name and integer id (``MemoryAdapters.commit``).
The base weights are not touched, nothing is written to disk, and a push that
fails or is aborted before the finish leaves the version before it serving.
A verified push (the trainer's default) also carries a publication header:
each worker admits every tensor against its manifest, writes a receipt of
what it staged at the trainer's prepare message, and refuses a version older
than the one its adapter name serves (``lora_publication``).

Serving reads adapters through vLLM's own LoRA manager, which loads an adapter
when a request names an id it does not hold, and drops all of them after every
base-weight update. ``install_memory_loader`` makes that load answer from
memory for the ids pushed here (building the adapter with
``LoRAModel.from_lora_tensors``); every other id still loads from its path. A
commit drops the id from the LoRA manager, so the next engine step loads the
new version: requests switch between two steps, never inside one, and never
see a half-written adapter. Each worker of a TP group receives the whole
adapter and vLLM's LoRA layers take their own slices, as for an adapter read
from disk.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm.distributed.weight_transfer.lora_publication import AdapterPublication
from vllm.distributed.weight_transfer.verification import (
    Receipt,
    check_model_version,
    pop_publication,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

# The PEFT prefix of adapter tensor names (``base_model.model.<module>...``).
PEFT_PREFIX = "base_model.model."
ADAPTER_KEY = "adapter"
# ``LoRARequest.lora_path`` of an adapter pushed from memory, by name.
MEMORY_SCHEME = "memory://"


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
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(
                f"adapter name must be a non-empty string, got {self.name!r}"
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
        return AdapterHeader.from_dict(update_info[ADAPTER_KEY])
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


def check_adapter(
    header: AdapterHeader,
    shapes: Mapping[str, tuple[int, ...]],
    base_shapes: Mapping[str, tuple[int, ...]] | None,
    max_rank: int | None,
) -> list[str]:
    """What is wrong with an adapter (tensor name -> shape), as messages; empty
    when nothing is. ``base_shapes`` are the served checkpoint's tensor shapes
    (None when unknown: module and shape checks then rest on vLLM's own)."""
    config = header.config
    errors: list[str] = []
    if max_rank is not None and config.rank > max_rank:
        errors.append(
            f"rank {config.rank} is above the engine's max_lora_rank {max_rank}"
        )
    if not shapes:
        errors.append("it has no tensors")
    modules: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        try:
            module, half = module_of(name)
        except ValueError as e:
            errors.append(str(e))
            continue
        modules.setdefault(module, {})[half] = tuple(shape)
    for module, halves in sorted(modules.items()):
        if module.rsplit(".", 1)[-1] not in config.target_modules:
            errors.append(
                f"{module} is not among target_modules {list(config.target_modules)}"
            )
            continue
        if set(halves) != {"A", "B"}:
            missing = "lora_B" if "A" in halves else "lora_A"
            errors.append(f"{module} has no {missing}")
            continue
        a, b = halves["A"], halves["B"]
        if len(a) != 2 or len(b) != 2 or a[0] != config.rank or b[1] != config.rank:
            errors.append(
                f"{module}: lora_A {list(a)} and lora_B {list(b)} do not have rank "
                f"{config.rank} (lora_A [r, in], lora_B [out, r])"
            )
            continue
        if base_shapes is None:
            continue
        base = base_shapes.get(f"{module}.weight")
        if base is None:
            errors.append(f"{module} is not a module of the served model")
        elif len(base) != 2 or (b[0], a[1]) != (base[0], base[1]):
            errors.append(
                f"{module}: lora_B @ lora_A is {[b[0], a[1]]} but the served "
                f"weight is {list(base)}"
            )
    return errors


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

    def add(
        self, header: AdapterHeader, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Copy one message's tensors (views of the trainer's buffer) in."""
        if self.complete:
            raise ValueError(
                f"adapter {header.name!r}: a message after the push's last one"
            )
        if self.header is not None and (
            self.header.name,
            self.header.lora_id,
            self.header.config,
            self.header.version,
        ) != (header.name, header.lora_id, header.config, header.version):
            raise ValueError(
                f"one update carries two adapters ({self.header.name!r} id "
                f"{self.header.lora_id}, then {header.name!r} id {header.lora_id}); "
                "push each in an update of its own"
            )
        self.header = header
        for name, tensor in tensors:
            if name in self.tensors:
                raise ValueError(f"adapter {header.name!r}: {name} arrived twice")
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

    def check_ids(self, header: AdapterHeader) -> list[str]:
        """An id already serving another name, or a name serving under
        another id, as messages."""
        with self._lock:
            errors = []
            held = self._live.get(header.lora_id)
            if held is not None and held.name != header.name:
                errors.append(
                    f"lora_id {header.lora_id} already serves adapter {held.name!r}"
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


def memory_adapters() -> MemoryAdapters:
    """This process's registry of adapters pushed from memory."""
    return _registry


def install_memory_loader() -> None:
    """Make vLLM's worker LoRA manager build adapters pushed from memory
    instead of loading them from their path (once per process). A request
    whose id was pushed here but whose name differs is refused."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from vllm.lora.worker_manager import WorkerLoRAManager

        from_path = WorkerLoRAManager._load_adapter

        def load_adapter(self: Any, lora_request: Any) -> Any:
            name, lora_id = lora_request.lora_name, lora_request.lora_int_id
            path = getattr(lora_request, "lora_path", "") or ""
            held = _registry.get(lora_id)
            if held is None and path.startswith(MEMORY_SCHEME):
                held = _registry.by_name(path.removeprefix(MEMORY_SCHEME))
                if held is None:
                    from vllm.exceptions import LoRAAdapterNotFoundError

                    # Upstream's not-found error, which the OpenAI server
                    # answers with 404, saying why.
                    error = LoRAAdapterNotFoundError(name, path)
                    error.message += (
                        "; no LoRA adapter was pushed to this engine under the "
                        f"name {path.removeprefix(MEMORY_SCHEME)!r}: push it with "
                        "push_lora_adapter first"
                    )
                    raise error
            if held is None:
                return from_path(self, lora_request)
            if held.name != name and path != memory_path(held.name):
                raise ValueError(
                    f"LoRA id {lora_id} serves the adapter {held.name!r} pushed "
                    f"by a trainer, not {name!r}"
                )
            if lora_id != held.lora_id:
                _registry.note_built(held.name, lora_id)
            return held.build(self, lora_id)

        WorkerLoRAManager._load_adapter = load_adapter  # type: ignore[method-assign]
        _installed = True


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
            raise ValueError(
                f"adapter {header.name!r}: this engine runs without LoRA; start "
                "it with enable_lora=True (and max_lora_rank at least the "
                "adapter's rank)"
            )
        staging = self.staging
        if staging is None:
            staging = self.staging = AdapterStaging()
        tensors = list(tensors)
        if self.publication is not None:
            self.publication.admit(tensors)
        staging.add(header, tensors)
        if self.publication is not None:
            self.publication.staged(tensors)
        if staging.complete:
            shapes = {n: tuple(t.shape) for n, t in staging.tensors.items()}
            errors = self.registry.check_ids(header) + check_adapter(
                header, shapes, self.base_shapes, self.max_rank
            )
            if errors:
                self.staging = None
                raise ValueError(
                    f"adapter {header.name!r} (lora_id {header.lora_id}) refused, "
                    f"nothing changed: {'; '.join(errors[:8])}"
                    + (f"; and {len(errors) - 8} more" if len(errors) > 8 else "")
                )

    def check_complete(self) -> None:
        """Refuse a finish that would commit a push cut short."""
        staging = self.staging
        if staging is not None and not staging.complete:
            name = staging.header.name if staging.header is not None else "?"
            self.staging = None
            raise ValueError(
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
