"""The desktop's screen for the in-jail server: screenshots (X11 GetImage -> PNG), sizes.

This file runs INSIDE the bubblewrap jail with the system ``python3`` (standard library plus
Debian's ``python3-xlib``); it must not import ``osworld_jax``. ``vmserver.py`` serves it.
"""

from __future__ import annotations

import struct
import threading
import zlib

_STATE: dict = {}
_X_LOCK = threading.Lock()


def png_encode(width: int, height: int, rgb: bytes) -> bytes:
    """Encodes 8-bit RGB pixels (row-major, no padding) as a PNG."""
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride : (y + 1) * stride] for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 1))
        + chunk(b"IEND", b"")
    )


def bgrx_to_rgb(data: bytes, npixels: int) -> bytearray:
    """Converts 32-bit little-endian BGRX pixels to packed RGB."""
    rgb = bytearray(npixels * 3)
    rgb[0::3] = data[2::4]
    rgb[1::3] = data[1::4]
    rgb[2::3] = data[0::4]
    return rgb


def _x_display():
    from Xlib import display as xdisplay  # python3-xlib

    d = _STATE.get("xdisplay")
    if d is None:
        d = xdisplay.Display()  # $DISPLAY
        _STATE["xdisplay"] = d
    return d


def paint_cursor(rgb: bytearray, width: int, height: int, cursor) -> None:
    """Alpha-blends an XFixes cursor image (premultiplied ARGB32 words) onto packed RGB pixels.

    ``cursor`` has ``x``, ``y`` (pointer position), ``xhot``, ``yhot``, ``width``, ``height``
    and ``cursor_image`` (row-major ARGB words), as XFixes GetCursorImage replies.
    """
    x0, y0 = cursor.x - cursor.xhot, cursor.y - cursor.yhot
    pixels = cursor.cursor_image
    for cy in range(cursor.height):
        y = y0 + cy
        if not 0 <= y < height:
            continue
        for cx in range(cursor.width):
            x = x0 + cx
            if not 0 <= x < width:
                continue
            argb = pixels[cy * cursor.width + cx]
            a = (argb >> 24) & 0xFF
            if a == 0:
                continue
            i = (y * width + x) * 3
            inv = 255 - a
            rgb[i] = min(255, ((argb >> 16) & 0xFF) + rgb[i] * inv // 255)
            rgb[i + 1] = min(255, ((argb >> 8) & 0xFF) + rgb[i + 1] * inv // 255)
            rgb[i + 2] = min(255, (argb & 0xFF) + rgb[i + 2] * inv // 255)


def _cursor_image(d):
    """The current cursor image (XFixes), or None when the extension is missing."""
    if not _STATE.get("xfixes_ready"):
        if not d.has_extension("XFIXES"):
            return None
        d.xfixes_query_version()
        _STATE["xfixes_ready"] = True
    return d.xfixes_get_cursor_image(d.screen().root)


def screenshot_png() -> bytes:
    """Grabs the whole root window, with the mouse cursor painted in (as upstream), as PNG."""
    from Xlib import X

    with _X_LOCK:
        try:
            d = _x_display()
            root = d.screen().root
            geom = root.get_geometry()
            w, h = geom.width, geom.height
            img = root.get_image(0, 0, w, h, X.ZPixmap, 0xFFFFFFFF)
            cursor = _cursor_image(d)
        except Exception:
            _STATE.pop("xdisplay", None)
            _STATE.pop("xfixes_ready", None)
            raise
    data = img.data if isinstance(img.data, bytes) else bytes(img.data)
    if len(data) != w * h * 4:
        raise RuntimeError(f"unexpected X image size {len(data)} for {w}x{h} (depth {img.depth})")
    rgb = bgrx_to_rgb(data, w * h)
    if cursor is not None:
        paint_cursor(rgb, w, h, cursor)
    return png_encode(w, h, bytes(rgb))


def screen_size() -> tuple[int, int]:
    """The root window's size."""
    with _X_LOCK:
        try:
            s = _x_display().screen()
            return s.width_in_pixels, s.height_in_pixels
        except Exception:
            _STATE.pop("xdisplay", None)
            raise


def wm_running() -> bool:
    """True once a EWMH window manager has set ``_NET_SUPPORTING_WM_CHECK`` on the root."""
    from Xlib import X

    with _X_LOCK:
        d = _x_display()
        atom = d.intern_atom("_NET_SUPPORTING_WM_CHECK")
        prop = d.screen().root.get_full_property(atom, X.AnyPropertyType)
        return prop is not None and len(prop.value) > 0


def window_size(app_class_name: str) -> tuple[int, int] | None:
    """Size of the first client window whose WM_CLASS (instance or class) matches, any case."""
    from Xlib import X
    from Xlib.error import XError

    want = app_class_name.lower()
    with _X_LOCK:
        d = _x_display()
        root = d.screen().root
        prop = root.get_full_property(d.intern_atom("_NET_CLIENT_LIST"), X.AnyPropertyType)
        for wid in prop.value if prop is not None else []:
            try:
                win = d.create_resource_object("window", wid)
                wm_class = win.get_wm_class()
                if wm_class and want in [n.lower() for n in wm_class]:
                    geom = win.get_geometry()
                    return geom.width, geom.height
            except XError:
                continue
    return None
