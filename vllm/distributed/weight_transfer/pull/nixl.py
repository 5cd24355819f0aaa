# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Direct NIXL transport: the inference side needs no Ray at all.

Each trainer rank runs a NIXL agent next to its `Producer` and a small control
socket (``multiprocessing.connection`` with an auth key, JSON messages). Each
worker runs its own NIXL agent. Per consumer and producer, one connection:

    consumer                              producer
    {"op": "register", chunks, digest} -> Producer.register; serve buffers are
                                          registered with NIXL once
                                       <- {"buffers": [...]}
    {"op": "pull", "seq": s, "id": i}  -> Producer.pack (waits for the group)
                                       <- {"id": i, "addr", "nbytes", "checksum",
                                           "delta": {"addr", "nbytes", "header"}
                                           when a delta is offered}
    NIXL READ of the packed bytes into the consumer's registered receive buffer
    {"op": "done", "seq": s}           -> Producer.read_done (no reply)
    {"op": "abort", "reason", "sync"}  -> Producer.fail (own connection)
    {"op": "receipt", "receipt", "id"} -> Producer.deliver_receipt (own
                                       <- {"id"}      connection, at finish)

The consumer sends its next pull to a producer before reading the current
chunk, so the producer packs one chunk while the previous one is read. The
producer answers requests in order on a thread per connection and handles
notices as they arrive, so a pull waiting for its group never holds back the
``done`` that frees the group before it.

A dropped connection of a consumer that still had chunks to read fails the
producer's sync at once; only the consumer's newest connection counts (one it
replaced after a failed pull may end late). A dead producer shows up on the
consumer as a dropped connection. Every wait on either side is bounded by
``stall_timeout_s``.

The control connections (authenticated, bounded handshakes, JSON messages)
are ``pull.control``'s. Bytes move only by NIXL READ (UCX); the control
messages are a few hundred bytes per chunk.
"""

from __future__ import annotations

import base64
import os
import queue
import secrets
import threading
import time
import uuid
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.weight_transfer.common.wire_fields import check_int
from vllm.distributed.weight_transfer.pull.chunks import PullChunk
from vllm.distributed.weight_transfer.pull.control import (
    HANDSHAKE_TIMEOUT_S,
    LOOPBACK_HOSTS,
    ControlListener,
    connect,
    recv_json,
    send_json,
)
from vllm.distributed.weight_transfer.pull.delta_bases import OfferedDelta
from vllm.distributed.weight_transfer.pull.producer import Producer
from vllm.distributed.weight_transfer.pull.transport import (
    ConsumerTransport,
    Offered,
    ProducerLink,
    ProducerServer,
)
from vllm.distributed.weight_transfer.verification import (
    describe_error,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.pull.registry import (
        ConsumerSettings,
        ServerSettings,
    )

logger = init_logger(__name__)

_REPLY_GRACE_S = 5.0


def _mem(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of ``tensor``."""
    if tensor.device.type == "cpu":
        return "DRAM", 0
    return "VRAM", tensor.device.index or 0


# The NIXL agent's progress thread sleeps this long between polls: nixl_agent's
# 0 busy-loops a quarter of a core per agent for its life; 1 ms costs about 1%
# and no measurable READ throughput (256 MiB CPU reads, 2-core CI machine).
PROGRESS_THREAD_DELAY_US = 1000
_AGENT_LOCK = threading.Lock()


def _readable(view: torch.Tensor) -> dict[str, Any]:
    """Where a consumer reads ``view`` (in a registered buffer) from."""
    mem, dev = _mem(view)
    return {"addr": view.data_ptr(), "nbytes": view.numel(), "mem": mem, "dev": dev}


