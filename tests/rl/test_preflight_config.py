import dataclasses
import socket

import pytest

from osworld_jax.env import PreflightError
from osworld_jax.errors import ConfigError
from osworld_jax.model import Qwen3MoeConfig
from osworld_jax.model.tiny import make_tiny_checkpoint
from osworld_jax.rl import ExperimentConfig, RLConfig, run_preflight
from osworld_jax.rl.config import MeshConfig, ServerConfig
from osworld_jax.rollout import RolloutConfig


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny")


def fail_backend():
    raise PreflightError("bwrap not found on PATH")


def test_preflight_lists_every_missing_part(tmp_path):
    empty = tmp_path / "tasks"
    empty.mkdir()
    url = f"http://127.0.0.1:{closed_port()}"
    exp = ExperimentConfig(
        rollout=RolloutConfig(urls=(url,), connect_timeout_s=2.0),
    )
    exp = exp.replace(data=exp.data.__class__(task_set=str(empty)))
    with pytest.raises(PreflightError) as info:
        run_preflight(exp, model_path=tmp_path / "no-model", backend_preflight=fail_backend)
    lines = str(info.value).splitlines()[1:]
    assert len(lines) == 4, lines
    assert "no-model" in lines[0] and "does not exist" in lines[0]
    assert url in lines[1] and "unreachable" in lines[1]
    assert "bwrap not found" in lines[2] and "'local'" in lines[2]
    assert "empty" in lines[3] and "DataConfig.task_set" in lines[3]


def test_r3_route_shape_comes_from_the_model(tiny):
    # Stating the route shape (or the R3 switch) on the rollout side is refused: one place.
    with pytest.raises(ConfigError, match="RolloutConfig.return_routed_experts.*router_replay"):
        ExperimentConfig(
            rollout=RolloutConfig(return_routed_experts=True, num_layers=48, num_experts_per_tok=8)
        )
    exp = ExperimentConfig(server=ServerConfig(launch="embedded"))  # router_replay defaults on
    run_preflight(exp, model_path=tiny, backend_preflight=lambda: None)  # bundled tasks, tiny
    rollout = exp.rollout_for(Qwen3MoeConfig.from_json(tiny / "config.json"))
    assert rollout.return_routed_experts and (rollout.num_layers, rollout.num_experts_per_tok) == (
        3,
        2,
    )
    off = exp.replace(trainer=dataclasses.replace(exp.trainer, router_replay=False))
    assert not off.rollout_for(Qwen3MoeConfig.from_json(tiny / "config.json")).return_routed_experts


def test_rl_config_validation():
    assert RLConfig(num_prompts=8, num_owners=8).num_logical_owners == 64
    with pytest.raises(ConfigError, match="RLConfig.estimator.*grpo"):
        RLConfig(estimator="ppo")
    with pytest.raises(ConfigError, match="num_owners"):
        RLConfig(num_owners=0)
    with pytest.raises(TypeError, match="pipeline"):
        MeshConfig(pipeline=2)
    with pytest.raises(ConfigError, match="MeshConfig.tensor"):
        MeshConfig(tensor=0)
    with pytest.raises(ConfigError, match="length_buckets"):
        RLConfig(length_buckets=(512, 256))


def test_a_relative_sandbox_root_is_one_config_line_before_anything_starts():
    """It passed preflight and --validate_only, then failed at the first sandbox."""
    from osworld_jax import config as gin_config

    for param, field in (
        ("LocalBackendConfig.root = 'sandboxes'", "root must be an absolute path"),
        ("LocalBackendConfig.extra_ro_binds = ('opt/app',)", "extra_ro_binds must hold absolute"),
    ):
        with pytest.raises(ConfigError) as refused:
            gin_config.load_experiment(["default.gin"], [param])
        line = str(refused.value)
        assert "\n" not in line and f"LocalBackendConfig.{field}" in line
