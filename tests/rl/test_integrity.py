"""A segment integrity error while collecting owners stops the run (issue 14 item 3).

An owner whose calls do not extend each other token-exactly (and declared no compaction) would
train on rows that are not what the server saw: ``build_segments`` raises
``SegmentIntegrityError`` and ``train()`` must stop with it, not mask the owner and go on.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest

from osworld_jax import config
from osworld_jax.agent import SegmentIntegrityError
from osworld_jax.agent import owner as owner_module
from osworld_jax.rl import train
from tests.rl import learnable
from tests.rl.test_slow import LEARN


@pytest.mark.slow
def test_a_segment_integrity_error_while_collecting_owners_stops_the_run(tmp_path, monkeypatch):
    real_build = owner_module.build_segments
    seen = []

    def broken_for_owner_3(history, **kw):
        """Owner 3's history gets a second call whose prompt rewrites an earlier token."""
        seen.append(history.owner_id)
        if history.owner_id != 3:
            return real_build(history, **kw)
        history = copy.deepcopy(history)
        first = history.calls[0]
        prompt = np.concatenate([first.prompt_ids, first.output_ids])
        prompt[1] = (prompt[1] + 1) % 100  # a token the server never saw at that position
        history.record_call(
            dataclasses.replace(
                first, prompt_ids=prompt, output_ids=first.output_ids[:1], routed_experts=None
            )
        )
        return real_build(history, **kw)

    monkeypatch.setattr(owner_module, "build_segments", broken_for_owner_3)
    tasks = learnable.write_tasks(tmp_path / "tasks")
    params = [*LEARN, f"DataConfig.task_set = '{tasks}'", "RLConfig.steps = 2"]
    exp = config.load_experiment(["default.gin"], params)
    run_dir = tmp_path / "run"
    with pytest.raises(
        SegmentIntegrityError, match=r"owner 3: call 1 breaks the token prefix"
    ) as e:
        train(exp, run_dir)
    assert (e.value.owner_id, e.value.call_index, e.value.position) == (3, 1, 1)
    assert 3 in seen
    # The run stopped inside step 1: no optimizer step, no checkpoint, no metrics, no records.
    assert not list((run_dir / "checkpoints").glob("1*"))
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()
    rollouts = run_dir / "rollouts.jsonl"
    assert not rollouts.exists() or not [json.loads(x) for x in rollouts.read_text().split()]
    assert not (run_dir / "weights" / "step_00000001").exists()
