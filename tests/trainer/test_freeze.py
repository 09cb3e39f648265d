"""Freezing is real: no gradient, no optimizer state, no master copy, bit-for-bit unchanged.

The seed freezes the MoE router and the vision tower with its projection; a tiny Qwen3-VL-MoE
with screenshots in the batch (so the tower's gradient is not zero by itself) trains a few
steps with both frozen.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from osworld_jax.model import is_frozen_name
from osworld_jax.trainer import OptimizerConfig, Trainer
from osworld_jax.trainer.step import make_gradients
from tests.trainer._tiny import trainer_config
from tests.trainer.test_images import BOUNDS, batch, policy  # noqa: F401 - the fixture

FROZEN = OptimizerConfig(learning_rate=1e-2, freeze_router=True, freeze_vision=True)
# No gate: the policy loss reaches every parameter (the batch's behaviour logprobs are 0).
LOSS = {"gate": "none"}


def frozen(group: str, name: str) -> bool:
    return is_frozen_name(f"{group}.{name}", freeze_router=True, freeze_vision=True)


def leaves(tree) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in flat}


def test_no_gradient_no_state_for_frozen_parameters(policy):  # noqa: F811
    cfg = trainer_config(optimizer=FROZEN, loss=LOSS)
    trainer = Trainer(cfg, policy, bounds=BOUNDS)
    state = trainer.init_state()
    params = jax.device_get(state.params)
    names = [(g, n) for g, group in params.items() for n in group]
    assert {g for g, n in names if frozen(g, n)} == {"moe", "vision", "vision_blocks", "deepstack"}
    # The optimizer holds no moment for a frozen parameter: mu and nu cover the trainable ones.
    trainable_size = sum(params[g][n].size for g, n in names if not frozen(g, n))
    moments = [x for k, x in leaves(state.opt_state).items() if "mu" in k or "nu" in k]
    assert sum(x.size for x in moments) == 2 * trainable_size
    # With screenshots in the batch the tower has a gradient when trained; frozen, jax.grad is
    # not taken w.r.t. it: the traced gradient program has no backward through the ViT and
    # the router (fewer matmuls), and the frozen leaves' gradients are constants.
    device_batch = trainer._device_batch(batch(length_buckets=[256]))[0]
    jaxprs = {
        name: jax.make_jaxpr(
            make_gradients(policy.config, policy.runtime, cfg, BOUNDS, labels=lab)
        )(state.params, device_batch)
        for name, lab in (("trained", None), ("frozen", trainer.labels))
    }
    dots = {k: str(j).count("dot_general") for k, j in jaxprs.items()}
    assert dots["frozen"] < dots["trained"], dots
    out_tree = jax.tree_util.tree_structure((0.0, state.params))
    outs = jax.tree_util.tree_unflatten(out_tree, jaxprs["frozen"].jaxpr.outvars)[1]
    for g, n in names:  # a frozen leaf's gradient is a literal zero broadcast, never computed
        var = outs[g][n]
        made_by = [e for e in jaxprs["frozen"].jaxpr.eqns if var in e.outvars]
        if frozen(g, n):
            assert [e.primitive.name for e in made_by] == ["broadcast_in_dim"], f"{g}.{n}"
            assert getattr(made_by[0].invars[0], "val", None) == 0, f"{g}.{n}"  # a literal


@pytest.mark.slow
def test_frozen_router_and_tower_are_bitwise_unchanged_after_steps(policy):  # noqa: F811
    trainer = Trainer(trainer_config(optimizer=FROZEN, loss=LOSS), policy, bounds=BOUNDS)
    state = trainer.init_state()
    b = batch(length_buckets=[256])
    before = jax.device_get(state.params)
    for _ in range(3):
        state, metrics = trainer.train_step(state, b)
        assert np.isfinite(metrics["loss"])
    after = jax.device_get(state.params)
    for g, group in before.items():
        for n, old in group.items():
            if frozen(g, n):  # bit for bit, every step
                np.testing.assert_array_equal(after[g][n], old, err_msg=f"{g}.{n}")
            elif old.ndim >= 2:  # every trained matrix moved
                assert not np.array_equal(after[g][n], old), f"{g}.{n}"


@pytest.mark.parametrize("master", ["float32", None])
def test_the_memory_estimate_drops_by_the_frozen_parameters_state(master):
    from osworld_jax.model.params import param_specs
    from osworld_jax.trainer.memory import estimate_step_memory
    from tests.trainer.test_images import CONFIG, RUNTIME
    from tests.trainer.test_memory import BF16

    specs = param_specs(CONFIG)
    n_frozen = sum(
        int(np.prod(s.shape))
        for k, s in specs.items()
        if is_frozen_name(k, freeze_router=True, freeze_vision=True)
    )
    assert n_frozen > 0 and RUNTIME
    kw = dict(rows=16, seq=256, patches=64)
    for micro in (1, 4):
        cfg = trainer_config(master_dtype=master, num_micro_batches=micro)
        trained = estimate_step_memory(CONFIG, BF16, cfg, **kw)
        cfg_f = trainer_config(master_dtype=master, num_micro_batches=micro, optimizer=FROZEN)
        held = estimate_step_memory(CONFIG, BF16, cfg_f, **kw)
        m = 4 if master == "float32" else 2  # master bytes; the policy computes in bf16 (2)
        # optimizer (mu + nu: 2m) + master (float32 masters: a frozen leaf keeps its bf16
        # copy alone, m bytes fewer; bf16 masters: the master is that copy, 0 fewer) +
        # gradient (bf16: 2, + the float32 accumulator with micro-batches: 4)
        drop = n_frozen * (2 * m + (m if m != 2 else 0) + 2 + (4 if micro > 1 else 0))
        state = ("params", "compute_copy", "moments", "grads")
        saved = sum(getattr(trained, k) - getattr(held, k) for k in state)
        assert saved == pytest.approx(drop, rel=1e-9)
        assert held.activations == trained.activations
        # and a frozen tower keeps nothing for a backward: one block's working set per patch
        assert 0 < held.vision < trained.vision
