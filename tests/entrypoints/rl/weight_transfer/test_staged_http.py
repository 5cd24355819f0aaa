# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Staged updates over HTTP: a real ``vllm serve`` started with
``--weight-transfer-config '{"backend": "ipc", "staging": "host"}'`` keeps
answering streaming clients through a whole sync.

While four clients stream greedy completions back to back, a trainer in this
process pushes new weights in many chunks, and a completion sent after every
chunk still gets exactly the old weights' output. The server holds
generation only for the commit, within the trainer's one finish request
(``update_guard``: pause, finish, KV reset, resume). Then:

* every stream completed with all its tokens;
* each stream is the old weights' output, the new weights' output, or the old
  output up to some token followed by the new weights' continuation of that
  prefix; at least one stream (usually a long one started right before the
  commit) is cut over that way (the sync is repeated, at most three times,
  when the commit fell between streams on a busy machine);
* the server serves exactly a fresh load of the trainer's weights (and
  Hugging Face's fp32 forward of them), ``/weight_info`` names the new
  version and generation is no longer paused.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import requests

from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)
from vllm.distributed.weight_transfer.testing import (
    DEFAULT_PROMPTS,
    assert_bit_identical,
    assert_serves_weights,
    load_hf_model,
    randomize_weights_,
)
from vllm.distributed.weight_transfer.testing.oracle import completions_greedy
from vllm.distributed.weight_transfer.testing.server import ServerProcess, serve
from vllm.distributed.weight_transfer.testing.streams import (
    Stream,
    StreamingClients,
    stream_completion,
)

pytestmark = pytest.mark.slow

STREAM_TOKENS = 32
# Far more than a commit takes to generate, even on a busy machine (200 was
# once not enough in CI: all three long streams ended before their commit).
LONG_STREAM_TOKENS = 480
MAX_MODEL_LEN = 512  # the tiny model's positions; room for the long stream
CHUNK_CAP = 128 * 1024  # many update messages for the ~2 MB model


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    with serve(
        tiny_model_dir,
        weight_transfer_backend="ipc",
        weight_transfer_options={"staging": "host"},
        max_model_len=MAX_MODEL_LEN,
    ) as s:
        yield s


def push(server: ServerProcess, model: Any, version: str, client: Any = None) -> None:
    IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=CHUNK_CAP),
        client=client or HTTPVLLMWeightSyncClient(server.base_url, timeout=120),
        source=ModuleSource(model),
    ).send_weights(weight_version=version)


def stream_tokens(
    server: ServerProcess,
    prompt: tuple[int, ...],
    max_tokens: int = STREAM_TOKENS,
    first_token: threading.Event | None = None,
) -> list[int]:
    """The token ids of one streamed greedy completion; ``first_token`` is set
    once some have arrived."""

    def on_chunk(stream: Stream) -> None:
        if stream.tokens and first_token is not None:
            first_token.set()

    return stream_completion(
        server.base_url,
        server.model,
        Stream(0, list(prompt)),
        max_tokens,
        token_ids=True,
        on_chunk=on_chunk,
    ).tokens


def streams(server: ServerProcess, n: int) -> StreamingClients:
    """``n`` clients streaming completions back to back until the block ends;
    client ``i`` streams prompt ``i % len(DEFAULT_PROMPTS)``."""
    return StreamingClients(
        server.base_url,
        server.model,
        [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(n)],
        STREAM_TOKENS,
        token_ids=True,
    )


class CompletesAfterEachMessage:
    """A sync client that sends one completion after every update message,
    and, right before the commit, starts a long stream and waits for its first
    tokens: a request certainly in flight at the commit."""

    def __init__(self, inner: HTTPVLLMWeightSyncClient, server: ServerProcess):
        self.inner, self.server = inner, server
        self.during: list[Any] = []
        self.long_stream: list[int] = []
        self._long = threading.Thread(target=self._stream_long)
        self._first_token = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def update_weights(self, update_info: Any) -> None:
        self.inner.update_weights(update_info)
        self.during.append(self.server.greedy())

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        # The commit: the server holds generation for this one request.
        assert self.inner.server_holds_commit, "vllm serve should hold the commit"
        self._long.start()
        assert self._first_token.wait(60), "the long stream never started"
        self.inner.finish_weight_update(weight_version)

    def join(self) -> None:
        self._long.join(120)

    def _stream_long(self) -> None:
        self.long_stream = stream_tokens(
            self.server, DEFAULT_PROMPTS[0], LONG_STREAM_TOKENS, self._first_token
        )


