"""The seed's base settings, row by row, in all four flash recipes (issue 42).

Each row of the seed's base recipe, read from the `ExperimentConfig` the project's own gin
loader builds; the alternatives stay reachable by one binding each.
"""

from __future__ import annotations

import pytest

from osworld_jax import config
from osworld_jax.trainer.optimizer import make_schedule

RECIPES = [
    f"osworld_flash_{size}_r3_{alt}.gin"
    for size in ("b8n8", "b17n16")
    for alt in ("dr_grpo", "reinforce")
]


@pytest.fixture(scope="module", params=RECIPES)
def exp(request):
    return config.load_experiment([request.param])


def test_router_vision_tower_and_projection_are_frozen(exp):
    opt = exp.trainer.optimizer
    assert opt.freeze_router and opt.freeze_vision and exp.trainer.router_replay


def test_adam_betas_and_the_lr_schedule(exp):
    opt = exp.trainer.optimizer
    assert (opt.b1, opt.b2, opt.learning_rate) == (0.9, 0.99, 5e-6)
    assert (opt.warmup_steps, opt.warmup_init_lr, opt.schedule) == (9, 0.0, "constant")
    lr = make_schedule(opt)
    # 9 warmup iterations from 0: lr(s) = 5e-6 * s / 9; then constant (min_lr = lr).
    assert float(lr(0)) == 0.0
    assert float(lr(3)) == pytest.approx(5e-6 / 3, rel=1e-6)
    assert [float(lr(s)) for s in (9, 10, 200)] == pytest.approx([5e-6] * 3, rel=1e-6)


def test_context_generation_and_turns(exp):
    comp = exp.agent.compaction
    assert (comp.max_context_tokens, comp.reserved_generation_tokens) == (49152, 11152)
    assert max(exp.rl.length_buckets) == 49152  # the longest row, so every micro-batch's
    assert exp.rollout.sampling.max_new_tokens == 16384
    assert exp.env.max_turns == 150


def test_screenshot_window(exp):
    agent = exp.agent
    # the last 2 image groups (one screenshot per observation), sliding; at most 10 active
    # images; the initial context protected (and kept by the periodic compaction's window)
    assert (agent.max_screenshots, agent.screenshots_after_compaction) == (2, None)
    assert agent.max_active_images == 10 and agent.protect_initial_observation
    assert agent.screenshot_window == 2 and agent.compaction.keep_last_observations == 2


def test_checkpoints_and_baseline_population(exp):
    ckpt = exp.trainer.checkpoint
    assert (ckpt.save_every, ckpt.keep) == (1, 2)
    assert exp.group.baseline_population == "all_owners"


@pytest.mark.parametrize(
    "binding,field,value",
    [
        ("OptimizerConfig.freeze_router = False", "trainer.optimizer.freeze_router", False),
        ("OptimizerConfig.freeze_vision = False", "trainer.optimizer.freeze_vision", False),
        ("OptimizerConfig.b2 = 0.999", "trainer.optimizer.b2", 0.999),
        ("OptimizerConfig.warmup_steps = 0", "trainer.optimizer.warmup_steps", 0),
        (
            "GroupPolicyConfig.baseline_population = 'logical_owners'",
            "group.baseline_population",
            "logical_owners",
        ),
        ("AgentConfig.screenshots_after_compaction = 1", "agent.screenshot_low_water", 1),
    ],
)
def test_our_alternatives_are_one_binding_away(binding, field, value):
    exp = config.load_experiment([RECIPES[0]], [binding])
    obj = exp
    for part in field.split("."):
        obj = getattr(obj, part)
    assert obj == value
