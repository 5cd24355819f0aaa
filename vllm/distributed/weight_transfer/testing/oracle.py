# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The correctness oracle for weight transfer: after a sync, vLLM's greedy tokens
and their logprobs must equal a Hugging Face forward pass of the trainer's weights.

`hf_greedy` runs the reference (a plain full-sequence forward per step, no KV
cache, log-softmax in float32); `vllm_greedy` and `completions_greedy` collect the
same thing from an `LLM` or an OpenAI-compatible server; `assert_same_greedy`
compares them with a message that shows the first divergence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Prompts as token ids: the oracle does not depend on any tokenizer.
DEFAULT_PROMPTS: tuple[tuple[int, ...], ...] = (
    (1, 17, 93, 255, 41, 8),
    (1, 300, 12, 77, 640, 5, 19),
)
DEFAULT_MAX_TOKENS = 8


@dataclass(frozen=True)
class GreedyResult:
    """Per prompt: the generated token ids and the logprob of each."""

    tokens: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]


def hf_greedy(
    model: torch.nn.Module,
    prompts: tuple[tuple[int, ...], ...] | list[list[int]] = DEFAULT_PROMPTS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> GreedyResult:
    import torch

    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            out_t: list[int] = []
            out_l: list[float] = []
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                lp = torch.log_softmax(logits, dim=-1)
                nxt = int(torch.argmax(logits))
                out_t.append(nxt)
                out_l.append(float(lp[nxt]))
                ids.append(nxt)
            tokens.append(tuple(out_t))
            logprobs.append(tuple(out_l))
    return GreedyResult(tuple(tokens), tuple(logprobs))


def vllm_greedy(
    llm: Any,
    prompts: tuple[tuple[int, ...], ...] | list[list[int]] = DEFAULT_PROMPTS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    one_at_a_time: bool = False,
    lora_request: Any = None,
) -> GreedyResult:
    """Greedy generation through an offline `vllm.LLM`, after dropping the
    prefix cache: every call prefills its prompts in full, so its output does
    not depend on what ran before (a cache hit changes the shapes of the
    matrix products, which moves the last bit of results on kernels that are
    not batch-invariant), and a fresh model swapped in for the oracle never
    reads KV blocks another model computed.

    ``one_at_a_time`` generates each prompt in a call of its own. An engine
    in its own process may start stepping before the last prompt of a call
    has arrived, so which requests share a step depends on timing; alone, a
    request's steps have the same shapes every time. Engines whose kernels are
    not batch-invariant need this for a bit-exact comparison (MKL's float32
    GEMM under ``WeightTransferConfig.cpu_linear="plain"``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0
    )
    requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    # ``lora_request``: every prompt through that LoRA adapter.
    lora = {"lora_request": lora_request} if lora_request is not None else {}
    if one_at_a_time:
        outs = [llm.generate([r], params, use_tqdm=False, **lora)[0] for r in requests]
    else:
        outs = llm.generate(requests, params, use_tqdm=False, **lora)
    tokens, logprobs = [], []
    for out in outs:
        comp = out.outputs[0]
        ids = tuple(comp.token_ids)
        tokens.append(ids)
        logprobs.append(
            tuple(
                float(step[tok].logprob)
                for tok, step in zip(ids, comp.logprobs, strict=True)
            )
        )
    return GreedyResult(tuple(tokens), tuple(logprobs))


def completions_greedy(
    base_url: str,
    model: str,
    prompts: tuple[tuple[int, ...], ...] | list[list[int]] = DEFAULT_PROMPTS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    timeout: float = 60.0,
) -> GreedyResult:
    """Greedy generation through a server's ``/v1/completions`` route."""
    import requests

    tokens, logprobs = [], []
    for prompt in prompts:
        resp = requests.post(
            f"{base_url.rstrip('/')}/v1/completions",
            json={
                "model": model,
                "prompt": list(prompt),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "logprobs": 0,
                "return_token_ids": True,
            },
            timeout=timeout,
        )
        resp.raise_for_status()
        choice = resp.json()["choices"][0]
        tokens.append(tuple(choice["token_ids"]))
        logprobs.append(tuple(choice["logprobs"]["token_logprobs"]))
    return GreedyResult(tuple(tokens), tuple(logprobs))


@dataclass(frozen=True)
class GreedyWording:
    """How a failed comparison of greedy results reads (``str.format``
    templates): ``tokens`` gets ``what``, ``i`` (the prompt), ``got`` and
    ``want`` (token lists); ``logprob`` also ``j`` (the step), ``g`` and
    ``w`` (the logprobs), ``diff`` (``g - w``), ``absdiff`` and ``atol``."""

    tokens: str
    logprob: str


HF_ORACLE = GreedyWording(
    tokens="{what} greedy tokens differ from the HF oracle for prompt {i}: "
    "got {got}, expected {want}",
    logprob="{what} logprob of prompt {i} step {j} is {g:.6f}, the HF oracle "
    "says {w:.6f} (|diff| {absdiff:.2e} > atol {atol})",
)


def assert_same_greedy(
    actual: GreedyResult,
    expected: GreedyResult,
    *,
    atol: float = 1e-3,
    what: str = "vLLM",
) -> None:
    """Tokens must be identical; logprobs within ``atol`` of the reference."""
    check_greedy(actual, expected, HF_ORACLE, what=what, atol=atol)


def check_greedy(
    actual: GreedyResult,
    expected: GreedyResult,
    wording: GreedyWording,
    *,
    what: str,
    atol: float | None,
) -> None:
    """Raise an ``AssertionError`` worded by ``wording`` at the first prompt
    whose tokens differ, else at the first logprob further than ``atol``
    from the reference (None: any difference, bit for bit)."""
    for i, (got, want) in enumerate(zip(actual.tokens, expected.tokens, strict=True)):
        if got != want:
            raise AssertionError(
                wording.tokens.format(what=what, i=i, got=list(got), want=list(want))
            )
    for i, (got_lp, want_lp) in enumerate(
        zip(actual.logprobs, expected.logprobs, strict=True)
    ):
        for j, (g, w) in enumerate(zip(got_lp, want_lp, strict=True)):
            if g != w if atol is None else abs(g - w) > atol:
                raise AssertionError(
                    wording.logprob.format(
                        what=what,
                        i=i,
                        j=j,
                        g=g,
                        w=w,
                        diff=g - w,
                        absdiff=abs(g - w),
                        atol=atol,
                    )
                )


def logprob_atol(dtype: str) -> float:
    """Tolerance for logprobs of two different kernels on the same weights."""
    return 5e-3 if dtype == "float32" else 6e-2


def switch_point(
    base_url: str,
    model: str,
    prompt: Sequence[int],
    tokens: Sequence[int],
    old_tokens: Sequence[int],
) -> int:
    """Where ``tokens``, a greedy output of ``prompt`` from a server whose
    weights changed while it generated, switch from the old weights' greedy
    output ``old_tokens`` to the served (new) weights' greedy continuation of
    that prefix: ``len(tokens)`` when they never switch. Fails when the tokens
    after the switch are not that continuation (``completions_greedy`` of the
    prompt plus the old prefix)."""
    tokens = list(tokens)
    k = next(
        (i for i, (a, b) in enumerate(zip(tokens, old_tokens, strict=False)) if a != b),
        len(tokens),
    )
    if k == len(tokens):
        return k
    continuation = completions_greedy(
        base_url, model, prompts=[list(prompt) + tokens[:k]], max_tokens=len(tokens) - k
    )
    assert tokens[k:] == list(continuation.tokens[0]), (
        f"an output of prompt {list(prompt)} is neither version: {tokens}"
    )
    return k
