"""Text of the prompt: the system prompt (action space + output format) and observations.

The output formats are the OSWorld conventions that ``osworld_jax.env.actions.parse_action``
accepts: pyautogui code in a ```python``` block, a computer_13 action as one JSON dict in a
```json``` block, and the special actions ``WAIT``, ``DONE`` and ``FAIL`` alone on the reply's last
line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from osworld_jax.agent.config import AgentConfig
from osworld_jax.env.actions import ActionSpace
from osworld_jax.registry import check_choice

if TYPE_CHECKING:
    from osworld_jax.agent.tokenizer import AgentTokenizer
    from osworld_jax.env.backend import Observation

_SPECIAL_ACTIONS = """\
Special actions: instead of a code block, end your reply with the word alone on its last line:
- WAIT: wait a moment for the screen to change.
- DONE: the task is complete.
- FAIL: the task cannot be completed."""

_PYAUTOGUI = """\
You are an agent that operates a Linux desktop ({w}x{h} pixels) to complete a task.
At each step you receive an observation (accessibility tree, terminal output, and the screen when \
available) and answer with exactly one action.

Action space: pyautogui. Write python code that uses the `pyautogui` module to perform the action, \
in one ```python ... ``` code block. Use absolute screen coordinates read from the observation; \
`import pyautogui` and `time` may be used; never call `pyautogui.locateCenterOnScreen` or \
`pyautogui.screenshot()`. Each step's code runs on its own: do not rely on variables from earlier \
steps.

{special}

You may think briefly before the action; then give exactly one action: one code block, or one \
special action word on the last line."""

_COMPUTER_13 = """\
You are an agent that operates a Linux desktop ({w}x{h} pixels) to complete a task.
At each step you receive an observation (accessibility tree, terminal output, and the screen when \
available) and answer with exactly one action.

Action space: computer_13. Answer with one JSON object in a ```json ... ``` code block, \
{{"action_type": TYPE, "parameters": {{...}}}}, where TYPE and its parameters are one of:
- MOVE_TO {{"x", "y"}}; CLICK {{"button"?, "x"?, "y"?, "num_clicks"?}}; MOUSE_DOWN {{"button"?}};
- MOUSE_UP {{"button"?}}; RIGHT_CLICK {{"x"?, "y"?}}; DOUBLE_CLICK {{"x"?, "y"?}};
- DRAG_TO {{"x", "y"}}; SCROLL {{"dx", "dy"}}; TYPING {{"text"}}; PRESS {{"key"}};
- KEY_DOWN {{"key"}}; KEY_UP {{"key"}}; HOTKEY {{"keys": [..]}}.
Buttons are "left", "right" or "middle"; coordinates are absolute screen pixels.

{special}

