# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What an adapter push's messages carry, and the checks of it: the
``adapter`` header (`AdapterHeader`, `AdapterConfig`), the PEFT tensor
names, the errors a message or a whole adapter is refused for
(``tensor_errors``, ``check_adapter``) and the refusal itself
(`AdapterRefused`, whose message starts with ``REFUSED_MARK`` on every
client). Also the ``lora_path`` that names an adapter pushed from memory
(``memory_path``). Pure: no torch, no LoRA manager."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.common.messages import ADAPTER_KEY
from vllm.distributed.weight_transfer.verification.wire import _PUBLICATION_ID_RE

__all__ = [
    "ADAPTER_KEY",
    "MEMORY_SCHEME",
    "PEFT_PREFIX",
    "REFUSED_MARK",
    "AdapterConfig",
    "AdapterHeader",
    "AdapterRefused",
    "adapter_header",
    "check_adapter",
    "memory_path",
    "module_of",
    "rank_errors",
    "refusal",
    "tensor_errors",
]

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
