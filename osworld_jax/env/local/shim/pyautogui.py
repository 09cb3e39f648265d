"""A PyAutoGUI-compatible subset backed by xdotool, for the local sandbox.

Runs inside the jail with the system python3 (stdlib only). Covers the calls OSWorld agents emit:
click, doubleClick, tripleClick, rightClick, middleClick, moveTo, moveRel/move, dragTo, dragRel,
scroll, hscroll, vscroll, typewrite/write, press, hotkey, keyDown, keyUp, mouseDown, mouseUp, size,
position, onScreen, sleep. ``FAILSAFE`` and ``PAUSE`` exist (``PAUSE`` seconds are slept after each
call, as PyAutoGUI does). A movement with a ``duration`` of at least ``MINIMUM_DURATION`` moves
in steps along its ``tween`` (``linear`` by default; every pytweening ease function is exported
here, as PyAutoGUI exports them). Screenshots, ``pixel`` and ``locate*`` come from the
``pyscreeze`` module beside this one (stdlib + python3-xlib: exact-match search, no Pillow or
OpenCV); a failed locate raises PyAutoGUI's ``ImageNotFoundException``, as PyAutoGUI 0.9.54 does.
An image filename in place of (x, y) clicks the center of that image on the screen.
"""

from __future__ import annotations

import collections
import functools
import subprocess
import time

if __package__:  # imported on the host as osworld_jax.env.local.shim.pyautogui (tests)
    from . import pyscreeze, pytweening
else:  # in the jail: modules beside this one in /opt/osworld/lib
    import pyscreeze  # type: ignore[no-redef]
    import pytweening  # type: ignore[no-redef]

for _name in pytweening.__all__:  # linear, getPointOnLine, easeInQuad, ..., easeInOutBounce
    globals()[_name] = getattr(pytweening, _name)
linear = pytweening.linear

FAILSAFE = False
PAUSE = 0.0
MINIMUM_DURATION = 0.1
MINIMUM_SLEEP = 0.05

Point = collections.namedtuple("Point", "x y")
Size = collections.namedtuple("Size", "width height")

_BUTTONS = {"left": "1", "middle": "2", "right": "3", "primary": "1", "secondary": "3"}

# PyAutoGUI key names -> X keysym names understood by xdotool.
_KEYS = {
    "enter": "Return",
    "return": "Return",
    "\n": "Return",
    "\r": "Return",
    "tab": "Tab",
    "\t": "Tab",
    "space": "space",
    " ": "space",
    "esc": "Escape",
    "escape": "Escape",
    "backspace": "BackSpace",
    "\b": "BackSpace",
    "delete": "Delete",
    "del": "Delete",
    "insert": "Insert",
    "up": "Up",
    "down": "Down",
    "left": "Left",
    "right": "Right",
    "home": "Home",
    "end": "End",
    "pageup": "Prior",
    "pgup": "Prior",
    "pagedown": "Next",
    "pgdn": "Next",
    "ctrl": "ctrl",
    "ctrlleft": "Control_L",
    "ctrlright": "Control_R",
    "control": "ctrl",
    "shift": "shift",
    "shiftleft": "Shift_L",
    "shiftright": "Shift_R",
    "alt": "alt",
    "altleft": "Alt_L",
    "altright": "Alt_R",
    "option": "alt",
    "win": "super",
    "winleft": "Super_L",
    "winright": "Super_R",
    "super": "super",
    "command": "super",
    "cmd": "super",
    "meta": "Meta_L",
    "capslock": "Caps_Lock",
    "numlock": "Num_Lock",
    "scrolllock": "Scroll_Lock",
    "printscreen": "Print",
    "prtsc": "Print",
    "prtscr": "Print",
    "print": "Print",
    "pause": "Pause",
    "menu": "Menu",
    "apps": "Menu",
    "volumeup": "XF86AudioRaiseVolume",
    "volumedown": "XF86AudioLowerVolume",
    "volumemute": "XF86AudioMute",
    "!": "exclam",
    '"': "quotedbl",
    "#": "numbersign",
    "$": "dollar",
    "%": "percent",
    "&": "ampersand",
    "'": "apostrophe",
    "(": "parenleft",
    ")": "parenright",
    "*": "asterisk",
    "+": "plus",
    ",": "comma",
    "-": "minus",
    ".": "period",
    "/": "slash",
    ":": "colon",
    ";": "semicolon",
    "<": "less",
    "=": "equal",
    ">": "greater",
    "?": "question",
    "@": "at",
    "[": "bracketleft",
    "\\": "backslash",
    "]": "bracketright",
    "^": "asciicircum",
    "_": "underscore",
    "`": "grave",
    "{": "braceleft",
    "|": "bar",
    "}": "braceright",
    "~": "asciitilde",
}
_KEYS.update({f"f{i}": f"F{i}" for i in range(1, 25)})
_KEYS.update({f"num{i}": f"KP_{i}" for i in range(10)})

