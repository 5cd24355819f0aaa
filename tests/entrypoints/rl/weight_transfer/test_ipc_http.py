# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End to end over HTTP: a trainer in this process updates a real ``vllm serve``
through the ``ipc`` backend, and after every update the server serves bit for
bit what a fresh vLLM load of the trainer's weights serves, and the same greedy
output as a Hugging Face forward pass of them (fp32).

One server per module (start-up costs ~30 s on CPU). It runs plain CPU linear
layers with the planned landing (``cpu_linear="plain"``, ``landing="planned"``),
so every layer's bytes land straight in the served tensors. The tests run in file
order and each one first puts the trainer model into the state it checks, so
the server's weights always follow the trainer's.

While an in-place update lands, the server holds generation itself
(``update_guard``): a completion sent mid-sync waits and is answered by the new
weights, ``/resume`` is refused, and a trainer that dies mid-sync is aborted at
the deadline with a ``fenced:`` version naming it.

Careless requests (issue #12: an open update with no weights, malformed
``update_weights`` bodies) are sent as raw HTTP, through the route handlers and
the sync-metrics middleware: the server keeps answering completions with
exactly the old weights, counts the failure on ``/metrics``, and the trainer's
next ``send_weights()`` recovers without a manual step.

Bodies that would land weights past the guard (a list whose worker element
carries weights next to a decoy of another kind, ``/collective_rpc
update_weights``) are refused before the workers while the old weights serve
under the old label; an in-place sync abandoned by another client ends with a
``fenced:`` label naming who abandoned it, and a takeover from a dead trainer
is one log line, never a 500.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests
import torch

from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    ParamMeta,
    WeightSource,
)
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerInitInfo,
    IPCTrainerWeightTransferEngine,
)
from vllm.distributed.weight_transfer.testing import (
    DEFAULT_PROMPTS,
    GreedyResult,
    assert_bit_identical,
    hf_greedy,
    load_hf_model,
    randomize_weights_,
)
from vllm.distributed.weight_transfer.testing.fresh_load import http_worker_call
from vllm.distributed.weight_transfer.testing.guard_decoys import (
    SendsDecoysFirst,
    assert_decoys_refused,
)
from vllm.distributed.weight_transfer.testing.mid_sync import (
    AbandonedMidSync,
    Careless,
    CompletesMidSync,
    Completions,
    update_with_manifest_dtype,
)
from vllm.distributed.weight_transfer.testing.serve_state import (
    FAILURE_PHASES,
    assert_serves,
    committed_syncs,
    failures,
    post,
    weight_info,
)
from vllm.distributed.weight_transfer.testing.server import (
    ServerProcess,
    metric_value,
    serve,
)
from vllm.distributed.weight_transfer.testing.shm_census import own_fork_entries
from vllm.distributed.weight_transfer.verification import (
    Manifest,
    PublicationHeader,
    attach_publication,
)
from vllm.distributed.weight_transfer.verification.receipts import RECEIPT_DIR_PREFIX

pytestmark = pytest.mark.slow


def served_greedy(server: ServerProcess) -> GreedyResult:
    return server.greedy()


# Short enough for the deadline test to wait it out, far above any gap
# between two calls of one sync.
UPDATE_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    with serve(
        tiny_model_dir,
        weight_transfer_backend="ipc",
        weight_transfer_options={
            "update_timeout_s": UPDATE_TIMEOUT_S,
            # Plain linear layers whose bytes land straight in the served
            # tensors (the fresh-load oracle loads through the same setting).
            "cpu_linear": "plain",
            "landing": "planned",
        },
    ) as s:
        yield s


@pytest.fixture(scope="module")
def trainer_model(tiny_model_dir: Path):
    return load_hf_model(tiny_model_dir, "float32")


@pytest.fixture(scope="module")
def trainer(server: ServerProcess, trainer_model):
    client = HTTPVLLMWeightSyncClient(server.base_url, timeout=120)
    return WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=True),
        client=client,
        source=ModuleSource(trainer_model),
    )


def test_server_serves_the_checkpoint_before_any_update(server, tiny_model_dir):
    assert_serves(server, load_hf_model(tiny_model_dir, "float32"))


