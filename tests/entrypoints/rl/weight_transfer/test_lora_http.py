# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LoRA adapters pushed from memory into ``vllm serve --enable-lora`` over the
RL HTTP routes (``HTTPVLLMWeightSyncClient``), served to OpenAI completions
that name the adapter as ``model``.

With ``label_outputs=True`` a stream the push commits inside names, on its
tokens, the adapter version before and after: the first span is the old
adapter's greedy output, the second the new one's continuation of it.

A trainer that dies after sending its adapter leaves the server serving:
generation is not held while the adapter is staged, and at the deadline the
server closes the push with the base weights' version label unchanged and
the adapter's previous version serving.

The push registers the adapter's name with the server
(``/v1/load_lora_adapter`` with its memory path; the server numbers it
itself). Every version served is compared bit for bit with the same server
serving the same adapter loaded from PEFT's directory under another name,
and with Hugging Face + PEFT's forward (fp32 tolerance); a second push after
an in-place step reaches the same ``model`` name; a bad adapter is refused
over HTTP with its cause and the version before keeps serving; an adapter
pulled over NIXL from the trainer's producer (``transport="nixl"``) serves
the same way. One id names one adapter whoever numbered it: a push of an
id ``/v1/load_lora_adapter`` gave another name is refused 409 and an id
pushed first is skipped by the server's numbering, each adapter then serving
exactly its own weights. At TP 2, where
each worker maps the adapter's buffer and takes its own slice; TP 1 is
covered offline (``test_lora_llm.py``, which runs both sizes), so CI starts
one server here instead of two.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.lora.labels import split_adapter_label
from vllm.distributed.weight_transfer.lora.pusher import (
    LoRAAdapter,
    LoRAPusher,
    push_lora_adapter,
)
from vllm.distributed.weight_transfer.lora.wire import memory_path
from vllm.distributed.weight_transfer.serving.lora_routes import LORA_ID_HEADER
from vllm.distributed.weight_transfer.testing import (
    GreedyResult,
    assert_bit_identical,
    assert_same_greedy,
    hf_greedy,
    load_hf_model,
    logprob_atol,
)
from vllm.distributed.weight_transfer.testing.fresh_load import http_worker_call
from vllm.distributed.weight_transfer.testing.lora import random_lora
from vllm.distributed.weight_transfer.testing.oracle import (
    DEFAULT_PROMPTS,
    completions_greedy,
)
from vllm.distributed.weight_transfer.testing.server import ServerProcess, serve
from vllm.distributed.weight_transfer.testing.streams import Stream, stream_generate

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow

MAX_RANK = 8
# Ids the server does not hand out itself (it numbers from 1).
PUSHED_ID = 1000
# The server's deadline for an open update between two calls (short, so the
# test of a trainer dying mid-push waits little). 8 s was too short once: a
# NIXL push under CI load took over 8 s from its start call to its
# update_weights (the producer's NIXL agent starting on a loaded 2-core host).
UPDATE_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    """Each of the two workers maps the pushed adapter's buffer itself and
    vLLM's LoRA layers take each worker's slice of it."""
    with serve(
        tiny_model_dir,
        tensor_parallel_size=2,
        weight_transfer_options={"update_timeout_s": UPDATE_TIMEOUT_S},
        extra_args=[
            # /inference/v1/generate: outputs carry per-token weight versions.
            "--enable-scale-out",
            "--enable-lora",
            "--max-lora-rank",
            str(MAX_RANK),
            "--max-loras",
            "2",
        ],
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    ) as s:
        yield s


def policy(model_dir: Path, seed: int, rank: int = MAX_RANK) -> Any:
    return random_lora(
        load_hf_model(model_dir, "float32"),
        seed,
        rank,
        ["q_proj", "v_proj", "o_proj", "down_proj"],
    )


def from_disk(server: ServerProcess, model: Any, path: Path, name: str) -> GreedyResult:
    model.save_pretrained(str(path))
    HTTPVLLMWeightSyncClient(server.base_url).register_lora_adapter(name, str(path))
    return completions_greedy(server.base_url, name)


