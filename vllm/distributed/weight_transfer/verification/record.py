# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``SyncRecord``: the timing of one sync on one side (trainer or worker),
phase by phase, and the one log line it becomes. Publications fill one per
sync; ``serving.metrics`` turns the server's into Prometheus samples."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from vllm.distributed.weight_transfer.verification.wire import (
    PublicationHeader,
    describe_error,
)


@dataclass
class SyncRecord:
    """Timing of one sync on one side; ``phase`` blocks accumulate."""

    backend: str
    side: str
    publication_id: str | None = None
    model_version: int | None = None
    nbytes: int = 0
    # Bytes the transport read, where it differs from ``nbytes`` (deltas).
    read_bytes: int | None = None
    phases: dict[str, float] = field(default_factory=dict)
    seconds: float | None = None
    ok: bool | None = None
    error: str | None = None
    failed_phase: str | None = None
    _started: float = field(default_factory=time.perf_counter, repr=False)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a block as ``name``; an exception marks the phase as failed."""
        started = time.perf_counter()
        try:
            yield
        except BaseException:
            if self.failed_phase is None:
                self.failed_phase = name
            raise
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + (
                time.perf_counter() - started
            )

    def bind(self, header: PublicationHeader) -> None:
        self.publication_id = header.publication_id
        self.model_version = header.model_version

    def finish(self, ok: bool = True, error: BaseException | str | None = None) -> None:
        self.seconds = time.perf_counter() - self._started
        self.ok = ok
        if error is not None:
            self.error = " ".join(describe_error(error).split())[:500]

    @property
    def gb_per_s(self) -> float:
        if not self.seconds:
            return 0.0
        return self.nbytes / self.seconds / 1e9

    def log_line(self) -> str:
        seconds = self.seconds if self.seconds is not None else 0.0
        what = f"weight sync [{self.backend} {self.side}]"
        if self.publication_id is not None:
            what += f" publication {self.publication_id[:12]}"
        if self.model_version is not None:
            what += f" v{self.model_version}"
        phases = ", ".join(f"{k} {v:.3f} s" for k, v in self.phases.items())
        if self.ok is False:
            where = f" in phase {self.failed_phase}" if self.failed_phase else ""
            return (
                f"{what}: FAILED after {seconds:.3f} s{where} "
                f"({self.nbytes / 1e9:.3f} GB moved): {self.error}; {phases}"
            )
        read = (
            ""
            if self.read_bytes is None
            else f", {self.read_bytes / 1e9:.3f} GB read as deltas and whole chunks"
        )
        return (
            f"{what}: {self.nbytes / 1e9:.3f} GB in {seconds:.3f} s "
            f"({self.gb_per_s:.2f} GB/s{read}); {phases}"
        )

    def log(self, logger: logging.Logger) -> None:
        if self.ok is False:
            logger.error("%s", self.log_line())
        else:
            logger.info("%s", self.log_line())
