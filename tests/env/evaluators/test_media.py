"""VLC, audio and video metrics (upstream ``metrics/vlc.py``, ``check_mp3_meta``)."""

import wave

import numpy as np
import pytest

from osworld_jax.env.evaluators import METRICS


def m(name):
    return METRICS.get(name)


def status(state="playing", meta=(("filename", "Desktop/song.mp3"),), streams=()):
    infos = "".join(f'<info name="{k}">{v}</info>' for k, v in meta)
    stream = "".join(f'<info name="{k}">{v}</info>' for k, v in streams)
    return (
        f"<root><state>{state}</state><information>"
        f'<category name="meta">{infos}</category>'
        f'<category name="Stream 0">{stream}</category></information></root>'
    )


def test_is_vlc_playing(src):
    f = m("is_vlc_playing")
    playing = src.text("s.xml", status(meta=(("filename", "/home/user/Music/song.mp3"),)))
    assert f(playing, {"type": "file_name", "file_name": "song.mp3"}) == 1.0
    assert f(playing, {"type": "file_name", "file_name": "other.mp3"}) == 0.0
    paused = src.text("p.xml", status(state="paused"))
    assert f(paused, {"type": "file_name", "file_name": "song.mp3"}) == 0.0
    url = "https://media.example.org/live/stream.m3u8"
    hls = src.text("u.xml", status(meta=(("title", "stream.m3u8"),)))
    assert f(hls, {"type": "url", "url": url}) == 1.0  # VLC shows just the file name
    other = src.text("o.xml", status(meta=(("url", "https://media.example.org/vod/x.m3u8"),)))
    assert f(other, {"type": "url", "url": url}) == 0.0
    assert f(None, {"type": "url", "url": url}) == 0.0


VLCRC = """\
# VLC media player preferences
[qt] # Qt interface
#qt-bgcone=1
qt-bgcone=0
qt-max-volume=200
#qt-minimal-view=0
qt-slider-colours=10;20;30;40;50;60;0;0;0;1;2;3
[core]
input-record-path=/home/user/Desktop
global-key-play-pause=Space
#one-instance-when-started-from-file=1
play-and-exit=1
"""


def test_vlcrc_settings(src):
    rc = src.text("vlcrc", VLCRC)
    empty = src.text("empty", "# nothing set\n")
    cases = [
        ("check_qt_bgcone", "expected_qt_bgcone", 0, 1),
        ("check_qt_max_volume", "expected_qt_max_volume", 200, 125),
        ("check_qt_minimal_view", "expected_qt_minimal_view", 0, 0),
        (
            "check_one_instance_when_started_from_file",
            "expected_one_instance_when_started_from_file",
            1,
            1,
        ),
        ("check_play_and_exit", "expected_play_and_exit", 1, 0),
        ("check_global_key_play_pause", "expected_global_key_play_pause", 1, 0),
    ]
    for name, key, value, default in cases:
        f = m(name)
        assert f(rc, {key: value}) == 1.0, name
        assert f(rc, {key: value + 1}) == 0.0, name
        assert f(empty, {key: default}) == 1.0, name  # VLC's default when the key is absent
    rec = m("is_vlc_recordings_folder")
    assert rec(rc, {"recording_file_path": "/home/user/Desktop"}) == 1.0
    assert rec(rc, {"recording_file_path": "/home/user/Videos"}) == 0.0
    assert rec(empty, {"recording_file_path": "/home/user/Desktop"}) == 0.0
    sl = m("check_qt_slider_colours")
    assert sl(rc, {"type": "blackish"}) == 1.0
    assert sl(empty, {"type": "blackish"}) == 0.0  # the default colours are not
    assert (
        sl(rc, {"type": "match", "expected_qt_slider_colours": "10;20;30;40;50;60;0;0;0;1;2;3"})
        == 1.0
    )


def test_is_vlc_fullscreen():
    f = m("is_vlc_fullscreen")
    screen = {"width": 1920, "height": 1080}
    assert f({"width": 1920, "height": 1080}, screen) == 1.0
    assert f({"width": 1280, "height": 720}, screen) == 0.0
    assert f(None, screen) == 0.0


def _wav(path, freqs, seconds=1.0, rate=22050):
    t = np.arange(int(seconds * rate)) / rate
    y = sum(np.sin(2 * np.pi * f * t) for f in freqs) / len(freqs)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((y * 20000).astype("<i2").tobytes())
    return str(path)


def test_compare_audios(tmp_path):
    f = m("compare_audios")
    a = _wav(tmp_path / "a.wav", [440, 660])
    same = _wav(tmp_path / "b.wav", [440, 660])
    other = _wav(tmp_path / "c.wav", [200, 3100, 5000])
    assert f(a, same) == pytest.approx(1.0)
    s = f(a, other)
    assert 0.0 < s < f(a, same)
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"not audio")
    assert f(str(broken), a) == 0.0
    assert f(str(broken), str(broken)) == 1.0  # both unreadable: upstream scores them alike
    assert f(None, a) == 0.0


def _video(path, shift):
    import cv2

    out = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 10, (64, 48))
    for i in range(12):
        frame = np.full((48, 64, 3), 255, np.uint8)
        x = (i * 3 + shift) % 40
        frame[10:30, x : x + 20] = (0, 0, 200)
        frame[35:45, 5:60] = (0, 150, 0) if shift == 0 else (150, 0, 150)
        out.write(frame)
    out.release()
    return str(path)


def test_compare_videos(tmp_path):
    f = m("compare_videos")
    a, b = _video(tmp_path / "a.avi", 0), _video(tmp_path / "b.avi", 0)
    assert f(a, b) == 1.0
    # a different picture in every frame: more than 5 frames differ by more than 5 hash bits
    assert f(a, _video(tmp_path / "c.avi", 20)) == 0.0
    assert f(None, b) == 0.0


def test_check_mp3_meta(tmp_path):
    from mutagen.easyid3 import EasyID3

    p = tmp_path / "song.mp3"
    tags = EasyID3()
    tags["title"] = "Baby"
    tags["artist"] = ["Justin Bieber", "Ludacris"]
    tags.save(str(p))
    f = m("check_mp3_meta")
    assert f(str(p), {"title": {"method": "eq", "ref": "Baby"}}) == 1.0
    assert f(str(p), {"artist": {"method": "eq", "ref": "Justin Bieber,Ludacris"}}) == 1.0
    assert f(str(p), {"title": {"method": "eq", "ref": "Baby!"}}) == 0.0
    assert f(str(p), {"album": {"method": "eq", "ref": ""}}) == 1.0  # a missing tag reads ""
    assert f(None, {"title": {"method": "eq", "ref": "Baby"}}) == 0.0
