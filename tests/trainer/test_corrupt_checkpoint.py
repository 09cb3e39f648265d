"""A complete checkpoint damaged on disk fails its restore with one line naming the step and file.

Issue 16 item 10: a corrupt latest checkpoint gave a 35-73 line traceback that did not name it.
Each case damages one file of a real orbax checkpoint the way a disk or a copy does (garbled
bytes, a cut file, broken JSON, a lost item) and restores through `Checkpointer`.
"""

from __future__ import annotations

import dataclasses
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from osworld_jax.trainer import CheckpointConfig
from osworld_jax.trainer.checkpoint import SET_ASIDE, Checkpointer, CorruptCheckpointError
from osworld_jax.trainer.state import TrainState


def _state(seed: int) -> TrainState:
    """A TrainState whose every field is a small random array (whatever its fields are)."""
    rng = np.random.default_rng(seed)
    leaf = lambda n: jnp.asarray(rng.standard_normal(n), jnp.float32)  # noqa: E731
    values = {f.name: leaf(4) for f in dataclasses.fields(TrainState)}
    values["params"] = {"attn": {"k_proj": leaf((8, 64, 16))}, "top": {"embed": leaf((64, 32))}}
    return TrainState(**values)


def _abstract(state: TrainState) -> TrainState:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints 1 and 2 (each with the task-stream JSON item), written once."""
    root = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    ckpt = Checkpointer(CheckpointConfig(directory=str(root), async_save=False))
    for step in (1, 2):
        assert ckpt.save(_state(step), step, {"next_index": 2 * step})
    ckpt.close()
    return root


@pytest.fixture
def copy(saved, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(saved, root)
    return root


def _damage_array(step_dir):
    biggest = max(step_dir.glob("state/ocdbt.process_0/d/*"), key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[64::7] = bytes(b ^ 0x5A for b in data[64::7])
    biggest.write_bytes(bytes(data))


def _cut_array(step_dir):
    biggest = max(step_dir.glob("state/ocdbt.process_0/d/*"), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[:100])


def _restore(root, step=None):
    ckpt = Checkpointer(CheckpointConfig(directory=str(root), async_save=False))
    try:
        return ckpt.restore(_abstract(_state(0)), step=step)
    finally:
        ckpt.close()


def test_an_intact_checkpoint_restores(copy):
    state, data = _restore(copy)
    np.testing.assert_array_equal(
        state.params["attn"]["k_proj"], _state(2).params["attn"]["k_proj"]
    )
    assert data == {"next_index": 4}


@pytest.mark.parametrize(
    ("damage", "where", "why"),
    [
        (_damage_array, r"2/state \(array params\.\w+\.\w+\)", r"ZSTD_decompressStream\(\) failed"),
        (_cut_array, r"2/state \(array params\.\w+\.\w+\)", r"not valid|Truncated|range"),
        (lambda d: (d / "state" / "_METADATA").write_text("{trunc"), r"2/state/_METADATA", "JSON"),
        (lambda d: (d / "data" / "metadata").write_text('{"next_in'), r"2/data/metadata", "JSON"),
        (
            lambda d: (d / "state" / "_METADATA").write_bytes(b'{"tree_metadata": "\xff\xfe"}'),
            r"2/state/_METADATA",
            r"not UTF-8 \(byte 0xff",
        ),
        (
            lambda d: (d / "state" / "manifest.ocdbt").write_bytes(b"xx"),
            r"manifest\.ocdbt",
            "manifest",
        ),
        (lambda d: shutil.rmtree(d / "state"), r"checkpoints/2", r'Item "state" was not found'),
    ],
    ids=[
        "garbled-array",
        "cut-array",
        "metadata-json",
        "data-json",
        "metadata-not-utf8",
        "manifest",
        "lost-item",
    ],
)
def test_a_damaged_checkpoint_names_its_step_and_file(copy, damage, where, why):
    damage(copy / "2")
    with pytest.raises(CorruptCheckpointError) as info:
        _restore(copy)
    err = info.value
    assert err.step == 2
    message = str(err)
    assert "\n" not in message
    assert message.startswith(f"checkpoint 2 is corrupt: {copy}/"), message
    assert re.search(where, err.path), err.path
    assert re.search(why, err.reason), err.reason
    state, data = _restore(copy, step=1)  # the previous one is untouched
    assert data == {"next_index": 2}


def test_set_aside_after_hides_newer_steps_without_deleting_them(copy):
    ckpt = Checkpointer(CheckpointConfig(directory=str(copy), async_save=False))
    moved = ckpt.set_aside_after(1)
    assert moved == [copy / f"2{SET_ASIDE}"] and moved[0].is_dir()
    assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
    assert ckpt.save(_state(5), 2, {"next_index": 9})  # step 2 can be written again
    ckpt.close()
    assert _restore(copy)[1] == {"next_index": 9}
    assert (copy / f"2{SET_ASIDE}" / "state").is_dir()  # the old step 2 is still there
