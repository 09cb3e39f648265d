"""``ServerConfig.launch = 'sglang'``: the run starts real SGLang servers, waits, stops them.

The command line is checked flag by flag against SGLang 0.5.23's own parser facts (recorded
below from ``python/sglang/srt/server_args.py``; when ``sglang`` imports here, its parser is
run on it too). The process life cycle runs against ``tests/rl/fake_sglang`` (a stand-in
``sglang.launch_server`` that forks a child like SGLang's scheduler), so no GPU is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from osworld_jax import config
from osworld_jax.errors import ConfigError
from osworld_jax.model import Qwen3MoeConfig
from osworld_jax.rl.config import ExperimentConfig, ModelSourceConfig, ServerConfig
from osworld_jax.rl.servers import server_group, server_problems
from osworld_jax.rollout import (
    EngineError,
    RolloutConfig,
    SamplingParams,
    SGLangClient,
    SGLangLaunchConfig,
)
from osworld_jax.rollout.launch import sglang_command

FAKE = Path(__file__).parent / "fake_sglang"
CONFIGS = Path(config.CONFIGS_DIR)

# SGLang 0.5.23 ``ServerArgs.add_cli_args``: flag -> value type ("flag" = store_true).
SGLANG_0_5_FLAGS: dict[str, object] = {
    "--model-path": str, "--host": str, "--port": int, "--tp-size": int, "--dp-size": int,
    "--ep-size": int, "--base-gpu-id": int, "--random-seed": int, "--max-running-requests": int,
    "--context-length": int, "--mem-fraction-static": float, "--weight-version": str,
    "--dtype": ("auto", "half", "float16", "bfloat16", "float", "float32"),
    "--skip-server-warmup": "flag", "--skip-tokenizer-init": "flag",
    "--enable-return-routed-experts": "flag", "--trust-remote-code": "flag",
    "--served-model-name": str, "--log-level": str,
}  # fmt: skip


def check_against_sglang_flags(argv: list[str]) -> None:
    """Every flag is one of SGLang 0.5.x's, with a value of its type (or none for a switch)."""
    i = 0
    while i < len(argv):
        flag = argv[i]
        assert flag in SGLANG_0_5_FLAGS, f"{flag} is not an SGLang 0.5.23 flag"
        kind = SGLANG_0_5_FLAGS[flag]
        if kind == "flag":
            i += 1
            continue
        value = argv[i + 1]
        assert not value.startswith("--"), f"{flag} needs a value"
        if isinstance(kind, tuple):
            assert value in kind, f"{flag} {value} not in {kind}"
        else:
            kind(value)  # type: ignore[operator]
        i += 2


def test_command_line_is_sglangs():
    cfg = SGLangLaunchConfig(
        num_servers=2, tp_size=2, dp_size=2, ep_size=4, base_gpu_id=1, random_seed=7,
        context_length=4096, mem_fraction_static=0.85, extra_args=("--log-level", "warning"),
    )  # fmt: skip
    cmd = sglang_command(
        "/ckpt", cfg, host="10.0.0.2", port=30001, index=1, max_running_requests=32,
        dtype="bfloat16", weight_version="step3", enable_return_routed_experts=True,
    )  # fmt: skip
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    argv = cmd[3:]
    assert argv == [
        "--model-path", "/ckpt", "--host", "10.0.0.2", "--port", "30001", "--tp-size", "2",
        "--base-gpu-id", "5", "--random-seed", "8", "--skip-server-warmup", "--dp-size", "2",
        "--ep-size", "4", "--skip-tokenizer-init", "--enable-return-routed-experts",
        "--max-running-requests", "32", "--dtype", "bfloat16", "--weight-version", "step3",
        "--context-length", "4096", "--mem-fraction-static", "0.85", "--log-level", "warning",
    ]  # fmt: skip
    check_against_sglang_flags(argv)
    if importlib.util.find_spec("sglang") is not None:  # SGLang's own parser, when installed
        from sglang.srt.server_args import ServerArgs

        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        ns = parser.parse_args(argv)
        assert (ns.tp_size, ns.base_gpu_id, ns.skip_tokenizer_init) == (2, 5, True)
    # defaults: one GPU, no dp / ep flags
    plain = sglang_command("/ckpt", SGLangLaunchConfig(skip_tokenizer_init=False), host="h", port=1)
    assert "--dp-size" not in plain and "--skip-tokenizer-init" not in plain
    check_against_sglang_flags(plain[3:])


