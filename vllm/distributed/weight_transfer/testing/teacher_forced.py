# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A tie-tolerant form of the greedy oracle, for low-precision runs.

In bfloat16, vLLM's kernels and a Hugging Face forward pass can rank two nearly
equal logits differently, and free-running greedy decoding then diverges for
the rest of the sequence. ``assert_greedy_matches_model`` feeds vLLM's own
tokens through the HF model instead (teacher forcing) and checks at every step
that vLLM's token is one HF also ranks first, up to ``atol`` in logprob, and
that vLLM's logprob for it is within ``atol`` of HF's. Wrong weights fail both
checks by far more than a near-tie does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.weight_transfer.testing.oracle import (
    DEFAULT_PROMPTS,
    GreedyResult,
)

if TYPE_CHECKING:
    import torch


def assert_greedy_matches_model(
    actual: GreedyResult,
    model: torch.nn.Module,
    *,
    atol: float,
    prompts: tuple[tuple[int, ...], ...] | list[list[int]] = DEFAULT_PROMPTS,
    what: str = "vLLM",
) -> None:
    import torch

    with torch.no_grad():
        for i, (prompt, tokens, logprobs) in enumerate(
            zip(prompts, actual.tokens, actual.logprobs, strict=True)
        ):
            ids = list(prompt) + list(tokens)
            logits = model(torch.tensor([ids])).logits[0].float()
            lps = torch.log_softmax(logits, dim=-1)
            for j, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
                step = lps[len(prompt) - 1 + j]
                best = float(step.max())
                ref = float(step[tok])
                if best - ref > atol:
                    raise AssertionError(
                        f"{what} chose token {tok} at prompt {i} step {j}; the HF "
                        f"model ranks it {best - ref:.4f} below its top token "
                        f"{int(step.argmax())} (tolerance {atol})"
                    )
                if abs(lp - ref) > atol:
                    raise AssertionError(
                        f"{what} logprob of token {tok} at prompt {i} step {j} is "
                        f"{lp:.6f}, the HF model says {ref:.6f} (atol {atol})"
                    )
