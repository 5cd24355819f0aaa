#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Run upstream vLLM 0.32.0's own weight-transfer tests, unmodified, against the fork.
#
# The tests come from upstream's PyPI sdist, downloaded once into the same cache as
# the upstream wheel (~/.cache/fork-upstream, or $VLLM_FORK_CACHE) and checked
# against its sha256. Its tests/ tree and pytest settings are unpacked into
# build/upstream-tests/ (ignored), and pytest runs there with the fork's .venv, so
# `import vllm` is the fork and `import tests.*` is upstream's test tree.
#
# Every upstream weight-transfer test must pass (or skip for want of a GPU) except
# those in tools/fork/upstream_tests_differ.txt, each listed with its reason.
# Extra arguments go to pytest; UPSTREAM_TESTS_NICE sets the run's niceness.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"

version=0.32.0
sdist_sha256=d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad
cache=${VLLM_FORK_CACHE:-$HOME/.cache/fork-upstream}
sdist=$cache/vllm-$version.tar.gz
dest=build/upstream-tests
differ=tools/fork/upstream_tests_differ.txt
python=$root/.venv/bin/python

# Upstream's weight-transfer tests: every file under its tests/ that exercises
# vllm.distributed.weight_transfer or the RL weight-transfer routes and hooks.
files=(
    tests/distributed/test_packed_tensor.py
    tests/distributed/test_sharded_rdt_plan.py
    tests/distributed/test_sharded_rdt_producer.py
    tests/distributed/test_sharded_rdt_trainer.py
    tests/distributed/test_weight_transfer.py
    tests/distributed/test_weight_transfer_m2n.py
    tests/distributed/test_weight_transfer_nccl_uid.py
    tests/entrypoints/rl/weight_transfer/test_offline.py
    tests/entrypoints/rl/weight_transfer_metrics/test_across_api_servers_metrics.py
    tests/entrypoints/rl/weight_transfer_metrics/test_weight_operation_metrics.py
    tests/v1/worker/test_gpu_worker_weight_transfer.py
)

log() { echo "[upstream_tests] $*" >&2; }

if [ ! -f "$sdist" ] || ! echo "$sdist_sha256  $sdist" | sha256sum -c --status; then
    log "downloading the vllm==$version sdist into $cache"
    mkdir -p "$cache"
    rm -f "$sdist"
    # pip prepares the sdist's metadata; "empty" keeps that from building anything.
    VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=$version \
        "$python" -m pip download --disable-pip-version-check -q --no-deps \
        --no-binary vllm "vllm==$version" -d "$cache"
    if ! echo "$sdist_sha256  $sdist" | sha256sum -c --status; then
        log "$sdist does not have sha256 $sdist_sha256; delete it and retry"
        exit 1
    fi
fi

if ! "$python" -c "import tblib, pytest_asyncio" 2>/dev/null; then
    log "installing upstream's test dependencies"
    "$python" -m pip install --disable-pip-version-check -q \
        -r tools/fork/requirements-upstream-tests.txt
fi

stamp=$dest/.sdist-sha256
if [ "$(cat "$stamp" 2>/dev/null)" != "$sdist_sha256" ]; then
    log "unpacking upstream's tests/ into $dest"
    rm -rf "$dest"
    mkdir -p "$dest"
    tar -xzf "$sdist" -C "$dest" --strip-components=1 \
        "vllm-$version/tests" "vllm-$version/pyproject.toml"
    echo "$sdist_sha256" >"$stamp"
fi

# A node id is deselected; a bare file path (a module that cannot even be
# imported against the fork) is not collected at all.
deselect=()
skipped_files=" "
while read -r node _; do
    case $node in
        *::*) deselect+=(--deselect "$node") ;;
        *) skipped_files+="$node " ;;
    esac
done < <(grep -v '^[[:space:]]*\(#\|$\)' "$differ")
run=()
for f in "${files[@]}"; do
    [[ $skipped_files == *" $f "* ]] || run+=("$f")
done

cd "$dest"
# Upstream's pyproject.toml carries its pytest markers; the cache stays out of the
# tree so that a re-run starts clean.
exec nice -n "${UPSTREAM_TESTS_NICE:-0}" "$python" -m pytest \
    -c pyproject.toml --rootdir . -p no:cacheprovider -ra \
    "${deselect[@]}" "${run[@]}" "$@"
