"""Two JAX processes on loopback (gloo CPU collectives, 4 devices each) == one process with 8.

Both runs execute tests/scale/mp_worker.py: the real ``Trainer.train_step`` on the tiny MoE
policy, mesh ``fsdp=2 x expert=2 x tensor=2`` over all 8 devices, for two steps (step 1's batch
broadcast from process 0, step 2's assembled from per-process parts), then an orbax save and
restore by every process and a process-0 HF export. The worker processes are spawned here with
bounded timeouts and report through files.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("mp_worker.py")
REPO = WORKER.parents[2]
TIMEOUT_S = 420

# Float32 end to end; the only difference between the runs is where XLA splits the collective
# reductions (gloo across processes vs in-process), i.e. summation order: a few ulps of the
# O(1) losses and of the 1e-3-sized updates.
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
PARAM_TOL = dict(rtol=1e-5, atol=1e-6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(out: Path, devices: int, log: Path, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # XLA_FLAGS: worker
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"  # XLA's SPMD partitioner warnings
    cmd = [sys.executable, str(WORKER), "--out", str(out), "--devices", str(devices), *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait_all(procs: dict[str, tuple[subprocess.Popen, Path]]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for name, (proc, log) in procs.items():
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name}: no result after {TIMEOUT_S} s; log tail:\n{_tail(log)}")
            if rc != 0:
                pytest.fail(f"{name}: exit code {rc}; log tail:\n{_tail(log)}")
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _tail(log: Path, n: int = 40) -> str:
    lines = [x for x in log.read_text().splitlines() if "spmd_partitioner" not in x]
    return "\n".join(lines[-n:])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("multiprocess")
    one, two = base / "one_process", base / "two_processes"
    one.mkdir()
    two.mkdir()
    port = str(_free_port())
    t0 = time.monotonic()
    procs = {"reference (1 x 8 devices)": (_spawn(one, 8, base / "ref.log"), base / "ref.log")}
    for pid in range(2):
        log = base / f"p{pid}.log"
        procs[f"process {pid} of 2"] = (
            _spawn(
                two,
                4,
                log,
                "--num-processes=2",
                f"--process-id={pid}",
                f"--coordinator=127.0.0.1:{port}",
            ),
            log,
        )
    _wait_all(procs)
    print(f"multi-process runs: {time.monotonic() - t0:.1f} s")
    load = lambda d, i: json.loads((d / f"metrics_{i}.json").read_text())
    return {
        "one": load(one, 0),
        "p0": load(two, 0),
        "p1": load(two, 1),
        "one_params": dict(np.load(one / "params.npz")),
        "two_params": dict(np.load(two / "params.npz")),
        "one_dir": one,
        "two_dir": two,
    }


@pytest.mark.slow
def test_two_processes_are_one_job(runs):
    for p in ("p0", "p1"):
        assert runs[p]["process_count"] == 2
    assert (runs["p0"]["process_index"], runs["p1"]["process_index"]) == (0, 1)
    assert runs["one"]["process_count"] == 1
    # Only process 0 ran the rollout of step 1.
    assert runs["p0"]["produced_step1"] and not runs["p1"]["produced_step1"]
    # initialize_distributed is idempotent, and refuses to re-join as another process.
    assert runs["p0"]["refused_other_values"] and runs["p1"]["refused_other_values"]
    # Every process ran the same SPMD program: identical metrics, identical assembled batches.
    assert runs["p0"]["metrics"] == runs["p1"]["metrics"]
    assert runs["p0"]["digest"] == runs["p1"]["digest"] == runs["one"]["digest"]


@pytest.mark.slow
def test_losses_equal_one_process(runs):
    one, two = runs["one"]["metrics"], runs["p0"]["metrics"]
    for a, b in zip(one, two, strict=True):
        print(
            f"step {a['step'] + 1}: loss 1 process {a['loss']:.9g}, 2 processes {b['loss']:.9g}, "
            f"|diff| {abs(a['loss'] - b['loss']):.3g}; grad_norm |diff| "
            f"{abs(a['grad_norm'] - b['grad_norm']):.3g}"
        )
    assert [m["step"] for m in one] == [m["step"] for m in two] == [0, 1]
    for step, (a, b) in enumerate(zip(one, two, strict=True)):
        assert a.keys() == b.keys()
        for key in ("loss", "policy_loss", "grad_norm", "entropy", "binary_kl_mean"):
            np.testing.assert_allclose(b[key], a[key], err_msg=f"step {step}: {key}", **LOSS_TOL)
        assert a["loss_tokens"] == b["loss_tokens"]
    assert one[0]["loss"] != one[1]["loss"]  # two different batches, two real updates


@pytest.mark.slow
def test_parameter_updates_equal_one_process(runs):
    a, b = runs["one_params"], runs["two_params"]
    assert a.keys() == b.keys()
    params = [k for k in a if k.startswith("init/")]
    assert len(params) > 10
    worst = {"step1": [0.0, 0.0], "step2": [0.0, 0.0]}  # max |update diff|, max |update|
    for k in params:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"initial {k}")
        for step in ("step1", "step2"):
            name = k.replace("init/", f"{step}/", 1)
            update_a, update_b = a[name] - a[k], b[name] - b[k]
            assert np.abs(update_a).max() > 0, f"{name}: no update"
            worst[step][0] = max(worst[step][0], float(np.abs(update_b - update_a).max()))
            worst[step][1] = max(worst[step][1], float(np.abs(update_a).max()))
            np.testing.assert_allclose(update_b, update_a, err_msg=name, **PARAM_TOL)
            np.testing.assert_allclose(b[name], a[name], err_msg=name, **PARAM_TOL)
    for step, (diff, size) in worst.items():
        print(
            f"{step}: max |update(2 processes) - update(1 process)| {diff:.3g} "
            f"(max |update| {size:.3g})"
        )


@pytest.mark.slow
def test_every_process_saves_and_restores(runs):
    for run in ("one", "p0", "p1"):
        assert runs[run]["restored_step"] == 2
    b = runs["two_params"]
    for k in b:
        if k.startswith("step2/"):
            np.testing.assert_array_equal(b[k.replace("step2/", "restored/", 1)], b[k], err_msg=k)
        if k.startswith("step2_opt/"):
            np.testing.assert_array_equal(b[k.replace("step2_opt/", "restored_opt/", 1)], b[k])
    # The two-process checkpoint holds the same train state as the one-process one.
    a = runs["one_params"]
    for k in a:
        if k.startswith("restored"):
            np.testing.assert_allclose(b[k], a[k], err_msg=k, **PARAM_TOL)


@pytest.mark.slow
def test_process0_exports_the_gathered_parameters(runs):
    from safetensors.numpy import load_file

    def tensors(d: Path) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for f in sorted((d / "hf").glob("*.safetensors")):
            out |= load_file(f)
        return out

    a, b = tensors(runs["one_dir"]), tensors(runs["two_dir"])
    assert a and a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(b[k], a[k], err_msg=k, **PARAM_TOL)
