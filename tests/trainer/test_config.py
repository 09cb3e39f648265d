"""Config validation (from the algorithms registries), LR schedules, the benchmark formula."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from osworld_jax.algorithms import LossConfig
from osworld_jax.errors import ConfigError
from osworld_jax.trainer import CheckpointConfig, OptimizerConfig, TrainerConfig, make_schedule


@pytest.mark.parametrize(
    ("cls", "kwargs", "field"),
    [
        (LossConfig, dict(gate="kl"), "LossConfig.gate: unknown policy-loss gate 'kl'"),
        (
            LossConfig,
            dict(agg_mode="mean"),
            "LossConfig.agg_mode: unknown loss aggregation mode 'mean'",
        ),
        (LossConfig, dict(gate_level="row"), "LossConfig.gate_level"),
        (TrainerConfig, dict(num_micro_batches=0), "TrainerConfig.num_micro_batches"),
        (TrainerConfig, dict(logprob_chunk=0), "TrainerConfig.logprob_chunk"),
        (LossConfig, dict(ratio_clip=(0.8,)), "LossConfig.ratio_clip"),
    ],
)
def test_trainer_config_errors_name_the_field(cls, kwargs, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(")):
        cls(**kwargs)


def test_other_config_errors():
    with pytest.raises(ConfigError, match="OptimizerConfig.schedule"):
        OptimizerConfig(schedule="linear")
    with pytest.raises(ConfigError, match="OptimizerConfig.decay_steps"):
        OptimizerConfig(schedule="cosine", warmup_steps=10, decay_steps=10)
    with pytest.raises(ConfigError, match="CheckpointConfig.keep"):
        CheckpointConfig(keep=0)
    assert OptimizerConfig().learning_rate == 5e-6 and OptimizerConfig().max_grad_norm == 1.0


def test_warmup_then_constant():
    lr = make_schedule(OptimizerConfig(learning_rate=1e-3, warmup_steps=4))
    # linear warmup s/4 * peak, then flat.
    np.testing.assert_allclose(
        [lr(s) for s in range(7)], [0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3], rtol=1e-6
    )


def test_warmup_then_cosine():
    cfg = OptimizerConfig(
        learning_rate=1e-3, warmup_steps=2, schedule="cosine", decay_steps=6, min_lr_ratio=0.1
    )
    lr = make_schedule(cfg)
    # after warmup u = min((s - 2) / 4, 1): peak * (0.1 + 0.9 * (1 + cos(pi u)) / 2)
    u = [min((s - 2) / 4, 1.0) for s in range(2, 8)]
    expect = [1e-3 * (0.1 + 0.9 * (1 + np.cos(np.pi * x)) / 2) for x in u]
    np.testing.assert_allclose([lr(s) for s in range(2, 8)], expect, rtol=1e-6)
    assert float(lr(1)) == pytest.approx(5e-4)


def _bench_module():
    path = Path(__file__).parents[2] / "benchmarks" / "train_step.py"
    spec = importlib.util.spec_from_file_location("bench_train_step", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module
    spec.loader.exec_module(module)
    return module


def test_benchmark_active_params_and_flops_by_hand():
    bench = _bench_module()
    cfg = bench.CONFIGS["bench-moe"].model
    # lm_head 2048*151936 = 311,164,928; final_norm 2048; input embedding excluded.
    # attention/layer: q,o 2*2048*32*128 + k,v 2*2048*4*128 + norms 2048+128+128+2048
    #   = 18,878,720; x 8 layers = 151,029,760.
    # MoE/layer: router 2048*128 = 262,144 + experts 3*128*2048*768 * 8/128 = 37,748,736
    #   = 38,010,880; x 8 = 304,087,040.
    active = 311_164_928 + 2048 + 151_029_760 + 304_087_040
    total, got = bench.active_params(cfg)
    assert got == active == 766_283_776
    assert total == active + 311_164_928 + 8 * 603_979_776 * 120 // 128
    b, s = 4, 4096
    expect = 6 * active * b * s + 12 * 8 * b * s**2 * 32 * 128 / 2
    assert bench.model_flops(cfg, b, s) == expect


def test_benchmark_vision_flops_by_hand():
    bench = _bench_module()
    vl = bench.CONFIGS["bench-vl"]
    # The text model is bench-moe's: the ViT is not in N_active.
    assert bench.active_params(vl.model) == bench.active_params(bench.CONFIGS["bench-moe"].model)
    # One 1920x1080 screenshot at Qwen3-VL's limits: 1088 x 1920 px -> 68 x 120 = 8160 patches.
    # Per patch: embed 1536 * 1152 = 1,769,472; 27 blocks x (4 * 1152^2 + 2 * 1152 * 4304 =
    #   15,224,832) = 411,070,464 -> 412,839,936 weights, 2 FLOPs each.
    # Attention: 27 x 4 x 8160^2 x 1152 = 8,284,314,009,600 per image.
    # Mergers (final + 3 DeepStack) per merged token (8160 / 4 = 2040): 4 x (4608^2 + 4608 x
    #   2048) = 122,683,392 weights.
    fwd = 2 * 8160 * 412_839_936 + 8_284_314_009_600 + 2 * 2040 * 122_683_392
    assert fwd == 15_522_410_004_480
    assert bench.vision_flops(vl.model.vision, [8160] * 4) == 4 * 3 * fwd  # 186.3 TFLOP
    batch = bench.bench_batch(vl, vl.model, vl.batch, vl.seq, vl.images)
    assert batch.tokens.shape == (1, 16384) and batch.pixel_values.shape == (1, 4 * 8160, 1536)
    assert (batch.tokens == vl.model.image_token_id).sum() == 4 * 2040
    assert batch.positions.shape == (3, 1, 16384)
    text = bench.model_flops(vl.model, 1, 16384)
    assert bench.step_flops(vl, vl.model, batch) == text + 4 * 3 * fwd