KEYBOARD_KEYS = (
    sorted(_KEYS) + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]
)


class PyAutoGUIException(Exception):
    """Base of PyAutoGUI's exceptions."""


class FailSafeException(PyAutoGUIException):
    """Raised for API compatibility; the sandbox never triggers the fail-safe."""


class ImageNotFoundException(PyAutoGUIException):
    """A ``locate*`` function found no match (PyAutoGUI's version of PyScreeze's exception)."""


def _raise_pyautogui_not_found(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except pyscreeze.ImageNotFoundException:
            raise ImageNotFoundException from None

    return wrapper


locate = _raise_pyautogui_not_found(pyscreeze.locate)
locateAll = _raise_pyautogui_not_found(pyscreeze.locateAll)
locateOnScreen = _raise_pyautogui_not_found(pyscreeze.locateOnScreen)
locateAllOnScreen = _raise_pyautogui_not_found(pyscreeze.locateAllOnScreen)
locateCenterOnScreen = _raise_pyautogui_not_found(pyscreeze.locateCenterOnScreen)
locateOnWindow = _raise_pyautogui_not_found(pyscreeze.locateOnWindow)
center = pyscreeze.center
pixel = pyscreeze.pixel
pixelMatchesColor = pyscreeze.pixelMatchesColor
screenshot = pyscreeze.screenshot


# Never use ``mousemove --sync``: it blocks (about 15 s) when the pointer is already there. The
# X server handles the requests of successive xdotool runs in order, so no sync is needed.
def _xdo(*args: str) -> str:
    res = subprocess.run(["xdotool", *args], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"xdotool {' '.join(args)} failed: {res.stderr.strip()}")
    return res.stdout


def _do_pause() -> None:
    if PAUSE:
        time.sleep(PAUSE)


def _keysym(key: str) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"invalid key {key!r}")
    if key in _KEYS:
        return _KEYS[key]
    low = key.lower()
    if low in _KEYS:
        return _KEYS[low]
    return key  # a letter, a digit, or an X keysym name given directly


def _xy(x, y):
    if x is None and y is None:
        return None
    if isinstance(x, str):  # an image file to find on the screen, as PyAutoGUI's _unpackXY
        x, y = center(locateOnScreen(x))
    elif isinstance(x, (tuple, list)) and y is None:
        x, y = center(x) if len(x) == 4 else (x[0], x[1])
    cur = position()
    return int(round(cur.x if x is None else x)), int(round(cur.y if y is None else y))


def size() -> Size:
    """The screen size."""
    out = _xdo("getdisplaygeometry").split()
    return Size(int(out[0]), int(out[1]))


def position(x=None, y=None) -> Point:
    """The mouse position (``x``/``y`` override the returned coordinates, as in PyAutoGUI)."""
    vals = dict(
        item.split("=", 1) for item in _xdo("getmouselocation", "--shell").split() if "=" in item
    )
    return Point(int(vals["X"]) if x is None else int(x), int(vals["Y"]) if y is None else int(y))


def onScreen(x, y=None) -> bool:  # noqa: N802 - PyAutoGUI name
    """True when (x, y) lies on the screen."""
    if isinstance(x, (tuple, list)):
        x, y = x[0], x[1]
    w, h = size()
    return 0 <= int(x) < w and 0 <= int(y) < h


