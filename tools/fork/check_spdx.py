# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fail when a fork source file lacks upstream's two SPDX header lines."""

import sys
from pathlib import Path

HEADER = (
    "SPDX-License-Identifier: Apache-2.0",
    "SPDX-FileCopyrightText: Copyright contributors to the vLLM project",
)
CHECKED_SUFFIXES = {".py", ".sh"}


def missing_header(path: Path) -> bool:
    head = path.read_text(encoding="utf-8", errors="replace").splitlines()[:4]
    return not all(any(line.endswith(h) for line in head) for h in HEADER)


def main(paths: list[str]) -> int:
    bad = [
        p
        for p in paths
        if Path(p).suffix in CHECKED_SUFFIXES
        and Path(p).is_file()
        and missing_header(Path(p))
    ]
    for p in bad:
        print(f"{p}: missing SPDX header lines {HEADER}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
