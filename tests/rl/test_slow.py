"""Slow end-to-end tests: the learning test, the notebook, scripts/train.py (default, Ctrl-C,
resume). Run with ``pytest --runslow tests/rl/test_slow.py``."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from osworld_jax import config
from osworld_jax.rl import train
from tests.rl import learnable

REPO = Path(__file__).resolve().parents[2]

# The learning demo's suite (osworld_jax/demo/learnable.py) through the real pipeline: the
# embedded server subprocess samples one token per owner, the memory desktop scores it, segments
# -> GRPO advantages -> train_step with R3 -> HF export -> /update_weights_from_disk refit. The
# demo's bindings (a higher LR than the recipes' 5e-6) so that a random tiny model learns in a
# few CPU minutes; scripts/demo_learning.py runs the same.
LEARNING_STEPS = learnable.STEPS
LEARN = list(learnable.BINDINGS)


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("learning")
    tasks = learnable.write_tasks(root / "tasks")
    exp = config.load_experiment(["default.gin"], [*LEARN, f"DataConfig.task_set = '{tasks}'"])
    run_dir = root / "run"
    config.write_operative_config(run_dir, exp)
    t0 = time.monotonic()
    result = train(exp, run_dir)
    print(f"learning run: {time.monotonic() - t0:.0f}s")
    return run_dir, result


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
def test_the_loop_learns(learning_run):
    _, result = learning_run
    rewards = [h["reward/mean"] for h in result.history]
    print("reward curve:", " ".join(f"{r:.2f}" for r in rewards))
    assert [h["step"] for h in result.history] == list(range(1, LEARNING_STEPS + 1))
    assert sum(rewards[:3]) / 3 < 0.35
    assert sum(rewards[-3:]) / 3 > 0.8
    for h in result.history:
        # Every refit took: the server sampled with exactly the trainer's weights and routes.
        assert h["gate/rejected_fraction"] == 0.0
        assert h["logprob/train_rollout_abs_diff"] < 1e-3
        assert h["r3/route_agreement"] > 0.99
        assert h["owners/failed"] == 0 and h["owners/total"] == 16


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


def _train_cmd(run_dir, steps):
    return [
        sys.executable,
        str(REPO / "scripts" / "train.py"),
        f"--run_dir={run_dir}",
        f"--steps={steps}",
    ]


def _live_processes_mentioning(text):
    """Live processes whose command line or environment contains ``text``.

    The tests put a marker into the trainer's environment: every process it starts (the
    embedded server, bwrap jails, desktops) inherits it, so a leftover one is found.
    """
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                environ = (p / "environ").read_bytes().decode(errors="replace")
                state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z" and (text in cmd or text in environ):
                out.append((int(p.name), cmd))
    return out


@pytest.mark.slow
def test_default_run_ctrl_c_and_resume(tmp_path):
    """scripts/train.py with no config flags (configs/default.gin: tiny model, embedded server,
    local sandboxes, bundled tasks); Ctrl-C after step 1; the same --run_dir resumes at step 2."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OSWORLD_JAX_TEST_RUN": str(run_dir)}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        _train_cmd(run_dir, 3), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 480
    while not (run_dir / "checkpoints" / "1").is_dir():
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint of step 1"
        time.sleep(1)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=180)[0].decode()
    print(f"first run {time.monotonic() - t0:.0f}s:\n{out[-1500:]}")
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted" in out
    assert not _live_processes_mentioning(str(run_dir))  # server and sandboxes are gone
    steps_done = [
        json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps_done[0] == 1
    for name in ("operative_config.gin", "experiment.json", "base_model/config.json"):
        assert (run_dir / name).is_file()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))

    assert f"run directory: {run_dir}" in out
    # The step after the last complete checkpoint may have logged before its save finished.
    ckpt = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())

    # Resuming as a text-model run is refused in one line before anything starts (no jax work).
    other = [f"--gin_file={REPO / 'configs' / g}" for g in ("default.gin", "text_only.gin")]
    refused = subprocess.run(
        [*_train_cmd(run_dir, max(steps_done) + 1), *other],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stdout + refused.stderr
    line = refused.stderr.strip()
    assert line.startswith(f"error: {run_dir} was trained with another config; changed: "), line
    assert "ModelSourceConfig.tiny_kind: 'qwen3_vl_moe' -> 'qwen3_moe'" in line, line
    assert "AgentConfig.max_screenshots: 3 -> 0" in line and "--allow_config_change" in line
    assert "\n" not in line and "RLConfig.steps" not in line  # run length may change

    t1 = time.monotonic()
    again = subprocess.run(
        _train_cmd(run_dir, max(steps_done) + 1),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(f"resumed run {time.monotonic() - t1:.0f}s:\n{again.stdout[-1500:]}")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumed = records[len(steps_done) :]
    assert [r["step"] for r in resumed] == [max(steps_done) + 1]
    assert (run_dir / "checkpoints" / str(max(steps_done) + 1)).is_dir()
    assert not _live_processes_mentioning(str(run_dir))
    assert f"resuming from checkpoint {ckpt}" in again.stdout
    assert f"results in {run_dir} ({run_dir.parent / 'latest'} points here)" in again.stdout
    assert (run_dir.parent / "latest").resolve() == run_dir.resolve()

    # Rerunning the finished run says so, at once.
    done = subprocess.run(
        _train_cmd(run_dir, max(steps_done) + 1),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        f"{run_dir} is finished: its checkpoint {max(steps_done) + 1} is at or past the last step"
    ), done.stdout


@pytest.mark.slow
def test_evaluate_then_freeze_the_band(learning_run, tmp_path, capsys):
    """scripts/evaluate.py (pass@8 of the untrained tiny model, served embedded) -> calibration
    JSONL -> scripts/freeze_band.py -> a verified frozen task set that training can read."""
    import runpy

    from osworld_jax.data import load_task_refs, verify_sha256sums

    run_dir, _ = learning_run
    tasks = run_dir.parent / "tasks"
    calib = tmp_path / "calib.jsonl"
    argv = [
        "evaluate.py",
        "--gin_file=default.gin",
        *(f"--gin_param={p}" for p in LEARN),
        f"--model_path={run_dir / 'base_model'}",
        f"--task_set={tasks}",
        "--reps=8",
        f"--out={calib}",
        f"--run_dir={tmp_path / 'eval'}",
    ]
    for script, args in [
        ("evaluate.py", argv),
        (
            "freeze_band.py",
            [
                "freeze_band.py",
                f"--calibration={calib}",
                f"--task_dir={tasks}",
                f"--out_dir={tmp_path / 'band'}",
                "--reps=8",
                "--num_repeats=2",
            ],
        ),
    ]:
        old, sys.argv = sys.argv, args
        try:
            with pytest.raises(SystemExit) as code:
                runpy.run_path(str(REPO / "scripts" / script), run_name="__main__")
        finally:
            sys.argv = old
        assert code.value.code == 0, capsys.readouterr()
    lines = [json.loads(x) for x in calib.read_text().splitlines()]
    assert sorted(x["task_id"] for x in lines) == [f"vowel-{i}" for i in range(4)]
    assert all(x["reps"] == 8 and x["failed"] == 0 for x in lines)
    rate = sum(x["passes"] for x in lines) / 32
    print("untrained pass rate", rate, [x["passes"] for x in lines])
    assert rate < 0.5  # the untrained model (cf. the learning test's first steps)
    band = [x["task_id"] for x in lines if 0 < x["passes"] < 8]
    assert band, lines
    verify_sha256sums(tmp_path / "band")
    refs = load_task_refs(tmp_path / "band")
    assert sorted({r.task_id for r in refs}) == sorted(band) and len(refs) == 2 * len(band)


@pytest.mark.slow
def test_two_process_run_matches_one_process(learning_run, tmp_path):
    """DistributedConfig with 2 processes x 1 CPU device (gloo): process 0 rolls out and
    broadcasts; both train their half of the rows (mesh data=2), checkpoint and export.
    Process 1 reaches each export after process 0 wrote it (mp_train_worker.py): before the
    fix it then skipped the export's barrier and hung (issue 16 item 15)."""
    import socket

    tasks = learning_run[0].parent / "tasks"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    run_dir = tmp_path / "run"
    env = dict(os.environ)  # the worker sets its device count in XLA_FLAGS
    env["OSWORLD_JAX_TEST_RUN"] = str(run_dir)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests" / "rl" / "mp_train_worker.py"),
                str(run_dir),
                str(tasks),
                "3",
                coordinator,
                str(i),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=480)[0].decode() for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    w0, w1 = (json.loads((run_dir / f"worker_{i}.json").read_text()) for i in range(2))
    assert (w0["process_count"], w0["steps"], w1["steps"]) == (2, [1, 2, 3], [])
    one_process = [h["reward/mean"] for h in learning_run[1].history[:3]]
    assert w0["rewards"][0] == one_process[0]  # same weights, same sampling seeds
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in records:  # the broadcast batch trained both halves; every refit took
        assert r["gate/rejected_fraction"] == 0.0
        assert r["logprob/train_rollout_abs_diff"] < 1e-3
    assert (run_dir / "checkpoints" / "3").is_dir()
    assert (run_dir / "weights" / "step_00000003" / "tokenizer.json").is_file()
    assert not _live_processes_mentioning(str(run_dir))
