# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Decoy bodies for ``vllm serve``'s update guard, shared by the backends'
HTTP tests.

``DECOYS`` holds, per case, how to wrap a trainer's real weights message
``m``: a list whose element 0 carries ``m`` next to a message of another
kind (abort, prepare, adapter), which the workers would read differently, and
the same list through ``/collective_rpc update_weights``; each with the
route, the body and the status the guard answers (422: the list mixes message
kinds; 403: weight methods go through the RL routes). A list of two elements
fits a server of one or two workers: the guard names the mixed kinds before it
checks the length.

``SendsDecoysFirst(inner, server)`` wraps a sync client: before the trainer's
first weights message reaches the server (after the start, so an update is
open, and before any weights, so generation is not held) it posts every decoy
around that message as raw HTTP and records the answer, the server's greedy
output and its ``/weight_info`` right after; then the real message goes on.
``assert_decoys_refused(client, before, label)`` checks each was refused with
its status and cause while the server served ``before`` under ``label``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import requests

from vllm.distributed.weight_transfer.testing.fresh_load import assert_bit_identical
from vllm.distributed.weight_transfer.testing.oracle import GreedyResult
from vllm.distributed.weight_transfer.testing.serve_state import weight_info

# case -> m -> (route, body, the status the guard answers)
DECOYS: dict[str, Callable[[Any], tuple[str, list[Any], int]]] = {
    "abort": lambda m: ("update_weights", [m, {"abort": "decoy"}], 422),
    "prepare": lambda m: ("update_weights", [m, {"prepare": "decoy-0123"}], 422),
    "adapter": lambda m: ("update_weights", [m, {"adapter": {}}], 422),
    "collective_rpc": lambda m: ("collective_rpc", [m, {"abort": "decoy"}], 403),
}
# What the guard's refusal names, per status.
REFUSAL_CAUSE = {422: "mixes message kinds", 403: "RL routes"}


def message_dict(update_info: Any) -> dict[str, Any]:
    """The JSON object of a sync client's ``update_info`` (a dict or a wire
    dataclass with ``to_dict``)."""
    to_dict = getattr(update_info, "to_dict", None)
    return to_dict() if callable(to_dict) else dict(update_info)


def is_weights(update_info: Any) -> bool:
    """Whether ``update_info`` is a weights message (not an abort or a
    prepare)."""
    message = message_dict(update_info)
    return "abort" not in message and "prepare" not in message


class SendsDecoysFirst:
    """A sync client that posts every decoy around its first weights message
    before sending it; see the module docstring. ``seen`` maps each case to
    (answer, greedy output right after, ``/weight_info`` right after)."""

    def __init__(self, inner: Any, server: Any) -> None:
        self.inner = inner
        self.server = server
        self.seen: dict[str, tuple[requests.Response, GreedyResult, dict]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def update_weights(self, update_info: Any) -> None:
        if not self.seen and is_weights(update_info):
            message = message_dict(update_info)
            for case, decoy in DECOYS.items():
                self.seen[case] = self._post(*decoy(message)[:2])
        self.inner.update_weights(update_info)

    def _post(
        self, route: str, body: list[Any]
    ) -> tuple[requests.Response, GreedyResult, dict]:
        if route == "collective_rpc":
            sent = {"method": "update_weights", "kwargs": {"update_info": body}}
        else:
            sent = {"update_info": body}
        base_url = self.server.base_url
        answer = requests.post(f"{base_url}/{route}", json=sent, timeout=120)
        return answer, self.server.greedy(), weight_info(self.server)


def assert_decoys_refused(
    client: SendsDecoysFirst, before: GreedyResult, label: dict[str, Any]
) -> None:
    """Every decoy was answered with its status naming the cause, and right
    after each the server served exactly ``before`` under ``label``."""
    assert set(client.seen) == set(DECOYS), sorted(client.seen)
    for case, (answer, served, seen_label) in client.seen.items():
        status = DECOYS[case]({})[2]
        assert answer.status_code == status, (case, answer.text)
        message = answer.json()["error"]["message"]
        assert REFUSAL_CAUSE[status] in message, (case, message)
        assert_bit_identical(served, before, what=f"vLLM after the {case} decoy")
        assert seen_label == label, (case, seen_label)
