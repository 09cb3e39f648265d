"""The ``memory`` sandbox backend: a tiny simulated desktop in this process (no X, no jail).

``MemoryBackend`` (``BACKENDS`` name ``"memory"``) implements the sandbox interface over
``MemoryDesktop`` (``osworld_jax.testing.memory_desktop``: a dict filesystem, a small command
interpreter, a text editor; agent code is read, never executed), so AgentEnv, the agent room and
the RL loop run fast and deterministically, with tasks scored through the normal
setup/getter/metric path.

``word_task(word)`` builds the learnable task family: "type WORD"; the reward is 1 iff the text
typed into the (auto-saving) editor equals ``word`` (``vm_command_line`` + ``exact_match``).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import os
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from osworld_jax.env.actions import Action, ActionKind, to_pyautogui
from osworld_jax.env.backend import (
    Observation,
    Sandbox,
    SandboxBackend,
    SandboxCreateError,
    SandboxError,
    SandboxStepError,
)
from osworld_jax.env.evaluators import evaluate_task
from osworld_jax.env.setup import SetupContext, run_setup
from osworld_jax.env.tasks import Task, load_task
from osworld_jax.testing.memory_desktop import EDITORS, HOME, MemoryDesktop


async def _no_sleep(seconds: float) -> None:
    await asyncio.sleep(0)


# ------------------------------------------------------------------------------- backend


class MemorySandbox(Sandbox):
    """One ``MemoryDesktop`` for one task."""

    def __init__(self, backend: MemoryBackend, sid: str, task: Task, desktop: MemoryDesktop):
        self.id = sid
        self.task = task
        self.desktop = desktop
        self._backend = backend

    async def observe(self) -> Observation:  # noqa: D102
        d = self.desktop
        return Observation(
            screenshot=d.png(),
            a11y_tree=d.a11y(),
            terminal=d.terminal_text,
            instruction=self.task.instruction,
        )

    async def step(self, action: Action) -> Observation:  # noqa: D102
        if self.id not in self._backend._live:
            raise SandboxStepError(f"sandbox {self.id} is closed")
        if action.kind == ActionKind.PYAUTOGUI:
            self.desktop.act(action.code)
        elif action.kind == ActionKind.COMPUTER_13:
            self.desktop.act(to_pyautogui(action))
        return await self.observe()

    async def evaluate(self, last_action: Action | None) -> float:  # noqa: D102
        return await evaluate_task(
            self.task,
            self.desktop,
            last_action,
            cache_dir=self._backend.cache_dir,
            attempts=1,
            sleep=_no_sleep,
        )

    async def close(self) -> None:  # noqa: D102
        self._backend._live.pop(self.id, None)


def _programs(command: Any) -> list[str]:
    """The program of each command in ``command`` (a list: argv; a string: a shell line).

    A shell line is split at ``;``, ``&&``, ``||`` and ``|`` outside quotes (``python -c
    "a; b"`` is one command); a line whose quotes do not close (shell-invalid) is split at
    the operators and whitespace, quotes or not, instead of failing.
    """
    if not isinstance(command, str):
        return [str(command[0])] if command else []
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # "No closing quotation": split at the operators, quotes or not
        tokens = [w for part in re.split(r"(&&|\|\||[;|])", command) for w in part.split()]
    programs, start = [], True
    for t in tokens:
        if t and set(t) <= set(";&|"):
            start = True
        elif start:
            programs.append(t)
            start = False
    return programs


class MemoryBackend(SandboxBackend[MemorySandbox]):
    """Sandboxes on ``MemoryDesktop`` (see the module docstring); fork = a deep copy.

    Attributes:
      cache_dir: the local file cache for ``download`` steps.
      screenshot_px: the side of the (square) screenshot PNG.
    """

    name = "memory"
    sandbox_type = MemorySandbox

    def __init__(self, *, cache_dir: str | None = None, screenshot_px: int = 32) -> None:
        self.cache_dir = cache_dir
        self.screenshot_px = screenshot_px
        self._live: dict[str, MemorySandbox] = {}
        self._ids = itertools.count()

    @classmethod
    def capability_reasons(cls, task: Task, config: object | None = None) -> list[str]:
        """What this tiny desktop cannot express for ``task`` (programs it does not have).

        ``config`` (the ``capabilities`` hook's) changes nothing here.
        """
        reasons = []
        probe = MemoryDesktop()
        commands: list[Any] = []
        for s in (*task.config, *task.evaluator.postconfig):
            if s.type in ("launch", "execute", "command"):
                commands.append(s.parameters.get("command"))
        for g in (*task.evaluator.result, *task.evaluator.expected):
            if g is not None and g.type in ("vm_command_line", "vm_command_error"):
                commands.append(g.params.get("command"))
        for c in commands:
            for program in _programs(c):
                if program not in EDITORS and not hasattr(probe, f"_c_{program.replace('-', '_')}"):
                    reasons.append(f"memory desktop has no program {program!r}")
        return list(dict.fromkeys(reasons))

    def preflight(self, tasks: Sequence[Task] | None = None) -> None:  # noqa: D102
        return None  # nothing external to check

    def _new(self, task: Task, desktop: MemoryDesktop) -> MemorySandbox:
        sid = f"memory-{next(self._ids)}"
        sb = MemorySandbox(self, sid, task, desktop)
        self._live[sid] = sb
        return sb

    async def create(self, task: Task) -> MemorySandbox:  # noqa: D102
        desktop = MemoryDesktop(shot=self.screenshot_px)
        ctx = SetupContext(
            cache_dir=self.cache_dir,
            task_id=task.id,
            base_dir=task.path.parent if task.path is not None else None,
            sleep=_no_sleep,
        )
        try:
            await run_setup(task.config, desktop, ctx=ctx)
        except SandboxError:
            raise
        except Exception as e:  # noqa: BLE001 - a setup failure is a create failure
            raise SandboxCreateError(f"memory create({task.id}): {type(e).__name__}: {e}") from e
        return self._new(task, desktop)

    async def _fork(self, sandbox: MemorySandbox, n: int) -> list[MemorySandbox]:  # noqa: D102
        return [self._new(sandbox.task, copy.deepcopy(sandbox.desktop)) for _ in range(n)]

    def inventory(self) -> list[str]:  # noqa: D102
        return sorted(self._live)


# ------------------------------------------------------------------------------- tasks


def word_task_dict(word: str, *, task_id: str | None = None) -> dict[str, Any]:
    """The OSWorld JSON object of ``word_task(word)`` (see there)."""
    path = f"{HOME}/answer.txt"
    return {
        "id": task_id or f"memory-word-{word}",
        "snapshot": "memory",
        "instruction": f"Type the word {word} into the open editor.",
        "source": "osworld_jax.testing.memory.word_task",
        "config": [{"type": "launch", "parameters": {"command": ["memory-editor", path]}}],
        "evaluator": {
            "func": "exact_match",
            "result": {"type": "vm_command_line", "command": ["cat", path]},
            "expected": {"type": "rule", "rules": {"expected": word}},
        },
        "related_apps": ["memory-editor"],
        "proxy": False,
        "fixed_ip": False,
        "possibility_of_env_change": "low",
    }


def write_word_tasks(root: str | os.PathLike[str], words: Sequence[str]) -> Path:
    """Writes ``word_task`` JSON files to ``root/memory_word/<id>.json`` (a task directory for
    the data pipeline); returns ``root``.
    """  # noqa: D205
    out = Path(root) / "memory_word"
    out.mkdir(parents=True, exist_ok=True)
    for w in words:
        d = word_task_dict(w)
        (out / f"{d['id']}.json").write_text(json.dumps(d, indent=2) + "\n")
    return Path(root)


def word_task(word: str, *, task_id: str | None = None) -> Task:
    """The learnable family: "type WORD"; reward 1 iff the editor's text equals ``word``.

    Solved in one turn by ``pyautogui.typewrite('WORD')`` — or, on this desktop, the bare
    ``typewrite('WORD')``/``write('WORD')``, or computer_13 ``TYPING`` — and scored by
    ``vm_command_line`` (``cat`` of the auto-saved file) + ``exact_match``.
    """
    return load_task(word_task_dict(word, task_id=task_id))
