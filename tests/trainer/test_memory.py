"""The train-step memory estimate and the check that fails before compiling."""

from __future__ import annotations

import dataclasses
import math

import pytest

from osworld_jax.model import ModelRuntimeConfig, Qwen3MoeConfig
from osworld_jax.model.params import param_specs
from osworld_jax.trainer import Trainer, TrainerConfig
from osworld_jax.trainer.memory import GiB, check_step_fits, estimate_step_memory
from osworld_jax.trainer.state import TrainerError
from tests.trainer import _tiny

# The issue-19 case: 8 layers, 128 experts top-8, hidden 2048 (about 5 B parameters).
MID = Qwen3MoeConfig(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
)
BF16 = ModelRuntimeConfig(dtype="bfloat16", remat="full")
H200 = 139.8 * GiB


def test_state_terms_are_parameter_count_times_dtype_bytes():
    n = sum(math.prod(s.shape) for s in param_specs(MID).values())
    f32 = estimate_step_memory(MID, BF16, TrainerConfig(), rows=8, seq=320)
    assert (f32.params, f32.moments, f32.compute_copy, f32.grads) == (4 * n, 8 * n, 2 * n, 2 * n)
    acc = estimate_step_memory(MID, BF16, TrainerConfig(num_micro_batches=8), rows=64, seq=320)
    assert acc.grads == 2 * n + 4 * n  # + the float32 accumulator
    bf = estimate_step_memory(MID, BF16, TrainerConfig(master_dtype=None), rows=8, seq=320)
    assert (bf.params, bf.moments, bf.compute_copy) == (2 * n, 4 * n, 0)
    sharded = estimate_step_memory(MID, BF16, TrainerConfig(), rows=8, seq=320, param_shards=4)
    assert sharded.params == f32.params / 4


def test_remat_orders_activation_memory():
    act = {
        r: estimate_step_memory(
            MID, dataclasses.replace(BF16, remat=r), TrainerConfig(), rows=4, seq=4096
        ).activations
        for r in ("none", "dots", "full")
    }
    assert act["none"] > act["dots"] > act["full"] > 0


def test_default_config_fits_the_issue_model_on_one_h200():
    # float32 masters, remat full, 8 micro-batches of 8 rows x 320 tokens (issue 19).
    cfg = TrainerConfig(num_micro_batches=8)
    est = check_step_fits(MID, BF16, cfg, rows=64, seq=320, capacity=H200)
    assert est.total < H200


def test_too_big_fails_with_what_would_fit():
    cfg = TrainerConfig()  # float32 masters, one micro-batch
    runtime = dataclasses.replace(BF16, remat="none")
    with pytest.raises(TrainerError) as e:
        check_step_fits(MID, runtime, cfg, rows=64, seq=4096, capacity=H200)
    msg = str(e.value)
    assert "64 rows x 4096 tokens" in msg and "GiB" in msg
    assert "num_micro_batches=" in msg and "remat=" in msg and "fsdp" in msg


def test_trainer_checks_before_compiling(monkeypatch):
    policy = _tiny.make_policy()
    trainer = Trainer(_tiny.trainer_config(), policy, bounds=_tiny.BOUNDS)
    state = trainer.init_state()
    batch = _tiny.make_batch(policy)
    monkeypatch.setattr("osworld_jax.trainer.memory.device_capacity", lambda: 1024.0)
    with pytest.raises(TrainerError, match="would fit"):
        trainer.train_step(state, batch)
    assert not trainer._jitted  # nothing was jitted, traced or compiled
