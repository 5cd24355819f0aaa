# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A two-rank Ray trainer updates a vLLM engine with ``sharded_rdt`` on CPU.

* The inference engine is an offline ``vllm.LLM`` inside a Ray actor, with the
  default (mp) executor: no Ray executor is needed on the inference side.
* The trainer has two ranks (Ray actors joined by a gloo group). Each holds the
  whole model but declares, through ``WeightSource.held_names()``, that it
  serves only every other gather group, as pipeline stages would.
* ``trainer_init`` runs on both ranks: each starts a producer (a NIXL agent and
  a control socket); rank 0 sends the worker init info. Every vLLM worker bakes
  its plan and registers its chunks with both producers.
* Per step, ``send_weights()`` runs on both ranks; each worker pulls exactly
  the slices its weight loaders keep, over NIXL, from the rank that holds them.
  Rank 0 verifies every worker's receipt (and, with ``--checksums``, every
  pulled chunk was checksummed) before the server reports ``step-<n>`` as its
  weight version. vLLM's greedy output is then compared with a Hugging Face
  forward pass of the trainer's weights; the script exits with status 1 on a
  mismatch.
* With ``--quantization fp8_per_channel`` the engine serves a bfloat16 model
  quantized online, and the oracle is what the same engine serves when it
  loads the trainer's weights fresh from a checkpoint (bit for bit). Adding
  ``--trainer-codes`` makes the trainer ranks quantize the linear weights
  themselves (``Fp8ChannelCodes``): each worker pulls only its shard of the
  codes and scales, about half the bytes, straight into the served codes.
