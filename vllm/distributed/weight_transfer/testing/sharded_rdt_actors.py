# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Ray actors for sharded_rdt end-to-end tests, examples and benchmarks.

``LLMHost``: an offline ``vllm.LLM`` (default mp executor) living in a Ray
actor, driven through `RayVLLMWeightSyncClient`, plus oracle helpers.
``TrainerRank``: one trainer rank holding a tiny HF model; ranks of one trainer
join a gloo group; each may hold only part of the model (``hold``).

    ray.init(num_cpus=4)
    llm = ray.remote(num_cpus=0)(LLMHost).remote(model_dir, tp=1)
    ranks = [ray.remote(num_cpus=0)(TrainerRank).remote(model_dir, r, 2, port)
             for r in range(2)]
    ray.get([t.init.remote(llm, num_consumers=1, hold="half") for t in ranks])
    ray.get([t.randomize.remote(seed=1) for t in ranks])
    ray.get([t.send.remote() for t in ranks])
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import torch

from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    WeightSource,
    layerwise_groups,
)


class WrappedSource(WeightSource):
    """``inner`` as it is: its metadata, held names and tensors. The sources
    below change one of them."""

    def __init__(self, inner: WeightSource) -> None:
        self.inner = inner

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def held_names(self) -> Collection[str] | None:
        return self.inner.held_names()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.inner)


class HeldGroupsSource(WrappedSource):
    """A source that holds only the gather groups with ``index % world == rank``
    (``hold="half"`` with two ranks), or all of them (``hold="all"``)."""

    def __init__(self, inner: WeightSource, rank: int, world: int, hold: str):
        super().__init__(inner)
        names = [m.name for m in inner.metadata()]
        groups = layerwise_groups(names)
        if hold == "all":
            self._held: set[str] | None = None
        elif hold == "half":
            self._held = {
                n for gi, g in enumerate(groups) if gi % world == rank for n in g
            }
        else:
            raise ValueError(f"hold is {hold!r}; expected 'all' or 'half'")

    def held_names(self) -> Collection[str] | None:
        return self._held

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.inner:
            if self._held is None or name in self._held:
                yield name, tensor


class FailingSource(WrappedSource):
    """``inner``, except that iteration raises after ``after`` tensors: a trainer
    rank that fails in the middle of a sync."""

    def __init__(self, inner: WeightSource, after: int) -> None:
        super().__init__(inner)
        self.after = after

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(self.inner):
            if i == self.after:
                raise RuntimeError(f"injected trainer failure after {i} tensors")
            yield item


class SlowSource(WrappedSource):
    """``inner``, waiting ``delay_s`` before each tensor: a sync that lasts
    long enough to generate during it."""

    def __init__(self, inner: WeightSource, delay_s: float) -> None:
        super().__init__(inner)
        self.delay_s = delay_s

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in self.inner:
            time.sleep(self.delay_s)
            yield item


class WrongShapeSource(WrappedSource):
    """``inner``, whose metadata announces ``name`` with one more row: a
    trainer that disagrees with the server on the model's structure."""

    def __init__(self, inner: WeightSource, name: str) -> None:
        super().__init__(inner)
        self.name = name

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(m.name, m.dtype, (m.shape[0] + 1, *m.shape[1:]))
            if m.name == self.name
            else m
            for m in self.inner.metadata()
        ]


