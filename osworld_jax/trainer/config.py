"""Trainer configs: the optimizer, checkpointing and the train step (frozen, documented)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from osworld_jax.algorithms import LossConfig
from osworld_jax.errors import ConfigError
from osworld_jax.registry import check_choice

#: Learning-rate schedules after the warmup.
Schedule = Literal["constant", "cosine"]
#: dtypes of the train-state parameters (``None``: the policy's own).
MasterDtype = Literal["float32", "bfloat16"] | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with linear warmup, then a constant or cosine learning rate.

    Attributes:
      learning_rate: peak learning rate (the OSWorld recipes use 5e-6).
      warmup_steps: linear warmup from ``warmup_init_lr`` to ``learning_rate`` over this many
        optimizer steps (the seed's recipes: 9 from 0, then constant).
      warmup_init_lr: the learning rate of the first warmup step (step 0).
      schedule: after warmup, ``"constant"`` or ``"cosine"`` (decay to
        ``learning_rate * min_lr_ratio`` at ``decay_steps``).
      decay_steps: total optimizer steps of the cosine schedule (warmup included); ignored by
        ``"constant"``.
      min_lr_ratio: final learning rate of the cosine schedule as a fraction of the peak.
      b1: Adam first-moment decay.
      b2: Adam second-moment decay (the seed's recipes: 0.99; optax's default 0.999 averages
        the second moment over ~1000 steps, longer than a 200-step run).
      eps: Adam epsilon.
      weight_decay: decoupled weight decay (AdamW), applied to matrices only (ndim >= 2); norms,
        biases and other vectors are not decayed.
      max_grad_norm: global-norm gradient clipping threshold (``None`` disables clipping).
      freeze_router: keep the MoE router weights fixed: no gradient is taken for them, no
        optimizer state or float32 master is held, they leave the clipping norm and stay bit
        for bit (`osworld_jax.model.freeze`). The seed's recipes freeze it (R3 then replays
        routes the router would still pick); Qwen3-VL-MoE's router has no bias, so the seed's
        router bias-update rate 0 has no counterpart. Default False.
      freeze_vision: keep a Qwen3-VL model's vision tower and its projection fixed (the patch
        embedding, the ViT blocks, the merger and the DeepStack mergers: the seed's
        ``freeze_vision_model`` + ``freeze_vision_projection``; as ``freeze_router``). Default
        False: the tower is trained.
    """

    learning_rate: float = 5e-6
    warmup_steps: int = 0
    warmup_init_lr: float = 0.0
    schedule: Schedule = "constant"
    decay_steps: int = 0
    min_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    freeze_router: bool = False
    freeze_vision: bool = False

    def __post_init__(self) -> None:
        check_choice(self.schedule, Schedule, "OptimizerConfig.schedule")
        if self.learning_rate < 0:
            raise ConfigError(f"OptimizerConfig.learning_rate: {self.learning_rate} < 0")
        if not 0.0 <= self.warmup_init_lr <= self.learning_rate:
            raise ConfigError(
                f"OptimizerConfig.warmup_init_lr: {self.warmup_init_lr} not in [0, "
                f"learning_rate = {self.learning_rate}]"
            )
        if self.warmup_steps < 0:
            raise ConfigError(f"OptimizerConfig.warmup_steps: {self.warmup_steps} < 0")
        if self.schedule == "cosine" and self.decay_steps <= self.warmup_steps:
            raise ConfigError(
                f"OptimizerConfig.decay_steps: {self.decay_steps} must exceed warmup_steps "
                f"({self.warmup_steps}) for the cosine schedule"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"OptimizerConfig.min_lr_ratio: {self.min_lr_ratio} not in [0, 1]")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ConfigError(f"OptimizerConfig.max_grad_norm: {self.max_grad_norm} <= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Orbax checkpointing of the train state and the data-iterator state.

    Attributes:
      directory: where checkpoints live (one sub-directory per step); ``None`` disables saving.
      save_every: save when ``step % save_every == 0`` (a forced save ignores it); 1, every
        step boundary (the seed's recipes).
      keep: keep the newest ``keep`` checkpoints, delete older ones (the seed's recipes: 2).
      async_save: write in a background thread (the trainer waits before exit / restore).
      restore_step: resume from this checkpoint step instead of the newest one (e.g. when the
        newest is corrupt: the error names it and the previous complete step). The newer
        checkpoints and refit exports are set aside (renamed ``<name>.set-aside``), not
        deleted. ``None``: the newest complete checkpoint.
    """

    directory: str | None = None
    save_every: int = 1
    keep: int = 3
    async_save: bool = True
    restore_step: int | None = None

    def __post_init__(self) -> None:
        if self.save_every < 1:
            raise ConfigError(f"CheckpointConfig.save_every: {self.save_every} < 1")
        if self.keep < 1:
            raise ConfigError(f"CheckpointConfig.keep: {self.keep} < 1")
        if self.restore_step is not None and self.restore_step < 1:
            raise ConfigError(f"CheckpointConfig.restore_step: {self.restore_step} < 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The train step: the loss, micro-batching, memory-safe logprobs, R3, master weights.

    Attributes:
      optimizer: the optimizer and its learning-rate schedule.
      checkpoint: checkpointing (directory, cadence, retention).
      loss: the policy loss: off-policy gate, aggregation mode, ratio clipping
        (``osworld_jax.algorithms.LossConfig``).
      num_minibatches: optimizer updates per rollout batch (>= 1): the batch's prompt groups are
        split into this many minibatches, one update each. 1 (the recipes): pi_old is the
        step's own logprobs. More: pi_old of every minibatch comes from one forward-only pass
        (`Trainer.logprobs`) before the first update, and the gate and importance ratios use
        it. The learning-rate schedule counts updates.
      num_micro_batches: gradient-accumulation micro-batches per optimizer step; the batch rows
        must divide by ``num_micro_batches * data-parallel size``. Loss denominators are always
        computed over the whole optimizer batch.
      logprob_chunk: sequence positions per chunk of the token-logprob head; at most
        ``[rows, logprob_chunk, vocab]`` float32 logits exist at a time (forward and backward).
      router_replay: R3: pass ``batch.routed_experts`` to the policy as ``replay_experts``.
      master_dtype: dtype of the parameters held in the train state and updated by the
        optimizer (the "master weights"); the forward casts them to the policy's own dtype, so a
        bfloat16 policy computes in bfloat16 while its updates accumulate in float32 (a 5e-6
        step is far below one bfloat16 ulp of a typical weight and would round away). ``None``
        keeps the policy's dtype (half the state memory, lossy updates).
      check_finite: raise ``NonFiniteError`` naming the step when the loss or gradient norm is
        NaN/Inf. (A non-finite update is always skipped in-graph: the state stays that of the
        previous step; without this check the step would pass silently.)
    """

    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    num_minibatches: int = 1
    num_micro_batches: int = 1
    logprob_chunk: int = 1024
    router_replay: bool = True
    master_dtype: MasterDtype = "float32"
    check_finite: bool = True

    def __post_init__(self) -> None:
        check_choice(self.master_dtype, MasterDtype, "TrainerConfig.master_dtype")
        if self.num_minibatches < 1:
            raise ConfigError(f"TrainerConfig.num_minibatches: {self.num_minibatches} < 1")
        if self.num_micro_batches < 1:
            raise ConfigError(f"TrainerConfig.num_micro_batches: {self.num_micro_batches} < 1")
        if self.logprob_chunk < 1:
            raise ConfigError(f"TrainerConfig.logprob_chunk: {self.logprob_chunk} < 1")
