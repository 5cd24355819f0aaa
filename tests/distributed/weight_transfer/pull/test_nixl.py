# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The NIXL transport's control socket against hostile peers: a port scan, a
wrong auth key or a silent connection never stops the producer accepting,
and a consumer's connect never waits without bound (no NIXL needed); the late
end of a connection a consumer replaced fails no sync."""

from __future__ import annotations

import json
import queue
import secrets
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection

import pytest

from vllm.distributed.weight_transfer.pull.control import (
    ControlListener,
    connect,
)

# Their handshake and connect deadlines are a second or a few: measured alone.
pytestmark = pytest.mark.serial

KEY = secrets.token_bytes(16)


@pytest.fixture
def listener():
    served: queue.Queue[bytes] = queue.Queue()

    def serve(conn: Connection) -> None:
        served.put(conn.recv_bytes())
        conn.send_bytes(b"ok")
        conn.close()

    listener = ControlListener("127.0.0.1", KEY, serve, handshake_timeout_s=1.0)
    listener.served = served  # type: ignore[attr-defined]
    yield listener
    listener.close()


def _consumer_succeeds(listener: ControlListener) -> None:
    started = time.monotonic()
    with connect(listener.address, KEY, timeout_s=5.0) as conn:
        conn.send_bytes(b"pull")
        assert conn.recv_bytes() == b"ok"
    assert listener.served.get(timeout=5) == b"pull"  # type: ignore[attr-defined]
    assert time.monotonic() - started < 3.0


def test_connect_and_close_does_not_stop_accepting(listener):
    for _ in range(3):
        socket.create_connection(listener.address).close()
    _consumer_succeeds(listener)


def test_a_wrong_key_is_refused_and_the_next_consumer_served(listener):
    with pytest.raises(AuthenticationError):
        connect(listener.address, secrets.token_bytes(16), timeout_s=5.0)
    _consumer_succeeds(listener)


def test_garbage_instead_of_a_handshake_does_not_stop_accepting(listener):
    with socket.create_connection(listener.address) as sock:
        sock.sendall(b"\xff" * 64)
        _consumer_succeeds(listener)


def test_a_silent_connection_neither_blocks_others_nor_lives_forever(listener):
    with socket.create_connection(listener.address) as silent:
        _consumer_succeeds(listener)
        # The producer drops it once the handshake deadline (1 s) passes.
        silent.settimeout(10.0)
        while silent.recv(4096):
            pass


def test_connections_beyond_the_handshake_cap_are_closed_on_arrival():
    def serve(conn: Connection) -> None:
        conn.send_bytes(conn.recv_bytes())
        conn.close()

    listener = ControlListener(
        "127.0.0.1", KEY, serve, handshake_timeout_s=30.0, max_pending_handshakes=2
    )
    try:
        silent = [socket.create_connection(listener.address) for _ in range(2)]
        # Both slots are held by connections that never authenticate: the
        # next one is closed at once instead of getting a thread.
        with socket.create_connection(listener.address) as extra:
            extra.settimeout(5.0)
            while extra.recv(4096):
                pass
        assert listener.refused_connections >= 1
        for sock in silent:
            sock.close()
        # Closing them frees the slots (their handshakes fail at once).
        deadline = time.monotonic() + 10.0
        while True:
            try:
                with connect(listener.address, KEY, timeout_s=2.0) as conn:
                    conn.send_bytes(b"pull")
                    assert conn.recv_bytes() == b"pull"
                break
            except (OSError, EOFError):
                assert time.monotonic() < deadline, "slots never came back"
                time.sleep(0.1)
    finally:
        listener.close()


def test_connect_to_a_peer_that_never_answers_times_out():
    with socket.create_server(("127.0.0.1", 0)) as mute:  # never accepts
        started = time.monotonic()
        with pytest.raises(OSError):
            connect(mute.getsockname()[:2], KEY, timeout_s=0.5)
        assert time.monotonic() - started < 3.0


def test_an_unreachable_loopback_producer_names_producer_host():
    """A worker on another node than the trainer reaches nothing at the
    default loopback address; the error says which setting fixes it."""
    from types import SimpleNamespace

    from vllm.distributed.weight_transfer.pull.nixl import _NixlLink

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    transport = SimpleNamespace(consumer_id=0, stall_timeout_s=2.0)
    endpoint = {"transport": "nixl", "host": "127.0.0.1", "port": port}
    endpoint["authkey"] = KEY.hex()
    with pytest.raises(RuntimeError, match="producer_host=") as info:
        _NixlLink(transport, 0, endpoint)  # type: ignore[arg-type]
    assert "transport='rdt'" in str(info.value)


class _ScriptedConn:
    """A control connection that delivers ``messages``, then reads as closed
    once ``end`` is set (a consumer that hung up)."""

    def __init__(self, messages: list[dict], end: threading.Event) -> None:
        self._messages = [json.dumps(m).encode() for m in messages]
        self._end = end

    def poll(self, timeout: float) -> bool:
        return bool(self._messages) or self._end.wait(timeout)

    def recv_bytes(self) -> bytes:
        if self._messages:
            return self._messages.pop(0)
        raise EOFError

    def send_bytes(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def _until(check, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.01)


def test_the_late_end_of_a_replaced_connection_fails_no_sync(monkeypatch):
    """A worker whose pull failed drops its connection and registers on a new
    one for the next sync. When the producer reads the old connection's end
    only after that (a loaded machine), the end must not fail the sync the
    new connection serves; the end of the new one still does."""
    pytest.importorskip("nixl")
    from vllm.distributed.weight_transfer.pull.nixl import NixlProducerServer

    producer = dict(
        rank=0, names=["x"], group_lens=[1], served_names=["x"], stall_timeout_s=10
    )
    server = NixlProducerServer(producer, "127.0.0.1")
    lost: list[tuple[int, str]] = []
    monkeypatch.setattr(
        server.producer, "consumer_lost", lambda cid, why: lost.append((cid, why))
    )
    register = {"op": "register", "id": 1, "consumer_id": 3, "chunks": []}
    old_end, new_end = threading.Event(), threading.Event()
    old = _ScriptedConn([register], old_end)
    new = _ScriptedConn([register], new_end)
    serving = [threading.Thread(target=server._serve, args=(c,)) for c in (old, new)]
    try:
        serving[0].start()
        _until(lambda: server._newest.get(3) is old, "registered the old one")
        serving[1].start()
        _until(lambda: server._newest.get(3) is new, "registered the new one")
        old_end.set()
        serving[0].join(10)
        assert lost == []
        new_end.set()
        serving[1].join(10)
        assert lost == [(3, "disconnected")]
    finally:
        old_end.set()
        new_end.set()
        server.close()
