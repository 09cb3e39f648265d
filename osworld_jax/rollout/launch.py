"""`launch_embedded`: start the embedded server as a subprocess, wait for it, stop it cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from osworld_jax.rollout.errors import EngineError


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedServer:
    """A ``python -m osworld_jax.rollout.serve`` subprocess (a context manager).

    Args:
      model_path: HF checkpoint directory.
      host: bind address.
      port: bind port (None: a free one).
      enable_return_routed_experts: pass ``--enable-return-routed-experts``.
      max_running_requests: KV-cache slots.
      weight_version: initial weight version.
      dtype: "float32" / "bfloat16" (None: the server's ``auto``).
      extra_args: further flags (e.g. ``["--context-length", "2048"]``).
      startup_timeout_s: how long to wait for ``/health`` 200.
      stop_timeout_s: grace period after SIGTERM before SIGKILL.
      env: extra environment variables of the subprocess.
      log_path: file receiving the server's stdout/stderr (None: a temporary file).

    Attributes:
      url: ``http://host:port`` once started.
      process: the ``subprocess.Popen`` (None before `start` / after `stop`).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        enable_return_routed_experts: bool = True,
        max_running_requests: int = 16,
        weight_version: str = "default",
        dtype: str | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 600.0,
        stop_timeout_s: float = 30.0,
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.cmd = [
            sys.executable,
            "-m",
            "osworld_jax.rollout.serve",
            "--model-path",
            str(model_path),
            "--host",
            host,
            "--port",
            str(self.port),
            "--max-running-requests",
            str(max_running_requests),
            "--weight-version",
            weight_version,
        ]
        if enable_return_routed_experts:
            self.cmd.append("--enable-return-routed-experts")
        if dtype is not None:
            self.cmd += ["--dtype", dtype]
        self.cmd += list(extra_args)
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(log_path) if log_path else None
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: object | None = None

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the server log."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def _health(self) -> int | None:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return None

    def start(self) -> EmbeddedServer:
        """Spawns the server and blocks until ``/health`` is 200.

        Raises:
          EngineError: the process exited, reported a start-up failure, or timed out (the
            message carries the tail of its log).
        """
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="osworld_jax_serve_", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        log_file = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self._log_file = log_file
        self.process = subprocess.Popen(
            self.cmd, stdout=log_file, stderr=subprocess.STDOUT, env=self.env
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                self._close_log()
                self.process = None
                raise EngineError(f"embedded server exited with {code}:\n{self.log_tail()}")
            status = self._health()
            if status == 200:
                return self
            if status == 500:
                self.stop()
                raise EngineError(f"embedded server failed to start:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(
                    f"embedded server not healthy after {self.startup_timeout_s}s:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.25)

    def stop(self) -> int | None:
        """SIGTERM, wait ``stop_timeout_s``, then SIGKILL; returns the exit code."""
        proc, self.process = self.process, None
        if proc is None:
            return None
        code = proc.poll()
        if code is None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        self._close_log()
        return code

    def _close_log(self) -> None:
        f, self._log_file = self._log_file, None
        if f is not None:
            f.close()  # type: ignore[attr-defined]

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def launch_embedded(model_path: str | Path, **kwargs: object) -> EmbeddedServer:
    """An unstarted `EmbeddedServer` (keyword arguments are its own); use it as a context.

    Example: ``with launch_embedded(ckpt, max_running_requests=8) as srv: ... srv.url``.
    """
    return EmbeddedServer(model_path, **kwargs)  # type: ignore[arg-type]
