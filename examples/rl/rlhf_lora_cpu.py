# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A LoRA trainer pushes its adapter from memory into an offline ``vllm.LLM``
after every step, over ``ipc`` or pulled over NIXL
(docs/training/weight_transfer/lora.md).

The trainer holds a PEFT LoRA over a tiny generated Qwen3 (no download). At
each step it changes the adapter in place (standing in for an optimizer step),
pushes it with a ``LoRAPusher`` (no file is written; the base weights are
not touched) and generates through ``LoRARequest("policy", 1, ...)``. The
output is then compared, bit for bit, with the same engine serving the same
adapter loaded from a PEFT directory under another id, and with Hugging Face +
PEFT's forward (float32, within a small logprob tolerance); the script exits
with status 1 on a mismatch. The pusher labels outputs (``label_outputs=True``):
every generated token's weight version label names the adapter version that
sampled it, which the script reads back from an output.

``--transport nixl`` pushes the way a trainer on another machine does: the
workers pull the adapter from the trainer's producer over NIXL and send their
receipts back through it (``--producer-host`` is the address they reach it
at; here all runs on one machine).

Run: ``python examples/rl/rlhf_lora_cpu.py [--steps 3] [--rank 8]
[--transport ipc|nixl] [--producer-host 127.0.0.1]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import torch

from vllm.distributed.weight_transfer.api import (
    LoRAAdapter,
    LoRAPusher,
    memory_path,
    split_adapter_label,
)
from vllm.distributed.weight_transfer.clients import OfflineLLMWeightSyncClient
from vllm.distributed.weight_transfer.testing import (
    TinyModelSpec,
    assert_bit_identical,
    assert_same_greedy,
    build_tiny_model,
    hf_greedy,
    load_hf_model,
    logprob_atol,
    vllm_greedy,
)
from vllm.distributed.weight_transfer.testing.tiny_engine import tiny_llm


def adapter_version_on_outputs(llm: Any, lora_request: Any) -> str | None:
    """The version of ``lora_request``'s adapter that the weight version
    label on a generated output names."""
    from vllm import SamplingParams

    (out,) = llm.generate(
        ["Hello"],
        SamplingParams(max_tokens=2, temperature=0.0),
        lora_request=lora_request,
        use_tqdm=False,
    )
    spans = out.outputs[0].weight_versions or []
    _, adapters = split_adapter_label(spans[-1].version) if spans else ("", {})
    return adapters.get(lora_request.lora_name)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="train-and-push steps")
    p.add_argument("--rank", type=int, default=8, help="the adapter's LoRA rank")
    p.add_argument(
        "--transport",
        choices=["ipc", "nixl"],
        default="ipc",
        help="ipc: workers map the trainer's buffer; nixl: they pull it",
    )
    p.add_argument(
        "--producer-host",
        default="127.0.0.1",
        help="with --transport nixl: the address workers reach the trainer at",
    )
    return p.parse_args()


def fake_training_step(model: torch.nn.Module, step: int) -> None:
    """Stands in for an optimizer step: a seeded in-place change of every
    LoRA tensor (the base weights are frozen, as in LoRA training)."""
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def main() -> int:
    import peft

    from vllm.lora.request import LoRARequest

    args = parse_args()
    model_dir = build_tiny_model(TinyModelSpec(arch="qwen3"))
    policy = peft.get_peft_model(
        load_hf_model(model_dir, "float32"),
        peft.LoraConfig(
            r=args.rank,
            lora_alpha=2 * args.rank,
            target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
            lora_dropout=0.0,
        ),
    ).eval()

    llm = tiny_llm(model_dir, enable_lora=True, max_lora_rank=args.rank)
    # Kept across steps: it reuses the buffer the adapter travels in (and,
    # over NIXL, the producer the workers pull from).
    pusher = LoRAPusher(
        OfflineLLMWeightSyncClient(llm),
        transport=args.transport,
        producer_host=args.producer_host,
        verify_checksums=True,
        # Each commit also names the adapter's version in the engine's weight
        # version label, which vLLM puts on every output token.
        label_outputs=True,
    )
    pushed = LoRARequest("policy", 1, memory_path("policy"))
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for step in range(1, args.steps + 1):
            fake_training_step(policy, step)
            adapter = LoRAAdapter.from_peft_model(policy, name="policy", lora_id=1)
            t0 = time.perf_counter()
            pusher.push(adapter, version=f"step-{step}")
            push_s = time.perf_counter() - t0
            nbytes = sum(t.numel() * t.element_size() for t in adapter.tensors.values())
            served = vllm_greedy(llm, lora_request=pushed)
            labelled = adapter_version_on_outputs(llm, pushed)
            # The same adapter from a directory, under an id of its own.
            path = os.path.join(tmp, f"step-{step}")
            policy.save_pretrained(path)
            from_disk = vllm_greedy(
                llm, lora_request=LoRARequest(f"disk-{step}", 100 + step, path)
            )
            try:
                assert labelled == f"step-{step}", f"outputs name {labelled!r}"
                assert_bit_identical(served, from_disk, what="pushed adapter")
                assert_same_greedy(
                    served, hf_greedy(policy), atol=logprob_atol("float32")
                )
                verdict = "matches the adapter from disk and HF + PEFT"
            except AssertionError as e:
                ok, verdict = False, f"MISMATCH: {e}"
            receipts = pusher.last_publication
            attested = (
                len(receipts.verified.workers)
                if receipts is not None and receipts.verified is not None
                else 0
            )
            print(
                f"step {step}: pushed {len(adapter.tensors)} tensors "
                f"({nbytes / 1e6:.2f} MB) over {args.transport} in {push_s:.3f} s, "
                f"{attested} worker receipt(s) verified, outputs name policy "
                f"{labelled}; {verdict}"
            )
    pusher.close()
    llm.llm_engine.engine_core.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