class LLMHost:
    """An offline LLM with the sharded_rdt backend, in a Ray actor."""

    def __init__(
        self, model_dir: str, tp: int = 1, dtype: str = "float32", **engine_args: Any
    ) -> None:
        if tp > 1:
            os.environ.setdefault(
                "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp))
            )
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm

        self.llm = tiny_llm(
            model_dir,
            dtype=dtype,
            tensor_parallel_size=tp,
            backend="sharded_rdt",
            in_process=True,
            **engine_args,
        )
        # MKL's float32 GEMM (plain CPU linear layers) is not batch-invariant:
        # such an engine generates each oracle prompt alone, so every step
        # has the same shapes every time.
        config = engine_args.get("weight_transfer_config")
        self.one_at_a_time = getattr(config, "cpu_linear", "packed") == "plain"

    # The RayVLLMWeightSyncClient surface.
    def init_weight_transfer_engine(self, request: Any) -> None:
        self.llm.init_weight_transfer_engine(request)

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, request: Any) -> None:
        self.llm.update_weights(request)

    def finish_weight_update(self) -> None:
        self.llm.finish_weight_update()
        # What a reader saw the moment the server finished the update.
        self.version_at_finish = self.llm.get_weight_version()

    def update_weight_version(self, version: str) -> None:
        self.llm.update_weight_version(version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.collective_rpc("shutdown_weight_transfer_engine")

    def shutdown(self) -> None:
        """Stop the engine and its worker processes. Call it before the actor
        is killed: killing the actor alone leaves vLLM's workers running,
        orphaned, until they notice their engine is gone (minutes, spinning
        a core each)."""
        self.llm.llm_engine.engine_core.shutdown()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop KV blocks cached under the previous weights."""
        return bool(
            self.llm.reset_prefix_cache(reset_running_requests=reset_running_requests)
        )

    # Oracle helpers.
    def greedy(self) -> Any:
        from vllm.distributed.weight_transfer.testing import vllm_greedy

        return vllm_greedy(self.llm, one_at_a_time=self.one_at_a_time)

    def fresh_load_greedy(self, checkpoint_dir: str) -> Any:
        """What this engine serves with a model loaded fresh from
        ``checkpoint_dir`` (the served model is put back afterwards)."""
        from vllm.distributed.weight_transfer.testing import (
            FreshLoadOracle,
            offline_worker_call,
        )

        oracle = FreshLoadOracle(offline_worker_call(self.llm), self.greedy)
        return oracle.from_checkpoint(checkpoint_dir)

    def receipts(self) -> list[dict[str, Any] | None]:
        """What each worker's engine pulled in its last update."""
        return self.llm.collective_rpc(_last_receipt)

    def weight_dtypes(self) -> list[dict[str, str]]:
        """Per worker: the dtype of every parameter of the served model."""
        return self.llm.collective_rpc(served_weight_dtypes)

    def pids(self) -> list[int]:
        return self.llm.collective_rpc(_pid)

    def weight_version(self) -> str | None:
        return self.llm.get_weight_version()

    def version_seen_at_finish(self) -> str | None:
        """The served version right after the last finish_weight_update."""
        return getattr(self, "version_at_finish", None)

    def planned_landing_state(self) -> list[dict[str, Any]]:
        """Each worker's planned landing (``served_layers.planned_landing_state``)."""
        from vllm.distributed.weight_transfer.testing.served_layers import (
            planned_landing_state,
        )

        return self.llm.collective_rpc(planned_landing_state)

    def fence_status(self) -> list[dict[str, Any]]:
        """Each worker engine's update state (``FenceStatus.to_dict``)."""
        return self.llm.collective_rpc(_fence_status)

    def fail_on_chunk(self, index: int) -> None:
        """Make each worker's next update raise when it lands chunk ``index``."""
        self.llm.collective_rpc(_fail_on_chunk, args=(index,))

    def engine_finish_errors(self) -> list[str | None]:
        """Call each worker engine's ``finish_weight_update`` directly; the
        errors it raised (None where it returned)."""
        return self.llm.collective_rpc(_engine_finish_error)

    def served_bytes(self, name: str) -> list[torch.Tensor]:
        """Per worker: the bytes of served parameter ``name``."""
        return self.llm.collective_rpc(_served_bytes, args=(name,))

    def flip_served_byte(self, name: str, index: int) -> None:
        """Flip the low bit of byte ``index`` of served parameter ``name`` on
        every worker, out of band (no update, nothing told)."""
        self.llm.collective_rpc(_flip_served_byte, args=(name, index))


def stop_llm_host(llm: Any, timeout_s: float = 120.0) -> None:
    """Shut an ``LLMHost`` actor's engine down, then kill the actor (also
    when the shutdown fails or times out)."""
    import ray

    try:
        ray.get(llm.shutdown.remote(), timeout=timeout_s)
    except Exception as e:  # the engine may already be gone
        print(f"LLMHost shutdown: {type(e).__name__}: {e}")
    finally:
        ray.kill(llm)


def served_weight_dtypes(worker: Any) -> dict[str, str]:
    """For ``collective_rpc``: parameter name -> dtype of the served model."""
    model = worker.model_runner.model
    return {name: str(p.dtype) for name, p in model.named_parameters()}


def _last_receipt(worker: Any) -> dict[str, Any] | None:
    return worker.weight_transfer_engine.last_receipt


def _fence_status(worker: Any) -> dict[str, Any]:
    return worker.weight_transfer_engine.fence_status


def _fail_on_chunk(worker: Any, index: int) -> None:
    """Landing chunk ``index`` raises once, whether it lands from the receive
    buffer or was written straight into the served tensors (a delta)."""
    lander = worker.weight_transfer_engine._lander
    originals = {name: getattr(lander, name) for name in ("land", "land_in_place")}

    def failing(name: str) -> Any:
        def call(i: int, *args: Any, **kwargs: Any) -> None:
            if i == index:
                for original, method in originals.items():  # one failure only
                    setattr(lander, original, method)
                raise RuntimeError(f"injected worker failure at chunk {i}")
            originals[name](i, *args, **kwargs)

        return call

    for name in originals:
        setattr(lander, name, failing(name))


def _engine_finish_error(worker: Any) -> str | None:
    try:
        worker.weight_transfer_engine.finish_weight_update()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _pid(worker: Any) -> int:
    return os.getpid()


def _served_param(worker: Any, name: str) -> torch.Tensor:
    return dict(worker.model_runner.model.named_parameters())[name].data


def _served_bytes(worker: Any, name: str) -> torch.Tensor:
    return _served_param(worker, name).contiguous().view(-1).view(torch.uint8).clone()


def _flip_served_byte(worker: Any, name: str, index: int) -> None:
    param = _served_param(worker, name)
    with torch.no_grad():
        param.view(-1).view(torch.uint8)[index] ^= 0x01


# How `TrainerRank.send_with_bad_delta` spoils each delta the producer offers:
# header field -> its new value from the header. "reply_nbytes" is not a
# header field: the NIXL pull reply names one delta byte more than there are.
BAD_DELTA_FIELDS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "base_version": lambda h: h["base_version"] + 1,
    "base_digest": lambda h: "md5:" + "0" * 16,
    "nbytes": lambda h: h["nbytes"] - h["unit"],
    "unit": lambda h: 3,
    "count": lambda h: 10**9,
    "positions_dtype": lambda h: "int64",
    "values_offset": lambda h: h["values_offset"] + 8,
    "buffer_nbytes": lambda h: h["buffer_nbytes"] + 1,
    "format": lambda h: h["format"] + 1,
}


