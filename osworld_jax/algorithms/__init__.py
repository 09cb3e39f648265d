"""osworld_jax.algorithms: advantage estimators, gates, policy loss and loss aggregation.

Pure, ``jax.jit``-able functions of arrays (static arguments: counts, modes, names). See
docs/INTERFACES.md and issue 2 §3 for the contract.
"""

from osworld_jax.algorithms.advantages import (
    batch_mean_advantages,
    compute_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_baseline_advantages,
    rloo_advantages,
)
from osworld_jax.algorithms.aggregation import aggregate_loss
from osworld_jax.algorithms.filtering import dapo_band_keep, dynamic_sampling_keep
from osworld_jax.algorithms.gates import (
    binary_kl,
    flash_reinforce_gate,
    no_gate,
    ratio_band_gate,
    truncate_is_weights,
)
from osworld_jax.algorithms.loss import LossConfig, policy_loss
from osworld_jax.algorithms.registries import (
    ESTIMATORS,
    GATES,
    LOSS_AGG_MODES,
    Estimator,
    Gate,
    GateLevel,
    LossAggMode,
)

__all__ = [
    "ESTIMATORS",
    "GATES",
    "LOSS_AGG_MODES",
    "Estimator",
    "Gate",
    "GateLevel",
    "LossAggMode",
    "LossConfig",
    "aggregate_loss",
    "batch_mean_advantages",
    "binary_kl",
    "compute_advantages",
    "dapo_band_keep",
    "dr_grpo_advantages",
    "dynamic_sampling_keep",
    "flash_reinforce_gate",
    "grpo_advantages",
    "no_gate",
    "policy_loss",
    "ratio_band_gate",
    "reinforce_baseline_advantages",
    "rloo_advantages",
    "truncate_is_weights",
]
