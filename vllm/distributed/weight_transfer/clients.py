# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Trainer-side clients of the inference engine's weight-sync control plane.

A trainer engine drives ``init -> start -> update* -> finish`` through any object
with the four methods of ``VLLMWeightSyncClient``. Three are provided:

* ``HTTPVLLMWeightSyncClient(base_url, timeout=300)``: the RL routes of
  ``vllm serve`` (``VLLM_SERVER_DEV_MODE=1``). Bodies are plain JSON; the
  fork's own updates are never pickled, so the server needs no
  ``VLLM_ALLOW_INSECURE_SERIALIZATION``. A
  failed call raises ``requests.HTTPError`` carrying the server's message;
  every call is bounded by ``timeout`` seconds, and a call that gets no answer
  in time raises ``WeightSyncReadTimeout``, which is both the builtin
  ``TimeoutError`` and the ``requests.exceptions.ReadTimeout`` upstream's
  client raises. The one exception to plain JSON is upstream 0.32's form: an
  update whose ``ipc_handles`` are raw ``reduce_tensor`` tuples (not the
  fork's JSON handle objects) travels, as upstream's client sends it, in
  ``ipc_handles_pickled`` (base64 pickle), which a server unpickles only under
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.
* ``RayVLLMWeightSyncClient(handle | [handles], timeout=None)``: ``LLM`` or
  ``AsyncLLM`` Ray actors. Each call fans out to every actor and waits for all
  of them; with ``timeout`` set, at most that many seconds (then Ray's
  ``GetTimeoutError``, a ``TimeoutError``). ``finish_weight_update(v)`` is
  upstream's two calls, ``finish_weight_update()`` then
  ``update_weight_version(v)``, so any actor with upstream's methods works.
* ``OfflineLLMWeightSyncClient(llm)``: an ``LLM`` in the trainer's own process.

Beyond the four sync calls, each client can set and read the weight version
the server reports (``update_weight_version(new_version)``,
``get_weight_version()``) and ask how many workers it
runs, data-parallel ranks included (``get_world_size()``). Verified publication
uses both: the version becomes visible only after every worker's receipt was
checked, and receipts are expected from that many workers.

For the commit (``full_resync.commit_update``) the HTTP and offline clients
can also hold generation for just that call (``pause_generation("keep")``,
``resume_generation()``, ``is_paused()``: the ``/pause`` routes over HTTP,
``sleep(level=0)`` and ``wake_up(tags=["scheduling"])`` on ``LLM``), and every
client can drop the KV cache computed with the old weights
(``reset_prefix_cache(reset_running_requests=True)``: running requests are
preempted and recomputed with the new weights). The Ray client does not hold
generation: an actor serves one call at a time, so a generate call queued
between the pause and the resume would wait forever. Against the fork's
``vllm serve`` the HTTP client does none of that: the server holds
generation for the commit itself (``update_guard``) and says so on its answer
to ``start_weight_update``, so the commit is one ``finish_weight_update``
call (``server_holds_commit``).

Update payloads are dicts (or a list of dicts, one per worker); objects with a
``to_dict()`` method, such as ``IPCWeightTransferUpdateInfo``, are converted.
``requests`` and ``ray`` are imported on first use.
"""

from __future__ import annotations

import base64
import json
import pickle
from typing import TYPE_CHECKING, Any

import requests

from vllm.distributed.weight_transfer.base import (
    WeightTransferInitRequest,
    WeightTransferUpdatePayload,
    WeightTransferUpdateRequest,
)
from vllm.distributed.weight_transfer.serving.update_guard import (
    COMMIT_HOLD_HEADER,
    COMMIT_HOLD_VALUE,
)

if TYPE_CHECKING:
    from ray.actor import ActorHandle

DEFAULT_TIMEOUT_S = 300.0


class WeightSyncReadTimeout(TimeoutError, requests.exceptions.ReadTimeout):
    """The server did not answer an HTTP weight-sync call within the client's
    timeout. Callers may catch it as ``TimeoutError`` or as ``requests``'
    ``ReadTimeout`` / ``Timeout`` / ``RequestException``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # requests' constructor (it keeps ``request=`` / ``response=``); the
        # builtin one, first in the MRO, takes no keywords.
        requests.exceptions.ReadTimeout.__init__(self, *args, **kwargs)


def _plain(payload: Any) -> Any:
    if isinstance(payload, list):
        return [_plain(p) for p in payload]
    to_dict = getattr(payload, "to_dict", None)
    return to_dict() if callable(to_dict) else payload


def _has_raw_ipc_handles(handles: Any) -> bool:
    maps = handles if isinstance(handles, list) else [handles]
    return any(
        isinstance(m, dict) and any(isinstance(h, tuple) for h in m.values())
        for m in maps
    )


def _http_update_info(info: Any) -> Any:
    """``info`` with raw upstream ``ipc_handles`` moved into
    ``ipc_handles_pickled``, as upstream 0.32's HTTP client sends them; the
    fork's JSON handle objects are left as they are."""
    if isinstance(info, list):
        return [_http_update_info(i) for i in info]
    if not isinstance(info, dict) or not _has_raw_ipc_handles(info.get("ipc_handles")):
        return info
    out = {k: v for k, v in info.items() if k != "ipc_handles"}
    pickled = pickle.dumps(info["ipc_handles"])
    out["ipc_handles_pickled"] = base64.b64encode(pickled).decode("ascii")
    return out


class HTTPVLLMWeightSyncClient:
    """Drives a ``vllm serve`` process over its RL HTTP routes."""

    def __init__(self, base_url: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        # Set from the answer to start_weight_update: the fork's server holds
        # generation for the commit itself (update_guard), so the trainer's
        # commit is the finish alone.
        self.server_holds_commit = False

    def _post(
        self,
        route: str,
        body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        response = self._send(route, body, params)
        return response.json() if response.content else None

    def _send(
        self,
        route: str,
        body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
    ) -> requests.Response:
        url = f"{self.base_url}/{route}"
        data = None
        if body is not None:
            try:
                data = json.dumps(body)
            except (TypeError, ValueError) as e:
                raise TypeError(
                    f"POST {route}: the body is not JSON-serializable ({e}); "
                    "weight-transfer payloads must be plain JSON"
                ) from e
        try:
            response = requests.post(
                url,
                data=data,
                params=params,
                headers={"Content-Type": "application/json"} if data else None,
                timeout=self.timeout,
            )
        except requests.exceptions.ReadTimeout as e:
            raise WeightSyncReadTimeout(
                f"POST {url} got no answer within {self.timeout}s; raise "
                "HTTPVLLMWeightSyncClient(timeout=...) for larger models",
                request=e.request,
                response=e.response,
            ) from e
        if not response.ok:
            raise requests.HTTPError(
                f"POST {url} failed with HTTP {response.status_code}: "
                f"{response.text[:2000]}",
                response=response,
            )
        return response

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def register_lora_adapter(self, name: str, path: str) -> None:
        """Make the OpenAI server serve the adapter ``name`` (``model=name``)
        from ``path`` through upstream's ``/v1/load_lora_adapter`` (the server
        needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``). A name it serves
        already is left as it is."""
        body = {"lora_name": name, "lora_path": path}
        try:
            self._send("v1/load_lora_adapter", body)
        except requests.HTTPError as e:
            if "already been loaded" not in str(e):
                raise

    def start_weight_update(self) -> None:
        response = self._send("start_weight_update")
        self.server_holds_commit = (
            response.headers.get(COMMIT_HOLD_HEADER) == COMMIT_HOLD_VALUE
        )

    def start_draft_weight_update(self) -> None:
        self._post("start_draft_weight_update")

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        body = {"update_info": _http_update_info(_plain(update_info))}
        self._post("update_weights", body)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self._post("finish_weight_update", body)

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("shutdown_weight_transfer_engine")

    def update_weight_version(self, new_version: str) -> None:
        self._post("update_weight_version", {"new_version": new_version})

    def pause_generation(self, mode: str = "keep") -> None:
        self._post("pause", params={"mode": mode})

    def resume_generation(self) -> None:
        self._post("resume")

    def is_paused(self) -> bool:
        return bool(self._get("is_paused")["is_paused"])

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        flag = "true" if reset_running_requests else "false"
        self._post("reset_prefix_cache", params={"reset_running_requests": flag})

    def _get(self, route: str, params: dict[str, str] | None = None) -> Any:
        url = f"{self.base_url}/{route}"
        response = requests.get(url, params=params, timeout=self.timeout)
        if not response.ok:
            raise requests.HTTPError(
                f"GET {url} failed with HTTP {response.status_code}: "
                f"{response.text[:2000]}",
                response=response,
            )
        return response.json()

    def get_world_size(self) -> int:
        return int(self._get("get_world_size", {"include_dp": "true"})["world_size"])

    def get_weight_version(self) -> str:
        return str(self._get("weight_info")["weight_version"])


class RayVLLMWeightSyncClient:
    """Drives one or more ``LLM`` / ``AsyncLLM`` Ray actors as one unit."""

    def __init__(
        self,
        handle: ActorHandle | list[ActorHandle],
        timeout: float | None = None,
    ) -> None:
        # An empty list is allowed, as upstream allows it: every call is a no-op.
        self.handles = list(handle) if isinstance(handle, list) else [handle]
        self.timeout = timeout

    def _call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        import ray

        refs = [getattr(h, method).remote(*args, **kwargs) for h in self.handles]
        if self.timeout is None:
            return ray.get(refs)
        try:
            return ray.get(refs, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise type(e)(
                f"{method} did not complete on all {len(refs)} actor(s) within "
                f"{self.timeout}s"
            ) from e

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call(
            "init_weight_transfer_engine",
            WeightTransferInitRequest(init_info=init_info),
        )

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def start_draft_weight_update(self) -> None:
        self._call("start_draft_weight_update")

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        self._call(
            "update_weights",
            WeightTransferUpdateRequest(update_info=_plain(update_info)),
        )

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update")
        if weight_version is not None:
            self._call("update_weight_version", weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("shutdown_weight_transfer_engine")

    def update_weight_version(self, new_version: str) -> None:
        self._call("update_weight_version", new_version)

    def get_world_size(self) -> int:
        """Workers of all actors together (DP ranks included)."""
        return sum(int(n) for n in self._call("get_world_size", True))

    def get_weight_version(self) -> str:
        """The first actor's label (every commit sets the same one on all)."""
        versions = self._call("get_weight_version")
        if not versions:
            raise ValueError("this client drives no actor")
        return str(versions[0])

    # No pause_generation here: an actor runs one call at a time, so a
    # generate call queued on it between the trainer's pause and resume would
    # wait for the resume that waits behind it. The commit therefore does not
    # hold generation on actors (see ``full_resync.commit_update``). An actor
    # class without reset_prefix_cache raises ``NotImplementedError`` here,
    # and the commit goes on without it.

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        self._optional(
            "reset_prefix_cache", reset_running_requests=reset_running_requests
        )

    def _optional(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        lacking = [h for h in self.handles if not hasattr(h, method)]
        if lacking:
            raise NotImplementedError(
                f"{len(lacking)} of {len(self.handles)} actor(s) have no {method}()"
            )
        return self._call(method, *args, **kwargs)


class OfflineLLMWeightSyncClient:
    """Drives an offline ``vllm.LLM`` living in the trainer's process."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def start_draft_weight_update(self) -> None:
        self.llm.start_draft_weight_update()

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        self.llm.update_weights({"update_info": _plain(update_info)})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def update_weight_version(self, new_version: str) -> None:
        self.llm.update_weight_version(new_version)

    def get_weight_version(self) -> str:
        return str(self.llm.get_weight_version())

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        self.llm.reset_prefix_cache(reset_running_requests=reset_running_requests)

    # The engine core schedules on its own process: generation goes on while
    # the trainer works, so the commit holds it like the other clients do.

    def pause_generation(self, mode: str = "keep") -> None:
        self.llm.sleep(level=0, mode=mode)

    def resume_generation(self) -> None:
        self.llm.wake_up(tags=["scheduling"])

    def is_paused(self) -> bool:
        return bool(self.llm.llm_engine.is_sleeping())

    def get_world_size(self) -> int:
        return int(self.llm.get_world_size(include_dp=True))