def test_send_weights_serves_the_trainers_new_weights(server, trainer, trainer_model):
    before = served_greedy(server)
    randomize_weights_(trainer_model, seed=1)
    expected = hf_greedy(trainer_model)
    assert expected.tokens != before.tokens, "seed 1 should change the greedy output"

    trainer.send_weights()

    assert_serves(server, trainer_model)
    # Every layer of the dense model took its bytes straight from the
    # trainer's chunks; none went through the layerwise reload.
    reply = http_worker_call(server.base_url)("planned_landing_state", [])
    (state,) = reply["results"]
    assert state["still_bound"] and not state["reloaded"], state
    names = {name for name, _ in trainer_model.named_parameters()}
    assert set(state["direct_names"]) <= names
    assert any(n.endswith("mlp.down_proj.weight") for n in state["direct_names"])


def test_second_update_after_in_place_optimizer_like_step(
    server, trainer, trainer_model
):
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, p in sorted(trainer_model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)

    trainer.send_weights()

    assert_serves(server, trainer_model)


def test_finish_stamps_the_weight_version(server, trainer):
    trainer.send_weights(weight_version="step-3")
    assert requests.get(f"{server.base_url}/weight_info").json() == {
        "weight_version": "step-3"
    }

    assert post(server, "update_weight_version", {"new_version": "step-3b"}).ok
    assert requests.get(f"{server.base_url}/weight_info").json() == {
        "weight_version": "step-3b"
    }


def test_sync_metrics_appear_on_metrics_without_flags(server, trainer, trainer_model):
    """A plain ``vllm serve`` (dev mode on for the RL routes) counts a real
    ``ipc`` sync as committed with the bytes its publication announced, and an
    update whose header the worker rejects as a failure of the update phase;
    upstream's weight-operation metrics stay, and the server keeps serving."""

    def scrape() -> str:
        return requests.get(f"{server.base_url}/metrics", timeout=30).text

    counters = (
        "vllm:weight_transfer_syncs_total",
        "vllm:weight_transfer_bytes_total",
        "vllm:weight_transfer_sync_seconds_count",
    )
    text = scrape()
    before = {name: metric_value(text, name, backend="ipc") for name in counters}
    failed_before = failures(server)["update"]

    trainer.send_weights()
    header = PublicationHeader.create(
        backend="ipc",
        model_version=1,
        manifest=Manifest.from_params([ParamMeta("w", torch.float32, (4,))]),
        trainer_devices=["cpu:test:0"],
    )
    assert post(server, "start_weight_update").ok
    rejected = post(
        server,
        "update_weights",
        {"update_info": attach_publication({"names": []}, header)},
    )
    assert not rejected.ok  # the worker closes the update on any failure

    text = scrape()
    grew = {
        name: metric_value(text, name, backend="ipc") - before[name]
        for name in counters
    }
    nbytes = sum(p.numel() * p.element_size() for p in trainer_model.parameters())
    assert grew == {
        "vllm:weight_transfer_syncs_total": 1,
        "vllm:weight_transfer_bytes_total": nbytes,
        "vllm:weight_transfer_sync_seconds_count": 1,
    }
    assert failures(server)["update"] == failed_before + 1
    for operation in ("start", "update", "finish"):
        count = metric_value(
            text,
            "vllm:rl_weight_update_operation_duration_seconds_count",
            operation=operation,
        )
        assert count >= 1
    assert "vllm:rl_weight_update_operations_in_flight" in text
    assert served_greedy(server).tokens


