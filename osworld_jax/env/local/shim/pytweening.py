"""The tweening (easing) functions of the ``pytweening`` package, for the sandbox's pyautogui shim.

Runs inside the jail with the system python3 (stdlib only). PyAutoGUI re-exports these names
(``pyautogui.easeInQuad`` ...) and accepts any of them as the ``tween`` argument of its movement
functions, e.g. OSWorld's computer_13 ``MOVE_TO`` sends
``pyautogui.moveTo(x, y, duration, pyautogui.easeInQuad)``. Each maps progress ``n`` in [0, 1] to
the fraction of the distance covered; all are 0 at ``n = 0`` and 1 at ``n = 1`` (the back and
elastic ones overshoot in between). The formulas are Robert Penner's easing equations, as
pytweening defines them (same names, same default parameters).
"""

from __future__ import annotations

import math

__all__ = [
    "linear",
    "getPointOnLine",
    "easeInQuad",
    "easeOutQuad",
    "easeInOutQuad",
    "easeInCubic",
    "easeOutCubic",
    "easeInOutCubic",
    "easeInQuart",
    "easeOutQuart",
    "easeInOutQuart",
    "easeInQuint",
    "easeOutQuint",
    "easeInOutQuint",
    "easeInSine",
    "easeOutSine",
    "easeInOutSine",
    "easeInExpo",
    "easeOutExpo",
    "easeInOutExpo",
    "easeInCirc",
    "easeOutCirc",
    "easeInOutCirc",
    "easeInElastic",
    "easeOutElastic",
    "easeInOutElastic",
    "easeInBack",
    "easeOutBack",
    "easeInOutBack",
    "easeInBounce",
    "easeOutBounce",
    "easeInOutBounce",
]


def linear(n):
    """f(n) = n; pyautogui's default tween. Raises ValueError outside [0, 1], as pyautogui's."""
    if not 0.0 <= n <= 1.0:
        raise ValueError("Argument must be between 0.0 and 1.0.")
    return n


def getPointOnLine(x1, y1, x2, y2, n):  # noqa: N802 - pytweening name
    """The point a fraction ``n`` of the way from (x1, y1) to (x2, y2)."""
    return ((x2 - x1) * n) + x1, ((y2 - y1) * n) + y1


def _in_out(f_in, n):
    """Symmetric in-out easing from an ease-in ``f_in``: f_in(2n)/2, then mirrored."""
    if n < 0.5:
        return f_in(2 * n) / 2
    return 1 - f_in(2 - 2 * n) / 2


def _power(k):
    return (
        lambda n: n**k,
        lambda n: 1 - (1 - n) ** k,
        lambda n: _in_out(lambda m: m**k, n),
    )


easeInQuad, easeOutQuad, easeInOutQuad = _power(2)
easeInCubic, easeOutCubic, easeInOutCubic = _power(3)
easeInQuart, easeOutQuart, easeInOutQuart = _power(4)
easeInQuint, easeOutQuint, easeInOutQuint = _power(5)


def easeInSine(n):  # noqa: N802
    """1 - cos(n pi / 2)."""
    return 1 - math.cos(n * math.pi / 2)


def easeOutSine(n):  # noqa: N802
    """sin(n pi / 2)."""
    return math.sin(n * math.pi / 2)


def easeInOutSine(n):  # noqa: N802
    """(1 - cos(n pi)) / 2."""
    return -0.5 * (math.cos(math.pi * n) - 1)


def easeInExpo(n):  # noqa: N802
    """2^(10 (n - 1)), exactly 0 at n = 0."""
    return 0 if n == 0 else 2 ** (10 * (n - 1))


def easeOutExpo(n):  # noqa: N802
    """1 - 2^(-10 n), exactly 1 at n = 1."""
    return 1 if n == 1 else 1 - 2 ** (-10 * n)


def easeInOutExpo(n):  # noqa: N802
    """The in-out exponential ease (0 and 1 exactly at the ends)."""
    if n in (0, 1):
        return n
    if n < 0.5:
        return 0.5 * 2 ** (10 * (2 * n - 1))
    return 0.5 * (2 - 2 ** (-10 * (2 * n - 1)))


def easeInCirc(n):  # noqa: N802
    """1 - sqrt(1 - n^2)."""
    return 1 - math.sqrt(1 - n * n)


def easeOutCirc(n):  # noqa: N802
    """sqrt(1 - (n - 1)^2)."""
    return math.sqrt(1 - (n - 1) ** 2)


def easeInOutCirc(n):  # noqa: N802
    """The in-out circular ease."""
    return _in_out(easeInCirc, n)


def easeOutElastic(n, amplitude=1, period=0.3):  # noqa: N802
    """A decaying sine that overshoots 1: a 2^(-10 n) sin((n - s) 2 pi / period) + 1."""
    if amplitude < 1:
        amplitude, s = 1, period / 4
    else:
        s = period / (2 * math.pi) * math.asin(1 / amplitude)
    return amplitude * 2 ** (-10 * n) * math.sin((n - s) * (2 * math.pi / period)) + 1


def easeInElastic(n, amplitude=1, period=0.3):  # noqa: N802
    """The elastic ease mirrored in time: 1 - easeOutElastic(1 - n)."""
    return 1 - easeOutElastic(1 - n, amplitude=amplitude, period=period)


def easeInOutElastic(n, amplitude=1, period=0.5):  # noqa: N802
    """In-elastic on the first half, out-elastic on the second."""
    n *= 2
    if n < 1:
        return easeInElastic(n, amplitude=amplitude, period=period) / 2
    return easeOutElastic(n - 1, amplitude=amplitude, period=period) / 2 + 0.5


def easeInBack(n, s=1.70158):  # noqa: N802
    """Backs up before moving: n^2 ((s + 1) n - s)."""
    return n * n * ((s + 1) * n - s)


def easeOutBack(n, s=1.70158):  # noqa: N802
    """Overshoots then settles: m^2 ((s + 1) m + s) + 1 with m = n - 1."""
    m = n - 1
    return m * m * ((s + 1) * m + s) + 1


def easeInOutBack(n, s=1.70158):  # noqa: N802
    """The in-out back ease (overshoot scaled by 1.525)."""
    s *= 1.525
    n *= 2
    if n < 1:
        return 0.5 * (n * n * ((s + 1) * n - s))
    n -= 2
    return 0.5 * (n * n * ((s + 1) * n + s) + 2)


def easeOutBounce(n):  # noqa: N802
    """Four parabolic bounces of decreasing height, landing at 1."""
    if n < 1 / 2.75:
        return 7.5625 * n * n
    if n < 2 / 2.75:
        n -= 1.5 / 2.75
        return 7.5625 * n * n + 0.75
    if n < 2.5 / 2.75:
        n -= 2.25 / 2.75
        return 7.5625 * n * n + 0.9375
    n -= 2.625 / 2.75
    return 7.5625 * n * n + 0.984375


def easeInBounce(n):  # noqa: N802
    """The bounce mirrored in time: 1 - easeOutBounce(1 - n)."""
    return 1 - easeOutBounce(1 - n)


def easeInOutBounce(n):  # noqa: N802
    """In-bounce on the first half, out-bounce on the second."""
    if n < 0.5:
        return easeInBounce(n * 2) * 0.5
    return easeOutBounce(n * 2 - 1) * 0.5 + 0.5
