# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plan records' JSON form: pinned field by field (plan and chunk digests
hash it), and read back to equal records."""

import json

from vllm.distributed.weight_transfer.plan.ops import SliceSpec, ViewOp
from vllm.distributed.weight_transfer.plan.worker_plan import (
    GatherGroup,
    Region,
    SliceCopy,
)


def _group() -> GatherGroup:
    spec = SliceSpec(
        source="w", chain=(ViewOp("narrow", (0, 0, 2)),), shape=(2, 3), dtype="bfloat16"
    )
    region = Region("layer", "weight", 6, (2, 3), (3, 1), "float32")
    return GatherGroup(
        index=1, names=("w",), copies=(SliceCopy(spec, region),), completes=("layer",)
    )


def test_json_form_is_fields_by_name_with_lists():
    assert _group().to_json() == {
        "index": 1,
        "names": ["w"],
        "copies": [
            {
                "slice": {
                    "source": "w",
                    "chain": [["narrow", [0, 0, 2], [], None]],
                    "shape": [2, 3],
                    "dtype": "bfloat16",
                },
                "region": {
                    "module": "layer",
                    "param": "weight",
                    "offset": 6,
                    "shape": [2, 3],
                    "stride": [3, 1],
                    "dtype": "float32",
                },
            }
        ],
        "completes": ["layer"],
    }


def test_read_back_through_json_equals_the_record():
    group = _group()
    again = GatherGroup.from_json(json.loads(json.dumps(group.to_json())))
    assert again == group
    assert isinstance(again.copies[0].slice.chain[0], ViewOp)
    assert again.names == ("w",)
