"""Several optimizer updates per rollout batch (``TrainerConfig.num_minibatches``).

pi_old of every minibatch comes from the forward-only pass (`Trainer.logprobs`) under the
parameters before the first update. The train step is another compiled program, and in bfloat16
XLA rounds its forward differently (excess precision kept in other places), so its own logprobs
are not the pass's. The first update therefore takes pi_old as the value of pi (straight
through): every ratio is exactly 1 there, whatever the two programs round.
"""

import dataclasses

import chex
import jax
import numpy as np
import pytest
from flax import nnx

from osworld_jax import config as gin_config
from osworld_jax.agent import pack_batch, select_groups, split_selection
from osworld_jax.errors import ConfigError
from osworld_jax.model import Policy
from osworld_jax.rl.stages import owner_advantages
from osworld_jax.trainer import Trainer, TrainerConfig, TrainerError
from tests.trainer._tiny import BOUNDS, RUNTIME, TINY, make_batch, make_policy, trainer_config
from tests.trainer.test_step_bounds import BOUNDS as STEP_BOUNDS
from tests.trainer.test_step_bounds import POLICY, B, N, step_owners

BF16 = dataclasses.replace(RUNTIME, dtype="bfloat16")
# T = 128: the length at which the tiny model's two bf16 programs round apart on the CPU
# (at T <= 64 they happen to agree bit for bit).
LENGTH = 128
PPO = dict(ratio_clip=(0.8, 1.28), gate_threshold=0.01)


def _loss_tokens(batch) -> np.ndarray:
    return np.asarray(batch.loss_mask) * np.asarray(batch.row_weight)[:, None] > 0


def test_num_minibatches_is_validated_and_gin_configurable():
    with pytest.raises(ConfigError, match=r"^TrainerConfig.num_minibatches: 0 < 1$"):
        TrainerConfig(num_minibatches=0)
    exp = gin_config.load_experiment([], ["TrainerConfig.num_minibatches = 4"])
    assert exp.trainer.num_minibatches == 4
    assert TrainerConfig().num_minibatches == 1  # the recipes: one update per batch
    with pytest.raises(ConfigError, match="TrainerConfig.num_minibatches"):
        gin_config.load_experiment([], ["TrainerConfig.num_minibatches = -1"])


@pytest.fixture(scope="module")
def f32():
    policy = make_policy()
    trainer = Trainer(trainer_config(num_minibatches=2), policy, bounds=BOUNDS)
    return trainer, make_batch(policy, seed=0), make_batch(policy, seed=1)


def test_one_minibatch_is_exactly_train_step(f32):
    trainer, b0, _ = f32
    s1, [m1] = trainer.train_minibatches(trainer.init_state(), [b0])
    s2, m2 = trainer.train_step(trainer.init_state(), b0)
    assert m1 == m2 and "policy_shift" not in m1  # the recipes' step, bit for bit
    chex.assert_trees_all_equal(s1, s2)


def test_minibatch_errors(f32):
    trainer, b0, b1 = f32
    state = trainer.init_state()
    with pytest.raises(TrainerError, match="0 minibatches, expected 1 to .*= 2"):
        trainer.train_minibatches(state, [])
    with pytest.raises(TrainerError, match="3 minibatches"):
        trainer.train_minibatches(state, [b0, b1, b0])
    with pytest.raises(TrainerError, match="first_update=True needs old_logprobs"):
        trainer.train_step(state, b0, first_update=True)


def test_first_update_gradient_is_the_steps_own(f32):
    # float32: both programs compute the same logprobs, so the straight-through value changes
    # nothing: the first update (pi_old = pi = the pass) is the one-update step.
    trainer, b0, b1 = f32
    olds = [trainer.logprobs(trainer.init_state().params, b) for b in (b0, b1)]
    a, ms = trainer.train_minibatches(trainer.init_state(), [b0, b1])
    b, mb = trainer.train_step(trainer.init_state(), b0)
    first, _ = trainer.train_step(trainer.init_state(), b0, olds[0], first_update=True)
    chex.assert_trees_all_close(first.params, b.params, atol=2e-6, rtol=2e-6)
    for k in mb:
        np.testing.assert_allclose(ms[0][k], mb[k], atol=2e-6, rtol=2e-6, err_msg=k)
    assert ms[0]["ratio_mean"] == 1.0 and ms[0]["policy_shift"] == 0.0
    assert [m["step"] for m in ms] == [0, 1] and int(jax.device_get(a.step)) == 2