def test_a_verified_sync_commits_then_a_mismatched_one_leaves_the_version(
    server, trainer_model
):
    """Checksummed small chunks commit and stamp the version; a manifest that
    disagrees with the served model (one tensor a column wider) is refused
    before loading: the version stays, the failure is counted, and the
    committed weights keep serving."""
    from test_ipc_verified_llm import ResizedSource

    client = HTTPVLLMWeightSyncClient(server.base_url, timeout=120)

    def trainer(source: WeightSource) -> IPCTrainerWeightTransferEngine:
        return WeightTransferTrainerFactory.trainer_init(  # type: ignore[return-value]
            IPCTrainerInitInfo(
                rank=0, packed_buffer_size_bytes=256 * 1024, verify_checksums=True
            ),
            client=client,
            source=source,
        )

    randomize_weights_(trainer_model, seed=9)
    failed_before = failures(server)["update"]
    trainer(ModuleSource(trainer_model)).send_weights(weight_version="11")
    assert weight_info(server) == {"weight_version": "11"}
    assert_serves(server, trainer_model)

    bad = ResizedSource(ModuleSource(trainer_model), "model.norm.weight")
    with pytest.raises(requests.HTTPError, match="disagrees with the served model"):
        trainer(bad).send_weights(weight_version="12")
    assert weight_info(server) == {"weight_version": "11"}  # refused before loading
    assert failures(server)["update"] == failed_before + 1
    assert_serves(server, trainer_model)


def test_server_runs_without_insecure_serialization(server):
    pids = server.group_pids()
    assert server.pid in pids
    for pid in pids:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        names = {entry.split(b"=", 1)[0] for entry in environ}
        assert b"VLLM_ALLOW_INSECURE_SERIALIZATION" not in names, pid
        assert b"VLLM_SERVER_DEV_MODE" in names, pid


BAD_UPDATES = {
    # What upstream's HTTP client sends: refused, this backend never unpickles.
    "pickled_handles": {
        "names": ["model.norm.weight"],
        "dtype_names": ["float32"],
        "shapes": [[128]],
        "ipc_handles_pickled": "gASVAAAAAAAAAAB9lC4=",
        "tensor_sizes": [512],
    },
    # Fields disagree: three shapes for one name.
    "inconsistent_lengths": {
        "names": ["model.norm.weight"],
        "dtype_names": ["float32"],
        "shapes": [[128], [128], [128]],
        "ipc_handles": {"cpu:x:0": {"kind": "shm", "name": "vllm-wt-x", "nbytes": 8}},
        "tensor_sizes": [512],
    },
    # Well-formed, but the shared-memory segment does not exist.
    "missing_segment": {
        "names": ["model.norm.weight"],
        "dtype_names": ["float32"],
        "shapes": [[128]],
        "ipc_handles": {
            "cpu:{host}:0": {
                "kind": "shm",
                "name": "vllm-wt-does-not-exist",
                "nbytes": 512,
            }
        },
        "tensor_sizes": [512],
        "offsets": [0],
    },
}


@pytest.mark.parametrize("case", sorted(BAD_UPDATES))
def test_bad_update_is_refused_and_the_server_keeps_serving(
    server, trainer, trainer_model, case
):
    import socket

    update_info = BAD_UPDATES[case]
    handles = update_info.get("ipc_handles")
    if isinstance(handles, dict):
        host = socket.gethostname()
        update_info = {
            **update_info,
            "ipc_handles": {k.format(host=host): v for k, v in handles.items()},
        }

    assert post(server, "start_weight_update").ok
    response = post(server, "update_weights", {"update_info": update_info})
    assert not response.ok, response.text
    if case == "pickled_handles":
        assert "ipc_handles_pickled" in response.text
    # The failed update closed the session; finishing is allowed to fail.
    post(server, "finish_weight_update")

    assert server.is_alive()
    assert_serves(server, trainer_model)  # what the server held before


CARELESS = {
    # A trainer that dies right after start while rollouts continue.
    "start-then-generate": Careless(None, seed=11),
    # Upstream's per-rank list form, with no entry for this worker: the
    # guard refuses it before the workers (common.messages).
    "empty-list": Careless(
        [], "list of 0 messages", failure_phases=("update",), seed=12
    ),
    # Counted under "abort" today: the observer sees the message's abort field.
    "abort-with-names": Careless(
        {"abort": "x", "names": []},
        "abort must be the only field",
        failure_phases=("update", "abort"),
        seed=13,
    ),
    "manifest-dtype-5": Careless(
        update_with_manifest_dtype(5),
        "dtype is 5",
        failure_phases=("update",),
        seed=14,
    ),
}


