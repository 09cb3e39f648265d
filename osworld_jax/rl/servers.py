"""The rollout servers a run starts (``ServerConfig.launch``) and their preflight checks.

``embedded`` starts one ``python -m osworld_jax.server.serve``; ``sglang`` starts
``ServerConfig.sglang.num_servers`` real SGLang servers (``python -m sglang.launch_server``, as
verl and slime do). Either way the run waits until they serve, points the client at them and
stops them (their whole process groups) when it ends.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from osworld_jax.rl.config import ExperimentConfig
from osworld_jax.rollout.launch import EmbeddedServer, ServerGroup, SGLangServer


def server_group(exp: ExperimentConfig, model_path: str | Path, run_dir: Path) -> ServerGroup:
    """The unstarted `ServerGroup` of ``exp.server`` (``launch`` must not be ``none``).

    Logs go to ``run_dir/server.log`` (embedded) or ``run_dir/sglang_<i>.log``.
    """
    s = exp.server
    routes = exp.trainer.router_replay  # R3: the servers return the routes the trainer replays
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
            env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "0"},
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
