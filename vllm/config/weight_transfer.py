# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
from typing import Literal

from vllm.config.utils import config


@config
class WeightTransferConfig:
    """Selects how an RL trainer pushes fresh weights into this engine's workers."""

    backend: Literal["nccl", "ipc", "sparse_nccl", "sharded_rdt", "nccl_m2n"] | str = (
        "nccl"
    )
    """Name of the worker-side weight transfer engine. Any name registered with
    `WeightTransferEngineFactory` is accepted (plugins may register more). As in
    upstream, the name is checked only when the worker creates its engine; an
    unknown or empty name fails there, with the list of registered backends.
    """

    update_timeout_s: float = 600.0
    """How long an open weight update (``ipc``, ``sharded_rdt``) may go without
    a message from the trainer. The worker checks it at the update's next call:
    past it, the update is aborted (layers that did not complete go back to
    their previous weights; the engine is fenced if any weight had landed) and
    the call fails with the reason. A trainer that starts a new sync abandons
    such an update by itself. Under ``vllm serve``, an in-place update whose
    weights are landing is aborted by the server as soon as the time passes,
    and the served version names the cause (``update_guard``).
    """

    staging: Literal["off", "device", "host"] = "off"
    """Where an ``ipc`` or ``sharded_rdt`` worker keeps an update until it
    commits. ``"off"`` (the default) lands every tensor in the served weights
    as it arrives, so generation must be paused for the whole update.
    ``"device"`` (the model's device) or ``"host"`` (host memory, pinned on
    CUDA) stages the bytes instead: the engine keeps serving the old weights
    during the transfer, a failure before the commit leaves them serving
    unfenced, and ``finish_weight_update`` commits in one call. Staging holds
    every byte the worker receives once: the worker's pull plan for
    ``sharded_rdt``, every tensor sent for ``ipc``; an update that does not
    fit in free memory is refused before it is copied, and a worker whose
    staging cannot hold even one copy of its own weights next to the KV
    cache vLLM will allocate refuses to start. The staging is kept from one
    committed update to the next (freed after a failure).
    """

    cpu_linear: Literal["packed", "plain"] = "packed"
    """How vLLM CPU runs unquantized linear layers. ``"packed"`` (vLLM's
    default) repacks each weight into a oneDNN (or sgl-kernel, zentorch)
    handle at load and drops the plain tensor, so every weight update rebuilds
    the handles. ``"plain"`` keeps each weight tensor and runs torch's linear
    on it: the layers' post-load processing leaves the loaded bytes as they
    are, a sync rebuilds nothing, and new weights can be written into the
    served tensors in place, at a cost in generation speed
    (``benchmarks/weight_transfer/bench_cpu_linear.py``). Other platforms
    ignore it.
    """

    landing: Literal["reload", "planned"] = "reload"
    """How an ``ipc`` or ``sharded_rdt`` update reaches the served tensors.
    ``"reload"`` (the default) lands every tensor through vLLM's layerwise
    reload: each layer it touches is rebuilt, loaded, processed and copied
    back. ``"planned"`` plans once (the sharded_rdt planner records where the
    model's own loaders put each byte, and each layer is proven to keep its
    bytes through vLLM's post-load processing) and then copies the bytes of
    such layers straight into the served tensors, once per byte: from the
    trainer's tensors for ``ipc``, from the receive buffer for
    ``sharded_rdt``. The other layers (MoE experts on vLLM CPU, packed or
    quantized layers) take the layerwise reload within the same update. On
    vLLM CPU, linear layers qualify only with ``cpu_linear="plain"``. Staged
    updates (``staging`` other than ``"off"``) stage the same bytes and land
    them the same way at the commit.
    """

    def __post_init__(self) -> None:
        if self.landing not in ("reload", "planned"):
            raise ValueError(
                "weight_transfer_config.landing must be 'reload' or 'planned', "
                f"got {self.landing!r}"
            )
        if self.cpu_linear not in ("packed", "plain"):
            raise ValueError(
                "weight_transfer_config.cpu_linear must be 'packed' or 'plain', "
                f"got {self.cpu_linear!r}"
            )
        if self.staging not in ("off", "device", "host"):
            raise ValueError(
                "weight_transfer_config.staging must be 'off', 'device' or "
                f"'host', got {self.staging!r}"
            )
        if not self.update_timeout_s > 0:
            raise ValueError(
                "weight_transfer_config.update_timeout_s must be a positive number "
                f"of seconds, got {self.update_timeout_s!r}"
            )
