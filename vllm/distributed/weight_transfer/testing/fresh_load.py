# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The same-engine oracle: after a sync, the served model must produce exactly
what vLLM produces when it loads the trainer's weights fresh from a checkpoint.

Why: a Hugging Face forward pass and vLLM's CPU kernels round differently in
bfloat16 and route MoE near-ties differently, so an HF comparison needs a
tolerance, and that tolerance depends on the CPU's instruction set. Comparing
vLLM with vLLM removes both: same kernels, same dtype, same TP layout, so the
outputs of a correct sync are bit-identical and a single wrong byte shows.

How: the engine under test builds a second model on each worker with vLLM's
own start-up path (``get_model``: construct the model class, run its
``load_weights`` over the checkpoint's safetensors files, run
``process_weights_after_loading``), binds it to the engine's KV cache in place
of the served model, generates, and puts the served model back. Nothing of
the fork's weight-transfer code runs on that path, and no second engine is
started, so the check costs about a second instead of an engine start.
``tests/entrypoints/rl/weight_transfer/test_fresh_load_oracle.py`` shows that
this reference is bit-identical to a separately started engine.

The worker half is ``FreshLoadWorkerExtension``; start engines with
``worker_extension_cls=WORKER_EXTENSION`` (``--worker-extension-cls`` for
``vllm serve``). The driver half is ``FreshLoadOracle``, built from a way to
call a worker method on every worker and a way to run the greedy prompts.

Prompts are shorter than one KV block, so no prefix-cache hit can carry KV
computed by one model into the other's generation.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.weight_transfer.testing.oracle import (
    GreedyResult,
    GreedyWording,
    assert_same_greedy,
    check_greedy,
    hf_greedy,
    logprob_atol,
)

if TYPE_CHECKING:
    import torch

WORKER_EXTENSION = (
    "vllm.distributed.weight_transfer.testing.fresh_load.FreshLoadWorkerExtension"
)

# Calls one worker method on every worker: (method name, positional args).
WorkerCall = Callable[[str, Sequence[Any]], Any]


class FreshLoadWorkerExtension:
    """Worker methods that swap a freshly loaded model in and back out (and
    one that reports the planned landing, for tests over HTTP).

    Mixed into vLLM's worker class (``self`` is the worker). The served model
    and its registered layers are kept aside untouched while the fresh model
    serves, and restored exactly; the KV cache tensors are shared by both.
    """

    def fresh_load_swap_in(self, checkpoint_dir: str) -> str:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model

        worker: Any = self
        if getattr(worker, "_fresh_load_saved", None) is not None:
            raise RuntimeError("a fresh model is already swapped in")
        runner = worker.model_runner
        config = runner.vllm_config
        registry = config.compilation_config.static_forward_context
        served_layers = dict(registry)
        fresh_config = copy.copy(config.model_config)
        fresh_config.model = checkpoint_dir
        registry.clear()
        try:
            with set_current_vllm_config(config):
                fresh = get_model(vllm_config=config, model_config=fresh_config)
        except BaseException:
            registry.clear()
            registry.update(served_layers)
            raise
        # The runner attached state to the served layers after construction
        # (the KV cache views, backend settings such as the CPU attention
        # ISA); the fresh layers get the same, so they read and write the
        # same KV cache tensors.
        for name, layer in registry.items():
            served = served_layers.get(name)
            if served is None:
                continue
            for attr, value in vars(served).items():
                if attr == "kv_cache" or attr not in vars(layer):
                    setattr(layer, attr, value)
        worker._fresh_load_saved = (runner.model, served_layers)
        runner.model = fresh
        return checkpoint_dir

    def planned_landing_state(self) -> dict[str, Any]:
        """The worker's planned landing (``served_layers.planned_landing_state``),
        callable by name, e.g. through a dev-mode server's ``/collective_rpc``."""
        from vllm.distributed.weight_transfer.testing.served_layers import (
            planned_landing_state,
        )

        return planned_landing_state(self)

    def served_weight_dtypes(self) -> dict[str, str]:
        """Parameter name -> dtype of the served model (a quantized layer's
        weight shows its codes' dtype), callable by name."""
        worker: Any = self
        model = worker.model_runner.model
        return {name: str(p.dtype) for name, p in model.named_parameters()}

    def slow_down_forward(self, seconds: str | float) -> bool:
        """Sleep ``seconds`` before every forward pass of the served model (0
        removes the pause), callable by name over HTTP (arguments arrive as
        strings). Tests over HTTP on a small CPU use it to make a generation
        take long enough in wall time that a commit falls inside it: without
        it the tiny model's 480 tokens take under a second, and a starved
        API server can deliver them all at once, after the fact."""
        import time

        worker: Any = self
        pause = float(seconds)
        old = getattr(worker, "_slow_forward_hook", None)
        if old is not None:
            old.remove()
            worker._slow_forward_hook = None
        if pause > 0:
            model = worker.model_runner.model
            worker._slow_forward_hook = model.register_forward_pre_hook(
                lambda module, args: time.sleep(pause)
            )
        return True

    def fp8_codes_state(self) -> dict[str, Any]:
        """Where the worker's last trainer-side FP8 codes landed (the layers
        they wrote straight into) and, per layer, the SHA-256 of its served
        codes (checkpoint orientation) and scales, callable by name."""
        import hashlib

        import torch

        worker: Any = self
        engine = worker.weight_transfer_engine
        # ipc keeps the landing of the last layout; sharded_rdt the init's.
        kept = getattr(engine, "_codes_kept", None)
        landing = kept[1] if kept is not None else getattr(engine, "_codes", None)
        if landing is None:
            return {"layers": [], "digests": {}}
        model = worker.model_runner.model
        digests = {}
        for name in sorted(landing.writers):
            layer = model.get_submodule(name)
            codes = layer.weight.t().contiguous().view(torch.uint8)
            scales = layer.weight_scale.reshape(-1).contiguous().view(torch.uint8)
            digests[name] = hashlib.sha256(
                codes.numpy().tobytes() + scales.numpy().tobytes()
            ).hexdigest()
        return {"layers": sorted(landing.writers), "digests": digests}

    def fresh_load_restore(self) -> bool:
        worker: Any = self
        saved = getattr(worker, "_fresh_load_saved", None)
        if saved is None:
            return False
        served_model, served_layers = saved
        runner = worker.model_runner
        registry = runner.vllm_config.compilation_config.static_forward_context
        registry.clear()
        registry.update(served_layers)
        runner.model = served_model
        worker._fresh_load_saved = None
        return True