@pytest.fixture(scope="module")
def bf16():
    """A bf16 trainer (PPO clipping, 2 minibatches) and two batches whose gate is hand-set.

    The behaviour logprobs mu are the pass's pi_old on rows 0-3 (binary KL 0: kept) and
    ``min(pi_old + 3, -1e-3)`` on rows 4-6 (binary KL > 0.1 per token: rejected); row 7 is
    padding.
    """
    policy = Policy(TINY, BF16, rngs=nnx.Rngs(0))
    cfg = dataclasses.replace(
        trainer_config(num_minibatches=2, loss=PPO), logprob_chunk=1024
    )  # one chunk: a smaller program to compile
    trainer = Trainer(cfg, policy, bounds=BOUNDS)
    params = trainer.init_state().params
    batches, olds = [], []
    for seed in (0, 1):
        b = make_batch(make_policy(), seed=seed, length=LENGTH)
        old = np.asarray(trainer.logprobs(params, b))
        off = np.arange(b.tokens.shape[0]) >= 4
        mu = np.where(off[:, None], np.minimum(old + 3.0, -1e-3), old)
        mu = np.where(_loss_tokens(b), mu, 0.0).astype(np.float32)
        batches.append(b._replace(behavior_logprobs=mu))
        olds.append(old)
    return trainer, batches, olds


@pytest.mark.slow
def test_bf16_first_update_ratios_are_exactly_one(bf16):
    trainer, (b0, b1), (old0, old1) = bf16
    mask = _loss_tokens(b0)

    # The defect: the step's own bf16 logprobs are not the forward-only pass's (two programs).
    _, raw = trainer.train_step(trainer.init_state(), b0, old_logprobs=old0)
    print(f"bf16 mean |train step - Trainer.logprobs| per loss token: {raw['policy_shift']:.3g}")
    assert raw["policy_shift"] > 1e-4 and raw["ratio_mean"] != 1.0

    state, ms = trainer.train_minibatches(trainer.init_state(), [b0, b1])
    first, second = ms
    # First update: pi's value is pi_old itself: every ratio 1, nothing clipped, no shift.
    assert first["ratio_mean"] == 1.0 and first["policy_shift"] == 0.0
    assert first["clip_fraction"] == 0.0
    # The gate decided on pi_old (the pass), exactly as set by hand: rows 4-6 of 7 rejected;
    # the kept rows' importance weights exp(pi_old - mu) are 1.
    kept_tokens = mask[:4].sum() / mask.sum()
    assert first["gate_rejected_fraction"] == pytest.approx(3 / 7, abs=1e-7)
    assert first["is_weight_mean"] == pytest.approx(kept_tokens, abs=1e-6)
    assert first["binary_kl_mean"] > 0.1  # the rejected rows are far off
    for k in ("gate_rejected_fraction", "is_weight_mean", "binary_kl_mean"):
        assert first[k] == raw[k], k  # the same pi_old: the same gate decisions

    # Second update: b1 from the parameters after the first, its pi_old from before any update
    # (the pass above): pi moved.
    assert second["step"] == 1 and int(jax.device_get(state.step)) == 2
    assert second["policy_shift"] > 10 * raw["policy_shift"]
    assert second["gate_rejected_fraction"] == pytest.approx(3 / 7, abs=1e-7)
    # ... and it is exactly the update made by hand with that pi_old.
    s = trainer.init_state()
    s, _ = trainer.train_step(s, b0, old0, first_update=True)
    after = trainer.logprobs(s.params, b1)  # pi_old taken too late: the wrong one
    s, by_hand = trainer.train_step(s, b1, old1)
    assert by_hand == second
    chex.assert_trees_all_equal(s.params, state.params)
    shift_after = np.abs(np.asarray(after) - old1)[_loss_tokens(b1)].mean()
    assert shift_after > 10 * raw["policy_shift"]  # the two pi_old are far apart


def test_split_pack_train_as_the_loop_would():
    # select_groups -> advantages once over the step -> split_selection -> pack_batch per part
    # -> train_minibatches: 3 groups into 2 updates (2 + 1 groups), one padded shape.
    trainer = Trainer(trainer_config(num_minibatches=2), make_policy(), bounds=STEP_BOUNDS)
    kw = dict(num_layers=TINY.num_hidden_layers, top_k=TINY.num_experts_per_tok)
    kw |= dict(length_buckets=(16,), row_buckets=[B * N])
    for failed_groups, updates in (((), 2), ((1, 2), 1)):  # 2 groups dropped: one update
        sel = select_groups(step_owners(0, failed_groups, 16), POLICY, num_prompts=B)
        adv = owner_advantages(sel, "grpo", STEP_BOUNDS)
        parts = split_selection(sel, adv, trainer.config.num_minibatches)
        batches = [pack_batch(p, a, **kw) for p, a in parts]
        whole = pack_batch(sel, adv, **kw)
        state, ms = trainer.train_minibatches(trainer.init_state(), batches)
        assert [m["step"] for m in ms] == list(range(updates))
        assert sum(m["loss_tokens"] for m in ms) == whole.loss_mask.sum()
        assert ms[0].get("ratio_mean", 1.0) == 1.0 and all(np.isfinite(m["loss"]) for m in ms)
        assert int(jax.device_get(state.step)) == updates