def switch_point(
    server: ServerProcess,
    prompt: tuple[int, ...],
    tokens: list[int],
    old_tokens: tuple[int, ...],
) -> int:
    """Where ``tokens`` switch from the old weights' greedy output to the new
    weights' greedy continuation of that prefix (``len(tokens)`` when they
    never switch, 0 when they are the new weights' from the start); fails
    when they are neither."""
    k = next(
        (i for i, (a, b) in enumerate(zip(tokens, old_tokens, strict=False)) if a != b),
        len(tokens),
    )
    if k == len(tokens):
        return k
    continuation = completions_greedy(
        server.base_url,
        server.model,
        prompts=[list(prompt) + tokens[:k]],
        max_tokens=len(tokens) - k,
    )
    assert tokens[k:] == list(continuation.tokens[0]), (
        f"a stream of prompt {prompt} is neither version: {tokens}"
    )
    return k


def test_streams_keep_going_through_a_staged_sync_and_switch_once(server):
    model = load_hf_model(server.model, "float32")
    randomize_weights_(model, seed=1)
    push(server, model, "s1")
    # A stream is cut over only when the commit falls inside it; the long one
    # started right before the commit usually is, but not always (on a busy
    # machine it can finish first; and one run saw a 0.35 s finish after which
    # the long stream still held only old tokens, not yet explained), so the
    # sync is repeated, at most six times.
    for attempt in range(6):
        if sync_once(server, model, seed=2 + attempt, version=f"s{2 + attempt}"):
            break
    else:
        raise AssertionError("no stream was in flight at any of six commits")
    assert_serves_weights(server.fresh_load_oracle(), model, dtype="float32")
    info = requests.get(f"{server.base_url}/weight_info", timeout=30).json()
    assert info["weight_version"] == f"s{2 + attempt}"
    paused = requests.get(f"{server.base_url}/is_paused", timeout=30).json()
    assert paused["is_paused"] is False


def sync_once(server: ServerProcess, model: Any, seed: int, version: str) -> bool:
    """One staged sync under four streams and a long one started right before
    the commit; checks every stream and completion; returns whether some
    stream was cut over from the old weights to the new ones."""
    before = server.greedy()
    old = completions_greedy(server.base_url, server.model, max_tokens=STREAM_TOKENS)
    (old_long,) = completions_greedy(
        server.base_url,
        server.model,
        prompts=[list(DEFAULT_PROMPTS[0])],
        max_tokens=LONG_STREAM_TOKENS,
    ).tokens
    randomize_weights_(model, seed=seed)
    sync_client = CompletesAfterEachMessage(
        HTTPVLLMWeightSyncClient(server.base_url, timeout=120), server
    )
    with streams(server, 4) as load:
        while len(load.done) < 4 and not load.errors:
            threading.Event().wait(0.05)  # streams are under way
        push(server, model, version, client=sync_client)
        sync_client.join()
        started = len(load.done)
        while len(load.done) < started + 4 and not load.errors:
            threading.Event().wait(0.05)  # streams go on after the commit
    assert not load.errors, load.errors
    assert len(sync_client.during) >= 5, "the sync should span many messages"
    for result in sync_client.during:
        assert_bit_identical(result, before, what="a completion during the transfer")

    cut_over = 0
    for done in load.done:
        prompt_index = done.client % len(DEFAULT_PROMPTS)
        tokens = done.tokens
        assert len(tokens) == STREAM_TOKENS, "every stream completes"
        k = switch_point(
            server, DEFAULT_PROMPTS[prompt_index], tokens, old.tokens[prompt_index]
        )
        cut_over += 0 < k < STREAM_TOKENS
    assert len(sync_client.long_stream) == LONG_STREAM_TOKENS
    k = switch_point(server, DEFAULT_PROMPTS[0], sync_client.long_stream, old_long)
    cut_over += 0 < k < LONG_STREAM_TOKENS
    return cut_over > 0
