"""Fixed bounds: dropped groups and other owner counts never recompile the train step.

The step is built for ``BatchBounds(num_owners=B*N, num_groups=B, ...)`` once; steps that drop
0, 1 or 2 of the B prompt groups (select_groups -> pack_batch, as the RL loop does) trace the
step once per padded length bucket, and the bounds leave the loss and gradients unchanged.
"""

import chex
import numpy as np
import optax
import pytest

from osworld_jax.agent import GroupPolicyConfig, OwnerRollout, Segment, pack_batch, select_groups
from osworld_jax.batch import BatchBounds
from osworld_jax.rl.stages import owner_advantages
from osworld_jax.trainer import Trainer, TrainerError
from osworld_jax.trainer import trainer as trainer_module
from tests.trainer._tiny import TINY, make_policy, trainer_config

B, N = 3, 2
BOUNDS = BatchBounds(num_owners=B * N, num_groups=B, norm_length=32)
POLICY = GroupPolicyConfig(min_healthy_per_group=2, min_step_batch_fraction=0.0)
TOL = dict(atol=2e-5, rtol=2e-5)


def step_owners(seed: int, failed_groups: tuple[int, ...], length: int) -> list[OwnerRollout]:
    """B x N owners; one owner of each group in ``failed_groups`` failed (the group drops)."""
    rng = np.random.default_rng(seed)
    owners = []
    for i in range(B * N):
        g = i // N
        if g in failed_groups and i % N == 0:
            owners.append(
                OwnerRollout(owner_id=i, group_id=g, segments=(), reward=None, failed=True)
            )
            continue
        n = int(rng.integers(length // 2 + 1, length + 1))
        mask = (np.arange(n) >= 3).astype(np.float32)
        seg = Segment(
            owner_id=i,
            group_id=g,
            tokens=rng.integers(1, TINY.vocab_size, n).astype(np.int32),
            loss_mask=mask,
            behavior_logprobs=(mask * (rng.normal(0, 0.01, n) - np.log(TINY.vocab_size))).astype(
                np.float32
            ),  # near the random model's ~uniform logprobs: the gate keeps the rows
            routed_experts=None,
            call_indices=(0,),
            weight_versions=("0",),
        )
        reward = float(i % 2)  # every group has a 1 and a 0: non-zero GRPO advantages
        owners.append(
            OwnerRollout(owner_id=i, group_id=g, segments=(seg,), reward=reward, failed=False)
        )
    return owners


def packed(seed, failed_groups, length, bounds=BOUNDS):
    sel = select_groups(step_owners(seed, failed_groups, length), POLICY, num_prompts=B)
    assert len(sel.dropped_group_ids) == len(failed_groups)
    adv = owner_advantages(sel, "grpo", bounds)
    batch = pack_batch(
        sel,
        adv,
        num_layers=TINY.num_hidden_layers,
        top_k=TINY.num_experts_per_tok,
        length_buckets=(16, 32),
        row_buckets=[B * N],
    )
    return batch, sel


def test_one_trace_per_length_bucket_whatever_the_dropped_groups(monkeypatch):
    traces, make = [], trainer_module.make_train_step

    def recording(**kwargs):
        step = make(**kwargs)

        def train_step(state, batch, *rest):
            traces.append(batch.tokens.shape)  # runs once per trace, never per call
            return step(state, batch, *rest)

        return train_step

    monkeypatch.setattr(trainer_module, "make_train_step", recording)
    policy = make_policy()
    trainer = Trainer(trainer_config(), policy, bounds=BOUNDS)
    state = trainer.init_state()
    # (dropped groups, longest row): 0, 1, 2 dropped groups in the 16 bucket, then the 32 bucket.
    plan = [((), 16), ((1,), 16), ((0, 2), 16), ((2,), 32), ((), 32), ((0, 1), 32)]
    owners_trained = []
    for seed, (failed, length) in enumerate(plan):
        batch, sel = packed(seed, failed, length)
        assert batch.tokens.shape == (B * N, length)
        state, metrics = trainer.train_step(state, batch)
        owners_trained.append(len(sel.owners))
        assert np.isfinite(metrics["loss"]) and metrics["step"] == seed
    assert owners_trained == [6, 4, 2, 4, 6, 2]
    assert traces == [(B * N, 16), (B * N, 32)]  # one trace per bucket, nothing per group count


@pytest.mark.slow
def test_bounds_leave_loss_and_gradients_unchanged():
    # The same batch (group 1 dropped: 4 of 6 owners, 2 of 3 groups) under the step's fixed
    # bounds and under its exact owner / group counts: prompt-mean-token-mean counts groups,
    # seq-mean-token-mean counts owners.
    policy = make_policy()
    batch, sel = packed(7, (1,), 16)
    exact = BatchBounds(num_owners=len(sel.owners), num_groups=sel.num_groups, norm_length=32)
    params = Trainer(trainer_config(), policy, bounds=BOUNDS).init_state().params
    for mode in ("prompt-mean-token-mean", "seq-mean-token-mean"):
        cfg = trainer_config(loss=dict(agg_mode=mode))
        loss, grads = Trainer(cfg, policy, bounds=BOUNDS).gradients(params, batch)
        ref_loss, ref_grads = Trainer(cfg, policy, bounds=exact).gradients(params, batch)
        chex.assert_trees_all_close(loss, ref_loss, **TOL)
        chex.assert_trees_all_close(grads, ref_grads, **TOL)
        assert float(optax.global_norm(grads)) > 0


def test_ids_outside_the_bounds_are_refused():
    policy = make_policy()
    batch, _ = packed(0, (), 16)
    small = BatchBounds(num_owners=B * N, num_groups=2, norm_length=32)
    trainer = Trainer(trainer_config(), policy, bounds=small)
    with pytest.raises(TrainerError, match=r"Batch.group_ids: .*BatchBounds.num_groups = 2"):
        trainer.train_step(trainer.init_state(), batch)