* With ``--deltas`` the trainer keeps up to 1 GiB of the bytes each producer
  last served (``delta_bases_gb``), and each training step moves 2% of the
  elements (the rest keep their bits): from the second step on, each chunk
  travels as a delta against what the worker landed, and the receipts' delta
  fields (bytes read, chunks as deltas, refusals, the worker's kept bytes)
  are printed (``docs/training/weight_transfer/deltas.md``).

Run: ``python examples/rl/rlhf_sharded_rdt_cpu.py [--arch qwen3_moe] [--tp 2]
[--steps 2] [--checksums] [--quantization fp8_per_channel [--trainer-codes]]
[--deltas]``.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import time
from typing import Any

import ray
import torch

from vllm.distributed.weight_transfer.testing import (
    TinyModelSpec,
    assert_bit_identical,
    assert_same_greedy,
    build_tiny_model,
    logprob_atol,
)
from vllm.distributed.weight_transfer.testing.sharded_rdt_actors import (
    HeldGroupsSource,
    LLMHost,
    stop_llm_host,
)


class TrainerRank:
    """One trainer rank: model, optimizer stand-in, sharded_rdt trainer engine."""

    def __init__(self, model_dir: str, rank: int, world: int, port: int) -> None:
        import torch.distributed as dist

        from vllm.distributed.weight_transfer.testing import load_hf_model

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        self.rank, self.world = rank, world
        self.model = load_hf_model(model_dir, "float32")
        self.engine: Any = None

    def init(
        self,
        llm: Any,
        num_consumers: int,
        checksums: bool,
        codes: bool = False,
        delta_bases_gb: float = 0.0,
    ) -> None:
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.api import (
            CheckpointNamesSource,
            ShardedRDTTrainerInitInfo,
        )
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

        # Checkpoint names (HF keeps MoE experts fused in memory), as FP8
        # codes and scales if asked; this rank holds every other gather group.
        names: Any = CheckpointNamesSource(self.model)
        if codes:
            from vllm.distributed.weight_transfer.api import Fp8ChannelCodes

            names = Fp8ChannelCodes(names)
        source = HeldGroupsSource(names, self.rank, self.world, hold="half")
        self.engine = WeightTransferTrainerFactory.trainer_init(
            ShardedRDTTrainerInitInfo(
                num_consumers=num_consumers,
                stall_timeout_s=60.0,
                verify_checksums=checksums,
                delta_bases_gb=delta_bases_gb,
                rank=self.rank,
            ),
            client=RayVLLMWeightSyncClient(llm),
            source=source,
        )

    def train_step(self, step: int, fraction: float = 1.0) -> None:
        """Stands in for an optimizer step: the same in-place change on every
        rank, so the ranks agree on the weights. ``fraction`` below 1: only
        that share of each weight's elements (a random subset) moves, the
        rest keep their exact bits, as a small RL learning rate leaves them."""
        gen = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for _, p in sorted(self.model.named_parameters()):
                step_ = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05
                if fraction < 1.0:
                    moved = torch.rand(p.shape, generator=gen) < fraction
                    step_ = torch.where(moved, step_, torch.zeros_like(step_))
                p.add_(step_)

    def send(self, step: int) -> float:
        t0 = time.perf_counter()
        # Served as the weight version once every worker's receipt verified.
        self.engine.send_weights(weight_version=f"step-{step}")
        return time.perf_counter() - t0

    def greedy(self) -> Any:
        from vllm.distributed.weight_transfer.testing import hf_greedy

        return hf_greedy(self.model)

    def save_checkpoint(self, directory: str) -> str:
        """This rank's full-precision weights as a checkpoint (the fresh-load
        oracle of a quantized engine)."""
        from vllm.distributed.weight_transfer.testing import save_checkpoint

        return str(save_checkpoint(self.model, directory))

    def shutdown(self) -> None:
        self.engine.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=["qwen3", "qwen3_moe"], default="qwen3")
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor parallel size")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument(
        "--checksums", action="store_true", help="checksum every pulled chunk"
    )
    p.add_argument(
        "--quantization",
        choices=["fp8_per_channel"],
        default=None,
        help="serve a bfloat16 model quantized online",
    )
    p.add_argument(
        "--trainer-codes",
        action="store_true",
        help="the trainer sends FP8 codes and scales (needs --quantization)",
    )
    p.add_argument(
        "--deltas",
        action="store_true",
        help="delta syncs (delta_bases_gb=1); each step moves 2%% of the elements",
    )
    args = p.parse_args()
    if args.trainer_codes and args.quantization is None:
        p.error("--trainer-codes needs --quantization fp8_per_channel")
    model_dir = str(build_tiny_model(TinyModelSpec(arch=args.arch)))

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    t0 = time.perf_counter()
    engine_args: dict[str, Any] = {}
    if args.quantization:
        engine_args = {"dtype": "bfloat16", "quantization": args.quantization}
    llm: Any = ray.remote(num_cpus=0)(LLMHost).remote(
        model_dir, tp=args.tp, **engine_args
    )
    ray.get(llm.pids.remote())
    print(f"LLM up in {time.perf_counter() - t0:.1f} s (sharded_rdt, TP={args.tp})")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank_actor: Any = ray.remote(num_cpus=0)(TrainerRank)
    ranks = [rank_actor.remote(model_dir, r, 2, port) for r in range(2)]
    ray.get(
        [
            t.init.remote(
                llm,
                num_consumers=args.tp,
                checksums=args.checksums,
                codes=args.trainer_codes,
                delta_bases_gb=1.0 if args.deltas else 0.0,
            )
            for t in ranks
        ]
    )

    failures = 0
    for step in range(1, args.steps + 1):
        fraction = 0.02 if args.deltas else 1.0
        ray.get([t.train_step.remote(step, fraction) for t in ranks])
        # send_weights also drops the KV blocks the previous weights computed.
        seconds = ray.get([t.send.remote(step) for t in ranks])
        version = ray.get(llm.weight_version.remote())
        got = ray.get(llm.greedy.remote())
        try:
            if args.quantization:
                # The same engine loading the trainer's weights fresh, with
                # its quantization: bit for bit.
                with tempfile.TemporaryDirectory(prefix="fresh-load-") as ckpt:
                    ray.get(ranks[0].save_checkpoint.remote(ckpt))
                    want = ray.get(llm.fresh_load_greedy.remote(ckpt))
                assert_bit_identical(got, want, what=f"vLLM at step {step}")
            else:
                want = ray.get(ranks[0].greedy.remote())
                assert_same_greedy(got, want, atol=logprob_atol("float32"))
            ok = True
        except AssertionError as e:
            ok, failures = False, failures + 1
            print(f"  {e}")
        receipts = ray.get(llm.receipts.remote())
        pulled = [
            f"worker {r['consumer_id']}: {r['bytes']} B from ranks "
            f"{r['bytes_by_producer']}, {r['checksums_verified']} checksums"
            + (
                f", read {r['read_bytes']} B, {r['delta_chunks']}/{r['chunks']} "
                f"chunks as deltas, {r['delta_refused']} refused"
                + (f" ({r['delta_first_refusal']})" if r["delta_refused"] else "")
                + f", {r['delta_bases_bytes']} B kept as bases"
                + f", {r['delta_served_bases']} read back from served tensors"
                if args.deltas
                else ""
            )
            for r in receipts
        ]
        if version != f"step-{step}":
            failures += 1
        print(
            f"step {step}: send_weights {max(seconds) * 1e3:.0f} ms; "
            f"{'; '.join(pulled)}; served version {version!r}; "
            f"vLLM == {'fresh-load' if args.quantization else 'HF'} oracle: {ok}"
        )
    ray.get([t.shutdown.remote() for t in ranks])
    stop_llm_host(llm)
    ray.shutdown()
    print(f"oracle match on every step: {failures == 0}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
