"""One jailed desktop from an offline system root: preflight, start, a screenshot, an action.

python benchmarks/jail_smoke.py /path/bundle/root
"""

import asyncio
import io
import sys
import time

from osworld_jax.env.local import LocalBackend, LocalBackendConfig

root = sys.argv[1]
t0 = time.monotonic()
backend = LocalBackend(LocalBackendConfig(system_root=root, window_manager="blackbox"))
backend.preflight()
print(f"preflight ok {time.monotonic() - t0:.1f}s", flush=True)


async def main() -> None:
    t = time.monotonic()
    d = await backend.start_desktop()
    print(f"desktop up {time.monotonic() - t:.1f}s", flush=True)
    try:
        from PIL import Image

        png = await d.client.screenshot()
        print("screenshot", Image.open(io.BytesIO(png)).size)
        code = "import pyautogui\npyautogui.click(410, 320)\nprint(tuple(pyautogui.position()))"
        print("action", await d.client.execute(["python", "-c", code]))
    finally:
        await d.close()
        await backend.aclose()


asyncio.run(main())
print("JAIL_SMOKE_OK")
