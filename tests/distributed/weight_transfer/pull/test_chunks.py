# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routing and chunking: pure functions from a plan to per-producer pulls."""

import pytest

from vllm.distributed.weight_transfer.plan.ops import SliceSpec, ViewOp
from vllm.distributed.weight_transfer.plan.worker_plan import (
    Region,
    SliceCopy,
    build_plan,
)
from vllm.distributed.weight_transfer.pull.chunks import (
    PACK_ALIGN,
    PullChunk,
    build_pull_plan,
    make_chunk,
)
from vllm.distributed.weight_transfer.pull.routing import (
    RdtRouter,
    check_ray_rdt_version,
)
from vllm.distributed.weight_transfer.sharded_rdt.wire import (
    ShardedRDTWeightTransferInitInfo,
)

NAMES = ["embed.weight", "layers.0.a", "layers.0.b", "layers.1.a", "layers.1.b"]
SHAPES = {n: (4, 3) for n in NAMES}


def _copy(name: str, rows: int, dtype: str = "float32") -> SliceCopy:
    spec = SliceSpec(name, (ViewOp("narrow", (0, 0, rows)),), (rows, 3), dtype)
    module = name.rsplit(".", 1)[0] or "root"
    region = Region(module, name.rsplit(".", 1)[1], 0, (rows, 3), (3, 1), dtype)
    return SliceCopy(spec, region)


def _plan(rows: int = 1):
    return build_plan(worker="w", names=NAMES, copies=[_copy(n, rows) for n in NAMES])


def test_slices_pack_at_16_byte_offsets():
    specs = [SliceSpec("x", (), (3,), "float32"), SliceSpec("y", (), (5,), "int8")]
    chunk = make_chunk(group=0, producer=0, seq=0, specs=specs)
    assert [p.offset for p in chunk.slices] == [0, PACK_ALIGN]
    assert chunk.nbytes == PACK_ALIGN + 5
    assert chunk.payload_bytes == 12 + 5


def test_chunk_json_round_trip_and_layout_check():
    chunk = build_pull_plan(_plan(), RdtRouter(1, 1), 0).chunks[1]
    assert PullChunk.from_json(chunk.to_json()) == chunk
    with pytest.raises(ValueError, match="offsets"):
        PullChunk(chunk.group, 0, 0, (chunk.slices[1], chunk.slices[0]))


def test_one_producer_gets_one_chunk_per_group_in_order():
    pulls = build_pull_plan(_plan(), RdtRouter(1, 1), 0)
    assert [c.group for c in pulls.chunks] == [0, 1, 2]
    assert [c.seq for c in pulls.chunks] == [0, 1, 2]
    assert pulls.payload_bytes == _plan().nbytes


def test_owners_split_groups_and_bytes_add_up():
    # rank 0 holds embed and layer 0, rank 1 holds layer 1
    owner_sets = [[0], [1]]
    classes = [0, 0, 0, 1, 1]
    router = RdtRouter(2, 1, owner_sets, classes, NAMES, [1, 2, 2])
    pulls = build_pull_plan(_plan(), router, 0)
    assert [(c.group, c.producer, c.seq) for c in pulls.chunks] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
    ]
    by_producer = pulls.payload_bytes_by_producer()
    assert sum(by_producer.values()) == _plan().nbytes
    assert by_producer[1] == 2 * 12


def test_consumers_spread_over_producers_that_hold_everything():
    router = RdtRouter(2, 2, names=NAMES, group_lens=[1, 2, 2])
    first = {c.producer for c in build_pull_plan(_plan(), router, 0).chunks}
    second = {c.producer for c in build_pull_plan(_plan(), router, 1).chunks}
    assert first == {0} and second == {1}


def test_digest_depends_on_content_not_consumer():
    router = RdtRouter(1, 2)
    a = build_pull_plan(_plan(1), router, 0)
    b = build_pull_plan(_plan(1), router, 1)
    c = build_pull_plan(_plan(2), router, 1)
    assert a.digest(0) == b.digest(0) != c.digest(0)


def test_router_rejects_bad_tables():
    with pytest.raises(ValueError, match="owner_sets"):
        RdtRouter(1, 1, [[3]], [0], ["x"])
    with pytest.raises(ValueError, match="name_owner_class has"):
        RdtRouter(1, 1, [[0]], [0, 0], ["x"])
    with pytest.raises(ValueError, match="does not divide"):
        RdtRouter(1, 3, workers_per_replica=2)


def test_worker_init_info_validates_and_rejects_unknown_fields():
    info = ShardedRDTWeightTransferInitInfo.from_dict(
        {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2]]}
    )
    assert info.transport == "auto"
    with pytest.raises(ValueError, match="unknown field"):
        ShardedRDTWeightTransferInitInfo.from_dict({"nmes": []})
    with pytest.raises(ValueError, match="shapes has 0 entries"):
        ShardedRDTWeightTransferInitInfo(names=["a"], dtype_names=["float32"])
    with pytest.raises(ValueError, match="transport"):
        ShardedRDTWeightTransferInitInfo(transport="tcp")


def test_ray_version_gate(monkeypatch):
    import importlib.metadata

    check_ray_rdt_version()  # the installed Ray is new enough
    monkeypatch.setattr(importlib.metadata, "version", lambda _: "2.40.0")
    with pytest.raises(ValueError, match="needs Ray >= 2.56.0; found Ray 2.40.0"):
        check_ray_rdt_version()


def test_router_group_lookup_and_group_owners():
    router = RdtRouter(2, 1, [[0], [1]], [0, 0, 0, 1, 1], NAMES, [1, 2, 2])
    assert router.producer_for(0, "layers.1.a") == 1
    assert router.group_owners(1) == (0,)
    assert RdtRouter(2, 1).group_owners(0) == (0, 1)
