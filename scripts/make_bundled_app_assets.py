"""Makes the input and gold files of the bundled application tasks with the real applications.

    .venv/bin/python scripts/make_bundled_app_assets.py [--only DOMAIN]

Writes ``osworld_jax/env/bundled/apps/<domain>/assets/<task id>/`` (committed; run again after
changing a task). Every document is what the application writes in a jailed local desktop
(``osworld_jax.testing.apps.RealApps``): spreadsheets, documents and presentations built with
the format libraries and saved again by LibreOffice (the gold files too, so formulas carry the
values LibreOffice computed), images exported by GIMP, the video written by OpenCV (VLC plays
it), the Thunderbird profile created by Thunderbird itself. Needs ``bash scripts/setup.sh --apps``.
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from osworld_jax.env.bundled import bundled_app_task_dir
from osworld_jax.testing.apps import RealApps

ROOT = bundled_app_task_dir()


def _out(domain: str, task: str, name: str) -> Path:
    p = ROOT / domain / "assets" / task / name
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def _xlsx(rows: list[list[Any]], edit: Callable[[Any], None] | None = None) -> bytes:
    import openpyxl

    wb = openpyxl.Workbook()
    ws = wb.active
    ws.title = "Sheet1"
    for r in rows:
        ws.append(r)
    if edit is not None:
        edit(ws)
    buf = io.BytesIO()
    wb.save(buf)
    return buf.getvalue()


def _docx(paragraphs: list[str]) -> bytes:
    import docx

    d = docx.Document()
    for text in paragraphs:
        d.add_paragraph(text)
    buf = io.BytesIO()
    d.save(buf)
    return buf.getvalue()


def _pptx(slides: list[tuple[str, list[str]]]) -> bytes:
    import pptx

    prs = pptx.Presentation()
    for title, body in slides:
        s = prs.slides.add_slide(prs.slide_layouts[1])  # title and content
        s.shapes.title.text = title
        tf = s.placeholders[1].text_frame
        for i, line in enumerate(body):
            p = tf.paragraphs[0] if i == 0 else tf.add_paragraph()
            p.text = line
    buf = io.BytesIO()
    prs.save(buf)
    return buf.getvalue()


def _png() -> bytes:
    """An asymmetric picture (a sky, a sun in the top left, a house on the right)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (160, 120), (120, 170, 230))
    d = ImageDraw.Draw(img)
    d.rectangle((0, 90, 159, 119), fill=(60, 140, 60))
    d.ellipse((12, 10, 42, 40), fill=(250, 220, 60))
    d.rectangle((100, 55, 145, 92), fill=(180, 80, 50))
    d.polygon([(95, 56), (122, 30), (150, 56)], fill=(120, 40, 30))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _avi() -> bytes:
    """A 4-second 160x120 MJPEG AVI at 10 fps (a bar moving across)."""
    import cv2
    import numpy as np

    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "clip.avi")
        out = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 10, (160, 120))
        for i in range(40):
            frame = np.full((120, 160, 3), 30, np.uint8)
            x = (4 * i) % 160
            frame[:, x : x + 12] = (40, 200, 250)
            out.write(frame)
        out.release()
        return Path(path).read_bytes()


def calc(ra: RealApps) -> None:
    rows = [["Item", "Amount"], ["Apples", 12], ["Pears", 7], ["Plums", 5]]
    _out("calc", "calc-sum-column", "sales.xlsx").write_bytes(
        ra.office(_xlsx(rows), "sales.xlsx", "xlsx")
    )
    gold = [*rows, ["Total", "=SUM(B2:B4)"]]
    _out("calc", "calc-sum-column", "sales_gold.xlsx").write_bytes(
        ra.office(_xlsx(gold), "sales_gold.xlsx", "xlsx")
    )
    scores = [["Name", "Score"], ["Ann", 90], ["Bob", 85]]
    _out("calc", "calc-bold-header", "scores.xlsx").write_bytes(
        ra.office(_xlsx(scores), "scores.xlsx", "xlsx")
    )


def writer(ra: RealApps) -> None:
    letter = ["Dear team,", "The meeting moves to Friday."]
    _out("writer", "writer-append-line", "letter.docx").write_bytes(
        ra.office(_docx(letter), "letter.docx", "docx")
    )
    _out("writer", "writer-append-line", "letter_gold.docx").write_bytes(
        ra.office(_docx([*letter, "Thank you."]), "letter_gold.docx", "docx")
    )
    report = ["Summary", "The details follow on the next page."]
    _out("writer", "writer-page-break", "report.docx").write_bytes(
        ra.office(_docx(report), "report.docx", "docx")
    )


