"""A Qwen3-VL policy's vision tower: trained by default, frozen on request, vectors not decayed."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from osworld_jax.model import Policy
from osworld_jax.trainer import OptimizerConfig, Trainer
from tests.model.vl_helpers import ours_config
from tests.trainer._tiny import BOUNDS, RUNTIME, make_batch, trainer_config

VISION = ("vision", "vision_blocks", "deepstack")
LR, WD = 1e-2, 0.1


@pytest.mark.parametrize(
    "freeze", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["trained", "frozen"]
)
def test_vision_tower_labels_and_weight_decay(freeze):
    cfg = dataclasses.replace(ours_config(), initializer_range=0.2)
    policy = Policy(cfg, RUNTIME, rngs=nnx.Rngs(0))
    batch = make_batch(policy)  # text only: the tower's gradients are exactly zero
    opt = OptimizerConfig(learning_rate=LR, weight_decay=WD, freeze_vision=freeze)
    trainer = Trainer(trainer_config(optimizer=opt), policy, bounds=BOUNDS)
    state = trainer.init_state()
    before = jax.device_get(state.params)
    state, _ = trainer.train_step(state, batch)
    after = jax.device_get(state.params)
    assert not np.allclose(after["attn"]["q_proj"], before["attn"]["q_proj"])  # the LM trains
    for group in VISION:
        for name, old in before[group].items():
            new = after[group][name]
            vector = name.endswith("bias") or "norm" in name
            if freeze or vector:  # frozen: no update at all; vectors: no weight decay
                np.testing.assert_array_equal(new, old, err_msg=f"{group}.{name}")
            else:  # zero gradient, so AdamW moves a matrix by its decay only: p (1 - lr wd)
                np.testing.assert_allclose(new, old * (1 - LR * WD), rtol=1e-6, err_msg=name)