def _move(xy, duration=0.0, tween=None) -> None:
    """Moves to ``xy``; over ``duration`` seconds along ``tween`` when it is long enough.

    As PyAutoGUI: in ``duration / MINIMUM_SLEEP`` steps (at least 1), the k-th at
    ``start + (xy - start) * tween(k / steps)``; durations under ``MINIMUM_DURATION`` jump.
    """
    if xy is None:
        return
    duration = float(duration or 0.0)
    if duration >= MINIMUM_DURATION:
        tween = linear if tween is None else tween
        cur = position()
        steps = max(1, int(duration / MINIMUM_SLEEP))
        pause = duration / steps
        for k in range(1, steps):
            px, py = pytweening.getPointOnLine(cur.x, cur.y, xy[0], xy[1], tween(k / steps))
            _xdo("mousemove", str(int(round(px))), str(int(round(py))))
            time.sleep(pause)
        time.sleep(pause)
    _xdo("mousemove", str(xy[0]), str(xy[1]))


def moveTo(x=None, y=None, duration=0.0, tween=linear, logScreenshot=False, _pause=True):  # noqa: N802,N803
    """Moves the mouse to (x, y)."""
    _move(_xy(x, y), duration, tween)
    _do_pause()


def moveRel(  # noqa: N802
    xOffset=None,  # noqa: N803
    yOffset=None,  # noqa: N803
    duration=0.0,
    tween=linear,
    logScreenshot=False,  # noqa: N803
    _pause=True,
):
    """Moves the mouse by an offset."""
    if isinstance(xOffset, (tuple, list)):
        xOffset, yOffset = xOffset[0], xOffset[1]
    cur = position()
    _move((cur.x + int(xOffset or 0), cur.y + int(yOffset or 0)), duration, tween)
    _do_pause()


move = moveRel


def mouseDown(
    x=None, y=None, button="left", duration=0.0, tween=None, logScreenshot=False, _pause=True
):  # noqa: N802
    """Presses a mouse button (at (x, y) when given)."""
    _move(_xy(x, y))
    _xdo("mousedown", _BUTTONS[button])


def mouseUp(
    x=None, y=None, button="left", duration=0.0, tween=None, logScreenshot=False, _pause=True
):  # noqa: N802
    """Releases a mouse button (at (x, y) when given)."""
    _move(_xy(x, y))
    _xdo("mouseup", _BUTTONS[button])


def click(
    x=None,
    y=None,
    clicks=1,
    interval=0.0,
    button="left",
    duration=0.0,
    tween=None,
    logScreenshot=None,
    _pause=True,
):  # noqa: E501
    """Clicks ``clicks`` times with ``button`` at (x, y) (the current position by default)."""
    _move(_xy(x, y), duration, tween)
    if button not in _BUTTONS:
        raise ValueError(f"unknown button {button!r}")
    delay = str(max(1, int(float(interval) * 1000))) if interval else "12"
    _xdo("click", "--repeat", str(int(clicks)), "--delay", delay, _BUTTONS[button])
    _do_pause()


def leftClick(
    x=None, y=None, interval=0.0, duration=0.0, tween=None, logScreenshot=None, _pause=True
):  # noqa: N802
    """A left click."""
    click(x, y, 1, interval, "left", duration)


def rightClick(
    x=None, y=None, interval=0.0, duration=0.0, tween=None, logScreenshot=None, _pause=True
):  # noqa: N802
    """A right click."""
    click(x, y, 1, interval, "right", duration)


def middleClick(
    x=None, y=None, interval=0.0, duration=0.0, tween=None, logScreenshot=None, _pause=True
):  # noqa: N802
    """A middle click."""
    click(x, y, 1, interval, "middle", duration)


def doubleClick(
    x=None,
    y=None,
    interval=0.0,
    button="left",
    duration=0.0,
    tween=None,
    logScreenshot=None,
    _pause=True,
):  # noqa: N802,E501
    """A double click."""
    click(x, y, 2, interval, button, duration)


def tripleClick(
    x=None,
    y=None,
    interval=0.0,
    button="left",
    duration=0.0,
    tween=None,
    logScreenshot=None,
    _pause=True,
):  # noqa: N802,E501
    """A triple click."""
    click(x, y, 3, interval, button, duration)


