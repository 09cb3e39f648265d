"""Checkpoints: retention, data-iterator state, exact resume, another mesh, kill -9 mid-save."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import chex
import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osworld_jax.model import load_hf_checkpoint, make_mesh
from osworld_jax.trainer import CheckpointConfig, Checkpointer, Trainer, TrainState
from tests.trainer._save_worker import make_state
from tests.trainer._tiny import BOUNDS, RUNTIME, make_batch, make_policy, trainer_config

TOL = dict(atol=2e-5, rtol=2e-5)


def _small_state(step):
    return TrainState(
        params={"w": jnp.full((4, 2), float(step))},
        opt_state=(jnp.zeros(3),),
        step=jnp.int32(step),
        weight_version=jnp.int32(step),
    )


def _ckpt(directory, **kw):
    return trainer_config(checkpoint=CheckpointConfig(directory=str(directory), **kw))


def test_cadence_and_keep_last_n(tmp_path):
    ck = Checkpointer(CheckpointConfig(directory=str(tmp_path), save_every=2, keep=2))
    started = [ck.save(_small_state(s), s, {"next_index": s}) for s in range(1, 8)]
    ck.wait()
    assert started == [False, True, False, True, False, True, False]
    assert ck.all_steps() == [4, 6]  # keep the newest two
    assert ck.save(_small_state(7), 7, force=True)
    state, data = ck.restore(jax.eval_shape(lambda: _small_state(0)))
    assert int(state.step) == 7 and data is None
    state, data = ck.restore(jax.eval_shape(lambda: _small_state(0)), step=6)
    chex.assert_trees_all_equal(state, _small_state(6))
    assert data == {"next_index": 6}
    ck.close()


def test_a_symlinked_step_directory_is_refused_at_start_and_nothing_is_deleted(tmp_path):
    """A step dir that is a link (here to a directory outside) would make orbax's rmtree of old
    steps fail mid-run, or delete through it: the start refuses it in one line naming it."""
    from osworld_jax.trainer.checkpoint import CheckpointPathError

    root, outside = tmp_path / "checkpoints", tmp_path / "precious"
    ck = Checkpointer(CheckpointConfig(directory=str(root), save_every=1, keep=1))
    ck.save(_small_state(1), 1, force=True)
    ck.close()
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    (root / "2").symlink_to(outside)
    with pytest.raises(CheckpointPathError) as refused:
        Checkpointer(CheckpointConfig(directory=str(root), save_every=1, keep=1))
    assert "\n" not in str(refused.value) and str(root / "2") in str(refused.value)
    assert (outside / "keep.txt").read_text() == "x" and (root / "1").is_dir()


def test_grain_iterator_state_round_trips(tmp_path):
    def iterator():
        return iter(grain.MapDataset.range(50).shuffle(seed=3).to_iter_dataset())

    it = iterator()
    seen = [next(it) for _ in range(7)]
    ck = Checkpointer(CheckpointConfig(directory=str(tmp_path)))
    ck.save(_small_state(1), 1, it)
    expected = [next(it) for _ in range(5)]
    fresh = iterator()
    _, restored = ck.restore(jax.eval_shape(lambda: _small_state(0)), data_iterator=fresh)
    assert restored is fresh and [next(fresh) for _ in range(5)] == expected
    assert seen[0] != expected[0]
    ck.close()


def test_resume_from_step_k_matches_uninterrupted_run(tmp_path):
    policy = make_policy()
    batches = [make_batch(policy, seed=s) for s in range(2)]
    with Trainer(_ckpt(tmp_path), policy, bounds=BOUNDS) as run:
        state, _ = run.train_step(run.init_state(), batches[0])
        assert run.save(state, data_state={"next_index": 1})  # async; the step below donates
        state, uninterrupted = run.train_step(state, batches[1])
    # A new process would do exactly this: fresh trainer, restore latest, continue.
    with Trainer(_ckpt(tmp_path), make_policy(seed=1), bounds=BOUNDS) as resumed:
        restored, data = resumed.restore()
        assert data == {"next_index": 1} and int(restored.step) == 1
        restored, metrics = resumed.train_step(restored, batches[1])
    assert metrics == uninterrupted  # same program, same inputs: bitwise equal on CPU
    chex.assert_trees_all_equal(jax.device_get(restored), jax.device_get(state))


@pytest.mark.slow
def test_restore_eight_device_checkpoint_onto_one_device(tmp_path):
    policy = make_policy()
    batches = [make_batch(policy, seed=s) for s in range(2)]
    eight = Trainer(
        _ckpt(tmp_path), policy, mesh=make_mesh(fsdp=2, expert=2, tensor=2), bounds=BOUNDS
    )
    state8, _ = eight.train_step(eight.init_state(), batches[0])
    saved = jax.device_get(state8)
    eight.save(state8)
    state8, m8 = eight.train_step(state8, batches[1])
    eight.close()

    one = Trainer(_ckpt(tmp_path), policy, bounds=BOUNDS)  # default 1-device mesh
    state1, _ = one.restore()
    chex.assert_trees_all_equal(jax.device_get(state1), saved)
    assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(state1))
    state1, m1 = one.train_step(state1, batches[1])
    for k in m8:
        np.testing.assert_allclose(m1[k], m8[k], err_msg=k, **TOL)
    chex.assert_trees_all_close(jax.device_get(state1), jax.device_get(state8), **TOL)


@pytest.mark.slow
def test_kill_9_mid_save_leaves_previous_checkpoint_usable(tmp_path):
    worker = Path(__file__).with_name("_save_worker.py")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]), XLA_FLAGS="")
    proc = subprocess.Popen(
        [sys.executable, str(worker), str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith("MIDSAVE"):
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert lines == ["SAVED 1", "MIDSAVE"] and proc.returncode == -signal.SIGKILL
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert any(name.startswith("2") and "tmp" in name for name in leftovers), leftovers

    ck = Checkpointer(CheckpointConfig(directory=str(tmp_path), keep=3))
    assert ck.all_steps() == [1]  # the half-written step 2 is invisible
    abstract = jax.eval_shape(lambda: make_state(0))
    state, data = ck.restore(abstract)
    chex.assert_trees_all_equal(jax.device_get(state), jax.device_get(make_state(1)))
    assert data == {"next_index": 1}
    # Training can go on: step 2 is saved again over the debris and becomes the latest.
    assert ck.save(make_state(2), 2, {"next_index": 2})
    ck.wait()
    assert ck.all_steps() == [1, 2]
    state, data = ck.restore(abstract)
    assert int(state.step) == 2 and data == {"next_index": 2}
    ck.close()


def test_export_hf_round_trips_through_the_model_loader(tmp_path, monkeypatch):
    policy = make_policy()
    trainer = Trainer(trainer_config(), policy, bounds=BOUNDS)
    state = trainer.init_state()
    path = trainer.export_hf(state, tmp_path / "hf")
    assert (path / "config.json").exists() and not list(tmp_path.glob("hf.tmp-*"))
    loaded = load_hf_checkpoint(path, dtype=jnp.float32, runtime=RUNTIME)
    chex.assert_trees_all_equal(loaded.params(), jax.device_get(state.params))
