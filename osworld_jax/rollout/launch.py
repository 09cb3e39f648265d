"""Rollout servers as subprocesses: start them, wait until they serve, stop them at exit.

- `EmbeddedServer` (`launch_embedded`): ``python -m osworld_jax.server.serve``, ready when
  ``/health`` is 200.
- `SGLangServer` (`launch_sglang`): real SGLang, ``python -m sglang.launch_server`` with the
  flags of SGLang 0.5.x (`sglang_command`), ready when ``/health_generate`` is 200 (a one-token
  generation succeeded, as slime waits), started as verl and slime start it.
- `ServerGroup`: several of them started together (all spawned, then all awaited) and stopped
  together, in reverse order, on exit or on any start-up failure.

Every server runs in its own process group (SGLang forks scheduler and detokenizer processes):
`ServerProcess.stop` sends SIGTERM to the group, waits, then SIGKILLs whatever is left of it.
"""

from __future__ import annotations

import contextlib
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
from typing import IO, Protocol, Self

from osworld_jax.contract.errors import EngineError
from osworld_jax.rollout.config import SGLangLaunchConfig


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One server subprocess in its own process group (a context manager).

    Args:
      cmd: the command line.
      host: bind address; port: bind port (the URL is ``http://host:port``).
      name: what the server is called in error messages.
      health_path: polled until it answers 200 (500 from it means "failed to start").
      startup_timeout_s: how long to wait for that.
      stop_timeout_s: grace period after SIGTERM before SIGKILL.
      env: extra environment variables of the subprocess.
      log_path: file receiving the server's stdout/stderr (None: a temporary file).
      health_timeout_s: timeout of one health request.

    Attributes:
      url: ``http://host:port``.
      process: the ``subprocess.Popen`` (None before `spawn` / after `stop`).
    """

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        host: str,
        port: int,
        name: str,
        health_path: str,
        startup_timeout_s: float,
        stop_timeout_s: float = 30.0,
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        health_timeout_s: float = 5.0,
    ) -> None:
        self.cmd = list(cmd)
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"
        self.name = name
        self.health_path = health_path
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.health_timeout_s = health_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(log_path) if log_path else None
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._deadline = 0.0

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the server log."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def _health(self) -> int | None:
        try:
            url = self.url + self.health_path
            with urllib.request.urlopen(url, timeout=self.health_timeout_s) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return None

    def spawn(self) -> Self:
        """Starts the subprocess (its own session and process group) without waiting."""
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"osworld_jax_{self.name}_", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.process = subprocess.Popen(
            self.cmd,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        self._deadline = time.monotonic() + self.startup_timeout_s
        return self

    def wait_ready(self) -> Self:
        """Blocks until the health path answers 200.

        Raises:
          EngineError: the process exited, reported a start-up failure, or timed out (the
            message carries the tail of its log); the process group is stopped first.
        """
        while True:
            proc = self.process
            if proc is None:
                raise EngineError(f"{self.name}: not started")
            code = proc.poll()
            if code is not None:
                self.stop()
                raise EngineError(
                    f"{self.name} at {self.url} exited with {code}:\n{self.log_tail()}"
                )
            status = self._health()
            if status == 200:
                return self
            if status == 500:
                self.stop()
                raise EngineError(f"{self.name} at {self.url} failed to start:\n{self.log_tail()}")
            if time.monotonic() > self._deadline:
                self.stop()
                raise EngineError(
                    f"{self.name} at {self.url} not healthy after {self.startup_timeout_s}s "
                    f"(GET {self.health_path}):\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def start(self) -> Self:
        """`spawn`, then `wait_ready`."""
        return self.spawn().wait_ready()

    def stop(self) -> int | None:
        """SIGTERM to the process group, wait ``stop_timeout_s``, then SIGKILL what is left.

        Returns the exit code of the server process (None if it was not running).
        """
        proc, self.process = self.process, None
        if proc is None:
            return None
        code = proc.poll()
        if code is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                code = proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                code = proc.wait()
        _signal_group(proc.pid, signal.SIGKILL)  # children the server left behind
        f, self._log_file = self._log_file, None
        if f is not None:
            f.close()
        return code

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def embedded_flags(
    model_path: str | Path,
    *,
    host: str,
    port: int,
    enable_return_routed_experts: bool,
    max_running_requests: int,
    weight_version: str = "default",
    dtype: str | None = None,
) -> list[str]:
    """The ``osworld_jax.server.serve`` flags of an embedded server (subprocess or colocated)."""
    flags = [
        "--model-path", str(model_path), "--host", host, "--port", str(port),
        "--max-running-requests", str(max_running_requests),
        "--weight-version", weight_version,
    ]  # fmt: skip
    if enable_return_routed_experts:
        flags.append("--enable-return-routed-experts")
    if dtype is not None:
        flags += ["--dtype", dtype]
    return flags


class ManagedServer(Protocol):
    """What a `ServerGroup` starts and stops: a `ServerProcess`, or a server on a thread of
    this process (`osworld_jax.server.colocated.ColocatedServer`, started by the RL loop)."""  # noqa: D205, D209

    @property
    def url(self) -> str: ...  # noqa: D102

    def spawn(self) -> object: ...  # noqa: D102

    def wait_ready(self) -> object: ...  # noqa: D102

    def stop(self) -> object: ...  # noqa: D102


class EmbeddedServer(ServerProcess):
    """A ``python -m osworld_jax.server.serve`` subprocess (a context manager).

    Args:
      model_path: HF checkpoint directory.
      host: bind address.
      port: bind port (None: a free one).
      enable_return_routed_experts: pass ``--enable-return-routed-experts``.
      max_running_requests: KV-cache slots.
      weight_version: initial weight version.
      dtype: "float32" / "bfloat16" (None: the server's ``auto``).
      extra_args: further flags (e.g. ``["--context-length", "2048"]``).
      startup_timeout_s: how long to wait for ``/health``.
      stop_timeout_s: grace period after SIGTERM before SIGKILL.
      env: extra environment variables of the subprocess.
      log_path: file receiving the server's stdout/stderr (None: a temporary file).
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
        port = port if port is not None else free_port(host)
        flags = embedded_flags(
            model_path,
            host=host,
            port=port,
            enable_return_routed_experts=enable_return_routed_experts,
            max_running_requests=max_running_requests,
            weight_version=weight_version,
            dtype=dtype,
        )
        cmd = [sys.executable, "-m", "osworld_jax.server.serve", *flags]
        super().__init__(
            [*cmd, *extra_args],
            host=host,
            port=port,
            name="embedded server",
            health_path="/health",
            startup_timeout_s=startup_timeout_s,
            stop_timeout_s=stop_timeout_s,
            env=env,
            log_path=log_path,
        )


def launch_embedded(model_path: str | Path, **kwargs: object) -> EmbeddedServer:
    """An unstarted `EmbeddedServer` (keyword arguments are its own); use it as a context.

    Example: ``with launch_embedded(ckpt, max_running_requests=8) as srv: ... srv.url``.
    """
    return EmbeddedServer(model_path, **kwargs)  # type: ignore[arg-type]


def sglang_command(
    model_path: str | Path,
    config: SGLangLaunchConfig,
    *,
    host: str,
    port: int,
    index: int = 0,
    max_running_requests: int | None = None,
    dtype: str | None = None,
    weight_version: str | None = None,
    enable_return_routed_experts: bool = False,
) -> list[str]:
    """The ``python -m sglang.launch_server`` command line of server ``index`` of a group.

    Flags are SGLang 0.5.x's (``python/sglang/srt/server_args.py``): ``--model-path``,
    ``--host``, ``--port``, ``--tp-size`` (and ``--dp-size`` / ``--ep-size`` above 1),
    ``--base-gpu-id`` (server ``i`` starts at ``base_gpu_id + i * tp_size * dp_size``),
    ``--random-seed`` (``random_seed + i``), ``--skip-server-warmup`` (as slime and verl: the
    wait is a real generation), ``--skip-tokenizer-init``, ``--enable-return-routed-experts``,
    ``--max-running-requests``, ``--dtype``, ``--weight-version``, ``--context-length``,
    ``--mem-fraction-static``, then ``config.extra_args``.
    """
    c = config
    cmd = [
        c.python or sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_path), "--host", host, "--port", str(port),
        "--tp-size", str(c.tp_size),
        "--base-gpu-id", str(c.base_gpu_id + index * c.tp_size * c.dp_size),
        "--random-seed", str(c.random_seed + index),
        "--skip-server-warmup",
    ]  # fmt: skip
    if c.dp_size > 1:
        cmd += ["--dp-size", str(c.dp_size)]
    if c.ep_size > 1:
        cmd += ["--ep-size", str(c.ep_size)]
    if c.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if enable_return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if max_running_requests is not None:
        cmd += ["--max-running-requests", str(max_running_requests)]
    if dtype is not None:
        cmd += ["--dtype", dtype]
    if weight_version is not None:
        cmd += ["--weight-version", weight_version]
    if c.context_length is not None:
        cmd += ["--context-length", str(c.context_length)]
    if c.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(c.mem_fraction_static)]
    return [*cmd, *c.extra_args]