@pytest.mark.parametrize("case", CARELESS, ids=CARELESS)
def test_careless_requests_after_start_leave_the_old_weights_serving(
    server, trainer, trainer_model, case
):
    """Issue #12's killers, over HTTP: after ``start`` (and a malformed
    update, if any) a completion is answered by exactly the old weights, the
    failure is counted, and the trainer's next sync closes what was left open
    and serves its weights."""
    careless = CARELESS[case]
    before = served_greedy(server)
    version = weight_info(server)
    failed_before = failures(server)

    assert post(server, "start_weight_update").status_code == 200
    if careless.update_info is not None:
        response = post(server, "update_weights", {"update_info": careless.update_info})
        assert 400 <= response.status_code < 600, response.text
        message = response.json()["error"]["message"]
        assert careless.refusal is not None and careless.refusal in message, message

    completion = requests.post(
        f"{server.base_url}/v1/completions",
        json={
            "model": server.model,
            "prompt": list(DEFAULT_PROMPTS[0]),
            "max_tokens": 3,
            "temperature": 0.0,
        },
        timeout=120,
    )
    assert completion.status_code == 200, completion.text
    assert server.is_alive()
    # Nothing landed: the old weights, bit for bit, and no fence.
    assert_bit_identical(served_greedy(server), before, what=f"vLLM after {case}")
    assert weight_info(server) == version

    failed = failures(server)
    counted = {p: failed[p] - failed_before[p] for p in FAILURE_PHASES}
    assert sum(counted.values()) == (1 if careless.failure_phases else 0), counted
    assert all(
        counted[p] == 0 for p in FAILURE_PHASES if p not in careless.failure_phases
    ), counted

    # The trainer's next sync closes whatever is still open on its own.
    syncs = committed_syncs(server)
    randomize_weights_(trainer_model, seed=careless.seed)
    trainer.send_weights(weight_version=f"after-{case}")
    assert weight_info(server) == {"weight_version": f"after-{case}"}
    assert committed_syncs(server) == syncs + 1
    assert_serves(server, trainer_model)


def test_update_after_failures_succeeds(server, trainer, trainer_model):
    randomize_weights_(trainer_model, seed=4)

    trainer.send_weights()

    assert_serves(server, trainer_model)


def sync_from_a_fresh_trainer(
    server: ServerProcess, model: torch.nn.Module, version: str
) -> None:
    """A new trainer process's first sync: a trainer engine of its own."""
    fresh = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=True),
        client=HTTPVLLMWeightSyncClient(server.base_url, timeout=120),
        source=ModuleSource(model),
    )
    assert isinstance(fresh, IPCTrainerWeightTransferEngine)
    fresh.send_weights(weight_version=version)


def test_a_trainer_killed_between_chunks_does_not_block_the_next_sync(
    server, trainer_model, tiny_model_dir
):
    """No manual step: the next trainer abandons the update the dead one left
    open, its segments and its receipt directory are removed (issue 44.1),
    and the sync serves the new weights."""
    import multiprocessing
    import os
    import signal

    from vllm.distributed.weight_transfer.testing.ipc_faults import push_then_die

    def receipt_dirs() -> set[str]:
        # Not those the parallel run's other worker holds.
        return own_fork_entries(prefix=RECEIPT_DIR_PREFIX)

    receipts_before = receipt_dirs()
    process = multiprocessing.get_context("spawn").Process(
        target=push_then_die,
        args=(server.base_url, str(tiny_model_dir), 41, 256 * 1024),
    )
    process.start()
    process.join(180)
    assert process.exitcode == -signal.SIGKILL
    left = [
        n for n in os.listdir("/dev/shm") if n.startswith(f"vllm-wt-{process.pid}-")
    ]
    assert left, "the dead trainer's segment should still exist"
    # Its verified sync's receipt directory, which nobody holds any more.
    dead_receipts = receipt_dirs() - receipts_before
    assert dead_receipts, "the dead trainer's receipt directory should exist"
    assert server.is_alive()

    randomize_weights_(trainer_model, seed=42)
    log_start = server.log_path.stat().st_size
    sync_from_a_fresh_trainer(server, trainer_model, "after-the-dead-trainer")
    # Issue 44.2: the takeover is a clean event: the start is answered 409
    # with one log line naming the open publication, and no 500 or traceback.
    with server.log_path.open(errors="replace") as log:
        log.seek(log_start)
        takeover_log = log.read()
    assert "Traceback" not in takeover_log, takeover_log[-4000:]
    assert '" 500' not in takeover_log, takeover_log[-4000:]
    refusals = [
        line
        for line in takeover_log.splitlines()
        if "Refused /start_weight_update" in line
    ]
    assert len(refusals) <= 1, refusals  # none if the deadline came first
    assert all("already active" in r and "publication" in r for r in refusals)
    assert requests.get(f"{server.base_url}/weight_info").json() == {
        "weight_version": "after-the-dead-trainer"
    }
    assert_serves(server, trainer_model)
    assert not [
        n for n in os.listdir("/dev/shm") if n.startswith(f"vllm-wt-{process.pid}-")
    ]
    assert not dead_receipts & receipt_dirs(), "a dead trainer's receipts remain"


