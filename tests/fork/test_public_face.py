# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Docs and examples reach the fork through its public faces only: the
package itself, upstream's kept import paths, ``api`` (the fork-only names)
and ``testing`` (helpers for tests and demos). The packages behind them are
the implementation and may move."""

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FACES = {
    "api",
    "base",
    "clients",
    "factory",
    "ipc_engine",
    "sharded_rdt_common",
    "sharded_rdt_engine",
    "sharded_rdt_trainer",
    "testing",
}
IMPORT = re.compile(r"from vllm\.distributed\.weight_transfer\.([\w.]+) import")


def readers() -> list[Path]:
    docs = sorted((REPO / "docs").rglob("*.md"))
    examples = sorted((REPO / "examples").rglob("*.py"))
    return [REPO / "README.md", *docs, *examples]


@pytest.mark.parametrize("path", readers(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_and_examples_import_only_the_public_faces(path):
    inner = sorted(
        {
            m.group(1)
            for m in IMPORT.finditer(path.read_text())
            if m.group(1).split(".")[0] not in FACES
        }
    )
    assert inner == [], f"{path.name} imports {inner}; import from api instead"


def test_every_name_of_the_api_face_resolves():
    api = importlib.import_module("vllm.distributed.weight_transfer.api")
    assert all(getattr(api, name, None) is not None for name in api.__all__)