def make_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend and a sleeping progress thread."""
    try:
        import nixl._api as nixl_api
    except ImportError as e:
        raise RuntimeError(
            "sharded_rdt's NIXL transport needs the `nixl` package on both the "
            "trainer and the inference side (`pip install nixl`)"
        ) from e
    bind = nixl_api.nixlBind
    base = bind.nixlAgentConfig

    class _DelayedProgress(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - the binding's name
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, max(value, PROGRESS_THREAD_DELAY_US))

    # nixl_agent builds its config from this class; swap it only while ours
    # is constructed.
    with _AGENT_LOCK:
        bind.nixlAgentConfig = _DelayedProgress
        try:
            return nixl_api.nixl_agent(
                name, nixl_api.nixl_agent_config(backends=["UCX"])
            )
        finally:
            bind.nixlAgentConfig = base


def register(agent: Any, tensor: torch.Tensor) -> Any:
    mem, dev = _mem(tensor)
    nbytes = tensor.numel() * tensor.element_size()
    return agent.register_memory([(tensor.data_ptr(), nbytes, dev, "")], mem)


def deregister_all(agent: Any, registrations: list[Any]) -> None:
    """Deregister each of ``registrations`` from ``agent`` (a failure is logged
    and the rest still go) and empty the list."""
    for reg in registrations:
        try:
            agent.deregister_memory(reg)
        except Exception as e:
            logger.debug("NIXL deregister failed: %s", e)
    registrations.clear()


# -- producer side -------------------------------------------------------------


class NixlProducerServer(ProducerServer):
    """Serves one `Producer` to consumers over NIXL; see the module docstring."""

    def __init__(self, producer_kwargs: dict[str, Any], host: str) -> None:
        self.agent_name = (
            f"sharded-rdt-producer-{uuid.uuid4().hex[:8]}-rk{producer_kwargs['rank']}"
        )
        self._agent: Any = make_agent(self.agent_name)
        self._registrations: list[Any] = []
        self._agent_lock = threading.Lock()
        self.producer = Producer(**producer_kwargs, on_new_buffer=self._register)
        self._authkey = secrets.token_bytes(16)
        self._host = host
        self._closed = threading.Event()
        self._connections: list[Connection] = []
        # Each consumer's newest registered connection (``_lost``).
        self._newest: dict[int, Connection] = {}
        self._connections_lock = threading.Lock()
        self._listener = ControlListener(host, self._authkey, self._serve)

    def endpoint(self) -> dict[str, Any]:
        return {
            "transport": "nixl",
            "host": self._host,
            "port": self._listener.address[1],
            "authkey": self._authkey.hex(),
            "agent": self.agent_name,
        }

    def _register(self, tensor: torch.Tensor) -> None:
        with self._agent_lock:
            self._registrations.append(register(self._agent, tensor))

    def _serve(self, conn: Connection) -> None:
        """Read one connection's messages: notices (``done``, ``abort``) at
        once, requests on a second thread that answers them in order, so a
        pull waiting for its group never delays the ``done`` before it."""
        with self._connections_lock:
            if self._closed.is_set():
                conn.close()
                return
            self._connections.append(conn)
        consumer_id: int | None = None
        requests: queue.Queue[dict[str, Any] | None] = queue.Queue()
        send_lock = threading.Lock()
        answerer = threading.Thread(
            target=self._answer,
            args=(conn, requests, send_lock),
            name="sharded-rdt-answer",
            daemon=True,
        )
        answerer.start()
        try:
            while not self._closed.is_set():
                if not conn.poll(0.5):
                    continue
                message = recv_json(conn)
                consumer_id = message.get("consumer_id", consumer_id)
                if message.get("op") == "register" and consumer_id is not None:
                    with self._connections_lock:  # a consumer's pulling one
                        self._newest[consumer_id] = conn
                if "id" in message:
                    requests.put(message)
                    continue
                try:
                    self._handle(message.get("op"), message)
                except Exception as e:
                    # Any notice, however malformed, is logged and dropped:
                    # this thread serves the consumer's later messages too.
                    logger.warning("sharded_rdt notice %s failed: %s", message, e)
        except (EOFError, OSError):
            self._lost(consumer_id, conn, "disconnected")
        except ValueError as e:  # not JSON, or not an object
            logger.warning("sharded_rdt producer dropped a connection: %s", e)
            self._lost(consumer_id, conn, f"malformed message: {e}")
        finally:
            requests.put(None)
            self._close_connection(conn)

    def _lost(self, consumer_id: int | None, conn: Connection, reason: str) -> None:
        """``conn`` ended: fail the sync if it was ``consumer_id``'s newest
        connection; the late end of an older one (the consumer reconnected
        after a failed pull) fails nothing."""
        if consumer_id is None or self._closed.is_set():
            return
        with self._connections_lock:
            if self._newest.get(consumer_id) is not conn:
                return
            del self._newest[consumer_id]
        self.producer.consumer_lost(consumer_id, reason)

    def _close_connection(self, conn: Connection) -> None:
        """Closes ``conn`` exactly once: its serving thread and `close` may
        both reach here, and a second ``close`` of the same descriptor would
        raise (or hit a descriptor reused since)."""
        with self._connections_lock:
            if conn not in self._connections:
                return
            self._connections.remove(conn)
            conn.close()

    def _answer(
        self,
        conn: Connection,
        requests: queue.Queue[dict[str, Any] | None],
        send_lock: threading.Lock,
    ) -> None:
        while (message := requests.get()) is not None:
            try:
                reply = self._handle(message.get("op"), message) or {}
            except Exception as e:
                # Every request gets an answer, an error included: else the
                # consumer's later pulls would wait out their deadline.
                reply = {"error": describe_error(e)}
            reply["id"] = message["id"]
            try:
                with send_lock:
                    send_json(conn, reply)
            except (EOFError, OSError):
                return

    def _handle(self, op: Any, message: dict[str, Any]) -> dict[str, Any] | None:
        producer = self.producer
        if op == "register":
            chunks = [PullChunk.from_json(c) for c in message["chunks"]]
            buffers = producer.register(
                message["consumer_id"], chunks, message["digest"]
            )
            with self._agent_lock:
                metadata = self._agent.get_agent_metadata()
            return {
                "buffers": len(buffers),
                "metadata": base64.b64encode(metadata).decode(),
            }
        if op == "pull":
            packed = producer.pack(
                message["consumer_id"], message["seq"], message.get("sync")
            )
            reply = _readable(packed.view)
            reply["checksum"] = packed.checksum
            if packed.delta is not None:
                reply["delta"] = _readable(packed.delta.view)
                reply["delta"]["header"] = packed.delta.header
            return reply
        if op == "receipt":
            producer.deliver_receipt(message["receipt"])
            return {}
        if op == "done":
            producer.read_done(message["consumer_id"], message["seq"])
            return None
        if op == "abort":
            producer.fail(
                f"consumer {message.get('consumer_id')} aborted: {message['reason']}",
                sync_id=message.get("sync"),
            )
            return None
        raise ValueError(f"unknown sharded_rdt control op {op!r}")

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.producer.close()
        self._listener.close()
        with self._connections_lock:
            open_connections = list(self._connections)
        for conn in open_connections:
            self._close_connection(conn)
        with self._agent_lock:
            deregister_all(self._agent, self._registrations)
            # Dropping the agent stops its progress thread, which otherwise
            # polls for the life of the process.
            self._agent = None


# -- consumer side -------------------------------------------------------------


class _NixlLink(ProducerLink):
    def __init__(
        self,
        transport: NixlConsumerTransport,
        producer_index: int,
        endpoint: dict[str, Any],
    ) -> None:
        self.transport = transport
        self.producer_index = producer_index
        self.peer = f"producer {producer_index}"
        self.endpoint = endpoint
        self.consumer_id = transport.consumer_id
        self._address = (endpoint["host"], int(endpoint["port"]))
        self._authkey = bytes.fromhex(endpoint["authkey"])
        self._conn = self._connect("connect")
        self._lock = threading.Lock()
        self._next_id = 0
        self._ahead: tuple[int, int] | None = None  # (seq, request id) in flight
        self.remote_agent: str | None = None

    def _send_request(self, message: dict[str, Any]) -> int:
        with self._lock:
            self._next_id += 1
            request_id = self._next_id
            try:
                send_json(
                    self._conn,
                    {**message, "id": request_id, "consumer_id": self.consumer_id},
                )
            except (EOFError, OSError) as e:
                raise self._lost(message["op"], e) from e
        return request_id

    def _await_reply(
        self, request_id: int, what: str, timeout_s: float
    ) -> dict[str, Any]:
        """The reply to ``request_id``; replies to requests abandoned by an
        earlier failure are skipped."""
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._conn.poll(remaining):
                    raise TimeoutError(
                        f"producer {self.producer_index} did not answer {what} "
                        f"within {timeout_s:.1f}s"
                    )
                reply = recv_json(self._conn)
                if reply.get("id") == request_id:
                    break
        except (EOFError, OSError) as e:
            raise self._lost(what, e) from e
        if "error" in reply:
            raise RuntimeError(
                f"producer {self.producer_index} refused {what}: {reply['error']}"
            )
        return reply

    def _connect(self, what: str) -> Connection:
        timeout_s = min(self.transport.stall_timeout_s, HANDSHAKE_TIMEOUT_S)
        try:
            return connect(self._address, self._authkey, timeout_s)
        except Exception as e:
            hint = ""
            if self._address[0] in LOOPBACK_HOSTS:
                hint = (
                    ". The producer published a loopback address (the default "
                    "producer_host): a worker on another node needs "
                    "ShardedRDTTrainerInitInfo(producer_host=<an address it can "
                    "reach>) or transport='rdt'"
                )
            raise RuntimeError(
                f"could not open a control connection to producer "
                f"{self.producer_index} ({self._address[0]}:{self._address[1]}) "
                f"for {what} within {timeout_s:.1f}s: {e!r}; the trainer rank is "
                f"gone, unreachable, or its endpoint's authkey does not match{hint}"
            ) from e

    def _lost(self, what: str, error: BaseException) -> RuntimeError:
        return RuntimeError(
            f"lost the connection to producer {self.producer_index} "
            f"({self._address[0]}:{self._address[1]}) during {what}; the trainer "
            f"rank most likely died: {error!r}"
        )

    def _request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        request_id = self._send_request(message)
        return self._await_reply(request_id, message["op"], timeout_s)

    def _notify(self, message: dict[str, Any]) -> None:
        with self._lock:
            try:
                send_json(self._conn, {**message, "consumer_id": self.consumer_id})
            except (EOFError, OSError) as e:
                raise self._lost(message["op"], e) from e

    def register(
        self, consumer_id: int, chunks: Sequence[PullChunk], digest: str
    ) -> None:
        reply = self._request(
            {
                "op": "register",
                "chunks": [c.to_json() for c in chunks],
                "digest": digest,
            },
            self.transport.stall_timeout_s,
        )
        # The producer's metadata describes its memory registrations, so it is
        # taken after the serve buffers for these chunks exist.
        if self.remote_agent is not None:
            self.transport.agent.remove_remote_agent(self.remote_agent)
        self.remote_agent = self.transport.agent.add_remote_agent(
            base64.b64decode(reply["metadata"])
        )

    def _request_pull(self, chunk: PullChunk, next_chunk: PullChunk | None) -> Offered:
        timeout_s = self.transport.stall_timeout_s + _REPLY_GRACE_S
        what = f"pull of seq {chunk.seq}"
        if chunk.seq == 0:
            self._ahead = None  # a new sync; a request left from a failed one is void
        if self._ahead is not None and self._ahead[0] == chunk.seq:
            request_id = self._ahead[1]
        else:
            request_id = self._send_request(
                {"op": "pull", "seq": chunk.seq, "sync": self.sync_id}
            )
        self._ahead = None
        reply = self._await_reply(request_id, what, timeout_s)
        if next_chunk is not None:
            # The producer packs the next chunk while this one is read.
            self._ahead = (
                next_chunk.seq,
                self._send_request({"op": "pull", "seq": next_chunk.seq}),
            )

        def read_into(into: torch.Tensor) -> None:
            if not chunk.nbytes:
                return
            assert self.remote_agent is not None, "pull before register"
            self.transport.read(
                self.remote_agent,
                into,
                (reply["addr"], chunk.nbytes, reply["dev"]),
                reply["mem"],
            )

        return Offered(
            reply["nbytes"],
            read_into,
            lambda: reply.get("checksum"),
            self._offered_delta(reply.get("delta")),
        )

    def _offered_delta(self, part: Any) -> OfferedDelta | None:
        """The delta a pull reply offers (``part``: where to read it, and its
        header), or None; a malformed part is refused when read."""
        if part is None:
            return None
        fields = part if isinstance(part, dict) else {}
        nbytes = fields.get("nbytes")

        def read_into(into: torch.Tensor) -> None:
            try:
                remote = (
                    check_int(fields.get("addr"), "delta.addr"),
                    into.numel(),
                    check_int(fields.get("dev"), "delta.dev"),
                )
                mem = fields["mem"]
            except KeyError as e:
                raise ValueError(f"the pull reply's delta has no {e}") from None
            assert self.remote_agent is not None, "pull before register"
            self.transport.read(self.remote_agent, into, remote, mem)

        return OfferedDelta(
            fields.get("header"),
            nbytes if isinstance(nbytes, int) and not isinstance(nbytes, bool) else -1,
            read_into,
        )

    def _read_done(self, seq: int) -> None:
        self._notify({"op": "done", "seq": seq})

    def abort(self, reason: str) -> None:
        self._ahead = None
        # A connection of its own: the pulling thread may hold this link's.
        with self._connect("abort") as conn:
            send_json(
                conn,
                {
                    "op": "abort",
                    "consumer_id": self.consumer_id,
                    "reason": reason,
                    "sync": self.sync_id,
                },
            )

    def deliver_receipt(self, receipt: dict[str, Any]) -> None:
        # A connection of its own, so that a pull request left over from a
        # failed sync never holds the receipt back. It names no consumer: its
        # closing is not a consumer leaving mid-sync.
        timeout_s = self.transport.stall_timeout_s + _REPLY_GRACE_S
        try:
            with self._connect("receipt delivery") as conn:
                send_json(conn, {"op": "receipt", "receipt": receipt, "id": 1})
                if not conn.poll(timeout_s):
                    raise TimeoutError(
                        f"producer {self.producer_index} did not take the "
                        f"receipt within {timeout_s:.1f}s"
                    )
                reply = recv_json(conn)
        except (EOFError, OSError) as e:
            raise self._lost("receipt delivery", e) from e
        if "error" in reply:
            raise RuntimeError(
                f"producer {self.producer_index} refused the receipt: {reply['error']}"
            )

    def close(self) -> None:
        self._conn.close()
        if self.remote_agent is None:
            return
        try:
            self.transport.agent.remove_remote_agent(self.remote_agent)
        except Exception as e:
            logger.debug("NIXL remove_remote_agent failed: %s", e)


class NixlConsumerTransport(ConsumerTransport):
    """A worker's NIXL agent; see the module docstring."""

    name = "nixl"

    def __init__(self, consumer_id: int, stall_timeout_s: float) -> None:
        self.consumer_id = consumer_id
        self.stall_timeout_s = stall_timeout_s
        self.agent: Any = make_agent(
            f"sharded-rdt-consumer{consumer_id}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self._registrations: list[Any] = []

    def receive_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._registrations.append(register(self.agent, buffer))
        return buffer

    def connect(self, producer_index: int, endpoint: Any) -> ProducerLink:
        if not isinstance(endpoint, dict) or endpoint.get("transport") != "nixl":
            raise ValueError(
                f"producer_endpoints[{producer_index}] = {endpoint!r} is not a NIXL "
                "endpoint"
            )
        return _NixlLink(self, producer_index, endpoint)

    def read(
        self,
        remote_agent: str,
        into: torch.Tensor,
        remote: tuple[int, int, int],
        remote_mem: str,
    ) -> None:
        """NIXL READ of ``remote`` (addr, nbytes, device) into ``into``."""
        mem, dev = _mem(into)
        local = self.agent.get_xfer_descs([(into.data_ptr(), remote[1], dev)], mem)
        far = self.agent.get_xfer_descs([remote], remote_mem)
        handle = self.agent.initialize_xfer("READ", local, far, remote_agent)
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + self.stall_timeout_s
            pause = 0.0
            while state != "DONE":
                if state == "ERR":
                    raise RuntimeError(f"NIXL READ from {remote_agent} failed")
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"NIXL READ of {remote[1]} bytes from {remote_agent} did "
                        f"not finish within {self.stall_timeout_s:.1f}s"
                    )
                time.sleep(pause)
                pause = min(pause * 2 or 1e-5, 1e-3)
                state = self.agent.check_xfer_state(handle)
        finally:
            self.agent.release_xfer_handle(handle)

    def close(self) -> None:
        if self.agent is None:
            return
        deregister_all(self.agent, self._registrations)
        self.agent = None  # stops the agent's progress thread


def nixl_consumer(settings: ConsumerSettings) -> ConsumerTransport:
    """The "nixl" transport's consumer factory (see `pull.registry`)."""
    return NixlConsumerTransport(settings.consumer_id, settings.stall_timeout_s)


def nixl_server(settings: ServerSettings) -> ProducerServer:
    """The "nixl" transport's server factory (see `pull.registry`)."""
    return NixlProducerServer(settings.producer_kwargs, host=settings.host)
