"""The rollout servers a run starts (``ServerConfig.launch``) and their preflight checks.

``embedded`` starts one ``python -m osworld_jax.server.serve``; ``sglang`` starts
``ServerConfig.sglang.num_servers`` real SGLang servers (``python -m sglang.launch_server``, as
verl and slime do). Either way the run waits until they serve, points the client at them and
stops them (their whole process groups) when it ends.

An embedded server can share the trainer's accelerators (``ServerConfig.device_memory_fraction``):
each process then preallocates only its share of each device (`memory_shares`), and both
shares are checked before anything compiles (`check_server_fits`, the trainer's step estimate).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from osworld_jax.errors import ConfigError
from osworld_jax.model.config import Qwen3MoeConfig
from osworld_jax.model.serving import (
    DEFAULT_MIN_BUCKET,
    GiB,
    ServerMemory,
    cache_layout,
    fit_problem,
    server_memory,
)
from osworld_jax.rl import compile_cache
from osworld_jax.rl.config import ExperimentConfig, ServerConfig
from osworld_jax.rollout.launch import (
    EmbeddedServer,
    ServerGroup,
    SGLangServer,
    embedded_flags,
    free_port,
)

log = logging.getLogger(__name__)

#: Of each shared device, left to neither process: what XLA allocates outside its pool (the
#: CUDA context, cuBLAS / cuDNN workspaces) for two processes.
SHARE_MARGIN = 0.05
MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def memory_shares(server: ServerConfig) -> tuple[float, float] | None:
    """``(server, trainer)`` fractions of each device when the embedded server shares the
    trainer's devices (``device_memory_fraction``), else None.

    >>> memory_shares(ServerConfig(launch="embedded", device_memory_fraction=0.25))
    (0.25, 0.7)
    """  # noqa: D205, D209
    f = server.device_memory_fraction
    if f is None:
        return None
    return f, round(1.0 - f - SHARE_MARGIN, 6)


def process_share(server: ServerConfig) -> float | None:
    """This (the trainer's) process's share of each device: the trainer's share beside an
    embedded server of its own process, everything but the margin when the server is
    colocated (one pool holds both: the server's budget is checked, not reserved), else None
    (jax's default)."""  # noqa: D205, D209
    shares = memory_shares(server)
    if server.launch == "colocated":
        return round(1.0 - SHARE_MARGIN, 6)
    return None if shares is None else shares[1]


def share_devices(exp: ExperimentConfig) -> None:
    """Sets this (the trainer's) process's share of each device before jax starts its backend.

    No-op without a split. A share already in the environment wins (logged). Raises
    `ConfigError` when a GPU backend already started with another share (too late to change).
    """
    share = process_share(exp.server)
    if share is None:
        return
    want = str(share)
    have = os.environ.get(MEM_FRACTION_ENV)
    if have is not None and have != want:
        log.warning(
            "%s=%s from the environment (the config's split says %s)", MEM_FRACTION_ENV, have, want
        )
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized() and have is None:
        import jax

        if jax.default_backend() == "gpu":
            raise ConfigError(
                "ServerConfig.device_memory_fraction: jax's GPU backend started before the run "
                f"could set {MEM_FRACTION_ENV}={want}; start the run in a fresh process"
            )
        return  # the CPU: no preallocation to split
    os.environ[MEM_FRACTION_ENV] = want


def server_group(exp: ExperimentConfig, model_path: str | Path, run_dir: Path) -> ServerGroup:
    """The unstarted `ServerGroup` of ``exp.server`` (``launch`` must not be ``none``).

    Logs go to ``run_dir/server.log`` (embedded) or ``run_dir/sglang_<i>.log``.
    """
    s = exp.server
    routes = exp.trainer.router_replay  # R3: the servers return the routes the trainer replays
    if s.launch == "colocated":
        return ServerGroup([colocated_server(exp, model_path, run_dir)])
    if s.launch == "embedded":
        extra = ["--expert-backend", exp.runtime.expert_backend, *s.extra_args]
        if s.return_original_logprob:
            extra.append("--return-original-logprob")
        embedded = EmbeddedServer(
            model_path,
            host=s.host,
            port=s.port or None,
            max_running_requests=s.max_running_requests,
            enable_return_routed_experts=routes,
            dtype=s.dtype,
            extra_args=extra,
            startup_timeout_s=s.startup_timeout_s,
            # the flag decides, not an inherited environment variable
            env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "0", **_share_env(s), **_cache_env(exp)},
            log_path=run_dir / "server.log",
        )
        return ServerGroup([embedded])
    if s.launch != "sglang":
        raise ValueError(f"server_group: ServerConfig.launch is {s.launch!r}")
    return ServerGroup(
        [
            SGLangServer(
                model_path,
                s.sglang,
                host=s.host,
                port=s.port + i if s.port else None,
                index=i,
                max_running_requests=s.max_running_requests,
                dtype=s.dtype,
                enable_return_routed_experts=routes,
                return_original_logprob=s.return_original_logprob,
                startup_timeout_s=s.startup_timeout_s,
                log_path=run_dir / f"sglang_{i}.log",
            )
            for i in range(s.sglang.num_servers)
        ]
    )


def colocated_server(exp: ExperimentConfig, model_path: str | Path, run_dir: Path) -> Any:
    """The unstarted `ColocatedServer` of ``exp.server`` (the embedded server's flags, on a
    thread of this process; its log in ``run_dir/server.log``)."""  # noqa: D205, D209
    from osworld_jax.server.colocated import ColocatedServer

    s = exp.server
    if jax_process_count() > 1:
        raise ConfigError(
            "ServerConfig.launch = 'colocated' runs the server inside the trainer's process: "
            "one process only (use 'embedded' or 'sglang' across hosts)"
        )
    flags = embedded_flags(
        model_path,
        host=s.host,
        port=s.port or free_port(s.host),  # the URL is known before the server starts
        enable_return_routed_experts=exp.trainer.router_replay,
        max_running_requests=s.max_running_requests,
        dtype=s.dtype,
    )
    flags += ["--expert-backend", exp.runtime.expert_backend, *s.extra_args]
    if s.return_original_logprob:
        flags.append("--return-original-logprob")
    shares, capacity = memory_shares(s), device_total()
    budget = None if shares is None or capacity is None else shares[0] * capacity
    return ColocatedServer(
        flags,
        memory_budget_bytes=budget,
        startup_timeout_s=s.startup_timeout_s,
        log_path=run_dir / "server.log",
    )


def device_total() -> float | None:
    """Bytes of this process's first device (its allocator's limit over its memory fraction),
    or None where the platform reports no limit (the CPU)."""  # noqa: D205, D209
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return None
    return float(limit) / float(os.environ.get(MEM_FRACTION_ENV, "0.75"))


def jax_process_count() -> int:
    """How many jax processes the run has (1 before ``jax.distributed`` starts)."""
    import jax

    return jax.process_count()


def embedded_server_memory(exp: ExperimentConfig, model: Qwen3MoeConfig) -> ServerMemory:
    """What the run's embedded server will hold on its device: its KV cache from the flags the
    run gives it (``ServerConfig.max_running_requests``, ``dtype`` and any ``--context-length``,
    ``--max-total-tokens`` or ``--min-bucket`` in ``extra_args``), its weights."""  # noqa: D205, D209
    s = exp.server
    flags = argparse.ArgumentParser(add_help=False)  # the server's flags that size its cache
    flags.add_argument("--context-length", type=int, default=None)
    flags.add_argument("--max-total-tokens", type=int, default=None)
    flags.add_argument("--min-bucket", type=int, default=DEFAULT_MIN_BUCKET)
    args, _ = flags.parse_known_args(list(s.extra_args))
    layout = cache_layout(
        model,
        max_running_requests=s.max_running_requests,
        context_length=args.context_length,
        max_total_tokens=args.max_total_tokens,
        min_bucket=args.min_bucket,
    )
    return server_memory(model, layout, "bfloat16" if s.dtype == "auto" else s.dtype)  # a GPU


def check_server_fits(exp: ExperimentConfig, model: Qwen3MoeConfig, device_bytes: float) -> str:
    """The embedded server's memory against its share of a ``device_bytes`` device; one line.

    Raises:
      ConfigError: it does not fit, naming what to change.
    """
    shares = memory_shares(exp.server)
    share = shares[0] if shares is not None else 1.0
    mem = embedded_server_memory(exp, model)
    problem = fit_problem(mem, device_bytes * share)
    if problem is not None:
        bf16 = (
            ", or serve in ServerConfig.dtype = 'bfloat16'"
            if exp.server.dtype != "bfloat16"
            else ""
        )
        raise ConfigError(
            f"the embedded server {problem} (ServerConfig.device_memory_fraction = {share} of "
            f"{device_bytes / GiB:.1f} GiB): raise device_memory_fraction, lower "
            "ServerConfig.max_running_requests (KV-cache slots) or its --context-length "
            f"(ServerConfig.extra_args){bf16}"
        )
    return f"~{mem.describe()} of its {device_bytes * share / GiB:.1f} GiB"


def _share_env(server: ServerConfig) -> dict[str, str]:
    shares = memory_shares(server)
    return {} if shares is None else {MEM_FRACTION_ENV: str(shares[0])}


CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


#: jax caches only programs that took at least this long to compile (default 1 s): every
#: program of a run is cached, so a second run compiles none (the server's many small buckets).
MIN_COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def _cache_env(exp: ExperimentConfig) -> dict[str, str]:
    d = compilation_cache(exp)
    if d is None:
        return {}
    return {CACHE_ENV: d, MIN_COMPILE_TIME_ENV: os.environ.get(MIN_COMPILE_TIME_ENV, "0")}


def compilation_cache(exp: ExperimentConfig) -> str | None:
    """The run's persistent compilation cache directory (``RLConfig.compilation_cache_dir``,
    ``~`` expanded; ``JAX_COMPILATION_CACHE_DIR`` of the environment wins), or None."""  # noqa: D205, D209
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    d = exp.rl.compilation_cache_dir
    return None if d is None else str(Path(d).expanduser())


def compilation_cache_problem(exp: ExperimentConfig) -> str | None:
    """One line when the compilation cache directory cannot be used (for preflight), or None."""
    d = compilation_cache(exp)
    if d is None:
        return None
    field = CACHE_ENV if os.environ.get(CACHE_ENV) else "RLConfig.compilation_cache_dir"
    return compile_cache.dir_problem(d, field)


def use_compilation_cache(exp: ExperimentConfig) -> None:
    """Points this process's jax at the run's compilation cache (before its first compile);
    the embedded server gets it through its environment (`server_group`).

    An unusable directory is one `ConfigError` line; entries a killed writer left unreadable
    are removed first (`compile_cache.repair`), so this run's compiles write them again.
    """  # noqa: D205
    d = compilation_cache(exp)
    if d is None:
        return
    problem = compilation_cache_problem(exp)
    if problem is not None:
        raise ConfigError(problem)
    import jax

    Path(d).mkdir(parents=True, exist_ok=True)
    compile_cache.repair(d)
    jax.config.update("jax_compilation_cache_dir", d)
    if MIN_COMPILE_TIME_ENV not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def server_problems(exp: ExperimentConfig) -> list[str]:
    """One line per reason the configured servers cannot run this experiment (for preflight)."""
    s = exp.server
    if s.launch != "sglang":
        return []
    problems = []
    python = s.sglang.python or sys.executable
    probe = "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
        ok = found.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        problems.append(
            f"ServerConfig.launch = 'sglang' but {python} cannot import sglang: "
            "pip install 'osworld_jax[sglang]' there (CUDA GPUs), or set "
            "SGLangLaunchConfig.python"
        )
    sampling = exp.rollout.sampling
    if s.sglang.skip_tokenizer_init and (sampling.stop or sampling.min_new_tokens):
        problems.append(
            "SGLangLaunchConfig.skip_tokenizer_init: SGLang then refuses SamplingParams.stop "
            "strings and min_new_tokens > 0; use stop_token_ids, or skip_tokenizer_init = False"
        )
    return problems
