"""Every mesh preset (configs/mesh_*gpu.gin) trains exactly as one device does.

On the 8 CPU devices of tests/conftest.py, each preset's mesh (1, 2, 4, 8 devices; expert
parallelism on) runs two train steps of the tiny policy with router replay: the engine's own
routes, then skewed replayed routes (every token of the MoE layer on experts 0 and 1: two
experts take all the tokens, two get none, and under expert parallelism one device of each
group computes everything). Losses, metrics, parameters and AdamW moments equal the 1-device
Trainer's.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import numpy as np
import pytest
from flax import nnx

from osworld_jax import config as gin_config
from osworld_jax.model import ModelRuntimeConfig, Policy, make_mesh
from osworld_jax.rl import MeshConfig
from osworld_jax.trainer import Trainer
from tests.trainer._tiny import BOUNDS, RUNTIME, TINY, make_batch, make_policy, trainer_config

TOL = dict(atol=2e-5, rtol=2e-5)  # float32 end to end: reassociation only
PRESETS = ("mesh_1gpu.gin", "mesh_2gpu.gin", "mesh_4gpu.gin", "mesh_8gpu.gin")


def _preset(name: str) -> tuple[MeshConfig, ModelRuntimeConfig]:
    gin_config.parse_gin([name])
    try:
        return gin_config.build(MeshConfig), gin_config.build(ModelRuntimeConfig)
    finally:
        gin_config.parse_gin([])  # leave no bindings behind


def make_policy_with(runtime: ModelRuntimeConfig) -> Policy:
    return Policy(TINY, runtime, rngs=nnx.Rngs(0))  # make_policy()'s weights


def _skewed(batch):
    """The batch with every token of the MoE layer (layer 0) replayed on experts 0 and 1."""
    routes = batch.routed_experts.copy()
    moe = list(TINY.moe_layers)
    live = routes[:, :, moe] >= 0
    routes[:, :, moe] = np.where(live, np.array([0, 1], np.int32), -1)
    return batch._replace(routed_experts=routes)


def _two_steps(trainer: Trainer, batches):
    state, out = trainer.init_state(), []
    for batch in batches:
        state, metrics = trainer.train_step(state, batch)
        out.append((metrics, jax.device_get((state.params, state.opt_state))))
    return out


@pytest.fixture(scope="module")
def reference():
    policy = make_policy()
    batches = [make_batch(policy), _skewed(make_batch(policy, seed=1))]
    return policy, batches, _two_steps(Trainer(trainer_config(), policy, bounds=BOUNDS), batches)


def test_presets_are_the_documented_meshes():
    shapes = {name: _preset(name)[0].axes() for name in PRESETS}
    assert [sum(v > 1 for v in s.values()) for s in shapes.values()] == [0, 1, 1, 2]
    assert [int(np.prod(list(s.values()))) for s in shapes.values()] == [1, 2, 4, 8]
    assert all(_preset(name)[1].expert_parallel for name in PRESETS)
    assert {_preset(name)[0].overlap for name in PRESETS} == {"none"}


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS[1:])
def test_preset_steps_equal_one_device(reference, name):
    _, batches, expected = reference
    mesh_config, runtime = _preset(name)
    axes = mesh_config.axes()
    n = int(np.prod(list(axes.values())))
    mesh = make_mesh(**axes, devices=jax.devices()[:n])
    # The reference's weights (seed 0) and float32; the preset's expert_parallel; the grouped
    # `ragged` backend ("auto" on CPU) against the reference's dense one.
    rt = dataclasses.replace(
        RUNTIME, expert_parallel=runtime.expert_parallel, expert_backend="ragged"
    )
    trainer = Trainer(trainer_config(), make_policy_with(rt), bounds=BOUNDS, mesh=mesh)
    gate = trainer.init_state().params["moe"]["gate"]
    assert len(gate.sharding.device_set) == n  # the experts are split over the mesh
    for (metrics, tree), (ref_metrics, ref_tree) in zip(
        _two_steps(trainer, batches), expected, strict=True
    ):
        assert metrics.keys() == ref_metrics.keys()
        for k in ref_metrics:
            np.testing.assert_allclose(metrics[k], ref_metrics[k], err_msg=k, **TOL)
        chex.assert_trees_all_close(tree, ref_tree, **TOL)
