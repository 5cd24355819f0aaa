# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The installed vllm is the pinned upstream release with this repo's files on top."""

import importlib
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def tracked_fork_modules() -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "vllm/*.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return [
        p[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        for p in out
        if p.endswith(".py")
    ]


def test_installed_distribution_is_named_vllm():
    version = importlib.metadata.version("vllm")
    assert version.startswith("0.32.0")
    if "cpu" in version:
        # vLLM infers the CPU platform from the version string.
        from vllm.platforms import current_platform

        assert current_platform.is_cpu()


@pytest.mark.parametrize("module", tracked_fork_modules())
def test_fork_module_is_imported_from_the_repo(module):
    mod = importlib.import_module(module)
    assert mod.__file__ is not None
    path = Path(mod.__file__).resolve()
    assert path.is_relative_to(REPO / "vllm"), f"{module} imported from {path}"


def test_upstream_modules_come_from_the_pinned_release():
    import vllm.v1.worker.gpu_worker as worker

    assert Path(worker.__file__).resolve().is_relative_to(REPO / "vllm")
    assert worker.__name__ not in tracked_fork_modules()


BUILTIN_BACKENDS = ["nccl", "ipc", "sparse_nccl", "sharded_rdt", "nccl_m2n"]


@pytest.mark.parametrize("name", BUILTIN_BACKENDS)
def test_every_upstream_backend_still_resolves(name):
    from vllm.distributed.weight_transfer import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )
    from vllm.distributed.weight_transfer.base import (
        TrainerWeightTransferEngine,
        WeightTransferEngine,
    )

    assert issubclass(
        WeightTransferEngineFactory.get_engine_class(name), WeightTransferEngine
    )
    assert issubclass(
        WeightTransferTrainerFactory.get_engine_class(name),
        TrainerWeightTransferEngine,
    )


def test_modelexpress_stays_registered_on_the_worker_side():
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    assert "modelexpress" in WeightTransferEngineFactory.available_backends()


# Each run of the CLI imports vLLM afresh (about 17 s on 2 cores); the runs the
# tests below read start together, at the first test that needs one.
_CLI_RUNS = {"version": ("--version",), "serve_help": ("serve", "--help=all")}


@pytest.fixture(scope="module")
def vllm_cli() -> dict[str, subprocess.CompletedProcess]:
    exe = str(Path(sys.executable).with_name("vllm"))
    started = {
        name: subprocess.Popen(
            [exe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, args in _CLI_RUNS.items()
    }
    finished = {}
    for name, process in started.items():
        try:
            out, err = process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        finished[name] = subprocess.CompletedProcess(
            process.args, process.returncode, out, err
        )
    return finished


def test_vllm_cli_reports_the_release_version(vllm_cli):
    out = vllm_cli["version"]
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("0.32.0")


def test_vllm_serve_help_lists_weight_transfer_config(vllm_cli):
    out = vllm_cli["serve_help"]
    assert out.returncode == 0, out.stderr
    assert "--weight-transfer-config" in out.stdout