def test_generation_mid_sync_waits_for_the_new_weights(server, trainer_model):
    """Nobody paused: the server holds generation from the first weights to
    the finish, so a completion sent mid-sync is answered by the new weights
    and the engine is not fenced."""
    randomize_weights_(trainer_model, seed=43)
    client = CompletesMidSync(
        HTTPVLLMWeightSyncClient(server.base_url, timeout=120), server
    )
    trainer = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=True),
        client=client,
        source=ModuleSource(trainer_model),
    )
    assert isinstance(trainer, IPCTrainerWeightTransferEngine)
    trainer.send_weights(weight_version="held-43")

    assert client.completions is not None
    assert client.waited and client.paused
    assert client.resume is not None and client.resume.status_code == 409
    assert "weight update is landing" in client.resume.text
    mid_sync = client.completions.outcome()
    assert weight_info(server) == {"weight_version": "held-43"}
    assert not client.inner.is_paused()
    assert_bit_identical(mid_sync, served_greedy(server), what="completion mid-sync")
    assert_serves(server, trainer_model)


def test_a_trainer_dying_mid_sync_is_fenced_at_the_deadline(
    server, trainer_model, tiny_model_dir
):
    """The dead trainer's update holds generation until the deadline; then the
    server aborts it, names the cause in the served version, answers the
    waiting completions, and the next sync needs no manual step."""
    import multiprocessing

    from vllm.distributed.weight_transfer.testing.ipc_faults import push_then_die

    before = weight_info(server)
    process = multiprocessing.get_context("spawn").Process(
        target=push_then_die,
        args=(server.base_url, str(tiny_model_dir), 44, 256 * 1024),
    )
    process.start()
    process.join(180)
    completions = Completions(server)
    completions.start()
    time.sleep(2)
    assert completions.is_alive(), "generation must wait while weights land"
    assert weight_info(server) == before

    completions.outcome(timeout_s=UPDATE_TIMEOUT_S + 120)
    version = weight_info(server)["weight_version"]
    assert version.startswith("fenced:"), version
    assert "update_timeout_s" in version, version
    assert server.is_alive()

    randomize_weights_(trainer_model, seed=45)
    sync_from_a_fresh_trainer(server, trainer_model, "after-the-deadline")
    assert weight_info(server) == {"weight_version": "after-the-deadline"}
    assert_serves(server, trainer_model)


