import hashlib
import json
from pathlib import Path

import pytest

from osworld_jax.data import (
    DataConfig,
    DataError,
    FreezeError,
    freeze_band,
    load_task_refs,
    make_task_stream,
    verify_sha256sums,
)
from osworld_jax.data import freeze as freeze_mod


@pytest.fixture
def inputs(tmp_path):
    tasks = tmp_path / "tasks" / "examples" / "os"
    tasks.mkdir(parents=True)
    for tid in ["a", "b", "c", "d"]:
        (tasks / f"{tid}.json").write_text(json.dumps({"id": tid, "instruction": tid}))
    (tasks / "b").mkdir()
    (tasks / "b" / "input.txt").write_text("asset of b")
    # d references its asset by a path relative to its JSON (the bundled-task layout).
    (tasks / "assets" / "d").mkdir(parents=True)
    (tasks / "assets" / "d" / "data.txt").write_text("asset of d")
    (tasks / "assets" / "a.txt").write_text("asset of a (not admitted)")
    (tasks / "d.json").write_text(
        json.dumps(
            {
                "id": "d",
                "instruction": "d",
                "config": [
                    {
                        "type": "download",
                        "parameters": {
                            "files": [{"url": "assets/d/data.txt", "path": "/home/user/data.txt"}]
                        },
                    }
                ],
            }
        )
    )
    calib = tmp_path / "calib.jsonl"
    # a: never solved, b: 2/4, c: always solved, d: 1/4  -> band (0 < k < 4) = {b, d}
    rows = [("a", 0), ("b", 2), ("c", 4), ("d", 1)]
    calib.write_text(
        "".join(json.dumps({"task_id": t, "reps": 4, "passes": k}) + "\n" for t, k in rows)
    )
    return calib, tmp_path / "tasks", tmp_path / "band"


