# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The verified-publication lifecycle on a toy in-process backend.

The toy trainer packs tensors into one byte buffer per chunk; two toy workers
copy what they receive into their resident tensors in place, as vLLM does, so
a failure after the first copy leaves mixed weights. The client fans every
call out to both workers and raises if any raises, like ``collective_rpc``,
and holds the served weight version like the engine core.
"""

from __future__ import annotations

import pytest
import torch

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.verification.fence import (
    WeightsFencedError,
    WeightState,
    is_fenced_version,
)
from vllm.distributed.weight_transfer.verification.publication import (
    TrainerPublication,
    WorkerPublication,
)
from vllm.distributed.weight_transfer.verification.wire import (
    ChecksumMismatch,
    IncompleteUpdate,
    ManifestMismatch,
)


def make_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(16, 8, generator=g),
        "layers.0.w": torch.randn(8, 8, generator=g),
        "layers.1.w": torch.randn(8, 8, generator=g),
        "head": torch.randn(4, 8, generator=g),
    }


class ToyWorker:
    def __init__(self, rank: int, receipt_root) -> None:
        self.weights = make_weights(0)
        self.pub = WorkerPublication(
            backend="toy",
            worker_rank=rank,
            worker_device=f"cpu:toy:{rank}",
            receipt_root=receipt_root,
        )
        self.fail_on: str | None = None

    def start_weight_update(self) -> None:
        self.pub.start()

    def update_weights(self, message: dict) -> None:
        touched = False
        try:
            info = self.pub.begin_message(message)
            buf = info["buffer"]
            for name, dtype, shape in info["tensors"]:
                self.pub.admit(name, dtype, shape)
            self.pub.check_buffer(0, buf)
            offset = 0
            for name, _, shape in info["tensors"]:
                dst = self.weights[name]
                n = dst.numel() * dst.element_size()
                if name == self.fail_on:
                    raise RuntimeError(f"load of {name} failed")
                self.pub.touch()
                touched = True
                dst.view(-1).view(torch.uint8).copy_(buf[offset : offset + n])
                self.pub.landed(name, n)
                offset += n
        except BaseException as e:
            self.pub.fail(e, weights_intact=not touched)
            raise

    def finish_weight_update(self) -> None:
        self.pub.finish()


class ToyClient:
    """Fans out to every worker; keeps the served version like the engine core."""

    def __init__(self, workers: list[ToyWorker]) -> None:
        self.workers = workers
        self.version = "default"
        self.corrupt_chunk: int | None = None

    def _all(self, method: str, *args) -> None:
        errors = []
        for w in self.workers:
            try:
                getattr(w, method)(*args)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, info: dict) -> None:
        if info["chunk"] == self.corrupt_chunk:
            info = {**info, "buffer": info["buffer"].clone()}
            info["buffer"][5] ^= 0x10
        self._all("update_weights", info)

    def finish_weight_update(self) -> None:
        self._all("finish_weight_update")
        self.version_at_finish = self.version

    def update_weight_version(self, v: str) -> None:
        self.version = v


def send(
    client: ToyClient,
    weights: dict[str, torch.Tensor],
    version: int,
    tmp_path,
    *,
    checksums: bool = False,
    metas: list[ParamMeta] | None = None,
    skip_chunk: int | None = None,
) -> None:
    """The toy trainer's send_weights, following the module docstring."""
    metas = metas or [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in weights.items()]
    pub = TrainerPublication.open(
        backend="toy",
        model_version=version,
        metas=metas,
        checksums=checksums,
        receipt_root=tmp_path,
    )
    names = list(weights)
    try:
        client.start_weight_update()
        for chunk, group in enumerate((names[:2], names[2:])):
            if chunk == skip_chunk:
                continue
            buf = torch.cat([weights[n].reshape(-1).view(torch.uint8) for n in group])
            info = {
                "chunk": chunk,
                "buffer": buf,
                "tensors": [
                    (n, weights[n].dtype, tuple(weights[n].shape)) for n in group
                ],
            }
            client.update_weights(pub.attach(info, checksums=[pub.checksum(buf)]))
        client.finish_weight_update()
        pub.verify(expected_workers=range(len(client.workers)), timeout_s=5)
        client.update_weight_version(f"v{version}")
    except BaseException as e:
        pub.fail(client, e)
        raise
    finally:
        pub.close()


def assert_serving(client: ToyClient, weights: dict[str, torch.Tensor]) -> None:
    for w in client.workers:
        for name, t in weights.items():
            assert torch.equal(w.weights[name], t), name


@pytest.fixture
def client(tmp_path):
    return ToyClient([ToyWorker(0, tmp_path), ToyWorker(1, tmp_path)])


