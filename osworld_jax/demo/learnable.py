"""The learning demo's task suite: real machinery, a toy reward a random tiny model can learn.

A random tiny model samples near-uniformly over its ~1k-token vocabulary, so no real desktop
task is solvable by it (the default run's reward is 0, as expected). This suite keeps
everything real (OSWorld-format tasks, AgentEnv, the in-process memory desktop with
fork-by-copy, the agent's prompting, the embedded server's sampling, GRPO, the train step with
router replay, the weight refit) and only changes the reward.

**The toy reward**: an episode scores 1 iff the model's one-token reply starts with a
lowercase vowel (a, e, i, o, u), else 0. About 19% of the tiny tokenizer's tokens decode to
text that starts with one, so the reward begins near 0.2 and rises towards 1 as the policy
moves probability mass onto those tokens. ``scripts/demo_learning.py`` runs it; the slow
learning test (``tests/rl/test_slow.py``) checks the same curve.
"""

from __future__ import annotations

import json
from pathlib import Path

from osworld_jax.env import BACKENDS, Action, Task
from osworld_jax.testing.memory import MemoryBackend, MemoryDesktop, MemorySandbox

BACKEND = "memory-vowel"
VOWELS = "aeiou"


def vowel_reward(text: str) -> float:
    """1.0 iff ``text`` starts with a lowercase vowel."""
    return float(text[:1] in VOWELS) if text else 0.0


class VowelSandbox(MemorySandbox):
    """A memory sandbox whose evaluation scores the reply text (see the module docstring).

    A one-token reply never parses as an action (``UNPARSED``); ``scores_replies`` asks
    `AgentEnv` to hand the evaluation that reply when no action ran (real backends see only the
    actions run, as upstream OSWorld).
    """

    scores_replies = True

    async def evaluate(self, last_action: Action | None) -> float:
        """The toy reward of the reply (`vowel_reward`)."""
        return vowel_reward(last_action.text if last_action is not None else "")


class VowelBackend(MemoryBackend):
    """``memory`` with `VowelSandbox` sandboxes."""

    name = BACKEND

    def _new(self, task: Task, desktop: MemoryDesktop) -> MemorySandbox:
        sid = f"{BACKEND}-{next(self._ids)}"
        sb = VowelSandbox(self, sid, task, desktop)
        self._live[sid] = sb
        return sb


if BACKEND not in BACKENDS:
    BACKENDS.add(BACKEND, VowelBackend)


#: The demo's bindings over ``configs/default.gin`` (with ``DataConfig.task_set`` = the tasks of
#: `write_tasks`): the text model, one turn of one token, 2 prompts x 8 owners, and a higher
#: learning rate than the recipes' 5e-6 so that the tiny model learns in a few CPU minutes.
STEPS = 18
BINDINGS = (
    "ModelSourceConfig.tiny_kind = 'qwen3_moe'",
    "AgentConfig.max_screenshots = 0",
    f"ExperimentConfig.sandbox = '{BACKEND}'",
    "AgentEnvConfig.max_turns = 1",
    "SamplingParams.max_new_tokens = 1",
    "AgentConfig.a11y_max_chars = 0",
    "AgentConfig.terminal_max_chars = 0",
    "AgentConfig.system_prompt = 'Answer with one word.'",
    "CompactionConfig.max_context_tokens = 1024",
    "CompactionConfig.reserved_generation_tokens = 16",
    "RLConfig.num_prompts = 2",
    "RLConfig.num_owners = 8",
    f"RLConfig.steps = {STEPS}",
    "RLConfig.length_buckets = (128,)",
    "RLConfig.progress_bar = False",
    "OptimizerConfig.learning_rate = 2e-2",
    "CheckpointConfig.save_every = 6",
)


def write_tasks(root: Path, n: int = 4) -> Path:
    """Writes ``n`` OSWorld-format tasks (no set-up) into ``root``; returns ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        task = {
            "id": f"vowel-{i}",
            "snapshot": "memory",
            "instruction": f"Task {i}: answer with one word that starts with a vowel.",
            "source": "osworld_jax/demo/learnable.py",
            "config": [],
            "evaluator": {
                "func": "exact_match",
                "result": {"type": "vm_command_line", "command": ["true"]},
                "expected": {"type": "rule", "rules": {"expected": ""}},
            },
        }
        (root / f"vowel-{i}.json").write_text(json.dumps(task, indent=1))
    return root