class TrainerRank:
    """One trainer rank: a full tiny HF model, a share of it held."""

    def __init__(self, model_dir: str, rank: int, world: int, port: int) -> None:
        self.rank = rank
        self.world = world
        if world > 1:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world,
            )
        self.model_dir = model_dir
        self.engine: Any = None
        self.model = self._load()

    def _load(self) -> torch.nn.Module:
        from vllm.distributed.weight_transfer.testing import load_hf_model

        return load_hf_model(self.model_dir, "float32")

    def reset(self) -> None:
        """Shut the trainer engine down and take the checkpoint's weights
        back, as a freshly started rank holds them (`TrainerPool` lends one
        rank to many tests)."""
        self.shutdown()
        self.model = self._load()

    def init(
        self,
        llm: Any,
        num_consumers: int,
        hold: str = "all",
        stall_timeout_s: float = 60.0,
        transport: str = "auto",
        verify_checksums: bool = False,
        client: Any = None,
        fp8_codes: bool = False,
        delta_bases_gb: float = 0.0,
    ) -> dict[str, Any]:
        """A trainer engine driving ``llm`` (an ``LLMHost`` actor) through
        Ray, or the engine ``client`` drives (e.g. a ``vllm serve`` over
        HTTP; ``llm`` is then unused). ``fp8_codes``: the trainer quantizes
        its linear weights to per-channel FP8 codes and scales
        (``fp8_codes.Fp8ChannelCodes``)."""
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.sharded_rdt.trainer import (
            ShardedRDTTrainerInitInfo,
        )
        from vllm.distributed.weight_transfer.trainer.sources import (
            CheckpointNamesSource,
        )

        if self.engine is not None:
            self.engine.shutdown()
        names: WeightSource = CheckpointNamesSource(self.model)
        if fp8_codes:
            from vllm.distributed.weight_transfer.quant.fp8 import Fp8ChannelCodes

            names = Fp8ChannelCodes(names)
        source = HeldGroupsSource(names, self.rank, self.world, hold)
        self.engine = WeightTransferTrainerFactory.trainer_init(
            ShardedRDTTrainerInitInfo(
                num_consumers=num_consumers,
                stall_timeout_s=stall_timeout_s,
                transport=transport,
                verify_checksums=verify_checksums,
                delta_bases_gb=delta_bases_gb,
                rank=self.rank,
            ),
            client=client if client is not None else RayVLLMWeightSyncClient(llm),
            source=source,
        )
        return self.engine.get_worker_init_payload()

    def randomize(self, seed: int) -> None:
        from vllm.distributed.weight_transfer.testing import randomize_weights_

        randomize_weights_(self.model, seed)

    def nudge(self, seed: int, fraction: float) -> None:
        """Move about ``fraction`` of every weight's elements by a small
        random step (the rest keep their exact bits), as an optimizer step
        with a small learning rate would."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                moved = torch.rand(p.shape, generator=gen) < fraction
                step = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-2
                p.add_(torch.where(moved, step, torch.zeros_like(step)))

    def send(
        self,
        live_consumer_ids: list[int] | None = None,
        weight_version: str | None = None,
    ) -> None:
        self.engine.send_weights(live_consumer_ids, weight_version=weight_version)

    def send_expecting_failure(self, weight_version: str | None = None) -> str:
        """A sync that must fail; returns the error the engine raised."""
        try:
            self.engine.send_weights(weight_version=weight_version)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        raise AssertionError("send_weights did not fail")

    def send_slowly(self, delay_s: float, weight_version: str | None = None) -> None:
        """A sync whose source waits ``delay_s`` before each tensor."""
        with self._sending_from(lambda source: SlowSource(source, delay_s)):
            self.engine.send_weights(weight_version=weight_version)

    def send_failing(self, after: int, delay_s: float = 0.0) -> str:
        """A sync whose source raises after ``after`` tensors (waiting
        ``delay_s`` before each); returns the error the engine raised."""

        def failing(source: WeightSource) -> WeightSource:
            slow = SlowSource(source, delay_s) if delay_s else source
            return FailingSource(slow, after)

        with self._sending_from(failing):
            return self.send_expecting_failure()

    def send_with_wrong_shape(self, name: str) -> str:
        """A sync whose metadata announces ``name`` with a wrong shape; returns
        the error the engine raised."""
        with self._sending_from(lambda source: WrongShapeSource(source, name)):
            return self.send_expecting_failure()

    @contextmanager
    def _sending_from(
        self, wrap: Callable[[WeightSource], WeightSource]
    ) -> Iterator[None]:
        """The engine sends from ``wrap(its source)`` inside the block."""
        source = self.engine.source
        self.engine.source = wrap(source)
        try:
            yield
        finally:
            self.engine.source = source

    def flip_byte_after_checksum(self, seq: int) -> None:
        """Flip one byte of the next chunk ``seq`` this rank's producer packs,
        after its checksum was taken (a fault in transit)."""
        producer = self.engine.producer
        pack = producer.pack

        def corrupting_pack(consumer_id: int, s: int, sync_id: Any = None) -> Any:
            packed = pack(consumer_id, s, sync_id)
            if s == seq:
                producer.pack = pack  # one fault only
                packed.view[packed.view.numel() // 2] ^= 0x01
            return packed

        producer.pack = corrupting_pack

    def reinit_workers(self) -> None:
        """Initialize the engine's weight transfer again with this trainer's
        payload, as a restarted worker would be: what it held is gone."""
        self.engine.client.init_weight_transfer_engine(
            self.engine.get_worker_init_payload()
        )

    def send_missed(self) -> None:
        """A sync no worker takes part in: the producers publish this rank's
        weights with no live consumer, and the engine is never told."""

        class _NoEngine:
            def update_weights(self, update_info: Any) -> None:
                return None

        client = self.engine.client
        self.engine.client = _NoEngine()
        try:
            self.engine._serve([], None)
        finally:
            self.engine.client = client

    def send_with_bad_delta(self, field: str) -> None:
        """A sync in which every delta this rank's producer offers has
        ``field`` spoiled (`BAD_DELTA_FIELDS`, or "reply_nbytes": the NIXL
        reply's delta byte count is one too many); the chunks themselves are
        served intact."""
        from vllm.distributed.weight_transfer.pull.delta_bases import (
            PublishedBases,
        )
        from vllm.distributed.weight_transfer.pull.nixl import NixlProducerServer

        offer = PublishedBases.offer
        handle = NixlProducerServer._handle

        def bad_offer(bases: Any, *args: Any, **kwargs: Any) -> Any:
            header = offer(bases, *args, **kwargs)
            if header is not None and field in BAD_DELTA_FIELDS:
                header[field] = BAD_DELTA_FIELDS[field](header)
            return header

        def bad_handle(server: Any, op: Any, message: dict[str, Any]) -> Any:
            reply = handle(server, op, message)
            if isinstance(reply, dict) and "delta" in reply:
                reply["delta"]["nbytes"] += 1
            return reply

        if field != "reply_nbytes" and field not in BAD_DELTA_FIELDS:
            raise ValueError(f"no way to spoil delta field {field!r}")
        with ExitStack() as patches:
            patches.enter_context(mock.patch.object(PublishedBases, "offer", bad_offer))
            if field == "reply_nbytes":
                patches.enter_context(
                    mock.patch.object(NixlProducerServer, "_handle", bad_handle)
                )
            self.engine.send_weights()

    def param_bytes(self, name: str) -> torch.Tensor:
        """The bytes of this rank's parameter ``name``."""
        param = dict(self.model.named_parameters())[name].data
        return param.contiguous().view(-1).view(torch.uint8).clone()

    def param_names(self) -> list[str]:
        return [n for n, _ in self.model.named_parameters()]

    def greedy(self) -> Any:
        from vllm.distributed.weight_transfer.testing import hf_greedy

        return hf_greedy(self.model)

    def save_checkpoint(self, directory: str) -> str:
        """Write this rank's model as a checkpoint (for the fresh-load oracle)."""
        from vllm.distributed.weight_transfer.testing import save_checkpoint

        return str(save_checkpoint(self.model, directory))

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


class ToyRdtConsumer:
    """A consumer of the toy plan (`sharded_rdt_procs.toy_pull_plan`) over Ray
    Direct Transport; create it with ``enable_tensor_transport=True``."""

    def pull_all(
        self,
        actor_name: str,
        namespace: str | None,
        chunks: list[dict[str, Any]],
        digest: str,
        checksums: bool = False,
        receipt: dict[str, Any] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Pull every chunk (with ``checksums``, check each producer checksum
        against the bytes that arrived), then deliver ``receipt`` if given."""
        from vllm.distributed.weight_transfer.pull.chunks import PullChunk
        from vllm.distributed.weight_transfer.pull.ray import (
            RdtConsumerTransport,
        )

        parsed = [PullChunk.from_json(c) for c in chunks]
        transport = RdtConsumerTransport(0, namespace=namespace, stall_timeout_s=60)
        link = transport.connect(0, actor_name)
        link.register(0, parsed, digest)
        link.checksums = checksums
        self._ready = True
        out = self._pull(link, parsed)
        if receipt is not None:
            link.deliver_receipt(receipt)
        return out

    def attach(
        self,
        actor_name: str,
        namespace: str | None,
        chunks: list[dict[str, Any]],
        digest: str,
        delta_bases_bytes: int,
    ) -> None:
        """Register with the producer actor for `pull_sync` calls, keeping up
        to ``delta_bases_bytes`` of landed chunks as delta bases."""
        from vllm.distributed.weight_transfer.pull.chunks import PullChunk
        from vllm.distributed.weight_transfer.pull.delta_bases import HeldBases
        from vllm.distributed.weight_transfer.pull.ray import (
            RdtConsumerTransport,
        )

        self._chunks = [PullChunk.from_json(c) for c in chunks]
        transport = RdtConsumerTransport(0, namespace=namespace, stall_timeout_s=60)
        self._link = transport.connect(0, actor_name)
        self._link.register(0, self._chunks, digest)
        self._link.checksums = True
        self._held = HeldBases(delta_bases_bytes)

    def pull_sync(self, sync_id: int) -> dict[str, Any]:
        """Pull sync ``sync_id`` against the bytes held from the syncs before:
        ``{"tensors", "deltas": each pull's delta fate, "read_bytes"}``."""
        self._link.sync_id = sync_id
        results: list[Any] = []
        out = self._pull(self._link, self._chunks, results)
        self._held.commit()
        return {
            "tensors": out,
            "deltas": [r.delta for r in results],
            "read_bytes": sum(r.read_bytes for r in results),
        }

    def _pull(
        self, link: Any, chunks: list[Any], results: list[Any] | None = None
    ) -> dict[str, torch.Tensor]:
        from vllm.distributed.weight_transfer.verification import payload_checksum

        held = getattr(self, "_held", None)
        out: dict[str, torch.Tensor] = {}
        for index, chunk in enumerate(chunks):
            buffer = torch.empty(chunk.nbytes, dtype=torch.uint8)
            base = held.base(index) if held is not None else None
            pulled = link.pull(chunk, buffer, None, base)
            if held is not None:
                held.record(index, buffer, link.sync_id)
            if results is not None:
                results.append(pulled)
            checksum = pulled.checksum
            if link.checksums and checksum != payload_checksum(buffer):
                raise AssertionError(
                    f"chunk {chunk.seq}: producer checksum {checksum} differs from "
                    f"that of the bytes received, {payload_checksum(buffer)}"
                )
            for packed in chunk.slices:
                raw = buffer[packed.offset : packed.offset + packed.spec.nbytes]
                out[packed.spec.source] = (
                    raw.view(torch.float32).view(packed.spec.shape).clone()
                )
        return out


def assert_serves_trainer(llm: Any, rank: Any) -> None:
    """The ``LLMHost`` actor ``llm`` serves bit for bit what a fresh vLLM load
    of the ``TrainerRank`` actor ``rank``'s weights serves, and the same
    greedy output as a Hugging Face forward of them."""
    import tempfile

    import ray

    from vllm.distributed.weight_transfer.testing import (
        assert_bit_identical,
        assert_same_greedy,
        logprob_atol,
    )

    served = ray.get(llm.greedy.remote())
    with tempfile.TemporaryDirectory(prefix="fresh-load-") as checkpoint:
        ray.get(rank.save_checkpoint.remote(checkpoint))
        expected = ray.get(llm.fresh_load_greedy.remote(checkpoint))
    assert_bit_identical(served, expected)
    assert_same_greedy(
        served, ray.get(rank.greedy.remote()), atol=logprob_atol("float32")
    )