You may think briefly before the action; then give exactly one action: one code block, or one \
special action word on the last line."""


def system_prompt(config: AgentConfig, action_space: str = "pyautogui") -> str:
    """The system prompt: the configured one, or the built-in one for ``action_space``.

    ``action_space`` is the env's (``AgentEnvConfig.action_space``: what the parser accepts).
    """
    if config.system_prompt is not None:
        return config.system_prompt
    check_choice(action_space, ActionSpace, "action_space", "action space")
    body = _PYAUTOGUI if action_space == "pyautogui" else _COMPUTER_13
    return body.format(w=config.screen_width, h=config.screen_height, special=_SPECIAL_ACTIONS)


def neutralize_special(text: str, special_tokens: Sequence[str]) -> str:
    """Breaks special-token strings inside observed text so they tokenise as plain text.

    A window title reading ``<|im_end|>`` must not end the user turn: a zero-width space is put
    after the first character of every special token string found in ``text``.
    """
    for tok in special_tokens:
        if len(tok) > 1 and tok in text:
            text = text.replace(tok, tok[0] + "\u200b" + tok[1:])
    return text


def trim_lines(text: str, max_chars: int) -> str:
    """Keeps the longest prefix of whole lines within ``max_chars`` and says what was cut.

    ``max_chars <= 0`` drops the text. A first line longer than the budget is cut mid-line.
    """
    if max_chars <= 0:
        return ""
    if len(text) <= max_chars:
        return text
    lines = text.splitlines()
    kept: list[str] = []
    used = 0
    for line in lines:
        if used + len(line) + 1 > max_chars:
            break
        kept.append(line)
        used += len(line) + 1
    if not kept:
        return lines[0][:max_chars] + f"\n[... truncated mid-line, {len(lines) - 1} more lines]"
    return "\n".join(kept) + f"\n[... {len(lines) - len(kept)} more lines truncated]"


def trim_tokens(text: str, max_tokens: int, tokenizer: AgentTokenizer) -> str:
    """Keeps whole lines of ``text`` within ``max_tokens`` tokens (0 = no cap)."""
    if max_tokens <= 0:
        return text
    ids = tokenizer.encode(text)
    if len(ids) <= max_tokens:
        return text
    # The decoded token prefix bounds the characters; cut back to a line boundary.
    prefix = tokenizer.decode(ids[:max_tokens], skip_special_tokens=False)
    return trim_lines(text, max(len(prefix.rsplit("\n", 1)[0]), 1))


#: Where a screenshot the prompt no longer shows was (``max_screenshots`` older ones drop).
SCREENSHOT_DROPPED = "(removed: the prompt shows only the last {k} screenshot(s))"


def render_observation(
    obs: Observation,
    config: AgentConfig,
    tokenizer: AgentTokenizer,
    *,
    a11y_max_chars: int | None = None,
    with_screenshot: bool = False,
) -> str:
    """The text of an observation's user turn: accessibility tree and terminal output.

    The screenshot is not text: the context manager puts it (or its placeholder) in front of
    this text as an image content part of the turn.

    Args:
      obs: the observation.
      config: prompting config (budgets).
      tokenizer: for the token budget of the a11y tree and the special-token list.
      a11y_max_chars: overrides ``config.a11y_max_chars`` (a compaction shrinks it on overflow).
      with_screenshot: a screenshot accompanies the text (then an observation without text
        renders as "" instead of "(no observation available)").

    Returns:
      The trimmed accessibility tree and the terminal tail.
    """
    budget = config.a11y_max_chars if a11y_max_chars is None else a11y_max_chars
    special = tokenizer.special_tokens
    parts: list[str] = []
    a11y = trim_lines(neutralize_special(obs.a11y_tree.strip(), special), budget)
    a11y = trim_tokens(a11y, config.a11y_max_tokens, tokenizer)
    if a11y:
        parts.append("Accessibility tree:\n" + a11y)
    terminal = obs.terminal.strip()
    if terminal and config.terminal_max_chars > 0:
        if len(terminal) > config.terminal_max_chars:
            terminal = "[...]\n" + terminal[-config.terminal_max_chars :]
        parts.append("Terminal output:\n" + neutralize_special(terminal, special))
    if not parts and not with_screenshot:
        parts.append("(no observation available)")
    return "\n\n".join(parts)


_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def summarize_action(reply: str, max_chars: int) -> str:
    """One line for the compact action history: the reply without thinking, cut to ``max_chars``.

    The last fenced code block is the action (the format the env parses); without one, the whole
    reply is used.
    """
    text = _THINK.sub("", reply)
    blocks = re.findall(r"```(?:\w+)?\s*(.*?)```", text, re.DOTALL)
    if blocks:
        text = blocks[-1]
    text = " ".join(text.split())
    if not text:
        text = "(empty reply)"
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def action_history_block(
    replies: Sequence[str], config: AgentConfig, *, first_step: int = 1
) -> str:
    """The compact history that replaces older turns after a compaction (declared in the text).

    ``first_step``: the episode step number of ``replies[0]`` (2 when the first observation
    is protected and stays verbatim before the history).
    """
    cfg = config.compaction
    n = len(replies)
    first = max(n - cfg.max_history_actions, 0)
    lines = [
        f"[Context compacted: {n} earlier step(s) are summarised by their actions; "
        "their observations were removed.]"
    ]
    if first:
        lines.append(f"(steps {first_step}-{first_step + first - 1} omitted)")
    for i in range(first, n):
        lines.append(f"{first_step + i}. {summarize_action(replies[i], cfg.max_action_chars)}")
    return "\n".join(lines)
