"""VLC, audio and video metrics.

Follows upstream ``desktop_env/evaluators/metrics/vlc.py`` and ``check_mp3_meta`` of
``others.py``: VLC's ``status.xml`` (its HTTP interface), its ``vlcrc`` config keys, audio
similarity (librosa MFCCs aligned with fastdtw, ``exp(-mean cosine distance)``) and video
equality (perceptual hashes of the first 100 frames, OpenCV decoding).
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from typing import Any

from osworld_jax.env.evaluators.registry import METRICS
from osworld_jax.env.evaluators.rules import match_value_to_rule, parse_xml

_FILE_KEYS = ("filename", "title", "uri", "location", "name")
_URL_PATHS = (
    ("meta", "url"), ("meta", "URI"), ("meta", "location"), ("meta", "title"),
    ("meta", "filename"), ("Stream 0", "Codec"), ("Stream 0", "Type"), ("Stream 0", "Language"),
)  # fmt: skip


def _info(tree: Any, category: str, name: str) -> str | None:
    el = tree.find(f'information/category[@name="{category}"]/info[@name="{name}"]')
    return el.text if el is not None and el.text else None


@METRICS.register("is_vlc_playing")
def is_vlc_playing(status_path: str | None, rule: Mapping[str, Any]) -> float:
    """1 iff VLC's status is ``playing`` the expected file (``type: file_name``) or stream URL.

    A file matches by basename or path suffix; a URL when contained in what VLC reports, when
    VLC reports just its file name, or when both are URLs of one host with the expected path
    inside the reported one.
    """
    if status_path is None:
        return 0.0
    with open(status_path, "rb") as f:
        tree = parse_xml(f.read())
    if tree.findtext("state") != "playing":
        return 0.0
    if rule["type"] == "file_name":
        got = next((v for k in _FILE_KEYS if (v := _info(tree, "meta", k))), None)
        if not got:
            return 0.0
        want = rule["file_name"]
        return float(os.path.basename(got) == want or got.endswith(want))
    if rule["type"] == "url":
        got = next((v for c, k in _URL_PATHS if (v := _info(tree, c, k))), None)
        if not got:
            return 0.0
        want = rule["url"]
        if want in got or got.endswith(want):
            return 1.0
        exp = urllib.parse.urlparse(want)
        if got == os.path.basename(exp.path):
            return 1.0
        if "://" in got:
            act = urllib.parse.urlparse(got)
            return float(exp.netloc == act.netloc and exp.path in act.path)
        return 0.0
    return 0.0


def _vlcrc_value(path: str, key: str, default: str) -> str:
    """The last ``key=value`` line of ``vlcrc`` that mentions ``key=`` (commented or not)."""
    with open(path, "rb") as f:
        text = f.read().decode("utf-8")
    value = default
    for line in text.split("\n"):
        if f"{key}=" in line:
            value = line.split("=")[-1].strip()
    return value


def _vlcrc_check(key: str, default: str, rule_key: str) -> Any:
    def metric(config: str | None, rule: Mapping[str, Any]) -> float:
        if config is None:
            return 0.0
        want = rule[rule_key]
        return float(
            _vlcrc_value(config, key, default) == (str(want) if isinstance(want, int) else want)
        )

    metric.__doc__ = (
        f"1 iff ``{key}`` in ``vlcrc`` (default {default!r}) is ``rule[{rule_key!r}]``."
    )
    return metric


for _name, _key, _default, _rule_key in (
    ("check_qt_bgcone", "qt-bgcone", "1", "expected_qt_bgcone"),
    ("check_qt_max_volume", "qt-max-volume", "125", "expected_qt_max_volume"),
    ("check_qt_minimal_view", "qt-minimal-view", "0", "expected_qt_minimal_view"),
    ("check_one_instance_when_started_from_file", "one-instance-when-started-from-file", "1",
     "expected_one_instance_when_started_from_file"),
    ("check_play_and_exit", "play-and-exit", "0", "expected_play_and_exit"),
):  # fmt: skip
    METRICS.add(_name, _vlcrc_check(_key, _default, _rule_key))


@METRICS.register("is_vlc_recordings_folder")
def is_vlc_recordings_folder(config: str | None, rule: Mapping[str, Any]) -> float:
    """1 iff the first uncommented ``input-record-path`` of ``vlcrc`` is the expected folder."""
    if config is None:
        return 0.0
    with open(config, "rb") as f:
        text = f.read().decode("utf-8")
    for line in text.split("\n"):
        if line.startswith("#") or not line.strip():
            continue
        if "input-record-path" in line:
            return float(line.split("=")[-1].strip() == rule["recording_file_path"])
    return 0.0


@METRICS.register("check_qt_slider_colours")
def check_qt_slider_colours(config: str | None, rule: Mapping[str, Any]) -> float:
    """``qt-slider-colours`` of ``vlcrc``: equal to the expected string (``type: match``) or
    every RGB triple below 100 per channel (``type: blackish``).
    """  # noqa: D205
    if config is None:
        return 0.0
    value = _vlcrc_value(config, "qt-slider-colours", "153;210;153;20;210;20;255;199;15;245;39;29")
    try:
        if rule["type"] == "match":
            return float(value == rule["expected_qt_slider_colours"])
        if rule["type"] == "blackish":
            nums = [int(x) for x in value.split(";")]
            triples = zip(nums[0::3], nums[1::3], nums[2::3], strict=False)
            return float(all(all(c < 100 for c in t) for t in triples))
    except ValueError:
        return 0.0
    return 0.0


@METRICS.register("check_global_key_play_pause")
def check_global_key_play_pause(config: str | None, rule: Mapping[str, Any]) -> float:
    """1 iff a global play/pause key is set (``"1"``) or not (``"0"``) as expected."""
    if config is None:
        return 0.0
    with open(config, "rb") as f:
        text = f.read().decode("utf-8")
    value = "0"
    for line in text.split("\n"):
        if "global-key-play-pause=" in line:
            value = "0" if line.split("=")[-1].strip() == "" else "1"
    want = rule["expected_global_key_play_pause"]
    return float(value == (str(want) if isinstance(want, int) else want))


@METRICS.register("is_vlc_fullscreen")
def is_vlc_fullscreen(window_size: Any, screen_size: Any) -> float:
    """1 iff VLC's window is exactly the screen's size."""
    if window_size is None or screen_size is None:
        return 0.0
    return float(
        window_size["width"] == screen_size["width"]
        and window_size["height"] == screen_size["height"]
    )


@METRICS.register("compare_audios")
def compare_audios(audio1: str | None, audio2: str | None) -> float:
    """``exp(-d)``, d the mean cosine distance along the DTW path of the row-normalised MFCCs.

    Both unreadable or empty: 1; one of them: 0.
    """
    import librosa
    import numpy as np
    from fastdtw import fastdtw
    from scipy.spatial.distance import cosine

    if not audio1 or not audio2:
        return 0.0

    def load(path: str) -> tuple[Any, Any]:
        try:
            return librosa.load(path)
        except Exception:  # noqa: BLE001 - an unreadable file is "bad", as upstream
            return None, None

    (y1, sr1), (y2, sr2) = load(audio1), load(audio2)
    bad1, bad2 = y1 is None or y1.shape[0] == 0, y2 is None or y2.shape[0] == 0
    if bad1 and bad2:
        return 1.0
    if bad1 or bad2:
        return 0.0
    try:
        m1 = librosa.util.normalize(librosa.feature.mfcc(y=y1, sr=sr1), axis=1)
        m2 = librosa.util.normalize(librosa.feature.mfcc(y=y2, sr=sr2), axis=1)
    except Exception:  # noqa: BLE001 - features fail on degenerate audio: 0, as upstream
        return 0.0
    distance, path = fastdtw(m1.T, m2.T, dist=cosine)
    return float(np.exp(-(distance / len(path)))) if path else 0.0


@METRICS.register("compare_videos")
def compare_videos(
    video1: str | None, video2: str | None, max_frames_to_check: int = 100, threshold: int = 5
) -> float:
    """1 iff the videos end together within the first frames checked and at most ``threshold``
    frame pairs differ by more than ``threshold`` in perceptual hash.
    """  # noqa: D205
    import cv2
    import imagehash
    from PIL import Image

    if not video1 or not video2:
        return 0.0
    cap1, cap2 = cv2.VideoCapture(video1), cv2.VideoCapture(video2)
    try:
        mismatches = 0
        for _ in range(max_frames_to_check):
            ok1, f1 = cap1.read()
            ok2, f2 = cap2.read()
            if not ok1 or not ok2:
                return float(ok1 == ok2)
            h1 = imagehash.phash(Image.fromarray(cv2.cvtColor(f1, cv2.COLOR_BGR2RGB)))
            h2 = imagehash.phash(Image.fromarray(cv2.cvtColor(f2, cv2.COLOR_BGR2RGB)))
            if h1 - h2 > threshold:
                mismatches += 1
                if mismatches > threshold:
                    return 0.0
        return 1.0
    finally:
        cap1.release()
        cap2.release()


@METRICS.register("check_mp3_meta")
def check_mp3_meta(mp3: str | None, meta: Mapping[str, Any]) -> float:
    """1 iff each ID3 tag of ``meta`` (joined with commas when multi-valued) matches its rule."""
    from mutagen.easyid3 import EasyID3

    if mp3 is None:
        return 0.0
    tags = EasyID3(mp3)
    ok = True
    for key, rule in meta.items():
        value = tags.get(key, "")
        ok = ok and match_value_to_rule(",".join(value) if isinstance(value, list) else value, rule)
    return float(ok)
