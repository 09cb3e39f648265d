"""Agent actions: parse model text into pyautogui code, computer_13 actions, WAIT, DONE or FAIL.

Two OSWorld action spaces:

- ``pyautogui``: Python code (in fenced code blocks, or bare) run on the desktop, or one of the
  special answers ``WAIT``, ``DONE``, ``FAIL``;
- ``computer_13``: a JSON object ``{"action_type": ..., "parameters": {...}}`` (parameters may
  also sit at the top level) with ``action_type`` one of ``ACTION_SPACE`` (OSWorld's
  ``desktop_env/actions.py``), validated here and lowered to pyautogui code by ``to_pyautogui``.

Unparsable output is data, not an infrastructure failure, and never an answer: it becomes an
``UNPARSED`` action with a ``parse_error``, which runs nothing and ends nothing (``AgentEnv``
spends the turn and the episode continues, as upstream OSWorld's agents do: ``PromptAgent``'s
``parse_code_from_string`` finds no code and ``run_single_example`` executes the empty action
list and takes the next step). It is never ``FAIL`` (which scores 1 on infeasible tasks) or
``DONE``.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import json
import re
import string
from collections.abc import Mapping
from typing import Any, Literal

from osworld_jax.registry import check_choice


class ActionKind(enum.StrEnum):
    """What an action is."""

    PYAUTOGUI = "pyautogui"
    COMPUTER_13 = "computer_13"
    WAIT = "WAIT"
    DONE = "DONE"
    FAIL = "FAIL"
    UNPARSED = "UNPARSED"


SPECIAL = (ActionKind.WAIT, ActionKind.DONE, ActionKind.FAIL)
#: How model text is written: pyautogui code, or OSWorld's computer_13 JSON actions.
ActionSpace = Literal["pyautogui", "computer_13"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Action:
    """One parsed action.

    Attributes:
      kind: what the action is.
      code: the pyautogui code (``PYAUTOGUI``), else "".
      params: the validated computer_13 action (``action_type`` plus its parameters) for
        ``COMPUTER_13``, else an empty mapping.
      parse_error: why the text could not be parsed (then ``kind`` is ``UNPARSED``), else None.
      text: the raw model text the action came from.
    """

    kind: ActionKind
    code: str = ""
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    parse_error: str | None = None
    text: str = ""

    @property
    def is_terminal(self) -> bool:
        """Whether the episode ends with this action (DONE or FAIL)."""
        return self.kind in (ActionKind.DONE, ActionKind.FAIL)


# --------------------------------------------------------------------------- computer_13

X_MAX, Y_MAX = 1920, 1080
BUTTONS = ("left", "right", "middle")
# pyautogui's KEYBOARD_KEYS (the names ``press``/``keyDown``/``hotkey`` accept).
KEYBOARD_KEYS = frozenset(
    [*string.printable.strip(), " ", "\t", "\n", "\r"]
    + [f"f{i}" for i in range(1, 25)]
    + [f"num{i}" for i in range(10)]
    + """accept add alt altleft altright apps backspace browserback browserfavorites
    browserforward browserhome browserrefresh browsersearch browserstop capslock clear convert
    ctrl ctrlleft ctrlright decimal del delete divide down end enter esc escape execute final
    fn hanguel hangul hanja help home insert junja kana kanji launchapp1 launchapp2 launchmail
    launchmediaselect left modechange multiply nexttrack nonconvert numlock pagedown pageup
    pause pgdn pgup playpause prevtrack print printscreen prntscrn prtsc prtscr return right
    scrolllock select separator shift shiftleft shiftright sleep space stop subtract tab up
    volumedown volumemute volumeup win winleft winright yen command option optionleft
    optionright""".split()
)


def _num(v: Any, lo: float, hi: float, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"{name} must be a number, got {v!r}")
    if not lo <= v <= hi:
        raise ValueError(f"{name}={v} out of range [{lo}, {hi}]")
    return v


def _key(v: Any, name: str = "key") -> str:
    if not isinstance(v, str) or v.lower() not in KEYBOARD_KEYS:
        raise ValueError(f"{name} {v!r} is not a keyboard key")
    return v.lower()


def _xy(p: Mapping[str, Any], required: bool) -> dict[str, float]:
    if "x" not in p and "y" not in p and not required:
        return {}
    if "x" not in p or "y" not in p:
        raise ValueError("needs both x and y")
    return {"x": _num(p["x"], 0, X_MAX, "x"), "y": _num(p["y"], 0, Y_MAX, "y")}


def _button(p: Mapping[str, Any]) -> dict[str, str]:
    if "button" not in p:
        return {}
    if p["button"] not in BUTTONS:
        raise ValueError(f"button must be one of {BUTTONS}, got {p['button']!r}")
    return {"button": p["button"]}


def _v_click(p: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {**_button(p), **_xy(p, required=False)}
    if "num_clicks" in p:
        if p["num_clicks"] not in (1, 2, 3):
            raise ValueError(f"num_clicks must be 1, 2 or 3, got {p['num_clicks']!r}")
        out["num_clicks"] = p["num_clicks"]
    return out


def _v_scroll(p: Mapping[str, Any]) -> dict[str, Any]:
    if "dx" not in p or "dy" not in p:
        raise ValueError("SCROLL needs dx and dy")
    for k in ("dx", "dy"):
        if isinstance(p[k], bool) or not isinstance(p[k], int):
            raise ValueError(f"{k} must be an int, got {p[k]!r}")
    return {"dx": p["dx"], "dy": p["dy"]}


def _v_typing(p: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(p.get("text"), str):
        raise ValueError("TYPING needs a string text")
    return {"text": p["text"]}


def _v_hotkey(p: Mapping[str, Any]) -> dict[str, Any]:
    keys = p.get("keys")
    if not isinstance(keys, list) or not keys:
        raise ValueError("HOTKEY needs a non-empty list keys")
    return {"keys": [_key(k, "keys[]") for k in keys]}


# action_type -> (validator of the parameters, allowed parameter names)
ACTION_SPACE: dict[str, tuple[Any, frozenset[str]]] = {
    "MOVE_TO": (lambda p: _xy(p, required=True), frozenset({"x", "y"})),
    "CLICK": (_v_click, frozenset({"button", "x", "y", "num_clicks"})),
    "MOUSE_DOWN": (_button, frozenset({"button"})),
    "MOUSE_UP": (_button, frozenset({"button"})),
    "RIGHT_CLICK": (lambda p: _xy(p, required=False), frozenset({"x", "y"})),
    "DOUBLE_CLICK": (lambda p: _xy(p, required=False), frozenset({"x", "y"})),
    "DRAG_TO": (lambda p: _xy(p, required=True), frozenset({"x", "y"})),
    "SCROLL": (_v_scroll, frozenset({"dx", "dy"})),
    "TYPING": (_v_typing, frozenset({"text"})),
    "PRESS": (lambda p: {"key": _key(p.get("key"))}, frozenset({"key"})),
    "KEY_DOWN": (lambda p: {"key": _key(p.get("key"))}, frozenset({"key"})),
    "KEY_UP": (lambda p: {"key": _key(p.get("key"))}, frozenset({"key"})),
    "HOTKEY": (_v_hotkey, frozenset({"keys"})),
    "WAIT": (lambda p: {}, frozenset()),
    "FAIL": (lambda p: {}, frozenset()),
    "DONE": (lambda p: {}, frozenset()),
}


def validate_computer_13(obj: Any) -> dict[str, Any]:
    """Validates one computer_13 action; returns ``{"action_type": T, **parameters}``.

    Raises:
      ValueError: naming the problem (unknown type, missing/extra/out-of-range parameter).
    """
    if isinstance(obj, str) and obj.strip().upper() in ("WAIT", "DONE", "FAIL"):
        return {"action_type": obj.strip().upper()}
    if not isinstance(obj, Mapping):
        raise ValueError(f"a computer_13 action must be a JSON object, got {type(obj).__name__}")
    kind = obj.get("action_type")
    if kind not in ACTION_SPACE:
        raise ValueError(f"unknown action_type {kind!r}")
    if "parameters" in obj:
        params = obj["parameters"]
        if not isinstance(params, Mapping):
            raise ValueError("parameters must be an object")
        extra_top = set(obj) - {"action_type", "parameters"}
        if extra_top:
            raise ValueError(f"{kind}: unexpected keys {sorted(extra_top)}")
    else:
        params = {k: v for k, v in obj.items() if k != "action_type"}
    validator, allowed = ACTION_SPACE[kind]
    extra = set(params) - allowed
    if extra:
        raise ValueError(f"{kind}: unexpected parameters {sorted(extra)}")
    try:
        return {"action_type": kind, **validator(params)}
    except ValueError as e:
        raise ValueError(f"{kind}: {e}") from None


def _fmt(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return repr(v)


def to_pyautogui(action: Action | Mapping[str, Any]) -> str:
    """Lowers a computer_13 action (validated) to pyautogui code (``""`` for WAIT/DONE/FAIL)."""
    p = dict(action.params) if isinstance(action, Action) else validate_computer_13(action)
    kind = p.pop("action_type")
    xy = f"{_fmt(p['x'])}, {_fmt(p['y'])}" if "x" in p else ""
    if kind == "MOVE_TO":
        return f"pyautogui.moveTo({xy})"
    if kind == "CLICK":
        args = [f"x={_fmt(p['x'])}", f"y={_fmt(p['y'])}"] if "x" in p else []
        if "button" in p:
            args.append(f"button={p['button']!r}")
        if "num_clicks" in p:
            args.append(f"clicks={p['num_clicks']}")
        return f"pyautogui.click({', '.join(args)})"
    if kind in ("MOUSE_DOWN", "MOUSE_UP"):
        fn = "mouseDown" if kind == "MOUSE_DOWN" else "mouseUp"
        return f"pyautogui.{fn}({'button=' + repr(p['button']) if 'button' in p else ''})"
    if kind == "RIGHT_CLICK":
        return f"pyautogui.rightClick({xy})"
    if kind == "DOUBLE_CLICK":
        return f"pyautogui.doubleClick({xy})"
    if kind == "DRAG_TO":
        return f"pyautogui.dragTo({xy}, duration=0.5, button='left')"
    if kind == "SCROLL":
        lines = []
        if p["dx"]:
            lines.append(f"pyautogui.hscroll({p['dx']})")
        if p["dy"]:
            lines.append(f"pyautogui.vscroll({p['dy']})")
        return "\n".join(lines)
    if kind == "TYPING":
        return f"pyautogui.typewrite({p['text']!r})"
    if kind in ("PRESS", "KEY_DOWN", "KEY_UP"):
        fn = {"PRESS": "press", "KEY_DOWN": "keyDown", "KEY_UP": "keyUp"}[kind]
        return f"pyautogui.{fn}({p['key']!r})"
    if kind == "HOTKEY":
        return f"pyautogui.hotkey({', '.join(repr(k) for k in p['keys'])})"
    return ""


# --------------------------------------------------------------------------- parsing

_THINK = re.compile(r"<think>.*?</think>", re.S)
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n?(.*?)```", re.S)
_KEYWORD = re.compile(r"^\s*(WAIT|DONE|FAIL)\s*$")


def _fail(text: str, why: str) -> Action:
    return Action(kind=ActionKind.UNPARSED, parse_error=why, text=text)


def _special(s: str) -> ActionKind | None:
    m = _KEYWORD.match(s)
    return ActionKind(m.group(1)) if m else None


def _parse_pyautogui(text: str) -> Action:
    blocks = [body for _, body in _FENCE.findall(text)]
    if not blocks:
        kw = _special(text)
        if kw is not None:
            return Action(kind=kw, text=text)
        # A bare final-line keyword after prose ("...so I am done.\nDONE").
        last = text.strip().splitlines()[-1] if text.strip() else ""
        kw = _special(last)
        if kw is not None:
            return Action(kind=kw, text=text)
        try:
            tree = ast.parse(text)
        except SyntaxError as e:
            return _fail(text, f"no code block, and not valid Python: {e.msg} (line {e.lineno})")
        if not any(isinstance(n, ast.Call) for n in ast.walk(tree)):
            return _fail(text, "no code block, and the text calls nothing")
        return Action(kind=ActionKind.PYAUTOGUI, code=text.strip("\n"), text=text)
    code_parts = []
    specials = []
    for b in blocks:
        kw = _special(b)
        if kw is not None:
            specials.append(kw)
        elif b.strip():
            code_parts.append(b.strip("\n"))
    if not code_parts:
        if specials:
            return Action(kind=specials[-1], text=text)
        return _fail(text, "empty code block")
    code = "\n".join(code_parts)
    try:
        ast.parse(code)
    except SyntaxError as e:
        return _fail(text, f"not valid Python: {e.msg} (line {e.lineno})")
    return Action(kind=ActionKind.PYAUTOGUI, code=code, text=text)


def _json_candidates(text: str) -> list[str]:
    blocks = [body for _, body in _FENCE.findall(text)]
    if blocks:
        return blocks
    start, end = text.find("{"), text.rfind("}")
    out = [text]
    if 0 <= start < end:
        out.insert(0, text[start : end + 1])
    return out


def _parse_computer_13(text: str) -> Action:
    kw = _special(text) or _special(text.strip().splitlines()[-1])
    if kw is not None:
        return Action(kind=kw, text=text)
    errors = []
    for cand in _json_candidates(text):
        kw = _special(cand)
        if kw is not None:
            return Action(kind=kw, text=text)
        try:
            obj = json.loads(cand)
        except json.JSONDecodeError as e:
            errors.append(f"bad JSON: {e.msg}")
            continue
        try:
            params = validate_computer_13(obj)
        except ValueError as e:
            return _fail(text, str(e))
        kind = params["action_type"]
        if kind in ("WAIT", "DONE", "FAIL"):
            return Action(kind=ActionKind(kind), text=text)
        return Action(kind=ActionKind.COMPUTER_13, params=params, text=text)
    return _fail(text, errors[-1] if errors else "no JSON action found")


def parse_action(text: str, action_space: str = "pyautogui") -> Action:
    """Turns model output into one action; unparsable output is ``UNPARSED`` with ``parse_error``.

    ``pyautogui``: fenced code blocks (any language tag) are concatenated into one program; a
    block (or the whole text, or its last line) that is exactly ``WAIT``/``DONE``/``FAIL`` is that
    special action when no code accompanies it; text without fences is taken as code when it is
    valid Python that calls something. ``<think>...</think>`` spans are ignored.
    ``computer_13``: the first fenced block, else the outermost ``{...}``, is parsed
    as JSON and validated against ``ACTION_SPACE``.

    Args:
      text: the model's raw output.
      action_space: ``"pyautogui"`` or ``"computer_13"``.

    Returns:
      The action (never raises for bad model output).

    Raises:
      ConfigError: an unknown ``action_space`` (a configuration error, not model output).
    """
    check_choice(action_space, ActionSpace, "action_space", "action space")
    body = _THINK.sub("", text or "")
    if not body.strip():
        return _fail(text, "empty output")
    action = _parse_computer_13(body) if action_space == "computer_13" else _parse_pyautogui(body)
    return dataclasses.replace(action, text=text)