def test_a_pushed_adapter_serves_openai_requests_by_name(
    server, tiny_model_dir, tmp_path
):
    client = HTTPVLLMWeightSyncClient(server.base_url, timeout=120)
    model = policy(tiny_model_dir, seed=1)
    push_lora_adapter(client, LoRAAdapter.from_peft_model(model, "policy", PUSHED_ID))
    served = completions_greedy(server.base_url, "policy")
    assert_bit_identical(
        served, from_disk(server, model, tmp_path / "v1", "policy-disk-1"), what="v1"
    )
    assert_same_greedy(served, hf_greedy(model), atol=logprob_atol("float32"))
    assert served != completions_greedy(server.base_url, server.model)

    # An optimizer step in place, pushed again: the same model name serves it.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-1.5)
    push_lora_adapter(
        client, LoRAAdapter.from_peft_model(model, "policy", PUSHED_ID), version="v2"
    )
    second = completions_greedy(server.base_url, "policy")
    assert_bit_identical(
        second, from_disk(server, model, tmp_path / "v2", "policy-disk-2"), what="v2"
    )
    assert second != served

    # A bad adapter (rank above the server's max_lora_rank) is refused with
    # its cause; the version before keeps serving.
    wide = policy(tiny_model_dir, seed=2, rank=2 * MAX_RANK)
    with pytest.raises(requests.HTTPError, match="max_lora_rank"):
        push_lora_adapter(
            client, LoRAAdapter.from_peft_model(wide, "policy", PUSHED_ID)
        )
    assert_bit_identical(
        completions_greedy(server.base_url, "policy"), second, what="after refusal"
    )
    # The server names the version each adapter serves, apart from the base
    # weights' (the refused push did not replace it).
    status = requests.get(f"{server.base_url}/weight_update_status", timeout=30)
    assert status.json()["adapters"]["policy"] == {
        "name": "policy",
        "lora_id": PUSHED_ID,
        "version": "v2",
    }


class _NoRegistration(HTTPVLLMWeightSyncClient):
    """Pushes without telling the OpenAI server the adapter's name."""

    register_lora_adapter = None  # type: ignore[assignment]


def _load_from_disk(server: ServerProcess, model: Any, path: Path, name: str) -> int:
    """``/v1/load_lora_adapter`` of ``model`` saved by PEFT; the id the
    server gave it."""
    model.save_pretrained(str(path))
    answer = requests.post(
        f"{server.base_url}/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(path)},
        timeout=120,
    )
    assert answer.ok, answer.text
    return int(answer.headers[LORA_ID_HEADER])


def test_one_id_names_one_adapter_whoever_numbered_it(server, tiny_model_dir, tmp_path):
    """A push of the id ``/v1/load_lora_adapter`` gave another adapter is
    refused 409 before the engine sees it, so the loaded adapter's requests
    never reach a step with a clashing id; an id pushed first is
    skipped by the server's numbering; a bad adapter is 400 naming its
    cause, a name that would forge a log line too. Every adapter then serves
    exactly its own weights, and the base model what it served before."""
    client = HTTPVLLMWeightSyncClient(server.base_url, timeout=120)
    atol = logprob_atol("float32")
    base = completions_greedy(server.base_url, server.model)
    sft_model = policy(tiny_model_dir, seed=8)
    sft_id = _load_from_disk(server, sft_model, tmp_path / "sft", "sft")
    sft = completions_greedy(server.base_url, "sft")
    assert_same_greedy(sft, hf_greedy(sft_model), atol=atol)

    evil_model = policy(tiny_model_dir, seed=9)
    evil = LoRAAdapter.from_peft_model(evil_model, "evil", sft_id)
    with pytest.raises(requests.HTTPError, match="already serves adapter 'sft'") as e:
        push_lora_adapter(client, evil)
    assert e.value.response.status_code == 409
    assert f"lora_id {sft_id}" in str(e.value)
    assert_bit_identical(completions_greedy(server.base_url, "sft"), sft, what="sft")

    # The other order: the id the server would hand out next is pushed
    # first; the next adapter loaded gets the one after it.
    push_lora_adapter(
        _NoRegistration(server.base_url, timeout=120),
        LoRAAdapter.from_peft_model(evil_model, "evil", sft_id + 1),
    )
    later_model = policy(tiny_model_dir, seed=10)
    assert _load_from_disk(server, later_model, tmp_path / "l", "later") == sft_id + 2
    later = completions_greedy(server.base_url, "later")
    assert_same_greedy(later, hf_greedy(later_model), atol=atol)
    client.register_lora_adapter("evil", memory_path("evil"))
    served_evil = completions_greedy(server.base_url, "evil")
    assert_same_greedy(served_evil, hf_greedy(evil_model), atol=atol)

    # A bad adapter: 400 with the worker's cause, not 500.
    wide = policy(tiny_model_dir, seed=11, rank=2 * MAX_RANK)
    with pytest.raises(requests.HTTPError, match="max_lora_rank") as e:
        push_lora_adapter(client, LoRAAdapter.from_peft_model(wide, "evil", sft_id + 1))
    assert e.value.response.status_code == 400
    # A name that would forge a log line: 400 before the engine.
    forged = {
        "name": "x\nWARNING forged log line",
        "lora_id": PUSHED_ID + 7,
        "config": evil.config.to_dict(),
        "last": True,
    }
    client.start_weight_update()
    answer = requests.post(
        f"{server.base_url}/update_weights",
        json={"update_info": {"names": [], "adapter": forged}},
        timeout=120,
    )
    client.update_weights({"abort": "the forged name was refused"})
    client.finish_weight_update()
    assert answer.status_code == 400 and "adapter name" in answer.text
    assert "forged" not in json.dumps(_status(server)["adapters"])

    # Nothing of that changed what serves.
    assert_bit_identical(completions_greedy(server.base_url, "sft"), sft, what="sft")
    assert_bit_identical(completions_greedy(server.base_url, "later"), later, what="l")
    assert_bit_identical(
        completions_greedy(server.base_url, "evil"), served_evil, what="evil"
    )
    assert_bit_identical(
        completions_greedy(server.base_url, server.model), base, what="base"
    )


