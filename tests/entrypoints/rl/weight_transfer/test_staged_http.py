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
* the long stream goes through vLLM's token-in/token-out route
  (``/inference/v1/generate``, ``--enable-scale-out``), whose last chunk
  gives the weight version of every span of output tokens: the spans name
  the old version, then the new one (or one of them alone), and the tokens
  of each span are exactly that version's (the old weights' output, then the
  new weights' continuation of the prefix the old span left);
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
import time
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
from vllm.distributed.weight_transfer.testing.fresh_load import http_worker_call
from vllm.distributed.weight_transfer.testing.oracle import (
    completions_greedy,
    switch_point,
)
from vllm.distributed.weight_transfer.testing.server import ServerProcess, serve
from vllm.distributed.weight_transfer.testing.streams import (
    Stream,
    StreamingClients,
    stream_generate,
)

pytestmark = pytest.mark.slow

STREAM_TOKENS = 32
# Far more than a commit takes to generate, even on a busy machine (200 was
# once not enough in CI: all three long streams ended before their commit).
LONG_STREAM_TOKENS = 480
MAX_MODEL_LEN = 512  # the tiny model's positions; room for the long stream
CHUNK_CAP = 128 * 1024  # many update messages for the ~2 MB model
FORWARD_PAUSE_S = 0.004


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    with serve(
        tiny_model_dir,
        weight_transfer_backend="ipc",
        weight_transfer_options={"staging": "host"},
        max_model_len=MAX_MODEL_LEN,
        # /inference/v1/generate: outputs carry per-token weight versions.
        extra_args=["--enable-scale-out"],
    ) as s:
        # Every forward pass waits FORWARD_PAUSE_S, so the long stream takes
        # seconds and the commit falls inside it (unpaused, the tiny model's
        # 480 tokens take under a second, and on two busy cores the server
        # could deliver them all at once, after the commit).
        http_worker_call(s.base_url)("slow_down_forward", [FORWARD_PAUSE_S])
        yield s


def push(server: ServerProcess, model: Any, version: str, client: Any = None) -> None:
    IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=CHUNK_CAP),
        client=client or HTTPVLLMWeightSyncClient(server.base_url, timeout=120),
        source=ModuleSource(model),
    ).send_weights(weight_version=version)


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
        self.long_stream = Stream(0, list(DEFAULT_PROMPTS[0]))
        self._long = threading.Thread(target=self._stream_long)
        self._first_token = threading.Event()
        # When the finish call began and ended (``time.perf_counter``).
        self.finish_s = (0.0, 0.0)

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
        started = time.perf_counter()
        self.inner.finish_weight_update(weight_version)
        self.finish_s = (started, time.perf_counter())

    def join(self) -> None:
        self._long.join(120)

    def _stream_long(self) -> None:
        def on_chunk(stream: Stream) -> None:
            if stream.tokens:
                self._first_token.set()

        stream_generate(
            self.server.base_url,
            self.long_stream,
            LONG_STREAM_TOKENS,
            on_chunk=on_chunk,
        )


def version_switch(
    server: ServerProcess,
    stream: Stream,
    old_tokens: tuple[int, ...],
    old_version: str,
    new_version: str,
) -> int:
    """Where ``stream``'s weight-version spans switch from ``old_version`` to
    ``new_version`` (``len`` when they never do, 0 when the stream is the new
    version's from the start), having checked that the spans cover every
    output token once and that each span's tokens are its version's: the old
    weights' greedy output, then the new weights' greedy continuation of the
    prefix before the switch."""
    spans, n = stream.weight_versions, len(stream.tokens)
    assert spans, "the last chunk should carry the weight versions"
    assert spans[0]["start"] == 0 and spans[-1]["end"] == n, spans
    assert all(
        a["end"] == b["start"] for a, b in zip(spans, spans[1:], strict=False)
    ), spans
    versions = [span["version"] for span in spans]
    assert versions in ([old_version], [new_version], [old_version, new_version]), (
        f"versions {versions} around a sync from {old_version} to {new_version}"
    )
    if versions == [old_version, new_version]:
        j = spans[0]["end"]
    else:
        j = n if versions == [old_version] else 0
    assert stream.tokens[:j] == list(old_tokens[:j]), "the old span is not old"
    if j < n:
        continuation = completions_greedy(
            server.base_url,
            server.model,
            prompts=[stream.prompt + stream.tokens[:j]],
            max_tokens=n - j,
        )
        assert stream.tokens[j:] == list(continuation.tokens[0]), (
            f"the {new_version} span is not the new weights' continuation"
        )
    return j


def test_streams_keep_going_through_a_staged_sync_and_switch_once(server):
    model = load_hf_model(server.model, "float32")
    randomize_weights_(model, seed=1)
    push(server, model, "s1")
    # A stream is cut over only when the commit falls inside it; the long one
    # started right before the commit almost always is (with the forward
    # pause it lasts about two seconds; the commit takes well under one), and
    # the sync is repeated, at most six times, for a machine busier still.
    seen = []
    for attempt in range(6):
        cut, what = sync_once(
            server, model, seed=2 + attempt, version=f"s{2 + attempt}"
        )
        seen.append(what)
        if cut:
            break
    else:
        raise AssertionError(
            "no stream was in flight at any of six commits: " + "; ".join(seen)
        )
    assert_serves_weights(server.fresh_load_oracle(), model, dtype="float32")
    info = requests.get(f"{server.base_url}/weight_info", timeout=30).json()
    assert info["weight_version"] == f"s{2 + attempt}"
    paused = requests.get(f"{server.base_url}/is_paused", timeout=30).json()
    assert paused["is_paused"] is False


def sync_once(
    server: ServerProcess, model: Any, seed: int, version: str
) -> tuple[bool, str]:
    """One staged sync under four streams and a long one started right before
    the commit; checks every stream and completion; returns whether some
    stream was cut over from the old weights to the new ones, and what the
    long stream and the finish call did (for a failure's message)."""
    info = requests.get(f"{server.base_url}/weight_info", timeout=30).json()
    old_version = info["weight_version"]
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
            server.base_url,
            server.model,
            DEFAULT_PROMPTS[prompt_index],
            tokens,
            old.tokens[prompt_index],
        )
        cut_over += 0 < k < STREAM_TOKENS
    long_stream = sync_client.long_stream
    assert len(long_stream.tokens) == LONG_STREAM_TOKENS
    j = version_switch(server, long_stream, old_long, old_version, version)
    cut_over += 0 < j < LONG_STREAM_TOKENS
    began, ended = sync_client.finish_s
    what = (
        f"{version}: long stream {long_stream.started:.3f}-"
        f"{long_stream.finished_at:.3f} {long_stream.weight_versions}, finish "
        f"call {began:.3f}-{ended:.3f}"
    )
    return cut_over > 0, what
