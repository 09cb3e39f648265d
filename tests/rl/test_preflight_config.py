import socket

import pytest

from osworld_jax.env import PreflightError
from osworld_jax.errors import ConfigError
from osworld_jax.model.tiny import make_tiny_checkpoint
from osworld_jax.rl import ExperimentConfig, RLConfig, run_preflight
from osworld_jax.rl.config import ServerConfig
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


def test_preflight_r3_shape_must_match_the_model(tiny):
    exp = ExperimentConfig(
        server=ServerConfig(launch="embedded"),
        rollout=RolloutConfig(return_routed_experts=True, num_layers=48, num_experts_per_tok=8),
    )
    with pytest.raises(PreflightError, match=r"\(48, 8\).*\(3, 2\)"):
        run_preflight(exp, model_path=tiny, backend_preflight=lambda: None)
    no_routes = ExperimentConfig(
        server=ServerConfig(launch="embedded")
    )  # router_replay defaults on
    with pytest.raises(PreflightError, match="return_routed_experts"):
        run_preflight(no_routes, model_path=tiny, backend_preflight=lambda: None)
    ok = ExperimentConfig(
        server=ServerConfig(launch="embedded"),
        rollout=RolloutConfig(return_routed_experts=True, num_layers=3, num_experts_per_tok=2),
    )
    run_preflight(ok, model_path=tiny, backend_preflight=lambda: None)  # bundled tasks, tiny


def test_rl_config_validation():
    assert (
        RLConfig(num_prompts=8, num_owners=8, train_global_batch_size=64).num_logical_owners == 64
    )
    with pytest.raises(ConfigError, match="8 x 8 = 64"):
        RLConfig(num_prompts=8, num_owners=8, train_global_batch_size=32)
    with pytest.raises(ConfigError, match="RLConfig.estimator.*grpo"):
        RLConfig(estimator="ppo")
    with pytest.raises(ConfigError, match="num_owners"):
        RLConfig(num_owners=0)
    with pytest.raises(ConfigError, match="mesh"):
        RLConfig(mesh={"pipeline": 2})
    with pytest.raises(ConfigError, match="length_buckets"):
        RLConfig(length_buckets=(512, 256))