def test_an_adapter_pulled_over_nixl_serves_openai_requests_by_name(
    server, tiny_model_dir, tmp_path
):
    """``transport="nixl"``: each of the server's workers pulls the adapter
    from this process's producer over NIXL and hands its receipt back through
    it, with checksums on; nothing is mapped."""
    client = HTTPVLLMWeightSyncClient(server.base_url, timeout=120)
    model = policy(tiny_model_dir, seed=3)
    adapter = LoRAAdapter.from_peft_model(model, "remote", PUSHED_ID + 1)
    verified = push_lora_adapter(
        client, adapter, version="r1", transport="nixl", verify_checksums=True
    )
    assert verified is not None and verified.workers == (0, 1)
    assert verified.checksums_verified == 2
    served = completions_greedy(server.base_url, "remote")
    assert_bit_identical(
        served, from_disk(server, model, tmp_path / "r1", "remote-disk-1"), what="r1"
    )
    assert_same_greedy(served, hf_greedy(model), atol=logprob_atol("float32"))
    status = requests.get(f"{server.base_url}/weight_update_status", timeout=30)
    assert status.json()["adapters"]["remote"]["version"] == "r1"


def test_a_memory_path_never_pushed_is_refused_and_the_server_keeps_serving(server):
    """Registering a name whose memory path no push filled: the server
    loads it at once (upstream's ``/v1/load_lora_adapter`` preloads), the
    worker finds no such adapter, and the server answers 404 with the cause,
    never loading it inside a generation step; base requests keep serving."""
    from vllm.distributed.weight_transfer.lora.wire import memory_path

    base = completions_greedy(server.base_url, server.model)
    answer = requests.post(
        f"{server.base_url}/v1/load_lora_adapter",
        json={"lora_name": "ghost", "lora_path": memory_path("never-pushed")},
        timeout=120,
    )
    assert answer.status_code == 404, answer.text
    assert "memory://never-pushed" in answer.text
    # Not registered: a request naming it is refused, not loaded in a step.
    refused = requests.post(
        f"{server.base_url}/v1/completions",
        json={"model": "ghost", "prompt": "hello", "max_tokens": 2},
        timeout=120,
    )
    assert refused.status_code == 404, refused.text
    assert_bit_identical(
        completions_greedy(server.base_url, server.model), base, what="base after"
    )


class _DiesAfterTheAdapter(HTTPVLLMWeightSyncClient):
    """A trainer that dies right after its adapter message was accepted: it
    sends nothing more, not even an abort."""

    dead = False

    def update_weights(self, update_info: Any) -> None:
        if self.dead:
            raise RuntimeError("the trainer died")
        super().update_weights(update_info)
        self.dead = True

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if self.dead:
            raise RuntimeError("the trainer died")
        super().finish_weight_update(weight_version)


def _status(server: ServerProcess) -> dict:
    answer = requests.get(f"{server.base_url}/weight_update_status", timeout=30)
    answer.raise_for_status()
    return answer.json()