def test_committed_update_lands_everywhere_then_becomes_visible(client, tmp_path):
    new = make_weights(1)
    send(client, new, version=1, tmp_path=tmp_path, checksums=True)
    assert_serving(client, new)
    assert client.version_at_finish == "default"  # not visible before receipts
    assert client.version == "v1"
    assert all(w.pub.fence.state == WeightState.COMMITTED for w in client.workers)
    assert list(tmp_path.iterdir()) == []  # receipt directory removed


def test_flipped_byte_is_caught_before_landing_and_fences_the_version(client, tmp_path):
    old = make_weights(0)
    client.corrupt_chunk = 1
    with pytest.raises(
        ChecksumMismatch, match="payload buffer 0 .* changed in transit"
    ):
        send(client, make_weights(1), version=1, tmp_path=tmp_path, checksums=True)
    assert is_fenced_version(client.version)
    # chunk 0 landed, chunk 1 did not: mixed weights, so the engine is fenced
    assert all(w.pub.fence.state == WeightState.FENCED for w in client.workers)
    assert torch.equal(client.workers[0].weights["head"], old["head"])
    with pytest.raises(WeightsFencedError, match="full resync is required"):
        client.workers[0].finish_weight_update()


def test_without_checksums_the_flip_lands_silently(client, tmp_path):
    client.corrupt_chunk = 1
    new = make_weights(1)
    send(client, new, version=1, tmp_path=tmp_path, checksums=False)
    assert not torch.equal(client.workers[0].weights["layers.1.w"], new["layers.1.w"])


def test_manifest_mismatch_is_rejected_before_any_weight_is_loaded(client, tmp_path):
    new = make_weights(1)
    metas = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in new.items()]
    metas[0] = ParamMeta("embed", torch.float32, (8, 16))  # trainer metadata lies
    with pytest.raises(ManifestMismatch, match="'embed' arrives with shape"):
        send(client, new, version=1, tmp_path=tmp_path, metas=metas)
    assert_serving(client, make_weights(0))
    assert all(w.pub.fence.state == WeightState.IDLE for w in client.workers)
    assert is_fenced_version(client.version)


def test_worker_failing_mid_update_fences_and_full_resync_recovers(client, tmp_path):
    client.workers[1].fail_on = "layers.1.w"
    new = make_weights(1)
    with pytest.raises(RuntimeError, match="load of layers.1.w failed"):
        send(client, new, version=1, tmp_path=tmp_path)
    assert is_fenced_version(client.version)
    assert client.workers[1].pub.fence.state == WeightState.FENCED
    client.workers[1].fail_on = None
    send(client, new, version=1, tmp_path=tmp_path)
    assert_serving(client, new)
    assert client.version == "v1"


def test_an_update_missing_tensors_fails_at_finish_and_fences(client, tmp_path):
    with pytest.raises(IncompleteUpdate, match="2 of 4 tensors incomplete"):
        send(client, make_weights(1), version=1, tmp_path=tmp_path, skip_chunk=1)
    assert all(w.pub.fence.state == WeightState.FENCED for w in client.workers)
    assert is_fenced_version(client.version)


def test_missing_receipt_fails_the_publication(client, tmp_path):
    client.workers.append(ToyWorker(2, tmp_path))
    client.workers[2].finish_weight_update = lambda: None  # attests nothing
    with pytest.raises(Exception, match="worker\\(s\\) \\[2\\]"):
        send(client, make_weights(1), version=1, tmp_path=tmp_path)
    assert is_fenced_version(client.version)


def test_an_older_version_is_refused(client, tmp_path):
    send(client, make_weights(1), version=5, tmp_path=tmp_path)
    with pytest.raises(ValueError, match="older than the committed version 5"):
        send(client, make_weights(2), version=4, tmp_path=tmp_path)
    assert_serving(client, make_weights(1))


def test_a_failure_without_a_message_is_named_in_fence_and_version(
    client, tmp_path, monkeypatch
):
    def fail_bare(self, message):
        self.pub.begin_message(message)
        self.pub.touch()
        self.pub.fail(AssertionError())
        raise AssertionError()

    monkeypatch.setattr(ToyWorker, "update_weights", fail_bare)
    with pytest.raises(AssertionError):
        send(client, make_weights(1), version=1, tmp_path=tmp_path)
    reason = client.workers[0].pub.fence.status.reason
    assert reason == "AssertionError (raised without a message)"
    assert client.version.endswith(": AssertionError (raised without a message)")


# ---------------------------------------------------------------------------
# header fields refused at the first message, before any weight lands


