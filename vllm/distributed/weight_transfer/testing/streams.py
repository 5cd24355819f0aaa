# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Streaming clients of a ``vllm serve`` for load during a weight sync: each
on its own thread, streaming greedy completions back to back and recording
when every chunk arrived (and, on request, the token ids). Tests, examples and
benchmarks read the records to judge what a sync did to generation."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Self

import requests


@dataclass
class Stream:
    """One streamed completion, filled in while its chunks arrive; times are
    ``time.perf_counter()``."""

    client: int
    prompt: list[int]
    # When the response began (its status checked), before the first chunk.
    started: float | None = None
    arrivals: list[float] = field(default_factory=list)  # one per chunk
    tokens: list[int] = field(default_factory=list)  # with ``token_ids`` only
    finished_at: float | None = None  # None while it runs, or if it failed
    # ``stream_generate`` only: the weight version of each span of output
    # tokens, ``{"version", "start", "end"}`` (vLLM's ``WeightVersionSpan``).
    weight_versions: list[dict] = field(default_factory=list)


def stream_completion(
    base_url: str,
    model: str,
    stream: Stream,
    max_tokens: int,
    *,
    timeout_s: float = 120.0,
    token_ids: bool = False,
    on_chunk: Callable[[Stream], None] | None = None,
) -> Stream:
    """Stream one greedy completion of ``stream.prompt`` into ``stream``
    (``on_chunk(stream)`` after each chunk); raises on any failure."""
    body: dict = {
        "model": model,
        "prompt": list(stream.prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    if token_ids:
        body["return_token_ids"] = True
    return _read_events(
        f"{base_url}/v1/completions", body, stream, timeout_s, on_chunk, fields=()
    )


def _read_events(
    url: str,
    body: dict,
    stream: Stream,
    timeout_s: float,
    on_chunk: Callable[[Stream], None] | None,
    fields: Sequence[str],
) -> Stream:
    """POST ``body`` to ``url`` and read its server-sent events into
    ``stream``: the arrival of each chunk, and each choice's token ids (and
    weight-version spans, when ``fields`` names them)."""
    response = requests.post(url, json=body, stream=True, timeout=timeout_s)
    response.raise_for_status()
    stream.started = time.perf_counter()
    for line in response.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[len(b"data: ") :])
        stream.arrivals.append(time.perf_counter())
        for choice in chunk["choices"]:
            stream.tokens += choice.get("token_ids") or []
            if "weight_versions" in fields:
                stream.weight_versions += choice.get("weight_versions") or []
        if on_chunk is not None:
            on_chunk(stream)
    stream.finished_at = time.perf_counter()
    return stream


def stream_generate(
    base_url: str,
    stream: Stream,
    max_tokens: int,
    *,
    timeout_s: float = 120.0,
    on_chunk: Callable[[Stream], None] | None = None,
    model: str | None = None,
) -> Stream:
    """Stream one greedy generation of ``stream.prompt`` through vLLM's
    token-in/token-out route (``/inference/v1/generate``, on a server started
    with ``--enable-scale-out``) into ``stream``: its token ids, and on the
    last chunk the weight version of every span of them. ``model`` names a
    LoRA adapter the server registered (None: the base model)."""
    body: dict = {
        "token_ids": list(stream.prompt),
        "sampling_params": {
            "temperature": 0.0,
            "max_tokens": max_tokens,
            "ignore_eos": True,
        },
        "stream": True,
    }
    if model is not None:
        body["model"] = model
    return _read_events(
        f"{base_url}/inference/v1/generate",
        body,
        stream,
        timeout_s,
        on_chunk,
        fields=("weight_versions",),
    )


class StreamingClients:
    """One client per prompt in ``prompts``, each streaming completions of it
    back to back from entering the block until leaving it (a stream under way
    then runs to its end). A client that fails records why in ``errors`` and
    stops."""

    def __init__(
        self,
        base_url: str,
        model: str,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        *,
        timeout_s: float = 120.0,
        token_ids: bool = False,
        join_timeout_s: float = 120.0,
    ) -> None:
        self.base_url, self.model = base_url, model
        self.prompts = [list(p) for p in prompts]
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.token_ids = token_ids
        self.join_timeout_s = join_timeout_s
        self.streams: list[Stream] = []  # every stream begun, in order
        # Per client: the arrival time of every chunk of all its streams.
        self.arrivals: list[list[float]] = [[] for _ in self.prompts]
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True)
            for i in range(len(self.prompts))
        ]

    @property
    def done(self) -> list[Stream]:
        """The streams that completed."""
        return [s for s in self.streams if s.finished_at is not None]

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.join_timeout_s)

    def _run(self, client: int) -> None:
        arrivals = self.arrivals[client]

        def note_chunk(stream: Stream) -> None:
            arrivals.append(stream.arrivals[-1])

        while not self._stop.is_set():
            stream = Stream(client, self.prompts[client])
            self.streams.append(stream)
            try:
                stream_completion(
                    self.base_url,
                    self.model,
                    stream,
                    self.max_tokens,
                    timeout_s=self.timeout_s,
                    token_ids=self.token_ids,
                    on_chunk=note_chunk,
                )
            except BaseException as e:
                self.errors.append(f"{type(e).__name__}: {e}")
                return
