# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark (CUDA): what an exact commit costs the requests it interrupts.

After a staged commit the fork drops the KV cache of the running requests
(``reset_prefix_cache(reset_running_requests=True)``), so that no token after
the commit reads KV computed by the old weights: each running request
recomputes its whole prefix with the new weights before its next token. That
recomputation, not the commit's copy, is what a running request waits for.

This script measures it on one GPU for a Qwen3-8B-shaped model (36 layers,
hidden 4096, 32 query and 8 key/value heads of 128, intermediate 12288,
bfloat16, TP=1, random weights): the prefill of a batch of prefixes, with
RMS norms, rotary embedding, causal attention through PyTorch's SDPA and the
SwiGLU MLP, chunked to ``--tokens-per-step`` tokens per forward as vLLM's
scheduler chunks a prefill. It is not vLLM: vLLM's KV-cache writes,
scheduling and sampling come on top, so the times are lower bounds.

It prints the prefill rate per prefix length, the recomputation a few
running loads would wait for (``recompute_s``: running requests x prefix
tokens at that rate), and that time over the commit's own device copy of the
same model's 16.4 GB, measured in the same run (``recompute_over_commit``).

Run (on the GPU machine): ``python3 benchmarks/weight_transfer/
bench_recompute_cuda.py --out benchmarks/results/recompute_cuda/h200.json``
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from _bench_common import device_times, emit_json, result_path, utc_now

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4096, 12288, 36, 32, 8, 128
EPS = 1e-6
# The shard the commit copies (bench_staged_commit_cuda.py: Qwen3-8B, TP=1).
SHARD_BYTES = 16_381_470_720
# Running loads: (requests, prefix tokens each).
LOADS = [(32, 1024), (256, 1024), (64, 4096), (256, 4096), (64, 16384)]


class Layer:
    """One decoder layer's weights, kernel format (fused qkv and gate_up)."""

    def __init__(self, gen: torch.Generator, dev: torch.device) -> None:
        def w(*shape: int) -> torch.Tensor:
            t = torch.empty(shape, dtype=torch.bfloat16, device=dev)
            return t.normal_(0.0, 0.02, generator=gen)

        q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        self.qkv = w(q + 2 * kv, HIDDEN)
        self.o = w(HIDDEN, q)
        self.gate_up = w(2 * INTER, HIDDEN)
        self.down = w(HIDDEN, INTER)
        ones = torch.ones(HIDDEN, dtype=torch.bfloat16, device=dev)
        self.norm1, self.norm2 = ones, ones.clone()
        self.q_norm = torch.ones(HEAD_DIM, dtype=torch.bfloat16, device=dev)
        self.k_norm = self.q_norm.clone()

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.qkv, self.o, self.gate_up, self.down)
        )


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves rotated (x: batch, tokens, heads, head_dim)."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


def prefill(
    h: torch.Tensor, layers: list[Layer], cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The decoder stack over ``h`` (batch, tokens, hidden), causal."""
    batch, tokens, _ = h.shape
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for layer in layers:
        x = F.rms_norm(h, (HIDDEN,), layer.norm1, EPS)
        q, k, v = (x @ layer.qkv.T).split([q_size, kv_size, kv_size], dim=-1)
        q = F.rms_norm(
            q.view(batch, tokens, HEADS, HEAD_DIM), (HEAD_DIM,), layer.q_norm, EPS
        )
        k = F.rms_norm(
            k.view(batch, tokens, KV_HEADS, HEAD_DIM), (HEAD_DIM,), layer.k_norm, EPS
        )
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        group = HEADS // KV_HEADS
        k = k.repeat_interleave(group, dim=2)
        v = v.view(batch, tokens, KV_HEADS, HEAD_DIM).repeat_interleave(group, dim=2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        h = h + attn.transpose(1, 2).reshape(batch, tokens, q_size) @ layer.o.T
        x = F.rms_norm(h, (HIDDEN,), layer.norm2, EPS)
        gate, up = (x @ layer.gate_up.T).chunk(2, dim=-1)
        h = h + (F.silu(gate) * up) @ layer.down.T
    return h


def rotary_tables(tokens: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device=dev) / HEAD_DIM))
    angles = torch.outer(torch.arange(tokens, device=dev).float(), inv)
    angles = torch.cat((angles, angles), dim=-1)[None, :, None, :]
    return angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)


def time_prefill(
    layers: list[Layer],
    batch: int,
    prefix: int,
    gen: torch.Generator,
    repeats: int,
) -> tuple[list[float], bool]:
    """Seconds of each of ``repeats`` prefills of ``batch`` prefixes of
    ``prefix`` tokens (after one warm-up), and whether the output is finite."""
    dev = layers[0].qkv.device
    cos, sin = rotary_tables(prefix, dev)
    h = torch.empty(batch, prefix, HIDDEN, dtype=torch.bfloat16, device=dev)
    h.normal_(0.0, 1.0, generator=gen)
    out: list[torch.Tensor] = []

    def step() -> None:
        out[:] = [prefill(h, layers, cos, sin)]

    times = device_times(step, repeats + 1)[1:]
    return times, bool(torch.isfinite(out[0]).all())


def time_copy(nbytes: int, repeats: int) -> float:
    """Median seconds of one device copy of ``nbytes`` (after a warm-up)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return statistics.median(device_times(lambda: dst.copy_(src), repeats + 1)[1:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens-per-step", type=int, default=16384)
    p.add_argument("--prefixes", default="1024,4096,16384")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(result_path(__file__)))
    args = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    layers = [Layer(gen, dev) for _ in range(LAYERS)]
    print(f"{LAYERS} layers, {sum(x.nbytes() for x in layers) / 1e9:.1f} GB")

    rates: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for prefix in (int(n) for n in args.prefixes.split(",")):
            batch = max(1, args.tokens_per_step // prefix)
            times, finite = time_prefill(layers, batch, prefix, gen, args.repeats)
            step = statistics.median(times)
            tokens = batch * prefix
            rates[prefix] = {
                "requests_per_step": batch,
                "step_s": round(step, 4),
                "tokens_per_s": round(tokens / step),
                "finite": finite,
            }
            print(
                f"prefix {prefix}: {batch} x {prefix} tokens in {step * 1e3:.1f} ms "
                f"({tokens / step:,.0f} tokens/s), finite {finite}"
            )

        commit_s = time_copy(SHARD_BYTES, args.repeats)
    print(
        f"commit floor: one device copy of {SHARD_BYTES / 1e9:.1f} GB in "
        f"{commit_s * 1e3:.2f} ms"
    )

    loads = []
    for requests, prefix in LOADS:
        if prefix not in rates:
            continue
        seconds = requests * prefix / rates[prefix]["tokens_per_s"]
        loads.append(
            {
                "running_requests": requests,
                "prefix_tokens": prefix,
                "recompute_s": round(seconds, 3),
                "recompute_over_commit": round(seconds / commit_s, 1),
            }
        )
        print(
            f"{requests} running x {prefix} tokens: recompute {seconds:.2f} s "
            f"= {seconds / commit_s:.0f}x the commit's copy"
        )
    doc = {
        "benchmark": "recompute_after_commit_cuda",
        "time_utc": utc_now(),
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "model": "Qwen3-8B shapes, 36 layers, bfloat16, TP=1, no vLLM",
        "tokens_per_step": args.tokens_per_step,
        "prefill": {str(k): v for k, v in rates.items()},
        "commit_copy_s": round(commit_s, 5),
        "loads": loads,
    }
    emit_json(doc, args.out)
    return 0 if all(r["finite"] for r in rates.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
