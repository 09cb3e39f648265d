"""The file cache's fetcher against a local HTTP server on 127.0.0.1 (no internet here).

The server serves files under the tasks' own URL paths (``/datasets/xlangai/.../resolve/main/
<domain>/<task id>/<file>``); ``--mirror https://huggingface.co=http://127.0.0.1:PORT`` points
the fetcher at it while the cache keys stay the tasks' URLs. Failures (404, a body cut short, a
wrong checksum) must never leave a file in the cache; a cut body resumes with ``Range``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re

import pytest

from osworld_jax.env import cache
from osworld_jax.env.cache import fetch as fetch_mod
from osworld_jax.env.capabilities import REMOTE_FILE, capabilities
from osworld_jax.env.tasks import load_task, load_tasks

HF = "https://huggingface.co"
BASE = "/datasets/xlangai/ubuntu_osworld_file_cache/resolve/main"


def url(path: str) -> str:
    return f"{HF}{BASE}/{path}"


class FileServer:
    """A minimal HTTP/1.1 server with per-path behaviours, counting requests and ranges.

    ``files[path] = bytes``; ``etag[path]`` is sent as ``ETag``; ``cut[path] = n`` sends only
    the first ``n`` bytes of the body (announcing the full length) and closes the connection,
    once per entry in ``cut_times[path]`` (default: every time).
    """

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.etag: dict[str, str] = {}
        self.cut: dict[str, int] = {}
        self.cut_times: dict[str, int] = {}
        self.requests: list[tuple[str, str | None]] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> FileServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def mirror(self) -> tuple[tuple[str, str], ...]:
        return ((HF, f"http://127.0.0.1:{self.port}"),)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
        except asyncio.IncompleteReadError:
            writer.close()
            return
        path = head.split()[1].split("?")[0]
        m = re.search(r"(?im)^range: bytes=(\d+)-", head)
        start = int(m.group(1)) if m else 0
        self.requests.append((path, m.group(0) if m else None))
        body = self.files.get(path)
        if body is None:
            writer.write(
                b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot found"
            )
        else:
            status = "206 Partial Content" if m else "200 OK"
            chunk = body[start:]
            hdrs = [f"HTTP/1.1 {status}", f"Content-Length: {len(chunk)}", "Connection: close"]
            if m:
                hdrs.append(f"Content-Range: bytes {start}-{len(body) - 1}/{len(body)}")
            if path in self.etag:
                hdrs.append(f'ETag: "{self.etag[path]}"')
            writer.write(("\r\n".join(hdrs) + "\r\n\r\n").encode())
            times = self.cut_times.get(path)
            if path in self.cut and (times is None or times > 0):
                if times is not None:
                    self.cut_times[path] = times - 1
                writer.write(chunk[: max(0, self.cut[path] - start)])
            else:
                writer.write(chunk)
        await writer.drain()
        writer.close()


def _config(server: FileServer, **kw) -> cache.FetchConfig:
    return cache.FetchConfig(
        mirrors=server.mirror, progress=False, jobs=4, retry_delay_s=0.01, **kw
    )


def test_fetch_verifies_checksums_and_publishes_atomically(tmp_path):
    good = b"gold workbook bytes" * 100
    files = {
        "calc/t1/gold.xlsx": good,
        "calc/t1/in.xlsx": b"input",
        "calc/t2/tagged.bin": b"tagged",
        "calc/t2/badtag.bin": b"tampered",
    }

    async def main():
        async with FileServer() as srv:
            for p, data in files.items():
                srv.files[f"{BASE}/{p}"] = data
            srv.etag[f"{BASE}/calc/t2/tagged.bin"] = hashlib.sha256(b"tagged").hexdigest()
            srv.etag[f"{BASE}/calc/t2/badtag.bin"] = hashlib.sha256(b"original").hexdigest()
            urls = [url(p) for p in files] + [url("calc/t3/missing.xlsx")]
            expected = {url("calc/t1/in.xlsx"): hashlib.sha256(b"input").hexdigest()}
            r1 = await cache.fetch_urls(urls, tmp_path, _config(srv, expected_sha256=expected))
            r2 = await cache.fetch_urls(urls, tmp_path, _config(srv))
            return r1, r2, srv.requests

    r1, r2, requests = asyncio.run(main())
    assert sorted(r1.fetched) == sorted(
        url(p) for p in ("calc/t1/gold.xlsx", "calc/t1/in.xlsx", "calc/t2/tagged.bin")
    )
    assert set(r1.failed) == {url("calc/t2/badtag.bin"), url("calc/t3/missing.xlsx")}
    assert "does not match" in r1.failed[url("calc/t2/badtag.bin")]
    assert "HTTP 404" in r1.failed[url("calc/t3/missing.xlsx")]
    # fetched files resolve by their task URL; failures leave nothing, not even a .part
    assert cache.resolve(url("calc/t1/gold.xlsx"), tmp_path).read_bytes() == good
    assert cache.resolve(url("calc/t2/badtag.bin"), tmp_path) is None
    assert not list(tmp_path.glob("*.part"))
    manifest = json.loads((tmp_path / cache.MANIFEST).read_text())
    assert manifest[url("calc/t1/gold.xlsx")]["sha256"] == hashlib.sha256(good).hexdigest()
    # the second run downloads only what is still missing
    assert r2.fetched == [] and len(r2.present) == 3 and len(r2.failed) == 2
    assert sum(1 for p, _ in requests if p.endswith("gold.xlsx")) == 1


def test_expected_sha256_mismatch_is_rejected(tmp_path):
    async def main():
        async with FileServer() as srv:
            srv.files[f"{BASE}/a/b/f.txt"] = b"served"
            wrong = {url("a/b/f.txt"): hashlib.sha256(b"pinned").hexdigest()}
            return await cache.fetch_urls(
                [url("a/b/f.txt")], tmp_path, _config(srv, expected_sha256=wrong)
            )

    r = asyncio.run(main())
    assert url("a/b/f.txt") in r.failed and cache.resolve(url("a/b/f.txt"), tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_a_truncated_body_is_never_published_and_resumes_with_range(tmp_path):
    body = bytes(range(256)) * 40  # 10240 bytes
    path = f"{BASE}/vlc/t/video.bin"

    async def main():
        async with FileServer() as srv:
            srv.files[path] = body
            srv.cut[path] = 4000  # every reply stops after byte 4000
            r1 = await cache.fetch_urls(
                [url("vlc/t/video.bin")], tmp_path, _config(srv, attempts=2)
            )
            part_size = (
                (tmp_path / f"{cache.cache_keys(url('vlc/t/video.bin'))[0]}.part").stat().st_size
            )
            del srv.cut[path]
            r2 = await cache.fetch_urls([url("vlc/t/video.bin")], tmp_path, _config(srv))
            return r1, part_size, r2, srv.requests

    r1, part_size, r2, requests = asyncio.run(main())
    assert (
        "truncated" in r1.failed[url("vlc/t/video.bin")]
        and "resume" in r1.failed[url("vlc/t/video.bin")]
    )
    assert part_size == 4000  # the second try resumed at 4000 and was cut again right there
    assert requests[1] == (path, "Range: bytes=4000-")
    assert r2.fetched == [url("vlc/t/video.bin")]
    assert requests[-1] == (path, "Range: bytes=4000-")
    assert cache.resolve(url("vlc/t/video.bin"), tmp_path).read_bytes() == body


def _write_task(root, domain, tid, evaluator, config=()):
    d = root / domain
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{tid}.json").write_text(
        json.dumps({"id": tid, "instruction": "x", "config": list(config), "evaluator": evaluator})
    )


def test_cli_fetch_then_status_and_capabilities_count_the_files_present(tmp_path, capsys):
    tasks_dir, cache_dir = tmp_path / "examples", tmp_path / "cache"
    gold, inp = url("libreoffice_calc/c1/gold.xlsx"), url("libreoffice_calc/c1/in.xlsx")
    result = {"type": "vm_file", "path": "/home/user/in.xlsx", "dest": "in.xlsx"}
    download = {
        "type": "download",
        "parameters": {"files": [{"url": inp, "path": "/home/user/in.xlsx"}]},
    }
    _write_task(
        tasks_dir,
        "libreoffice_calc",
        "c1",
        {
            "func": "compare_table",
            "result": result,
            "expected": {"type": "cloud_file", "path": gold, "dest": "gold.xlsx"},
            "options": {"rules": [{"type": "sheet_name"}]},
        },
        config=[download],
    )
    _write_task(
        tasks_dir,
        "chrome",
        "h1",
        {"func": "infeasible"},
        config=[{"type": "update_browse_history", "parameters": {"history": []}}],
    )
    (task,) = [t for t in load_tasks(tasks_dir) if t.id == "c1"]
    assert cache.remote_files(task) == [inp, gold]
    assert cache.HISTORY_EMPTY_URL in cache.remote_files(
        load_task(tasks_dir / "chrome" / "h1.json")
    )
    before = capabilities(task, "memory", cache_dir=cache_dir)
    assert {r.detail for r in before.reasons if r.kind == REMOTE_FILE} == {inp, gold}

    async def serve_and_fetch():
        async with FileServer() as srv:
            srv.files[f"{BASE}/libreoffice_calc/c1/gold.xlsx"] = b"G"
            srv.files[f"{BASE}/libreoffice_calc/c1/in.xlsx"] = b"I"
            srv.files[
                f"{BASE}/chrome/44ee5668-ecd5-4366-a6ce-c1c9b8d4e938/history_empty.sqlite"
            ] = b"H"
            argv = [
                "fetch",
                str(tasks_dir),
                "--cache-dir",
                str(cache_dir),
                "--no-progress",
                "--mirror",
                f"{HF}=http://127.0.0.1:{srv.port}",
            ]
            return await asyncio.to_thread(cache.main, argv)

    assert asyncio.run(serve_and_fetch()) == 0
    assert "fetched 3, already present 0, failed 0" in capsys.readouterr().out
    assert capabilities(task, "memory", cache_dir=cache_dir)  # the files now count as present
    assert cache.main(["status", str(tasks_dir), "--cache-dir", str(cache_dir), "--verify"]) == 0
    assert "3/3 remote files present" in capsys.readouterr().out
    # a cached file altered after the fact is found by --verify
    cache.resolve(gold, cache_dir).write_bytes(b"changed")
    assert cache.main(["status", str(tasks_dir), "--cache-dir", str(cache_dir), "--verify"]) == 1
    assert "corrupt" in capsys.readouterr().out
    assert cache.main(["fetch", str(tasks_dir), "--mirror", "nonsense"]) == 2


def test_status_counts_partial_downloads(tmp_path):
    tasks_dir = tmp_path / "examples"
    u = url("os/o1/f.txt")
    _write_task(
        tasks_dir,
        "os",
        "o1",
        {
            "func": "exact_match",
            "result": {"type": "cloud_file", "path": u, "dest": "f"},
            "expected": {"type": "rule", "rules": {"expected": ""}},
        },
    )
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / f"{cache.cache_keys(u)[0]}.part").write_bytes(b"half")
    st = cache.cache_status(load_tasks(tasks_dir), tmp_path / "c")
    assert (st.needed, st.present, st.partial, st.tasks_complete, st.tasks_total) == (1, 0, 1, 0, 1)


@pytest.mark.parametrize(
    "headers,want",
    [
        ({"X-Linked-ETag": '"' + "a" * 64 + '"'}, "a" * 64),
        ({"ETag": 'W/"' + "B" * 64 + '"'}, "b" * 64),
        ({"ETag": '"' + "c" * 40 + '"'}, None),  # a git blob sha1, not a content digest
        ({}, None),
    ],
)
def test_server_sha256_headers(headers, want):
    assert fetch_mod._server_sha256(headers) == want


def test_assume_cached_and_the_apps_column_of_the_report(tmp_path):
    from osworld_jax.env.capabilities import main as env_main
    from osworld_jax.env.capabilities import report

    tasks_dir = tmp_path / "examples"
    u = url("os/o1/f.txt")
    rule = {"type": "rule", "rules": {"expected": ""}}
    # o1 needs only a remote file; o2 only a program nobody has; o3 both
    _write_task(
        tasks_dir,
        "os",
        "o1",
        {
            "func": "exact_match",
            "result": {"type": "cloud_file", "path": u, "dest": "f"},
            "expected": rule,
        },
    )
    missing_app = [{"type": "launch", "parameters": {"command": ["no-such-program-xyz"]}}]
    _write_task(tasks_dir, "os", "o2", {"func": "infeasible"}, config=missing_app)
    _write_task(
        tasks_dir,
        "os",
        "o3",
        {
            "func": "exact_match",
            "result": {"type": "cloud_file", "path": u, "dest": "f"},
            "expected": rule,
        },
        config=missing_app,
    )
    (o1,) = [t for t in load_tasks(tasks_dir) if t.id == "o1"]
    empty = tmp_path / "empty-cache"
    assert not capabilities(o1, "local", cache_dir=empty)
    assert capabilities(o1, "local", cache_dir=empty, assume_cached=True)
    plain = report(tasks_dir, "local", cache_dir=empty)
    assert "runnable=0" in plain and "+apps=1" in plain  # o2 waits for a program only
    cached = report(tasks_dir, "local", cache_dir=empty, assume_cached=True)
    assert "runnable=1" in cached and "+apps=2" in cached and "assumed cached" in cached
    assert "     2  no-such-program-xyz" in cached  # the programs the +apps tasks wait for
    argv = ["runnable", str(tasks_dir), "--cache-dir", str(empty), "--assume-cached"]
    assert env_main(argv) == 0