class SGLangServer(ServerProcess):
    """A real SGLang server, ``python -m sglang.launch_server`` (a context manager).

    Args:
      model_path: HF checkpoint directory.
      config: the `SGLangLaunchConfig` (interpreter, parallelism, GPUs, flags).
      host: bind address.
      port: bind port (None: a free one).
      index: this server's index in its group (GPU offset and seed).
      max_running_requests, dtype, weight_version, enable_return_routed_experts: the flags.
      return_original_logprob: set ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` in its environment
        (output logprobs at temperature 1; see `osworld_jax.rollout.logprob_temperature`).
      startup_timeout_s: how long to wait for ``/health_generate``.
      stop_timeout_s: grace period after SIGTERM before SIGKILL.
      env: extra environment variables.
      log_path: file receiving the server's stdout/stderr (None: a temporary file).
    """

    def __init__(
        self,
        model_path: str | Path,
        config: SGLangLaunchConfig,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        index: int = 0,
        max_running_requests: int | None = None,
        dtype: str | None = None,
        weight_version: str | None = None,
        enable_return_routed_experts: bool = False,
        return_original_logprob: bool = False,
        startup_timeout_s: float = 1800.0,
        stop_timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        port = port if port is not None else free_port(host)
        cmd = sglang_command(
            model_path,
            config,
            host=host,
            port=port,
            index=index,
            max_running_requests=max_running_requests,
            dtype=dtype,
            weight_version=weight_version,
            enable_return_routed_experts=enable_return_routed_experts,
        )
        super().__init__(
            cmd,
            host=host,
            port=port,
            name=f"SGLang server {index}",
            health_path="/health_generate",
            startup_timeout_s=startup_timeout_s,
            stop_timeout_s=stop_timeout_s,
            env={
                "SGLANG_RETURN_ORIGINAL_LOGPROB": "1" if return_original_logprob else "0",
                **(env or {}),
            },
            log_path=log_path,
            health_timeout_s=60.0,  # SGLang's /health_generate waits for a real generation
        )


def launch_sglang(
    model_path: str | Path, config: SGLangLaunchConfig, **kwargs: object
) -> SGLangServer:
    """An unstarted `SGLangServer` (keyword arguments are its own); use it as a context."""
    return SGLangServer(model_path, config, **kwargs)  # type: ignore[arg-type]


class ServerGroup:
    """Several servers started and stopped together (a context manager).

    All are spawned first (they load in parallel), then each is awaited; if one fails to
    start, every one is stopped and the error propagates. On exit they stop in reverse order.

    Attributes:
      servers: the `ServerProcess` objects.
      urls: their base URLs, in order.
    """

    def __init__(self, servers: Sequence[ManagedServer]) -> None:
        if not servers:
            raise ValueError("ServerGroup needs at least one server")
        self.servers = list(servers)
        self.urls = tuple(s.url for s in self.servers)

    def start(self) -> Self:
        """Spawns every server, then waits for each; stops them all on any failure."""
        try:
            for s in self.servers:
                s.spawn()
            for s in self.servers:
                s.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stops every server (reverse order)."""
        for s in reversed(self.servers):
            s.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