def test_config_validation():
    with pytest.raises(ConfigError, match="ServerConfig.launch: unknown server launcher 'vllm'"):
        ServerConfig(launch="vllm")
    with pytest.raises(ConfigError, match="SGLangLaunchConfig.tp_size must be >= 1"):
        SGLangLaunchConfig(tp_size=0)


def test_fragment_starts_two_sglang_servers(tmp_path):
    exp = config.load_experiment(
        [CONFIGS / "osworld_flash_b8n8_r3_dr_grpo.gin", CONFIGS / "sglang_servers.gin"]
    )
    assert exp.server.launch == "sglang" and exp.server.sglang.num_servers == 2
    group = server_group(exp, "/ckpt", tmp_path)
    assert group.urls == ("http://127.0.0.1:30000", "http://127.0.0.1:30001")
    for i, server in enumerate(group.servers):
        argv = server.cmd[3:]
        check_against_sglang_flags(argv)
        assert argv[argv.index("--base-gpu-id") + 1] == str(4 * i)
        assert "--enable-return-routed-experts" in argv  # the recipe trains with R3
        assert server.env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "0"
        assert server.log_path == tmp_path / f"sglang_{i}.log"


def _experiment(tiny: Path, **sglang) -> ExperimentConfig:
    return ExperimentConfig(
        model=ModelSourceConfig(path=str(tiny)),
        server=ServerConfig(
            launch="sglang",
            startup_timeout_s=60,
            return_original_logprob=True,
            sglang=SGLangLaunchConfig(python=sys.executable, num_servers=2, **sglang),
        ),
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def _all_gone(pids: list[int], within_s: float = 5.0) -> bool:
    """SIGKILL is delivered asynchronously: allow it a moment."""
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _pids(log: Path) -> list[int]:
    return [int(p) for p in re.findall(r"scheduler pid (\d+)", log.read_text())]


@pytest.fixture
def fake_sglang(monkeypatch):
    path = os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)


def test_run_starts_waits_for_and_stops_sglang_servers(fake_sglang, tmp_path):
    from osworld_jax.agent import AgentTokenizer
    from osworld_jax.model.tiny import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    exp = _experiment(tiny)
    assert server_problems(exp) == []  # sglang imports in the servers' interpreter
    tok = AgentTokenizer.from_model_dir(tiny)
    with server_group(exp, tiny, tmp_path) as group:
        children = [p for s in group.servers for p in _pids(s.log_path)]
        assert len(children) == 2 and all(_alive(p) for p in children)
        info = json.loads(urllib.request.urlopen(group.urls[1] + "/server_info").read())
        assert info["skip_tokenizer_init"] and info["enable_return_routed_experts"]
        assert info["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"

        async def main():
            cfg = exp.rollout_for(Qwen3MoeConfig.from_json(tiny / "config.json"))  # R3 shape
            async with SGLangClient(group.urls, cfg, detokenize=tok.decode) as client:
                return await asyncio.gather(
                    *(
                        client.generate([5, 6, 7], SamplingParams(max_new_tokens=4))
                        for _ in range(4)
                    )
                )

        gens = asyncio.run(main())
        for g in gens:  # token-only replies: the client decoded the text
            assert g.output_ids == [10 + (5 * i + 3) % 100 for i in range(4)]
            assert g.text == tok.decode(g.output_ids) != ""
            assert g.routed_experts.shape == (3 + 4 - 1, 3, 2)
        procs = [s.process for s in group.servers]
    assert all(p is not None and p.poll() is not None for p in procs)
    assert _all_gone(children)  # the process groups are gone


def test_a_server_that_fails_to_start_stops_the_group(fake_sglang, tmp_path):
    from osworld_jax.model.tiny import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    exp = _experiment(tiny, base_gpu_id=63)  # server 1 gets GPU 64: "invalid device ordinal"
    group = server_group(exp, tiny, tmp_path)
    want = r"(?s)SGLang server 1 .* exited with 1:\n.*invalid device"
    with pytest.raises(EngineError, match=want):
        group.start()
    assert all(s.process is None for s in group.servers)
    assert _all_gone(_pids(tmp_path / "sglang_0.log"))


def test_preflight_names_what_sglang_cannot_do(tmp_path):
    exp = _experiment(tmp_path)
    exp = exp.replace(
        server=ServerConfig(
            launch="sglang", sglang=SGLangLaunchConfig(python=str(tmp_path / "no-python"))
        ),
        rollout=RolloutConfig(sampling=SamplingParams(stop=("</action>",))),
    )
    problems = server_problems(exp)
    assert len(problems) == 2
    assert "cannot import sglang" in problems[0] and "osworld_jax[sglang]" in problems[0]
    assert "stop" in problems[1] and "skip_tokenizer_init" in problems[1]
