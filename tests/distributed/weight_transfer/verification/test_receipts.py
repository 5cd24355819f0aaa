# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Receipt channels: the shared-memory directory and the producer inbox."""

import dataclasses
import json
import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from vllm.distributed.weight_transfer.base import ParamMeta
from vllm.distributed.weight_transfer.testing.owner_child import OwnerChild
from vllm.distributed.weight_transfer.verification.checks import (
    ManifestChecker,
    verify_receipts,
)
from vllm.distributed.weight_transfer.verification.receipts import (
    CallbackReceiptSink,
    ReceiptInbox,
    ReceiptTimeoutError,
    ShmReceiptBox,
    ShmReceiptSink,
    reap_receipt_dirs,
    receipt_file_name,
    sink_for,
)
from vllm.distributed.weight_transfer.verification.wire import (
    Manifest,
    PublicationHeader,
    Receipt,
)

MANIFEST = Manifest.from_params([ParamMeta("w", torch.float32, (4,))])


def header(**kw) -> PublicationHeader:
    return PublicationHeader.create(
        backend="ipc",
        model_version=1,
        manifest=MANIFEST,
        trainer_devices=["cpu:h:0"],
        **kw,
    )


def receipt(h: PublicationHeader, rank: int) -> Receipt:
    checker = ManifestChecker(h, MANIFEST)
    checker.admit("w", torch.float32, (4,))
    checker.landed("w", 16)
    return checker.receipt(rank, f"cpu:h:{rank}")


def _worker(directory: str, header_dict: dict, rank: int) -> None:
    h = PublicationHeader.from_dict(header_dict)
    ShmReceiptSink(directory, root=os.path.dirname(directory)).deliver(receipt(h, rank))


