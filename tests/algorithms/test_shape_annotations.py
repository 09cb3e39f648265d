"""The jaxtyping shape annotations of the public functions hold (checked with beartype)."""

import jax.numpy as jnp
import pytest
from beartype import BeartypeConf, beartype
from jaxtyping import TypeCheckError, jaxtyped

import osworld_jax.algorithms as alg

_checker = beartype(conf=BeartypeConf(is_pep484_tower=True))


def checked(fn):
    return jaxtyped(fn, typechecker=_checker)


N, G, R, T = 6, 2, 3, 4
REWARDS = jnp.linspace(0.0, 1.0, N)
GROUPS = jnp.array([0, 0, 0, 1, 1, 1])
LP = jnp.full((R, T), -1.0)
MASK = jnp.ones((R, T))


def test_advantage_annotations():
    for fn in (alg.grpo_advantages, alg.dr_grpo_advantages, alg.rloo_advantages):
        assert checked(fn)(REWARDS, GROUPS, G).shape == (N,)
    counts = jnp.ones(N)
    assert checked(alg.reinforce_baseline_advantages)(REWARDS, GROUPS, G, counts).shape == (N,)
    assert checked(alg.batch_mean_advantages)(REWARDS).shape == (N,)
    assert checked(alg.dynamic_sampling_keep)(REWARDS, GROUPS, G).shape == (G,)
    assert checked(alg.dapo_band_keep)(jnp.array([0, 1, 2]), 2).shape == (3,)
    with pytest.raises(TypeCheckError):  # group_ids of another length than rewards
        checked(alg.grpo_advantages)(REWARDS, GROUPS[:4], G)


def test_gate_and_loss_annotations():
    assert checked(alg.binary_kl)(LP, LP).shape == (R, T)
    for level, shape in (("sequence", (R,)), ("token", (R, T))):
        keep, w = checked(alg.flash_reinforce_gate)(LP, LP, MASK, level=level)
        assert keep.shape == shape and w.shape == (R, T)
    loss = checked(alg.aggregate_loss)(LP, MASK, mode="token-mean")
    assert loss.shape == ()
    loss, metrics = checked(alg.policy_loss)(
        LP, LP, LP, MASK, group_ids=jnp.array([0, 1, 1]), num_groups=2, norm_length=8
    )
    assert loss.shape == () and all(v.shape == () for v in metrics.values())
    with pytest.raises(TypeCheckError):  # a loss mask of another shape than the logprobs
        checked(alg.flash_reinforce_gate)(LP, LP, MASK[:, :2])
