"""A learnable task suite for the RL learning test, on the env room's in-process memory desktop.

A random tiny model samples near-uniformly over its ~1k-token vocabulary, so no real desktop
task is solvable by it. This suite keeps everything real (tasks, AgentEnv, the memory desktop
with fork-by-copy, the agent's prompting, the server's sampling) and only changes the reward:
an episode scores 1 iff the model's reply starts with a lowercase vowel. About 19% of the tiny
tokenizer's tokens decode to text that starts with one, so a one-token reply begins near 0.2
and the policy has to move probability mass onto those tokens to improve.
"""

from __future__ import annotations

import json
from pathlib import Path

from osworld_jax.env import BACKENDS, Action
from osworld_jax.testing.memory import MemoryBackend, MemorySandbox

BACKEND = "memory-vowel"
VOWELS = "aeiou"


def vowel_reward(text: str) -> float:
    """1.0 iff ``text`` starts with a lowercase vowel."""
    return float(text[:1] in VOWELS) if text else 0.0


class VowelSandbox(MemorySandbox):
    """A memory sandbox whose evaluation scores the reply text (see the module docstring)."""

    async def evaluate(self, last_action: Action | None) -> float:
        return vowel_reward(last_action.text if last_action is not None else "")


class VowelBackend(MemoryBackend):
    """``memory`` with `VowelSandbox` sandboxes."""

    name = BACKEND

    def _new(self, task, desktop):
        sid = f"{BACKEND}-{next(self._ids)}"
        sb = VowelSandbox(self, sid, task, desktop)
        self._live[sid] = sb
        return sb


if BACKEND not in BACKENDS:
    BACKENDS.add(BACKEND, VowelBackend)


def write_tasks(root: Path, n: int = 4) -> Path:
    """Writes ``n`` OSWorld-format tasks (no set-up) into ``root``; returns ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        task = {
            "id": f"vowel-{i}",
            "snapshot": "memory",
            "instruction": f"Task {i}: answer with one word that starts with a vowel.",
            "source": "tests/rl/learnable.py",
            "config": [],
            "evaluator": {
                "func": "exact_match",
                "result": {"type": "vm_command_line", "command": ["true"]},
                "expected": {"type": "rule", "rules": {"expected": ""}},
            },
        }
        (root / f"vowel-{i}.json").write_text(json.dumps(task, indent=1))
    return root
