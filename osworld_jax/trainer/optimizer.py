"""The optax optimizer: global-norm clipping + AdamW on a warmup/constant|cosine schedule."""

from __future__ import annotations

from typing import Any

import jax
import optax

from osworld_jax.trainer.config import OptimizerConfig

TRAIN, FROZEN = "trainable", "frozen"  # the labels of osworld_jax.model.param_labels


def make_schedule(config: OptimizerConfig) -> optax.Schedule:
    """The learning rate as a function of the optimizer step.

    ``lr(s) = init + (peak - init) * s / warmup`` for ``s < warmup`` (``init`` =
    ``warmup_init_lr``, the seed's 0: step 0 makes no update); afterwards ``peak`` (constant) or
    ``peak * (m + (1 - m) * (1 + cos(pi * (s - warmup) / (decay - warmup))) / 2)`` (cosine, with
    ``m = min_lr_ratio``, held at ``peak * m`` after ``decay_steps``).
    """
    peak = config.learning_rate
    if config.schedule == "constant":
        after: optax.Schedule = optax.constant_schedule(peak)
    else:
        after = optax.cosine_decay_schedule(
            peak, config.decay_steps - config.warmup_steps, alpha=config.min_lr_ratio
        )
    if config.warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(config.warmup_init_lr, peak, config.warmup_steps)
    return optax.join_schedules([warmup, after], [config.warmup_steps])


def _matrices(params: Any) -> Any:
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(
    config: OptimizerConfig, *, labels: Any | None = None, decay_mask: Any | None = None
) -> optax.GradientTransformation:
    """``clip_by_global_norm -> adamw`` on ``make_schedule(config)``.

    Args:
      config: the optimizer config.
      labels: a params-shaped pytree of ``"trainable"`` / ``"frozen"`` strings (or ``None``: all
        trainable). Frozen leaves get a zero update and no optimizer state, and are left out of
        the clipping norm.
      decay_mask: a params-shaped pytree of bools: which leaves get weight decay (default:
        every leaf with ndim >= 2; the trainer also excludes stacked norm scales).

    Returns:
      The optax transformation.
    """
    parts = []
    if config.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(config.max_grad_norm))
    parts.append(
        optax.adamw(
            make_schedule(config),
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=_matrices if decay_mask is None else decay_mask,
        )
    )
    tx = optax.chain(*parts)
    if labels is None:
        return tx
    return optax.multi_transform({TRAIN: tx, FROZEN: optax.set_to_zero()}, labels)
