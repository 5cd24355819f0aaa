# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A producer and a consumer of the sharded_rdt NIXL transport in separate
processes, without vLLM, for fault-injection tests and the pull benchmark.

`toy_names`, `toy_tensors` and `toy_pull_plan` describe a small checkpoint and a
worker that keeps some rows of every tensor; `consumer_main` and
`producer_main` are process entry points that report over a pipe.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import torch

from vllm.distributed.weight_transfer.plan.ops import SliceSpec, ViewOp
from vllm.distributed.weight_transfer.plan.worker_plan import (
    Region,
    SliceCopy,
    build_plan,
)
from vllm.distributed.weight_transfer.pull.chunks import (
    PullChunk,
    PullPlan,
    build_pull_plan,
)
from vllm.distributed.weight_transfer.pull.routing import RdtRouter


def toy_names(num_layers: int) -> list[str]:
    return (
        ["embed.weight"]
        + [f"layers.{i}.weight" for i in range(num_layers)]
        + ["head.weight"]
    )


def toy_tensors(
    num_layers: int, rows: int, cols: int, seed: int
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        n: torch.randn(rows, cols, generator=gen, dtype=torch.float32)
        for n in toy_names(num_layers)
    }


def toy_pull_plan(num_layers: int, rows: int, cols: int, keep: int) -> PullPlan:
    """A worker that keeps the first ``keep`` rows of every tensor."""
    copies = []
    for name in toy_names(num_layers):
        spec = SliceSpec(
            name, (ViewOp("narrow", (0, 0, keep)),), (keep, cols), "float32"
        )
        module, param = name.rsplit(".", 1)
        region = Region(module, param, 0, (keep, cols), (cols, 1), "float32")
        copies.append(SliceCopy(spec, region))
    plan = build_plan(worker="toy", names=toy_names(num_layers), copies=copies)
    return build_pull_plan(plan, RdtRouter(1, 1), 0)


def consumer_main(
    endpoint: dict[str, Any],
    chunks_json: list[dict[str, Any]],
    digest: str,
    mode: str,
    stall_timeout_s: float,
    conn: Any,
) -> None:
    """Register, report "registered", then pull every chunk and report each
    ("pulled", seq). ``mode``: "normal"; "slow" (0.5 s between pulls);
    "stall" (stop after the first chunk, keep the connection open);
    "bad-sync-id" (first a pull naming sync ``"1"``, a string, whose refusal
    is reported as ("refused", error), then the normal pulls)."""
    from vllm.distributed.weight_transfer.pull.nixl import (
        NixlConsumerTransport,
    )

    try:
        chunks = [PullChunk.from_json(c) for c in chunks_json]
        transport = NixlConsumerTransport(0, stall_timeout_s)
        link = transport.connect(0, endpoint)
        link.register(0, chunks, digest)
        size = max(c.nbytes for c in chunks)
        buffer = transport.receive_buffer(size, torch.device("cpu"))
        conn.send(("registered", None))
        if mode == "bad-sync-id":
            link.sync_id = "1"  # type: ignore[assignment]
            try:
                link.pull(chunks[0], buffer[: chunks[0].nbytes])
            except Exception as e:
                conn.send(("refused", str(e)))
            else:
                conn.send(("error", "a pull naming sync '1' was answered"))
                return
            link.sync_id = None
        for chunk in chunks:
            link.pull(chunk, buffer[: chunk.nbytes])
            conn.send(("pulled", chunk.seq))
            if mode == "stall":
                time.sleep(3600)
            if mode == "slow":
                time.sleep(0.5)
        conn.send(("done", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def producer_main(
    producer_kwargs: dict[str, Any],
    num_layers: int,
    rows: int,
    cols: int,
    conn: Any,
) -> None:
    """Serve the toy tensors: report the endpoint, then on "sync" run one sync,
    publishing a group every 0.3 s, and report "synced" or the error."""
    from vllm.distributed.weight_transfer.pull.nixl import NixlProducerServer

    try:
        server = NixlProducerServer(producer_kwargs, host="127.0.0.1")
        conn.send(("endpoint", server.endpoint()))
        while True:
            command = conn.recv()
            if command != "sync":
                break
            tensors = toy_tensors(num_layers, rows, cols, seed=0)
            server.begin_sync([0])
            for gi, name in enumerate(toy_names(num_layers)):
                server.wait_credit()
                server.publish(gi, {name: tensors[name]})
                time.sleep(0.3)
            server.end_sync()
            conn.send(("synced", None))
        server.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def raw_read_main(
    metadata: bytes, addr: int, nbytes: int, repeats: int, conn: Any
) -> None:
    """Read ``nbytes`` at ``addr`` of the agent described by ``metadata`` with
    one NIXL READ, ``repeats`` times, into a registered CPU buffer; report the
    seconds of each read (the benchmark's baseline)."""
    from vllm.distributed.weight_transfer.pull.nixl import make_agent, register

    try:
        agent = make_agent(f"raw-reader-{time.time_ns()}")
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        register(agent, buffer)
        remote = agent.add_remote_agent(metadata)
        times = []
        for _ in range(repeats):
            local = agent.get_xfer_descs([(buffer.data_ptr(), nbytes, 0)], "DRAM")
            far = agent.get_xfer_descs([(addr, nbytes, 0)], "DRAM")
            started = time.perf_counter()
            handle = agent.initialize_xfer("READ", local, far, remote)
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(handle)
            times.append(time.perf_counter() - started)
            agent.release_xfer_handle(handle)
            if state == "ERR":
                raise RuntimeError("NIXL READ failed")
        conn.send(("times", times))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
