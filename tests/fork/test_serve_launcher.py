# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``vllm serve`` launcher used by tests, examples and benchmarks: its
command line and environment, and its failure path (no real server started)."""

from __future__ import annotations

import json
import sys

import pytest

from vllm.distributed.weight_transfer.testing import server as launcher


def test_command_line_enables_the_backend_and_small_cpu_defaults():
    args = launcher.serve_args("/models/m", 8123, tensor_parallel_size=2)
    assert args[:2] == ["serve", "/models/m"]
    assert args[args.index("--port") + 1] == "8123"
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert "--enforce-eager" in args
    config = json.loads(args[args.index("--weight-transfer-config") + 1])
    assert config == {"backend": "ipc"}


def test_environment_has_dev_mode_and_no_insecure_serialization(monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    env = launcher.server_env(tensor_parallel_size=2)
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in env
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert (
        launcher.server_env(env={"VLLM_CPU_OMP_THREADS_BIND": "auto"})[
            "VLLM_CPU_OMP_THREADS_BIND"
        ]
        == "auto"
    )


def test_a_server_that_dies_at_start_raises_with_its_log(monkeypatch, tmp_path):
    script = "import sys; print('engine failed: no such model'); sys.exit(3)"
    monkeypatch.setattr(
        launcher, "vllm_command", lambda: [sys.executable, "-c", script]
    )
    with (
        pytest.raises(launcher.ServerStartError, match="exited with code 3") as info,
        launcher.serve(tmp_path, log_path=tmp_path / "server.log"),
    ):
        pass
    assert "engine failed: no such model" in str(info.value)


def test_a_server_that_never_gets_healthy_is_killed(monkeypatch, tmp_path):
    script = "import time; print('starting', flush=True); time.sleep(600)"
    monkeypatch.setattr(
        launcher, "vllm_command", lambda: [sys.executable, "-c", script]
    )
    started: list[launcher.ServerProcess] = []
    original = launcher.ServerProcess.wait_healthy

    def wait(self, timeout_s):
        started.append(self)
        return original(self, timeout_s)

    monkeypatch.setattr(launcher.ServerProcess, "wait_healthy", wait)
    with (
        pytest.raises(launcher.ServerStartError, match="not healthy after") as info,
        launcher.serve(tmp_path, startup_timeout_s=2),
    ):
        pass
    assert "starting" in str(info.value)
    assert not started[0].is_alive()
    assert started[0].group_pids() == []


# A fake ``vllm serve``: dies of upstream's slow-start race the first time
# (marked by a file), then answers /health on the port after ``--port``.
_RACE_THEN_SERVE = """
import http.server, pathlib, sys
marker = pathlib.Path(sys.argv[1])
if not marker.exists():
    marker.write_text("died once")
    print("    assert addresses.coordinator_input is not None")
    print("AssertionError")
    sys.exit(1)
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_a_start_lost_to_upstreams_slow_start_race_is_tried_once_more(
    monkeypatch, tmp_path
):
    marker = tmp_path / "died"
    command = [sys.executable, "-c", _RACE_THEN_SERVE, str(marker)]
    monkeypatch.setattr(launcher, "vllm_command", lambda: command)
    with launcher.serve(tmp_path, log_path=tmp_path / "server.log") as server:
        assert server.is_alive()
    assert marker.exists()
    # The log keeps the failed start.
    assert "coordinator_input" in (tmp_path / "server.log").read_text()


def test_the_slow_start_race_is_retried_only_once(monkeypatch, tmp_path):
    script = "print('assert addresses.coordinator_input is not None'); exit(1)"
    starts: list[int] = []

    def command() -> list[str]:
        starts.append(1)
        return [sys.executable, "-c", script]

    monkeypatch.setattr(launcher, "vllm_command", command)
    with (
        pytest.raises(launcher.ServerStartError, match="exited with code 1"),
        launcher.serve(tmp_path, log_path=tmp_path / "server.log"),
    ):
        pass
    assert len(starts) == 2
