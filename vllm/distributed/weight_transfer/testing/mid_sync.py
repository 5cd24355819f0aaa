# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Clients that act on a ``vllm serve`` while a weight update is open, for the
HTTP tests of its update guard.

``Completions(server)`` asks for the oracle prompts' greedy completions on a
thread; ``outcome()`` waits for them. ``CompletesMidSync(inner, server)``
wraps a sync client: once the trainer's first weights went out it starts
``Completions``, notes whether they still wait 1.5 s later and whether the
server reports itself paused, and posts a ``/resume``. ``AbandonedMidSync``
wraps one too: after the first weights message a second client tries to
start an update without taking over (it waits, then gives up), then aborts
the open update with ``REASON``, and the label and greedy output served right
after are noted. ``Careless`` describes what a client sends after
``POST /start_weight_update`` instead of a sync, and what the server must
answer; ``update_with_manifest_dtype`` builds one such body.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import requests
import torch

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.testing.guard_decoys import is_weights
from vllm.distributed.weight_transfer.testing.oracle import (
    GreedyResult,
    completions_greedy,
)
from vllm.distributed.weight_transfer.testing.serve_state import post, weight_info
from vllm.distributed.weight_transfer.verification import (
    Manifest,
    PublicationHeader,
    attach_publication,
)

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.testing.server import ServerProcess


class Completions(threading.Thread):
    """The oracle prompts through ``/v1/completions`` on a thread."""

    def __init__(self, server: ServerProcess) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.result: GreedyResult | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = completions_greedy(
                self.server.base_url, self.server.model, timeout=120
            )
        except BaseException as e:
            self.error = e

    def outcome(self, timeout_s: float = 120) -> GreedyResult:
        self.join(timeout_s)
        assert not self.is_alive(), "the completions never came back"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


class CompletesMidSync:
    """A sync client that, once the first weights went out, sends completions
    and a ``/resume`` and notes what the server did with them."""

    def __init__(self, inner: HTTPVLLMWeightSyncClient, server: ServerProcess):
        self.inner = inner
        self.server = server
        self.completions: Completions | None = None
        self.waited = False
        self.paused = False
        self.resume: requests.Response | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def update_weights(self, update_info: Any) -> None:
        self.inner.update_weights(update_info)
        control = isinstance(update_info, dict) and (
            "abort" in update_info or "prepare" in update_info
        )
        if self.completions is None and not control:
            self.completions = Completions(self.server)
            self.completions.start()
            time.sleep(1.5)
            self.waited = self.completions.is_alive()
            self.paused = self.inner.is_paused()
            self.resume = post(self.server, "resume")


class AbandonedMidSync:
    """A sync client after whose first accepted weights message (generation
    held, the model half landed) a second client acts on the open update:
    a LoRA pusher that waits (``take_over=False``), then one that abandons
    it (abort and finish, what ``push_lora_adapter`` did before)."""

    REASON = "abandoned: a LoRA pusher took the server"

    def __init__(self, inner: HTTPVLLMWeightSyncClient, server: ServerProcess):
        self.inner = inner
        self.server = server
        self.waited: BaseException | None = None
        self.label: str | None = None
        self.served: GreedyResult | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def update_weights(self, update_info: Any) -> None:
        self.inner.update_weights(update_info)
        if self.label is not None or not is_weights(update_info):
            return
        from vllm.distributed.weight_transfer.trainer.start_update import (
            UpdateStillOpen,
            start_update,
        )
        from vllm.distributed.weight_transfer.trainer.sync import abort_update

        other = HTTPVLLMWeightSyncClient(self.server.base_url, timeout=120)
        try:
            start_update(other, "a LoRA pusher", take_over=False, wait_s=1.0)
        except UpdateStillOpen as e:
            self.waited = e
        abort_update(other, self.REASON)
        self.label = weight_info(self.server)["weight_version"]
        self.served = self.server.greedy()


@dataclass(frozen=True)
class Careless:
    """What a client sends after ``POST /start_weight_update``, and what the
    server must answer."""

    update_info: Any  # the body's update_info; None: no update_weights at all
    refusal: str | None = None  # the cause the refusal names
    # /metrics counts the refusal once, under one of these phases
    failure_phases: tuple[str, ...] = ()
    seed: int = 0  # the trainer's weights for the recovering sync


def update_with_manifest_dtype(dtype: Any) -> dict[str, Any]:
    """An ``ipc`` update message (no tensors) whose publication header lists
    one manifest entry with the dtype ``dtype``."""
    header = PublicationHeader.create(
        backend="ipc",
        model_version=1,
        manifest=Manifest.from_params(
            [ParamMeta("model.norm.weight", torch.float32, (128,))]
        ),
        trainer_devices=["cpu:test:0"],
    )
    update = attach_publication({"names": []}, header)
    update["publication"]["manifest"]["entries"][0][1] = dtype
    return update
