import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from osworld_jax import config
from osworld_jax.agent import AgentConfig, CompactionConfig, GroupPolicyConfig
from osworld_jax.algorithms import LossConfig
from osworld_jax.data import DataConfig
from osworld_jax.env import AgentEnvConfig
from osworld_jax.env.local import LocalBackendConfig
from osworld_jax.env.osworld_adapter import OSWorldBackendConfig
from osworld_jax.env.remote import RemoteBackendConfig
from osworld_jax.errors import ConfigError
from osworld_jax.model import ModelRuntimeConfig
from osworld_jax.model.tiny import tiny_config
from osworld_jax.rl import ExperimentConfig, MeshConfig, ModelSourceConfig, RLConfig, ServerConfig
from osworld_jax.rollout import RolloutConfig, SamplingParams
from osworld_jax.trainer import CheckpointConfig, OptimizerConfig, TrainerConfig
from osworld_jax.trainer.distributed import DistributedConfig

CONFIGS = Path(config.CONFIGS_DIR)
# The seed's recipes: two alternatives (Dr.GRPO, REINFORCE baseline) of B8/N8 and B17/N16.
SEED_RECIPES = [
    f"osworld_flash_{size}_r3_{alt}.gin"
    for size in ("b8n8", "b17n16")
    for alt in ("dr_grpo", "reinforce")
]
RECIPES = ["default.gin", *SEED_RECIPES]
# The shared parts of the seed's recipes: they refuse to run without an estimator.
BASES = ["osworld_flash_b8n8_r3.gin", "osworld_flash_b17n16_r3.gin"]
FRAGMENTS = ["grpo.gin", "dr_grpo.gin", "reinforce_baseline.gin", "flash_reinforce.gin"]
FRAGMENTS += ["sglang_servers.gin"]  # tests/rl/test_servers.py
FRAGMENTS += ["text_only.gin"]
FRAGMENTS += ["gpu_1x_h200.gin", "gpu_1x_h100.gin"]  # tests/rl/test_gpu_recipe.py
# Mesh presets (tests/trainer/test_mesh_presets.py: each trains as one device does).
MESH_PRESETS = [f"mesh_{n}gpu.gin" for n in (1, 2, 4, 8)]
FRAGMENTS += MESH_PRESETS
# The recipe test swaps the real model and servers for tiny, embedded ones.
TINY = [
    "ModelSourceConfig.path = 'tiny'",
    "ServerConfig.launch = 'embedded'",
    "MeshConfig.fsdp = 1",
]


def test_every_gin_file_is_covered():
    assert sorted(p.name for p in CONFIGS.glob("*.gin")) == sorted(RECIPES + BASES + FRAGMENTS)


@pytest.mark.parametrize("preset", MESH_PRESETS)
def test_mesh_presets_override_a_recipes_mesh(preset):
    # A recipe then a preset: the preset's mesh replaces the recipe's (MeshConfig.fsdp = 8).
    exp = config.load_experiment([CONFIGS / SEED_RECIPES[0], CONFIGS / preset])
    n = int(preset.removeprefix("mesh_").removesuffix("gpu.gin"))
    axes = exp.rl.mesh.axes()
    assert np.prod(list(axes.values())) == n and exp.runtime.expert_parallel
    assert exp.rl.mesh.overlap == "none"  # "pipelined": no faster on 2 GPUs (docs/SCALE.md)
    assert exp.runtime.remat == "full"  # the rest of the recipe stays


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_build_with_tiny_model(recipe):
    exp = config.load_experiment([CONFIGS / recipe], TINY)
    assert isinstance(exp, ExperimentConfig)
    assert exp.model.path == "tiny" and exp.server.launch == "embedded"
    assert exp.trainer.router_replay and not exp.rollout.return_routed_experts  # derived:
    tiny = exp.rollout_for(tiny_config(1024, 0))  # R3 and the route shape from the model
    assert tiny.return_routed_experts and (tiny.num_layers, tiny.num_experts_per_tok) == (3, 2)
    assert exp.trainer.loss.gate == "binary_kl" and exp.trainer.loss.gate_threshold == 0.01
    assert exp.trainer.loss.agg_mode == "prompt-mean-token-mean"
    assert exp.rl.num_logical_owners == exp.rl.num_prompts * exp.rl.num_owners


