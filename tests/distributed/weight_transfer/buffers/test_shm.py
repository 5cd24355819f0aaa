# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU data plane: a shared-memory segment written by one process is read,
byte for byte, by another; mappings outlive the unlink; nothing is left in
/dev/shm; a segment is reaped exactly when no live trainer owns it."""

import multiprocessing as mp
import os

import pytest
import torch

from vllm.distributed.weight_transfer.buffers import shm as shm_buffer
from vllm.distributed.weight_transfer.buffers.dataplane import (
    BufferImporter,
    allocate_buffer,
    export_tensor,
)
from vllm.distributed.weight_transfer.buffers.handles import ShmHandle, cpu_device_key
from vllm.distributed.weight_transfer.buffers.shm import (
    SHM_DIR,
    MappedSegment,
    SharedMemoryBuffer,
    reap_segments,
)
from vllm.distributed.weight_transfer.testing.owner_child import (
    OwnerChild,
    exited_pid,
)


def _read_in_child(handle_dict, queue):
    seg = MappedSegment(ShmHandle(**handle_dict))
    assert seg.tensor is not None
    queue.put(seg.tensor.clone().tolist())
    seg.close()


def test_bytes_written_by_the_trainer_are_read_by_another_process():
    with SharedMemoryBuffer(64) as buf:
        assert buf.tensor is not None
        buf.tensor.copy_(torch.arange(64, dtype=torch.uint8))
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(
            target=_read_in_child,
            args=({"name": buf.name, "nbytes": buf.nbytes}, queue),
        )
        proc.start()
        got = queue.get(timeout=60)
        proc.join(timeout=60)
    assert got == list(range(64))
    assert proc.exitcode == 0


def test_close_unlinks_and_a_mapping_outlives_the_unlink():
    buf = SharedMemoryBuffer(16)
    assert buf.tensor is not None
    buf.tensor.fill_(7)
    reader = MappedSegment(buf.handle)
    buf.close()
    buf.close()  # idempotent
    assert not os.path.exists(os.path.join(SHM_DIR, buf.name))
    assert reader.tensor is not None
    assert reader.tensor.tolist() == [7] * 16
    reader.close()


def test_a_view_that_outlives_close_still_reads_its_memory():
    """Closing either side lets go of its mapping but never unmaps it under a
    view that is still alive (``torch.frombuffer`` does not pin the mapping,
    so ``mmap.close`` would have succeeded and left the view dangling); the
    memory goes with the last view."""
    buf = SharedMemoryBuffer(4096)
    assert buf.tensor is not None
    written = buf.tensor[:8]
    written.fill_(5)
    reader = MappedSegment(buf.handle)
    assert reader.tensor is not None
    read = reader.tensor[:8]
    reader.close()
    buf.close()
    assert not os.path.exists(os.path.join(SHM_DIR, buf.name))
    assert read.tolist() == [5] * 8 and written.tolist() == [5] * 8
    written.fill_(6)  # the same pages: both views see it
    assert read.tolist() == [6] * 8


def test_segments_are_private_to_the_owner():
    with SharedMemoryBuffer(8) as buf:
        mode = os.stat(os.path.join(SHM_DIR, buf.name)).st_mode & 0o777
    assert mode == 0o600


def test_missing_or_short_segment_is_a_clear_error():
    with pytest.raises(ValueError, match="does not exist on this host"):
        MappedSegment(ShmHandle(name="vllm-wt-missing-0", nbytes=8))
    with (
        SharedMemoryBuffer(8) as buf,
        pytest.raises(ValueError, match="has 8 bytes but the handle claims 64"),
    ):
        MappedSegment(ShmHandle(name=buf.name, nbytes=64))


def test_exported_tensor_is_viewed_with_its_dtype_and_shape_by_the_importer():
    src = torch.randn(3, 5, dtype=torch.float32).to(torch.bfloat16)
    exported = export_tensor(src)
    importer = BufferImporter(torch.device("cpu"), local_rank=0)
    _, handle = importer.select({cpu_device_key(0): exported.handle}, "ipc_handles")
    raw = importer.open(handle)
    assert importer.open(handle) is raw  # mapped once
    view = raw.view(torch.bfloat16).view(3, 5)
    assert torch.equal(view, src)
    assert raw.untyped_storage().data_ptr() in importer.storage_ptrs()
    del raw, view
    importer.close()
    exported.close()


def test_allocated_buffer_of_zero_bytes_is_valid():
    buf = allocate_buffer(0, torch.device("cpu"))
    assert buf.handle.nbytes == 0
    buf.close()


# -- hostile segments (a same-host client names the segment) -----------------


def _mapping_perms(path: str) -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(path):
                return line.split()[1]
    raise AssertionError(f"{path} is not mapped")


def test_a_symlinked_segment_is_refused_and_its_target_untouched(tmp_path):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"outside!")
    name = f"vllm-wt-link-{os.getpid()}"
    os.symlink(outside, os.path.join(SHM_DIR, name))
    try:
        with pytest.raises(ValueError, match=f"{name}.*symbolic link"):
            MappedSegment(ShmHandle(name=name, nbytes=8))
    finally:
        os.unlink(os.path.join(SHM_DIR, name))
    assert outside.read_bytes() == b"outside!"


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_segment_that_is_not_a_regular_file_is_refused(kind):
    name = f"vllm-wt-{kind}-{os.getpid()}"
    path = os.path.join(SHM_DIR, name)
    os.mkdir(path) if kind == "directory" else os.mkfifo(path)
    try:
        with pytest.raises(ValueError, match=f"{name}.*not a regular file"):
            MappedSegment(ShmHandle(name=name, nbytes=0))
    finally:
        os.rmdir(path) if kind == "directory" else os.unlink(path)


def test_a_segment_owned_by_another_uid_is_refused(monkeypatch):
    with SharedMemoryBuffer(8) as buf:
        monkeypatch.setattr(os, "geteuid", lambda: os.stat(SHM_DIR).st_uid + 4242)
        with pytest.raises(ValueError, match=f"{buf.name}.*owned by uid"):
            MappedSegment(buf.handle)


def test_the_worker_engine_maps_segments_read_only():
    with SharedMemoryBuffer(8) as buf:
        importer = BufferImporter(torch.device("cpu"), local_rank=0, writable=False)
        importer.open(buf.handle)
        assert _mapping_perms(os.path.join(SHM_DIR, buf.name)) == "r--s"
        importer.close()


def test_a_segment_truncated_between_two_uses_is_refused_not_read():
    # Reading the kept mapping after the truncation would raise SIGBUS; the
    # importer must refuse before handing it out.
    with SharedMemoryBuffer(8192) as buf:
        importer = BufferImporter(torch.device("cpu"), local_rank=0, writable=False)
        assert importer.open(buf.handle).sum().item() == 0
        os.truncate(os.path.join(SHM_DIR, buf.name), 0)
        with pytest.raises(ValueError, match=f"{buf.name}.*has 0 bytes"):
            importer.open(buf.handle)
        importer.close()


def test_a_segment_replaced_between_two_uses_is_refused():
    with SharedMemoryBuffer(16) as buf:
        importer = BufferImporter(torch.device("cpu"), local_rank=0, writable=False)
        importer.open(buf.handle)
        path = os.path.join(SHM_DIR, buf.name)
        os.unlink(path)
        with pytest.raises(ValueError, match=f"{buf.name}.*no longer exists"):
            importer.open(buf.handle)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, 16)
        os.close(fd)
        with pytest.raises(ValueError, match=f"{buf.name}.*different file"):
            importer.open(buf.handle)
        importer.close()


# -- reaping segments of trainers that are gone -------------------------------
# Each test reaps a private directory standing in for /dev/shm, never the real
# one, where other processes' segments live.


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(shm_buffer, "SHM_DIR", str(tmp_path))
    return tmp_path


def _segment_named_by_pid(pid: int) -> tuple[str, SharedMemoryBuffer]:
    """A new segment filled with 9s, renamed as if its owner had ``pid`` (a
    trainer in another PID namespace, seen from here)."""
    buf = SharedMemoryBuffer(16)
    assert buf.tensor is not None
    buf.tensor.fill_(9)
    name = f"vllm-wt-{pid}-{buf.name.rsplit('-', 1)[1]}"
    os.rename(os.path.join(shm_buffer.SHM_DIR, buf.name), shm_buffer._path(name))
    return name, buf


def test_a_live_trainers_segment_is_kept_though_its_pid_is_dead_here(shm_dir):
    """Ownership is the owner's lock, not ``kill(pid, 0)``: a trainer in
    another PID namespace names its segments with a pid that is dead (or
    someone else) here, and its segments stay while it lives."""
    dead_pid = exited_pid()
    with OwnerChild(lambda: _segment_named_by_pid(dead_pid)) as owner:
        assert reap_segments(str(shm_dir)) == []
        allocate_buffer(8, torch.device("cpu")).close()  # reaps first
        assert (shm_dir / owner.name).exists()


def test_a_killed_trainers_segment_is_reaped_while_a_worker_maps_it(shm_dir):
    """A worker's mapping does not count as ownership, is never removed by the
    worker, and stays readable after the reaper unlinks the name."""
    with OwnerChild(lambda: _segment_named_by_pid(os.getpid())) as owner:
        mapped = MappedSegment(ShmHandle(name=owner.name, nbytes=16))
        assert reap_segments(str(shm_dir)) == []
        owner.kill()
        assert reap_segments(str(shm_dir)) == [owner.name]
    assert not (shm_dir / owner.name).exists()
    assert mapped.tensor is not None and mapped.tensor.tolist() == [9] * 16
    mapped.close()


def test_the_reaper_keeps_its_own_processes_segments(shm_dir):
    """Including a SharedParameters-style segment whose views outlive the
    buffer object's mapping, and after a forked helper exits."""
    plain, lasting = SharedMemoryBuffer(8), SharedMemoryBuffer(8)
    lasting.outlive_views()
    helper = mp.get_context("fork").Process(target=os._exit, args=(0,))
    helper.start()
    helper.join(timeout=30)
    assert helper.exitcode == 0
    assert reap_segments(str(shm_dir)) == []
    assert {plain.name, lasting.name} <= set(os.listdir(shm_dir))
    plain.close()
    lasting.close()
    assert os.listdir(shm_dir) == []


def test_unowned_segments_are_reaped_and_nothing_else(shm_dir):
    """A segment nobody holds the lock on goes, even one named with the
    reaper's own (live) pid; links, lookalikes and other files stay."""
    unowned = [shm_dir / f"vllm-wt-{pid}-0123abcd" for pid in (os.getpid(), 1)]
    other, target = shm_dir / "unrelated-file", shm_dir / "target"
    lookalike = shm_dir / "vllm-wt-receipts-0123456789"
    link = shm_dir / f"vllm-wt-{os.getpid()}-feedbeef"
    for f in (*unowned, other, target):
        f.write_bytes(b"x")
    lookalike.mkdir()
    link.symlink_to(target)
    assert sorted(reap_segments(str(shm_dir))) == sorted(f.name for f in unowned)
    assert not any(f.exists() for f in unowned)
    assert other.exists() and target.exists() and lookalike.is_dir()
    assert link.is_symlink()
