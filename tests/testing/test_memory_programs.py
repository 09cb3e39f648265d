"""The memory backend's capability check reads every program of a task's shell commands."""

from __future__ import annotations

import json
from pathlib import Path

from osworld_jax.env import load_task
from osworld_jax.testing.memory import MemoryBackend, _programs


def test_programs_split_at_shell_operators_outside_quotes():
    assert _programs('cd /tmp && python -c "a; b" | grep x; ls') == ["cd", "python", "grep", "ls"]
    assert _programs(["python3", "-c", "import os; os.exit(0)"]) == ["python3"]
    assert _programs([]) == []


def test_an_unclosed_quote_is_split_at_whitespace_not_raised():
    # 207 of the 369 upstream tasks hold such a line (a quote opened before a ';').
    assert _programs("echo 'it's; done") == ["echo", "done"]


def test_capability_reasons_of_a_task_with_an_unclosed_quote(tmp_path: Path):
    task = {
        "id": "t",
        "snapshot": "memory",
        "instruction": "x",
        "source": "test",
        "config": [{"type": "execute", "parameters": {"command": "frobnicate 'it's; done"}}],
        "evaluator": {
            "func": "exact_match",
            "result": {"type": "vm_command_line", "command": ["true"]},
            "expected": {"type": "rule", "rules": {"expected": ""}},
        },
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(task))
    reasons = MemoryBackend.capability_reasons(load_task(path))
    assert "memory desktop has no program 'frobnicate'" in reasons


def test_report_prints_no_empty_headings_when_every_task_runs(tmp_path: Path):
    from osworld_jax.env.capabilities import report

    task = {
        "id": "t",
        "snapshot": "memory",
        "instruction": "x",
        "source": "test",
        "config": [],
        "evaluator": {
            "func": "exact_match",
            "result": {"type": "vm_command_line", "command": ["true"]},
            "expected": {"type": "rule", "rules": {"expected": ""}},
        },
    }
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "t.json").write_text(json.dumps(task))
    text = report(tmp_path, "memory")
    assert "runnable=1" in text.splitlines()[0]
    assert "reason kinds" not in text and "most common specific" not in text
