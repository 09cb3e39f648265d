"""R3 route agreement comes out of the train step's replayed forward (``r3/route_agreement``).

The reference is the probe the RL loop used to run as a separate stage: a second forward pass
without replay, comparing the model's own top-k expert sets with the engine's recorded ones.
The train step instead compares, inside its replayed forward, each MoE layer's own top-k with
the replayed route. Both see the same router input at a layer when every earlier MoE layer
replays the model's own experts, so on the batches below (engine routes = the model's routes,
permuted, with disagreements placed in the last MoE layer) the two must be equal; where an
earlier layer disagrees, the in-step value measures each layer given the engine's upstream
experts (what R3 actually trains on) and may differ from the free-running probe.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from osworld_jax.batch import Batch, BatchBounds
from osworld_jax.model import ModelRuntimeConfig, Policy
from osworld_jax.model.tiny import tiny_config
from osworld_jax.trainer import Trainer
from tests.trainer._tiny import trainer_config

R, T = 2, 16


@pytest.fixture(scope="module")
def tiny_policy():
    cfg = tiny_config(128, 1)  # 3 layers: layer 0 dense, layers 1 and 2 MoE (top-2 of 8)
    return Policy(cfg, ModelRuntimeConfig(), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def trainer(tiny_policy):
    bounds = BatchBounds(num_owners=1, num_groups=1, norm_length=T)
    return Trainer(trainer_config(), tiny_policy, bounds=bounds)


def old_probe(policy, batch):
    """The deleted ``rl.stages.route_agreement``: an un-replayed forward, set equality."""
    engine = np.asarray(batch.routed_experts)  # [R, T, L, K]
    has = (engine >= 0).all(-1) & (np.asarray(batch.segment_ids) > 0)[..., None]  # [R, T, L]
    if not has.any():
        return float("nan")
    ours = np.asarray(
        policy(
            jnp.asarray(batch.tokens),
            positions=jnp.asarray(batch.positions),
            segment_ids=jnp.asarray(batch.segment_ids),
            return_logits=False,
        ).routed_experts
    )
    same = (np.sort(ours, -1) == np.sort(engine, -1)).all(-1)
    return float(same[has].mean())


def batch_with(tokens, seg_ids, routes):
    z = np.zeros((R, T), np.float32)
    mask = (seg_ids > 0).astype(np.float32)
    mask[:, :4] = 0.0
    return Batch(
        tokens=tokens,
        loss_mask=mask,
        behavior_logprobs=mask * -np.log(128.0, dtype=np.float32),
        advantages=z + mask,
        positions=np.broadcast_to(np.arange(T, dtype=np.int32), (R, T)).copy(),
        segment_ids=seg_ids,
        owner_ids=np.zeros(R, np.int32),
        group_ids=np.zeros(R, np.int32),
        row_weight=np.ones(R, np.float32),
        routed_experts=routes.astype(np.int32),
    )


def test_step_metric_equals_the_old_probe(tiny_policy, trainer):
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, 128, size=(R, T)).astype(np.int32)
    seg_ids = np.ones((R, T), np.int32)
    seg_ids[1, 12:] = 0  # padding never counts
    own = np.asarray(
        tiny_policy(
            jnp.asarray(tokens),
            positions=jnp.asarray(np.broadcast_to(np.arange(T), (R, T))),
            segment_ids=jnp.asarray(seg_ids),
            return_logits=False,
        ).routed_experts
    )
    engine = np.where(seg_ids[..., None, None] > 0, own[..., ::-1], -1)  # same sets, reordered
    engine[:, :, 0] = -1  # the dense layer has no route
    changed = engine.copy()
    changed[0, :8, 2, :] = (changed[0, :8, 2, :] + 1) % 8  # 8 of the last MoE layer's routes
    cases = {"own": engine, "changed": changed, "none": np.full_like(engine, -1)}
    # 28 real tokens x 2 MoE layers = 56 routed (token, layer) pairs.
    expect = {"own": 1.0, "changed": 48 / 56, "none": float("nan")}
    state = trainer.init_state()
    for name, routes in cases.items():
        batch = batch_with(tokens, seg_ids, routes)
        reference = old_probe(trainer.policy(state.params), batch)
        _, metrics = trainer.train_step(trainer.init_state(), batch)
        got = metrics["route_agreement"]
        assert reference == pytest.approx(expect[name], nan_ok=True), name
        np.testing.assert_allclose(got, reference, rtol=0, atol=1e-7, err_msg=name)  # NaN == NaN


@pytest.mark.slow
def test_no_agreement_metric_without_router_replay(tiny_policy):
    bounds = BatchBounds(num_owners=1, num_groups=1, norm_length=T)
    live = Trainer(trainer_config(router_replay=False), tiny_policy, bounds=bounds)
    tokens = np.ones((R, T), np.int32)
    routes = np.full((R, T, 3, 2), -1, np.int32)
    _, metrics = live.train_step(
        live.init_state(), batch_with(tokens, np.ones_like(tokens), routes)
    )
    assert "route_agreement" not in metrics