def save_checkpoint(model: torch.nn.Module, directory: str | Path) -> Path:
    """Write ``model`` (a Hugging Face model) as a safetensors checkpoint with
    Hugging Face's own serializer, in the dtype it holds."""
    path = Path(directory)
    model.save_pretrained(str(path), safe_serialization=True)  # type: ignore[operator]
    return path


FRESH_LOAD = GreedyWording(
    tokens="{what} greedy tokens for prompt {i} are {got}; a fresh load of the "
    "trainer's weights gives {want}",
    logprob="{what} logprob at prompt {i} step {j} is {g!r}; a fresh load of "
    "the trainer's weights gives {w!r} (bit-exact comparison, difference "
    "{diff:.3e})",
)


def assert_bit_identical(
    actual: GreedyResult, expected: GreedyResult, *, what: str = "vLLM"
) -> None:
    """Same tokens and the same logprobs to the last bit."""
    check_greedy(actual, expected, FRESH_LOAD, what=what, atol=None)


class FreshLoadOracle:
    """What a fresh load of given weights serves, measured in the engine under
    test.

    ``call_workers(method, args)`` runs a ``FreshLoadWorkerExtension`` method
    on every worker; ``greedy()`` runs the oracle prompts through the engine.
    """

    def __init__(
        self, call_workers: WorkerCall, greedy: Callable[[], GreedyResult]
    ) -> None:
        self._call_workers = call_workers
        self._greedy = greedy

    def from_checkpoint(self, checkpoint_dir: str | Path) -> GreedyResult:
        """Greedy output of a model loaded fresh from ``checkpoint_dir``."""
        self._call_workers("fresh_load_swap_in", (str(checkpoint_dir),))
        try:
            return self._greedy()
        finally:
            self._call_workers("fresh_load_restore", ())

    def expected(self, model: torch.nn.Module) -> GreedyResult:
        """Greedy output of a fresh load of ``model``'s current weights."""
        with tempfile.TemporaryDirectory(prefix="fresh-load-") as tmp:
            return self.from_checkpoint(save_checkpoint(model, tmp))

    def assert_serves(
        self, model: torch.nn.Module, *, what: str = "vLLM after the sync"
    ) -> GreedyResult:
        """The engine serves exactly what a fresh load of ``model`` serves;
        returns the served output."""
        served = self._greedy()
        assert_bit_identical(served, self.expected(model), what=what)
        return served


def assert_serves_weights(
    oracle: FreshLoadOracle,
    model: torch.nn.Module,
    *,
    dtype: str,
    what: str = "vLLM after the sync",
) -> GreedyResult:
    """The end-to-end check of a sync, in two parts.

    The gate, for every dtype and architecture: the engine serves bit for bit
    what a fresh vLLM load of ``model``'s weights serves. In float32 also: the
    served tokens equal a Hugging Face forward of ``model`` and the logprobs
    agree within ``logprob_atol("float32")``, which proves the engine serves
    the trainer's model and not only what vLLM would load. In bfloat16 the
    Hugging Face comparison is left out: its rounding and MoE routing differ
    from vLLM's kernels by amounts that depend on the CPU.
    """
    served = oracle.assert_serves(model, what=what)
    if dtype == "float32":
        assert_same_greedy(
            served, hf_greedy(model), atol=logprob_atol(dtype), what=what
        )
    return served


def offline_worker_call(llm: Any) -> WorkerCall:
    """``call_workers`` for an offline ``vllm.LLM``."""

    def call(method: str, args: Sequence[Any]) -> Any:
        return llm.collective_rpc(method, args=tuple(args))

    return call


def http_worker_call(base_url: str, timeout: float = 120.0) -> WorkerCall:
    """``call_workers`` for a ``vllm serve`` in dev mode (``/collective_rpc``;
    arguments travel as strings)."""
    import requests

    def call(method: str, args: Sequence[Any]) -> Any:
        resp = requests.post(
            f"{base_url.rstrip('/')}/collective_rpc",
            json={"method": method, "args": [str(a) for a in args]},
            timeout=timeout,
        )
        resp.raise_for_status()
        return resp.json() if resp.content else None

    return call
