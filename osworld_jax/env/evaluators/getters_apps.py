"""Application getters: VLC, GIMP, Impress, window and wallpaper information.

Follow upstream ``desktop_env/evaluators/getters`` ``vlc.py``, ``gimp.py``, ``impress.py`` and
``info.py`` on Linux. What upstream asks its VM server for through routes the in-VM protocol does
not have (the VLC HTTP interface, a window's size, the wallpaper) is asked from inside the desktop
with a short Python program (``run_python``), so it works where the desktop's network is private.
"""

from __future__ import annotations

import base64
import collections
import posixpath
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from osworld_jax.env.desktop_python import run_python
from osworld_jax.env.evaluators.getters import _fetch, _scratch, vm_file
from osworld_jax.env.evaluators.registry import GETTERS, EvalContext
from osworld_jax.env.evaluators.rules import parse_xml
from osworld_jax.env.protocol import VMProtocol


async def _copy(vm: VMProtocol, path: str, dest: str, ctx: EvalContext) -> str | None:
    data = await _fetch(vm, path)
    if data is None:
        return None
    target = _scratch(ctx, dest)
    target.write_bytes(data)
    return str(target)


@GETTERS.register("vlc_config")
async def vlc_config(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """VLC's ``~/.config/vlc/vlcrc`` copied to ``dest``.

    Raises:
      FileNotFoundError: VLC has written no config (upstream fails too; the metric scores 0).
    """
    out = await _copy(vm, "~/.config/vlc/vlcrc", str(params["dest"]), ctx)
    if out is None:
        raise FileNotFoundError("~/.config/vlc/vlcrc")
    return out


# VLC's HTTP interface inside the desktop (upstream's vlc_port).
VLC_HTTP_PORT = "8080"

_VLC_STATUS = """
import base64, json, sys, urllib.request
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/requests/status.xml")
req.add_header("Authorization", "Basic " + base64.b64encode(b":password").decode())
try:
    with urllib.request.urlopen(req, timeout=10) as r:
        print(json.dumps(base64.b64encode(r.read()).decode()))
except Exception:
    print(json.dumps(None))
"""


@GETTERS.register("vlc_playing_info")
async def vlc_playing_info(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """VLC's ``status.xml`` from its HTTP interface (port 8080, password ``password``) saved to
    ``dest``; None when VLC does not answer.
    """  # noqa: D205
    body = await run_python(vm, _VLC_STATUS, VLC_HTTP_PORT)
    if body is None:
        return None
    target = _scratch(ctx, str(params["dest"]))
    target.write_bytes(base64.b64decode(body))
    return str(target)


# upstream's list of video MIME subtypes (duplicates kept: they weigh the vote the same way)
_VIDEO_TYPES = (
    "3gp 3gp 3gpp 3gpp 3gpp2 3gpp2 avi avi divx divx dv dv fli fli flv flv mp2t mp2t mp4 mp4 "
    "mp4v-es mp4v-es mpeg mpeg mpeg-system mpeg-system msvideo msvideo ogg ogg quicktime quicktime "
    "vnd.divx vnd.divx vnd.mpegurl vnd.mpegurl vnd.rn-realvideo vnd.rn-realvideo webm webm x-anim "
    "x-anim x-avi x-avi x-flc x-flc x-fli x-fli x-flv x-flv x-m4v x-m4v x-matroska x-matroska "
    "x-mpeg x-mpeg x-mpeg-system x-mpeg-system x-mpeg2 x-mpeg2 x-ms-asf x-ms-asf x-ms-asf-plugin "
    "x-ms-asf-plugin x-ms-asx x-ms-asx x-ms-wm x-ms-wm x-ms-wmv x-ms-wmv x-ms-wmx x-ms-wmx "
    "x-ms-wvx x-ms-wvx x-msvideo x-msvideo x-nsv x-nsv x-ogm x-ogm x-ogm+ogg x-theora x-theora "
    "x-theora+ogg x-theora+ogg"
).split()

_XDG_DEFAULTS = """
import json, subprocess, sys
out = []
for t in sys.argv[1:]:
    try:
        r = subprocess.run(["xdg-mime", "query", "default", "video/" + t],
                           capture_output=True, text=True, timeout=10)
        out.append(r.stdout if r.returncode == 0 else "")
    except Exception:
        out.append("")
print(json.dumps(out))
"""


@GETTERS.register("default_video_player")
async def default_video_player(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """The application ``xdg-mime`` names most often as the default for video types, as printed
    (``"unknown"`` when none).
    """  # noqa: D205
    apps = [a for a in await run_python(vm, _XDG_DEFAULTS, *_VIDEO_TYPES) if a]
    return collections.Counter(apps).most_common(1)[0][0] if apps else "unknown"


@GETTERS.register("gimp_config_file")
async def gimp_config_file(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """GIMP 2.10's ``~/.config/GIMP/2.10/<file_name>`` copied to ``dest`` (None if missing)."""
    return await _copy(vm, f"~/.config/GIMP/2.10/{params['file_name']}", str(params["dest"]), ctx)


_RELS = "http://schemas.openxmlformats.org/package/2006/relationships"
_P_NS = "http://schemas.openxmlformats.org/presentationml/2006/main"
_A_NS = "http://schemas.openxmlformats.org/drawingml/2006/main"
_R_NS = "http://schemas.openxmlformats.org/officeDocument/2006/relationships"


async def _slide_media(
    vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext, kind: str
) -> Any:
    """A slide's embedded (extracted next to the deck) or linked (fetched) media file."""
    deck_path = str(params["ppt_file_path"])
    index, dest = int(params["slide_index"]), str(params["dest"])
    deck = await vm_file(vm, {"path": deck_path, "dest": posixpath.basename(deck_path)}, ctx)
    if deck is None:
        raise FileNotFoundError(deck_path)
    slide, rels = f"ppt/slides/slide{index + 1}.xml", f"ppt/slides/_rels/slide{index + 1}.xml.rels"
    with zipfile.ZipFile(deck) as z:
        names = z.namelist()
        want_id = None
        if kind == "image":
            if slide not in names:
                return None
            root = parse_xml(z.read(slide))
            for bg in root.iter(f"{{{_P_NS}}}bgPr"):
                blip = next(bg.iter(f"{{{_A_NS}}}blip"), None)
                if blip is not None and blip.get(f"{{{_R_NS}}}embed"):
                    want_id = blip.get(f"{{{_R_NS}}}embed")
                    break
            if want_id is None:
                return None
        if rels not in names:
            return None
        for rel in parse_xml(z.read(rels)).iterfind(f"{{{_RELS}}}Relationship"):
            other_id = want_id is not None and rel.get("Id") != want_id
            if kind not in rel.get("Type", "") or other_id:
                continue
            target = rel.get("Target", "")
            if target.startswith(".."):
                inner = posixpath.normpath(posixpath.join("ppt/slides", target))
                out = Path(deck).parent
                z.extract(inner, out)
                return str(out / inner)
            if not target.startswith("file://"):
                raise ValueError(f"{kind} in slide {index}: unexpected target {target!r}")
            return await vm_file(vm, {"path": target[7:], "dest": dest}, ctx)
    return None


@GETTERS.register("audio_in_slide")
async def audio_in_slide(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """The audio of slide ``slide_index`` of the desktop deck ``ppt_file_path`` (None if none)."""
    return await _slide_media(vm, params, ctx, "audio")


@GETTERS.register("background_image_in_slide")
async def background_image_in_slide(
    vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext
) -> Any:
    """The background picture of slide ``slide_index`` of the deck (None if it has none)."""
    return await _slide_media(vm, params, ctx, "image")


_WINDOW_SIZE = """
import json, subprocess, sys
want = sys.argv[1].lower()
def run(*a):
    return subprocess.run(a, capture_output=True, text=True, timeout=10).stdout
out = None
for wid in run("xdotool", "search", "--onlyvisible", "--class", sys.argv[1]).split():
    classes = run("xprop", "-id", wid, "WM_CLASS").split("=", 1)[-1]
    names = [c.strip().strip('"').lower() for c in classes.split(",")]
    if want in names:
        shell = run("xdotool", "getwindowgeometry", "--shell", wid)
        geo = dict(kv.split("=", 1) for kv in shell.split())
        out = {"width": int(geo["WIDTH"]), "height": int(geo["HEIGHT"])}
        break
print(json.dumps(out))
"""


@GETTERS.register("vm_window_size")
async def vm_window_size(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """``{"width", "height"}`` of the first visible window whose WM_CLASS names
    ``app_class_name`` (case-insensitive), or None.
    """  # noqa: D205
    return await run_python(vm, _WINDOW_SIZE, str(params["app_class_name"]))


vm_window_size.needs_apps = ("xdotool", "xprop")  # type: ignore[attr-defined]


@GETTERS.register("vm_wallpaper")
async def vm_wallpaper(vm: VMProtocol, params: Mapping[str, Any], ctx: EvalContext) -> Any:
    """The GNOME wallpaper (``gsettings ... picture-uri``) copied to ``dest``; an empty file
    when there is none (as upstream).
    """  # noqa: D205
    r = await vm.execute(["gsettings", "get", "org.gnome.desktop.background", "picture-uri"])
    uri = str(r.get("output") or "").strip().replace("file://", "").replace("'", "")
    data = await _fetch(vm, uri) if r.get("returncode") in (0, None) and uri else None
    target = _scratch(ctx, str(params["dest"]))
    target.write_bytes(data or b"")
    return str(target)


vm_wallpaper.needs_apps = ("gsettings",)  # type: ignore[attr-defined]
default_video_player.needs_apps = ("xdg-mime",)  # type: ignore[attr-defined]
