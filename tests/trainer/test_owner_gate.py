"""``gate_level='owner'`` through the micro-batched train step equals the full-batch reference.

An owner's rows are split across micro-batches (rows i, i + M, ...), but its gate decision
pools all of them; the step decides on the whole batch first (`step._gate_owners_first`).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osworld_jax.algorithms import LossConfig, policy_loss
from osworld_jax.trainer import Trainer
from tests.trainer._tiny import BOUNDS, make_batch, make_policy, naive_logprobs, trainer_config

TOL = dict(atol=2e-5, rtol=2e-5)


def _reference(trainer, batch, level):
    """Loss of the whole batch from full-vocabulary logits and one policy_loss call."""

    def loss(params):
        lp, _, _ = naive_logprobs(trainer.policy(params), batch)
        mask = jnp.asarray(batch.loss_mask * batch.row_weight[:, None])
        value, metrics = policy_loss(
            lp,
            batch.behavior_logprobs,
            batch.advantages,
            mask,
            config=LossConfig(gate_level=level),
            group_ids=batch.group_ids,
            num_groups=BOUNDS.num_groups,
            owner_ids=batch.owner_ids,
            num_owners=BOUNDS.num_owners,
            norm_length=BOUNDS.norm_length,
        )
        return value, metrics

    return loss


@pytest.mark.slow
def test_owner_gate_with_micro_batches_equals_the_full_batch_reference():
    policy = make_policy()
    batch = make_batch(policy)
    # Owner 0 has rows 0 and 1 (micro-batches 0 and 1 of 2). Row 0 drifts far from the
    # policy, row 1 stays on it: per row only row 0 is rejected; pooled over owner 0 the drift
    # still exceeds delta = 0.01, so the owner level rejects row 1 as well.
    # (+2 nats: mu ~ 7 pi on tokens of pi ~ 1/64, a binary KL ~ 0.1 per token.)
    behavior = batch.behavior_logprobs.copy()
    on = batch.loss_mask[0] > 0
    behavior[0] = np.where(on, np.minimum(behavior[0] + 2.0, -1e-3), 0.0)
    batch = batch._replace(behavior_logprobs=behavior)
    plain = Trainer(trainer_config(), policy, bounds=BOUNDS)
    params = plain.init_state().params
    results = {}
    for level in ("sequence", "owner"):
        ref = _reference(plain, batch, level)
        (ref_loss, ref_metrics), ref_grads = jax.jit(jax.value_and_grad(ref, has_aux=True))(params)
        for m in (1, 2):
            cfg = trainer_config(num_micro_batches=m, loss=dict(gate_level=level))
            loss, grads = Trainer(cfg, policy, bounds=BOUNDS).gradients(params, batch)
            chex.assert_trees_all_close(loss, ref_loss, **TOL)
            chex.assert_trees_all_close(grads, ref_grads, **TOL)
        results[level] = float(ref_loss), float(ref_metrics["gate_rejected_token_fraction"])
    # The two levels decide differently here: the owner level rejects row 1's tokens too.
    assert results["owner"][1] > results["sequence"][1] > 0.0
    assert results["owner"][0] != pytest.approx(results["sequence"][0])
