# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A response JSON cannot carry (NaN logprobs from weights that produce them)
is answered ``500`` naming the served weight version, not vLLM's ``400``
(``non_finite_outputs.NonFiniteOutputs``), and NaN left in the KV cache is
zeroed at a commit without touching a finite value (``kv_scrub``). The engine
test (``test_quantized_llm.py``) runs both behind ``vllm serve``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.distributed.weight_transfer.serving.non_finite_outputs import NonFiniteOutputs
from vllm.distributed.weight_transfer.worker.kv_scrub import (
    kv_caches,
    zero_non_finite,
    zero_non_finite_kv,
)


class _Engine:
    async def get_weight_version(self) -> str:
        return "step-7"


def _client():
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from fastapi.testclient import TestClient

    from vllm.entrypoints.serve.exception_handling.register import (
        init_exception_handler,
    )

    app = FastAPI()
    init_exception_handler(app)
    app.state.args = SimpleNamespace(log_error_stack=False)
    app.state.engine_client = _Engine()

    @app.post("/v1/completions")
    async def completions(nan: bool = False) -> JSONResponse:
        return JSONResponse({"logprob": float("nan") if nan else -1.5})

    @app.post("/v1/bad")
    async def bad() -> JSONResponse:
        raise ValueError("max_tokens must be positive")

    app.add_middleware(NonFiniteOutputs)
    return TestClient(app, raise_server_exceptions=False)


def test_a_nan_in_the_output_is_a_500_naming_the_weight_version():
    pytest.importorskip("fastapi")
    client = _client()
    answer = client.post("/v1/completions", params={"nan": "true"})
    assert answer.status_code == 500, answer.text
    error = answer.json()["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError"
    assert "weight_version 'step-7'" in error["message"]
    assert "not in the request" in error["message"]


def test_other_answers_pass_through_unchanged():
    pytest.importorskip("fastapi")
    client = _client()
    ok = client.post("/v1/completions")
    assert ok.status_code == 200 and ok.json() == {"logprob": -1.5}
    refused = client.post("/v1/bad")
    assert refused.status_code == 400
    assert "max_tokens must be positive" in refused.json()["error"]["message"]


def test_only_non_finite_kv_values_are_zeroed():
    kv = torch.randn(3, 2, 16, 8, dtype=torch.bfloat16)
    kept = kv.clone()
    kv[1, 0, 4, 2] = float("nan")
    kv[2, 1, 0, 0] = float("-inf")
    assert zero_non_finite(kv) == 1
    assert torch.isfinite(kv).all()
    assert kv[1, 0, 4, 2] == 0 and kv[2, 1, 0, 0] == 0
    changed = torch.zeros_like(kv, dtype=torch.bool)
    changed[1, 0, 4, 2] = changed[2, 1, 0, 0] = True
    assert torch.equal(kv[~changed], kept[~changed])
    assert zero_non_finite(kv) == 0


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64]
)
@pytest.mark.parametrize("bad", ["nan", "-nan", "inf", "-inf", None])
def test_the_bit_scan_finds_exactly_the_non_finite_values(monkeypatch, dtype, bad):
    """Chunks are flagged from the values' bits: a NaN of either sign or an
    infinity is found, the largest finite values and negative zero are not,
    and only the chunk that holds the bad value is rewritten."""
    from vllm.distributed.weight_transfer.worker import kv_scrub

    monkeypatch.setattr(kv_scrub, "_CHUNK", 64)
    info = torch.finfo(dtype)
    kv = torch.randn(4, 64, dtype=torch.float64).to(dtype)
    kv[0, :4] = torch.tensor([info.max, -info.max, info.tiny, -0.0], dtype=dtype)
    kept = kv.clone()
    if bad is not None:
        value = float(bad.lstrip("-"))
        kv[2, 7] = -value if bad.startswith("-") else value
    assert zero_non_finite(kv) == (0 if bad is None else 1)
    expected = kept.clone()
    if bad is not None:
        expected[2, 7] = 0
    assert torch.equal(
        kv.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8)
    )


def test_every_kv_cache_of_the_forward_context_is_scrubbed_once():
    shared = torch.full((4, 8), float("nan"))
    byte_cache = torch.full((4, 8), 255, dtype=torch.uint8)
    context = {
        "layers.0.attn": SimpleNamespace(kv_cache=shared),
        "layers.1.attn": SimpleNamespace(kv_cache=[shared]),
        "layers.2.attn": SimpleNamespace(kv_cache=byte_cache),
        "layers.3.mlp": SimpleNamespace(),
    }
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=context)
    )
    assert len(list(kv_caches(config))) == 2
    assert zero_non_finite_kv(config) == 1
    assert not shared.any()
    assert (byte_cache == 255).all()  # bytes: no value is non-finite