def test_freeze_publishes_a_verified_snapshot(inputs):
    calib, task_dir, out = inputs
    assert freeze_band(calib, task_dir, out, reps=4, num_repeats=2) == out
    assert not list(out.parent.glob(".band.tmp-*"))
    lines = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    assert [(x["task_id"], x["group_id"]) for x in lines] == [
        ("b", "rlvr-band:b:repeat:0"),
        ("d", "rlvr-band:d:repeat:0"),
        ("b", "rlvr-band:b:repeat:1"),
        ("d", "rlvr-band:d:repeat:1"),
    ]
    assert (out / "tasks/examples/os/b/input.txt").read_text() == "asset of b"
    assert (out / "tasks/examples/os/assets/d/data.txt").read_text() == "asset of d"
    assert not (out / "tasks/examples/os/assets/a.txt").exists()
    assert not (out / "tasks/examples/os/a.json").exists()
    snap = json.loads((out / "SNAPSHOT.json").read_text())
    assert snap["counts"]["admitted"] == 2 and snap["counts"]["train_rows"] == 4
    assert snap["counts"]["rejected_low"] == 1 and snap["counts"]["rejected_high"] == 1
    assert snap["counts"]["admitted_mean_pass_rate"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert snap["inputs"]["calibration"]["sha256"] == hashlib.sha256(calib.read_bytes()).hexdigest()
    assert snap["admitted"] == ["b", "d"]
    verify_sha256sums(out)
    # Training reads the frozen directory as a task set, repeats and group ids included.
    refs = load_task_refs(out)
    assert [r.group_id for r in refs] == [x["group_id"] for x in lines]
    assert json.loads(open(refs[0].path).read())["id"] == "b"
    stream = make_task_stream(DataConfig(task_set=str(out)), 4, process_index=0, process_count=1)
    assert sorted(r.group_id for r in next(stream)) == sorted(x["group_id"] for x in lines)


def test_tampered_snapshot_fails_verification(inputs):
    calib, task_dir, out = inputs
    freeze_band(calib, task_dir, out)
    p = out / "tasks/examples/os/d.json"
    p.chmod(0o644)
    p.write_text('{"id": "d", "instruction": "changed"}')
    with pytest.raises(DataError, match="d.json changed"):
        verify_sha256sums(out)
    with pytest.raises(DataError, match="changed"):
        make_task_stream(DataConfig(task_set=str(out)), 1, process_index=0, process_count=1)


def test_band_bounds_are_configurable(inputs):
    calib, task_dir, out = inputs
    freeze_band(calib, task_dir, out, low=1, high=5)  # 1 < k < 5 -> {b, c}
    assert json.loads((out / "SNAPSHOT.json").read_text())["admitted"] == ["b", "c"]


def test_refuses_when_an_input_changes_during_the_freeze(inputs, monkeypatch):
    calib, task_dir, out = inputs
    real_copy = freeze_mod._copy_file

    def copy_then_edit_calibration(src, dst):
        real_copy(src, dst)
        calib.write_text(calib.read_text() + "\n")

    monkeypatch.setattr(freeze_mod, "_copy_file", copy_then_edit_calibration)
    with pytest.raises(FreezeError, match="changed during the freeze"):
        freeze_band(calib, task_dir, out)
    assert not out.exists()
    assert not list(out.parent.glob(".band.tmp-*"))


def test_refuses_bad_inputs(inputs):
    calib, task_dir, out = inputs
    out.mkdir()
    with pytest.raises(FreezeError, match="already exists"):
        freeze_band(calib, task_dir, out)
    out.rmdir()
    with pytest.raises(FreezeError, match="reps=8"):
        freeze_band(calib, task_dir, out, reps=8)
    calib.write_text(calib.read_text() + json.dumps({"task_id": "zz", "reps": 4, "passes": 1}))
    with pytest.raises(FreezeError, match="zz"):
        freeze_band(calib, task_dir, out)
    calib.write_text(json.dumps({"task_id": "a", "reps": 4, "passes": 5}) + "\n")
    with pytest.raises(FreezeError, match=r"calib.jsonl:1: passes 5"):
        freeze_band(calib, task_dir, out)
    calib.write_text(json.dumps({"task_id": "a", "reps": 4, "passes": 0}) + "\n")
    with pytest.raises(FreezeError, match="no task inside the band"):
        freeze_band(calib, task_dir, out)
    assert not out.exists()


def test_bundled_tasks_freeze_with_their_assets(tmp_path):
    from osworld_jax.env import bundled_tasks_dir

    refs = load_task_refs(bundled_tasks_dir())
    assert len(refs) >= 20
    calib = tmp_path / "calib.jsonl"
    calib.write_text(
        "".join(
            json.dumps({"task_id": r.task_id, "reps": 4, "passes": i % 5}) + "\n"
            for i, r in enumerate(refs)
        )
    )
    out = freeze_band(calib, bundled_tasks_dir(), tmp_path / "band", reps=4, num_repeats=3)
    verify_sha256sums(out)
    snap = json.loads((out / "SNAPSHOT.json").read_text())
    admitted = {r.task_id for i, r in enumerate(refs) if 0 < i % 5 < 4}
    assert set(snap["admitted"]) == admitted
    frozen = load_task_refs(out)
    assert len(frozen) == 3 * len(admitted)
    # Every admitted task that downloads a bundled asset has it in the frozen copy.
    from osworld_jax.env import load_task

    for ref in frozen[: len(admitted)]:
        task = load_task(ref.path)
        for step in task.config:
            for f in step.parameters.get("files", []) if step.type == "download" else []:
                url = f["url"]
                if "://" not in url:
                    assert (Path(ref.path).parent / url).is_file(), (ref.task_id, url)


def test_freeze_band_script(tmp_path, inputs, capsys):
    import runpy
    import sys

    calib, task_dir, out = inputs
    argv = [
        "freeze_band.py",
        f"--calibration={calib}",
        f"--task_dir={task_dir}",
        f"--out_dir={out}",
        "--reps=4",
        "--num_repeats=2",
    ]
    script = Path(__file__).resolve().parents[2] / "scripts" / "freeze_band.py"
    old = sys.argv
    sys.argv = argv
    try:
        with pytest.raises(SystemExit) as code:
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = old
    assert code.value.code == 0
    assert "froze 2/4 tasks (4 train rows)" in capsys.readouterr().out
    sys.argv = argv
    try:
        with pytest.raises(SystemExit) as code:
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = old
    assert code.value.code == 2  # the dataset exists: refused (a bad value: exit 2)
    assert "already exists" in capsys.readouterr().err
