"""Pure helpers of the in-jail server and shim, run on the host (they are stdlib-only)."""

from __future__ import annotations

import ast
import io
import random
from pathlib import Path

import aiohttp
import numpy as np
from PIL import Image

from osworld_jax.env.local import jailexec, vmserver
from osworld_jax.env.local.shim import pyautogui as shim

LOCAL = Path(vmserver.__file__).parent


def test_png_encoder_round_trips_pixels():
    rng = np.random.default_rng(0)
    w, h = 37, 11
    rgb = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    png = vmserver.png_encode(w, h, rgb.tobytes())
    img = Image.open(io.BytesIO(png))
    assert img.size == (w, h) and img.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(img), rgb)


def test_bgrx_to_rgb_swaps_channels_and_drops_padding():
    # Two pixels in X11's little-endian 32-bit ZPixmap order: B, G, R, pad.
    data = bytes([1, 2, 3, 99, 10, 20, 30, 77])
    assert vmserver.bgrx_to_rgb(data, 2) == bytes([3, 2, 1, 30, 20, 10])


def test_cursor_is_alpha_blended_at_its_hotspot():
    from types import SimpleNamespace

    w, h = 4, 3
    rgb = bytearray([100] * (w * h * 3))
    # A 2x1 cursor: an opaque red pixel and a half-transparent (premultiplied) white one,
    # hotspot (1, 0), pointer at (2, 1): the cursor covers pixels (1, 1) and (2, 1).
    cursor = SimpleNamespace(
        x=2, y=1, xhot=1, yhot=0, width=2, height=1, cursor_image=[0xFFFF0000, 0x80808080]
    )
    vmserver.paint_cursor(rgb, w, h, cursor)
    px = lambda x, y: tuple(rgb[(y * w + x) * 3 : (y * w + x) * 3 + 3])  # noqa: E731
    assert px(1, 1) == (255, 0, 0)
    # 0x80 + 100 * (255 - 128) // 255 = 128 + 49 = 177 per channel.
    assert px(2, 1) == (177, 177, 177)
    untouched = [px(x, y) for x in range(w) for y in range(h) if (x, y) not in {(1, 1), (2, 1)}]
    assert set(untouched) == {(100, 100, 100)}
    # Off-screen parts are clipped.
    vmserver.paint_cursor(rgb, w, h, SimpleNamespace(**{**vars(cursor), "x": 4, "y": 5}))


def test_multipart_parser_matches_aiohttp_encoding():
    payload = bytes(random.Random(1).getrandbits(8) for _ in range(4096)) + b"\r\n--x\r\n"
    form = aiohttp.FormData()
    form.add_field("file_path", "/home/user/ä b.bin")
    form.add_field("file_data", payload, filename="b.bin", content_type="application/octet-stream")
    writer = form()
    buf = io.BytesIO()

    class Sink:
        async def write(self, chunk: bytes) -> None:
            buf.write(chunk)

    import asyncio

    asyncio.run(writer.write(Sink()))
    fields = vmserver.parse_multipart(buf.getvalue(), writer.content_type)
    assert fields["file_path"].decode() == "/home/user/ä b.bin"
    assert fields["file_data"] == payload


def test_run_command_reports_start_failures_and_limits_as_results():
    res = vmserver.run_command(["/nonexistent/binary"], shell=False)
    assert res["returncode"] == 127 and res["status"] == "error"
    res = vmserver.run_command("printf 'a b'; echo err >&2; exit 4", shell=True)
    assert res == {"status": "success", "output": "a b", "error": "err\n", "returncode": 4}
    res = vmserver.run_command(["sleep", "5"], shell=False, timeout=0.2)
    assert res["returncode"] == -9 and "timed out" in res["error"] and res["limit"] == "time"
    # Output past the cap: the command is killed, the result names the limit, the host never
    # holds more than the cap.
    res = jailexec.run_capped(["yes"], timeout=30, max_output=100_000)
    assert res["limit"] == "output" and res["returncode"] == -9
    assert len(res["output"]) == 100_000


def test_shim_key_names_map_to_x_keysyms():
    assert shim._keysym("enter") == "Return"
    assert shim._keysym("Ctrl") == "ctrl"
    assert shim._keysym("pagedown") == "Next"
    assert shim._keysym(",") == "comma"
    assert shim._keysym("f5") == "F5"
    assert shim._keysym("a") == "a"


def test_jail_side_modules_import_only_stdlib_and_debian_packages():
    """The jail's python3 has no osworld_jax and no pip packages: check the imports statically."""
    allowed_third_party = {"Xlib", "pyatspi"}
    shim_modules = {p.stem for p in (LOCAL / "shim").glob("*.py")} | {"jailexec", "screen", "a11y"}
    import sys

    jail_side = [LOCAL / f for f in ("vmserver.py", "jailexec.py", "screen.py", "a11y.py")]
    jail_side += (LOCAL / "shim").glob("*.py")
    for path in jail_side:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                ok = top in sys.stdlib_module_names or top in allowed_third_party
                assert ok or top in shim_modules, (path, name)
