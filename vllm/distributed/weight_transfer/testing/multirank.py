# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A multi-process trainer for tests and examples: ``world_size`` processes join a
gloo group, each builds the same tiny HF model, and all of them push it with the
``ipc`` backend in lockstep. Rank 0's client calls are relayed over a pipe to the
process that owns the ``LLM``, which runs them with ``serve_relayed_calls``.

    parent_conn, child_conn = multiprocessing.get_context("spawn").Pipe()
    procs = start_trainer_ranks(spec, seed=1, world_size=2, conn=child_conn)
    payloads = serve_relayed_calls(parent_conn, OfflineLLMWeightSyncClient(llm))
    join_trainer_ranks(procs)
"""

from __future__ import annotations

import multiprocessing
import socket
import traceback
from typing import Any

from vllm.distributed.weight_transfer.testing.tiny_models import TinyModelSpec

_DONE = "__done__"


class PipeClient:
    """A ``VLLMWeightSyncClient`` that forwards every call over a pipe."""

    def __init__(self, conn: Any, timeout_s: float = 300.0) -> None:
        self.conn = conn
        self.timeout_s = timeout_s

    def _call(self, method: str, *args: Any) -> Any:
        self.conn.send((method, args))
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"relayed {method} got no answer in {self.timeout_s}s")
        error, result = self.conn.recv()
        if error is not None:
            raise RuntimeError(f"relayed {method} failed: {error}")
        return result

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)

    def update_weight_version(self, new_version: str) -> None:
        self._call("update_weight_version", new_version)

    def get_world_size(self) -> int:
        return int(self._call("get_world_size"))


class _NoClient:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a non-sender trainer rank called client.{name}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer_rank(
    rank: int,
    world_size: int,
    port: int,
    spec: TinyModelSpec,
    seed: int,
    conn: Any,
    init_kwargs: dict[str, Any],
    syncs: int,
    sharded: bool = False,
) -> None:
    import torch.distributed as dist

    from vllm.distributed.weight_transfer import (
        ModuleSource,
        WeightTransferTrainerFactory,
    )
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.testing.tiny_models import (
        build_hf_model,
        randomize_weights_,
    )

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
    )
    try:
        model = build_hf_model(spec)
        randomize_weights_(model, seed)
        sent = _sharded_copy(model, world_size) if sharded else model
        client = PipeClient(conn) if rank == 0 else _NoClient()
        engine = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=rank, **init_kwargs),
            client=client,
            source=ModuleSource(sent),
        )
        engine.send_weights()
        for i in range(1, syncs):
            # In place, as an optimizer step changes the weights.
            randomize_weights_(model, seed + i)
            if sharded:
                _reshard_in_place(sent, model, world_size)
            engine.send_weights()
        engine.shutdown()
    except BaseException:
        if rank == 0:
            conn.send((_DONE, traceback.format_exc()))
        raise
    else:
        if rank == 0:
            conn.send((_DONE, None))
    finally:
        dist.destroy_process_group()


def _sharded_copy(model: Any, world_size: int) -> Any:
    """A copy of ``model`` whose parameters are DTensors sharding dimension 0
    over a CPU mesh of every rank, FSDP2's layout."""
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    sharded = copy.deepcopy(model)
    for module in sharded.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            shards = distribute_tensor(param.detach(), mesh, [Shard(0)])
            setattr(module, name, torch.nn.Parameter(shards, requires_grad=False))
    return sharded


def _reshard_in_place(sharded: Any, model: Any, world_size: int) -> None:
    """Copy ``model``'s values into ``sharded``'s shards, in place."""
    import torch
    from torch.distributed.tensor import distribute_tensor

    full = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in sharded.named_parameters():
            value = distribute_tensor(
                full[name].detach(), param.device_mesh, param.placements
            )
            param.to_local().copy_(value.to_local())


def start_trainer_ranks(
    spec: TinyModelSpec,
    seed: int,
    world_size: int,
    conn: Any,
    syncs: int = 1,
    sharded: bool = False,
    **init_kwargs: Any,
) -> list[Any]:
    """Spawn the trainer ranks; rank 0 relays its client calls over ``conn``.
    Each rank builds ``spec``'s model with weights from ``seed`` and sends it
    ``syncs`` times, drawing the weights anew in place (seed + i) before each
    later sync; ``trainer_weights`` gives the last sync's model. ``sharded``:
    the ranks hold the model as DTensors sharding dimension 0 over all of
    them (FSDP2's layout), and send those."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = []
    for rank in range(world_size):
        proc = ctx.Process(
            target=_trainer_rank,
            args=(
                rank,
                world_size,
                port,
                spec,
                seed,
                conn,
                init_kwargs,
                syncs,
                sharded,
            ),
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    return procs


def trainer_weights(spec: TinyModelSpec, seed: int, syncs: int = 1) -> Any:
    """The model the ranks of ``start_trainer_ranks(spec, seed, syncs=...)``
    sent last."""
    from vllm.distributed.weight_transfer.testing.tiny_models import (
        build_hf_model,
        randomize_weights_,
    )

    model = build_hf_model(spec)
    for i in range(syncs):
        randomize_weights_(model, seed + i)
    return model


def serve_relayed_calls(conn: Any, client: Any, timeout_s: float = 300.0) -> list:
    """Run rank 0's relayed calls on ``client`` until it is done.

    Returns the update payloads it sent; raises if the trainer failed.
    """
    payloads: list[Any] = []
    while True:
        if not conn.poll(timeout_s):
            raise TimeoutError(f"trainer rank 0 sent nothing for {timeout_s}s")
        method, args = conn.recv()
        if method == _DONE:
            if args is not None:
                raise RuntimeError(f"trainer rank 0 failed:\n{args}")
            return payloads
        if method == "update_weights":
            payloads.append(args[0])
        try:
            result = getattr(client, method)(*args)
        except Exception as e:
            conn.send((f"{type(e).__name__}: {e}", None))
        else:
            conn.send((None, result))


def join_trainer_ranks(procs: list[Any], timeout_s: float = 120.0) -> None:
    for proc in procs:
        proc.join(timeout_s)
    codes = [p.exitcode for p in procs]
    if codes != [0] * len(procs):
        for p in procs:
            if p.is_alive():
                p.kill()
        raise RuntimeError(f"trainer ranks exited with codes {codes}")


def worker_ipc_update_keys(worker: Any) -> list[str]:
    """For ``llm.collective_rpc``: the device keys a worker read last update."""
    engine = worker.weight_transfer_engine
    return sorted(getattr(engine, "last_update_keys", set()))