def seed_recipe(size: str, alternative: str) -> ExperimentConfig:
    """Every field of a seed recipe, written out (the reference the gin files must build)."""
    b8 = size == "b8n8"
    urls = tuple(f"http://sglang-{i}:30000" for i in range(2 if b8 else 4))
    return ExperimentConfig(
        model=ModelSourceConfig(path="/checkpoints/Qwen3-VL-30B-A3B-Instruct"),
        runtime=ModelRuntimeConfig(
            dtype="bfloat16", expert_backend="auto", remat="full", scan_layers=True
        ),
        trainer=TrainerConfig(
            optimizer=OptimizerConfig(
                learning_rate=5e-6,
                weight_decay=0.01,
                max_grad_norm=1.0,
                warmup_steps=9,
                warmup_init_lr=0.0,
                schedule="constant",
                b1=0.9,
                b2=0.99,
                freeze_router=True,
                freeze_vision=True,
            ),
            checkpoint=CheckpointConfig(save_every=1, keep=2),
            loss=LossConfig(
                gate="binary_kl",
                gate_threshold=0.01,
                gate_level="sequence",
                agg_mode="prompt-mean-token-mean",
                ratio_clip=None,
            ),
            num_micro_batches=8 if b8 else 17,
            router_replay=True,
        ),
        rollout=RolloutConfig(
            urls=urls, sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=16384)
        ),
        server=ServerConfig(launch="none"),
        env=AgentEnvConfig(max_turns=150),
        sandbox=LocalBackendConfig(),
        agent=AgentConfig(
            max_screenshots=2,
            screenshots_after_compaction=None,
            max_active_images=10,
            protect_initial_observation=True,
            compaction=CompactionConfig(
                max_context_tokens=49152,
                reserved_generation_tokens=11152,
                every_k_actions=5,
                keep_last_observations=2,
            ),
        ),
        group=GroupPolicyConfig(min_healthy_per_group=2, baseline_population="all_owners"),
        data=DataConfig(task_set=f"/data/osworld/band_{size}"),
        rl=RLConfig(
            num_prompts=8 if b8 else 17,
            num_owners=8 if b8 else 16,
            steps=200,
            estimator={"dr_grpo": "dr_grpo", "reinforce": "reinforce_baseline"}[alternative],
            mesh=MeshConfig(fsdp=8),
            length_buckets=(8192, 16384, 32768, 49152),
            # the seed's "windowed sampler with staleness 1", its windows validated
            max_staleness=1,
            stale_owners="refuse",
            # no over-provisioning: every drawn group is trained (issue 29 item 3)
            extra_rollout_groups=0,
            min_groups_for_streaming_train=None,
        ),
        distributed=DistributedConfig(),
    )


@pytest.mark.parametrize("size", ["b8n8", "b17n16"])
@pytest.mark.parametrize("alternative", ["dr_grpo", "reinforce"])
def test_seed_recipes_field_by_field(size, alternative):
    exp = config.load_experiment([f"osworld_flash_{size}_r3_{alternative}.gin"])
    want = seed_recipe(size, alternative)
    assert dataclasses.asdict(exp) == dataclasses.asdict(want)  # every field of every room
    # The seed's defining choices, spelled out:
    assert (
        exp.rl.estimator == {"dr_grpo": "dr_grpo", "reinforce": "reinforce_baseline"}[alternative]
    )
    assert exp.group.baseline_population == "all_owners"
    loss = exp.trainer.loss
    assert (loss.gate, loss.gate_threshold, loss.gate_level) == ("binary_kl", 0.01, "sequence")
    assert loss.agg_mode == "prompt-mean-token-mean"
    assert exp.trainer.router_replay and exp.trainer.optimizer.learning_rate == 5e-6
    assert exp.rl.num_logical_owners == (64 if size == "b8n8" else 272)
    assert exp.logprob_temperature == 1.0


