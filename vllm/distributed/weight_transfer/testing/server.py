# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Start a real ``vllm serve`` for tests, examples and benchmarks.

``serve(model_dir, ...)`` is a context manager that launches
``vllm serve <model_dir>`` on 127.0.0.1 at a free port, waits until ``/health``
answers and yields a ``ServerProcess`` (``base_url``, ``model``, ``pid``,
``log_tail()``). On exit it terminates the server's whole process group (API
server, engine core, workers), escalating to SIGKILL, whatever happened inside
the block.

Defaults suit a small CPU machine: ``--dtype float32 --enforce-eager
--max-model-len 256 --max-num-seqs 4 --kv-cache-memory-bytes 67108864 --seed 0``
(``tiny_engine.TINY_ENGINE_ARGS``; ``VLLM_CPU_KVCACHE_SPACE``, when set, wins).
The RL routes (``/init_weight_transfer_engine``, ``/update_weights``, ...) need
``VLLM_SERVER_DEV_MODE=1``, which is always set. ``tensor_parallel_size=2``
also sets ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` unless the caller chose a
binding, because the CPU default binds per NUMA node.

``VLLM_ALLOW_INSECURE_SERIALIZATION`` is removed from the inherited environment
(pass it in ``env`` to keep it): the fork's weight-transfer routes carry no
pickle, and a test of that must not pass by accident.

A server that exits during start-up or is not healthy within
``startup_timeout_s`` raises ``ServerStartError`` with the tail of its log.
One start-up failure is tried again, once, on a new port: upstream's engine
core waits for its input socket in rounds of 10 s and, when a round times
out, asserts that a data-parallel coordinator exists, so an engine without
data parallelism whose start takes longer than that on a loaded machine dies
with that assertion (``_UPSTREAM_SLOW_START``). The retry is logged to
stderr; any other failure is raised at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.distributed.weight_transfer.testing.fresh_load import (
    WORKER_EXTENSION,
    FreshLoadOracle,
    http_worker_call,
)
from vllm.distributed.weight_transfer.testing.oracle import (
    GreedyResult,
    completions_greedy,
)
from vllm.distributed.weight_transfer.testing.tiny_engine import TINY_ENGINE_ARGS

DEFAULT_STARTUP_TIMEOUT_S = 300.0
_STOP_GRACE_S = 20.0
_LOG_TAIL_LINES = 60
_DROPPED_ENV = ("VLLM_ALLOW_INSECURE_SERIALIZATION",)
# What upstream's engine core (vllm/v1/engine/core.py) logs when it dies of
# the slow-start race described in the module docstring.
_UPSTREAM_SLOW_START = "assert addresses.coordinator_input is not None"


class ServerStartError(RuntimeError):
    """``vllm serve`` died or did not become healthy during start-up."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def vllm_command() -> list[str]:
    """The ``vllm`` CLI of the running interpreter's environment."""
    script = Path(sys.executable).parent / "vllm"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def serve_args(
    model_dir: str | os.PathLike[str],
    port: int,
    *,
    host: str = "127.0.0.1",
    weight_transfer_backend: str | None = "ipc",
    weight_transfer_options: Mapping[str, object] | None = None,
    dtype: str = "float32",
    max_model_len: int = TINY_ENGINE_ARGS["max_model_len"],
    max_num_seqs: int = TINY_ENGINE_ARGS["max_num_seqs"],
    tensor_parallel_size: int = 1,
    extra_args: Sequence[str] = (),
    fresh_load_oracle: bool = True,
) -> list[str]:
    """The argument list after ``vllm`` for one server. The weight-transfer
    config is ``weight_transfer_backend`` plus ``weight_transfer_options``
    (e.g. ``{"staging": "host"}``). ``fresh_load_oracle`` installs the worker
    methods of ``testing.fresh_load`` (see ``ServerProcess.fresh_load_oracle``)."""
    args = [
        "serve",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--enforce-eager",
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--kv-cache-memory-bytes",
        str(TINY_ENGINE_ARGS["kv_cache_memory_bytes"]),
        "--seed",
        str(TINY_ENGINE_ARGS["seed"]),
    ]
    if tensor_parallel_size != 1:
        args += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if weight_transfer_backend is not None:
        config = {"backend": weight_transfer_backend, **(weight_transfer_options or {})}
        args += ["--weight-transfer-config", json.dumps(config)]
    if fresh_load_oracle:
        args += ["--worker-extension-cls", WORKER_EXTENSION]
    return args + list(extra_args)


def server_env(
    tensor_parallel_size: int = 1, env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The server's environment: inherited, minus ``_DROPPED_ENV``, plus the
    settings in the module docstring, plus ``env`` (which wins)."""
    out = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    out["VLLM_SERVER_DEV_MODE"] = "1"
    out.setdefault("HF_HUB_OFFLINE", "1")
    out.setdefault("TOKENIZERS_PARALLELISM", "false")
    if tensor_parallel_size > 1:
        out.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND",
            "|".join(str(i) for i in range(tensor_parallel_size)),
        )
    out.update(env or {})
    return out


@dataclass
class ServerProcess:
    """A running ``vllm serve``; see the module docstring."""

    base_url: str
    model: str
    process: subprocess.Popen
    log_path: Path
    command: list[str]
    env: dict[str, str] = field(repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"<log {self.log_path} unreadable: {e}>"
        return "\n".join(text.splitlines()[-lines:])

    def greedy(self) -> GreedyResult:
        """The oracle prompts through ``/v1/completions``, after resetting the
        prefix cache (KV blocks cached before an update hold old activations)."""
        import requests

        requests.post(f"{self.base_url}/reset_prefix_cache", timeout=60)
        return completions_greedy(self.base_url, self.model)

    def fresh_load_oracle(self) -> FreshLoadOracle:
        """The same-engine oracle for this server (started with
        ``fresh_load_oracle=True``, the default)."""
        return FreshLoadOracle(http_worker_call(self.base_url), self.greedy)

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def group_pids(self) -> list[int]:
        """Pids of every live process in the server's process group."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # Fields after the parenthesised command: state, ppid, pgrp, ...
            state, _, pgrp = stat.rsplit(")", 1)[1].split()[:3]
            if int(pgrp) == self.pid and state != "Z":
                pids.append(int(entry.name))
        return sorted(pids)

    def wait_healthy(self, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> None:
        """Block until ``/health`` answers 200; ``ServerStartError`` otherwise."""
        import requests

        deadline = time.monotonic() + timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(
                    f"vllm serve exited with code {code} before it became healthy "
                    f"(command: {' '.join(self.command)}); last log lines:\n"
                    f"{self.log_tail()}"
                )
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{self.base_url}/health", timeout=5).ok:
                    return
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"vllm serve at {self.base_url} was not healthy after "
                    f"{timeout_s:.0f}s (raise startup_timeout_s on a busy machine); "
                    f"last log lines:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        """Terminate the whole process group: SIGTERM, then SIGKILL."""
        for sig, grace in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                self.process.poll()
                if not self.group_pids():
                    return
                time.sleep(0.2)
        self.process.wait(timeout=5)


@contextlib.contextmanager
def serve(
    model_dir: str | os.PathLike[str],
    *,
    env: Mapping[str, str] | None = None,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    log_path: str | os.PathLike[str] | None = None,
    **serve_options: Any,
) -> Iterator[ServerProcess]:
    """Run ``vllm serve model_dir`` for the duration of the block;
    ``serve_options`` are ``serve_args``' keywords (``weight_transfer_backend``,
    ``dtype``, ``tensor_parallel_size``, ...), except ``host``: the server
    listens on 127.0.0.1.

    The log goes to ``log_path`` (kept) or to a temporary file that is deleted
    when the block exits without an error.
    """
    if "host" in serve_options:
        raise TypeError("serve() listens on 127.0.0.1 and takes no host")
    full_env = server_env(serve_options.get("tensor_parallel_size", 1), env)
    tmp_dir = None
    if log_path is None:
        tmp_dir = Path(tempfile.mkdtemp(prefix="vllm-serve-"))
        path = tmp_dir / "server.log"
    else:
        path = Path(log_path)
        path.parent.mkdir(parents=True, exist_ok=True)

    def start(mode: str) -> ServerProcess:
        port = free_port()
        command = vllm_command() + serve_args(model_dir, port, **serve_options)
        with open(path, mode) as log:
            process = subprocess.Popen(
                command,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, killed as one
            )
        return ServerProcess(
            base_url=f"http://127.0.0.1:{port}",
            model=str(model_dir),
            process=process,
            log_path=path,
            command=command,
            env=full_env,
        )

    failed = True
    server = start("wb")
    try:
        try:
            server.wait_healthy(startup_timeout_s)
        except ServerStartError:
            log = server.log_path.read_text(errors="replace")
            if server.is_alive() or _UPSTREAM_SLOW_START not in log:
                raise
            # One line: the error's own text repeats the log's tail.
            print(
                "vllm serve died of upstream's slow-start race (log: "
                f"{server.log_path}); starting it once more",
                file=sys.stderr,
            )
            server.stop()
            server = start("ab")  # the log keeps the failed start
            server.wait_healthy(startup_timeout_s)
        yield server
        failed = False
    finally:
        server.stop()
        if tmp_dir is not None and not failed:
            shutil.rmtree(tmp_dir, ignore_errors=True)


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name{labels}`` (labels matched exactly) in a
    ``/metrics`` response in Prometheus text format; 0 when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0
