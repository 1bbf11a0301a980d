"""Start a local agent as its own process (emulation mode: the agent beside the GPU host) and
wait until it serves. Used by the demo, the tests and the benchmarks."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class AgentProcess:
    """``dpu-agent serve`` in a subprocess on a free loopback port.

    Args:
        settings: TOML text of extra config sections (e.g. ``[arena]\\nbytes = "64MiB"``).
        env: extra environment variables.
    """

    def __init__(self, settings: str = "", env: dict[str, str] | None = None,
                 startup_timeout: float = 30.0, interpreter: list[str] | None = None) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="dpu-agent-")
        root = Path(self._dir.name)
        self.config_path = root / "agent.toml"
        self.config_path.write_text(settings)
        self.ready_file = root / "ready"
        self.log_path = root / "agent.log"
        # Port 0 (a free one) unless the caller says otherwise; the ready file reports it.
        self.env = {**os.environ, "DPU_AGENT_SERVER_LISTEN_ADDRESS": "127.0.0.1:0",
                    **(env or {})}
        self.startup_timeout = startup_timeout
        self.interpreter = interpreter or [sys.executable]
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.metrics_port = 0
        self.activations_port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> AgentProcess:
        self.ready_file.unlink(missing_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*self.interpreter, "-m", "dpu_agent.cli", "serve", "--config", str(self.config_path),
             "--ready-file", str(self.ready_file)], stdout=log, stderr=subprocess.STDOUT,
            env=self.env)
        log.close()
        deadline = time.monotonic() + self.startup_timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"agent not ready in {self.startup_timeout} s:\n{self.log()}")
            time.sleep(0.02)
        ports = [int(x) for x in self.ready_file.read_text().split()]
        self.port, self.metrics_port, self.activations_port = [*ports, 0, 0][:3]
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then after ``timeout`` its stacks and SIGKILL (:func:`stop_process`);
        returns the exit code."""
        if self.proc is None:
            return None
        stop_process(self.proc, timeout)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> AgentProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._dir.cleanup()


STACK_DUMP_SECONDS = 1.0
"""How long a hung process is given to write its stacks before SIGKILL."""


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10.0) -> bool:
    """SIGTERM ``proc`` and wait up to ``timeout`` seconds; if it is still running, SIGUSR1
    first (the project's processes dump every thread's stack to their stderr on it: the
    record of where shutdown hung), then SIGKILL. Returns whether it exited on SIGTERM."""
    if proc.poll() is not None:
        return True
    proc.terminate()
    try:
        proc.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(STACK_DUMP_SECONDS)
        proc.kill()
        proc.wait()
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdProcess:
    """A single-member etcd (Debian's ``etcd-server``) on free loopback ports, its data in a
    temporary directory; for cluster-mode tests, benchmarks and the demo."""

    def __init__(self, startup_timeout: float = 20.0,
                 tls: tuple[str, str, str] | None = None) -> None:
        self.binary = shutil.which("etcd")
        if self.binary is None:
            raise FileNotFoundError("etcd is not installed (Debian package etcd-server; "
                                    "`make test` installs it)")
        self._dir = tempfile.TemporaryDirectory(prefix="etcd-")
        self.client_port, self.peer_port = free_port(), free_port()
        self.startup_timeout = startup_timeout
        self.tls = tls
        """(CA, server certificate, server key): https with client certificates required."""
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> bool:
        return shutil.which("etcd") is not None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> EtcdProcess:
        scheme = "https" if self.tls else "http"
        client, peer = f"{scheme}://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        tls = ([] if self.tls is None else
               ["--trusted-ca-file", self.tls[0], "--cert-file", self.tls[1], "--key-file",
                self.tls[2], "--client-cert-auth"])
        log = open(Path(self._dir.name) / "etcd.log", "ab")
        self.proc = subprocess.Popen(
            [self.binary, "--name", "test", "--data-dir", str(Path(self._dir.name) / "data"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"test={peer}", "--log-level", "warn", *tls],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), 0.2):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"etcd not listening in {self.startup_timeout} s") \
                        from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def __enter__(self) -> EtcdProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._dir.cleanup()
