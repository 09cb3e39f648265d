"""Issue 33 items 10-13 and 15: the task-file cache stays inside its directory.

Each test replays one attack of the second hardening round against a local HTTP server on
127.0.0.1 (its loops are bounded: at most a few thousand chunks, and they stop when the client
goes away): keys that named host files, an endless body, symlinks planted in the cache
directory, two fetches of the same file at once, and a ``--manifest`` that is not JSON.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import pytest

from osworld_jax.env import cache

HF = "https://huggingface.co"
BASE = "/datasets/xlangai/ubuntu_osworld_file_cache/resolve/main"


def url(path: str) -> str:
    return f"{HF}{BASE}/{path}"


class SlowServer:
    """Serves ``body`` for every path, ``chunk`` bytes every ``every_s`` seconds (chunked encoding
    when ``length`` is None, else announcing ``length``); ``endless`` repeats it (up to 5000
    chunks). Counts the requests."""

    def __init__(self, body: bytes, *, chunk: int, every_s: float, endless: bool = False,
                 length: int | None = None) -> None:  # fmt: skip
        self.body, self.chunk, self.every_s = body, chunk, every_s
        self.endless, self.length = endless, length
        self.requests = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> SlowServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    @property
    def mirror(self) -> tuple[tuple[str, str], ...]:
        return ((HF, f"http://127.0.0.1:{self.port}"),)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            self.requests += 1
            length = self.length
            framing = f"Content-Length: {length}" if length else "Transfer-Encoding: chunked"
            writer.write(f"HTTP/1.1 200 OK\r\n{framing}\r\nConnection: close\r\n\r\n".encode())
            pieces = [self.body[i : i + self.chunk] for i in range(0, len(self.body), self.chunk)]
            for n in range(5000 if self.endless else len(pieces)):
                piece = pieces[n % len(pieces)]
                writer.write(piece if length else b"%x\r\n%b\r\n" % (len(piece), piece))
                await writer.drain()
                await asyncio.sleep(self.every_s)
            if not length:
                writer.write(b"0\r\n\r\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def _config(server: SlowServer, **kw) -> cache.FetchConfig:
    kw.setdefault("attempts", 1)
    return cache.FetchConfig(mirrors=server.mirror, progress=False, retry_delay_s=0.01, **kw)


# --------------------------------------------------------------------------- item 10


@pytest.fixture
def host(tmp_path):
    """A cache directory three levels down and a root-only "host" file outside it."""
    secret = tmp_path / "secret.txt"
    secret.write_text("root only")
    secret.chmod(0o600)
    root = tmp_path / "a" / "b" / "cache"
    root.mkdir(parents=True)
    return root, secret


def test_a_resolve_url_naming_a_host_path_stays_in_the_cache(host):
    root, secret = host
    attack = f"{HF}{BASE}/{secret}"  # ".../resolve/main//tmp/.../secret.txt": an absolute key
    assert "//" in attack
    assert cache.resolve(attack, root) is None  # was: the host file
    assert all(not k.startswith("/") for k in cache.cache_keys(attack))
    # the same key normalised is looked up inside the cache
    inside = root / str(secret).lstrip("/")
    inside.parent.mkdir(parents=True)
    inside.write_text("cached copy")
    assert cache.resolve(attack, root) == inside
    assert cache.resolve(url("x/../../../../secret.txt"), root) is None  # '..' gives no key


@pytest.mark.parametrize("task_id", ["../../..", "..", "ok/../../..", "<abs>"])
def test_a_task_id_cannot_lead_a_key_out_of_the_cache(host, task_id):
    root, secret = host
    task_id = str(secret.parent) if task_id == "<abs>" else task_id
    attack = f"https://example.com/files/{secret.name}"
    assert cache.resolve(attack, root, task_id) is None  # was: the host file for 2 of them
    (root / secret.name).write_text("cached")  # the basename key still works, inside
    assert cache.resolve(attack, root, task_id) == root / secret.name


def test_a_bundled_relative_path_stays_beside_its_task_file(host):
    root, secret = host  # a bundled task's asset path "../../../secret.txt" from base_dir
    assert cache.resolve("../../../secret.txt", None, "t", base_dir=root) is None
    (root / "assets").mkdir()
    (root / "assets" / "in.txt").write_text("asset")
    assert cache.resolve("assets/./in.txt", None, "t", base_dir=root) == root / "assets" / "in.txt"


def test_fetch_does_not_count_a_host_file_as_present(host):
    root, secret = host

    async def main():
        async with SlowServer(b"served", chunk=6, every_s=0) as srv:
            return await cache.fetch_urls([f"{HF}{BASE}/{secret}"], root, _config(srv))

    r = asyncio.run(main())
    assert r.present == [] and r.fetched == [f"{HF}{BASE}/{secret}"]  # was: "already present"
    assert cache.resolve(f"{HF}{BASE}/{secret}", root).read_bytes() == b"served"
    assert secret.read_text() == "root only"


# --------------------------------------------------------------------------- item 11


def test_an_endless_body_stops_at_the_size_cap(tmp_path):
    async def main():
        async with SlowServer(b"x" * 65536, chunk=65536, every_s=0, endless=True) as srv:
            t0 = time.monotonic()
            r = await cache.fetch_urls(
                [url("a/endless.bin")], tmp_path, _config(srv, max_bytes=1 << 20)
            )
            return r, time.monotonic() - t0

    r, took = asyncio.run(main())
    assert "exceeds the 1048576 bytes allowed" in r.failed[url("a/endless.bin")]
    assert took < 10 and list(tmp_path.iterdir()) == []  # was: 150 MB after 8 s, growing


def test_an_announced_length_over_the_expected_size_is_refused_before_reading(tmp_path):
    u = url("a/big.bin")

    async def main():
        async with SlowServer(b"y" * 1000, chunk=1000, every_s=0, length=1000) as srv:
            return await cache.fetch_urls([u], tmp_path, _config(srv, expected_size={u: 10}))

    r = asyncio.run(main())
    assert "1000 bytes announced, more than the 10 allowed" in r.failed[u]
    assert list(tmp_path.iterdir()) == []


def test_a_trickling_body_fails_at_the_deadline(tmp_path):
    async def main():
        async with SlowServer(b"z" * 10, chunk=10, every_s=0.05, endless=True) as srv:
            t0 = time.monotonic()
            r = await cache.fetch_urls([url("a/slow.bin")], tmp_path, _config(srv, deadline_s=1))
            return r, time.monotonic() - t0

    r, took = asyncio.run(main())
    assert "not complete after 1 s (deadline_s)" in r.failed[url("a/slow.bin")]
    assert 0.9 < took < 5  # each chunk came within the per-read timeout: only the deadline ends it


# --------------------------------------------------------------------------- item 12


def test_a_symlink_planted_at_the_part_file_is_not_written_through(tmp_path):
    root, victim = tmp_path / "cache", tmp_path / "victim.conf"
    root.mkdir()
    victim.write_text("precious")
    u = url("a/f.bin")
    (root / f"{cache.cache_keys(u)[0]}.part").symlink_to(victim)

    async def main():
        async with SlowServer(b"payload", chunk=7, every_s=0) as srv:
            return await cache.fetch_urls([u], root, _config(srv))

    r = asyncio.run(main())
    assert "a symlink; not written through" in r.failed[u]
    assert victim.read_text() == "precious"  # was: overwritten with the body (as root)


def test_a_symlink_planted_at_the_manifest_temp_file_is_not_written_through(tmp_path):
    root, victim = tmp_path / "cache", tmp_path / "victim.conf"
    root.mkdir()
    victim.write_text("precious")
    (root / ".MANIFEST.json.tmp").symlink_to(victim)

    async def main():
        async with SlowServer(b"payload", chunk=7, every_s=0) as srv:
            return await cache.fetch_urls([url("a/f.bin")], root, _config(srv))

    assert asyncio.run(main()).fetched == [url("a/f.bin")]
    assert victim.read_text() == "precious"  # was: the manifest written into it
    manifest = json.loads((root / cache.MANIFEST).read_text())
    assert manifest[url("a/f.bin")]["sha256"] == hashlib.sha256(b"payload").hexdigest()
    assert not (root / cache.MANIFEST).is_symlink()


# --------------------------------------------------------------------------- item 13


def test_two_fetches_of_one_file_at_once_publish_it_once_with_its_true_sha(tmp_path):
    body = bytes(range(256)) * 64  # 16 KiB in 32 chunks of 512 bytes, 10 ms apart

    async def main():
        async with SlowServer(body, chunk=512, every_s=0.01, length=len(body)) as srv:
            first = cache.fetch_urls([url("a/f.bin")], tmp_path, _config(srv))
            second = cache.fetch_urls([url("a/f.bin")], tmp_path, _config(srv))
            return await asyncio.gather(first, second), srv.requests

    (r1, r2), requests = asyncio.run(main())  # was: FileNotFoundError, a wrong SHA published
    assert sorted(r1.fetched + r2.fetched + r1.present + r2.present) == [url("a/f.bin")] * 2
    assert len(r1.fetched + r2.fetched) == 1 and requests == 1 and not (r1.failed or r2.failed)
    manifest = json.loads((tmp_path / cache.MANIFEST).read_text())
    assert manifest[url("a/f.bin")]["sha256"] == hashlib.sha256(body).hexdigest()
    assert cache.resolve(url("a/f.bin"), tmp_path).read_bytes() == body
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [cache.MANIFEST, cache.cache_keys(url("a/f.bin"))[0]]
    )  # no lock, temp or partial file left


# --------------------------------------------------------------------------- item 15


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"u": "abc"}', "not a SHA-256"),
        ('{"u": {"sha256": "' + "a" * 64 + '", "size": "9"}}', "size must be a whole number"),
        (b"\xff\xfe", "not JSON"),
    ],
)
def test_a_bad_manifest_option_is_one_line(tmp_path, capsys, text, why):
    tasks = tmp_path / "examples"
    tasks.mkdir()
    bad = tmp_path / "m.json"
    bad.write_bytes(text if isinstance(text, bytes) else text.encode())
    argv = ["fetch", str(tasks), "--cache-dir", str(tmp_path / "c"), "--manifest", str(bad)]
    assert cache.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --manifest {bad}: "), err
    assert why in err
    assert cache.main([*argv[:-1], str(tmp_path / "absent.json")]) == 2
    assert "No such file" in capsys.readouterr().err
