"""Helpers of the tests that run ``scripts/train.py`` as a user does (a subprocess).

``QUICK`` is a light configuration of the real pipeline (tiny model, embedded server, the
in-process ``memory`` sandboxes, one-token replies) for tests about the run itself (its
directory, its failures, its processes) rather than about learning.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rl import learnable

REPO = Path(__file__).resolve().parents[2]
MARKER = "OSWORLD_JAX_TEST_RUN"  # inherited by every process a run starts

QUICK = [
    # The text model (configs/text_only.gin's bindings): these runs test the loop, not pixels.
    "ModelSourceConfig.tiny_kind = 'qwen3_moe'",
    "AgentConfig.max_screenshots = 0",
    "ExperimentConfig.sandbox = 'memory'",
    "AgentEnvConfig.max_turns = 1",
    "SamplingParams.max_new_tokens = 1",
    "AgentConfig.a11y_max_chars = 0",
    "AgentConfig.terminal_max_chars = 0",
    "AgentConfig.system_prompt = 'Answer with one word.'",
    "CompactionConfig.max_context_tokens = 1024",
    "CompactionConfig.reserved_generation_tokens = 16",
    "RLConfig.num_prompts = 2",
    "RLConfig.num_owners = 2",
    "RLConfig.length_buckets = (128,)",
    "RLConfig.progress_bar = False",
    "CheckpointConfig.save_every = 1",
]


def quick_tasks(root: Path) -> Path:
    """The learnable suite's task files (plain OSWorld format) under ``root/tasks``."""
    return learnable.write_tasks(root / "tasks")


def train_cmd(run_dir: Path, *args: str, steps: int | None = None) -> list[str]:
    """``python scripts/train.py --run_dir=... [--steps=N] ARGS``."""
    cmd = [sys.executable, str(REPO / "scripts" / "train.py"), f"--run_dir={run_dir}"]
    if steps is not None:
        cmd.append(f"--steps={steps}")
    return [*cmd, *args]


def quick_args(tasks: Path, *extra: str) -> list[str]:
    """``--gin_param`` flags of `QUICK` on ``tasks`` plus ``extra`` bindings."""
    params = [*QUICK, f"DataConfig.task_set = '{tasks}'", *extra]
    return [f"--gin_param={p}" for p in params]


def run_env(run_dir: Path) -> dict[str, str]:
    """The environment of a test run: unbuffered, and marked so its processes can be found."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", MARKER: str(run_dir)}


def live_processes_mentioning(text: str) -> list[tuple[int, str]]:
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


class Tmpfs:
    """Size-limited tmpfs mounts under a test's directory, unmounted at the end (needs root).

    ``mount(path, size, read_only)`` skips the test where mounting is impossible (not root);
    CI runs as root, so there it always runs.
    """

    def __init__(self) -> None:
        self.mounted: list[Path] = []

    def mount(self, path: Path, size: str = "64m", *, read_only: bool = False) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        opts = f"size={size}" + (",ro" if read_only else "")
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True
        )
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here (needs root, as CI runs): {r.stderr.strip()}")
        self.mounted.append(path)
        return path

    def remount_read_only(self, path: Path) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)

    def unmount_all(self) -> None:
        for path in reversed(self.mounted):
            subprocess.run(["umount", "-l", str(path)], check=False)
        self.mounted.clear()
