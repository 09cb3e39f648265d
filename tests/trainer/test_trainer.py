"""Train-step invariants on the tiny real Policy (CPU, 8 fake devices from tests/conftest.py)."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from osworld_jax.algorithms import LossConfig, policy_loss
from osworld_jax.model import Policy, RouterReplayError, make_mesh
from osworld_jax.trainer import NonFiniteError, OptimizerConfig, Trainer, TrainerError
from osworld_jax.trainer import trainer as trainer_module
from tests.trainer._tiny import (
    BOUNDS,
    RUNTIME,
    TINY,
    make_batch,
    make_policy,
    naive_logprobs,
    trainer_config,
)

# Float32 end to end through two layers + Adam: differences are reassociation only.
TOL = dict(atol=2e-5, rtol=2e-5)


class CountingTrainer(Trainer):
    """Every test below that uses the shared trainer runs one traced train step: n=1 overall."""

    def __init__(self, *args, **kwargs):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(trainer_module, "make_train_step", _counted(trainer_module.make_train_step))
            super().__init__(*args, **kwargs)


def _counted(make):
    def make_counted(**kwargs):
        return chex.assert_max_traces(make(**kwargs), n=1)

    return make_counted


@pytest.fixture(scope="module")
def policy():
    return make_policy()


@pytest.fixture(scope="module")
def trainer(policy):
    return CountingTrainer(trainer_config(), policy, bounds=BOUNDS)


def _reference_loss(policy, batch, agg_mode):
    """The batch loss from full-vocabulary logits and one direct policy_loss call."""
    lp, _, _ = naive_logprobs(policy, batch)
    mask = jnp.asarray(batch.loss_mask * batch.row_weight[:, None])
    loss, _ = policy_loss(
        lp,
        batch.behavior_logprobs,
        batch.advantages,
        mask,
        config=LossConfig(agg_mode=agg_mode),
        group_ids=batch.group_ids,
        num_groups=BOUNDS.num_groups,
        owner_ids=batch.owner_ids,
        num_owners=BOUNDS.num_owners,
        norm_length=BOUNDS.norm_length,
    )
    return loss


@pytest.mark.slow
def test_micro_batched_gradient_equals_full_batch_reference(policy, trainer):
    # End to end through the model and the chunked logprob head. Owners 0 and 3 have rows in
    # both micro-batches (rows i, i+2, ...): only global denominators make the two halves add up
    # to the full-batch loss and gradient (every mode and gate: test_accumulation.py).
    batch = make_batch(policy)
    params = trainer.init_state().params
    ref = lambda p: _reference_loss(trainer.policy(p), batch, "prompt-mean-token-mean")
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(ref))(params)
    two = Trainer(trainer_config(num_micro_batches=2), policy, bounds=BOUNDS)
    loss, grads = two.gradients(params, batch)
    chex.assert_trees_all_close(loss, ref_loss, **TOL)
    chex.assert_trees_all_close(grads, ref_grads, **TOL)


@pytest.mark.slow
def test_accumulated_update_and_metrics_equal_one_big_batch(policy, trainer):
    batch = make_batch(policy)
    one_state, one = trainer.train_step(trainer.init_state(), batch)
    four = Trainer(trainer_config(num_micro_batches=4), policy, bounds=BOUNDS)
    four_state, m4 = four.train_step(four.init_state(), batch)
    chex.assert_trees_all_close(one_state.params, four_state.params, **TOL)
    chex.assert_trees_all_close(one_state.opt_state, four_state.opt_state, **TOL)
    assert one.keys() == m4.keys()
    for k in one:
        np.testing.assert_allclose(one[k], m4[k], err_msg=k, **TOL)


def test_metrics_match_direct_computation(policy, trainer):
    batch = make_batch(policy)
    lp, ent, _ = naive_logprobs(policy, batch)
    mask = batch.loss_mask * batch.row_weight[:, None]
    _, metrics = trainer.train_step(trainer.init_state(), batch)
    # entropy and |train - behaviour| are loss-token means; binary_kl from policy_loss's gate.
    np.testing.assert_allclose(metrics["entropy"], np.sum(ent * mask) / mask.sum(), rtol=1e-5)
    diff = np.abs(np.asarray(lp) - batch.behavior_logprobs)
    expect = np.sum(diff * mask) / mask.sum()
    np.testing.assert_allclose(metrics["logprob_abs_diff"], expect, rtol=1e-4)
    np.testing.assert_allclose(
        metrics["loss"], _reference_loss(policy, batch, "prompt-mean-token-mean"), **TOL
    )
    assert metrics["lr"] == pytest.approx(1e-3) and metrics["step"] == 0
    assert metrics["loss_tokens"] == mask.sum() and 0.0 <= metrics["gate_rejected_fraction"] <= 1
    assert metrics["binary_kl_mean"] > 0.0 and np.isfinite(metrics["grad_norm"])


def test_no_recompile_across_steps_of_one_bucket(policy, trainer):
    state = trainer.init_state()
    steps = []
    for seed in range(3):  # new data, same shapes and meta: no new trace (CountingTrainer)
        state, metrics = trainer.train_step(state, make_batch(policy, seed=seed))
        steps.append(metrics["step"])
    assert steps == [0, 1, 2] and int(state.step) == 3 and int(state.weight_version) == 3


def test_non_finite_loss_names_the_step_and_skips_the_update(policy, trainer):
    batch = make_batch(policy)
    state, _ = trainer.train_step(trainer.init_state(), batch)
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    bad = batch._replace(advantages=np.where(batch.loss_mask > 0, np.nan, 0.0).astype(np.float32))
    with pytest.raises(NonFiniteError, match=r"train step 1: non-finite grad_norm, loss") as err:
        trainer.train_step(state, bad)
    assert err.value.step == 1
    kept = err.value.state  # the step's output state: the update was skipped in-graph
    assert int(kept.step) == 1 and int(kept.weight_version) == 1
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, (kept.params, kept.opt_state)), before)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_policy_gradient_sign(policy, trainer, sign):
    # One trainable token with advantage +1 (-1): one step raises (lowers) its logprob.
    batch = make_batch(policy)
    r, t = 2, int(np.argmax(batch.loss_mask[2]))
    mask = np.zeros_like(batch.loss_mask)
    mask[r, t] = 1.0
    batch = batch._replace(loss_mask=mask, advantages=sign * mask)
    state = trainer.init_state()
    before = np.asarray(trainer.logprobs(state.params, batch))[r, t]
    state, _ = trainer.train_step(state, batch)
    after = np.asarray(trainer.logprobs(state.params, batch))[r, t]
    assert sign * (after - before) > 1e-3, (before, after)


@pytest.mark.slow
def test_frozen_router_is_not_updated(policy):
    batch = make_batch(policy)
    cfg = trainer_config(optimizer=OptimizerConfig(learning_rate=1e-3, freeze_router=True))
    trainer = Trainer(cfg, policy, bounds=BOUNDS)
    state = trainer.init_state()
    router = np.asarray(state.params["moe"]["router"])
    gate = np.asarray(state.params["moe"]["gate"])
    state, _ = trainer.train_step(state, batch)
    np.testing.assert_array_equal(np.asarray(state.params["moe"]["router"]), router)
    assert not np.allclose(np.asarray(state.params["moe"]["gate"]), gate)


def test_router_replay_uses_batch_routes(policy, trainer):
    batch = make_batch(policy)
    params = trainer.init_state().params
    live = Trainer(trainer_config(router_replay=False), policy, bounds=BOUNDS).logprobs(
        params, batch
    )
    # The engine's own routes reproduce live routing exactly.
    chex.assert_trees_all_close(trainer.logprobs(params, batch), live, **TOL)
    # Other (valid) routes change the logprobs of later tokens.
    flipped = np.where(batch.routed_experts >= 0, 3 - batch.routed_experts, -1).astype(np.int32)
    moved = trainer.logprobs(params, batch._replace(routed_experts=flipped))
    assert np.max(np.abs(np.asarray(moved) - np.asarray(live)) * batch.loss_mask) > 1e-3
    bad = batch.routed_experts.copy()
    bad[0, 0, 0, :] = [0, 0]  # duplicate expert ids
    with pytest.raises(RouterReplayError):
        trainer.logprobs(params, batch._replace(routed_experts=bad))
    # The compact route type (pack_batch's int8 for up to 128 experts) replays the same routes.
    small = batch._replace(routed_experts=batch.routed_experts.astype(np.int8))
    np.testing.assert_array_equal(
        np.asarray(trainer.logprobs(params, small)), np.asarray(trainer.logprobs(params, batch))
    )


@pytest.mark.slow
def test_one_device_and_eight_device_mesh_agree(policy, trainer):
    # fsdp x expert x tensor = 2 x 2 x 2: embed dims over fsdp, experts over expert, heads /
    # vocab / MLP widths over tensor, batch rows over fsdp x expert.
    batch = make_batch(policy)
    one_state, one = trainer.train_step(trainer.init_state(), batch)
    mesh = make_mesh(fsdp=2, expert=2, tensor=2)
    eight = Trainer(trainer_config(), policy, mesh=mesh, bounds=BOUNDS)
    state8 = eight.init_state()
    assert state8.params["moe"]["gate"].sharding.spec[1] in ("expert", ("expert",))
    assert len(state8.params["top"]["lm_head"].sharding.device_set) == 8
    state8, m8 = eight.train_step(state8, batch)
    for k in one:
        np.testing.assert_allclose(one[k], m8[k], err_msg=k, **TOL)
    chex.assert_trees_all_close(
        jax.device_get(one_state.params), jax.device_get(state8.params), **TOL
    )
    chex.assert_trees_all_close(
        jax.device_get(one_state.opt_state), jax.device_get(state8.opt_state), **TOL
    )
    # The optimizer moments live where their parameters live.
    mu = state8.opt_state[1][0].mu["moe"]["gate"]
    assert mu.sharding == state8.params["moe"]["gate"].sharding


@pytest.mark.slow
def test_old_logprobs_from_the_same_policy_give_the_same_step(policy):
    # pi_old from the forward-only logprobs of the current params == the default
    # stop_gradient(pi): same coefficients, ratio 1, same update (the second-update path).
    batch = make_batch(policy)
    trainer = Trainer(
        trainer_config(), policy, bounds=BOUNDS
    )  # a second trace: not the CountingTrainer
    state = trainer.init_state()
    old = trainer.logprobs(state.params, batch)
    with_old, m_old = trainer.train_step(state, batch, old_logprobs=old)
    default, m = trainer.train_step(trainer.init_state(), batch)
    for k in m:
        np.testing.assert_allclose(m_old[k], m[k], err_msg=k, **TOL)
    chex.assert_trees_all_close(with_old.params, default.params, **TOL)


@pytest.mark.slow
def test_float32_master_weights_keep_updates_that_bfloat16_rounds_away():
    # lr 5e-6: Adam's first step moves each weight by ~5e-6, far below one bf16 ulp of a
    # weight of size ~0.2 (2^-3 * 2^-7 ~ 1e-3): bf16 state weights do not move at all, f32
    # master weights move by ~lr, and the bf16 policy view (what SGLang gets) is the rounding.
    bf16 = Policy(TINY, dataclasses.replace(RUNTIME, dtype="bfloat16"), rngs=nnx.Rngs(0))
    batch = make_batch(make_policy())
    opt = OptimizerConfig(learning_rate=5e-6, weight_decay=0.0)
    moved = {}
    for master in ("float32", None):
        trainer = Trainer(trainer_config(optimizer=opt, master_dtype=master), bf16, bounds=BOUNDS)
        state = trainer.init_state()
        before = np.asarray(state.params["moe"]["gate"], np.float32)
        state, metrics = trainer.train_step(state, batch)
        after = np.asarray(state.params["moe"]["gate"], np.float32)
        moved[master] = np.mean(after != before)
        assert state.params["moe"]["gate"].dtype == (jnp.float32 if master else jnp.bfloat16)
        assert np.isfinite(metrics["loss"])
        if master:
            np.testing.assert_allclose(np.abs(after - before).max(), 5e-6, rtol=0.05)
            view = trainer.policy(state.params).params()["moe"]["gate"]
            assert view.dtype == jnp.bfloat16
    assert moved["float32"] > 0.9 and moved[None] < 0.05, moved


def test_rows_must_divide_by_micro_batches_times_data_parallel(policy):
    trainer = Trainer(
        trainer_config(num_micro_batches=3), policy, mesh=make_mesh(data=2), bounds=BOUNDS
    )
    with pytest.raises(TrainerError, match=r"8 rows do not divide by num_micro_batches \(3\)"):
        trainer.train_step(trainer.init_state(), make_batch(policy))
