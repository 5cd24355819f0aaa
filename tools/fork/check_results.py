# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Check that the committed benchmark results and the docs that quote them
agree. Exit 1, naming the file, when:

- a file under ``benchmarks/results/`` is cited by no doc;
- a doc cites a results path that does not exist;
- a figure a doc line quotes next to a result path does not occur in that
  result file.

Docs are ``README.md``, ``benchmarks/README.md`` and every ``*.md`` under
``docs/``. A citation is a path ``benchmarks/results/<bench>/<file>.json``
(``results/<bench>/<file>.json`` in ``benchmarks/README.md``). A path written
``<sha>:benchmarks/results/<file>.json`` names a result kept only in git
history (``git show <sha>:<path>`` prints it); it is not checked here.

A figure is a number on the citing line (a table row is one line) written
with a unit right after it, or each end of a range written ``<a>-<b><unit>``.
The units: ``%``, ``x`` (a ratio), ``s``, ``ms``, ``us``, ``GB``, ``GiB``,
``MB``, ``MiB``, ``GB/s`` or ``GiB/s``. When a line cites
several result files, each figure must occur in one of them. A figure occurs
in a file when some number in the file's JSON, rounded to the figure's
decimal places, equals it, read in the figure's unit: a fraction or a
percentage for ``%``; seconds, milliseconds or microseconds for times; bytes
in decimal or binary units for sizes and rates; the number itself for
``x``. Figures that a doc derives from a file's numbers (a ratio of two
fields, a sum) go on a line of their own, without the path.

Pure standard library; reads the files, no git calls.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"

CITE = re.compile(r"(?<![\w:/.-])(?:benchmarks/)?results/([\w./-]*?\.json)")
NUMBER = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(
    rf"(?<![\w.,/-])({NUMBER})(?:\s?-\s?({NUMBER}))?\s?"
    r"(GiB/s|GB/s|GiB|GB|MiB|MB|ms|us|µs|%|x|s)(?![\w/])"
)

# unit -> what a file's number is multiplied by to read it in that unit
SCALES: dict[str, tuple[float, ...]] = {
    "%": (1.0, 100.0),
    "x": (1.0,),
    "s": (1.0,),
    "ms": (1.0, 1e3),
    "us": (1.0, 1e6),
    "µs": (1.0, 1e6),
    "GB": (1.0, 1e-9),
    "GiB": (1.0, 2.0**-30),
    "MB": (1.0, 1e-6),
    "MiB": (1.0, 2.0**-20),
    "GB/s": (1.0, 1e-9),
    "GiB/s": (1.0, 2.0**-30),
}


def docs() -> list[Path]:
    found = [REPO / "README.md", REPO / "benchmarks" / "README.md"]
    found += sorted((REPO / "docs").rglob("*.md"))
    return [p for p in found if p.is_file()]


def numbers(value: object, out: list[float]) -> list[float]:
    if isinstance(value, bool):
        return out
    if isinstance(value, (int, float)):
        out.append(float(value))
    elif isinstance(value, dict):
        for v in value.values():
            numbers(v, out)
    elif isinstance(value, list):
        for v in value:
            numbers(v, out)
    return out


def occurs(text: str, unit: str, values: list[float]) -> bool:
    quoted = float(text.replace(",", ""))
    places = len(text.split(".")[1]) if "." in text else 0
    tol = 0.5 * 10**-places + 1e-9
    return any(abs(v * scale - quoted) <= tol for v in values for scale in SCALES[unit])


def main() -> int:
    errors: list[str] = []
    kept = {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*.json")}
    cited: set[str] = set()
    loaded: dict[str, list[float]] = {}
    for doc in docs():
        rel = doc.relative_to(REPO)
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            paths = [m.group(1) for m in CITE.finditer(line)]
            if not paths:
                continue
            present = []
            for path in paths:
                cited.add(path)
                if path not in kept:
                    errors.append(f"{rel}:{lineno}: cites missing results/{path}")
                    continue
                if path not in loaded:
                    data = json.loads((RESULTS / path).read_text())
                    loaded[path] = numbers(data, [])
                present.append(path)
            if not present:
                continue
            values = [v for p in present for v in loaded[p]]
            for m in FIGURE.finditer(CITE.sub(" ", line)):
                low, high, unit = m.groups()
                for text in (low, high) if high else (low,):
                    if not occurs(text, unit, values):
                        errors.append(
                            f"{rel}:{lineno}: figure {text}{unit} is not in "
                            + ", ".join(f"results/{p}" for p in present)
                        )
    for path in sorted(kept - cited):
        errors.append(f"benchmarks/results/{path}: cited by no doc")
    for e in errors:
        print(e)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