def test_a_trainer_dying_mid_push_leaves_the_server_serving_and_unfenced(
    server, tiny_model_dir
):
    client = HTTPVLLMWeightSyncClient(server.base_url, timeout=120)
    model = policy(tiny_model_dir, seed=3)
    push_lora_adapter(
        client,
        LoRAAdapter.from_peft_model(model, "policy", PUSHED_ID),
        version="before-death",
    )
    before = completions_greedy(server.base_url, "policy")
    base = completions_greedy(server.base_url, server.model)
    label = _status(server)["weight_version"]

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-1.5)
    with pytest.raises(RuntimeError, match="the trainer died"):
        push_lora_adapter(
            _DiesAfterTheAdapter(server.base_url, timeout=120),
            LoRAAdapter.from_peft_model(model, "policy", PUSHED_ID),
            version="never-committed",
        )
    # The push is open on the server, and requests are served meanwhile:
    # both completions return while it is still open, so generation was not
    # held for it (a hold would last until the deadline closed it).
    assert _status(server)["open"]["adapter"]["version"] == "never-committed"
    assert_bit_identical(
        completions_greedy(server.base_url, "policy"), before, what="during"
    )
    assert_bit_identical(
        completions_greedy(server.base_url, server.model), base, what="base during"
    )
    assert _status(server)["open"] is not None

    # At the deadline the server closes the push: nothing is fenced, the
    # version label and the adapter's version are the ones before.
    give_up = time.monotonic() + UPDATE_TIMEOUT_S + 60
    while _status(server)["open"] is not None:
        assert time.monotonic() < give_up, _status(server)
        time.sleep(0.5)
    status = _status(server)
    assert status["weight_version"] == label
    assert status["adapters"]["policy"]["version"] == "before-death"
    assert_bit_identical(
        completions_greedy(server.base_url, "policy"), before, what="after"
    )
    # The next push goes through.
    push_lora_adapter(
        client,
        LoRAAdapter.from_peft_model(model, "policy", PUSHED_ID),
        version="after-death",
    )
    assert completions_greedy(server.base_url, "policy") != before
    assert _status(server)["adapters"]["policy"]["version"] == "after-death"


STREAM_TOKENS = 200  # with the prompt, within the server's max_model_len
FORWARD_PAUSE_S = 0.01  # so the stream lasts seconds and the push falls inside


def test_a_stream_names_the_adapter_version_of_each_of_its_tokens(
    server, tiny_model_dir
):
    client = HTTPVLLMWeightSyncClient(server.base_url, timeout=120)
    pusher = LoRAPusher(client, label_outputs=True)
    model = policy(tiny_model_dir, seed=4)
    prompt = list(DEFAULT_PROMPTS[0])
    slow_down = http_worker_call(server.base_url)
    try:
        pusher.push(
            LoRAAdapter.from_peft_model(model, "policy", PUSHED_ID), version="s-1"
        )
        old = completions_greedy(
            server.base_url, "policy", prompts=[prompt], max_tokens=STREAM_TOKENS
        ).tokens[0]
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(-1.5)

        # A long stream of the adapter, and the next version pushed while its
        # first tokens are out.
        slow_down("slow_down_forward", [FORWARD_PAUSE_S])
        stream = Stream(0, prompt)
        first_tokens = threading.Event()

        def on_chunk(s: Stream) -> None:
            if len(s.tokens) >= 8:
                first_tokens.set()

        reading = threading.Thread(
            target=stream_generate,
            args=(server.base_url, stream, STREAM_TOKENS),
            kwargs={"on_chunk": on_chunk, "model": "policy"},
        )
        reading.start()
        assert first_tokens.wait(60), "the stream never started"
        pusher.push(
            LoRAAdapter.from_peft_model(model, "policy", PUSHED_ID), version="s-2"
        )
        reading.join(120)
        assert stream.finished_at is not None, "the stream did not finish"
    finally:
        slow_down("slow_down_forward", [0])
        pusher.close()

    spans, n = stream.weight_versions, len(stream.tokens)
    assert n == STREAM_TOKENS
    assert [(s["start"], s["end"]) for s in spans] == [
        (0, spans[0]["end"]),
        (spans[0]["end"], n),
    ], f"one switch of version inside the stream: {spans}"
    versions = [split_adapter_label(s["version"])[1]["policy"] for s in spans]
    assert versions == ["s-1", "s-2"]
    switch = spans[0]["end"]
    assert stream.tokens[:switch] == list(old[:switch]), "the s-1 span is not s-1's"
    continuation = completions_greedy(
        server.base_url,
        "policy",
        prompts=[prompt + stream.tokens[:switch]],
        max_tokens=n - switch,
    )
    assert stream.tokens[switch:] == list(continuation.tokens[0]), (
        "the s-2 span is not s-2's continuation of the s-1 tokens"
    )