def dragTo(
    x=None,
    y=None,
    duration=0.0,
    tween=None,
    button="left",
    logScreenshot=None,
    _pause=True,
    mouseDownUp=True,
):  # noqa: N802,N803,E501
    """Drags from the current position to (x, y) holding ``button``."""
    target = _xy(x, y)
    if mouseDownUp:
        _xdo("mousedown", _BUTTONS[button])
    if target is not None:
        cur = position()
        tween = linear if tween is None else tween
        steps = 8
        for i in range(1, steps + 1):
            px, py = pytweening.getPointOnLine(cur.x, cur.y, target[0], target[1], tween(i / steps))
            _xdo("mousemove", str(int(round(px))), str(int(round(py))))
            if duration:
                time.sleep(float(duration) / steps)
    if mouseDownUp:
        _xdo("mouseup", _BUTTONS[button])
    _do_pause()


def dragRel(
    xOffset=0,
    yOffset=0,
    duration=0.0,
    tween=None,
    button="left",
    logScreenshot=None,
    _pause=True,
    mouseDownUp=True,
):  # noqa: N802,N803,E501
    """Drags by an offset holding ``button``."""
    if isinstance(xOffset, (tuple, list)):
        xOffset, yOffset = xOffset[0], xOffset[1]
    cur = position()
    dragTo(
        cur.x + int(xOffset), cur.y + int(yOffset), duration, None, button, None, True, mouseDownUp
    )


drag = dragRel


def _wheel(clicks, x, y, pos_button: str, neg_button: str) -> None:
    _move(_xy(x, y))
    n = int(clicks)
    if n:
        _xdo("click", "--repeat", str(abs(n)), "--delay", "5", pos_button if n > 0 else neg_button)
    _do_pause()


def scroll(clicks, x=None, y=None, logScreenshot=None, _pause=True):
    """Scrolls up (positive) or down (negative) by ``clicks`` wheel notches."""
    _wheel(clicks, x, y, "4", "5")


vscroll = scroll


def hscroll(clicks, x=None, y=None, logScreenshot=None, _pause=True):
    """Scrolls right (positive) or left (negative)."""
    _wheel(clicks, x, y, "7", "6")


def typewrite(message, interval=0.0, logScreenshot=None, _pause=True):
    """Types a string (or presses each key name of a list)."""
    if isinstance(message, (list, tuple)):
        for key in message:
            press(key)
            if interval:
                time.sleep(float(interval))
        return
    text = str(message)
    if not text:
        return
    delay = str(max(1, int(float(interval) * 1000))) if interval else "2"
    # Newlines as Return presses between chunks: xdotool types "\n" as Return too, but explicit
    # presses behave the same in every application.
    parts = text.split("\n")
    for i, part in enumerate(parts):
        if part:
            _xdo("type", "--delay", delay, "--", part)
        if i < len(parts) - 1:
            _xdo("key", "Return")
    _do_pause()


write = typewrite


def press(keys, presses=1, interval=0.0, logScreenshot=None, _pause=True):
    """Presses (down and up) each key ``presses`` times."""
    if isinstance(keys, str):
        keys = [keys]
    for _ in range(int(presses)):
        for key in keys:
            _xdo("key", "--clearmodifiers", _keysym(key))
            if interval:
                time.sleep(float(interval))
    _do_pause()


def hotkey(*args, **kwargs):
    """Presses the keys in order and releases them in reverse (a chord like ctrl+s)."""
    keys = []
    for a in args:
        keys.extend(a if isinstance(a, (list, tuple)) else [a])
    if not keys:
        return
    _xdo("key", "--clearmodifiers", "+".join(_keysym(k) for k in keys))
    _do_pause()


def keyDown(key, logScreenshot=None, _pause=True):  # noqa: N802
    """Holds a key down."""
    _xdo("keydown", _keysym(key))


def keyUp(key, logScreenshot=None, _pause=True):  # noqa: N802
    """Releases a key."""
    _xdo("keyup", _keysym(key))


def sleep(seconds):
    """time.sleep, as pyautogui.sleep."""
    time.sleep(seconds)