def first_message(pub: TrainerPublication, weights: dict[str, torch.Tensor]) -> dict:
    """The first chunk of ``send``'s publication of ``weights``."""
    names = list(weights)[:2]
    buf = torch.cat([weights[n].reshape(-1).view(torch.uint8) for n in names])
    info = {
        "chunk": 0,
        "buffer": buf,
        "tensors": [(n, weights[n].dtype, tuple(weights[n].shape)) for n in names],
    }
    return pub.attach(info, checksums=[pub.checksum(buf)])


def open_publication(tmp_path, **kw) -> TrainerPublication:
    weights = make_weights(1)
    return TrainerPublication.open(
        backend=kw.pop("backend", "toy"),
        model_version=1,
        metas=[ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in weights.items()],
        receipt_root=tmp_path,
        **kw,
    )


def assert_refused_untouched(worker: ToyWorker, message: dict, field: str) -> None:
    """``message`` is refused naming ``field``; nothing landed, not fenced."""
    worker.start_weight_update()
    with pytest.raises(ValueError, match=rf"publication\.{field}\b"):
        worker.update_weights(message)
    assert_serving(ToyClient([worker]), make_weights(0))
    assert worker.pub.fence.state == WeightState.IDLE
    assert f"publication.{field}" in (worker.pub.fence.status.last_failure or "")


def test_a_receipt_dir_outside_the_receipt_root_is_refused_at_the_first_message(
    tmp_path,
):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    worker = ToyWorker(0, root)
    pub = open_publication(elsewhere)
    try:
        assert_refused_untouched(
            worker, first_message(pub, make_weights(1)), "receipt_dir"
        )
        assert pub.box is not None
        assert list(pub.box.path.iterdir()) == []  # no receipt written there
    finally:
        pub.close()


def test_a_missing_receipt_dir_is_refused_at_the_first_message(tmp_path):
    """A trainer on another host: its receipt box is not on this one."""
    pub = open_publication(tmp_path)
    message = first_message(pub, make_weights(1))
    pub.close()  # the directory is gone
    assert_refused_untouched(ToyWorker(0, tmp_path), message, "receipt_dir")


def test_a_producer_channel_on_an_engine_without_producer_is_refused_at_once(
    tmp_path,
):
    from vllm.distributed.weight_transfer.verification.receipts import ReceiptInbox

    pub = open_publication(tmp_path, channel="producer", inbox=ReceiptInbox())
    message = first_message(pub, make_weights(1))
    assert_refused_untouched(ToyWorker(0, tmp_path), message, "receipt_channel")


def test_another_backends_publication_is_refused_at_the_first_message(tmp_path):
    pub = open_publication(tmp_path, backend="sharded_rdt")
    try:
        message = first_message(pub, make_weights(1))
        assert_refused_untouched(ToyWorker(0, tmp_path), message, "backend")
    finally:
        pub.close()


def test_a_later_message_that_changes_the_header_is_refused(client, tmp_path):
    pub = open_publication(tmp_path)
    worker = client.workers[0]
    try:
        worker.start_weight_update()
        worker.update_weights(first_message(pub, make_weights(1)))
        later = first_message(pub, make_weights(1))
        later["publication"]["model_version"] = 2
        with pytest.raises(ValueError, match=r"publication\.model_version 1 -> 2"):
            worker.update_weights(later)
        # the first chunk had landed: fenced, naming the cause
        assert worker.pub.fence.state == WeightState.FENCED
        assert "publication.model_version" in worker.pub.fence.status.reason
    finally:
        pub.close()


# ---------------------------------------------------------------------------
# the trainer's prepare message


def test_a_prepare_naming_another_publication_is_refused_before_any_receipt(
    client, tmp_path
):
    pub = open_publication(tmp_path)
    worker = client.workers[0]
    own = pub.header.publication_id
    try:
        worker.start_weight_update()
        worker.update_weights(first_message(pub, make_weights(1)))
        stray = {"prepare": "0123456789abcdef"}
        with pytest.raises(ValueError, match=f"'0123456789abcdef' but .* {own}"):
            worker.pub.check_prepare(stray)
        assert pub.box is not None
        assert list(pub.box.path.iterdir()) == []  # nothing attested
        # the prepare that names the open publication goes through
        worker.pub.check_prepare({"prepare": own})
        # so does an adapter push's, named among the open publications
        other = open_publication(tmp_path)
        try:
            worker.pub.check_prepare(
                {"prepare": other.header.publication_id}, other.header
            )
        finally:
            other.close()
    finally:
        pub.close()


def test_a_prepare_in_an_update_without_publication_names_nothing_to_refuse():
    worker = ToyWorker(0, None)
    worker.start_weight_update()
    worker.pub.check_prepare({"prepare": "0123456789abcdef"})
    assert worker.pub.prepare() is None