def impress(ra: RealApps) -> None:
    body = ["Numbers", "Plans"]
    for task, name, before, after in (
        ("impress-first-title", "deck", ("Draft", "Agenda"), ("Final Report", "Agenda")),
        ("impress-second-title", "talk", ("Welcome", "Agenda"), ("Welcome", "Questions")),
    ):
        slides = [(before[0], body), (before[1], body)]
        _out("impress", task, f"{name}.pptx").write_bytes(
            ra.office(_pptx(slides), f"{name}.pptx", "pptx")
        )
        gold = [(after[0], body), (after[1], body)]
        _out("impress", task, f"{name}_gold.pptx").write_bytes(
            ra.office(_pptx(gold), f"{name}_gold.pptx", "pptx")
        )


def chrome(ra: RealApps) -> None:
    for task in ("chrome-new-tab", "chrome-close-tab"):
        for name, title in (("page_a", "Alpha"), ("page_b", "Beta")):
            html = f"<!DOCTYPE html><html><head><title>{title}</title></head>"
            html += f"<body><h1>{title}</h1><p>A local page.</p></body></html>\n"
            _out("chrome", task, f"{name}.html").write_text(html)


def gimp(ra: RealApps) -> None:
    png = ra.gimp(_png(), "landscape.png")
    for task in ("gimp-mirror", "gimp-darken"):
        _out("gimp", task, "landscape.png").write_bytes(png)


def vlc(ra: RealApps) -> None:
    clip = _avi()
    for task in ("vlc-play", "vlc-fullscreen"):
        _out("vlc", task, "clip.avi").write_bytes(clip)


_PROFILE = "t5q2a5hp.default-release"


def thunderbird(ra: RealApps) -> None:
    """A profile Thunderbird made on its first start, renamed to upstream's profile name."""
    ra.shell("rm -rf ~/.thunderbird")
    ra.launch(["/usr/bin/thunderbird", "--headless"])
    end = time.monotonic() + 120
    while ra.execute("ls ~/.thunderbird/*/prefs.js", shell=True)["returncode"] != 0:
        if time.monotonic() > end:
            sys.exit("Thunderbird wrote no profile within 120 s")
        time.sleep(1)
    time.sleep(5)
    ra.launch(["pkill", "thunderbird"])
    time.sleep(5)
    # Debian's Thunderbird names its profile "*.default-default"; upstream's VM has
    # t5q2a5hp.default-release (the tasks name it): rename it, keep Thunderbird's install key
    made = ra.shell("cd ~/.thunderbird && ls -d *.default-default").split()[0]
    install = ra.file("/home/user/.thunderbird/installs.ini").decode().split("]")[0].strip("[")
    ini = (
        f"[Profile0]\nName=default-release\nIsRelative=1\nPath={_PROFILE}\nDefault=1\n\n"
        f"[Install{install}]\nDefault={_PROFILE}\nLocked=1\n\n"
        "[General]\nStartWithLastProfile=1\nVersion=2\n"
    )
    ra.upload("/home/user/.thunderbird/profiles.ini", ini.encode())
    installs = f"[{install}]\nDefault={_PROFILE}\nLocked=1\n"
    ra.upload("/home/user/.thunderbird/installs.ini", installs.encode())
    keep = "prefs.js times.json compatibility.ini"
    ra.shell(
        f"cd ~/.thunderbird && mv {made} {_PROFILE} && rm -rf *.default 'Crash Reports' "
        f"'Pending Pings' && cd {_PROFILE} && for f in *; do "
        f'case " {keep} " in *" $f "*) ;; *) rm -rf "$f" ;; esac; done && cd /home/user && '
        "tar -czf /tmp/osworld_apps/thunderbird-profile.tar.gz .thunderbird"
    )
    data = ra.file("/tmp/osworld_apps/thunderbird-profile.tar.gz")
    for task in ("thunderbird-spellcheck", "thunderbird-quote"):
        _out("thunderbird", task, "thunderbird-profile.tar.gz").write_bytes(data)


DOMAINS = {
    "calc": calc,
    "writer": writer,
    "impress": impress,
    "chrome": chrome,
    "gimp": gimp,
    "vlc": vlc,
    "thunderbird": thunderbird,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=sorted(DOMAINS), action="append")
    args = p.parse_args()
    with RealApps() as ra:
        for name in args.only or DOMAINS:
            shutil.rmtree(ROOT / name / "assets", ignore_errors=True)
            DOMAINS[name](ra)
            print(f"{name}: {sorted(str(q.relative_to(ROOT)) for q in (ROOT / name).rglob('*.*'))}")
    subprocess.run(["du", "-sh", str(ROOT)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
