"""The one-GPU recipes (configs/gpu_1x_h100.gin, and configs/gpu_1x_h200.gin: the H100's run
with 5 text layers) built and validated on the CPU: preflight, the server's and the train step's
memory against their shares of the GPU, what a split that cannot fit names, and how each process
gets its share of the device. The recipes run the server inside the trainer's process
(``ServerConfig.launch = 'colocated'``); `EMBEDDED` turns the H200 recipe back into a server of
its own process beside the trainer (``launch = 'embedded'``), which stays supported."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import jax
import pytest

from osworld_jax import config
from osworld_jax.contract.errors import EngineError
from osworld_jax.errors import ConfigError
from osworld_jax.model import Qwen3MoeConfig
from osworld_jax.model.serving import CacheLayout, GiB, cache_layout, server_memory
from osworld_jax.rl import servers
from osworld_jax.rl.config import ServerConfig
from osworld_jax.rl.servers import (
    MEM_FRACTION_ENV,
    embedded_server_memory,
    memory_shares,
    process_share,
    server_group,
)
from osworld_jax.rl.validate import validate
from osworld_jax.server.colocated import ColocatedServer
from osworld_jax.trainer import TrainerError
from tests.rl.runs import REPO

GPU = "gpu_1x_h200.gin"
SEED = "osworld_flash_b8n8_r3_dr_grpo.gin"
# The H200 recipe with its server in a process of its own (python -m osworld_jax.server.serve):
# each process preallocates its own share of the GPU, the server 25% and the trainer the rest
# less the 5% margin (70%). Its refit goes through the disk: an exported HF checkpoint a step,
# ~8.5 GB; beside the base model (~8.5 GB) and a checkpoint (~46 GB) the H200's 64 GiB disk
# holds one, not the default two.
EMBEDDED = [
    "ServerConfig.launch = 'embedded'",
    "ServerConfig.device_memory_fraction = 0.25",
    "RLConfig.weights_keep = 1",
]
# KV cache of one 16,384-token slot at 5 layers, bf16: 2 (k, v) x 5 x 16,384 x 4 heads x 128 x 2 B
KV_SLOT = 2 * 5 * 16384 * 4 * 128 * 2


def _lines(files, params=()):
    return validate(config.load_experiment(files, params))


def _trainer_share(params=()):
    """The memory fraction the trainer's process sets before jax starts its backend (in a fresh
    process: ``share_devices`` refuses once a GPU backend started)."""  # noqa: D205, D209
    code = (
        "import os\n"
        "from osworld_jax import config\n"
        "from osworld_jax.rl.servers import share_devices\n"
        f"share_devices(config.load_experiment([{GPU!r}], {list(params)!r}))\n"
        f"print(os.environ[{MEM_FRACTION_ENV!r}])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != MEM_FRACTION_ENV}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_the_h200_recipe_is_the_h100_run_with_5_layers_and_fits_141_gb_by_its_estimate():
    exp = config.load_experiment([GPU])
    assert exp.server.launch == "colocated" and exp.server.refits_in_memory
    assert exp.trainer.master_dtype == "float32"  # as on the H100
    assert exp.trainer.optimizer.freeze_router and exp.trainer.optimizer.freeze_vision
    assert process_share(exp.server) == 0.95  # one pool: the server's share is a budget in it
    assert memory_shares(exp.server) == (0.15, 0.8)
    h100 = config.load_experiment(["gpu_1x_h100.gin"])
    assert (exp.rl.steps, exp.rl.length_buckets) == (h100.rl.steps, h100.rl.length_buckets)
    assert exp.rollout.sampling.max_new_tokens == h100.rollout.sampling.max_new_tokens == 256
    assert exp.server.max_running_requests == h100.server.max_running_requests == 16
    lines = _lines([GPU])
    assert lines[0] == "model: a random model the run builds (5 layers, 128 experts)"
    assert lines[1] == "preflight: ok (sandbox backend 'local', task set 'bundled')"
    # Hand-derived: KV = 16 slots x KV_SLOT = 2 x 5 x 16 x 16,384 x 4 x 128 x 2 B
    assert 16 * KV_SLOT / GiB == 2.5
    assert lines[2].startswith("memory: the embedded server needs ~")
    assert "KV cache 2.5) of its 21.0 GiB" in lines[2]  # 0.15 x 139.8 GiB
    assert lines[3].startswith("memory: one train step of 8 rows x 16384 tokens (24480 image")
    # The step is checked against the pool (0.95) less the server's budget (0.15): 0.80 x 139.8
    assert lines[3].endswith(" of 111.8 GiB per device (of 1)")


def test_the_h100_recipe_colocates_the_server_and_fits_80_gb_by_its_estimate():
    exp = config.load_experiment(["gpu_1x_h100.gin"])
    assert exp.server.launch == "colocated" and exp.server.refits_in_memory
    assert exp.trainer.master_dtype == "float32"  # bf16 masters lose every LR 5e-6 update
    assert exp.trainer.optimizer.freeze_router and exp.trainer.optimizer.freeze_vision
    assert process_share(exp.server) == 0.95  # one pool: the server's share is a budget in it
    lines = _lines(["gpu_1x_h100.gin"])
    assert lines[0] == "model: a random model the run builds (2 layers, 128 experts)"
    # Hand-derived: KV = 2 (k, v) x 2 layers x 16 slots x 16,384 tokens x 4 heads x 128 x 2 B
    assert exp.server.max_running_requests == 16  # two steps' owners (k = 1) keep their slots
    assert 2 * 2 * 16 * 16384 * 4 * 128 * 2 / GiB == 1.0
    assert "KV cache 1.0) of its 15.8 GiB" in lines[2]  # 0.2 x 79.1 GiB
    assert lines[3].endswith(" of 59.3 GiB per device (of 1)")  # 0.75 x 79.1 GiB


def test_with_its_server_in_a_process_of_its_own_both_shares_are_checked():
    exp = config.load_experiment([GPU], EMBEDDED)
    assert exp.server.launch == "embedded" and not exp.server.refits_in_memory  # disk refit
    assert process_share(exp.server) == 0.7  # two pools: each process preallocates its own
    lines = _lines([GPU], EMBEDDED)
    assert lines[0] == "model: a random model the run builds (5 layers, 128 experts)"
    assert lines[1] == "preflight: ok (sandbox backend 'local', task set 'bundled')"
    # the same server (weights twice for a refit, 16 slots: KV 2.5 GiB) in a larger share
    assert "KV cache 2.5) of its 35.0 GiB" in lines[2]  # 0.25 x 139.8 GiB
    assert lines[3].startswith("memory: one train step of 8 rows x 16384 tokens (24480 image")
    assert lines[3].endswith(" of 97.9 GiB per device (of 1)")  # 0.70 x 139.8 GiB
    step = lines[3].removesuffix(" of 97.9 GiB per device (of 1)")  # "... needs ~88.2 GiB"
    assert _lines([GPU])[3].startswith(step)  # the same step, checked against less room


def test_after_a_seed_recipe_it_keeps_the_recipes_algorithm_on_one_gpu():
    exp = config.load_experiment([SEED, GPU])
    assert exp.rl.estimator == "dr_grpo" and exp.trainer.router_replay
    t = exp.trainer
    assert t.optimizer.learning_rate == 5e-6 and t.loss.gate == "binary_kl"
    assert t.loss.gate_threshold == 0.01 and t.loss.agg_mode == "prompt-mean-token-mean"
    assert exp.rl.mesh.axes() == dict(data=1, fsdp=1, expert=1, tensor=1)
    # the seed's external servers ('none') give way to the one-GPU server in the trainer
    assert (exp.server.launch, exp.model.path) == ("colocated", "tiny")
    assert exp.server.refits_in_memory and t.master_dtype == "float32"
    # The seed's freezing (router, vision tower) is the H200 recipe's own, and the memory plan
    # counts it: training the tower too (float32 master, moments, gradient) needs ~98.6 GiB.
    assert t.optimizer.freeze_router and t.optimizer.freeze_vision
    unfrozen = ["OptimizerConfig.freeze_router = False", "OptimizerConfig.freeze_vision = False"]
    assert _lines([SEED, GPU])[2:4] == _lines([GPU])[2:4]
    assert _lines([SEED, GPU])[3] != _lines([GPU], unfrozen)[3]


def test_a_split_that_cannot_fit_fails_before_compiling_naming_what_to_change():
    # Half the device to the server leaves the trainer 0.45 (62.9 GiB) for its ~88.2 GiB step,
    # whether the server shares the trainer's pool (the recipe) or has its own process.
    for params in ([], EMBEDDED):
        with pytest.raises(TrainerError, match=r"ServerConfig\.device_memory_fraction = 0\.5 lea"):
            _lines([GPU], [*params, "ServerConfig.device_memory_fraction = 0.5"])
    # 64 slots: KV = 64 x KV_SLOT = 10.0 GiB; with the weights twice (2 x 8.0) over the recipe's
    # 21.0 GiB (0.15 x 139.8)
    assert 64 * KV_SLOT / GiB == 10.0
    with pytest.raises(ConfigError) as e:
        _lines([GPU], ["ServerConfig.max_running_requests = 64"])
    msg = str(e.value)
    assert "KV cache 10.0) of the 21.0 GiB" in msg and "max_running_requests" in msg, msg
    assert "--context-length" in msg and "dtype = 'bfloat16'" not in msg  # already bfloat16
    # A server process of its own at 0.25 (35.0 GiB) holds 64 slots, not 256: KV 40.0 GiB alone
    _lines([GPU], [*EMBEDDED, "ServerConfig.max_running_requests = 64"])
    assert 256 * KV_SLOT / GiB == 40.0
    with pytest.raises(ConfigError, match=r"KV cache 40\.0\) of the 35\.0 GiB"):
        _lines([GPU], [*EMBEDDED, "ServerConfig.max_running_requests = 256"])
    with pytest.raises(ConfigError, match="launch is 'none'"):
        ServerConfig(launch="none", device_memory_fraction=0.25)
    with pytest.raises(ConfigError, match=r"\[0\.02, 0\.9\]"):
        ServerConfig(launch="embedded", device_memory_fraction=0.95)


def test_a_server_process_of_its_own_and_the_trainer_each_get_their_share(tmp_path):
    exp = config.load_experiment([GPU], EMBEDDED)
    assert memory_shares(exp.server) == (0.25, 0.7)
    server = server_group(exp, tmp_path / "model", tmp_path).servers[0]
    assert server.env[MEM_FRACTION_ENV] == "0.25"
    # The trainer's process sets its own before jax starts its backend (a fresh process).
    assert _trainer_share(EMBEDDED) == "0.7"


def test_the_colocated_server_gets_a_budget_in_the_trainers_pool(tmp_path, monkeypatch):
    exp = config.load_experiment([GPU])
    assert memory_shares(exp.server) == (0.15, 0.8)
    monkeypatch.setattr(servers, "device_total", lambda: 139.8 * GiB)  # what an H200 reports
    server = server_group(exp, tmp_path / "model", tmp_path).servers[0]
    assert isinstance(server, ColocatedServer)  # a thread of the trainer's process
    assert server.memory_budget_bytes == pytest.approx(0.15 * 139.8 * GiB)  # 21.0 GiB
    # one pool for both: the trainer's process preallocates the device less the margin
    assert _trainer_share() == "0.95"


def test_the_engine_refuses_a_cache_its_device_share_cannot_hold(monkeypatch):
    from osworld_jax.server.memory import check_fits

    model = Qwen3MoeConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    layout = cache_layout(
        model, max_running_requests=5, context_length=3000, max_total_tokens=None, min_bucket=16
    )
    assert layout == CacheLayout(context_length=3000, slots=8, slot_len=4096)
    mem = server_memory(model, layout, "float32")
    assert mem.kv_cache == 2 * 2 * 8 * 4096 * 2 * 16 * 4  # k/v x layers x slots x len x KV x D
    device = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": mem.total - 1})
    monkeypatch.setattr(jax, "local_devices", lambda: [device])
    with pytest.raises(EngineError, match=r"8 slots x 4096 tokens.*--max-running-requests"):
        check_fits(model, layout, "float32")
    device.memory_stats = lambda: {"bytes_limit": mem.total}
    check_fits(model, layout, "float32")  # exactly fits
    device.memory_stats = lambda: None  # the CPU reports no limit: nothing to check
    check_fits(model, layout, "float32")


def test_the_server_estimate_parses_the_servers_own_flags():
    flags = "('--context-length', '8192', '--max-total-tokens', '20000')"
    exp = config.load_experiment([GPU], [f"ServerConfig.extra_args = {flags}"])
    # the flags the server gets, whether on a thread of the trainer's process (the recipe's
    # 'colocated') or in a process of its own ('embedded')
    model = Qwen3MoeConfig.from_hf_dict(  # the recipe's text model
        {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
         "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 5,
         "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
         "num_experts": 128, "num_experts_per_tok": 8}
    )  # fmt: skip
    mem = embedded_server_memory(exp, model)
    # --max-total-tokens 20000 // 8192 = 2 slots of 8192 tokens, bf16:
    # 2 (k, v) x 5 layers x 2 slots x 8,192 tokens x 4 KV heads x 128 x 2 B = 0.3125 GiB
    assert mem.kv_cache == 2 * 5 * 2 * 8192 * 4 * 128 * 2


def test_the_trainer_and_its_server_share_a_persistent_compilation_cache(tmp_path, monkeypatch):
    cache = tmp_path / "xla"
    named = [f"RLConfig.compilation_cache_dir = '{cache}'"]
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # cache even a tiny program
    code = (
        "import jax, jax.numpy as jnp\n"
        "from osworld_jax import config\n"
        "from osworld_jax.rl.servers import use_compilation_cache\n"
        f"use_compilation_cache(config.load_experiment([{GPU!r}], "
        f"[\"RLConfig.compilation_cache_dir = '{cache}'\"]))\n"
        "print(jax.jit(lambda x: x * 2 + 1)(jnp.arange(3.0)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert any(cache.iterdir()), "nothing written to the compilation cache"
    # The recipe's colocated server compiles in the trainer's process, with this jax config. A
    # server in a process of its own compiles into the same directory, named in its environment;
    # a cache named by the environment (as this suite's) wins over the config's.
    exp = config.load_experiment([GPU], [*EMBEDDED, *named])
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    server = server_group(exp, tmp_path / "model", tmp_path).servers[0]
    assert server.env["JAX_COMPILATION_CACHE_DIR"] == str(cache)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    server = server_group(exp, tmp_path / "model", tmp_path).servers[0]
    assert server.env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "env")
