# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The direct NIXL transport between real processes: a killed consumer, a
stalled consumer or a killed producer ends the sync with an error on the
surviving side within the stall timeout (and the bytes that did arrive are the
replayed slice)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

from vllm.distributed.weight_transfer.testing.sharded_rdt_procs import (
    consumer_main,
    producer_main,
    toy_names,
    toy_pull_plan,
    toy_tensors,
)

# Deadlines of seconds measured against spawned processes: run alone.
pytestmark = [pytest.mark.slow, pytest.mark.nixl, pytest.mark.serial]
pytest.importorskip("nixl")

LAYERS, ROWS, COLS, KEEP = 4, 64, 32, 16
CTX = multiprocessing.get_context("spawn")


def _producer_kwargs(stall_timeout_s: float) -> dict:
    names = toy_names(LAYERS)
    return dict(
        rank=0,
        names=names,
        group_lens=[1] * len(names),
        served_names=names,
        stall_timeout_s=stall_timeout_s,
    )


def _expect(conn, kind: str, timeout: float = 60.0):
    assert conn.poll(timeout), f"no {kind!r} message within {timeout}s"
    got, value = conn.recv()
    assert got == kind, f"expected {kind!r}, got {got!r}: {value}"
    return value


def _start_consumer(endpoint, mode: str, stall_timeout_s: float):
    pulls = toy_pull_plan(LAYERS, ROWS, COLS, KEEP)
    parent, child = CTX.Pipe()
    proc = CTX.Process(
        target=consumer_main,
        args=(
            endpoint,
            [c.to_json() for c in pulls.chunks],
            pulls.digest(0),
            mode,
            stall_timeout_s,
            child,
        ),
        daemon=True,
    )
    proc.start()
    _expect(parent, "registered")
    return proc, parent


def _serve_one_sync(server, delay: float = 0.0):
    tensors = toy_tensors(LAYERS, ROWS, COLS, seed=0)
    server.begin_sync([0])
    for gi, name in enumerate(toy_names(LAYERS)):
        server.wait_credit()
        server.publish(gi, {name: tensors[name]})
        time.sleep(delay)
    server.end_sync()


@pytest.fixture
def server_factory():
    from vllm.distributed.weight_transfer.pull.nixl import NixlProducerServer

    servers = []

    def make(stall_timeout_s: float):
        server = NixlProducerServer(_producer_kwargs(stall_timeout_s), "127.0.0.1")
        servers.append(server)
        return server

    yield make
    for s in servers:
        s.close()


def test_killing_a_consumer_mid_sync_fails_the_producer_at_once(server_factory):
    server = server_factory(30.0)
    proc, conn = _start_consumer(server.endpoint(), "slow", 30.0)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="consumer 0 disconnected mid-sync"):
        tensors = toy_tensors(LAYERS, ROWS, COLS, seed=0)
        server.begin_sync([0])
        for gi, name in enumerate(toy_names(LAYERS)):
            server.wait_credit()
            server.publish(gi, {name: tensors[name]})
            if gi == 0:
                _expect(conn, "pulled")
                os.kill(proc.pid or 0, signal.SIGKILL)
        server.end_sync()
    assert time.monotonic() - started < 10.0


def test_a_stalled_consumer_fails_the_producer_within_the_timeout(server_factory):
    server = server_factory(2.0)
    proc, conn = _start_consumer(server.endpoint(), "stall", 30.0)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="no progress for 2.0s"):
        _serve_one_sync(server)
    assert time.monotonic() - started < 6.0
    proc.kill()


def test_a_pull_the_producer_cannot_answer_leaves_the_connection_served(
    server_factory,
):
    """A pull whose sync id is a string makes the producer raise TypeError;
    the consumer gets that error as an answer, and its next pulls on the same
    connection are still answered (the answering thread used to die)."""
    server = server_factory(30.0)
    proc, conn = _start_consumer(server.endpoint(), "bad-sync-id", 30.0)
    refusal = _expect(conn, "refused")
    assert "TypeError" in refusal or "not supported" in refusal, refusal
    _serve_one_sync(server)
    chunks = len(toy_pull_plan(LAYERS, ROWS, COLS, KEEP).chunks)
    assert [_expect(conn, "pulled") for _ in range(chunks)] == list(range(chunks))
    _expect(conn, "done")
    proc.join(10)


def test_killing_the_producer_mid_sync_fails_the_consumer(tmp_path):
    from vllm.distributed.weight_transfer.pull.nixl import (
        NixlConsumerTransport,
    )

    parent, child = CTX.Pipe()
    proc = CTX.Process(
        target=producer_main,
        args=(_producer_kwargs(30.0), LAYERS, ROWS, COLS, child),
        daemon=True,
    )
    proc.start()
    endpoint = _expect(parent, "endpoint")
    pulls = toy_pull_plan(LAYERS, ROWS, COLS, KEEP)
    transport = NixlConsumerTransport(0, 30.0)
    link = transport.connect(0, endpoint)
    link.register(0, pulls.chunks, pulls.digest(0))
    buffer = transport.receive_buffer(pulls.max_chunk_bytes, torch.device("cpu"))
    parent.send("sync")
    first = pulls.chunks[0]
    link.pull(first, buffer[: first.nbytes])
    got = buffer[: first.nbytes].view(torch.float32).view(KEEP, COLS)
    assert torch.equal(got, toy_tensors(LAYERS, ROWS, COLS, 0)["embed.weight"][:KEEP])
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="lost the connection to producer 0"):
        for chunk in pulls.chunks[1:]:
            link.pull(chunk, buffer[: chunk.nbytes])
    assert time.monotonic() - started < 10.0
    link.close()
    transport.close()
