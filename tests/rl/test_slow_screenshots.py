"""Slow end-to-end test of the default run (configs/default.gin: screenshots of jailed local
desktops, the embedded server) and the analysis notebook on its run directory."""

import json
import subprocess
import sys
import time

import pytest

from osworld_jax import config
from osworld_jax.rl import train
from tests.rl.runs import REPO


@pytest.fixture(scope="module")
def screenshot_run(tmp_path_factory):
    """The default run (configs/default.gin: the tiny Qwen3-VL-MoE, screenshots of jailed local
    desktops, the embedded server) for 2 steps."""
    run_dir = tmp_path_factory.mktemp("screenshots") / "run"
    exp = config.load_experiment(["default.gin"], ["RLConfig.progress_bar = False"])
    config.write_operative_config(run_dir, exp)
    t0 = time.monotonic()
    result = train(exp, run_dir, steps=2)
    print(f"default run with screenshots, 2 steps: {time.monotonic() - t0:.0f}s")
    return run_dir, result


@pytest.mark.slow
def test_the_default_loop_trains_on_screenshots(screenshot_run):
    # Every step's batch holds the owners' screenshots (8 owners, >= 1 turn each); the trainer
    # reproduces the server's logprobs of the sampled tokens (float32) and replays its routes,
    # image tokens included, on 100% of (token, MoE layer) pairs.
    run_dir, result = screenshot_run
    assert [h["step"] for h in result.history] == [1, 2]
    for h in result.history:
        print({k: h[k] for k in ("logprob/train_rollout_abs_diff", "r3/route_agreement")})
        assert h["logprob/train_rollout_abs_diff"] <= 1e-5
        assert h["r3/route_agreement"] == 1.0
        assert h["batch/images"] >= 8 and h["owners/failed"] == 0
        assert h["gate/rejected_fraction"] == 0.0
    from osworld_jax.rl import analysis

    episodes = analysis.load_episodes(run_dir)
    assert [(e["step"], e["owner"]) for e in episodes] == [(1, 0), (2, 0)]
    shot = analysis.episode_image(run_dir, episodes[0]["calls"][0]["images"][-1])
    assert shot.shape == (1080, 1920, 3)  # the jailed desktop's real screen


@pytest.mark.slow
def test_analysis_notebook_executes(screenshot_run):
    import jupytext
    import nbformat

    # The documented command (train.py prints it for its run): scripts/analyze.py RUN_DIR.
    run_dir, _ = screenshot_run
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "analyze.py"), str(run_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == f"wrote {run_dir.resolve() / 'analysis.ipynb'}"
    assert "WARNING" not in r.stderr, r.stderr  # no TCP warning, no kernel left to its parent
    assert not list(REPO.glob("kernel-ipc-*"))  # the kernel's sockets live in a temp dir
    nb = nbformat.read(run_dir / "analysis.ipynb", as_version=4)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 6  # the last one: an owner's screenshots next to its actions
    assert "recorded episodes" in str(nb.cells[-1].outputs)
    committed = json.loads((REPO / "notebooks" / "analysis.ipynb").read_text())
    assert all(not c.get("outputs") for c in committed["cells"])  # committed without outputs
    assert [
        c["source"]
        for c in jupytext.reads(
            (REPO / "notebooks" / "analysis.py").read_text(), fmt="py:percent"
        ).cells
    ] == [
        c["source"] if isinstance(c["source"], str) else "".join(c["source"])
        for c in committed["cells"]
    ]  # the pair is in sync