@pytest.mark.parametrize("base", BASES)
def test_a_recipe_without_an_estimator_refuses_to_run(base):
    msg = one_line_error([base])
    # The location is the binding (in the B8/N8 base, which the B17/N16 base includes).
    assert "osworld_flash_b8n8_r3.gin:" in msg and "RLConfig.estimator" in msg
    assert "dr_grpo" in msg and "reinforce" in msg


def test_an_included_recipe_logs_no_spurious_error(caplog):
    # gin looks an include up in every search path; a miss before the hit is not an error.
    with caplog.at_level(logging.DEBUG):
        for recipe in SEED_RECIPES:
            config.load_experiment([recipe])
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records
    assert not [r for r in caplog.records if "Path not found" in r.getMessage()]


def test_default_values():
    default = config.load_experiment(["default.gin"])
    assert (default.rl.num_prompts, default.rl.num_owners) == (2, 4)
    assert default.data.task_set == "bundled" and default.backend == "local"
    assert isinstance(default.sandbox, LocalBackendConfig)
    # The default run sees the screen: the tiny Qwen3-VL-MoE, the last 3 screenshots.
    assert default.model.tiny_kind == "qwen3_vl_moe" and default.agent.max_screenshots == 3
    text = config.load_experiment(["default.gin", "text_only.gin"])
    assert text.model.tiny_kind == "qwen3_moe" and text.agent.max_screenshots == 0
    assert dataclasses.replace(text, model=default.model, agent=default.agent) == default


@pytest.mark.parametrize(
    "fragment,estimator",
    [
        ("grpo.gin", "grpo"),
        ("dr_grpo.gin", "dr_grpo"),
        ("reinforce_baseline.gin", "reinforce_baseline"),
        ("flash_reinforce.gin", "batch_mean"),
    ],
)
def test_fragments_override_the_recipe(fragment, estimator):
    exp = config.load_experiment(["osworld_flash_b8n8_r3.gin", fragment], TINY)
    assert exp.rl.estimator == estimator
    assert exp.rl.num_prompts == 8  # the rest of the recipe is kept


def test_later_files_and_params_override(tmp_path):
    a, b = tmp_path / "a.gin", tmp_path / "b.gin"
    a.write_text("RLConfig.steps = 5\nRLConfig.num_owners = 2\n")
    b.write_text("RLConfig.steps = 7\n")
    exp = config.load_experiment([a, b], ["RLConfig.num_owners = 3"])
    assert (exp.rl.steps, exp.rl.num_owners) == (7, 3)


def test_nested_configs_are_built_from_their_own_bindings():
    exp = config.load_experiment(
        [],
        [
            "SamplingParams.temperature = 0.25",
            "OptimizerConfig.learning_rate = 0.5",
            "CompactionConfig.every_k_actions = 3",
        ],
    )
    assert exp.rollout.sampling.temperature == 0.25
    assert exp.trainer.optimizer.learning_rate == 0.5
    assert exp.agent.compaction.every_k_actions == 3


def one_line_error(files, params=()):
    with pytest.raises(ConfigError) as info:
        config.load_experiment(files, params)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def test_unknown_field_names_file_line_and_binding(tmp_path):
    f = tmp_path / "typo.gin"
    f.write_text("RLConfig.steps = 2\n\nRLConfig.num_promts = 8\n")
    msg = one_line_error([f])
    assert f"{f}:3" in msg and "RLConfig.num_promts = 8" in msg and "num_promts" in msg


def test_unknown_class_names_file_and_binding(tmp_path):
    f = tmp_path / "typo.gin"
    f.write_text("RLConfg.steps = 2\n")
    msg = one_line_error([f])
    assert f"{f}:1" in msg and "RLConfg" in msg


def test_bad_param_names_the_param():
    msg = one_line_error([], ["RLConfig.stepz = 2"])
    assert "--gin_param[0]" in msg and "stepz" in msg


def test_syntax_error_names_the_file(tmp_path):
    f = tmp_path / "bad.gin"
    f.write_text("RLConfig.steps = \n")
    assert str(f) in one_line_error([f])


def test_wrong_type_names_file_line_and_binding(tmp_path):
    f = tmp_path / "t.gin"
    f.write_text("# comment\nRLConfig.num_prompts = 'eight'\n")
    msg = one_line_error([f])
    assert f"{f}:2" in msg and "RLConfig.num_prompts = 'eight'" in msg and "int" in msg


