"""Registries fail loudly; DAPO dynamic sampling and the offline band."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import osworld_jax.algorithms as alg
from osworld_jax.algorithms import (
    ESTIMATORS,
    GATES,
    LOSS_AGG_MODES,
    Estimator,
    Gate,
    LossAggMode,
    compute_advantages,
    dapo_band_keep,
    dynamic_sampling_keep,
)
from osworld_jax.errors import ConfigError


@pytest.mark.parametrize(
    "registry, enum",
    [(ESTIMATORS, Estimator), (LOSS_AGG_MODES, LossAggMode), (GATES, Gate)],
)
def test_registry_names_are_the_enum_values(registry, enum):
    assert registry.names() == sorted(e.value for e in enum)
    for e in enum:
        assert callable(registry.get(e.value))
        registry.validate(e.value, "Cfg.field")


@pytest.mark.parametrize("registry", [ESTIMATORS, LOSS_AGG_MODES, GATES])
def test_registry_unknown_and_duplicate_raise(registry):
    with pytest.raises(ConfigError, match="unknown"):
        registry.get("no-such-name")
    with pytest.raises(ConfigError, match="RLConfig.choice"):
        registry.validate("no-such-name", "RLConfig.choice")
    first = registry.names()[0]
    with pytest.raises(ValueError, match="duplicate"):
        registry.add(first, lambda *a, **k: None)
    assert registry.names() == sorted(registry.names())  # unchanged by the failed add


def test_compute_advantages_unknown_name_and_missing_token_counts():
    r, g = jnp.array([1.0, 0.0]), jnp.array([0, 0])
    with pytest.raises(ConfigError, match="grpo2"):
        compute_advantages("grpo2", r, g, 1)
    with pytest.raises(ConfigError, match="token_counts"):
        compute_advantages("reinforce_baseline", r, g, 1)


def test_public_names_are_exported():
    for name in [
        "grpo_advantages",
        "dr_grpo_advantages",
        "rloo_advantages",
        "reinforce_baseline_advantages",
        "batch_mean_advantages",
        "binary_kl",
        "flash_reinforce_gate",
        "aggregate_loss",
        "policy_loss",
        "dynamic_sampling_keep",
        "dapo_band_keep",
        "compute_advantages",
        "ESTIMATORS",
        "LOSS_AGG_MODES",
        "GATES",
    ]:
        assert name in alg.__all__ and hasattr(alg, name)


def test_dynamic_sampling_keep_hand_values():
    # group 0: eight 0.95 (all equal -> drop); group 1: [1, 0] (keep); group 2: singleton (drop);
    # group 3: [1 (invalid), 0, 0] -> valid rewards all equal (drop); group 4: empty (drop).
    rewards = jnp.array([0.95] * 8 + [1.0, 0.0, 0.5, 1.0, 0.0, 0.0])
    groups = jnp.array([0] * 8 + [1, 1, 2, 3, 3, 3])
    valid = jnp.array([True] * 11 + [False, True, True])
    got = dynamic_sampling_keep(rewards, groups, 5, valid=valid)
    np.testing.assert_array_equal(np.asarray(got), [False, True, False, False, False])
    # without valid, group 3 has 1 vs 0 -> keep
    got = jax.jit(dynamic_sampling_keep, static_argnums=2)(rewards, groups, 5)
    np.testing.assert_array_equal(np.asarray(got), [False, True, False, True, False])


def test_dapo_band_keep_hand_values():
    passes = jnp.array([0, 1, 2, 7, 8])
    # default band 0 < k < 8
    np.testing.assert_array_equal(np.asarray(dapo_band_keep(passes, 8)), [0, 1, 1, 1, 0])
    # 1 < k < 7
    np.testing.assert_array_equal(
        np.asarray(dapo_band_keep(passes, 8, low=1, high=7)), [0, 0, 1, 0, 0]
    )
    # per-task reps: 0 < k < reps_i
    reps = jnp.array([4, 1, 4, 7, 9])
    np.testing.assert_array_equal(np.asarray(dapo_band_keep(passes, reps)), [0, 0, 1, 0, 1])
