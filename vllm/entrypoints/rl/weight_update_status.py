# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``GET /weight_update_status``: the serving version and the update in flight.

Upstream's ``GET /weight_info`` answers ``{"weight_version": ...}``, the label
of the weights that serve, and the fork keeps that answer as it is. With
staging on, an engine also holds a second version while a sync runs: the one
being staged, verified, then committed. This route shows both, from what the
RL routes of this API-server process saw (``RouteSyncObserver``)::

    {
      "weight_version": "step-41",        # upstream's label, as /weight_info
      "staging": "device",                # the engine's staging setting
      "open": {                            # null when no update is open
        "publication_id": "...", "model_version": 1764770000000000,
        "payload_bytes": 1234567, "backend": "sharded_rdt",
        "seconds_open": 1.73,
        "prepared": true,                  # every worker attested (receipts out)
        "failed": false,
        "adapter": null                    # name, id, version of an adapter push
      },
      "committed": {"publication_id": "...", "model_version": ...,
                    "payload_bytes": ...}, # the last base update that finished
      "adapters": {"policy": {"name": "policy", "lora_id": 1000,
                              "version": "step-41"}}  # last push of each
    }

With ``staging`` other than ``"off"``, ``open`` is the staged version: the
engine serves ``weight_version`` until the commit. With ``"off"`` it is the
update landing in place (generation is held meanwhile). The label a trainer
passes to ``finish_weight_update`` is only known at the commit, so ``open``
names the publication; ``model_version`` is the number the trainer published
(its init info's ``model_version``, one more per sync; by default the wall
clock in microseconds). ``adapters`` names the version label of the last push of
each LoRA adapter (``lora_trainer.push_lora_adapter(..., version=...)``),
which serves under that name; adapter pushes never change ``committed``.
With several API-server processes each answers for the calls it served, as
for the sync metrics.
"""

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm.distributed.weight_transfer.serving.metrics import route_sync_observer

router = APIRouter()


@router.get("/weight_update_status")
async def weight_update_status(raw_request: Request) -> JSONResponse:
    engine = raw_request.app.state.engine_client
    status: dict[str, Any] = {
        "weight_version": await engine.get_weight_version(),
        "staging": _staging(engine),
    }
    status.update(route_sync_observer().update_status())
    return JSONResponse(content=status)


def _staging(engine: Any) -> str | None:
    config = getattr(engine.vllm_config, "weight_transfer_config", None)
    return getattr(config, "staging", None)