def test_validation_error_names_the_binding_location(tmp_path):
    f = tmp_path / "v.gin"
    f.write_text("RLConfig.num_prompts = 2\nRLConfig.estimator = 'ppo'\n")
    msg = one_line_error([f])
    assert f"{f}:2" in msg and "RLConfig.estimator" in msg and "grpo" in msg  # lists choices
    g = tmp_path / "r3.gin"
    g.write_text(
        "RolloutConfig.num_layers = 3\nRolloutConfig.return_routed_experts = True\n"
        "RolloutConfig.num_experts_per_tok = 2\n"
    )
    msg = one_line_error([g])  # R3 is switched on in one place: TrainerConfig.router_replay
    assert f"{g}:2" in msg and "TrainerConfig.router_replay" in msg
    msg = one_line_error([], ["MeshConfig.fsdp = 0"])
    assert "--gin_param[0]:1" in msg and "MeshConfig.fsdp" in msg


def test_missing_file():
    assert "nope.gin" in one_line_error(["nope.gin"])


def test_operative_config_written(tmp_path):
    exp = config.load_experiment(["default.gin"], ["RLConfig.steps = 9"])
    path = config.write_operative_config(tmp_path, exp)
    text = path.read_text()
    assert "RLConfig.steps = 9" in text and "SamplingParams.max_new_tokens = 24" in text
    resolved = json.loads((tmp_path / config.RESOLVED_CONFIG_NAME).read_text())
    assert resolved["rl"]["steps"] == 9 and resolved["rollout"]["sampling"]["max_new_tokens"] == 24


def test_facts_stated_in_one_place_only():
    # The action space is the env's (the prompt describes what the parser accepts).
    assert "action_space" in one_line_error([], ["AgentConfig.action_space = 'computer_13'"])
    exp = config.load_experiment([], ["AgentEnvConfig.action_space = 'computer_13'"])
    assert exp.env.action_space == "computer_13"
    # One knob with one legal value is gone.
    assert "train_global_batch_size" in one_line_error([], ["RLConfig.train_global_batch_size = 8"])
    for derived in ("num_layers = 48", "num_experts_per_tok = 8"):
        assert "config.json" in one_line_error([], [f"RolloutConfig.{derived}"])


def test_sandbox_backend_and_its_settings_are_one_field(tmp_path):
    gin_file = tmp_path / "remote.gin"
    gin_file.write_text(
        "ExperimentConfig.sandbox = @RemoteBackendConfig()\n"
        'RemoteBackendConfig.base_url = "https://sandboxes.example:8443"\n'
        'RemoteBackendConfig.ca_bundle = "/etc/osworld/ca.pem"\n'
        'RemoteBackendConfig.cache_dir = "/srv/cache"\n'
    )
    exp = config.load_experiment(["default.gin", gin_file])
    assert exp.backend == "remote" and isinstance(exp.sandbox, RemoteBackendConfig)
    assert exp.sandbox.base_url == "https://sandboxes.example:8443"
    assert exp.sandbox.ca_bundle == "/etc/osworld/ca.pem" and exp.cache_dir == "/srv/cache"
    osw = config.load_experiment([], ["ExperimentConfig.sandbox = @OSWorldBackendConfig()"])
    assert osw.backend == "osworld" and isinstance(osw.sandbox, OSWorldBackendConfig)
    assert osw.sandbox.provider_name == "docker"
    # An unbound sandbox is the local backend, built from its own bindings.
    local = config.load_experiment([], ["LocalBackendConfig.cache_dir = '/tmp/c'"])
    assert local.backend == "local" and local.cache_dir == "/tmp/c"
    assert config.load_experiment([], ["ExperimentConfig.sandbox = 'memory'"]).backend == "memory"


def test_sandbox_errors_are_one_line():
    msg = one_line_error([], ["ExperimentConfig.sandbox = 'nope'"])
    assert "--gin_param[0]:1" in msg and "ExperimentConfig.sandbox" in msg and "local" in msg
    msg = one_line_error([], ["ExperimentConfig.sandbox = @RemoteBackendConfig()"])
    assert "base_url" in msg and "ca_bundle" in msg