def test_workers_in_other_processes_deliver_and_trainer_verifies(tmp_path):
    h0 = header()
    with ShmReceiptBox(h0.publication_id, root=tmp_path) as box:
        h = header(
            publication_id=h0.publication_id,
            receipt_channel="shm",
            receipt_dir=str(box.path),
        )
        assert oct(box.path.stat().st_mode & 0o777) == "0o700"
        ctx = mp.get_context("fork")
        procs = [
            ctx.Process(target=_worker, args=(str(box.path), h.to_dict(), r))
            for r in (0, 1)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        got = box.collect([0, 1], timeout_s=30)
        verify_receipts(h, got, [0, 1])
    assert not box.path.exists()


@pytest.mark.serial
def test_collect_times_out_naming_missing_workers(tmp_path):
    h = header()
    with ShmReceiptBox(h.publication_id, root=tmp_path) as box:
        ShmReceiptSink(box.path, root=tmp_path).deliver(receipt(h, 0))
        started = time.monotonic()
        with pytest.raises(ReceiptTimeoutError, match="worker\\(s\\) \\[1, 2\\]"):
            box.collect([0, 1, 2], timeout_s=0.2)
        assert time.monotonic() - started < 5


def test_a_failure_receipt_ends_the_wait_early(tmp_path):
    h = header()
    with ShmReceiptBox(h.publication_id, root=tmp_path) as box:
        ShmReceiptSink(box.path, root=tmp_path).deliver(
            Receipt.failure(h, 1, "cpu:h:1", "oom")
        )
        got = box.collect([0, 1], timeout_s=30)
    assert [r.error for r in got] == ["oom"]


def test_sink_writes_atomically_and_leaves_no_temp_files(tmp_path):
    h = header()
    with ShmReceiptBox(h.publication_id, root=tmp_path) as box:
        r = receipt(h, 3)
        ShmReceiptSink(box.path, root=tmp_path).deliver(r)
        [name] = os.listdir(box.path)
        assert name == receipt_file_name(r) and name.startswith("worker-3-")
        assert json.loads((box.path / name).read_text())["worker_rank"] == 3


def test_box_rejects_a_file_claiming_another_worker(tmp_path):
    h = header()
    with ShmReceiptBox(h.publication_id, root=tmp_path) as box:
        name = receipt_file_name(receipt(h, 0))
        (box.path / name).write_text(json.dumps(receipt(h, 1).to_dict()))
        with pytest.raises(ValueError, match="holds the receipt of worker 1"):
            box.read()


def test_workers_of_two_engines_sharing_a_rank_are_both_collected(tmp_path):
    h = header()
    with ShmReceiptBox(h.publication_id, root=tmp_path) as box:
        for device in ("cuda:GPU-a", "cuda:GPU-b"):
            r = dataclasses.replace(receipt(h, 0), worker_device=device)
            ShmReceiptSink(box.path, root=tmp_path).deliver(r)
        got = box.collect(2, timeout_s=30)
        assert sorted(r.worker_device for r in got) == ["cuda:GPU-a", "cuda:GPU-b"]
        assert verify_receipts(h, got, 2).workers == (0, 0)
        with pytest.raises(ReceiptTimeoutError, match="1 of 3 worker"):
            box.collect(3, timeout_s=0.1)


def test_sink_refuses_foreign_directories_and_missing_trainer(tmp_path):
    with pytest.raises(ValueError, match="is not a vllm-wt-receipts-"):
        ShmReceiptSink(tmp_path, root=tmp_path)
    gone = tmp_path / "vllm-wt-receipts-0123456789abcdef"
    with pytest.raises(FileNotFoundError, match="needs a colocated trainer"):
        ShmReceiptSink(gone, root=tmp_path).deliver(receipt(header(), 0))


def test_producer_inbox_collects_across_threads():
    h = header(receipt_channel="producer")
    inbox = ReceiptInbox()
    sink = sink_for(h, producer_call=inbox.deliver)
    assert isinstance(sink, CallbackReceiptSink)
    threads = [
        threading.Thread(target=sink.deliver, args=(receipt(h, r),)) for r in range(4)
    ]
    for t in threads:
        t.start()
    got = inbox.collect(h.publication_id, range(4), timeout_s=30)
    for t in threads:
        t.join()
    assert [r.worker_rank for r in got] == [0, 1, 2, 3]
    inbox.discard(h.publication_id)
    with pytest.raises(ReceiptTimeoutError, match="\\[0\\]"):
        inbox.collect(h.publication_id, [0], timeout_s=0.05)


def test_sink_for_follows_the_header():
    assert sink_for(header()) is None
    with pytest.raises(ValueError, match="has no producer to call"):
        sink_for(header(receipt_channel="producer"))


# -- client-chosen receipt directories ---------------------------------------

RECEIPT_DIR = "vllm-wt-receipts-0123456789abcdef"


def test_sink_refuses_a_directory_outside_the_receipt_root(tmp_path):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    (elsewhere / RECEIPT_DIR).mkdir(parents=True)
    for directory in (
        elsewhere / RECEIPT_DIR,
        root / "sub" / RECEIPT_DIR,
        root / ".." / "elsewhere" / RECEIPT_DIR,
    ):
        with pytest.raises(ValueError, match="not directly under .* receipt root"):
            ShmReceiptSink(directory, root=root)
    assert list((elsewhere / RECEIPT_DIR).iterdir()) == []


def test_the_default_receipt_root_is_the_workers_own(tmp_path):
    (tmp_path / RECEIPT_DIR).mkdir()
    with pytest.raises(ValueError, match="not directly under .* receipt root"):
        sink_for(header(receipt_channel="shm", receipt_dir=str(tmp_path / RECEIPT_DIR)))


def test_sink_refuses_a_symlinked_receipt_directory(tmp_path):
    root, target = tmp_path / "root", tmp_path / "target"
    root.mkdir()
    target.mkdir()
    (root / RECEIPT_DIR).symlink_to(target)
    sink = ShmReceiptSink(root / RECEIPT_DIR, root=root)
    with pytest.raises(ValueError, match="symbolic link or not a directory"):
        sink.deliver(receipt(header(), 0))
    assert list(target.iterdir()) == []


def test_sink_replaces_a_link_planted_under_the_receipt_name(tmp_path):
    h = header()
    outside = tmp_path / "outside.json"
    outside.write_text("untouched")
    with ShmReceiptBox(h.publication_id, root=tmp_path) as box:
        r = receipt(h, 0)
        (box.path / receipt_file_name(r)).symlink_to(outside)
        ShmReceiptSink(box.path, root=tmp_path).deliver(r)
        assert not (box.path / receipt_file_name(r)).is_symlink()
        assert box.collect([0], timeout_s=1)[0] == r
    assert outside.read_text() == "untouched"


def test_sink_refuses_a_directory_owned_by_another_uid(tmp_path, monkeypatch):
    h = header()
    with ShmReceiptBox(h.publication_id, root=tmp_path) as box:
        monkeypatch.setattr(os, "geteuid", lambda: box.path.stat().st_uid + 4242)
        with pytest.raises(ValueError, match="owned by uid"):
            ShmReceiptSink(box.path, root=tmp_path).deliver(receipt(h, 0))


def test_receipt_names_with_a_trailing_newline_are_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a vllm-wt-receipts-"):
        ShmReceiptSink(f"{tmp_path}/{RECEIPT_DIR}\n", root=tmp_path)
    with pytest.raises(ValueError, match="publication id"):
        ShmReceiptBox("0123456789abcdef\n", root=tmp_path)
    h = header()
    with ShmReceiptBox(h.publication_id, root=tmp_path) as box:
        (box.path / (receipt_file_name(receipt(h, 0)) + "\n")).write_text("{}")
        assert box.read() == {}  # not a receipt file name: skipped, never parsed


# -- receipt directories of trainers that are gone -----------------------------


def _open_box(root, publication_id: str):
    box = ShmReceiptBox(publication_id, root=root)
    return box.path.name, box


def test_a_killed_trainers_receipt_dir_goes_at_the_next_trainers_box(tmp_path):
    """Kept while its trainer lives (another trainer's box does not touch
    it), removed by the next box as soon as that trainer is killed: no age
    threshold, no pid."""
    dying = header().publication_id
    with OwnerChild(lambda: _open_box(tmp_path, dying)) as owner:
        with ShmReceiptBox(header().publication_id, root=tmp_path):
            assert (tmp_path / owner.name).is_dir()
        owner.kill()
        with ShmReceiptBox(header().publication_id, root=tmp_path) as box:
            assert sorted(os.listdir(tmp_path)) == [box.path.name]


def test_only_unowned_receipt_dirs_are_reaped(tmp_path):
    h = header()
    unowned = tmp_path / "vllm-wt-receipts-0123456789"
    unowned.mkdir()  # fresh, but nobody holds its lock
    (unowned / "worker-0-0123456789abcdef.json").write_text("{}")
    segment_like = tmp_path / "vllm-wt-1-0123abcd"
    segment_like.write_bytes(b"x")
    with ShmReceiptBox(h.publication_id, root=tmp_path) as box:
        assert reap_receipt_dirs(tmp_path) == []
        assert box.path.is_dir() and segment_like.exists()
    assert not unowned.exists()
    assert os.listdir(tmp_path) == [segment_like.name]
    box.close()  # idempotent
