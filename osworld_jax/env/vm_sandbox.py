"""What every sandbox driven through the OSWorld in-VM protocol does the same way.

The ``local`` and ``remote`` backends differ in how a desktop is started, reached and
failed; once a ``VMProtocol`` client reaches it, observing and acting are one procedure:
observation = screenshot + a11y tree + terminal text fetched concurrently; a pyautogui or
computer_13 action runs as python code through ``/execute`` (a raising action is data, not an
infrastructure failure); WAIT sleeps; every non-terminal action is followed by a settle pause.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from osworld_jax.env.actions import Action, ActionKind, to_pyautogui
from osworld_jax.env.protocol import VMProtocol

#: Prepended to model code, as OSWorld's controller does (FAILSAFE off: corners are clickable).
PYAUTOGUI_PREFIX = "import pyautogui; import time; pyautogui.FAILSAFE = False; "


async def _empty() -> str:
    return ""


async def fetch_observation(
    vm: VMProtocol, *, a11y: bool, terminal: bool
) -> tuple[bytes, str, str]:
    """Fetches (screenshot PNG, a11y tree, terminal text) concurrently; "" for those not asked."""
    shot, tree, term = await asyncio.gather(
        vm.screenshot(),
        vm.accessibility() if a11y else _empty(),
        vm.terminal() if terminal else _empty(),
    )
    return shot, tree, term


async def perform_action(
    run_code: Callable[[str], Awaitable[Any]],
    action: Action,
    *,
    wait_action_s: float,
    settle_s: float,
) -> None:
    """Runs one parsed action through ``run_code`` (python in the desktop); DONE/FAIL do nothing.

    Args:
      run_code: runs python code in the desktop (with `PYAUTOGUI_PREFIX`), e.g. over ``/execute``.
      action: the parsed action.
      wait_action_s: how long WAIT sleeps.
      settle_s: pause after every non-terminal action, so the screen shows its effect.
    """
    if action.kind == ActionKind.PYAUTOGUI:
        await run_code(action.code)
    elif action.kind == ActionKind.COMPUTER_13:
        await run_code(to_pyautogui(action))
    elif action.kind == ActionKind.WAIT:
        await asyncio.sleep(wait_action_s)
    if settle_s > 0 and action.kind not in (ActionKind.DONE, ActionKind.FAIL):
        await asyncio.sleep(settle_s)