def test_hostile_version_and_stray_prepare_leave_old_or_new_weights(
    server, trainer_model
):
    """A publication a day ahead of the clock (the default trainers' versions)
    is refused at its first message naming ``publication.model_version``: the
    old weights serve. A prepare naming another publication mid-sync is
    answered 409 naming both ids before it reaches the workers, and the open
    sync goes on to serve the trainer's new weights exactly."""
    from test_ipc_verified_llm import StrayPrepare

    randomize_weights_(trainer_model, seed=47)
    sync_from_a_fresh_trainer(server, trainer_model, "before-the-hostile")
    before = served_greedy(server)
    randomize_weights_(trainer_model, seed=48)
    day_ahead = time.time_ns() // 1000 + 23 * 3600 * 1_000_000
    hostile = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=True, model_version=day_ahead),
        client=HTTPVLLMWeightSyncClient(server.base_url, timeout=120),
        source=ModuleSource(trainer_model),
    )
    assert isinstance(hostile, IPCTrainerWeightTransferEngine)
    with pytest.raises(requests.HTTPError, match=r"publication\.model_version"):
        hostile.send_weights(weight_version="a-day-ahead")
    assert_bit_identical(served_greedy(server), before, what="after the refusal")

    stray = StrayPrepare(
        HTTPVLLMWeightSyncClient(server.base_url, timeout=120), after=1
    )
    honest = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=256 * 1024),
        client=stray,
        source=ModuleSource(trainer_model),
    )
    assert isinstance(honest, IPCTrainerWeightTransferEngine)
    honest.send_weights(weight_version="despite-the-stray-prepare")
    assert stray.refusal is not None and "HTTP 409" in stray.refusal
    assert f"names publication '{StrayPrepare.STRAY_ID}'" in stray.refusal
    assert f"open update is publication {stray.publication_id}" in stray.refusal
    assert weight_info(server) == {"weight_version": "despite-the-stray-prepare"}
    assert_serves(server, trainer_model)


def test_a_decoy_list_or_collective_rpc_is_refused_and_the_old_weights_serve(
    server, trainer_model
):
    """Issue finding 3: a list whose worker element carries weights next to a
    decoy of another kind, or ``/collective_rpc update_weights``, is refused
    before the workers, naming why; completions right after are the old
    weights under the old label, and the real sync then serves the new."""
    before = served_greedy(server)
    version = weight_info(server)
    randomize_weights_(trainer_model, seed=46)
    client = SendsDecoysFirst(
        HTTPVLLMWeightSyncClient(server.base_url, timeout=120), server
    )
    trainer = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=True),
        client=client,
        source=ModuleSource(trainer_model),
    )
    assert isinstance(trainer, IPCTrainerWeightTransferEngine)
    trainer.send_weights(weight_version="after-the-decoys")

    assert_decoys_refused(client, before, version)
    assert weight_info(server) == {"weight_version": "after-the-decoys"}
    assert_serves(server, trainer_model)


def test_an_abandoned_in_place_sync_fences_the_label_and_names_the_cause(
    server, trainer_model
):
    """Issue finding 4: a pusher that will not take over waits and gives up
    naming the open update; an abort of the half-landed update (anyone's)
    fences the served label with its reason before generation resumes; the
    base trainer's next chunk is refused naming that reason; the next sync
    recovers."""
    randomize_weights_(trainer_model, seed=47)
    client = AbandonedMidSync(
        HTTPVLLMWeightSyncClient(server.base_url, timeout=120), server
    )
    trainer = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(
            rank=0,
            packed=True,
            packed_buffer_size_bytes=256 * 1024,
            overlap_chunks=False,
        ),
        client=client,
        source=ModuleSource(trainer_model),
    )
    assert isinstance(trainer, IPCTrainerWeightTransferEngine)
    with pytest.raises(Exception) as refused:
        trainer.send_weights(weight_version="never-served")
    causes = []
    error: BaseException | None = refused.value
    while error is not None:
        causes.append(str(error))
        error = error.__cause__ or error.__context__

    assert client.waited is not None
    assert "another update is open" in str(client.waited)
    assert "publication" in str(client.waited)
    assert client.label is not None and client.label.startswith("fenced:")
    assert AbandonedMidSync.REASON in client.label, client.label
    assert client.served is not None and client.served.tokens  # answered
    # The base trainer's next chunk was refused naming who abandoned it.
    assert any(
        "HTTP 409" in c and "already ended" in c and AbandonedMidSync.REASON in c
        for c in causes
    ), causes
    assert weight_info(server)["weight_version"].startswith("fenced:")
    assert server.is_alive()

    randomize_weights_(trainer_model, seed=48)
    sync_from_a_fresh_trainer(server, trainer_model, "after-the-abandoned-sync")
    assert weight_info(server) == {"weight_version": "after-the-abandoned-sync"}
    assert_serves(server, trainer_model)
