import ast
import json

import pytest

from osworld_jax.env.actions import (
    ACTION_SPACE,
    ActionKind,
    parse_action,
    to_pyautogui,
    validate_computer_13,
)
from osworld_jax.errors import ConfigError


def c13(obj):
    return parse_action("```json\n" + json.dumps(obj) + "\n```", "computer_13")


# (action, expected pyautogui code) — the code is what OSWorld's controller runs for it
CASES = [
    ({"action_type": "MOVE_TO", "x": 10, "y": 20}, "pyautogui.moveTo(10, 20)"),
    ({"action_type": "CLICK"}, "pyautogui.click()"),
    (
        {"action_type": "CLICK", "x": 5, "y": 6, "button": "right", "num_clicks": 2},
        "pyautogui.click(x=5, y=6, button='right', clicks=2)",
    ),
    ({"action_type": "MOUSE_DOWN", "button": "left"}, "pyautogui.mouseDown(button='left')"),
    ({"action_type": "MOUSE_UP"}, "pyautogui.mouseUp()"),
    ({"action_type": "RIGHT_CLICK", "x": 1, "y": 2}, "pyautogui.rightClick(1, 2)"),
    ({"action_type": "DOUBLE_CLICK"}, "pyautogui.doubleClick()"),
    (
        {"action_type": "DRAG_TO", "x": 300, "y": 400},
        "pyautogui.dragTo(300, 400, duration=0.5, button='left')",
    ),
    ({"action_type": "SCROLL", "dx": 0, "dy": -3}, "pyautogui.vscroll(-3)"),
    ({"action_type": "SCROLL", "dx": 2, "dy": 1}, "pyautogui.hscroll(2)\npyautogui.vscroll(1)"),
    ({"action_type": "TYPING", "text": 'it\'s "q"\n'}, "pyautogui.typewrite('it\\'s \"q\"\\n')"),
    ({"action_type": "PRESS", "key": "Enter"}, "pyautogui.press('enter')"),
    ({"action_type": "KEY_DOWN", "key": "shift"}, "pyautogui.keyDown('shift')"),
    ({"action_type": "KEY_UP", "key": "shift"}, "pyautogui.keyUp('shift')"),
    ({"action_type": "HOTKEY", "keys": ["ctrl", "s"]}, "pyautogui.hotkey('ctrl', 's')"),
]


@pytest.mark.parametrize(("obj", "code"), CASES)
def test_each_computer_13_action(obj, code):
    a = c13(obj)
    assert a.kind == ActionKind.COMPUTER_13, a.parse_error
    assert a.params["action_type"] == obj["action_type"]
    assert to_pyautogui(a) == code
    ast.parse(code)
    # the nested "parameters" form is equivalent
    nested = {
        "action_type": obj["action_type"],
        "parameters": {k: v for k, v in obj.items() if k != "action_type"},
    }
    assert to_pyautogui(c13(nested)) == code


def test_every_action_type_covered():
    assert {o["action_type"] for o, _ in CASES} | {"WAIT", "DONE", "FAIL"} == set(ACTION_SPACE)


@pytest.mark.parametrize("kind", ["WAIT", "DONE", "FAIL"])
def test_special_computer_13(kind):
    assert c13({"action_type": kind}).kind == ActionKind(kind)
    assert parse_action(kind, "computer_13").kind == ActionKind(kind)


@pytest.mark.parametrize(
    ("obj", "msg"),
    [
        ({"action_type": "TELEPORT"}, "unknown action_type"),
        ({"action_type": "MOVE_TO", "x": 1}, "needs both x and y"),
        ({"action_type": "MOVE_TO", "x": 1, "y": 99999}, "out of range"),
        ({"action_type": "CLICK", "button": "side"}, "button"),
        ({"action_type": "CLICK", "num_clicks": 4}, "num_clicks"),
        ({"action_type": "PRESS", "key": "notakey"}, "not a keyboard key"),
        ({"action_type": "HOTKEY", "keys": []}, "non-empty list"),
        ({"action_type": "TYPING", "text": 5}, "string text"),
        ({"action_type": "SCROLL", "dx": 1.5, "dy": 0}, "must be an int"),
        ({"action_type": "MOVE_TO", "x": True, "y": 1}, "must be a number"),
        ({"action_type": "WAIT", "seconds": 3}, "unexpected parameters"),
    ],
)
def test_invalid_computer_13_is_unparsed_with_error(obj, msg):
    a = c13(obj)
    assert a.kind == ActionKind.UNPARSED and not a.is_terminal
    assert msg in a.parse_error
    with pytest.raises(ValueError, match=msg):
        validate_computer_13(obj)


def test_computer_13_bare_json_and_garbage():
    a = parse_action('I will click. {"action_type": "CLICK", "x": 3, "y": 4}', "computer_13")
    assert a.kind == ActionKind.COMPUTER_13 and a.params == {"action_type": "CLICK", "x": 3, "y": 4}
    bad = parse_action("click the button please", "computer_13")
    assert bad.kind == ActionKind.UNPARSED and bad.parse_error


def test_pyautogui_code_blocks():
    text = (
        "Plan.\n```python\nimport pyautogui\npyautogui.click(1, 2)\n```\n"
        "then\n```\npyautogui.press('a')\n```"
    )
    a = parse_action(text)
    assert a.kind == ActionKind.PYAUTOGUI
    assert a.code == "import pyautogui\npyautogui.click(1, 2)\npyautogui.press('a')"
    assert a.text == text


def test_pyautogui_bare_code_and_keywords():
    assert parse_action("pyautogui.click(5, 5)").code == "pyautogui.click(5, 5)"
    for kw in ("WAIT", "DONE", "FAIL"):
        assert parse_action(kw).kind == ActionKind(kw)
        assert parse_action(f"```\n{kw}\n```").kind == ActionKind(kw)
        assert parse_action(f"The task is finished.\n{kw}").kind == ActionKind(kw)
        assert parse_action(kw).is_terminal == (kw != "WAIT")


def test_think_is_ignored():
    a = parse_action("<think>```python\nos.remove('/')\n```</think>\n```python\nx()\n```")
    assert a.code == "x()"
    assert parse_action("<think>DONE</think>").kind == ActionKind.UNPARSED


@pytest.mark.parametrize(
    "text",
    ["", "   ", "hello there", "```python\ndef f(:\n```", "```python\n\n```", "just words."],
)
def test_garbage_is_its_own_outcome_never_fail_or_done(text):
    # A parse failure is UNPARSED: not FAIL (1 on infeasible tasks), not DONE, not terminal
    # (the episode continues, as upstream's agents do: the turn runs no action).
    a = parse_action(text)
    assert a.kind == ActionKind.UNPARSED
    assert a.parse_error
    assert not a.is_terminal


def test_unknown_action_space_is_config_error():
    with pytest.raises(ConfigError, match="action_space"):
        parse_action("DONE", "claude")
