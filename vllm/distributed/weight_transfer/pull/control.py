# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Authenticated JSON control connections between a producer and its
consumers (``pull.nixl``'s control socket).

A producer's ``ControlListener`` listens on ``(host, any port)``; its accept
loop only accepts, and each connection authenticates on a thread of its own
(``multiprocessing``'s HMAC challenge, both ways) within
``HANDSHAKE_TIMEOUT_S``; one that fails or stays silent is logged and
dropped. At most ``MAX_PENDING_HANDSHAKES`` authenticate at once and more are
closed on arrival, so a flood of connections costs a bounded number of
threads and delays consumers, never past their own deadline. A consumer's
``connect`` bounds the TCP connect and the handshake the same way. Once
authenticated, each side exchanges JSON objects with ``send_json`` and
``recv_json``; ``set_io_timeout`` bounds a connection's blocking reads and
writes.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

# How long a new control connection may take to authenticate, either side.
HANDSHAKE_TIMEOUT_S = 10.0
# How many connections may be authenticating at the same time.
MAX_PENDING_HANDSHAKES = 64


def send_json(conn: Connection, message: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(message).encode())


def recv_json(conn: Connection) -> dict[str, Any]:
    message = json.loads(conn.recv_bytes())
    if not isinstance(message, dict):
        raise ValueError(
            f"control message is a {type(message).__name__}, not an object"
        )
    return message


def set_io_timeout(conn: Connection, timeout_s: float | None) -> None:
    """Bound every blocking read and write on ``conn`` by ``timeout_s``
    (None: unbounded). A read or write that times out raises
    ``BlockingIOError``."""
    seconds = timeout_s or 0.0
    value = struct.pack("ll", int(seconds), int((seconds % 1) * 1_000_000))
    # A second socket object on a duplicate of the descriptor; the options
    # belong to the shared socket.
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


# Addresses that reach only the machine itself.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def connect(address: tuple[str, int], authkey: bytes, timeout_s: float) -> Connection:
    """An authenticated control connection to ``address``; the TCP connect
    and the handshake each take at most ``timeout_s``, else ``OSError``
    (``TimeoutError`` / ``BlockingIOError``) or ``AuthenticationError``."""
    sock = socket.create_connection(address, timeout=timeout_s)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    try:
        set_io_timeout(conn, timeout_s)
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
        set_io_timeout(conn, None)
    except BaseException:
        conn.close()
        raise
    return conn


class ControlListener:
    """Accepts authenticated control connections on ``(host, any port)``
    and hands each to ``serve`` on a thread of its own; see the module
    docstring. ``serve`` owns the connection it is given."""

    def __init__(
        self,
        host: str,
        authkey: bytes,
        serve: Callable[[Connection], None],
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
    ) -> None:
        self._authkey = authkey
        self._serve = serve
        self._handshake_timeout_s = handshake_timeout_s
        self._handshake_slots = threading.BoundedSemaphore(max_pending_handshakes)
        self._max_pending = max_pending_handshakes
        self.refused_connections = 0
        self._closed = threading.Event()
        self._sock = socket.create_server((host, 0), backlog=64)
        # Lets the loop notice ``close`` without a connection arriving.
        self._sock.settimeout(0.5)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._thread = threading.Thread(
            target=self._accept_loop, name="sharded-rdt-accept", daemon=True
        )
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if not self._closed.is_set():
                    logger.warning(
                        "sharded_rdt producer failed to accept a connection: %s", e
                    )
                    time.sleep(0.1)  # e.g. out of descriptors; try again
                continue
            if not self._handshake_slots.acquire(blocking=False):
                self._refuse(sock, peer)
                continue
            threading.Thread(
                target=self._admit,
                args=(sock, peer),
                name="sharded-rdt-serve",
                daemon=True,
            ).start()

    def _refuse(self, sock: socket.socket, peer: Any) -> None:
        # Counted before the close, so whoever sees the close sees the count.
        self.refused_connections += 1
        sock.close()
        # The first refusal, then one line per hundred: a flood must not
        # flood the log too.
        if self.refused_connections % 100 == 1:
            logger.warning(
                "sharded_rdt producer closed a control connection from %s on "
                "arrival: %d connections are already authenticating (%d "
                "refused so far)",
                peer,
                self._max_pending,
                self.refused_connections,
            )

    def _admit(self, sock: socket.socket, peer: Any) -> None:
        sock.settimeout(None)
        conn = Connection(sock.detach())
        try:
            set_io_timeout(conn, self._handshake_timeout_s)
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
            set_io_timeout(conn, None)
        except Exception as e:
            logger.warning(
                "sharded_rdt producer dropped a control connection from %s that "
                "did not authenticate within %.1fs: %r",
                peer,
                self._handshake_timeout_s,
                e,
            )
            conn.close()
            return
        finally:
            self._handshake_slots.release()
        if self._closed.is_set():
            conn.close()
            return
        self._serve(conn)

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
